//! `qwen35 validate --ir DIR` on optimum-intel's exports of the tiny model (`testdata/ir/`), CPU device: the checks
//! that apply to an external IR run and pass, the others are skipped (neither passed nor failed); the INT4 export
//! passes on the weights it holds and fails the compare check on the plain INT4 rule; a static context declared in
//! the manifest brings the over-long check back; bad input is a clear error.

use serde_json::Value;
use std::path::{Path, PathBuf};

use crate::common;
use common::{expect_error, qwen35, stderr, testdata};

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

/// The checks a stateful IR cannot have: it exposes neither per-layer graphs nor its states, and takes any
/// number of tokens per call (nothing is padded); and the images check, the tiny model having no vision tower.
const SKIPPED: [&str; 4] = ["images", "probe", "padding", "prompt-lookup"];

fn ir(name: &str) -> PathBuf {
    testdata().join("ir").join(name)
}

/// Short runs: two prompts, 4 tokens, lengths up to 64.
fn small(dir: &Path) -> Vec<String> {
    let prompts = common::two_prompts(dir);
    [
        "--device",
        "CPU",
        "--tokens",
        "4",
        "--max-length",
        "64",
        "--prompts",
        prompts.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

/// Runs `validate --ir ir` with `args` and `--json` into `dir`; the exit code, the JSON and the standard error.
fn validate(dir: &Path, name: &str, ir: &Path, args: &[String]) -> (Option<i32>, Value, String) {
    let j = dir.join(format!("{name}.json"));
    let mut all = vec!["validate", "--ir", ir.to_str().unwrap()];
    all.extend(args.iter().map(String::as_str));
    all.extend(["--json", j.to_str().unwrap()]);
    let o = qwen35(&all);
    let err = stderr(&o);
    assert!(
        j.exists(),
        "{all:?} wrote no report: {}\n{err}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(!err.contains("panicked"), "{err}");
    let v = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    (o.status.code(), v, err)
}

fn check<'a>(v: &'a Value, id: &str) -> &'a Value {
    v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("no check `{id}`"))
}

fn failed(v: &Value) -> Vec<&str> {
    v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["passed"] == false)
        .map(|c| c["id"].as_str().unwrap())
        .collect()
}

#[test]
fn the_f32_export_passes_every_check_that_applies_and_the_others_are_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let md = tmp.path().join("r.md");
    let mut args = small(tmp.path());
    args.extend(["--report".into(), md.display().to_string()]);
    let (code, v, _) = validate(tmp.path(), "f32", &ir("tiny-f32"), &args);
    assert_eq!(code, Some(0), "failed: {:?}", failed(&v));
    assert_eq!(v["passed"], true);
    let ids: Vec<&str> = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, CHECKS);
    // Skipped checks are neither passed nor failed, and say why; the IR declares no static context, so the
    // over-long check is skipped too.
    for c in v["checks"].as_array().unwrap() {
        let id = c["id"].as_str().unwrap();
        if SKIPPED.contains(&id) || id == "over-long" {
            assert!(c["passed"].is_null(), "{c}");
            assert!(!c["skipped"].as_str().unwrap().is_empty(), "{c}");
        } else {
            assert_eq!(c["passed"], true, "{c}");
            assert!(c["skipped"].is_null(), "{c}");
        }
    }
    assert!(
        check(&v, "prompt-lookup")["skipped"]
            .as_str()
            .unwrap()
            .contains("inside OpenVINO")
    );
    assert!(
        check(&v, "over-long")["skipped"]
            .as_str()
            .unwrap()
            .contains("no static context")
    );
    let i = &v["inputs"];
    assert!(i["ir"].as_str().unwrap().ends_with("tiny-f32"), "{i}");
    assert_eq!(i["ir_reference_weights"], "f32");
    assert_eq!(i["warnings"], serde_json::json!([]));
    assert!(i["block"].is_null() && i["context"].is_null() && i["probe_mode"].is_null());
    // The IR compiled twice (deployed, and fresh for back-to-back), on the CPU at f32.
    let graphs = v["device"]["graphs"].as_array().unwrap();
    assert_eq!(graphs.len(), 2, "{graphs:?}");
    for g in graphs {
        assert_eq!(g["execution_devices"], "CPU", "{g}");
        assert_eq!(g["precision"], "f32", "{g}");
    }
    // Against the reference: the very tokens, logits to f32 rounding; layers and states not exposed.
    let cmp = &v["compare"]["devices"][0];
    assert_eq!(cmp["greedy_matched"], cmp["greedy_total"]);
    assert_eq!(cmp["record"]["backend"], "graph-set");
    assert!(cmp["logits"]["nmse"].as_f64().unwrap() < 1e-10);
    // The prompt in pieces of 1 and 16 (the default for graphs that take any number of tokens per call), the state
    // carried inside the IR, gives the one call's tokens and logits.
    let blocks = check(&v, "blocks");
    let d = &blocks["details"];
    assert_eq!(d["blocks"], serde_json::json!([1, 16]));
    assert!(d["deployed_block"].is_null());
    let runs = d["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 4, "{d}");
    for r in runs {
        assert!(r["against_deployed"]["first_divergence"].is_null(), "{r}");
        assert!(r["prompt_logits"]["nmse"].as_f64().unwrap() < 1e-10, "{r}");
        assert!(r["calls"].as_u64().unwrap() >= 2, "{r}");
    }
    // Continuing the IR's own state equals the conversation from scratch.
    let reuse = &check(&v, "prefix-reuse")["details"];
    assert!(reuse["agreement"]["first_divergence"].is_null(), "{reuse}");
    assert!(reuse["agreement"]["logits"]["nmse"].as_f64().unwrap() < 1e-10);
    // A reset leaves nothing behind: bit-identical to a freshly compiled IR.
    let b2b = &check(&v, "back-to-back")["details"];
    assert_eq!(b2b["prompt_logits"]["max_abs"], 0.0);
    assert_eq!(b2b["generated"]["logits"]["max_abs"], 0.0);
    // Length: logits only (the state is not exposed), up to --max-length.
    let length = &check(&v, "length")["details"];
    assert!(length["first_failing"].is_null());
    assert!(length["context"].is_null());
    let points = length["points"].as_array().unwrap();
    let lengths: Vec<u64> = points
        .iter()
        .map(|p| p["length"].as_u64().unwrap())
        .collect();
    assert_eq!(lengths, [4, 8, 16, 32, 64]);
    assert!(points.iter().all(|p| p["state"].is_null()));

    let report = std::fs::read_to_string(&md).unwrap();
    for needle in [
        "**PASS**",
        "| graphs | `",
        "stateful IR made elsewhere",
        "tiny-f32",
        "| probe | SKIP |",
        "| over-long | SKIP |",
        "neither passed nor failed",
        "### prompt-lookup — SKIP",
        "## Appendix: the compare-devices report",
    ] {
        assert!(report.contains(needle), "the Markdown has no `{needle}`");
    }
    assert!(!report.contains("Appendix: the probe report"));

    // A device that goes wrong from position 40 on: on the IR too the length check finds exactly 40, and the
    // checks whose runs stay below it (or see it on both sides) pass.
    args.extend(["--inject-fault".into(), "logits-from=40".into()]);
    let (code, v, _) = validate(tmp.path(), "late", &ir("tiny-f32"), &args);
    assert_eq!(code, Some(1));
    assert_eq!(failed(&v), ["length"]);
    let length = &check(&v, "length")["details"];
    assert_eq!(length["first_failing"], 40, "{length}");
    assert_eq!(length["bisection_between"], serde_json::json!([32, 64]));
}

