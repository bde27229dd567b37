//! Graphs made elsewhere: optimum-intel's exports of `testdata/models/tiny` and `tiny-moe` (`testdata/ir/`, written
//! by `scripts/make_optimum_export.py`) as a backend on the CPU device, against the reference on the same weights,
//! and the IR's compressed constants against the reference's weight format.

use candle_core::{DType, Tensor};
use npu::devices::CompileOptions;
use npu::engine::DecoderEngine;
use npu::external::constants::{IrWeight, checkpoint_name, compressed_weights};
use npu::graphset::manifest;
use reference::backend::{Backend, ReferenceBackend, greedy, teacher_forced};
use reference::config::Config;
use reference::model::{Model, RunOptions};
use reference::quant::{QuantKind, QuantizedMatrix, WeightFormat};
use reference::schema::Schema;
use reference::weights::WeightStore;
use std::collections::BTreeSet;
use std::path::PathBuf;

fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

fn ir(name: &str) -> PathBuf {
    testdata().join("ir").join(name)
}

fn checkpoint(model: &str, format: WeightFormat) -> (Config, WeightStore) {
    let dir = testdata().join("models").join(model);
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let store = WeightStore::open_with_format(&dir, DType::F32, format).unwrap();
    (config, store)
}

fn reference_of(model: &str, format: WeightFormat) -> ReferenceBackend {
    let (config, store) = checkpoint(model, format);
    let model = Model::from_weights(config, &store).unwrap();
    ReferenceBackend::new(model, RunOptions::default(), false, &format.name()).unwrap()
}

fn reference(format: WeightFormat) -> ReferenceBackend {
    reference_of("tiny", format)
}

fn open_model_dir(model: &str, dir: &std::path::Path) -> npu::Result<DecoderEngine> {
    let (config, _) = checkpoint(model, WeightFormat::F32);
    let set = manifest::open(dir)?;
    DecoderEngine::open(&set, config, "CPU", &CompileOptions::default(), None)
}

fn open_dir(dir: &std::path::Path) -> npu::Result<DecoderEngine> {
    open_model_dir("tiny", dir)
}

fn external(name: &str) -> DecoderEngine {
    open_dir(&ir(name)).unwrap()
}

/// The IR file of a one-file set.
fn files(name: &str) -> (PathBuf, PathBuf, Option<String>) {
    let set = manifest::open(&ir(name)).unwrap();
    let g = &set.decoder().unwrap().graphs[0];
    (g.xml.clone(), g.bin.clone(), set.reference_weights.clone())
}

