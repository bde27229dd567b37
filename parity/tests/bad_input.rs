//! The bad-input suite: one case per way a user (or a device) can hand the tool something wrong, each run against
//! the built binary and held to its exit code (2 an error, 1 a finding) and a word the message must hold, never a
//! panic. The fixtures (broken checkpoints, dumps, graph sets) are made once in a temporary folder; `{name}` in a
//! case's arguments stands for a fixture's path.

use candle_core::{DType, Tensor};
use parity::dump::Dump;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::testdata;

/// One case: what is run, and what must come of it.
struct Case {
    /// What the case is about (shown when it fails).
    what: &'static str,
    /// The arguments, `{fixture}` placeholders substituted.
    args: &'static str,
    /// Environment variables set for the run (`{fixture}` substituted too).
    env: &'static [(&'static str, &'static str)],
    /// The exit code expected.
    code: i32,
    /// Words the standard error (or output) must hold.
    needles: &'static [&'static str],
}

const U64_MAX: &str = "18446744073709551615";

/// The table. Arguments are split on spaces (no case needs a space inside one argument); `{long}` is a prompt of
/// 3000 token ids, past the tiny model's 2048 positions.
fn cases() -> Vec<Case> {
    let c = |what, args, code, needles| Case {
        what,
        args,
        env: &[],
        code,
        needles,
    };
    let e = |what, args, env, code, needles| Case {
        what,
        args,
        env,
        code,
        needles,
    };
    vec![
        // A device's faults, planted in dumps and checkpoints: findings (exit 1), named.
        c(
            "diff: scattered NaN logits",
            "diff {nan_logits} {clean}",
            1,
            &["logits", "NaN"],
        ),
        c(
            "diff: one NaN in an intermediate",
            "diff {nan_core} {clean}",
            1,
            &["layers.0.linear_attn.core_output", "position"],
        ),
        c(
            "diff: all-NaN logits",
            "diff {all_nan} {clean}",
            1,
            &["non-finite"],
        ),
        c(
            "diff: infinity in a state",
            "diff {inf_state} {clean}",
            1,
            &["layers.0.recurrent_state", "infinite"],
        ),
        c(
            "diff: the reference dump holds NaN",
            "diff {clean} {nan_core}",
            1,
            &["reference's side"],
        ),
        c(
            "run: a NaN norm weight",
            "run --model {nan_model} --prompt hi --max-tokens 4",
            1,
            &["NaN", "model.layers.1.input_layernorm.weight"],
        ),
        c(
            "ranges: a NaN norm weight",
            "ranges --model {nan_model} --prompt hi",
            1,
            &["first non-finite value", "layers.1."],
        ),
        c(
            "dump: a NaN norm weight (the file kept, exit 1)",
            "dump --model {nan_model} --prompt hi --generate 3 --out {tmp}/nan.safetensors",
            1,
            &[
                "NaN at generated token 0",
                "0 of the 3 tokens",
                "`layers.1.",
            ],
        ),
        c(
            "validate: a device whose logits turn NaN",
            "validate --device CPU --token-ids 1,2,3,4,5,6 --tokens 3 --inject-fault nan-from=4",
            1,
            &["NaN"],
        ),
        // Outputs that would overwrite an input or each other, or cannot be written: refused before work.
        c(
            "dump: --out onto the checkpoint it reads",
            "dump --model {model_copy} --token-ids 1 --out {model_copy}/model.safetensors",
            2,
            &["--out", "model.safetensors"],
        ),
        c(
            "diff: --json onto an input",
            "diff {clean} {clean} --json {clean}",
            2,
            &["--json", "clean.safetensors"],
        ),
        c(
            "diff: --json equal to --report",
            "diff {clean} {clean} --json {tmp}/r.txt --report {tmp}/r.txt",
            2,
            &["--json", "--report"],
        ),
        c(
            "validate: --json /proc/x",
            "validate --device CPU --json /proc/x/report.json",
            2,
            &["--json", "/proc/x"],
        ),
        c(
            "export-ir: --blocks 16,16",
            "export-ir --blocks 16,16 --out {tmp}/ir16",
            2,
            &["--blocks", "twice"],
        ),
        c(
            "export-ir: a block past --context",
            "export-ir --blocks 2000 --context 1024 --out {tmp}/ir2000",
            2,
            &["--blocks 2000", "--context"],
        ),
        c(
            "export-ir: --out not empty",
            "export-ir --out {tmp}",
            2,
            &["--out", "empty"],
        ),
        c(
            "synth: more than the disk holds",
            "synth --layers 100000 --out {tmp}/huge",
            2,
            &["--out", "free"],
        ),
        // Counts beyond what any run can hold: refused before work, naming the flag.
        c(
            "run: --max-tokens u64::MAX",
            "run --prompt hi --max-tokens {u64max}",
            2,
            &["--max-tokens", "max_position_embeddings"],
        ),
        c(
            "dump: --generate 10^12",
            "dump --token-ids 1,2 --generate 1000000000000 --out {tmp}/g.safetensors",
            2,
            &["--generate", "max_position_embeddings"],
        ),
        c(
            "compare-devices: --tokens u64::MAX",
            "compare-devices --tokens {u64max}",
            2,
            &["--tokens", "positions"],
        ),
        c(
            "validate: --tokens u64::MAX",
            "validate --device CPU --tokens {u64max}",
            2,
            &["--tokens", "positions"],
        ),
        c(
            "bench: --decode-tokens u64::MAX",
            "bench --decode-tokens {u64max} --no-machine",
            2,
            &["--decode-tokens", "positions"],
        ),
        c(
            "bench: --prompt-tokens u64::MAX",
            "bench --prompt-tokens {u64max} --no-machine",
            2,
            &["--prompt-tokens", "positions"],
        ),
        c(
            "dump: a prompt past max_position_embeddings",
            "dump --token-ids {long} --out {tmp}/l.safetensors",
            2,
            &["3000 prompt tokens", "2048"],
        ),
        c(
            "ranges: a prompt past max_position_embeddings",
            "ranges --token-ids {long}",
            2,
            &["3000 prompt tokens", "2048"],
        ),
        c(
            "compare-devices: a prompt past max_position_embeddings",
            "compare-devices --token-ids {long} --tokens 1",
            2,
            &["3000 prompt tokens", "2048"],
        ),
        c(
            "compare-devices: --block past --context",
            "compare-devices --block 2000 --tokens 1",
            2,
            &["--block 2000", "--context"],
        ),
        c(
            "dump: --block past --context",
            "dump --backend openvino --block 64 --context 32 --token-ids 1 --out {tmp}/b.safetensors",
            2,
            &["--block 64", "32"],
        ),
        // Loading.
        e(
            "OPENVINO_LIB: the C++ library",
            "devices",
            &[("OPENVINO_LIB", "{cpp_lib}")],
            2,
            &["OPENVINO_LIB", "C API", "libopenvino_c"],
        ),
        e(
            "OPENVINO_LIB: not a library",
            "devices",
            &[("OPENVINO_LIB", "{clean}")],
            2,
            &["OPENVINO_LIB", "cannot be loaded"],
        ),
        c(
            "index: a shard outside the model's folder",
            "dump --model {traversal} --token-ids 1 --out {tmp}/t.safetensors",
            2,
            &["model.safetensors.index.json", "../", "weight_map"],
        ),
        c(
            "index: weight_map not an object",
            "dump --model {no_weight_map} --token-ids 1 --out {tmp}/t.safetensors",
            2,
            &["model.safetensors.index.json", "`weight_map` is missing"],
        ),
        c(
            "diff: a generated id outside the vocabulary",
            "diff {big_id} {clean}",
            2,
            &["`generated`", "outside the vocabulary"],
        ),
        c(
            "diff: a prompt id outside the vocabulary",
            "diff {big_prompt_id} {clean}",
            2,
            &["`token_ids`", "outside the vocabulary"],
        ),
        c(
            "diff: a 2-D generated",
            "diff {gen_2d} {clean}",
            2,
            &["`generated`", "one axis"],
        ),
        c(
            "diff: 1-D logits",
            "diff {logits_1d} {clean}",
            2,
            &["`logits`", "[T, V]"],
        ),
        c(
            "config: max_position_embeddings missing",
            "dump --model {no_positions} --token-ids 1 --out {tmp}/p.safetensors",
            2,
            &["config.json", "max_position_embeddings", "missing"],
        ),
        // Conflicts, refused naming both sides.
        c(
            "--device-config precision against --precision",
            "dump --backend openvino --device-config {f16_config} --precision f32 --token-ids 1 --out {tmp}/c.safetensors",
            2,
            &["INFERENCE_PRECISION_HINT", "--precision"],
        ),
        c(
            "--device-config precision against the default",
            "dump --backend openvino --device-config {f16_config} --token-ids 1 --out {tmp}/c.safetensors",
            2,
            &["INFERENCE_PRECISION_HINT", "default --precision"],
        ),
        c(
            "FP16SIM: an option twice in the name",
            "compare-devices --device FP16SIM:store=f16,store=f32 --tokens 1",
            2,
            &["`store` given twice", "store=f16", "store=f32"],
        ),
        e(
            "FP16SIM: a config overriding the name",
            "compare-devices --device FP16SIM:store=f16 --tokens 1",
            &[("QWEN35_DEVICE_CONFIG", "{\"store\":\"f32\"}")],
            2,
            &["`store` given twice", "device config"],
        ),
        c(
            "--system with --token-ids",
            "dump --token-ids 1,2 --system hello --out {tmp}/s.safetensors",
            2,
            &["--system", "--token-ids"],
        ),
        c(
            "--think with --prompts",
            "compare-devices --prompts {prompts} --think",
            2,
            &["--think"],
        ),
        c(
            "--allow-precision bogus",
            "validate --device CPU --allow-precision bogus",
            2,
            &["--allow-precision bogus"],
        ),
        c(
            "manifest: version 99",
            "compare-devices --ir {version99} --tokens 1",
            2,
            &["manifest.json", "version", "99"],
        ),
        c(
            "manifest: v1 format, version 99",
            "compare-devices --ir {v1_version99} --tokens 1",
            2,
            &["version", "99"],
        ),
        c(
            "manifest: reference_weights int9",
            "compare-devices --ir {int9} --tokens 1",
            2,
            &["reference_weights", "int9"],
        ),
        c(
            "manifest: a model that does not exist",
            "compare-devices --ir {no_model} --tokens 1",
            2,
            &["`model`", "no config.json"],
        ),
        // Messages that name what is wrong.
        c(
            "--device empty",
            "validate --device ",
            2,
            &["no device named"],
        ),
        c(
            "--model a file",
            "dump --model {clean} --token-ids 1 --out {tmp}/m.safetensors",
            2,
            &["--model", "a file"],
        ),
        c(
            "--model a missing folder",
            "dump --model {tmp}/nowhere --token-ids 1 --out {tmp}/m.safetensors",
            2,
            &["--model", "no such directory"],
        ),
        e(
            "QWEN35_DEVICE_CONFIG: a missing path",
            "dump --backend openvino --token-ids 1 --out {tmp}/e.safetensors",
            &[("QWEN35_DEVICE_CONFIG", "{tmp}/no-such.json")],
            2,
            &["QWEN35_DEVICE_CONFIG", "JSON object", "path"],
        ),
        c(
            "ranges: --store bogus",
            "ranges --prompt hi --store f8",
            2,
            &["--store f8"],
        ),
        c(
            "diff: not a dump",
            "diff {config_file} {clean}",
            2,
            &["not a safetensors dump"],
        ),
        c(
            "diff: dumps of different prompts",
            "diff {other_prompt} {clean}",
            2,
            &["different prompts"],
        ),
        c(
            "a token id outside the vocabulary",
            "dump --token-ids 1,99999 --out {tmp}/v.safetensors",
            2,
            &["--token-ids", "99999"],
        ),
        c(
            "--inject-fault bogus",
            "validate --device CPU --inject-fault nan-from=x",
            2,
            &["--inject-fault", "nan-from=POSITION"],
        ),
        c("--block 0", "compare-devices --block 0", 2, &["--block"]),
        c(
            "--max-kl negative",
            "compare-devices --max-kl=-1",
            2,
            &["--max-kl"],
        ),
    ]
}

