//! llama.cpp as a device (`--devices llama.cpp`): the harness's side of it, on any machine. The worker process is
//! served by the reference itself behind llama.cpp's protocol (`QWEN35_WORKER_ENGINE=reference`, a test switch of
//! `qwen35-llama-worker`), so that the device, its reports, a worker that crashes and a worker with a planted bug
//! are checked without llama.cpp; llama.cpp itself is checked by the tests at the end, built with `--features
//! llama-cpp`.

use crate::common::{expect_error, expect_error_env, qwen35_env, stderr, testdata};
use reference::gguf::model::fault::Fault;
use std::path::{Path, PathBuf};

const WORKER: &str = env!("CARGO_BIN_EXE_qwen35-llama-worker");
const IDS: &str = "508,82,88,282,68,76,198,56";

fn gguf(name: &str) -> PathBuf {
    testdata()
        .join("gguf/llamacpp")
        .join(format!("{name}.gguf"))
}

/// The reference behind the worker's protocol, with `more` environment.
fn reference_worker<'a>(more: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut env = vec![
        ("QWEN35_LLAMA_WORKER", WORKER),
        ("QWEN35_WORKER_ENGINE", "reference"),
    ];
    env.extend_from_slice(more);
    env
}

/// `compare-devices` of the device on `model`, its JSON report written to `json`: the exit code and the report.
fn compare(
    model: &Path,
    json: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Option<i32>, serde_json::Value, String) {
    let mut args = vec![
        "compare-devices",
        "--model",
        model.to_str().unwrap(),
        "--devices",
        "llama.cpp",
        "--token-ids",
        IDS,
        "--tokens",
        "3",
        "--context",
        "64",
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = qwen35_env(&args, env);
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{err}");
    let v = std::fs::read(json)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    (o.status.code(), v, err)
}

#[test]
fn a_device_behind_the_worker_protocol_is_compared_layer_by_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("r.json");
    let (code, v, err) = compare(&gguf("tiny-tied.f32"), &json, &[], &reference_worker(&[]));
    assert_eq!(code, Some(0), "{err}\n{v}");
    let d = &v["devices"][0];
    assert_eq!(d["device"], "llama.cpp CPU", "{d}");
    // Every layer's output came through the pipe and equals the reference's (the same engine on both sides).
    let layers = d["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 4, "{d}");
    for l in layers {
        assert_eq!(l["output"]["nrmse"].as_f64(), Some(0.0), "{l}");
    }
    assert_eq!(d["logits"]["nmse"].as_f64(), Some(0.0), "{d}");
    // The states stay inside the runtime: said, not compared as if equal.
    assert!(
        d.to_string().contains("not exposed"),
        "the report should say the states are not exposed: {d}"
    );
}

#[test]
fn a_worker_that_crashes_is_named_with_its_signal_and_the_call() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("r.json");
    let env = reference_worker(&[("QWEN35_WORKER_FAULT", "abort-at:2")]);
    let (code, _, err) = compare(&gguf("tiny-tied.f32"), &json, &[], &env);
    assert_eq!(code, Some(2), "{err}");
    for needle in ["signal 6 (SIGABRT)", "the device crashed", "llama.cpp"] {
        assert!(err.contains(needle), "`{needle}` missing:\n{err}");
    }
    assert!(!json.exists(), "no report is left behind by a failed run");
}

#[test]
fn a_bug_planted_in_the_device_is_named_at_its_layer() {
    // The worker runs a copy of the model with the seed's conv-orientation bug; the reference runs the file.
    let tmp = tempfile::tempdir().unwrap();
    let faulty = tmp.path().join("faulty");
    std::fs::create_dir(&faulty).unwrap();
    let model = testdata().join("gguf/models/tiny-f32.gguf");
    reference::gguf::write_checkpoint(&model, Some(Fault::ConvOrientation), &faulty).unwrap();
    let json = tmp.path().join("r.json");
    let env = reference_worker(&[("QWEN35_WORKER_MODEL", faulty.to_str().unwrap())]);
    let (code, v, err) = compare(&model, &json, &[], &env);
    assert_eq!(code, Some(1), "{err}\n{v}");
    let layers = v["devices"][0]["layers"].as_array().unwrap();
    // Layer 0 is a linear-attention layer: the bug shows there first.
    let first_bad = layers
        .iter()
        .position(|l| l["output"]["nrmse"].as_f64().unwrap() > 1e-4)
        .unwrap();
    assert_eq!(first_bad, 0, "{layers:?}");
}

