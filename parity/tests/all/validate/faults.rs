//! A fault injected into the device (`--inject-fault`) fails the one check that looks for it, and every other check
//! passes: one small validate run per fault, on this project's graphs at f32 (nothing is skipped there).

use super::{CHECKS, check, failed, small, validate};
use serde_json::Value;
use std::path::Path;

/// Validates the small set with `fault`: exit 1, the check `id` failed, every other one passed. Returns the report.
fn only_fails(dir: &Path, name: &str, fault: &str, id: &str) -> Value {
    fails_exactly(dir, name, fault, &[id])
}

/// Validates the small set with `fault`: exit 1, exactly the checks `ids` failed (in report order), every other one
/// passed. Returns the report.
fn fails_exactly(dir: &Path, name: &str, fault: &str, ids: &[&str]) -> Value {
    let mut args = small(dir);
    args.extend(["--inject-fault".to_string(), fault.to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, v) = validate(dir, name, &args);
    assert_eq!(v["inputs"]["fault"], fault);
    assert_eq!(failed(&v), ids, "{fault}");
    assert_eq!(code, Some(1), "{fault}");
    for other in CHECKS.iter().filter(|c| !ids.contains(c)) {
        let c = check(&v, other);
        if *other == "images" && c["skipped"].is_string() {
            continue; // no --image given
        }
        assert_eq!(c["passed"], true, "{fault}: {c}");
    }
    v
}

/// The failures of check `id`, one string.
fn failures(v: &Value, id: &str) -> String {
    serde_json::to_string(&check(v, id)["failures"]).unwrap()
}

#[test]
fn graphs_of_one_block_size_fail_the_blocks_check_alone() {
    let tmp = tempfile::tempdir().unwrap();
    // The graphs compiled for blocks of 1 scale their logits by 1 + 1e-3: the same tokens, an NMSE of ~1e-6.
    let v = only_fails(tmp.path(), "block", "block-graph=1", "blocks");
    let f = failures(&v, "blocks");
    assert!(f.contains("blocks of 1 vs deployed"), "{f}");
    assert!(f.contains("the prompt positions' logits NMSE"), "{f}");
    for r in check(&v, "blocks")["details"]["runs"].as_array().unwrap() {
        assert!(r["against_deployed"]["first_divergence"].is_null(), "{r}");
    }
}

#[test]
fn a_prompt_fed_unpadded_that_leaves_another_state_fails_the_padding_check_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let v = only_fails(tmp.path(), "pad", "unpadded-tail", "padding");
    let f = failures(&v, "padding");
    assert!(
        f.contains("the state after the prompt") && f.contains("recurrent_state"),
        "{f}"
    );
    assert!(
        check(&v, "padding")["details"]["padded_slots"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[test]
fn verify_blocks_with_stale_rows_fail_the_prompt_lookup_check_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let v = only_fails(tmp.path(), "rows", "stale-rows", "prompt-lookup");
    let f = failures(&v, "prompt-lookup");
    assert!(f.contains("prompt lookup vs greedy"), "{f}");
    let verify: u64 = check(&v, "prompt-lookup")["details"]["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["verify_calls"].as_u64().unwrap())
        .sum();
    assert!(verify > 0, "no verify block ran");
}

#[test]
fn hidden_outputs_scaled_fail_the_compare_check_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let v = only_fails(tmp.path(), "taps", "taps-scaled", "compare");
    let f = failures(&v, "compare");
    assert!(f.contains("--max-layer-nrmse"), "{f}");
    // The logits are right: only the hidden outputs are off.
    assert!(!f.contains("--max-nmse"), "{f}");
}

#[test]
fn one_layers_own_graph_wrong_fails_the_probe_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let v = only_fails(tmp.path(), "layer", "layer-graph=2", "probe");
    let f = failures(&v, "probe");
    assert!(
        f.contains("layer 2 ") && f.contains("--probe-max-nrmse"),
        "{f}"
    );
    let over: Vec<u64> = v["probe"]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["over"] == true)
        .map(|l| l["layer"].as_u64().unwrap())
        .collect();
    assert_eq!(over, [2]);
    assert_eq!(v["probe"]["drill_down"]["first_over"], "mlp_output");
}

#[test]
fn logits_wrong_past_a_length_fail_the_length_check_alone() {
    let tmp = tempfile::tempdir().unwrap();
    // Every other check's runs stay below position 40 or compare the device with itself; the length check's
    // bisection finds exactly 40 (the prompt of 40 tokens is the first whose decode step, at position 40, is wrong).
    let v = only_fails(tmp.path(), "late", "logits-from=40", "length");
    let length = check(&v, "length");
    assert_eq!(length["details"]["first_failing"], 40, "{length}");
    assert_eq!(
        length["details"]["bisection_between"],
        serde_json::json!([31, 63])
    );
    let points = length["details"]["points"].as_array().unwrap();
    let at = |l: u64| points.iter().find(|p| p["length"] == l).unwrap()["passed"].clone();
    assert_eq!(at(39), true);
    assert_eq!(at(40), false);
}

#[test]
fn a_device_that_cuts_an_over_long_prompt_fails_the_over_long_check_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let v = only_fails(tmp.path(), "cut", "overflow", "over-long");
    let f = failures(&v, "over-long");
    assert!(
        f.contains("the device ran a prompt of 129 tokens on a static context of 128"),
        "{f}"
    );
    assert!(check(&v, "over-long")["details"]["device_error"].is_null());
}

/// A restore that does nothing fails the two checks that go back to a snapshot, the follow-up turn and the lookup's
/// verify blocks (which restore after a rejected draft), and no other. (A state kept between sequences,
/// `leak-state`, is no such fault: every check that runs one sequence after another sees it, `validate.rs`.)
#[test]
fn a_restore_that_does_nothing_fails_the_checks_that_restore_and_no_other() {
    let tmp = tempfile::tempdir().unwrap();
    let v = fails_exactly(
        tmp.path(),
        "restore",
        "ignore-restore",
        &["prefix-reuse", "prompt-lookup"],
    );
    assert!(failures(&v, "prefix-reuse").contains("position"));
}
