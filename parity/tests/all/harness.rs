//! The parity harness on the CPU device: compare-devices, probe and diff agree with the reference at f32 and exit 0,
//! fail (exit 1) when a threshold is set tighter than the measured error, write every report, and refuse bad input
//! clearly. (Fault injection is in `faults.rs`.)

use std::path::Path;

use crate::common;
use common::{expect_error, qwen35, stderr};

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Every key the JSON documentation of `report::compare` promises.
fn assert_compare_keys(v: &serde_json::Value) {
    for k in [
        "schema_version",
        "tool",
        "passed",
        "machine",
        "inputs",
        "quantization",
        "devices",
    ] {
        assert!(v.get(k).is_some(), "no `{k}` in {v}");
    }
    assert_eq!(v["schema_version"], 2);
    let d = &v["devices"][0];
    for k in [
        "device",
        "record",
        "thresholds",
        "passed",
        "failures",
        "greedy_matched",
        "greedy_total",
        "all",
        "prompt_positions",
        "generated_positions",
        "near_ties",
        "confident",
        "logits",
        "final_norm",
        "layers",
        "states",
        "tapped_vs_deployed",
        "first_divergence",
        "prompt_tokens_per_s",
        "decode_tokens_per_s",
        "prompts",
    ] {
        assert!(d.get(k).is_some(), "no `devices[0].{k}`");
    }
    for k in [
        "positions",
        "same_top1",
        "top5_overlap",
        "kl_mean",
        "kl_p99",
        "kl_max",
        "delta_p_mean",
        "delta_p_rms",
        "near_tie_flips",
        "confident_flips",
        "eos_drift_max",
        "eos_drift_mean",
    ] {
        assert!(d["all"].get(k).is_some(), "no `all.{k}`");
    }
    for k in [
        "max_abs", "nmse", "nrmse", "rel_l2", "cosine", "nan", "inf", "count",
    ] {
        assert!(d["logits"].get(k).is_some(), "no `logits.{k}`");
    }
    for k in [
        "layer",
        "kind",
        "output",
        "mixer",
        "mlp",
        "nrmse_by_position",
    ] {
        assert!(d["layers"][0].get(k).is_some(), "no `layers[0].{k}`");
    }
    assert!(d["record"]["precision"].is_string());
}