/// A chat prompt of a model (its golden's), cut to `n` tokens.
fn prompt_of(model: &str, n: usize) -> Vec<u32> {
    let g = candle_core::safetensors::load(
        testdata().join(format!("goldens/{model}.safetensors")),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let ids: Vec<i64> = g["token_ids"].to_vec1().unwrap();
    ids[..n].iter().map(|&x| x as u32).collect()
}

/// A chat prompt of the tiny model (the golden's), cut to `n` tokens.
fn prompt(n: usize) -> Vec<u32> {
    prompt_of("tiny", n)
}

fn nmse(a: &Tensor, b: &Tensor) -> f64 {
    let a: Vec<f64> = a
        .flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap();
    let b: Vec<f64> = b
        .flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
    num / b.iter().map(|y| y * y).sum::<f64>()
}

/// Teacher-forced logits NMSE of `device` against `reference` over a prompt and the reference's greedy tokens, and
/// whether the greedy tokens agree.
fn compare(
    device: &mut dyn Backend,
    reference: &mut dyn Backend,
    ids: &[u32],
    n: usize,
) -> (f64, bool) {
    let r = greedy(reference, ids, n, &[], false, |_| Ok(())).unwrap();
    let d = greedy(device, ids, n, &[], false, |_| Ok(())).unwrap();
    let cont = &r.tokens[..n - 1];
    let rf = teacher_forced(reference, ids, cont).unwrap();
    let df = teacher_forced(device, ids, cont).unwrap();
    (nmse(&df.run.logits, &rf.run.logits), r.tokens == d.tokens)
}

/// The compressed matrices of the IR `ir` (an export of `model`), each held to the reference's weights in the
/// format the manifest names (`reference_weights`): the same kind, shape, codes and scale bits. Returns the IR's
/// matrices, that format, and the checkpoint tensors the IR compresses, which must be exactly those the format
/// compresses, each once.
fn held_to_the_reference(model: &str, ir: &str) -> (Vec<IrWeight>, WeightFormat, BTreeSet<String>) {
    let (xml, bin, reference_weights) = files(ir);
    let weights = compressed_weights(&xml, &bin).unwrap();
    let format = WeightFormat::parse(reference_weights.as_deref().unwrap()).unwrap();
    let (config, store) = checkpoint(model, format);
    let specs = Schema::new(&config).tensors();
    let mut in_ir = BTreeSet::new();
    let bits =
        |m: &QuantizedMatrix| -> Vec<u16> { m.scales().iter().map(|s| s.to_bits()).collect() };
    for w in &weights {
        let name = w.checkpoint_name().unwrap();
        let spec = specs
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("{}: no checkpoint tensor {name}", w.constant));
        let ours = store
            .quantized(spec)
            .unwrap()
            .unwrap_or_else(|| panic!("{name}: the IR compresses it, {format} keeps it float"));
        assert_eq!(ours.kind(), w.matrix.kind(), "{name}");
        assert_eq!(ours.shape(), w.matrix.shape(), "{name}");
        assert_eq!(ours.codes(), w.matrix.codes(), "{name}: codes differ");
        assert_eq!(bits(&ours), bits(&w.matrix), "{name}: scales differ");
        assert!(in_ir.insert(name.clone()), "{name}: held twice in the IR");
    }
    let ours: BTreeSet<String> = specs
        .iter()
        .filter(|s| store.storage(s).is_quantized())
        .map(|s| s.name.clone())
        .collect();
    assert_eq!(
        in_ir, ours,
        "the IR and {format} compress different tensors"
    );
    (weights, format, in_ir)
}

/// The checkpoint tensors `format` compresses in `model`.
fn compressed_by(model: &str, format: WeightFormat) -> BTreeSet<String> {
    let (config, store) = checkpoint(model, format);
    Schema::new(&config)
        .tensors()
        .iter()
        .filter(|s| store.storage(s).is_quantized())
        .map(|s| s.name.clone())
        .collect()
}

#[test]
fn the_int4_export_holds_exactly_the_weights_of_the_nncf_rule() {
    let (weights, format, in_ir) = held_to_the_reference("tiny", "tiny-int4");
    assert_eq!(format, WeightFormat::Int4Nncf { group: 32 });
    // 31 INT4 projections, and INT8: the embedding, the LM head and the three DeltaNet convs.
    let int8: Vec<&str> = weights
        .iter()
        .filter(|w| w.matrix.kind() == QuantKind::Int8Sym)
        .map(|w| w.consumer.as_str())
        .collect();
    assert_eq!(weights.len(), 36);
    assert!(weights.iter().all(|w| w.expert.is_none()));
    assert_eq!(int8.iter().filter(|c| **c == "GroupConvolution").count(), 3);
    assert_eq!(int8.len(), 5);

    // The project's plain int4 rule keeps exactly the convs float.
    let plain = compressed_by("tiny", WeightFormat::Int4Sym { group: 32 });
    let missing: Vec<&String> = in_ir.difference(&plain).collect();
    assert_eq!(
        missing,
        [
            "layers.0.linear_attn.conv1d.weight",
            "layers.1.linear_attn.conv1d.weight",
            "layers.2.linear_attn.conv1d.weight"
        ]
    );
}

