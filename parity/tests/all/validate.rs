//! `qwen35 validate` on the bundled tiny model: every check passes on the CPU device at f32 (exit 0) and is in the
//! JSON; FP16SIM runs; an injected fault fails the check that looks for it (and the bisection finds the length
//! where it starts); a precision the device substitutes fails unless allowed; bad input is a clear error.

use serde_json::Value;
use std::path::Path;

use crate::common;
use common::{expect_error, qwen35, small_validate_args as small, stderr};

/// Each fault of the device failing the one check that looks for it.
mod faults;

/// Every check, in the report's order.
const CHECKS: [&str; 12] = [
    "execution-devices",
    "precision",
    "compare",
    "images",
    "probe",
    "blocks",
    "padding",
    "prefix-reuse",
    "prompt-lookup",
    "back-to-back",
    "length",
    "over-long",
];

/// Runs `validate` with `args` and `--json` into `dir`; the exit code and the JSON.
fn validate(dir: &Path, name: &str, args: &[&str]) -> (Option<i32>, Value) {
    let j = dir.join(format!("{name}.json"));
    let mut all = vec!["validate", "--json", j.to_str().unwrap()];
    all.extend_from_slice(args);
    let o = qwen35(&all);
    assert!(
        j.exists(),
        "{args:?} wrote no report: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        stderr(&o)
    );
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    let v = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    (o.status.code(), v)
}

fn check<'a>(v: &'a Value, id: &str) -> &'a Value {
    v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("no check `{id}`"))
}

fn failed(v: &Value) -> Vec<String> {
    v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["passed"] == false)
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn validate_passes_on_the_cpu_at_f32_with_every_check_in_the_report() {
    let tmp = tempfile::tempdir().unwrap();
    let md = tmp.path().join("r.md");
    let (code, v) = validate(
        tmp.path(),
        "cpu",
        &[
            "--device",
            "CPU",
            "--context",
            "128",
            "--lookup-tokens",
            "48",
            "--report",
            md.to_str().unwrap(),
        ],
    );
    assert_eq!(code, Some(0), "failed: {:?}", failed(&v));
    assert_eq!(v["schema_version"], 2);
    assert_eq!(v["passed"], true);
    let ids: Vec<&str> = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, CHECKS);
    for c in v["checks"].as_array().unwrap() {
        if c["id"] == "images" {
            // Skipped on a checkpoint without a vision tower, saying so: it neither passes nor fails.
            assert!(c["passed"].is_null(), "{c}");
            assert!(
                c["skipped"].as_str().unwrap().contains("no vision tower"),
                "{c}"
            );
            continue;
        }
        assert_eq!(c["passed"], true, "{c}");
        assert!(c["skipped"].is_null(), "{c}");
        assert!(!c["figure"].as_str().unwrap().is_empty());
        assert!(c["failures"].as_array().unwrap().is_empty());
    }
    // Where and how it ran: every graph on the CPU, in f32; no model cache unless asked for on a CPU.
    let d = &v["device"];
    assert_eq!(d["precision_requested"], "f32");
    let graphs = d["graphs"].as_array().unwrap();
    assert!(graphs.len() >= 8, "{graphs:?}");
    for g in graphs {
        assert_eq!(g["execution_devices"], "CPU", "{g}");
        assert_eq!(g["precision"], "f32", "{g}");
        assert!(g.get("loaded_from_cache").is_some_and(Value::is_null));
    }
    // At f32 on the CPU the equivalences hold exactly or to rounding.
    let blocks = &check(&v, "blocks")["details"];
    assert_eq!(blocks["blocks"], serde_json::json!([1, 16, 64]));
    assert_eq!(blocks["deployed_block"], 16);
    let runs = blocks["runs"].as_array().unwrap();
    // Blocks of 1 and 64 against the deployed 16, on every prompt of the shipped set.
    assert!(
        !runs.is_empty() && runs.iter().all(|r| r["block"] != 16),
        "{runs:?}"
    );
    for r in runs {
        assert!(r["against_deployed"]["first_divergence"].is_null(), "{r}");
        assert!(r["against_deployed"]["logits"]["nmse"].as_f64().unwrap() < 1e-10);
        assert!(r["prompt_logits"]["nmse"].as_f64().unwrap() < 1e-10, "{r}");
    }
    let b2b = &check(&v, "back-to-back")["details"];
    assert_eq!(b2b["prompt_logits"]["max_abs"], 0.0);
    assert_eq!(b2b["state"]["max_abs"], 0.0);
    assert_eq!(b2b["generated"]["logits"]["max_abs"], 0.0);
    let pad = &check(&v, "padding")["details"];
    assert!(pad["padded_slots"].as_u64().unwrap() > 0);
    assert!(pad["state"]["nrmse"].as_f64().unwrap() < 1e-5);
    assert!(check(&v, "prefix-reuse")["details"]["agreement"]["first_divergence"].is_null());
    // Prompt lookup: greedy's tokens, and on this random model a few drafts hit (the repeated prompt's).
    let lookup = &check(&v, "prompt-lookup")["details"];
    assert!(lookup["proposed"].as_u64().unwrap() > 0);
    assert!(lookup["accepted"].as_u64().unwrap() > 0, "{lookup}");
    assert!(lookup["speedup"].as_f64().unwrap() > 0.0);
    for r in lookup["runs"].as_array().unwrap() {
        assert!(r["agreement"]["first_divergence"].is_null(), "{r}");
    }
    let length = &check(&v, "length")["details"];
    assert_eq!(length["max_length"], 127);
    assert!(length["first_failing"].is_null());
    let lengths: Vec<u64> = length["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["length"].as_u64().unwrap())
        .collect();
    assert_eq!(lengths, [7, 15, 31, 63, 127]);
    let over = &check(&v, "over-long")["details"];
    assert_eq!(over["prompt_tokens"], 129);
    assert!(
        over["device_error"]
            .as_str()
            .unwrap()
            .contains("static context")
    );
    // The compare-devices report the compare check made, in full.
    let cmp = &v["compare"]["devices"][0];
    assert_eq!(cmp["greedy_matched"], cmp["greedy_total"]);
    assert_eq!(v["probe"]["layers"].as_array().unwrap().len(), 4);

    let report = std::fs::read_to_string(&md).unwrap();
    for needle in [
        "# qwen35 validate report",
        "**PASS**",
        "| check | verdict | key figure | on failure, look at |",
        "| back-to-back | PASS |",
        "model cache",
        "| graph | compiled for | precision | execution devices |",
        "## Appendix: the compare-devices report",
        "## Appendix: the probe report",
    ] {
        assert!(report.contains(needle), "the Markdown has no `{needle}`");
    }
}

