//! Graph sets read from files (`testdata/sets/`, written by `scripts/make_graph_sets.py`) through the one engine:
//! the sets `qwen35 export-ir` writes compute exactly what this project's graphs built in memory compute; the
//! optimum export made stateless by OpenVINO's transformation exposes states that agree with the reference's; the
//! renamed copy (every port renamed, the recurrent states transposed) is the same graph to the bit; each graph broken
//! on purpose differs from the reference in the one state it breaks.

use candle_core::{DType, Tensor};
use npu::devices::CompileOptions;
use npu::engine::{DecoderEngine, HostLayerState, LayerChain, LayerRunner};
use npu::graphs::{Builder, GraphOptions};
use npu::graphset::layout::CallPositions;
use npu::graphset::{PromptRule, manifest};
use reference::backend::{Backend, ReferenceBackend, Snapshot, greedy};
use reference::config::Config;
use reference::model::{Model, RunOptions};
use reference::weights::WeightStore;
use std::path::PathBuf;

fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

fn tiny() -> (Config, WeightStore) {
    let dir = testdata().join("models/tiny");
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let store = WeightStore::open(&dir, DType::F32).unwrap();
    (config, store)
}

fn open(name: &str) -> DecoderEngine {
    let (config, _) = tiny();
    let set = manifest::open(&testdata().join("sets").join(name)).unwrap();
    DecoderEngine::open(&set, config, "CPU", &CompileOptions::default(), None).unwrap()
}

fn reference() -> ReferenceBackend {
    let (config, store) = tiny();
    let model = Model::from_weights(config, &store).unwrap();
    ReferenceBackend::new(model, RunOptions::default(), false, "f32").unwrap()
}

