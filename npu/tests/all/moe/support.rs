//! tiny-moe and what the MoE tests share: the checkpoint in a weight format, transformers' goldens, the names of the
//! chosen experts, the reference's prompt taps, and each layer's own graph run on the reference's input.

use candle_core::{DType, Tensor};
use npu::devices::CompileOptions;
use npu::engine::{HostLayerState, LayerRunner};
use npu::graphs::{Builder, MoeGraphForm};
use npu::graphset::layout::CallPositions;
use reference::config::Config;
use reference::model::{Model, RunOptions};
use reference::quant::WeightFormat;
use reference::taps::{Taps, names};
use reference::weights::WeightStore;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The tiny-moe checkpoint's directory.
pub fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny-moe")
}

/// transformers' goldens of tiny-moe (`scripts/make_moe_goldens.py`).
pub fn golden() -> BTreeMap<String, Tensor> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/goldens/tiny-moe.safetensors");
    candle_core::safetensors::load(&path, &candle_core::Device::Cpu)
        .unwrap()
        .into_iter()
        .collect()
}

/// tiny-moe's config and its weights in `format` (`f32`, `f16`, `int4[:G]`).
pub fn open(format: &str) -> (Config, WeightStore) {
    let dir = model_dir();
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let format = WeightFormat::parse(format).unwrap();
    (
        config,
        WeightStore::open_with_format(&dir, DType::F32, format).unwrap(),
    )
}

/// `layers.{i}.mlp.experts_chosen` of every layer.
pub fn chosen_names(config: &Config) -> Vec<String> {
    (0..config.num_layers())
        .map(|i| names::layer(i, &names::mixer(names::MLP, names::EXPERTS_CHOSEN)))
        .collect()
}

/// One call's outputs under the dump's names: its taps and the logits of every row.
pub type Outputs = BTreeMap<String, Tensor>;
/// Rows of an i64 `[T, k]` tensor.
pub fn rows(t: &Tensor) -> Vec<Vec<i64>> {
    assert_eq!(t.dtype(), DType::I64, "experts_chosen is i64");
    t.to_vec2::<i64>().unwrap()
}

/// The graph shapes both tests run: prompt blocks of 16 in each MoE form, and one token (which always gathers).
pub const FORMS: [(usize, MoeGraphForm); 3] = [
    (16, MoeGraphForm::Masked),
    (16, MoeGraphForm::Gather),
    (1, MoeGraphForm::Gather),
];

/// The reference's prompt taps and states, one forward call.
pub fn reference_taps(
    config: &Config,
    weights: &WeightStore,
    ids: &[u32],
) -> (Outputs, Vec<reference::model::LayerState>) {
    let model = Model::from_weights(config.clone(), weights).unwrap();
    let mut state = model.new_state().unwrap();
    let mut taps = Taps::on();
    model
        .prefill(ids, &mut state, &RunOptions::default(), &mut taps)
        .unwrap();
    (taps.take().into_iter().collect(), state.layers)
}

/// Each layer's own graph run on the reference's input to that layer over the whole prompt, on `device`: its
/// outputs under the dump's names (`layers.{i}.` added).
pub fn layer_outputs(
    builder: &Builder,
    device: &str,
    tokens: usize,
    taps: &Outputs,
) -> Vec<Outputs> {
    let config = builder.config();
    (0..config.num_layers())
        .map(|layer| {
            let mut runner =
                LayerRunner::new(builder, layer, tokens, device, &CompileOptions::default())
                    .unwrap();
            let input = if layer == 0 {
                taps[names::EMBEDDINGS].clone()
            } else {
                taps[&names::layer(layer - 1, names::OUTPUT)].clone()
            };
            let mut state = HostLayerState::zeros(config, layer).unwrap();
            runner
                .run(&input, 0, CallPositions::TEXT, &mut state)
                .unwrap()
                .into_iter()
                .map(|(name, t)| (names::layer(layer, &name), t))
                .collect()
        })
        .collect()
}
