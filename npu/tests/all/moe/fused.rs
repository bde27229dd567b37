//! Experts stored fused, as transformers 5 holds them, build the very graphs experts stored one by one build.

use crate::moe::support::{model_dir, open};
use candle_core::{DType, Tensor};
use npu::graphs::{Builder, GraphOptions};
use reference::config::Config;
use reference::quant::WeightFormat;
use reference::weights::WeightStore;
use std::collections::BTreeMap;

/// A copy of tiny-moe in `dir` with every layer's experts stored fused, as transformers 5 holds them: one
/// `experts.gate_up_proj` `[E, 2·Im, H]` (each expert's gate rows, then its up rows) and one `experts.down_proj`
/// `[E, H, Im]`.
fn fused_copy(dir: &std::path::Path, config: &Config) {
    let src = model_dir();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let mut tensors: BTreeMap<String, Tensor> =
        candle_core::safetensors::load(src.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap()
            .into_iter()
            .collect();
    let experts = config.moe.as_ref().unwrap().num_experts;
    for layer in 0..config.num_layers() {
        let key = |rest: &str| format!("model.layers.{layer}.mlp.experts.{rest}");
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..experts {
            let mut take =
                |proj: &str| tensors.remove(&key(&format!("{e}.{proj}.weight"))).unwrap();
            let (gate, up) = (take("gate_proj"), take("up_proj"));
            gate_up.push(Tensor::cat(&[gate, up], 0).unwrap());
            down.push(take("down_proj"));
        }
        tensors.insert(key("gate_up_proj"), Tensor::stack(&gate_up, 0).unwrap());
        tensors.insert(key("down_proj"), Tensor::stack(&down, 0).unwrap());
    }
    reference::synthetic::write_safetensors(&dir.join("model.safetensors"), &tensors, DType::F32)
        .unwrap();
}

/// Experts stored fused build the very graphs experts stored one by one build: the same IR, XML and `.bin` byte for
/// byte, in f32 and INT4/INT8.
#[test]
fn a_fused_checkpoint_builds_the_same_graphs() {
    let (config, _) = open("f32");
    let dir = tempfile::tempdir().unwrap();
    fused_copy(dir.path(), &config);
    for format in ["f32", "int4:32"] {
        let format = WeightFormat::parse(format).unwrap();
        let apart = WeightStore::open_with_format(&model_dir(), DType::F32, format).unwrap();
        let fused = WeightStore::open_with_format(dir.path(), DType::F32, format).unwrap();
        for tokens in [1, 16] {
            let ir = |weights: &WeightStore| {
                let builder = Builder::new(&config, weights, GraphOptions::default()).unwrap();
                let g = builder.decoder_graph(tokens).unwrap();
                let (xml, bin) = g.serialize();
                (xml, bin.to_vec())
            };
            let (a, f) = (ir(&apart), ir(&fused));
            assert_eq!(a.0, f.0, "{} t{tokens}: XML", format.name());
            assert!(a.1 == f.1, "{} t{tokens}: .bin bytes differ", format.name());
            println!(
                "{} t{tokens}: {} bytes of .bin, the same from a fused checkpoint",
                format.name(),
                a.1.len()
            );
        }
    }
}