/// A chat prompt of the tiny model (the golden's), cut to `n` tokens.
fn prompt(n: usize) -> Vec<u32> {
    let g = candle_core::safetensors::load(
        testdata().join("goldens/tiny.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let ids: Vec<i64> = g["token_ids"].to_vec1().unwrap();
    ids[..n].iter().map(|&x| x as u32).collect()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `‖a − b‖ / ‖b‖`.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (values(a), values(b));
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
    (num / b.iter().map(|y| y * y).sum::<f64>().max(1e-300)).sqrt()
}

/// Every state of `a` against `b`'s: (name, relative error), worst first.
fn state_errors(a: &Snapshot, b: &Snapshot) -> Vec<(String, f64)> {
    assert_eq!(a.position, b.position);
    assert_eq!(
        a.tensors.keys().collect::<Vec<_>>(),
        b.tensors.keys().collect::<Vec<_>>()
    );
    let mut e: Vec<(String, f64)> = b
        .tensors
        .iter()
        .map(|(k, t)| (k.clone(), rel(&a.tensors[k], t)))
        .collect();
    e.sort_by(|x, y| y.1.total_cmp(&x.1));
    e
}

#[test]
fn an_exported_decoder_set_computes_what_the_graphs_built_in_memory_compute() {
    let (config, store) = tiny();
    let builder = Builder::new(&config, &store, GraphOptions::default()).unwrap();
    let mut own = DecoderEngine::new(&builder, 16, "CPU", &CompileOptions::default()).unwrap();
    let mut set = open("tiny-decoder");
    assert_eq!(set.blocks(), vec![1, 16]);
    assert!(set.takes_token_valid() && set.has_taps() && set.exposes_state());
    // 35 tokens: two blocks and a padded one, then single-token decode.
    let ids = prompt(35);
    let a = greedy(&mut own, &ids, 6, &[], true, |_| Ok(())).unwrap();
    let b = greedy(&mut set, &ids, 6, &[], true, |_| Ok(())).unwrap();
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(rel(&b.prompt.logits, &a.prompt.logits), 0.0);
    for (x, y) in a.logits.iter().zip(&b.logits) {
        assert_eq!(rel(y, x), 0.0);
    }
    for (name, e) in state_errors(&b.after_prompt, &a.after_prompt) {
        assert_eq!(e, 0.0, "{name}");
    }
    assert_eq!(
        a.prompt.taps.keys().collect::<Vec<_>>(),
        b.prompt.taps.keys().collect::<Vec<_>>()
    );
    // Without padding (full blocks, then single tokens) the same prompt agrees to f32 rounding.
    set.set_prompt_rule(PromptRule::Blocks).unwrap();
    let c = greedy(&mut set, &ids, 6, &[], true, |_| Ok(())).unwrap();
    assert_eq!(c.tokens, a.tokens);
    let e = rel(&c.prompt.logits, &a.prompt.logits);
    assert!(e > 0.0 && e < 1e-5, "{e:e}");
}

#[test]
fn an_exported_per_layer_set_is_the_in_memory_layer_graph_and_chains_into_the_decoder() {
    let (config, store) = tiny();
    let builder = Builder::new(&config, &store, GraphOptions::default()).unwrap();
    let set = manifest::open(&testdata().join("sets/tiny-layers")).unwrap();
    assert!(set.decoder.is_none());
    let files = &set.layers.as_ref().unwrap().graphs;
    let g = files
        .iter()
        .find(|g| g.layer == Some(3) && g.tokens == Some(16))
        .unwrap();
    let mut from_file =
        LayerRunner::open(&set, g, config.clone(), "CPU", &CompileOptions::default()).unwrap();
    let mut in_memory =
        LayerRunner::new(&builder, 3, 16, "CPU", &CompileOptions::default()).unwrap();
    let hidden = Tensor::randn(
        0f32,
        1.0,
        (20, config.hidden_size),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let mut s1 = HostLayerState::zeros(&config, 3).unwrap();
    let mut s2 = HostLayerState::zeros(&config, 3).unwrap();
    let a = from_file
        .run(&hidden, 0, CallPositions::TEXT, &mut s1)
        .unwrap();
    let b = in_memory
        .run(&hidden, 0, CallPositions::TEXT, &mut s2)
        .unwrap();
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (k, t) in &a {
        assert_eq!(rel(t, &b[k]), 0.0, "{k}");
    }

    let host = Model::from_weights(config.clone(), &store).unwrap();
    let mut chain = LayerChain::open(&set, host, "CPU", &CompileOptions::default()).unwrap();
    let mut r = reference();
    let ids = prompt(35);
    let x = greedy(&mut chain, &ids, 8, &[], true, |_| Ok(())).unwrap();
    let y = greedy(&mut r, &ids, 8, &[], true, |_| Ok(())).unwrap();
    assert_eq!(x.tokens, y.tokens);
    let e = rel(&x.prompt.logits, &y.prompt.logits);
    assert!(e < 1e-5, "chain logits {e:e}");
    let worst = &state_errors(&x.after_prompt, &y.after_prompt)[0];
    assert!(worst.1 < 1e-4, "{worst:?}");
}

#[test]
fn the_stateless_export_exposes_states_that_agree_with_the_reference() {
    let mut device = open("tiny-stateless");
    assert!(device.exposes_state());
    assert!(device.blocks().is_empty(), "a dynamic graph");
    let mut r = reference();
    let ids = prompt(40);
    let d = greedy(&mut device, &ids, 8, &[], true, |_| Ok(())).unwrap();
    let g = greedy(&mut r, &ids, 8, &[], true, |_| Ok(())).unwrap();
    assert_eq!(d.tokens, g.tokens);
    let e = rel(&d.prompt.logits, &g.prompt.logits);
    assert!(e < 1e-5, "logits {e:e}");
    let errors = state_errors(&d.after_prompt, &g.after_prompt);
    eprintln!("stateless export vs reference, states after 40 tokens: {errors:?}");
    assert!(errors[0].1 < 1e-5, "{:?}", errors[0]);
    // A snapshot restored continues exactly as the state it was taken from.
    let kept = device.snapshot().unwrap();
    let next = device.forward(&[5], false).unwrap().logits;
    device.restore(&kept).unwrap();
    let again = device.forward(&[5], false).unwrap().logits;
    assert_eq!(rel(&again, &next), 0.0);

    // Embeddings fed by the host in place of token ids: the same graph but for the lookup, bit for bit.
    let (config, store) = tiny();
    let model = Model::from_weights(config.clone(), &store).unwrap();
    let set = manifest::open(&testdata().join("sets/tiny-embeds")).unwrap();
    let e = DecoderEngine::open(
        &set,
        config.clone(),
        "CPU",
        &CompileOptions::default(),
        None,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("embedding table"), "{e}");
    let mut embeds = DecoderEngine::open(
        &set,
        config,
        "CPU",
        &CompileOptions::default(),
        Some(model.token_table()),
    )
    .unwrap();
    let x = greedy(&mut embeds, &ids, 8, &[], true, |_| Ok(())).unwrap();
    assert_eq!(x.tokens, d.tokens);
    assert_eq!(rel(&x.prompt.logits, &d.prompt.logits), 0.0);
    for (name, e) in state_errors(&x.after_prompt, &d.after_prompt) {
        assert_eq!(e, 0.0, "{name}");
    }

    // The renamed copy (its recurrent states transposed) is the same graph: bit for bit.
    let mut renamed = open("tiny-renamed");
    let n = greedy(&mut renamed, &ids, 8, &[], true, |_| Ok(())).unwrap();
    assert_eq!(n.tokens, d.tokens);
    assert_eq!(rel(&n.prompt.logits, &d.prompt.logits), 0.0);
    for (name, e) in state_errors(&n.after_prompt, &d.after_prompt) {
        assert_eq!(e, 0.0, "{name}");
    }
}

#[test]
fn each_broken_graph_differs_in_exactly_its_state() {
    let mut r = reference();
    let ids = prompt(40);
    let g = greedy(&mut r, &ids, 2, &[], false, |_| Ok(())).unwrap();
    for (set, state) in [
        ("broken-conv-shift", "layers.1.conv_state"),
        ("broken-kv-late", "layers.3.key_cache"),
        ("broken-ssm-scaled", "layers.2.recurrent_state"),
    ] {
        let mut device = open(set);
        let d = greedy(&mut device, &ids, 2, &[], false, |_| Ok(())).unwrap();
        let errors = state_errors(&d.after_prompt, &g.after_prompt);
        eprintln!("{set}: {:?}", &errors[..3]);
        assert_eq!(errors[0].0, state, "{set}: {errors:?}");
        assert!(errors[0].1 > 5e-3, "{set}: {errors:?}");
    }
}

/// A copy of the renamed set whose manifest is changed by `edit`, opened on the CPU: the error, if any.
fn renamed_with(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let src = testdata().join("sets/tiny-renamed");
    std::fs::copy(
        src.join("openvino_model.xml"),
        tmp.path().join("openvino_model.xml"),
    )
    .unwrap();
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("manifest.json")).unwrap()).unwrap();
    let bin = testdata().join("sets/tiny-stateless/openvino_model.bin");
    m["decoder"]["graphs"][0]["bin"] = bin.display().to_string().into();
    edit(&mut m);
    std::fs::write(tmp.path().join("manifest.json"), m.to_string()).unwrap();
    let (config, _) = tiny();
    match manifest::open(tmp.path())
        .and_then(|set| DecoderEngine::open(&set, config, "CPU", &CompileOptions::default(), None))
    {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_description_that_does_not_match_the_graph_names_the_port_the_file_and_the_key() {
    assert_eq!(renamed_with(|_| {}), "", "the renamed set opens as it is");
    // The recurrent states' layout as the stateless naming has it: the graph's ports are transposed.
    let e = renamed_with(|m| {
        m["decoder"]["states"]["recurrent_state"]["shape"] =
            serde_json::json!(["batch", "heads", "key_dim", "value_dim"])
    });
    assert!(
        e.contains("`decoder.states.recurrent_state.input`")
            && e.contains("`dn0_S_T` dim 2 is 24")
            && e.contains("`key_dim` is 16")
            && e.contains("openvino_model.xml"),
        "{e}"
    );
    let e = renamed_with(|m| m["decoder"]["states"]["key_cache"]["type"] = "f16".into());
    assert!(
        e.contains("`attn3_K` is f32 in the graph, the description says f16"),
        "{e}"
    );
    let e = renamed_with(|m| {
        m["decoder"]["states"]
            .as_object_mut()
            .unwrap()
            .remove("value_cache");
    });
    assert!(
        e.contains("`decoder.states.value_cache`") && e.contains("layer 3 (full_attention)"),
        "{e}"
    );
    let e = renamed_with(|m| m["decoder"]["states"]["conv_state"]["input"]["1"] = "nope".into());
    assert!(
        e.contains("names input `nope`, which the graph does not have"),
        "{e}"
    );
    let e = renamed_with(|m| {
        m["decoder"]["inputs"]
            .as_object_mut()
            .unwrap()
            .remove("positions");
    });
    assert!(
        e.contains("has input `where`, which the description maps to no role"),
        "{e}"
    );
    // The manifest itself: an unknown axis, an unknown key, a cache update that is none of the three.
    let e = renamed_with(|m| {
        m["decoder"]["inputs"]["input_ids"]["shape"] = serde_json::json!(["tokenz"])
    });
    assert!(
        e.contains("`decoder.inputs.input_ids.shape[0]`") && e.contains("unknown axis `tokenz`"),
        "{e}"
    );
    let e = renamed_with(|m| m["decoder"]["stats"] = serde_json::json!({}));
    assert!(e.contains("`decoder.stats`: not a key here"), "{e}");
    let e = renamed_with(|m| {
        m["decoder"]["states"]["key_cache"]["output_shape"] =
            serde_json::json!(["batch", "kv_heads", "past", "head_dim"])
    });
    assert!(e.contains("`past` → `past`"), "{e}");
}

mod layout {
    use candle_core::{Device, Tensor};
    use npu::graphset::layout::{from_port, to_port};
    use npu::graphset::{Axis, ElemKind, PortSpec};
    use proptest::prelude::*;

    proptest! {
        /// Any axis order, with batch axes anywhere: into a port's layout and back is the identity.
        #[test]
        fn a_state_goes_into_any_layout_and_back(perm in Just([0usize, 1, 2]).prop_shuffle(), batch in 0usize..5) {
            let canonical = [Axis::Heads, Axis::KeyDim, Axis::ValueDim];
            let dims = [2usize, 3, 5];
            let t = Tensor::arange(0f32, 30.0, &Device::Cpu).unwrap().reshape(dims.to_vec()).unwrap();
            let mut shape: Vec<Axis> = perm.iter().map(|&i| canonical[i]).collect();
            let mut port_dims: Vec<usize> = perm.iter().map(|&i| dims[i]).collect();
            if batch < 4 {
                shape.insert(batch.min(shape.len()), Axis::Batch);
                port_dims.insert(batch.min(port_dims.len()), 1);
            }
            let port = PortSpec::new("s", ElemKind::F32, &shape);
            let p = to_port(&t, &canonical, &port, &port_dims, "test").unwrap();
            prop_assert_eq!(p.dims(), &port_dims[..]);
            // Each element lands where its axes say.
            let pv: Vec<f32> = p.flatten_all().unwrap().to_vec1().unwrap();
            let named: Vec<usize> = shape.iter().filter_map(|a| canonical.iter().position(|c| c == a)).collect();
            let strides: Vec<usize> = (0..port_dims.len()).map(|i| port_dims[i + 1..].iter().product()).collect();
            let named_strides: Vec<usize> = shape.iter().zip(&strides).filter(|(a, _)| !a.is_unit()).map(|(_, s)| *s).collect();
            for h in 0..2 { for k in 0..3 { for v in 0..5 {
                let idx = [h, k, v];
                let at: usize = named.iter().zip(&named_strides).map(|(&c, &s)| idx[c] * s).sum();
                prop_assert_eq!(pv[at], (h * 15 + k * 5 + v) as f32);
            }}}
            let back = from_port(&p, &shape, &canonical, "test").unwrap();
            let a: Vec<f32> = back.flatten_all().unwrap().to_vec1().unwrap();
            let b: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            prop_assert_eq!(a, b);
        }
    }
}