#[test]
fn validate_runs_on_fp16sim() {
    let tmp = tempfile::tempdir().unwrap();
    let (code, v) = validate(
        tmp.path(),
        "sim",
        &[
            "--device",
            "FP16SIM",
            "--context",
            "96",
            "--tokens",
            "3",
            "--lookup-tokens",
            "8",
            "--blocks",
            "1,16",
            "--max-length",
            "40",
        ],
    );
    // FP16SIM's default arithmetic (fp16 storage, subnormals flushed) moves this random model's logits far past the
    // f16 thresholds (logits NMSE ~0.2 against the reference, 1e-2 allowed; validate.md's table), so the two checks
    // against the reference's logits fail while the device agrees with itself and each layer alone holds: exit 1.
    assert_eq!(code, Some(1), "{v}");
    assert_eq!(v["passed"], false);
    assert_eq!(failed(&v), ["compare", "length"]);
    assert_eq!(v["checks"].as_array().unwrap().len(), CHECKS.len());
    let d = &v["device"];
    assert_eq!(d["precision"], "f16");
    assert_eq!(
        d["graphs"][0]["execution_devices"],
        "FP16SIM:store=f16,ftz=on,acc=f32,state=f16,norm=ops"
    );
    // Ran where asked, in what it asked; deterministic; refuses an over-long prompt.
    for id in [
        "execution-devices",
        "precision",
        "back-to-back",
        "over-long",
    ] {
        assert_eq!(check(&v, id)["passed"], true, "{}", check(&v, id));
    }
    // The length check ran its probe points and, a point failing, bisected to a first failing length.
    let length = &check(&v, "length")["details"];
    let first = length["first_failing"].as_u64().unwrap();
    let (lo, hi) = (
        length["bisection_between"][0].as_u64().unwrap(),
        length["bisection_between"][1].as_u64().unwrap(),
    );
    assert!(lo < first && first <= hi, "{length}");
}

