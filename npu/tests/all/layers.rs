//! Every per-layer graph, in every form, against the reference on the testdata models (CPU device, f32).

use candle_core::{DType, Tensor};
use npu::devices::CompileOptions;
use npu::engine::{HostLayerState, LayerRunner};
use npu::graphs::{Builder, DeltaNetGraphForm, GraphOptions};
use npu::graphset::layout::CallPositions;
use reference::config::{Config, LayerKind};
use reference::deltanet::Inverse;
use reference::model::{LayerState, Model, RunOptions};
use reference::taps::Taps;
use reference::weights::WeightStore;
use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::common;
use common::Worst;

fn model_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/models")
        .join(name)
}

/// The golden prompt of a model.
fn prompt(name: &str) -> Vec<u32> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../testdata/goldens/{name}.safetensors"));
    let t = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
    common::ids_of(&t["token_ids"])
}

/// The reference's taps and states after the prompt.
fn reference_run(
    dir: &std::path::Path,
    ids: &[u32],
) -> (BTreeMap<String, Tensor>, Vec<LayerState>) {
    let model = Model::load(dir, DType::F32).unwrap();
    let mut state = model.new_state().unwrap();
    let mut taps = Taps::on();
    model
        .prefill(ids, &mut state, &RunOptions::default(), &mut taps)
        .unwrap();
    (taps.take(), state.layers)
}

// The forms in two tests, so that the two halves (each compiles and runs every layer of every model) run side by
// side.

#[test]
fn layer_graphs_match_the_reference_in_the_chunked_forms() {
    layer_graphs_match_the_reference(&[
        (16, DeltaNetGraphForm::Chunked(Inverse::Doubling), 1024.0),
        (64, DeltaNetGraphForm::Chunked(Inverse::Doubling), 1.0),
        (
            16,
            DeltaNetGraphForm::Chunked(Inverse::Substitution),
            1024.0,
        ),
        (8, DeltaNetGraphForm::Chunked(Inverse::Series), 1024.0),
    ]);
}

#[test]
fn layer_graphs_match_the_reference_in_the_matrix_and_loop_forms() {
    layer_graphs_match_the_reference(&[
        (5, DeltaNetGraphForm::Matrix, 1024.0),
        (1, DeltaNetGraphForm::Matrix, 1024.0),
        (16, DeltaNetGraphForm::Loop, 1.0),
    ]);
}

/// Every layer graph of every testdata model, in each of `forms` (tokens per call, form, output scale), against the
/// reference's taps and states.
fn layer_graphs_match_the_reference(forms: &[(usize, DeltaNetGraphForm, f32)]) {
    for name in common::models() {
        let name = name.as_str();
        let dir = model_dir(name);
        let ids = prompt(name);
        let (taps, states) = reference_run(&dir, &ids);
        let config = Config::from_file(&dir.join("config.json")).unwrap();
        let weights = WeightStore::open(&dir, DType::F32).unwrap();
        for &(tokens, form, scale) in forms {
            let opts = GraphOptions {
                form,
                output_scale: scale,
                context: 160,
                taps: true,
                ..GraphOptions::default()
            };
            let builder = Builder::new(&config, &weights, opts).unwrap();
            let mut worst = Worst::default();
            for layer in 0..config.num_layers() {
                let mut runner =
                    LayerRunner::new(&builder, layer, tokens, "CPU", &CompileOptions::default())
                        .unwrap();
                let input = if layer == 0 {
                    taps["embeddings"].clone()
                } else {
                    taps[&format!("layers.{}.output", layer - 1)].clone()
                };
                let mut state = HostLayerState::zeros(&config, layer).unwrap();
                let out = runner
                    .run(&input, 0, CallPositions::TEXT, &mut state)
                    .unwrap();
                let label = format!("{name} layer {layer} T={tokens} {form:?} scale {scale}");
                for (tap, t) in &out {
                    let reference_name = if tap == "output"
                        || tap == "mixer_output"
                        || tap == "mlp_output"
                        || tap.contains('.')
                    {
                        format!("layers.{layer}.{tap}")
                    } else {
                        panic!("{label}: unexpected output {tap}");
                    };
                    worst.check(&label, &reference_name, t, &taps[&reference_name], &config);
                }
                let [first, second] =
                    reference::model::state_names(layer, config.layer_types[layer]);
                match (&state, &states[layer], config.layer_types[layer]) {
                    (
                        HostLayerState::Linear { conv, recurrent },
                        LayerState::Linear(s),
                        LayerKind::Linear,
                    ) => {
                        worst.check(&label, &first, conv, &s.conv, &config);
                        worst.check(&label, &second, recurrent, &s.recurrent, &config);
                    }
                    (
                        HostLayerState::Attention { keys, values },
                        LayerState::Attention(c),
                        LayerKind::Full,
                    ) => {
                        assert_eq!(keys.dim(1).unwrap(), ids.len());
                        worst.check(&label, &first, keys, c.keys.as_ref().unwrap(), &config);
                        worst.check(&label, &second, values, c.values.as_ref().unwrap(), &config);
                    }
                    _ => panic!("{label}: state kinds differ"),
                }
            }
            println!(
                "{name}: layer graphs T={tokens} {form:?} scale {scale}: worst error {:.2e} of its head's (or \
                 tensor's) max\n{}",
                worst.overall(),
                worst.report()
            );
        }
    }
}
