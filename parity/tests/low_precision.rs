//! A device computing in reduced precision against the reference: the CPU device asked for f16 on every machine,
//! and every NPU `qwen35 devices` lists, with the NPU port's settings and tolerances in units of the precision the
//! device reports.

use reference::compare::diff;

mod common;
use common::{
    F32, Tolerance, check_dump, config, dump, golden_ids, qwen35_env as qwen35, stderr, testdata,
};

/// Greedy tokens compared between a reduced-precision device run and the reference.
const GREEDY: usize = 8;

/// Tolerances of a reduced-precision device run, in multiples of the epsilon ε of the arithmetic the device reports
/// it computed in (f16 2^-10 = 9.8e-4, bf16 2^-7 = 7.8e-3): every tap and state within this many ε of its max and of
/// each head's own max (heads under ε times the tensor's max measured against that floor), logits within this many ε
/// of the largest |logit|, absolute; never tighter than the f32 tolerances (a device that falls back to f32). The
/// SPEC's figure for the real model on an NPU is 2% per layer (20 ε in f16); the tiny model on a CPU computing in bf16
/// measured at most 13.9 ε on a whole tensor (layer 1's MLP output), 13.6 ε per head (layer 2's beta, head 3) and
/// 13.9 ε on the logits.
const EPS_FACTOR: f64 = 32.0;

/// The epsilon of the arithmetic named by an `INFERENCE_PRECISION_HINT` read back from a device; a device that does
/// not report one (`unknown`) is taken to compute in the f16 requested, and the report says so.
fn precision_epsilon(precision: &str) -> (f64, &'static str) {
    use candle_core::DType;
    use reference::compare::epsilon;
    match precision {
        "f16" => (epsilon(DType::F16), ""),
        "bf16" => (epsilon(DType::BF16), ""),
        "f32" => (epsilon(DType::F32), ""),
        "unknown" => (
            epsilon(DType::F16),
            " (precision not reported; taken as the f16 requested)",
        ),
        other => panic!("the device reports an unexpected inference precision `{other}`"),
    }
}