#[test]
fn injected_faults_fail_the_checks_that_look_for_them() {
    let tmp = tempfile::tempdir().unwrap();
    let small = small(tmp.path());
    let with = |fault: &'static str| -> Vec<&str> {
        let mut args: Vec<&str> = small.iter().map(String::as_str).collect();
        args.extend(["--inject-fault", fault]);
        args
    };

    // A device that keeps its recurrent state between sequences.
    let (code, v) = validate(tmp.path(), "leak", &with("leak-state"));
    assert_eq!(code, Some(1));
    let b2b = check(&v, "back-to-back");
    assert_eq!(b2b["passed"], false);
    assert!(b2b["details"]["state"]["max_abs"].as_f64().unwrap() > 0.0);
    assert!(
        b2b["failures"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f.as_str().unwrap().contains("bit-identical expected"))
    );
    assert_eq!(check(&v, "over-long")["passed"], true);

    // A device that cannot go back to a snapshot: `validate/faults.rs`.

    // A device whose logits turn NaN from position 40 on: a finding of the checks that reach it (never a panic
    // or a pass), named as non-finite, its undefined measures `null` in the JSON.
    let (code, v) = validate(tmp.path(), "nan", &with("nan-from=40"));
    assert_eq!(code, Some(1));
    let length = check(&v, "length");
    assert_eq!(length["passed"], false, "{length}");
    assert_eq!(length["details"]["first_failing"], 40, "{length}");
    let failures = serde_json::to_string(&v).unwrap();
    assert!(failures.contains("NaN"), "no check names the NaN");
}

