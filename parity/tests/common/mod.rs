//! Helpers shared by the binary's test files.
#![allow(dead_code)]

pub mod gguf;
pub mod vl;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs `qwen35 args` with extra environment variables.
pub fn qwen35_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_qwen35"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("the binary runs")
}

/// Runs `qwen35 args`.
pub fn qwen35(args: &[&str]) -> Output {
    qwen35_env(args, &[])
}

/// The bundled test data.
pub fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

/// The command's standard error as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs `args` expecting exit code 2 and an error mentioning every `needle`, never a panic.
pub fn expect_error_env(args: &[&str], env: &[(&str, &str)], needles: &[&str]) {
    let o = qwen35_env(args, env);
    let err = stderr(&o);
    assert_eq!(
        o.status.code(),
        Some(2),
        "{args:?} should fail with exit code 2; stderr: {err}"
    );
    for n in needles {
        assert!(
            err.contains(n),
            "{args:?}: the error does not mention `{n}`:\n{err}"
        );
    }
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
}

/// [`expect_error_env`] without extra environment.
pub fn expect_error(args: &[&str], needles: &[&str]) {
    expect_error_env(args, &[], needles)
}

/// `--token-ids` text for an i64 id tensor.
pub fn ids_arg(t: &candle_core::Tensor) -> String {
    t.to_vec1::<i64>()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// How close one dump must be to another.
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    /// Logits: absolute.
    pub logits_atol: f64,
    /// Every other float tensor: relative to its max and, for tensors with heads, to each head's (or row's) own max
    /// (see `reference::compare::slicing`).
    pub rtol: f64,
    /// The precision the per-head floor is taken from, when the data was computed coarser than it is stored (an fp16
    /// device's f32 dump); `None`: the dtypes'.
    pub epsilon: Option<f64>,
}

/// An f32 run against another f32 run (or transformers' f32 goldens): logits within 1e-3 absolute, every tensor and
/// head within 1e-4 of its max.
pub const F32: Tolerance = Tolerance {
    logits_atol: 1e-3,
    rtol: 1e-4,
    epsilon: None,
};

/// The worst figure per tensor family over the tensors checked, for the test output.
pub type Worst = reference::compare::WorstByFamily;

/// Checks every tensor of `expected` against the same tensor of `actual`: ids exactly, logits and every other tensor
/// (per head where it has heads) within `tol`. Panics with a labelled report on the first failure.
pub fn check_dump(
    label: &str,
    actual: &parity::dump::Dump,
    expected: &parity::dump::Dump,
    config: &reference::config::Config,
    tol: Tolerance,
) -> Worst {
    use reference::compare::{diff, diff_sliced};
    let mut worst = Worst::default();
    for (name, e) in &expected.tensors {
        let a = actual
            .get(name)
            .unwrap_or_else(|err| panic!("{label}: {err}"));
        assert_eq!(a.dims(), e.dims(), "{label} {name}: shape");
        let whole = diff(a, e).unwrap_or_else(|err| panic!("{label} {name}: {err}"));
        match name.as_str() {
            "token_ids" | "generated" => {
                assert_eq!(whole.max_abs, 0.0, "{label} {name}: {whole}");
                continue;
            }
            "logits" => {
                assert!(
                    whole.within(tol.logits_atol, 0.0),
                    "{label} {name}: {whole}"
                );
                worst.record(name, whole.max_abs, name, "abs");
                continue;
            }
            _ => {}
        }
        assert!(whole.within(0.0, tol.rtol), "{label} {name}: {whole}");
        match diff_sliced(name, a, e, config).unwrap_or_else(|err| panic!("{label} {name}: {err}"))
        {
            Some(s) => {
                let s = match tol.epsilon {
                    Some(eps) => s.with_epsilon(eps),
                    None => s,
                };
                assert!(
                    s.within(tol.rtol),
                    "{label} {name}: {s} (tolerance {:.2e} of each {}'s max)",
                    tol.rtol,
                    s.what
                );
                let at = format!("{name} {} {}", s.what, s.worst().unwrap_or(0));
                worst.record(name, s.relative(), &at, s.what);
            }
            None => worst.record(name, whole.relative(), name, "tensor"),
        }
    }
    worst
}

/// The config of a bundled test model.
pub fn config(model: &str) -> reference::config::Config {
    reference::config::Config::from_file(&testdata().join("models").join(model).join("config.json"))
        .unwrap()
}

/// The golden prompt of a bundled model, as `--token-ids` text.
pub fn golden_ids(model: &str) -> String {
    let g =
        parity::dump::Dump::read(&testdata().join(format!("goldens/{model}.safetensors"))).unwrap();
    ids_arg(&g.tensors["token_ids"])
}

/// `qwen35 dump` of the tiny model on `ids` with `args`, read back.
pub fn dump(
    dir: &Path,
    file: &str,
    ids: &str,
    generate: usize,
    args: &[&str],
) -> parity::dump::Dump {
    let out = dir.join(file);
    let model = testdata().join("models/tiny");
    let generate = generate.to_string();
    let mut all = vec![
        "dump",
        "--model",
        model.to_str().unwrap(),
        "--token-ids",
        ids,
        "--generate",
        &generate,
        "--out",
        out.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let o = qwen35_env(&all, &[]);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    parity::dump::Dump::read(&out).unwrap()
}

/// Writes `dir/two.jsonl`, two short prompts (a chat message and token ids) for quick runs, and returns its path.
pub fn two_prompts(dir: &Path) -> PathBuf {
    let prompts = dir.join("two.jsonl");
    std::fs::write(
        &prompts,
        "{\"label\": \"river\", \"prompt\": \"Why does the river rise in spring?\"}\n\
         {\"label\": \"ids\", \"token_ids\": [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, \
         188, 199, 211]}\n",
    )
    .unwrap();
    prompts
}

/// validate's small settings on the CPU device: [`two_prompts`] written into `dir`, 4 tokens, a context of 128,
/// 12 lookup tokens, blocks of 1 and 16.
pub fn small_validate_args(dir: &Path) -> Vec<String> {
    let prompts = two_prompts(dir);
    [
        "--device",
        "CPU",
        "--context",
        "128",
        "--tokens",
        "4",
        "--lookup-tokens",
        "12",
        "--blocks",
        "1,16",
        "--prompts",
        prompts.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

/// Checks that every tensor of `a` equals `b`'s bit for bit, and so does the metadata but for the run's times and
/// the model directory.
pub fn same_dump(label: &str, a: &parity::dump::Dump, b: &parity::dump::Dump) {
    assert_eq!(
        a.tensors.keys().collect::<Vec<_>>(),
        b.tensors.keys().collect::<Vec<_>>(),
        "{label}: names"
    );
    for (name, x) in &a.tensors {
        let y = &b.tensors[name];
        assert_eq!(
            (x.dtype(), x.dims()),
            (y.dtype(), y.dims()),
            "{label} {name}"
        );
        let (x, y) = (
            x.to_dtype(candle_core::DType::F64).unwrap(),
            y.to_dtype(candle_core::DType::F64).unwrap(),
        );
        let (x, y) = (
            x.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
            y.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
        );
        assert!(
            x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "{label} {name}: values differ"
        );
    }
    let timeless = |d: &parity::dump::Dump| {
        let mut m = d.metadata.clone();
        m.retain(|k, _| !k.ends_with("_seconds") && k != "model");
        m
    };
    assert_eq!(timeless(a), timeless(b), "{label}: metadata");
}

/// A copy of the folder `src` in `dst`.
pub fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
}

/// The names in `dir`, sorted (hidden files included).
pub fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}