#[test]
fn the_int4_export_passes_on_the_nncf_rule_and_fails_compare_on_the_plain_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |weights: &str| {
        let mut args = small(tmp.path());
        args.extend(["--weights".into(), weights.into()]);
        validate(
            tmp.path(),
            &weights.replace(':', "_"),
            &ir("tiny-int4"),
            &args,
        )
    };
    let (code, v, err) = run("int4-nncf:32");
    assert_eq!(code, Some(0), "failed: {:?}", failed(&v));
    assert_eq!(v["inputs"]["ir_reference_weights"], "int4-nncf:32");
    assert_eq!(v["inputs"]["weights"], "int4-nncf:32");
    assert_eq!(v["inputs"]["warnings"], serde_json::json!([]));
    assert!(!err.contains("warning"), "{err}");

    // The plain rule keeps the DeltaNet conv weights float, which the export holds in INT8: a warning, and the
    // compare check fails on it.
    let (code, v, err) = run("int4:32");
    assert_eq!(code, Some(1));
    assert!(
        err.contains("warning") && err.contains("int4-nncf:32"),
        "{err}"
    );
    let warnings = v["inputs"]["warnings"].as_array().unwrap();
    assert_eq!(warnings.len(), 1);
    assert!(
        warnings[0]
            .as_str()
            .unwrap()
            .contains("`--weights int4:32`")
    );
    let compare = check(&v, "compare");
    assert_eq!(compare["passed"], false, "{compare}");
    assert!(
        compare["failures"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f.as_str().unwrap().contains("--max-nmse"))
    );
    assert!(
        compare["next"]
            .as_str()
            .unwrap()
            .contains("reference_weights")
    );
    // The IR against itself is unaffected by the reference's weights.
    for id in ["blocks", "prefix-reuse", "back-to-back"] {
        assert_eq!(check(&v, id)["passed"], true, "{}", check(&v, id));
    }
}

/// A copy of the f32 export in `dir/name` with its manifest changed by `edit`.
fn f32_copy(dir: &Path, name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let out = dir.join(name);
    std::fs::create_dir(&out).unwrap();
    for f in ["openvino_model.xml", "openvino_model.bin"] {
        std::fs::copy(ir("tiny-f32").join(f), out.join(f)).unwrap();
    }
    let text = std::fs::read_to_string(ir("tiny-f32").join("manifest.json")).unwrap();
    let mut m: Value = serde_json::from_str(&text).unwrap();
    m["model"] = testdata().join("models/tiny").display().to_string().into();
    edit(&mut m);
    std::fs::write(out.join("manifest.json"), m.to_string()).unwrap();
    out
}