#[test]
fn options_that_do_not_apply_to_llama_cpp_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("device.json");
    std::fs::write(&config, "{}").unwrap();
    let cache = tmp.path().join("cache");
    let model = gguf("tiny-tied.f32");
    let m = model.to_str().unwrap();
    let moe = gguf("tiny-moe-gguf.f32");
    let env = reference_worker(&[]);
    // Every option of this project's graphs and of OpenVINO, on compare-devices and validate alike.
    for (flag, value, model) in [
        ("--precision", "f16", m),
        ("--block", "4", m),
        ("--device-config", config.to_str().unwrap(), m),
        ("--cache-dir", cache.to_str().unwrap(), m),
        ("--output-scale", "1", m),
        ("--moe-form", "gather", moe.to_str().unwrap()),
        ("--inverse", "doubling", m),
        ("--chunk", "8", m),
        ("--decode-form", "sequential", m),
        ("--prefill-block", "4", m),
        ("--deltanet-form", "matrix", m),
    ] {
        for (command, devices) in [("compare-devices", "--devices"), ("validate", "--device")] {
            let args = [
                command,
                "--model",
                model,
                devices,
                "llama.cpp",
                "--token-ids",
                IDS,
                flag,
                value,
            ];
            expect_error_env(&args, &env, &[flag, "llama.cpp"]);
        }
    }
    // llama.cpp runs a GGUF file: a checkpoint directory is refused, naming --model.
    let dir = testdata().join("models/tiny");
    let args = [
        "compare-devices",
        "--model",
        dir.to_str().unwrap(),
        "--devices",
        "llama.cpp",
        "--token-ids",
        IDS,
    ];
    expect_error_env(&args, &env, &["--model", "GGUF"]);
    // The reference modelling llama.cpp against an OpenVINO device compares unlike with unlike: refused.
    let args = [
        "compare-devices",
        "--model",
        m,
        "--devices",
        "CPU",
        "--token-ids",
        IDS,
        "--arithmetic",
        "llama-cpp",
    ];
    expect_error(&args, &["--arithmetic"]);
    // A ggml device llama.cpp does not have is refused before any work, naming the ones it has.
    let args = [
        "compare-devices",
        "--model",
        m,
        "--devices",
        "llama.cpp:NOSUCH",
        "--token-ids",
        IDS,
    ];
    expect_error_env(&args, &reference_worker(&[]), &["NOSUCH"]);
}

#[cfg(not(feature = "llama-cpp"))]
#[test]
fn without_the_feature_the_device_says_how_to_build_it() {
    let model = gguf("tiny-tied.f32");
    let args = [
        "compare-devices",
        "--model",
        model.to_str().unwrap(),
        "--devices",
        "llama.cpp",
        "--token-ids",
        IDS,
    ];
    expect_error_env(
        &args,
        &[("QWEN35_LLAMA_WORKER", WORKER)],
        &["--features llama-cpp"],
    );
}

#[test]
fn validate_runs_every_check_the_device_allows_and_names_the_ones_it_cannot() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("v.json");
    let model = gguf("tiny-tied.f32");
    let args = [
        "validate",
        "--model",
        model.to_str().unwrap(),
        "--device",
        "llama.cpp",
        "--context",
        "128",
        "--tokens",
        "4",
        "--json",
        json.to_str().unwrap(),
    ];
    let o = qwen35_env(&args, &reference_worker(&[]));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let checks = v["checks"].as_array().unwrap();
    let check = |id: &str| {
        checks
            .iter()
            .find(|c| c["id"] == id)
            .unwrap_or_else(|| panic!("no check {id}: {v}"))
    };
    for id in [
        "execution-devices",
        "precision",
        "compare",
        "blocks",
        "back-to-back",
        "length",
        "over-long",
    ] {
        assert_eq!(check(id)["passed"], true, "{}", check(id));
    }
    // What llama.cpp cannot do is skipped with its reason, neither passed nor failed.
    for (id, why) in [
        ("probe", "per-layer graphs"),
        ("prompt-lookup", "llama.cpp keeps its KV caches"),
    ] {
        let c = check(id);
        assert!(c["passed"].is_null(), "{c}");
        assert!(c["skipped"].as_str().unwrap().contains(why), "{c}");
    }
}

/// llama.cpp itself (built with `--features llama-cpp`; CI does not build it): its layers and logits on a Q8_0 file
/// agree with the reference modelling its arithmetic to f32 rounding, and leave the plain reference's thresholds.
#[cfg(feature = "llama-cpp")]
#[test]
fn llama_cpp_itself_agrees_like_for_like_and_not_otherwise() {
    let tmp = tempfile::tempdir().unwrap();
    let env = [("QWEN35_LLAMA_WORKER", WORKER)];
    let model = gguf("tiny-tied.q8_0");
    let like = tmp.path().join("like.json");
    let (code, v, err) = compare(&model, &like, &["--arithmetic", "llama-cpp"], &env);
    assert_eq!(code, Some(0), "{err}\n{v}");
    let d = &v["devices"][0];
    for l in d["layers"].as_array().unwrap() {
        assert!(l["output"]["nrmse"].as_f64().unwrap() < 1e-6, "{l}");
    }
    let plain = tmp.path().join("plain.json");
    let (code, v, err) = compare(&model, &plain, &[], &env);
    assert_eq!(code, Some(1), "{err}\n{v}");
    let worst = v["devices"][0]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["output"]["nrmse"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(worst > 1e-3, "{worst}");
}
