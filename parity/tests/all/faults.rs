//! Fault injection: a device wrong in one known place (a scaled weight, a swapped gate, a leaky state hand-off) makes
//! the probe flag exactly that layer, state or op.

use candle_core::{DType, Tensor};
use npu::devices::CompileOptions;
use npu::engine::HostLayerState;
use npu::graphs::{Builder, GraphOptions};
use npu::graphset::layout::CallPositions;
use parity::device::DeviceLayers;
use parity::images::PromptInput;
use parity::probe::{LayerDevice, Mode, ProbeThresholds, ReferenceTrace, drill_down, probe};
use reference::backend::{ReferenceBackend, RunRecord};
use reference::config::Config;
use reference::model::{Model, RunOptions};
use reference::schema::{Param, Schema};
use reference::weights::WeightStore;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::common;
use common::testdata;

fn tiny() -> PathBuf {
    testdata().join("models/tiny")
}

/// A copy of the tiny model whose tensor `spec` is replaced by `edit(tensor)`.
fn corrupted_copy(dir: &Path, param: Param, layer: usize, edit: impl Fn(&Tensor) -> Tensor) {
    let src = tiny();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let config = Config::from_file(&src.join("config.json")).unwrap();
    let name = Schema::new(&config).layer(layer, param).full_name("model.");
    let mut tensors: BTreeMap<String, Tensor> =
        candle_core::safetensors::load(src.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap()
            .into_iter()
            .collect();
    let t = tensors.get(&name).unwrap().clone();
    tensors.insert(name, edit(&t));
    reference::io::save_safetensors(&dir.join("model.safetensors"), &tensors, &BTreeMap::new())
        .unwrap();
}

/// The reference's trace of a 40-token prompt in blocks of 16.
fn reference_trace(config: &Config) -> ReferenceTrace {
    let store = WeightStore::open(&tiny(), DType::F32).unwrap();
    let model = Model::from_weights(config.clone(), &store).unwrap();
    let mut reference = ReferenceBackend::new(model, RunOptions::default(), true, "f32").unwrap();
    let ids: Vec<u32> = (0..40).map(|i| (i * 29 + 3) % 500).collect();
    ReferenceTrace::new(&mut reference, &PromptInput::Ids(ids), 16).unwrap()
}

/// The per-layer graphs of the checkpoint in `dir`, every layer compiled.
fn device_layers(dir: &Path, config: &Config) -> DeviceLayers {
    let store = WeightStore::open(dir, DType::F32).unwrap();
    let builder = Builder::new(
        config,
        &store,
        GraphOptions {
            context: 64,
            ..GraphOptions::default()
        },
    )
    .unwrap();
    let all: Vec<usize> = (0..config.num_layers()).collect();
    DeviceLayers::build(&builder, &all, 16, "CPU", &CompileOptions::default()).unwrap()
}

fn flagged(layers: &[parity::probe::LayerProbe]) -> Vec<usize> {
    layers.iter().filter(|l| l.over).map(|l| l.layer).collect()
}

const F32: ProbeThresholds = ProbeThresholds {
    max_nrmse: 1e-4,
    max_state_nrmse: 1e-4,
};

#[test]
fn a_scaled_weight_is_flagged_in_exactly_its_layer() {
    let config = Config::from_file(&tiny().join("config.json")).unwrap();
    let trace = reference_trace(&config);
    let tmp = tempfile::tempdir().unwrap();
    // Layer 1's DeltaNet output projection 3% too large.
    corrupted_copy(tmp.path(), Param::OutProj, 1, |t| (t * 1.03).unwrap());
    let mut device = device_layers(tmp.path(), &config);
    let all: Vec<usize> = (0..config.num_layers()).collect();
    let isolated = probe(&config, &trace, &mut device, &all, Mode::Isolated, F32).unwrap();
    assert_eq!(
        flagged(&isolated),
        vec![1],
        "isolated mode flags the corrupted layer and no other"
    );
    let d = drill_down(&isolated).unwrap();
    assert_eq!(d.layer, 1);
    // Everything before out_proj agrees; the error starts at the mixer output.
    assert_eq!(
        d.first_over.as_deref(),
        Some("mixer_output"),
        "{:?}",
        d.intermediates
    );
    let chained = probe(&config, &trace, &mut device, &all, Mode::Chained, F32).unwrap();
    let flagged_chained = flagged(&chained);
    assert_eq!(
        flagged_chained.first(),
        Some(&1),
        "chained: {flagged_chained:?}"
    );
    assert!(!flagged_chained.contains(&0));
}

#[test]
fn a_swapped_gate_is_flagged_at_the_attention_layer_and_its_query() {
    let config = Config::from_file(&tiny().join("config.json")).unwrap();
    let trace = reference_trace(&config);
    let tmp = tempfile::tempdir().unwrap();
    // q_proj rows per head are [query D | gate D]: swap the halves of every head.
    let (heads, d) = (config.num_attention_heads, config.head_dim);
    corrupted_copy(tmp.path(), Param::QProj, 3, |t| {
        let (rows, cols) = t.dims2().unwrap();
        let per_head = t.reshape((heads, 2, d, cols)).unwrap();
        let swapped = Tensor::cat(
            &[
                per_head.narrow(1, 1, 1).unwrap(),
                per_head.narrow(1, 0, 1).unwrap(),
            ],
            1,
        )
        .unwrap();
        swapped.reshape((rows, cols)).unwrap()
    });
    let mut device = device_layers(tmp.path(), &config);
    let all: Vec<usize> = (0..config.num_layers()).collect();
    let isolated = probe(&config, &trace, &mut device, &all, Mode::Isolated, F32).unwrap();
    assert_eq!(flagged(&isolated), vec![3]);
    let d = drill_down(&isolated).unwrap();
    assert_eq!(
        d.first_over.as_deref(),
        Some("self_attn.query"),
        "{:?}",
        d.intermediates
    );
}

/// A device whose state hand-off is corrupted: the recurrent state it returns is 1% too large.
struct LeakyState(DeviceLayers);

impl LayerDevice for LeakyState {
    fn run(
        &mut self,
        layer: usize,
        hidden: &Tensor,
        start: usize,
        positions: CallPositions,
        state: &mut HostLayerState,
    ) -> anyhow::Result<BTreeMap<String, Tensor>> {
        let out = self.0.run(layer, hidden, start, positions, state)?;
        if let HostLayerState::Linear { recurrent, .. } = state {
            *recurrent = (&*recurrent * 1.01)?;
        }
        Ok(out)
    }

    fn block(&self) -> usize {
        self.0.block()
    }

    fn context(&self) -> Option<usize> {
        self.0.context()
    }

    fn record(&self) -> RunRecord {
        self.0.record()
    }
}

#[test]
fn a_corrupted_state_hand_off_fails_the_state_rows() {
    let config = Config::from_file(&tiny().join("config.json")).unwrap();
    let trace = reference_trace(&config);
    let mut device = LeakyState(device_layers(&tiny(), &config));
    let all: Vec<usize> = (0..config.num_layers()).collect();
    let layers = probe(&config, &trace, &mut device, &all, Mode::Isolated, F32).unwrap();
    for l in &layers {
        let recurrent = l
            .states
            .iter()
            .find(|s| s.name.ends_with("recurrent_state"));
        if l.kind == "linear_attention" {
            assert!(l.over, "layer {}", l.layer);
            assert!(
                recurrent.unwrap().error.nrmse.get() > F32.max_state_nrmse,
                "layer {}",
                l.layer
            );
            assert!(
                l.state_drift.iter().all(|&e| e > F32.max_state_nrmse),
                "layer {}: {:?}",
                l.layer,
                l.state_drift
            );
            // Isolated: each block starts from the reference's state, so the outputs of the first block are exact;
            // only the hand-off is wrong.
            assert!(l.output.unwrap().nrmse.get() < 1e-5, "layer {}", l.layer);
        } else {
            assert!(
                !l.over,
                "the attention layer {} has no recurrent state",
                l.layer
            );
        }
    }
}
