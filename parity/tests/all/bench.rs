//! `qwen35 synth` and `qwen35 bench` end to end: a synthetic checkpoint written, loaded and timed on both backends, the
//! JSON's keys, and clear errors on bad flags. Timings are never asserted.

use crate::common;
use common::{expect_error, qwen35, stderr};
use std::path::Path;

fn synth_tiny(dir: &Path, seed: &str) {
    let o = qwen35(&[
        "synth",
        "--out",
        dir.to_str().unwrap(),
        "--layers",
        "4",
        "--seed",
        seed,
        "--arch",
        "tiny",
        "--shard-bytes",
        "300000",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("model-00001-of-"), "{out}");
    assert!(out.contains("--token-ids"), "{out}");
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn synth_then_bench_writes_every_figure() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    synth_tiny(&model, "5");
    assert!(model.join("model.safetensors.index.json").exists());
    let json = tmp.path().join("bench.json");
    let o = qwen35(&[
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--prompt-tokens",
        "70",
        "--decode-tokens",
        "3",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = String::from_utf8_lossy(&o.stdout);
    for needle in [
        "load", "prompt", "decode", "tok/s", "GFLOP/s", "VmHWM", "GEMM",
    ] {
        assert!(table.contains(needle), "no `{needle}` in\n{table}");
    }
    let r = read_json(&json);
    for key in [
        "prompt_tokens_per_s",
        "decode_tokens_per_s",
        "peak_rss_bytes",
        "peak_anon_bytes",
        "load_seconds",
        "prompt_gflops_per_s",
        "decode_gflops_per_s",
        "decode_weight_bytes_per_token",
    ] {
        assert!(
            r[key].as_f64().is_some_and(|x| x > 0.0),
            "{key}: {}",
            r[key]
        );
    }
    for key in ["gemm_gflops_per_s", "copy_gb_per_s", "read_gb_per_s"] {
        assert!(r["machine"][key].as_f64().is_some_and(|x| x > 0.0), "{key}");
    }
    assert_eq!(r["prompt_tokens"], 70);
    assert_eq!(r["decode_tokens"], 3);
    assert_eq!(r["prompt_ids"].as_array().unwrap().len(), 70);
    // The first token comes from the prompt's logits, then one per decode step.
    assert_eq!(r["generated_ids"].as_array().unwrap().len(), 4);
    assert_eq!(r["record"]["backend"], "reference");
    // Two chunks of 64 (the second padded) in each of the three linear layers.
    assert!(r["prompt_flops"]["deltanet"].as_f64().unwrap() > 0.0);

    // The same prompt on the OpenVINO CPU device.
    let json_ov = tmp.path().join("bench-ov.json");
    let o = qwen35(&[
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--prompt-tokens",
        "70",
        "--decode-tokens",
        "3",
        "--backend",
        "openvino",
        "--no-machine",
        "--json",
        json_ov.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ov = read_json(&json_ov);
    assert_eq!(ov["record"]["backend"], "openvino");
    assert_eq!(ov["record"]["device"], "CPU");
    assert!(ov["machine"].is_null());
    assert_eq!(ov["prompt_ids"], r["prompt_ids"]);
    assert!(ov["decode_tokens_per_s"].as_f64().is_some_and(|x| x > 0.0));
}

#[test]
fn an_moe_checkpoint_benches_reading_k_of_its_experts_per_step() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("moe");
    let o = qwen35(&[
        "synth",
        "--out",
        model.to_str().unwrap(),
        "--layers",
        "4",
        "--arch",
        "tiny-moe",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("tiny-moe (4 layers)"));
    let json = tmp.path().join("bench.json");
    let o = qwen35(&[
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--prompt-tokens",
        "20",
        "--decode-tokens",
        "2",
        "--no-machine",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("active per token"));
    let r = read_json(&json);
    // tiny-moe in bf16 (hidden 64): three DeltaNet mixers of 16896 weights and an attention one of 28672, per layer
    // the router 8·64, the shared expert 3·48·64 and its gate 64, 2 of the 8 experts of 3·32·64, the LM head 512·64.
    let per_step = 3 * 16896 + 28672 + 4 * (512 + 9216 + 64 + 2 * 3 * 32 * 64) + 512 * 64;
    assert_eq!(r["decode_weight_bytes_per_token"], 2 * per_step, "{r}");
    let (all, active) = (
        r["parameters"].as_u64().unwrap(),
        r["active_parameters"].as_u64().unwrap(),
    );
    assert_eq!(all - active, 4 * 6 * 3 * 32 * 64);
    assert_eq!(r["generated_ids"].as_array().unwrap().len(), 3);
}

#[test]
fn bad_flags_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    synth_tiny(&model, "1");
    let m = model.to_str().unwrap();
    expect_error(
        &["bench", "--model", m, "--prompt-tokens", "0"],
        &["--prompt-tokens"],
    );
    expect_error(
        &["bench", "--model", m, "--decode-tokens", "0"],
        &["--decode-tokens"],
    );
    expect_error(&["bench", "--model", m, "--device", "CPU"], &["--device"]);
    expect_error(
        &[
            "bench",
            "--model",
            m,
            "--backend",
            "openvino",
            "--dtype",
            "f64",
        ],
        &["--dtype"],
    );
    expect_error(
        &["bench", "--model", m, "--json", "/nonexistent-dir/b.json"],
        &["--json", "does not exist"],
    );
    expect_error(
        &[
            "bench",
            "--model",
            tmp.path().join("nowhere").to_str().unwrap(),
        ],
        &["--model", "no such directory"],
    );
    expect_error(
        &[
            "bench",
            "--model",
            m,
            "--backend",
            "openvino",
            "--context",
            "16",
        ],
        &["--context"],
    );
    let fresh = tmp.path().join("fresh");
    let f = fresh.to_str().unwrap();
    expect_error(&["synth", "--out", f, "--layers", "0"], &["--layers"]);
    expect_error(
        &["synth", "--out", f, "--layers", "2", "--arch", "huge"],
        &["--arch", "huge", "35b-a3b", "qwen3.5-9b"],
    );
    expect_error(
        &["synth", "--out", m, "--layers", "2"],
        &["--out", "not empty"],
    );
}

#[test]
fn synth_is_deterministic_through_the_command_line() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    synth_tiny(&a, "9");
    synth_tiny(&b, "9");
    let mut names: Vec<_> = std::fs::read_dir(&a)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert!(names.len() >= 4);
    for name in names {
        assert!(
            std::fs::read(a.join(&name)).unwrap() == std::fs::read(b.join(&name)).unwrap(),
            "{name:?} differs"
        );
    }
}

#[test]
fn bench_times_the_vision_tower_on_both_backends() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::testdata().join("models/tiny-vl");
    let m = model.to_str().unwrap();
    for backend in ["reference", "openvino"] {
        let json = tmp.path().join(format!("{backend}.json"));
        let o = qwen35(&[
            "bench",
            "--model",
            m,
            "--image-grid",
            "8x10",
            "--image-runs",
            "2",
            "--backend",
            backend,
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{backend}: {}", stderr(&o));
        let r = read_json(&json);
        assert_eq!(r["patches"], 80, "{r}");
        assert_eq!(r["rows"], 20, "{r}");
        assert_eq!(r["run_seconds"].as_array().unwrap().len(), 2, "{r}");
        assert!(r["flops"].as_u64().unwrap() > 0, "{r}");
    }
    expect_error(
        &["bench", "--model", m, "--image-grid", "8"],
        &["--image-grid 8", "HxW"],
    );
    expect_error(
        &["bench", "--model", m, "--image-grid", "7x8"],
        &["--image-grid 7x8", "2 x 2 merge blocks"],
    );
    let tiny = common::testdata().join("models/tiny");
    expect_error(
        &[
            "bench",
            "--model",
            tiny.to_str().unwrap(),
            "--image-grid",
            "8x8",
        ],
        &["vision_config"],
    );
}
