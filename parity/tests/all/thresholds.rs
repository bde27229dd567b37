//! Every threshold flag fails a run that passes without it: a run that passes (exit 0), then the same run with one
//! threshold set just tighter than what that run's JSON measured, which exits 1 with one failure line, naming that
//! threshold. On FP16SIM (fp16 arithmetic, a nonzero error on every measure) for compare-devices' `--max-kl`,
//! `--min-token-agreement` and `--max-state-nrmse`, on the CPU device at f32 (errors of ~1e-8) for validate's probe
//! thresholds, and on a dump of the CPU device against the reference's for diff's `--max-nmse` (finite values: the
//! NaN case is `non_finite.rs`). `--max-confident-flips` cannot be shown so (no passing run has a confident flip, see
//! its test).

use serde_json::Value;
use std::path::Path;

use crate::common;
use common::{dump, qwen35, stderr};

/// Runs `qwen35 args --json DIR/NAME.json`: the exit code and the JSON.
fn run(dir: &Path, name: &str, args: &[&str]) -> (Option<i32>, Value) {
    let j = dir.join(format!("{name}.json"));
    let mut all = args.to_vec();
    all.extend(["--json", j.to_str().unwrap()]);
    let o = qwen35(&all);
    assert!(j.exists(), "{args:?} wrote no JSON: {}", stderr(&o));
    let v = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    (o.status.code(), v)
}

/// The failure lines of compare-devices' only device.
fn device_failures(v: &Value) -> Vec<String> {
    v["devices"][0]["failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect()
}

/// `x` a little tighter (smaller), as the flag's text: the run measured `x` and passed, so `x` itself is the
/// loosest threshold it meets.
fn below(x: f64) -> String {
    assert!(x > 0.0, "nothing to tighten: the run measured {x}");
    format!("{:e}", x * 0.999)
}

#[test]
fn compare_devices_thresholds_each_fail_a_run_that_passed() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = common::two_prompts(tmp.path());
    let base = [
        "compare-devices",
        "--devices",
        "FP16SIM",
        "--context",
        "64",
        "--prompts",
        prompts.to_str().unwrap(),
        "--tokens",
        "12",
        // Loose enough for fp16's error on this random model, so that the run passes and each threshold below
        // is the only one that can fail.
        "--max-nmse",
        "1",
        "--max-layer-nrmse",
        "10",
    ];
    let loose = [
        ("--max-kl", "100"),
        ("--min-token-agreement", "0"),
        ("--max-state-nrmse", "100"),
    ];
    let with = |tight: Option<(&str, &str)>| -> Vec<String> {
        let mut a: Vec<String> = base.iter().map(|s| s.to_string()).collect();
        for (flag, value) in loose {
            let value = match tight {
                Some((f, v)) if f == flag => v,
                _ => value,
            };
            a.extend([flag.to_string(), value.to_string()]);
        }
        a
    };
    let args = with(None);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, v) = run(tmp.path(), "pass", &args);
    assert_eq!(code, Some(0), "{:?}", device_failures(&v));
    let d = &v["devices"][0];
    let kl = d["all"]["kl_mean"].as_f64().unwrap();
    let top1 = d["all"]["same_top1"].as_f64().unwrap();
    let state = d["states"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["error"]["nrmse"].as_f64().unwrap())
        .fold(0.0, f64::max);
    println!(
        "FP16SIM, two prompts, 12 tokens: mean KL {kl:.3e}, same top-1 {top1}, worst state NRMSE {state:.3e}"
    );
    assert!(top1 < 1.0, "fp16 flips no token here: top-1 {top1}");
    let tight = [
        ("--max-kl", below(kl)),
        // Just above the share measured: one more agreeing position than there were would be needed.
        ("--min-token-agreement", format!("{:e}", top1 + 1e-6)),
        ("--max-state-nrmse", below(state)),
    ];
    for (flag, value) in &tight {
        let args = with(Some((flag, value)));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, v) = run(tmp.path(), &flag[2..], &args);
        let f = device_failures(&v);
        assert_eq!(code, Some(1), "{flag} {value}: {f:?}");
        assert_eq!(f.len(), 1, "{flag} {value}: {f:?}");
        assert!(f[0].contains(flag), "{flag} {value}: {f:?}");
    }
}