/// After the tiny model has read `ids` then `prefix`: the reference's margin between its two largest logits, and
/// between its largest logit and that of `token`.
fn reference_margins(ids: &[u32], prefix: &[u32], token: usize) -> (f64, f64) {
    use reference::model::{Model, RunOptions};
    let model = Model::load(&testdata().join("models/tiny"), candle_core::DType::F32).unwrap();
    let mut all = ids.to_vec();
    all.extend_from_slice(prefix);
    let mut state = model.new_state().unwrap();
    let logits: Vec<f64> = model
        .prefill(
            &all,
            &mut state,
            &RunOptions::default(),
            &mut reference::taps::Taps::off(),
        )
        .unwrap()
        .to_dtype(candle_core::DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap();
    let mut sorted = logits.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    (sorted[0] - sorted[1], sorted[0] - logits[token])
}

/// A dump computed in f16 on `device` as an NPU computes, with the NPU port's settings (chunked form, block-doubling
/// inverse, output scale 1024, blocks of 16), against the reference's f32 dump of the tiny model's golden prompt.
///
/// Asserts: every tap and state within [`EPS_FACTOR`] ε of its max and of each head's max, logits within
/// [`EPS_FACTOR`] ε of the largest |logit| (ε of the precision the device reports, the f32 tolerances at least); and
/// the first [`GREEDY`] greedy tokens identical or, at the first divergence, the device's token within twice the
/// largest logit error measured on the prompt of the reference's top logit there (teacher-forced on the common
/// prefix; when the device picked the reference's runner-up this is its top-2 margin): a near tie the measured error
/// can flip, not a fault.
fn low_precision_dump_matches_the_reference(device: &str) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let ids = golden_ids("tiny");
    let mut reference = dump(tmp.path(), "reference.safetensors", &ids, GREEDY, &[]);
    let on_device = dump(
        tmp.path(),
        "device.safetensors",
        &ids,
        GREEDY,
        &[
            "--backend",
            "openvino",
            "--device",
            device,
            "--precision",
            "f16",
            "--deltanet-form",
            "chunked",
            "--inverse",
            "doubling",
            "--output-scale",
            "1024",
            "--block",
            "16",
        ],
    );
    assert_eq!(on_device.metadata["precision_requested"], "f16");
    assert_eq!(on_device.metadata["output_scale"], "1024");
    assert_eq!(
        on_device.metadata["deltanet_prefill"],
        "chunked(16, doubling)"
    );
    let precision = on_device.metadata["precision"].clone();
    let (eps, note) = precision_epsilon(&precision);
    let expected_tokens: Vec<i64> = reference.tensors["generated"].to_vec1().unwrap();
    let device_tokens: Vec<i64> = on_device.tensors["generated"].to_vec1().unwrap();
    reference.tensors.remove("generated");
    let logits_scale = diff(&reference.tensors["logits"], &reference.tensors["logits"])
        .unwrap()
        .scale;
    let tolerance = Tolerance {
        logits_atol: (EPS_FACTOR * eps * logits_scale).max(F32.logits_atol),
        rtol: (EPS_FACTOR * eps).max(F32.rtol),
        epsilon: Some(eps),
    };
    let label = format!("{device} computing in {precision}{note}");
    let worst = check_dump(&label, &on_device, &reference, &config("tiny"), tolerance);
    let logits_error = diff(&on_device.tensors["logits"], &reference.tensors["logits"])
        .unwrap()
        .max_abs;
    let same = expected_tokens
        .iter()
        .zip(&device_tokens)
        .take_while(|(a, b)| a == b)
        .count();
    let tokens = if same == GREEDY {
        format!("{GREEDY} greedy tokens identical")
    } else {
        let ids: Vec<u32> = ids.split(',').map(|x| x.parse().unwrap()).collect();
        let prefix: Vec<u32> = expected_tokens[..same].iter().map(|&x| x as u32).collect();
        let (margin, gap) = reference_margins(&ids, &prefix, device_tokens[same] as usize);
        assert!(
            gap <= 2.0 * logits_error,
            "{label}: greedy token {same} differs ({} vs the reference's {}) where the reference ranks the device's \
             token {gap:.3e} below its top (top-2 margin {margin:.3e}), more than twice the largest logit error on \
             the prompt ({logits_error:.3e}): a fault, not a near tie",
            device_tokens[same],
            expected_tokens[same]
        );
        format!(
            "greedy tokens identical for {same} of {GREEDY}; then a near tie (the reference ranks the device's \
             token {gap:.3e} below its top, top-2 margin {margin:.3e}; logit error {logits_error:.3e})"
        )
    };
    format!(
        "{label}: {tokens}; logits max abs {logits_error:.3e} ({:.1} eps of max |logit|); worst {:.2e} of its \
         head's (or tensor's) max ({:.1} eps)\n{}",
        logits_error / (eps * logits_scale),
        worst.overall(),
        worst.overall() / eps,
        worst.report()
    )
}

/// When `qwen35 devices` lists an NPU, a dump on it in f16 (the port's settings) matches the reference within an
/// fp16 tolerance. The same check runs on every machine on the CPU device asked for f16 (the CPU computes in what it
/// has, f16 or bf16, and the tolerance follows what it reports), so the check itself is exercised without an NPU.
#[test]
fn npu_dump_matches_the_reference_when_present() {
    let o = qwen35(&["devices", "--json"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<String> = v["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_string())
        .collect();
    println!("{}", low_precision_dump_matches_the_reference("CPU"));
    let npus: Vec<&String> = names.iter().filter(|n| n.starts_with("NPU")).collect();
    if npus.is_empty() {
        println!(
            "NPU check skipped: no NPU present (devices: {})",
            names.join(", ")
        );
        return;
    }
    for npu in npus {
        println!("{}", low_precision_dump_matches_the_reference(npu));
    }
}
