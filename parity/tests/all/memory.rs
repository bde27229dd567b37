//! Memory known before work: a command whose estimated peak does not fit the memory available refuses up front,
//! with the figure, what it holds, and the options that would fit; the JSON report carries the estimate beside the
//! peak measured.

use crate::common;

use common::{expect_error_env, qwen35_env, stderr, testdata};

fn tiny() -> String {
    testdata().join("models/tiny").display().to_string()
}

const IDS: &str = "5,17,33,2,99,140,7,7";

/// The estimate a refusal states (`about X MiB`), in MiB.
fn stated_mib(err: &str) -> f64 {
    let rest = err
        .split("would hold about ")
        .nth(1)
        .unwrap_or_else(|| panic!("no estimate in: {err}"));
    let mut words = rest.split_whitespace();
    let value: f64 = words.next().unwrap().parse().unwrap();
    match words.next().unwrap() {
        "MiB" => value,
        "GiB" => value * 1024.0,
        u => panic!("unit {u} in: {err}"),
    }
}

#[test]
fn compare_devices_refuses_before_any_work_when_the_estimate_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let model = tiny();
    let args = [
        "compare-devices",
        "--model",
        &model,
        "--devices",
        "CPU",
        "--token-ids",
        IDS,
        "--tokens",
        "2",
        "--json",
        json.to_str().unwrap(),
    ];
    expect_error_env(
        &args,
        &[("QWEN35_MEMORY_GIB", "0.00001")],
        &[
            "compare-devices would hold about",
            "CPU: deployed graphs",
            "f32 weights",
            "QWEN35_MEMORY_GIB",
        ],
    );
    assert!(!json.exists(), "a refused run writes no report");
}

#[test]
fn a_refusal_offers_the_weights_that_would_fit() {
    let model = tiny();
    let run = |weights: &str, budget: &str| {
        qwen35_env(
            &[
                "compare-devices",
                "--model",
                &model,
                "--devices",
                "CPU",
                "--weights",
                weights,
                "--token-ids",
                IDS,
                "--tokens",
                "2",
            ],
            &[("QWEN35_MEMORY_GIB", budget)],
        )
    };
    // What int4 needs, as its own refusal states it; then f32 with a little more than that.
    let int4 = stated_mib(&stderr(&run("int4", "0.00001")));
    let f32_err = stderr(&run("f32", "0.00001"));
    let f32 = stated_mib(&f32_err);
    assert!(int4 < f32, "int4 {int4} MiB, f32 {f32} MiB");
    let budget = (int4 + 0.2) / 1024.0;
    assert!(budget * 1024.0 < f32, "the budget must sit between the two");
    let o = run("f32", &format!("{budget}"));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("these would fit: ") && err.contains("--weights int4 (about"),
        "{err}"
    );
}

/// An MoE model's masked prompt blocks compile its experts twice over on a plugin: a refusal offers the gathered
/// form, and a single one-token graph, when they would fit.
#[test]
fn a_refusal_offers_gathered_experts_and_one_token_graphs() {
    let model = testdata().join("models/tiny-moe").display().to_string();
    let run = |extra: &[&str], budget: &str| {
        let mut args = vec![
            "compare-devices",
            "--model",
            &model,
            "--devices",
            "CPU",
            "--token-ids",
            IDS,
            "--tokens",
            "2",
        ];
        args.extend_from_slice(extra);
        qwen35_env(&args, &[("QWEN35_MEMORY_GIB", budget)])
    };
    let masked = ["--moe-form", "masked", "--block", "16"];
    let gather = stated_mib(&stderr(&run(&["--moe-form", "gather"], "0.00001")));
    let one = stated_mib(&stderr(&run(&["--block", "1"], "0.00001")));
    let full = stated_mib(&stderr(&run(&masked, "0.00001")));
    assert!(
        gather < full && one < full,
        "gather {gather}, block 1 {one}, masked {full} MiB"
    );
    // Half the 0.1 MiB a message prints: the budget holds the largest of the two whatever the rounding.
    let budget = (gather.max(one) + 0.05) / 1024.0;
    assert!(budget * 1024.0 < full, "the budget must sit between them");
    let err = stderr(&run(&masked, &format!("{budget}")));
    assert!(
        err.contains("--moe-form gather (about") && err.contains("--block 1 (about"),
        "{err}"
    );
}

#[test]
fn probe_offers_fewer_layers() {
    let model = tiny();
    let o = qwen35_env(
        &[
            "probe",
            "--model",
            &model,
            "--device",
            "CPU",
            "--token-ids",
            IDS,
        ],
        &[("QWEN35_MEMORY_GIB", "0.00001")],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("probe would hold about"), "{err}");
    // With all layers refused, a budget just above the two-layer estimate offers `--layers`.
    let all = stated_mib(&err);
    let o = qwen35_env(
        &[
            "probe",
            "--model",
            &model,
            "--device",
            "CPU",
            "--token-ids",
            IDS,
            "--layers",
            "0,3",
        ],
        &[("QWEN35_MEMORY_GIB", "0.00001")],
    );
    let two = stated_mib(&stderr(&o));
    assert!(two <= all, "two layers {two} MiB, all {all} MiB");
}

#[test]
fn a_bad_memory_figure_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.safetensors");
    let model = tiny();
    expect_error_env(
        &[
            "dump",
            "--model",
            &model,
            "--token-ids",
            IDS,
            "--out",
            out.to_str().unwrap(),
        ],
        &[("QWEN35_MEMORY_GIB", "lots")],
        &["QWEN35_MEMORY_GIB=lots", "not a number of GiB"],
    );
}

#[test]
fn the_json_report_carries_the_estimate_beside_the_measured_peak() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let model = tiny();
    let o = qwen35_env(
        &[
            "compare-devices",
            "--model",
            &model,
            "--devices",
            "FP16SIM",
            "--token-ids",
            IDS,
            "--tokens",
            "2",
            "--json",
            json.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.code().is_some_and(|c| c <= 1), "{}", stderr(&o));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let m = &v["memory"];
    let estimate = m["estimate_bytes"].as_u64().expect("an estimate");
    let peak = m["measured_peak_bytes"].as_u64().expect("a measured peak");
    assert!(estimate > 0 && peak > 0, "{m}");
    assert!(
        m["peak_phase"]["name"]
            .as_str()
            .is_some_and(|n| !n.is_empty()),
        "{m}"
    );
}
