//! A device computing in reduced precision against the reference: the CPU device asked for f16 on every machine,
//! and every NPU `qwen35 devices` lists, with the NPU port's settings and tolerances in units of the precision the
//! device reports; a greedy token that differs is a near tie only within FP16SIM's logit error (scaled to that
//! arithmetic).

use reference::compare::diff;

use crate::common;
use common::{
    F32, Tolerance, check_dump, config, dump, golden_ids, qwen35_env as qwen35, stderr, testdata,
};

/// Greedy tokens compared between a reduced-precision device run and the reference.
const GREEDY: usize = 8;

/// Tolerances of a reduced-precision device run, in multiples of the unit roundoff u (the largest relative error of
/// one rounding) of the arithmetic the device reports it computed in: every tap and state within this many u of its
/// max and of each head's own max (heads under the machine epsilon 2u times the tensor's max measured against that
/// floor), logits within this many u of the largest |logit|, absolute; never tighter than the f32 tolerances (a device
/// that falls back to f32).
///
/// f16 (u = 2^-11, 11 significand bits): 64 u = 3.1%, the SPEC's figure for the real model on an NPU (2% per layer,
/// 41 u) rounded up; not measured here (no NPU on the machines this runs on; FP16SIM's fp16 is the baseline below).
const F16_FACTOR: f64 = 64.0;

/// bf16 (u = 2^-8, 8 significand bits): 48 u = 0.19. The tiny model on this CPU computing in bf16 (asked for f16)
/// measured at most 17.8 u on a tensor or head (layer 2's `linear_attn.qkv`, channel 159) and 12.5 u on the logits;
/// an earlier run recorded 27.8 u. Ten times the measured error would be 0.7 of each tensor's max, which passes
/// nearly anything; 48 u is 2.7 times this run's worst and 1.7 times the earlier one's.
const BF16_FACTOR: f64 = 48.0;

/// The unit roundoff of the arithmetic named by an `INFERENCE_PRECISION_HINT` read back from a device and the factor
/// its tolerances are in; a device that does not report one (`unknown`) is taken to compute in the f16 requested, and
/// the report says so.
fn arithmetic(precision: &str) -> (f64, f64, &'static str) {
    match precision {
        "f16" => (F16_U, F16_FACTOR, ""),
        "bf16" => (2f64.powi(-8), BF16_FACTOR, ""),
        // The f32 tolerances apply (see `Tolerance` below); the factor only scales the report.
        "f32" => (2f64.powi(-24), 1.0, ""),
        "unknown" => (
            F16_U,
            F16_FACTOR,
            " (precision not reported; taken as the f16 requested)",
        ),
        other => panic!("the device reports an unexpected inference precision `{other}`"),
    }
}

/// f16's unit roundoff.
const F16_U: f64 = 1.0 / 2048.0;

/// The baseline of the near-tie margin: FP16SIM in fp16 on the same graphs and settings, its RMSNorms fused as
/// OpenVINO's devices compute them (with the norms as separate fp16 ops the tiny model's logits break: measured 0.96
/// of max |logit|). Measured: largest logit error 0.302, 0.79% of max |logit| 38.4 (16 u of f16).
const TIE_BASELINE: &str = "FP16SIM:norm=fused";