/// The fixtures every case may name, by placeholder.
struct Fixtures {
    _dir: tempfile::TempDir,
    paths: BTreeMap<&'static str, String>,
}

/// Runs the binary.
fn qwen35(args: &[String], env: &[(String, String)]) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_qwen35"));
    c.args(args)
        .env_remove("QWEN35_DEVICE_CONFIG")
        .env_remove("OPENVINO_LIB");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("the binary runs")
}

/// A copy of `d` with `edit` applied to its tensors, written to `path`.
fn edited(d: &Dump, path: &Path, edit: impl FnOnce(&mut BTreeMap<String, Tensor>)) {
    let mut tensors = d.tensors.clone();
    edit(&mut tensors);
    Dump {
        tensors,
        metadata: d.metadata.clone(),
    }
    .write(path)
    .unwrap();
}

/// `t` with `f` applied to its f32 values.
fn map_f32(t: &Tensor, f: impl FnOnce(&mut [f32])) -> Tensor {
    let mut v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    f(&mut v);
    Tensor::from_vec(v, t.dims(), t.device()).unwrap()
}

fn ids(v: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &candle_core::Device::Cpu).unwrap()
}

/// A copy of the folder `src` in `dst`.
fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
}

/// A copy of the tiny graph set whose manifest `edit` changes (its model made absolute, so the copy finds it).
fn edited_set(dst: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    copy_dir(&testdata().join("sets/tiny-decoder"), dst);
    let path = dst.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    m["model"] = testdata()
        .join("models/tiny")
        .canonicalize()
        .unwrap()
        .to_str()
        .unwrap()
        .into();
    edit(&mut m);
    std::fs::write(&path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
}

/// A change to a checkpoint's tensors.
type TensorEdit = Box<dyn FnOnce(&mut std::collections::HashMap<String, Tensor>)>;

/// A copy of the tiny model with `edit` applied to its config and (when given) its tensors.
fn edited_model(
    dst: &Path,
    config: impl FnOnce(&mut serde_json::Value),
    tensors: Option<TensorEdit>,
) {
    copy_dir(&testdata().join("models/tiny"), dst);
    let path = dst.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config(&mut c);
    std::fs::write(&path, c.to_string()).unwrap();
    if let Some(edit) = tensors {
        let file = dst.join("model.safetensors");
        let mut t = candle_core::safetensors::load(&file, &candle_core::Device::Cpu).unwrap();
        edit(&mut t);
        candle_core::safetensors::save(&t, &file).unwrap();
    }
}

fn fixtures() -> Fixtures {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let p = |name: &str| root.join(name);
    let mut paths: BTreeMap<&'static str, String> = BTreeMap::new();
    let mut put = |key: &'static str, path: PathBuf| {
        paths.insert(key, path.to_str().unwrap().to_string());
    };

    // A clean dump of the tiny model, and dumps planted with what a broken device (or program) writes.
    let clean = p("clean.safetensors");
    let o = Command::new(env!("CARGO_BIN_EXE_qwen35"))
        .args([
            "dump",
            "--token-ids",
            "11,22,33,44,55,66,77,88",
            "--generate",
            "3",
        ])
        .arg("--out")
        .arg(&clean)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let d = Dump::read(&clean).unwrap();
    put("clean", clean);
    let logits = |f: fn(&mut [f32])| {
        let t = map_f32(&d.tensors["logits"], f);
        move |m: &mut BTreeMap<String, Tensor>| {
            m.insert("logits".into(), t);
        }
    };
    edited(
        &d,
        &p("nan_logits.safetensors"),
        logits(|v| v.iter_mut().step_by(7).for_each(|x| *x = f32::NAN)),
    );
    put("nan_logits", p("nan_logits.safetensors"));
    edited(&d, &p("all_nan.safetensors"), logits(|v| v.fill(f32::NAN)));
    put("all_nan", p("all_nan.safetensors"));
    let core = "layers.0.linear_attn.core_output";
    edited(&d, &p("nan_core.safetensors"), |m| {
        let t = map_f32(&m[core], |v| v[v.len() / 2] = f32::NAN);
        m.insert(core.into(), t);
    });
    put("nan_core", p("nan_core.safetensors"));
    let state = "layers.0.recurrent_state";
    edited(&d, &p("inf_state.safetensors"), |m| {
        let t = map_f32(&m[state], |v| v[0] = f32::INFINITY);
        m.insert(state.into(), t);
    });
    put("inf_state", p("inf_state.safetensors"));
    edited(&d, &p("big_id.safetensors"), |m| {
        m.insert("generated".into(), ids(&[5, 1 << 40, 7], &[3]));
    });
    put("big_id", p("big_id.safetensors"));
    edited(&d, &p("big_prompt_id.safetensors"), |m| {
        m.insert(
            "token_ids".into(),
            ids(&[11, 22, 33, 44, 55, 66, 77, -1], &[8]),
        );
    });
    put("big_prompt_id", p("big_prompt_id.safetensors"));
    edited(&d, &p("gen_2d.safetensors"), |m| {
        m.insert("generated".into(), ids(&[5, 6, 7, 8], &[2, 2]));
    });
    put("gen_2d", p("gen_2d.safetensors"));
    edited(&d, &p("logits_1d.safetensors"), |m| {
        let t = m["logits"].flatten_all().unwrap();
        m.insert("logits".into(), t);
    });
    put("logits_1d", p("logits_1d.safetensors"));
    edited(&d, &p("other_prompt.safetensors"), |m| {
        m.insert(
            "token_ids".into(),
            ids(&[11, 22, 33, 44, 55, 66, 77, 89], &[8]),
        );
    });
    put("other_prompt", p("other_prompt.safetensors"));

    // Checkpoints.
    edited_model(
        &p("nan_model"),
        |_| {},
        Some(Box::new(|t| {
            let name = "model.layers.1.input_layernorm.weight";
            let w = map_f32(&t[name], |v| v[3] = f32::NAN);
            t.insert(name.into(), w);
        })),
    );
    put("nan_model", p("nan_model"));
    edited_model(
        &p("no_positions"),
        |c| {
            c.as_object_mut().unwrap().remove("max_position_embeddings");
        },
        None,
    );
    put("no_positions", p("no_positions"));
    for (key, map) in [
        (
            "traversal",
            serde_json::json!({"model.embed_tokens.weight": "../../../etc/passwd"}),
        ),
        ("no_weight_map", serde_json::json!(["model.safetensors"])),
    ] {
        let dst = root.join(key);
        copy_dir(&testdata().join("models/tiny"), &dst);
        std::fs::remove_file(dst.join("model.safetensors")).unwrap();
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(dst.join("model.safetensors.index.json"), index.to_string()).unwrap();
        put(key, dst);
    }
    put("config_file", testdata().join("models/tiny/config.json"));
    copy_dir(&testdata().join("models/tiny"), &p("model_copy"));
    put("model_copy", p("model_copy"));

    // Graph sets with a wrong manifest.
    edited_set(&p("version99"), |m| m["version"] = 99.into());
    put("version99", p("version99"));
    edited_set(&p("v1_version99"), |m| {
        m["format"] = "qwen35-external-ir".into();
        m["version"] = 99.into();
    });
    put("v1_version99", p("v1_version99"));
    edited_set(&p("int9"), |m| m["reference_weights"] = "int9".into());
    put("int9", p("int9"));
    edited_set(&p("no_model"), |m| m["model"] = "no/such/model".into());
    put("no_model", p("no_model"));

    // Files for options.
    std::fs::write(p("f16.json"), r#"{"INFERENCE_PRECISION_HINT": "f16"}"#).unwrap();
    put("f16_config", p("f16.json"));
    std::fs::write(
        p("prompts.jsonl"),
        "{\"label\": \"a\", \"token_ids\": [1, 2, 3]}\n",
    )
    .unwrap();
    put("prompts", p("prompts.jsonl"));
    let lib = npu::runtime::locate().unwrap();
    let cpp = std::fs::read_dir(lib.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libopenvino.so"))
        })
        .expect("the C++ library beside libopenvino_c");
    put("cpp_lib", cpp);
    put("tmp", root.to_path_buf());
    let long: Vec<String> = (0..3000).map(|i| (i % 90 + 1).to_string()).collect();
    paths.insert("long", long.join(","));
    paths.insert("u64max", U64_MAX.to_string());
    Fixtures { _dir: dir, paths }
}