/// NNCF on optimum-intel's MoE export: the experts are stacked constants `[E, out, in]` (the gate and up halves of
/// `gate_up_proj`, and `down_proj`) read by batched MatMuls, compressed in groups along their last axis per expert
/// and row. Every expert's codes and scales, the router's, the shared expert's and its 1-row gate's are bit for bit
/// the reference's `int4-nncf:8` (the project's INT4 rule, with the conv weights' INT8 as NNCF gives them).
#[test]
fn the_moe_int4_export_holds_exactly_the_weights_of_the_nncf_rule_experts_included() {
    let (weights, format, in_ir) = held_to_the_reference("tiny-moe", "tiny-moe-int4");
    assert_eq!(format, WeightFormat::Int4Nncf { group: 8 });
    let int4 = QuantKind::Int4Sym { group: 8 };
    let of = |name: &str| -> &IrWeight {
        weights
            .iter()
            .find(|w| w.checkpoint_name().unwrap() == name)
            .unwrap_or_else(|| panic!("the IR does not compress {name}"))
    };
    // 4 layers x 3 stacked constants x 8 experts, each a matrix of its own; every MoE weight INT4 in groups of 8.
    let experts: Vec<&IrWeight> = weights.iter().filter(|w| w.expert.is_some()).collect();
    assert_eq!(experts.len(), 4 * 3 * 8);
    for w in weights
        .iter()
        .filter(|w| w.checkpoint_name().unwrap().contains(".mlp."))
    {
        assert_eq!(w.matrix.kind(), int4, "{}", w.checkpoint_name().unwrap());
    }
    for (name, shape, scales) in [
        ("layers.2.mlp.experts.5.gate_proj.weight", [16, 32], [16, 4]),
        ("layers.2.mlp.experts.5.up_proj.weight", [16, 32], [16, 4]),
        ("layers.2.mlp.experts.5.down_proj.weight", [32, 16], [32, 2]),
        ("layers.2.mlp.gate.weight", [8, 32], [8, 4]),
        (
            "layers.2.mlp.shared_expert.down_proj.weight",
            [32, 24],
            [32, 3],
        ),
        ("layers.2.mlp.shared_expert_gate.weight", [1, 32], [1, 4]),
    ] {
        let w = of(name);
        assert_eq!(
            (w.matrix.shape(), w.matrix.scale_shape()),
            (shape, scales),
            "{name}"
        );
    }
    assert_eq!(of("layers.2.mlp.experts.5.up_proj.weight").expert, Some(5));
    // 51 INT4 MatMul weights (24 of them stacked) and the same five INT8 ones as tiny's.
    assert_eq!(weights.len(), 51 - 12 + experts.len() + 5);
    assert_eq!(in_ir.len(), weights.len());
    // The plain int4 rule differs only in the DeltaNet convs here too.
    let plain = compressed_by("tiny-moe", WeightFormat::Int4Sym { group: 8 });
    let missing: Vec<&String> = in_ir.difference(&plain).collect();
    assert_eq!(missing.len(), 3);
    assert!(
        missing
            .iter()
            .all(|n| n.ends_with("linear_attn.conv1d.weight"))
    );
}

#[test]
fn the_f32_export_holds_no_compressed_weight_and_constant_names_map_explicitly() {
    let (xml, bin, reference_weights) = files("tiny-f32");
    assert!(compressed_weights(&xml, &bin).unwrap().is_empty());
    assert_eq!(reference_weights.as_deref(), Some("f32"));
    assert_eq!(
        checkpoint_name(
            "__module.model.model.layers.7.linear_attn/aten::_convolution/Reshape",
            None
        )
        .unwrap(),
        "layers.7.linear_attn.conv1d.weight"
    );
    assert_eq!(
        checkpoint_name("self.model.lm_head.weight", None).unwrap(),
        "lm_head.weight"
    );
    let e = checkpoint_name("__module.model.model.rotary_emb/aten::to/Convert", None).unwrap_err();
    assert!(
        e.to_string()
            .contains("`__module.model.model.rotary_emb/aten::to/Convert`"),
        "{e}"
    );
    // The MoE export's stacked expert constants, one matrix per expert.
    let (xml, bin, _) = files("tiny-moe-f32");
    assert!(compressed_weights(&xml, &bin).unwrap().is_empty());
    for (constant, e, name) in [
        (
            "__module.model.model.layers.1.mlp/prim::ListUnpack/VariadicSplit.0",
            0,
            "layers.1.mlp.experts.0.gate_proj.weight",
        ),
        (
            "__module.model.model.layers.1.mlp/prim::ListUnpack/VariadicSplit.1",
            7,
            "layers.1.mlp.experts.7.up_proj.weight",
        ),
        (
            "self.model.model.layers.12.mlp.experts.down_proj",
            3,
            "layers.12.mlp.experts.3.down_proj.weight",
        ),
    ] {
        assert_eq!(checkpoint_name(constant, Some(e)).unwrap(), name);
    }
    // A fused gate_up_proj (an export that keeps it whole) is no single expert matrix: named, not guessed.
    let e = checkpoint_name(
        "self.model.model.layers.0.mlp.experts.gate_up_proj",
        Some(0),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("`self.model.model.layers.0.mlp.experts.gate_up_proj`"),
        "{e}"
    );
    assert!(checkpoint_name("self.model.model.layers.0.mlp.gate.weight", Some(0)).is_err());
}