/// A confident flip (a position where the top tokens differ and the reference's top-two margin exceeds twice the
/// largest logit difference there) cannot happen with finite logits: for the device to prefer `b` over the
/// reference's top `a`, `Δb − Δa ≥ ref[a] − ref[b] ≥ margin`, so `2·max|Δ| ≥ margin`, a near tie. Only a row holding a
/// NaN or an infinity flips confidently, and such a run already fails on its non-finite logits: no run that passes
/// has a confident flip to tighten below. What is shown instead: on a run with NaN logits (tiny-h128 under FP16SIM
/// without the ×1024 output rescaling, see `fp16_story.rs`) the flips are counted, and `--max-confident-flips` one
/// below the count adds its own failure line, which the count itself does not.
#[test]
fn max_confident_flips_adds_its_line_below_the_count() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::testdata().join("models/tiny-h128");
    let args = |flips: &str| -> Vec<String> {
        [
            "compare-devices",
            "--model",
            model.to_str().unwrap(),
            "--devices",
            "FP16SIM",
            "--output-scale",
            "1",
            "--context",
            "64",
            "--prompt",
            "Why does the river rise in spring?",
            "--tokens",
            "4",
            "--max-confident-flips",
            flips,
        ]
        .map(String::from)
        .to_vec()
    };
    let a = args("1000");
    let (code, v) = run(
        tmp.path(),
        "nan",
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let f = device_failures(&v);
    assert_eq!(code, Some(1), "{f:?}");
    assert!(f.iter().any(|f| f.contains("NaN")), "{f:?}");
    assert!(
        !f.iter().any(|f| f.contains("--max-confident-flips")),
        "{f:?}"
    );
    let flips = v["devices"][0]["all"]["confident_flips"].as_u64().unwrap();
    println!("FP16SIM x1 on tiny-h128: {flips} confident flips");
    assert!(flips > 0);
    let a = args(&(flips - 1).to_string());
    let (code, v) = run(
        tmp.path(),
        "tight",
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let tight = device_failures(&v);
    assert_eq!(code, Some(1), "{tight:?}");
    let added: Vec<&String> = tight.iter().filter(|l| !f.contains(l)).collect();
    assert_eq!(added.len(), 1, "{tight:?}");
    assert!(added[0].contains("--max-confident-flips"), "{added:?}");
}

#[test]
fn validate_probe_thresholds_each_fail_a_run_that_passed() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = common::two_prompts(tmp.path());
    let base = [
        "validate",
        "--device",
        "CPU",
        "--context",
        "64",
        "--tokens",
        "2",
        "--lookup-tokens",
        "4",
        "--blocks",
        "1,16",
        "--max-length",
        "40",
        "--prompts",
        prompts.to_str().unwrap(),
    ];
    let (code, v) = run(tmp.path(), "pass", &base);
    assert_eq!(code, Some(0), "{}", v["checks"]);
    let layers = v["probe"]["layers"].as_array().unwrap();
    let worst = |f: &dyn Fn(&Value) -> Vec<f64>| layers.iter().flat_map(f).fold(0.0, f64::max);
    let output = worst(&|l| {
        ["output", "mixer", "mlp"]
            .iter()
            .filter_map(|k| l[k]["nrmse"].as_f64())
            .collect()
    });
    let state = worst(&|l| {
        l["states"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["error"]["nrmse"].as_f64().unwrap())
            .chain(
                l["state_drift"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap()),
            )
            .collect()
    });
    println!("CPU f32 probe: worst output NRMSE {output:.3e}, worst state NRMSE {state:.3e}");
    for (flag, value) in [
        ("--probe-max-nrmse", below(output)),
        ("--probe-max-state-nrmse", below(state)),
    ] {
        let mut args = base.to_vec();
        args.extend([flag, &value]);
        let (code, v) = run(tmp.path(), &flag[2..], &args);
        let failed: Vec<&Value> = v["checks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["passed"] == false)
            .collect();
        assert_eq!(code, Some(1), "{flag} {value}: {failed:?}");
        assert_eq!(failed.len(), 1, "{flag} {value}: {failed:?}");
        assert_eq!(failed[0]["id"], "probe");
        let lines = serde_json::to_string(&failed[0]["failures"]).unwrap();
        assert!(lines.contains(flag), "{flag} {value}: {lines}");
    }
}

#[test]
fn diff_exits_1_on_dumps_that_differ_beyond_its_threshold() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (
        tmp.path().join("ref.safetensors"),
        tmp.path().join("ov.safetensors"),
    );
    let ids = "5,17,33,2,99,140,7,7,301,12,45,6";
    dump(tmp.path(), "ref.safetensors", ids, 3, &[]);
    let openvino = ["--backend", "openvino", "--context", "64"];
    dump(tmp.path(), "ov.safetensors", ids, 3, &openvino);
    let (b_s, a_s) = (b.to_str().unwrap(), a.to_str().unwrap());
    let (code, v) = run(tmp.path(), "pass", &["diff", b_s, a_s]);
    assert_eq!(code, Some(0), "{:?}", device_failures(&v));
    // OpenVINO's CPU device against the reference, both f32: a rounding-sized difference, finite everywhere.
    let nmse = v["devices"][0]["logits"]["nmse"].as_f64().unwrap();
    let max_nmse = below(nmse);
    let (code, v) = run(
        tmp.path(),
        "tight",
        &["diff", b_s, a_s, "--max-nmse", &max_nmse],
    );
    let f = device_failures(&v);
    assert_eq!(code, Some(1), "{f:?}");
    assert_eq!(f.len(), 1, "{f:?}");
    assert!(
        f[0].contains("--max-nmse") && !f[0].contains("NaN"),
        "{f:?}"
    );
}
