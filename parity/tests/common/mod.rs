//! Helpers shared by the binary's test files.
#![allow(dead_code)]

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

/// The worst figure per tensor family (`layers.{i}.` dropped) over the tensors checked, for the test output.
#[derive(Default)]
pub struct Worst {
    /// Family → (figure, where, per what: `head`, `channel`, …, `tensor`, or `abs` for the logits).
    families: std::collections::BTreeMap<String, (f64, String, &'static str)>,
}

impl Worst {
    fn record(&mut self, name: &str, value: f64, at: String, per: &'static str) {
        let family = match name.strip_prefix("layers.") {
            Some(rest) => rest.split_once('.').map_or(rest, |(_, t)| t),
            None => name,
        };
        let entry = self
            .families
            .entry(family.to_string())
            .or_insert((0.0, String::new(), per));
        if value >= entry.0 {
            *entry = (value, at, per);
        }
    }

    /// The worst relative figure of any family but the logits.
    pub fn overall(&self) -> f64 {
        self.families
            .iter()
            .filter(|(f, _)| *f != "logits")
            .map(|(_, (v, _, _))| *v)
            .fold(0.0, f64::max)
    }

    /// One line per family.
    pub fn report(&self) -> String {
        self.families
            .iter()
            .map(|(family, (v, at, per))| match *per {
                "abs" => format!("  {family:<28} {v:.2e} abs"),
                _ => format!("  {family:<28} per {per} {v:.2e} of its max ({at})"),
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

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
                worst.record(name, whole.max_abs, name.clone(), "abs");
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
                worst.record(name, s.relative(), at, s.what);
            }
            None => worst.record(name, whole.relative(), name.clone(), "tensor"),
        }
    }
    worst
}

/// The config of a bundled test model.
pub fn config(model: &str) -> reference::config::Config {
    reference::config::Config::from_file(&testdata().join("models").join(model).join("config.json"))
        .unwrap()
}