#[test]
fn the_f32_export_agrees_with_the_reference() {
    let mut device = external("tiny-f32");
    let mut reference = reference(WeightFormat::F32);
    let (error, same) = compare(&mut device, &mut reference, &prompt(40), 8);
    eprintln!(
        "tiny-f32 export vs reference f32: logits NMSE {error:.3e}, greedy tokens equal: {same}"
    );
    assert!(same, "greedy tokens differ");
    // Measured 7.3e-13 (f32 rounding: NMSE is squared, so 1e-11 allows 3.7 times the measured RMS error).
    assert!(error < 1e-11, "logits NMSE {error:e}");
    assert!(!device.exposes_state());
    assert!(
        device
            .snapshot()
            .unwrap_err()
            .to_string()
            .contains("not exposed")
    );
    // A reset starts over: the same prompt twice gives the same logits.
    let a = greedy(&mut device, &prompt(12), 2, &[], true, |_| Ok(())).unwrap();
    let b = greedy(&mut device, &prompt(12), 2, &[], true, |_| Ok(())).unwrap();
    assert_eq!(nmse(&a.prompt.logits, &b.prompt.logits), 0.0);
    assert!(a.after_prompt.tensors.is_empty());
}

#[test]
fn the_int4_export_agrees_with_the_nncf_rule_and_not_with_the_plain_int4_rule() {
    let mut device = external("tiny-int4");
    let ids = prompt(40);
    let (nncf, same) = compare(
        &mut device,
        &mut reference(WeightFormat::Int4Nncf { group: 32 }),
        &ids,
        8,
    );
    let (plain, _) = compare(
        &mut device,
        &mut reference(WeightFormat::Int4Sym { group: 32 }),
        &ids,
        8,
    );
    eprintln!(
        "tiny-int4 export: logits NMSE {nncf:.3e} vs int4-nncf:32 (tokens equal: {same}), {plain:.3e} vs int4:32"
    );
    assert!(
        same,
        "greedy tokens differ from the reference on int4-nncf:32"
    );
    // The same weights on both sides, so only f32 rounding differs: measured 7.9e-13 (1.4e-12 on another x86-64
    // CPU); 1e-11 is about ten times that (3.6 times in RMS error: NMSE is squared). The plain rule's conv weights
    // measured 1.1e-4, 1.4e8 times the NNCF rule's.
    assert!(nncf < 1e-11, "logits NMSE {nncf:e} against int4-nncf:32");
    assert!(
        plain > 1e7 * nncf,
        "the conv weights' INT8 moved nothing: {plain:e} vs {nncf:e}"
    );
}

/// The MoE exports on the CPU device against the reference on the weights they hold: the f32 export and f32, the
/// INT4 export and `int4-nncf:8` (its weights exactly, as the test above reads them), on the MoE golden's chat
/// prompt, whose 40 first tokens include layer 2's built-in near tie of the router (token 20: the 3rd and 4th
/// expert 3e-5 apart).
#[test]
fn the_moe_exports_agree_with_the_reference_on_the_weights_they_hold() {
    let ids = prompt_of("tiny-moe", 40);
    let mut f32 = open_model_dir("tiny-moe", &ir("tiny-moe-f32")).unwrap();
    let (error, same) = compare(
        &mut f32,
        &mut reference_of("tiny-moe", WeightFormat::F32),
        &ids,
        8,
    );
    let mut int4 = open_model_dir("tiny-moe", &ir("tiny-moe-int4")).unwrap();
    let nncf = WeightFormat::Int4Nncf { group: 8 };
    let (nncf_error, nncf_same) = compare(&mut int4, &mut reference_of("tiny-moe", nncf), &ids, 8);
    let plain = WeightFormat::Int4Sym { group: 8 };
    let (plain_error, _) = compare(&mut int4, &mut reference_of("tiny-moe", plain), &ids, 8);
    eprintln!(
        "tiny-moe exports: f32 logits NMSE {error:.3e} (tokens equal: {same}); int4 {nncf_error:.3e} vs \
         int4-nncf:8 (tokens equal: {nncf_same}), {plain_error:.3e} vs int4:8"
    );
    assert!(same && nncf_same, "greedy tokens differ");
    // f32 rounding only on both: measured 1.4e-12 (f32) and 1.5e-12 (int4); 1e-11 allows 2.6 times that RMS error
    // (NMSE is squared).
    assert!(error < 1e-11, "f32 export: logits NMSE {error:e}");
    assert!(
        nncf_error < 1e-11,
        "int4 export: logits NMSE {nncf_error:e}"
    );
    // The plain rule's float conv weights alone: measured 4.5e-4, 3.0e8 times the NNCF rule's.
    assert!(
        plain_error > 1e7 * nncf_error,
        "the conv weights' INT8 moved nothing: {plain_error:e} vs {nncf_error:e}"
    );
}