/// A copy of the f32 export whose manifest declares a static context of `context` tokens.
fn with_context(dir: &Path, context: usize) -> PathBuf {
    f32_copy(dir, &format!("tiny-f32-context-{context}"), |m| {
        m["context"] = context.into()
    })
}

#[test]
fn a_mask_that_forgets_the_past_fails_the_checks_of_successive_calls() {
    // The manifest maps `attention_mask` as [batch, tokens]: a call after others masks only its own tokens. The
    // prompt in one call is right, so what fails is every run of several calls: the pieces, the continued turn.
    let tmp = tempfile::tempdir().unwrap();
    let bad = f32_copy(tmp.path(), "short-mask", |m| {
        m["inputs"]["attention_mask"]["shape"] = serde_json::json!(["batch", "tokens"])
    });
    let (code, v, _) = validate(tmp.path(), "mask", &bad, &small(tmp.path()));
    assert_eq!(code, Some(1));
    let f = failed(&v);
    for id in ["blocks", "prefix-reuse"] {
        assert!(f.contains(&id), "{id} passed: {}", check(&v, id));
        assert!(
            check(&v, id)["next"]
                .as_str()
                .unwrap()
                .contains("attention_mask")
        );
    }
    let runs = check(&v, "blocks")["details"]["runs"].as_array().unwrap();
    assert!(
        runs.iter()
            .all(|r| r["prompt_logits"]["nmse"].as_f64().unwrap() > 1e-4),
        "{runs:?}"
    );
    // The same IR on the same calls twice: still deterministic.
    assert_eq!(check(&v, "back-to-back")["passed"], true);
}

#[test]
fn a_static_context_in_the_manifest_brings_the_over_long_check_back() {
    let tmp = tempfile::tempdir().unwrap();
    let ir64 = with_context(tmp.path(), 64);
    let args: Vec<String> = small(tmp.path())
        .into_iter()
        .filter(|a| a != "--max-length" && a != "64")
        .collect();
    let (code, v, _) = validate(tmp.path(), "context", &ir64, &args);
    assert_eq!(code, Some(0), "failed: {:?}", failed(&v));
    assert_eq!(v["inputs"]["context"], 64);
    let over = check(&v, "over-long");
    assert_eq!(over["passed"], true, "{over}");
    assert_eq!(over["details"]["prompt_tokens"], 65);
    assert!(
        over["details"]["device_error"]
            .as_str()
            .unwrap()
            .contains("static context holds 64"),
        "{over}"
    );
    // The commands' own refusal names where the context came from: the manifest, not a flag `--ir` refuses.
    let command = over["details"]["command_error"].as_str().unwrap();
    assert!(
        command.contains("manifest.json") && !command.contains("--context"),
        "{command}"
    );
    // The length check defaults to the context less the decode step's slot.
    assert_eq!(check(&v, "length")["details"]["max_length"], 63);
    for id in SKIPPED {
        assert!(check(&v, id)["passed"].is_null());
    }
    // What does not fit the declared context is refused before anything runs.
    let mut long = args.clone();
    long.extend(["--max-length".into(), "64".into()]);
    let mut all = vec!["validate", "--ir", ir64.to_str().unwrap()];
    all.extend(long.iter().map(String::as_str));
    expect_error(&all, &["--max-length 64", "static context holds 64"]);
}

#[test]
fn validate_ir_errors_are_clear() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().to_str().unwrap();
    let f32 = ir("tiny-f32");
    let f32 = f32.to_str().unwrap();
    expect_error(
        &["validate", "--ir", "no/such/dir"],
        &["--ir no/such/dir", "not a directory"],
    );
    expect_error(
        &["validate", "--ir", empty],
        &["openvino_model.xml", "does not exist"],
    );
    expect_error(
        &["validate", "--ir", f32, "--probe-mode", "chained"],
        &[
            "--probe-mode",
            "probe",
            "per-layer graphs",
            "inside OpenVINO",
        ],
    );
    expect_error(
        &["validate", "--ir", f32, "--lookup-tokens", "8"],
        &["--lookup-tokens", "prompt-lookup", "inside OpenVINO"],
    );
    expect_error(
        &["validate", "--ir", f32, "--block", "8"],
        &["--block", "made elsewhere"],
    );
    expect_error(
        &["validate", "--ir", f32, "--inject-fault", "leak-state"],
        &["--inject-fault leak-state", "logits-from"],
    );
    expect_error(
        &["validate", "--ir", f32, "--device", "FP16SIM"],
        &["FP16SIM", "OpenVINO device"],
    );
    expect_error(
        &["validate", "--ir", f32, "--blocks", "1,0"],
        &["--blocks", "at least 1"],
    );
    // A declared context the shipped prompts do not fit.
    let ir16 = with_context(tmp.path(), 16);
    expect_error(
        &[
            "validate",
            "--ir",
            ir16.to_str().unwrap(),
            "--max-length",
            "8",
        ],
        &["prompt `river`", "static context holds 16"],
    );
}