/// `text` with every `{name}` replaced by its fixture.
fn fill(text: &str, f: &Fixtures) -> String {
    let mut out = text.to_string();
    for (k, v) in &f.paths {
        out = out.replace(&format!("{{{k}}}"), v);
    }
    out
}

#[test]
fn every_bad_input_is_refused_or_reported_as_the_table_says() {
    let f = fixtures();
    let mut failed = Vec::new();
    let table = cases();
    for case in &table {
        let args: Vec<String> = fill(case.args, &f).split(' ').map(str::to_string).collect();
        let env: Vec<(String, String)> = case
            .env
            .iter()
            .map(|(k, v)| (k.to_string(), fill(v, &f)))
            .collect();
        let o = qwen35(&args, &env);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        let mut wrong = Vec::new();
        if o.status.code() != Some(case.code) {
            wrong.push(format!(
                "exit {:?}, expected {}",
                o.status.code(),
                case.code
            ));
        }
        if text.contains("panicked") {
            wrong.push("panicked".into());
        }
        for n in case.needles {
            if !text.contains(n) {
                wrong.push(format!("no `{n}` in the message"));
            }
        }
        if !wrong.is_empty() {
            let tail: String = text.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
            failed.push(format!("{}: {} — {tail}", case.what, wrong.join(", ")));
        }
    }
    println!("{} bad-input cases", table.len());
    assert!(
        failed.is_empty(),
        "{} of {} cases went wrong:\n{}",
        failed.len(),
        table.len(),
        failed.join("\n")
    );
}

/// A closed pipe on the standard output ends the command quietly (as any Unix tool), not with a panic.
#[test]
fn a_closed_pipe_is_not_a_panic() {
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "'{}' compare-devices --help | head -c 1 >/dev/null",
            env!("CARGO_BIN_EXE_qwen35")
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn an_injected_type_error_is_not_a_panic() {
    // Integer logits in a dump: named, not a panic in the comparison.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("int.safetensors");
    let mut t = BTreeMap::new();
    t.insert("token_ids".to_string(), ids(&[1, 2], &[2]));
    t.insert(
        "logits".to_string(),
        Tensor::zeros((2, 4), DType::I64, &candle_core::Device::Cpu).unwrap(),
    );
    Dump {
        tensors: t,
        metadata: BTreeMap::new(),
    }
    .write(&f)
    .unwrap();
    let path = f.to_str().unwrap().to_string();
    let o = qwen35(&["diff".into(), path.clone(), path], &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("`logits`") && !err.contains("panicked"),
        "{err}"
    );
}