#[test]
fn a_manifest_port_the_ir_does_not_have_is_named() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["openvino_model.xml", "openvino_model.bin"] {
        std::fs::copy(ir("tiny-f32").join(f), dir.path().join(f)).unwrap();
    }
    let text = r#"{"inputs": {"input_ids": {"name": "tokens"}}, "outputs": {"logits": {"name": "logits"}}}"#;
    std::fs::write(dir.path().join("manifest.json"), text).unwrap();
    let e = open_dir(dir.path()).err().unwrap().to_string();
    assert!(
        e.contains("`inputs.input_ids`") && e.contains("names input `tokens`"),
        "{e}"
    );

    // A manifest key missing, and an IR input mapped to no role.
    std::fs::write(dir.path().join("manifest.json"), r#"{"inputs": {}}"#).unwrap();
    let e = manifest::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("`outputs`: missing"), "{e}");
    let text = r#"{"inputs": {"input_ids": {"name": "input_ids"}}, "outputs": {"logits": {"name": "logits"}}}"#;
    std::fs::write(dir.path().join("manifest.json"), text).unwrap();
    let e = open_dir(dir.path()).err().unwrap().to_string();
    assert!(e.contains("has input `attention_mask`"), "{e}");

    // Without a manifest: optimum-intel's names; without the .bin: the file is named.
    std::fs::remove_file(dir.path().join("manifest.json")).unwrap();
    assert!(manifest::open(dir.path()).is_ok());
    std::fs::remove_file(dir.path().join("openvino_model.bin")).unwrap();
    let e = manifest::open(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("openvino_model.bin") && e.contains("does not exist"),
        "{e}"
    );
}

#[test]
fn a_static_context_in_the_manifest_is_enforced() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["openvino_model.xml", "openvino_model.bin"] {
        std::fs::copy(ir("tiny-f32").join(f), dir.path().join(f)).unwrap();
    }
    let text = std::fs::read_to_string(ir("tiny-f32").join("manifest.json")).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    m["context"] = 16.into();
    std::fs::write(dir.path().join("manifest.json"), m.to_string()).unwrap();
    let mut device = open_dir(dir.path()).unwrap();
    assert_eq!(device.record().context, Some(16));
    // 12 prompt tokens and 5 generated (4 fed back) fill 16 slots; one more token is refused, naming the context,
    // and the position stays where it was.
    let g = greedy(&mut device, &prompt(12), 5, &[], false, |_| Ok(())).unwrap();
    assert_eq!(g.tokens.len(), 5);
    assert_eq!(device.position().unwrap(), 16);
    let e = device.forward(&[1], false).unwrap_err().to_string();
    assert!(e.contains("static context holds 16"), "{e}");
    assert_eq!(device.position().unwrap(), 16);
    let e = greedy(&mut device, &prompt(17), 1, &[], false, |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("17 tokens after 0") && e.contains("manifest.json"),
        "{e}"
    );

    m["context"] = 0.into();
    std::fs::write(dir.path().join("manifest.json"), m.to_string()).unwrap();
    let e = manifest::open(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("`context`") && e.contains("whole number ≥ 1"),
        "{e}"
    );
}