#[test]
fn compare_devices_agrees_at_f32_and_writes_every_report() {
    let tmp = tempfile::tempdir().unwrap();
    let (j, md, svg) = (
        tmp.path().join("r.json"),
        tmp.path().join("r.md"),
        tmp.path().join("r.svg"),
    );
    let o = qwen35(&[
        "compare-devices",
        "--devices",
        "CPU",
        "--context",
        "160",
        "--json",
        j.to_str().unwrap(),
        "--report",
        md.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}\n{}", stderr(&o));
    assert!(out.contains("PASS"), "{out}");
    let v = json(&j);
    assert_compare_keys(&v);
    let d = &v["devices"][0];
    assert_eq!(v["passed"], true);
    assert_eq!(d["record"]["precision"], "f32");
    // The default prompt set: four prompts, 12 greedy tokens each, all identical at f32.
    assert_eq!(v["inputs"]["prompts"].as_array().unwrap().len(), 4);
    assert_eq!(d["greedy_matched"], 48);
    assert_eq!(d["greedy_total"], 48);
    assert_eq!(d["all"]["same_top1"], 1.0);
    // Measured 1.1e-12 (OpenVINO's CPU in f32 against the reference): 1e-11 leaves ~10x for a change of arithmetic.
    assert!(
        d["logits"]["nmse"].as_f64().unwrap() < 1e-11,
        "{}",
        d["logits"]
    );
    for l in d["layers"].as_array().unwrap() {
        assert!(l["output"]["nrmse"].as_f64().unwrap() < 1e-5, "{l}");
    }
    // Hidden states come from graphs with taps; at f32 on the CPU they give the deployed graphs' logits.
    assert!(d["tapped_vs_deployed"].as_f64().unwrap() < 1e-3);
    let report = std::fs::read_to_string(&md).unwrap();
    for needle in [
        "# qwen35 compare-devices report",
        "INFERENCE_PRECISION_HINT",
        "| layer |",
        "KL(P_ref",
    ] {
        assert!(report.contains(needle), "the Markdown has no `{needle}`");
    }
    let chart = std::fs::read_to_string(&svg).unwrap();
    assert!(chart.starts_with("<svg") && chart.contains("<polyline") && chart.contains("layer"));
}

#[test]
fn thresholds_tighter_than_the_measured_error_exit_1() {
    let tmp = tempfile::tempdir().unwrap();
    let j = tmp.path().join("r.json");
    let o = qwen35(&[
        "compare-devices",
        "--devices",
        "CPU",
        "--context",
        "160",
        "--prompt",
        "Why does the river rise?",
        "--tokens",
        "4",
        "--max-nmse",
        "0",
        "--max-layer-nrmse",
        "1e-12",
        "--json",
        j.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let v = json(&j);
    assert_eq!(v["passed"], false);
    let failures: Vec<String> = v["devices"][0]["failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect();
    assert!(
        failures.iter().any(|f| f.contains("--max-nmse")),
        "{failures:?}"
    );
    assert!(
        failures.iter().any(|f| f.contains("--max-layer-nrmse")),
        "{failures:?}"
    );
    // The layer line names layer 0 first: every layer is over a threshold of 1e-12.
    assert_eq!(v["devices"][0]["first_divergence"]["layer"][0], 0);

    let o = qwen35(&[
        "probe",
        "--device",
        "CPU",
        "--context",
        "160",
        "--token-ids",
        "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20",
        "--max-nrmse",
        "1e-12",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
}

#[test]
fn probe_agrees_at_f32_in_both_modes() {
    let tmp = tempfile::tempdir().unwrap();
    for mode in ["isolated", "chained"] {
        let (j, md, svg) = (
            tmp.path().join(format!("{mode}.json")),
            tmp.path().join(format!("{mode}.md")),
            tmp.path().join(format!("{mode}.svg")),
        );
        let o = qwen35(&[
            "probe",
            "--device",
            "CPU",
            "--mode",
            mode,
            "--context",
            "160",
            "--prompt",
            "Why does the river rise in spring?",
            "--json",
            j.to_str().unwrap(),
            "--report",
            md.to_str().unwrap(),
            "--plot",
            svg.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(0), "{mode}: {}", stderr(&o));
        let v = json(&j);
        for k in [
            "schema_version",
            "tool",
            "passed",
            "machine",
            "inputs",
            "record",
            "thresholds",
            "layers",
            "drill_down",
        ] {
            assert!(v.get(k).is_some(), "{mode}: no `{k}`");
        }
        assert_eq!(v["inputs"]["mode"], mode);
        let layers = v["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 4);
        for l in layers {
            for k in [
                "output",
                "mixer",
                "mlp",
                "states",
                "state_drift",
                "block_ends",
                "intermediates",
                "magnitudes",
                "over",
            ] {
                assert!(l.get(k).is_some(), "{mode}: no `layers[].{k}`");
            }
            assert_eq!(l["over"], false);
            assert!(l["output"]["nrmse"].as_f64().unwrap() < 1e-5, "{mode}: {l}");
            // 35 prompt tokens in blocks of 16: the state is compared after each of the three blocks.
            assert_eq!(l["state_drift"].as_array().unwrap().len(), 3);
        }
        assert!(v["drill_down"].is_null());
        assert!(std::fs::read_to_string(&md).unwrap().contains("## Layers"));
        assert!(std::fs::read_to_string(&svg).unwrap().contains("<polyline"));
    }
}

#[test]
fn diff_of_a_dump_with_itself_is_zero_and_a_device_dump_is_close() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, j) = (
        tmp.path().join("ref.safetensors"),
        tmp.path().join("ov.safetensors"),
        tmp.path().join("d.json"),
    );
    let ids = "5,17,33,2,99,140,7,7,301,12,45,6";
    for (out, extra) in [
        (&a, vec![]),
        (&b, vec!["--backend", "openvino", "--context", "64"]),
    ] {
        let mut args = vec![
            "dump",
            "--token-ids",
            ids,
            "--generate",
            "5",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend(extra);
        let o = qwen35(&args);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let o = qwen35(&[
        "diff",
        a.to_str().unwrap(),
        a.to_str().unwrap(),
        "--json",
        j.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&j);
    let d = &v["devices"][0];
    let tensors = d["tensors"].as_array().unwrap();
    assert!(tensors.len() > 50, "{} tensors compared", tensors.len());
    for t in tensors {
        assert_eq!(t["error"]["max_abs"], 0.0, "{t}");
    }
    assert_eq!(d["logits"]["max_abs"], 0.0);
    assert_eq!(d["greedy_matched"], 5);

    let o = qwen35(&[
        "diff",
        b.to_str().unwrap(),
        a.to_str().unwrap(),
        "--json",
        j.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&j);
    assert_eq!(v["devices"][0]["record"]["backend"], "openvino");
    // Measured 7.9e-13 (OpenVINO's CPU in f32 against the reference): 1e-11 leaves ~10x.
    let logits = &v["devices"][0]["logits"];
    assert!(logits["nmse"].as_f64().unwrap() < 1e-11, "{logits}");
    // Dumps of different prompts are not comparable.
    let c = tmp.path().join("other.safetensors");
    let o = qwen35(&["dump", "--token-ids", "1,2,3", "--out", c.to_str().unwrap()]);
    assert!(o.status.success());
    expect_error(
        &["diff", c.to_str().unwrap(), a.to_str().unwrap()],
        &["different prompts"],
    );
}

/// FP16SIM with nothing rounded is a second executor of the graphs: compared like a device, it passes the f32
/// thresholds; its default fp16 arithmetic is reported as what ran.
#[test]
fn fp16sim_is_compared_like_a_device() {
    let tmp = tempfile::tempdir().unwrap();
    let j = tmp.path().join("r.json");
    let o = qwen35(&[
        "compare-devices",
        "--devices",
        "FP16SIM:store=f32,ftz=off,FP16SIM",
        "--context",
        "64",
        "--prompt",
        "Why does the river rise?",
        "--tokens",
        "4",
        "--json",
        j.to_str().unwrap(),
    ]);
    // Exit 1: FP16SIM's default fp16 arithmetic fails the f16 thresholds on this random model (logits NMSE ~0.15
    // against 1e-2 allowed), while the one with nothing rounded passes.
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let v = json(&j);
    assert_eq!(v["passed"], false);
    let devices = v["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    let exact = &devices[0];
    assert_eq!(exact["device"], "FP16SIM:store=f32,ftz=off");
    assert_eq!(exact["record"]["precision"], "f32");
    assert_eq!(exact["passed"], true, "{}", exact["failures"]);
    assert_eq!(exact["greedy_matched"], 4);
    let fp16 = &devices[1];
    assert_eq!(fp16["record"]["precision"], "f16");
    assert_eq!(fp16["passed"], false);
    assert!(
        fp16["failures"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f.as_str().unwrap().contains("--max-nmse")),
        "{}",
        fp16["failures"]
    );
    assert_eq!(fp16["record"]["properties"]["ftz"], "on");
    assert_eq!(
        fp16["record"]["execution_devices"],
        "FP16SIM:store=f16,ftz=on,acc=f32,state=f16,norm=ops"
    );
    // fp16 moves the logits far more than f32 rounding does.
    assert!(
        fp16["logits"]["nmse"].as_f64().unwrap() > 1e3 * exact["logits"]["nmse"].as_f64().unwrap()
    );
}

/// Thresholds from FP16SIM: the CPU device computing bf16 (asked for f16) stays within 3× FP16SIM-bf16's error on
/// every layer, and each layer is judged by its own threshold, 3× the baseline's error there.
#[test]
fn probe_thresholds_from_fp16sim() {
    let tmp = tempfile::tempdir().unwrap();
    let j = tmp.path().join("p.json");
    let o = qwen35(&[
        "probe",
        "--device",
        "CPU",
        "--precision",
        "f16",
        "--tolerance-from",
        "FP16SIM:store=bf16",
        "--context",
        "64",
        "--prompt",
        "Why does the river rise?",
        "--json",
        j.to_str().unwrap(),
    ]);
    let v = json(&j);
    let baseline = &v["baseline"];
    assert_eq!(baseline["device"], "FP16SIM:store=bf16");
    for (l, b) in v["layers"]
        .as_array()
        .unwrap()
        .iter()
        .zip(baseline["layers"].as_array().unwrap())
    {
        let allowed = l["thresholds"]["max_nrmse"].as_f64().unwrap();
        let expected = (3.0 * b[1].as_f64().unwrap()).max(1e-4);
        assert!(
            (allowed - expected).abs() <= 1e-12 * expected,
            "{allowed} vs {expected}"
        );
    }
    // Only a bf16 CPU makes this pass: say what ran if it did not.
    if v["record"]["precision"] == "bf16" {
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
    expect_error(
        &[
            "probe",
            "--device",
            "CPU",
            "--token-ids",
            "1,2",
            "--tolerance-from",
            "FP16SIM",
            "--factor",
            "0.5",
        ],
        &["--factor"],
    );
}

/// The range report names what fp16 cannot hold: eps 1e-6 is an fp16 subnormal (flushed: zero), and on the tiny
/// model the ×1024-rescaled DeltaNet outputs square past 65504 in the gated norm (what FP16SIM shows at ×1024).
#[test]
fn ranges_name_what_fp16_cannot_hold() {
    let tmp = tempfile::tempdir().unwrap();
    let j = tmp.path().join("r.json");
    let o = qwen35(&["ranges", "--json", j.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&j);
    assert_eq!(v["storage"], "f16");
    let constants = v["constants"].as_array().unwrap();
    let eps = constants
        .iter()
        .find(|c| c["name"].as_str().unwrap().starts_with("rms_norm_eps"))
        .unwrap();
    assert_eq!(eps["subnormal"], true, "{eps}");
    let gated = constants
        .iter()
        .find(|c| c["name"].as_str().unwrap().starts_with("gated norm eps"))
        .unwrap();
    assert_eq!(
        gated["subnormal"], false,
        "eps × 1024² is a normal fp16: {gated}"
    );
    let first = v["first_overflow"].as_str().unwrap();
    assert!(
        first.starts_with("layers.0.linear_attn.core_output squared"),
        "{first}"
    );
    // Without the rescaling nothing overflows, and the gated norm's eps is flushed instead.
    let o = qwen35(&[
        "ranges",
        "--output-scale",
        "1",
        "--json",
        j.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&j);
    assert!(v["first_overflow"].is_null(), "{}", v["first_overflow"]);
    assert!(
        v["constants"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["subnormal"] == true)
    );
}

#[test]
fn harness_errors_are_clear() {
    expect_error(
        &["compare-devices", "--devices", "FP16SIM:ftz=maybe"],
        &["--devices", "ftz"],
    );
    expect_error(
        &[
            "dump",
            "--backend",
            "openvino",
            "--device",
            "FP16SIM",
            "--precision",
            "f16",
            "--token-ids",
            "1",
            "--out",
            "never-written.safetensors",
        ],
        &["--precision", "FP16SIM"],
    );
    expect_error(
        &["compare-devices", "--devices", "NO_SUCH_DEVICE"],
        &["--devices", "NO_SUCH_DEVICE", "available"],
    );
    expect_error(&["compare-devices", "--tokens", "0"], &["--tokens"]);
    expect_error(&["compare-devices", "--max-kl=-1"], &["--max-kl"]);
    expect_error(
        &["compare-devices", "--min-token-agreement", "2"],
        &["--min-token-agreement"],
    );
    expect_error(
        &["compare-devices", "--context", "16"],
        &["static context", "--context"],
    );
    expect_error(
        &["compare-devices", "--token-ids", "1,2,900"],
        &["900", "vocabulary"],
    );
    expect_error(
        &[
            "compare-devices",
            "--json",
            "/no/such/dir/r.json",
            "--token-ids",
            "1",
        ],
        &["--json", "/no/such/dir"],
    );
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("p.jsonl");
    std::fs::write(&bad, "{\"prompt\": \"hi\"}\n{\"promt\": \"typo\"}\n").unwrap();
    expect_error(
        &["compare-devices", "--prompts", bad.to_str().unwrap()],
        &["p.jsonl:2", "promt"],
    );
    expect_error(
        &[
            "probe",
            "--device",
            "CPU",
            "--token-ids",
            "1,2",
            "--layers",
            "9",
        ],
        &["--layers", "9"],
    );
    expect_error(
        &["probe", "--device", "NO_SUCH_DEVICE", "--token-ids", "1,2"],
        &["NO_SUCH_DEVICE"],
    );
    expect_error(
        &[
            "probe",
            "--device",
            "CPU",
            "--token-ids",
            "1,2",
            "--mode",
            "sideways",
        ],
        &["--mode"],
    );
    expect_error(
        &["diff", "/no/such/a.safetensors", "/no/such/b.safetensors"],
        &["/no/such/a.safetensors"],
    );
}
