//! `qwen35` with the OpenVINO backend on the CPU device: dumps against the goldens and the reference, devices,
//! exported IR, and clear errors.

use parity::dump::Dump;
use reference::compare::diff;
use std::path::Path;

mod common;
use common::{
    F32, Tolerance, check_dump, config, expect_error_env as expect_error, qwen35_env as qwen35,
    stderr, testdata,
};

#[test]
fn devices_lists_the_cpu() {
    let o = qwen35(&["devices", "--json"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        v["openvino"].as_str().unwrap().starts_with("2026.4.1"),
        "{v}"
    );
    let devices = v["devices"].as_array().unwrap();
    assert!(
        devices
            .iter()
            .any(|d| d["name"] == "CPU" && !d["full_name"].as_str().unwrap().is_empty()),
        "{v}"
    );
    let o = qwen35(&["devices"], &[]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("CPU:"));
}

#[test]
fn openvino_dumps_match_the_goldens() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, block) in [("tiny", "16"), ("tiny-tied", "64"), ("tiny-full", "1")] {
        let golden = Dump::read(&testdata().join(format!("goldens/{name}.safetensors"))).unwrap();
        let out = tmp.path().join(format!("{name}.safetensors"));
        let model = testdata().join("models").join(name);
        let ids = common::ids_arg(&golden.tensors["token_ids"]);
        let o = qwen35(
            &[
                "dump",
                "--backend",
                "openvino",
                "--device",
                "CPU",
                "--block",
                block,
                "--context",
                "256",
                "--model",
                model.to_str().unwrap(),
                "--token-ids",
                &ids,
                "--generate",
                "16",
                "--out",
                out.to_str().unwrap(),
            ],
            &[],
        );
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let d = Dump::read(&out).unwrap();
        assert_eq!(d.metadata["backend"], "openvino");
        assert_eq!(
            d.metadata["precision"], "f32",
            "{name}: a reference run must have computed in f32"
        );
        assert_eq!(d.metadata["property.DYNAMIC_QUANTIZATION_GROUP_SIZE"], "0");
        let label = format!("{name} block {block}");
        let worst = check_dump(&label, &d, &golden, &config(name), F32);
        println!(
            "{label}: OpenVINO CPU dump vs transformers, worst {:.2e} of its head's (or tensor's) max\n{}",
            worst.overall(),
            worst.report()
        );
    }
}

#[test]
fn quantized_device_dump_equals_the_reference_on_the_same_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = (0..40)
        .map(|i| ((i * 53) % 500).to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut dumps = vec![];
    for backend in ["reference", "openvino"] {
        let out = tmp.path().join(format!("{backend}.safetensors"));
        let o = qwen35(
            &[
                "dump",
                "--backend",
                backend,
                "--weights",
                "int4:32",
                "--token-ids",
                &ids,
                "--generate",
                "8",
                "--out",
                out.to_str().unwrap(),
            ],
            &[],
        );
        assert!(o.status.success(), "{backend}: {}", stderr(&o));
        dumps.push(Dump::read(&out).unwrap());
    }
    assert_eq!(dumps[0].metadata["weights"], "int4:32");
    assert_eq!(dumps[1].metadata["weights"], "int4:32");
    assert_eq!(dumps[0].tensors.len(), dumps[1].tensors.len());
    // Every tensor, greedy tokens exactly, taps and states per head.
    let worst = check_dump("int4:32", &dumps[1], &dumps[0], &config("tiny"), F32);
    println!(
        "int4:32 OpenVINO CPU dump vs the reference on the same weights: worst {:.2e} of its head's (or tensor's) \
         max\n{}",
        worst.overall(),
        worst.report()
    );
}