#[test]
fn a_substituted_precision_fails_unless_allowed() {
    let tmp = tempfile::tempdir().unwrap();
    let small = small(tmp.path());
    let mut args: Vec<&str> = small.iter().map(String::as_str).collect();
    args.extend(["--precision", "f16"]);
    let (code, v) = validate(tmp.path(), "f16", &args);
    let p = check(&v, "precision");
    // A CPU without f16 arithmetic computes another precision when asked for f16 (bf16 where it has bf16, else
    // f32): the check fails naming it, and accepts it when allowed; a CPU with f16 arithmetic passes.
    let computed = v["device"]["precision"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    if computed != "f16" {
        assert!(computed == "bf16" || computed == "f32", "{computed}");
        assert_eq!(code, Some(1));
        assert_eq!(p["passed"], false);
        let why = p["failures"][0].as_str().unwrap();
        let allow = format!("--allow-precision {computed}");
        assert!(why.contains(&computed) && why.contains(&allow), "{why}");
        args.extend(["--allow-precision", computed.as_str()]);
        let (_, v) = validate(tmp.path(), "allowed", &args);
        let p = check(&v, "precision");
        assert_eq!(p["passed"], true, "{p}");
        assert!(p["notes"][0].as_str().unwrap().contains("accepted"));
    } else {
        assert_eq!(p["passed"], true, "{p}");
    }
}

#[test]
fn validate_errors_are_clear() {
    expect_error(
        &[
            "validate",
            "--device",
            "CPU",
            "--context",
            "128",
            "--max-length",
            "128",
        ],
        &["--max-length 128", "--context"],
    );
    expect_error(
        &[
            "validate",
            "--device",
            "CPU",
            "--context",
            "32",
            "--token-ids",
            "1,2,3",
        ],
        &["--blocks", "64", "32"],
    );
    expect_error(
        &[
            "validate",
            "--device",
            "CPU",
            "--context",
            "64",
            "--blocks",
            "1,16",
            "--tokens",
            "40",
        ],
        &["static context", "--context", "--tokens"],
    );
    expect_error(
        &["validate", "--device", "CPU", "--inject-fault", "gremlins"],
        &["--inject-fault", "gremlins"],
    );
    expect_error(
        &["validate", "--device", "CPU", "--lookup-draft", "0"],
        &["--lookup-draft"],
    );
    expect_error(
        &["validate", "--device", "NO_SUCH_DEVICE"],
        &["--device", "NO_SUCH_DEVICE"],
    );
    expect_error(
        &["validate", "--device", "FP16SIM", "--precision", "f16"],
        &["--precision", "FP16SIM"],
    );
    expect_error(&["validate"], &["--device"]);
}

#[test]
fn a_second_validate_loads_every_graph_from_the_model_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("ov-cache");
    let mut args = small(tmp.path());
    args.extend(["--cache-dir".to_string(), cache.display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let flags = |v: &Value| -> Vec<Option<bool>> {
        v["device"]["graphs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["loaded_from_cache"].as_bool())
            .collect()
    };
    let (code, first) = validate(tmp.path(), "first", &args);
    assert_eq!(code, Some(0), "failed: {:?}", failed(&first));
    assert_eq!(first["device"]["cache_dir"], cache.display().to_string());
    // The first graph is compiled and stored (later ones of the same run may already come from the cache).
    assert_eq!(flags(&first)[0], Some(false), "{:?}", flags(&first));
    let (code, second) = validate(tmp.path(), "second", &args);
    assert_eq!(code, Some(0), "failed: {:?}", failed(&second));
    let second = flags(&second);
    assert!(second.iter().all(|&f| f == Some(true)), "{second:?}");
    // Another precision on the same cache is compiled afresh, never served the f32 graphs (OpenVINO keys a cached
    // graph by the graph and the device alone; each set of properties has a folder of its own).
    let mut f16 = args.clone();
    f16.extend(["--precision", "f16"]);
    let (code, third) = validate(tmp.path(), "third", &f16);
    assert!(
        matches!(code, Some(0 | 1)),
        "{code:?}: {:?}",
        failed(&third)
    );
    assert_eq!(flags(&third)[0], Some(false), "{:?}", flags(&third));
    // Every graph computes in the one precision the device gives for f16, the decoders compiled from their cached
    // IR's paths as the per-layer graphs compiled from memory (on a CPU without f16 the first were f32, the second
    // bf16: the plugin resolved the hint by whether it was loaded when the hint was set).
    let precisions: std::collections::BTreeSet<&str> = third["device"]["graphs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["precision"].as_str().unwrap_or("unknown"))
        .collect();
    assert_eq!(precisions.len(), 1, "{precisions:?}");
    let folders: Vec<String> = common::entries(&cache)
        .into_iter()
        .filter(|e| e.starts_with("CPU-"))
        .collect();
    assert_eq!(folders.len(), 2, "{folders:?}");
}

/// `validate --image` on the tiny model with a vision tower (the small runs, one committed image): the images check
/// runs the device's vision graph, its text with its own rows and the text after the image, and passes on the CPU;
/// the probe runs on the prompt with the image. A device that forgets the rope delta an image leaves in the state
/// (the text after the image at the count of tokens, not at the image's largest position + 1) fails the images check
/// alone: every text check passes, as does the probe (its layers are given the positions).
#[test]
fn validate_with_an_image_checks_the_vision_graph_the_image_rows_and_the_rope_delta() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::testdata().join("models/tiny-vl");
    let image = common::testdata().join("images/wide.png");
    let mut args = small(tmp.path());
    args.extend([
        "--model".to_string(),
        model.to_str().unwrap().into(),
        "--image".into(),
        image.to_str().unwrap().into(),
    ]);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, v) = validate(tmp.path(), "image", &a);
    assert_eq!(code, Some(0), "failed: {:?}", failed(&v));
    for c in v["checks"].as_array().unwrap() {
        assert_eq!(c["passed"], true, "{c}");
    }
    let images = &check(&v, "images")["details"];
    let vision = images["vision"].as_array().unwrap();
    let merger = vision
        .iter()
        .find(|r| r["name"] == "vision.merger")
        .expect("the merger's row");
    // Measured 5.1e-8 (the CPU's f32 vision graph against the reference tower).
    assert!(
        merger["error"]["nrmse"].as_f64().unwrap() < 1e-6,
        "{merger}"
    );
    assert_eq!(images["blocks"].as_array().unwrap().len(), 2);
    assert!(
        images["follow_up"]["first_divergence"].is_null(),
        "{images}"
    );
    assert_eq!(images["after_images"]["logits"]["max_abs"], 0.0);
    let cmp = &images["compare"];
    assert_eq!(cmp["greedy_matched"], cmp["greedy_total"]);
    assert_eq!(v["probe"]["inputs"]["prompt"], "with 1 image(s)");
    let prompts = v["inputs"]["prompts"].as_array().unwrap();
    assert_eq!(prompts.last().unwrap()[0], "with 1 image(s)", "{prompts:?}");

    args.extend(["--inject-fault".to_string(), "forget-rope-delta".into()]);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, v) = validate(tmp.path(), "image-fault", &a);
    assert_eq!(failed(&v), ["images"]);
    assert_eq!(code, Some(1));
    let f = serde_json::to_string(&check(&v, "images")["failures"]).unwrap();
    assert!(f.contains("--max-nmse"), "{f}");
    let follow = &check(&v, "images")["details"]["follow_up"];
    assert!(
        follow["logits"]["nmse"].as_f64().unwrap() > 1e-6,
        "{follow}"
    );
}