/// A disagreement in the greedy tokens is a near tie when the reference ranks the device's token at most this many
/// times the baseline's largest logit error below its top, that error scaled from f16's u to the u of the arithmetic
/// the device reports (to first order a rounding error is linear in u): two logits each moved by that much swap when
/// they are within twice of it. The device's own error sets no margin (a worse device would be judged more
/// leniently), nor does FP16SIM computing in bf16: it rounds every stored value to bf16 and measures 9.4 (62 u of
/// bf16), beyond the tolerance a bf16 device is held to, against the bf16 CPU's 1.87 (12.5 u); scaled from f16 the
/// bf16 margin is 2 · 8 · 0.302 = 4.8.
const NEAR_TIE: f64 = 2.0;

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
/// Asserts: every tap and state within [`F16_FACTOR`] or [`BF16_FACTOR`] u of its max and of each head's max,
/// logits within as many u of the largest |logit| (u of the precision the device reports, the f32 tolerances at
/// least); and the first [`GREEDY`] greedy tokens identical or, at the first divergence, the device's token within
/// [`NEAR_TIE`] times FP16SIM's largest logit error on the prompt (fp16, same settings; scaled to the device's
/// arithmetic) of the reference's top logit there (teacher-forced on the common prefix; when the device picked the
/// reference's runner-up this is its top-2 margin): a near tie that arithmetic can flip, not a fault.
fn low_precision_dump_matches_the_reference(device: &str) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let ids = golden_ids("tiny");
    // The NPU port's settings; FP16SIM takes its arithmetic from its options, not from `--precision`.
    let args = [
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
    ];
    let mut reference = dump(tmp.path(), "reference.safetensors", &ids, GREEDY, &[]);
    let on_device = dump(
        tmp.path(),
        "device.safetensors",
        &ids,
        GREEDY,
        &[&["--backend", "openvino", "--device", device], &args[..]].concat(),
    );
    assert_eq!(on_device.metadata["precision_requested"], "f16");
    assert_eq!(on_device.metadata["output_scale"], "1024");
    assert_eq!(
        on_device.metadata["deltanet_prefill"],
        "chunked(16, doubling)"
    );
    let precision = on_device.metadata["precision"].clone();
    let (u, factor, note) = arithmetic(&precision);
    let on_sim = dump(
        tmp.path(),
        "fp16sim.safetensors",
        &ids,
        GREEDY,
        &[
            &["--backend", "openvino", "--device", TIE_BASELINE],
            &args[2..],
        ]
        .concat(),
    );
    let expected_tokens: Vec<i64> = reference.tensors["generated"].to_vec1().unwrap();
    let device_tokens: Vec<i64> = on_device.tensors["generated"].to_vec1().unwrap();
    reference.tensors.remove("generated");
    let logits_scale = diff(&reference.tensors["logits"], &reference.tensors["logits"])
        .unwrap()
        .scale;
    let tolerance = Tolerance {
        logits_atol: (factor * u * logits_scale).max(F32.logits_atol),
        rtol: (factor * u).max(F32.rtol),
        epsilon: Some(2.0 * u),
    };
    let label = format!("{device} computing in {precision}{note}");
    let worst = check_dump(&label, &on_device, &reference, &config("tiny"), tolerance);
    let logits_error = diff(&on_device.tensors["logits"], &reference.tensors["logits"])
        .unwrap()
        .max_abs;
    let sim_error = diff(&on_sim.tensors["logits"], &reference.tensors["logits"])
        .unwrap()
        .max_abs;
    let tie = NEAR_TIE * sim_error * u / F16_U;
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
            gap <= tie,
            "{label}: greedy token {same} differs ({} vs the reference's {}) where the reference ranks the device's \
             token {gap:.3e} below its top (top-2 margin {margin:.3e}), more than the near-tie margin {tie:.3e} \
             ({NEAR_TIE} times {TIE_BASELINE}'s largest logit error {sim_error:.3e}, scaled to {precision}; the \
             device's {logits_error:.3e}): a fault, not a near tie",
            device_tokens[same],
            expected_tokens[same]
        );
        format!(
            "greedy tokens identical for {same} of {GREEDY}; then a near tie (the reference ranks the device's \
             token {gap:.3e} below its top, top-2 margin {margin:.3e}, within the near-tie margin {tie:.3e}; the \
             device's logit error {logits_error:.3e})"
        )
    };
    format!(
        "{label}: {tokens}; logits max abs {logits_error:.3e} ({:.1} u of max |logit|; {TIE_BASELINE} {sim_error:.3e}, \
         near-tie margin {tie:.3e}); worst {:.2e} of its head's (or tensor's) max ({:.1} u; tolerance {factor} u)\n{}",
        logits_error / (u * logits_scale),
        worst.overall(),
        worst.overall() / u,
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