#[test]
fn export_ir_writes_graphs_openvino_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ir");
    let o = qwen35(
        &[
            "export-ir",
            "--out",
            out.to_str().unwrap(),
            "--layers",
            "--blocks",
            "16",
            "--weights",
            "int4:32",
            "--context",
            "64",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    let graphs = manifest["graphs"].as_array().unwrap();
    assert_eq!(
        graphs.len(),
        2 * (1 + 4),
        "decoder and 4 layers, for 1 and 16 tokens"
    );
    let mut core = npu::runtime::core().unwrap();
    for g in graphs {
        let xml = out.join(g["xml"].as_str().unwrap());
        let bin = out.join(g["bin"].as_str().unwrap());
        let model = core
            .read_model_from_file(xml.to_str().unwrap(), bin.to_str().unwrap())
            .unwrap();
        assert_eq!(
            model.get_inputs_len().unwrap(),
            g["inputs"].as_array().unwrap().len(),
            "{}",
            g["name"]
        );
        assert_eq!(
            model.get_outputs_len().unwrap(),
            g["outputs"].as_array().unwrap().len(),
            "{}",
            g["name"]
        );
    }
    // Deterministic: the same export twice gives the same bytes.
    let again = tmp.path().join("again");
    let o = qwen35(
        &[
            "export-ir",
            "--out",
            again.to_str().unwrap(),
            "--blocks",
            "16",
            "--weights",
            "int4:32",
            "--context",
            "64",
        ],
        &[],
    );
    assert!(o.status.success());
    for f in ["decoder_t16.xml", "decoder_t16.bin", "decoder_t1.bin"] {
        assert_eq!(
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(again.join(f)).unwrap(),
            "{f}"
        );
    }
}

#[test]
fn openvino_errors_are_clear() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.safetensors");
    let out = out.to_str().unwrap();
    let ov = ["dump", "--backend", "openvino"];
    fn with<'a>(ov: &[&'a str], extra: &[&'a str], out: &'a str) -> Vec<&'a str> {
        let mut v: Vec<&str> = ov.to_vec();
        v.extend_from_slice(extra);
        v.extend_from_slice(&["--out", out]);
        v
    }
    // A device no machine has (whether an NPU is present or not).
    expect_error(
        &with(
            &ov,
            &["--device", "NO_SUCH_DEVICE", "--token-ids", "1,2"],
            out,
        ),
        &[],
        &["NO_SUCH_DEVICE", "not available", "CPU"],
    );
    expect_error(
        &with(&ov, &["--token-ids", "1,2"], out),
        &[("OPENVINO_LIB", "/no/such/libopenvino_c.so")],
        &["OPENVINO_LIB", "/no/such/libopenvino_c.so"],
    );
    expect_error(
        &with(
            &ov,
            &["--token-ids", "1,2", "--deltanet-form", "sequential"],
            out,
        ),
        &[],
        &["--deltanet-form", "matrix, chunked or loop"],
    );
    expect_error(
        &with(&ov, &["--token-ids", "1,2", "--dtype", "f64"], out),
        &[],
        &["--dtype"],
    );
    expect_error(
        &with(
            &ov,
            &["--token-ids", "1,2,3,4,5,6,7,8,9,10", "--context", "8"],
            out,
        ),
        &[],
        &["static context", "--context"],
    );
    expect_error(
        &with(&ov, &["--token-ids", "1,2", "--block", "0"], out),
        &[],
        &["--block"],
    );
    expect_error(
        &with(&ov, &["--token-ids", "1,2", "--weights", "int3"], out),
        &[],
        &["--weights", "int3"],
    );
    let cfg = tmp.path().join("cfg.json");
    let cfg_path = cfg.to_str().unwrap().to_string();
    let cfg_str = cfg_path.as_str();
    std::fs::write(&cfg, r#"{"NOT_A_PROPERTY": "1"}"#).unwrap();
    expect_error(
        &with(
            &ov,
            &["--token-ids", "1,2", "--device-config", cfg_str],
            out,
        ),
        &[],
        &["NOT_A_PROPERTY", "CPU"],
    );
    std::fs::write(&cfg, r#"["not", "an", "object"]"#).unwrap();
    expect_error(
        &with(
            &ov,
            &["--token-ids", "1,2", "--device-config", cfg_str],
            out,
        ),
        &[],
        &["cfg.json", "JSON object"],
    );
    expect_error(
        &with(&ov, &["--token-ids", "1,2"], out),
        &[("QWEN35_DEVICE_CONFIG", "{oops")],
        &["QWEN35_DEVICE_CONFIG", "JSON"],
    );
    expect_error(
        &[
            "dump",
            "--device",
            "CPU",
            "--token-ids",
            "1,2",
            "--out",
            out,
        ],
        &[],
        &["--device", "--backend openvino"],
    );
    expect_error(
        &["devices"],
        &[("OPENVINO_LIB", "/no/such/dir")],
        &["OPENVINO_LIB"],
    );
    expect_error(
        &with(&ov, &["--token-ids", "1,2", "--chunk", "8"], out),
        &[],
        &["--chunk", "--block"],
    );
    expect_error(
        &[
            "dump",
            "--deltanet-form",
            "loop",
            "--token-ids",
            "1,2",
            "--out",
            out,
        ],
        &[],
        &["loop", "sequential"],
    );
    // Options that would be ignored are refused; the output scale must keep the math exact.
    expect_error(
        &with(
            &ov,
            &["--token-ids", "1,2", "--decode-form", "sequential"],
            out,
        ),
        &[],
        &["--decode-form", "matrix"],
    );
    expect_error(
        &with(
            &ov,
            &[
                "--token-ids",
                "1,2",
                "--deltanet-form",
                "matrix",
                "--inverse",
                "series",
            ],
            out,
        ),
        &[],
        &["--inverse", "chunked"],
    );
    for scale in ["1000", "1e20", "0.5"] {
        expect_error(
            &with(&ov, &["--token-ids", "1,2", "--output-scale", scale], out),
            &[],
            &["--output-scale", "power of two"],
        );
        expect_error(
            &[
                "dump",
                "--token-ids",
                "1,2",
                "--output-scale",
                scale,
                "--out",
                out,
            ],
            &[],
            &["--output-scale", "power of two"],
        );
    }
}

/// The golden prompt of a bundled model, as `--token-ids` text.
fn golden_ids(model: &str) -> String {
    let g = Dump::read(&testdata().join(format!("goldens/{model}.safetensors"))).unwrap();
    common::ids_arg(&g.tensors["token_ids"])
}

/// `qwen35 dump` of the tiny model on `ids` with `args`, read back.
fn dump(dir: &Path, file: &str, ids: &str, generate: usize, args: &[&str]) -> Dump {
    let out = dir.join(file);
    let model = testdata().join("models/tiny");
    let generate = generate.to_string();
    let mut all = vec![
        "dump",
        "--model",
        model.to_str().unwrap(),
        "--token-ids",
        ids,
        "--generate",
        &generate,
        "--out",
        out.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let o = qwen35(&all, &[]);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    Dump::read(&out).unwrap()
}

/// The Loop form (one OpenVINO `Loop` op per DeltaNet layer, as the optimum-intel export) computes what the reference
/// computes: the golden prompt in blocks of 16 (the last one padded), every tap and state, and 8 greedy tokens.
#[test]
fn loop_form_dump_matches_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = golden_ids("tiny");
    let reference = dump(tmp.path(), "reference.safetensors", &ids, 8, &[]);
    let looped = dump(
        tmp.path(),
        "loop.safetensors",
        &ids,
        8,
        &[
            "--backend",
            "openvino",
            "--deltanet-form",
            "loop",
            "--block",
            "16",
        ],
    );
    assert_eq!(looped.metadata["deltanet_prefill"], "loop");
    assert_eq!(looped.metadata["precision"], "f32");
    assert_eq!(looped.tensors.len(), reference.tensors.len());
    let worst = check_dump("loop", &looped, &reference, &config("tiny"), F32);
    println!(
        "Loop form vs the reference: 8 greedy tokens identical, worst {:.2e} of its head's (or tensor's) max\n{}",
        worst.overall(),
        worst.report()
    );
}

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
