//! FP16SIM with nothing rounded (`store=f32,ftz=off`) is a second executor of the graphs, sharing no code with
//! OpenVINO: on every testdata model and form it must agree with OpenVINO's CPU device at f32. Then the arithmetic
//! it models: fp16 rounding moves the numbers by fp16's precision, and flushing subnormals zeroes what they hold.

use candle_core::{DType, Tensor};
use npu::devices::CompileOptions;
use npu::engine::{DecoderEngine, HostLayerState, LayerRunner};
use npu::graphs::{Builder, DeltaNetGraphForm, GraphOptions};
use npu::graphset::layout::CallPositions;
use reference::backend::{Backend, ReferenceBackend};
use reference::compare::diff;
use reference::config::Config;
use reference::deltanet::Inverse;
use reference::model::{Model, RunOptions};
use reference::weights::WeightStore;
use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::common;
use common::run;

const EXACT: &str = "FP16SIM:store=f32,ftz=off";

fn model_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/models")
        .join(name)
}

/// A 40-token prompt and the reference's taps over it.
fn reference_taps(dir: &std::path::Path) -> (Vec<u32>, BTreeMap<String, Tensor>) {
    let ids: Vec<u32> = (0..40).map(|i| (i * 41 + 7) % 500).collect();
    let model = Model::load(dir, DType::F32).unwrap();
    let mut backend = ReferenceBackend::new(model, RunOptions::default(), true, "f32").unwrap();
    let f = backend.forward(&ids, true).unwrap();
    (ids, f.taps)
}

/// Largest relative difference (to the OpenVINO tensor's max) over every output of two runs.
fn worst_of(label: &str, sim: &BTreeMap<String, Tensor>, ov: &BTreeMap<String, Tensor>) -> f64 {
    assert_eq!(
        sim.keys().collect::<Vec<_>>(),
        ov.keys().collect::<Vec<_>>(),
        "{label}"
    );
    let mut worst = (0f64, String::new());
    for (name, t) in ov {
        let d = diff(&sim[name], t).unwrap();
        assert_eq!(d.non_finite, 0, "{label} {name}");
        if d.relative() > worst.0 {
            worst = (d.relative(), format!("{name}: {d}"));
        }
    }
    println!("{label}: worst {}", worst.1);
    worst.0
}

// The forms in two tests, so that the two halves run side by side.

#[test]
fn exact_fp16sim_agrees_with_openvino_on_every_layer_graph_in_the_chunked_forms() {
    exact_fp16sim_agrees_with_openvino_on_every_layer_graph(&[
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
fn exact_fp16sim_agrees_with_openvino_on_every_layer_graph_in_the_matrix_and_loop_forms() {
    exact_fp16sim_agrees_with_openvino_on_every_layer_graph(&[
        (5, DeltaNetGraphForm::Matrix, 1024.0),
        (1, DeltaNetGraphForm::Matrix, 1.0),
        (16, DeltaNetGraphForm::Loop, 1.0),
    ]);
}

/// Every layer graph of every testdata model, in each of `forms`, on FP16SIM with f32 storage and on OpenVINO's CPU.
fn exact_fp16sim_agrees_with_openvino_on_every_layer_graph(
    forms: &[(usize, DeltaNetGraphForm, f32)],
) {
    let mut overall = 0f64;
    for name in common::models() {
        let name = name.as_str();
        let dir = model_dir(name);
        let (_, taps) = reference_taps(&dir);
        let config = Config::from_file(&dir.join("config.json")).unwrap();
        let weights = WeightStore::open(&dir, DType::F32).unwrap();
        for &(tokens, form, scale) in forms {
            let opts = GraphOptions {
                form,
                output_scale: scale,
                context: 64,
                taps: true,
                ..GraphOptions::default()
            };
            let builder = Builder::new(&config, &weights, opts).unwrap();
            let mut worst = 0f64;
            for layer in 0..config.num_layers() {
                let input = if layer == 0 {
                    taps["embeddings"].clone()
                } else {
                    taps[&format!("layers.{}.output", layer - 1)].clone()
                };
                let mut outputs = Vec::new();
                for device in ["CPU", EXACT] {
                    let mut runner = LayerRunner::new(
                        &builder,
                        layer,
                        tokens,
                        device,
                        &CompileOptions::default(),
                    )
                    .unwrap();
                    let mut state = HostLayerState::zeros(&config, layer).unwrap();
                    let mut out = runner
                        .run(&input, 0, CallPositions::TEXT, &mut state)
                        .unwrap();
                    out.extend(state.dump_tensors(layer).unwrap());
                    outputs.push(out);
                }
                let label = format!("{name} layer {layer} T={tokens} {form:?}");
                worst = worst.max(worst_of(&label, &outputs[1], &outputs[0]));
            }
            println!(
                "{name} T={tokens} {form:?} ×{scale}: FP16SIM f32 vs OpenVINO CPU f32, worst {worst:.2e} of max"
            );
            // f32 summation-order noise. Measured worst 5.0e-6 on tiny-decay (the gated norm's output, whose
            // strongly decaying heads' outputs are small), 1.5e-6 on the other models (tiny-full, T=8, the series
            // inverse): twice the worst.
            assert!(worst < 1e-5, "{name} T={tokens} {form:?}: {worst:.2e}");
            overall = overall.max(worst);
        }
    }
    println!("every layer graph: worst {overall:.2e} of max");
}

#[test]
fn exact_fp16sim_decodes_as_openvino_does() {
    for name in ["tiny", "tiny-tied", "tiny-full"] {
        let dir = model_dir(name);
        let (ids, _) = reference_taps(&dir);
        let config = Config::from_file(&dir.join("config.json")).unwrap();
        let weights = WeightStore::open(&dir, DType::F32).unwrap();
        for (block, form) in [
            (16, DeltaNetGraphForm::Chunked(Inverse::Doubling)),
            (1, DeltaNetGraphForm::Matrix),
        ] {
            let opts = GraphOptions {
                form,
                context: 64,
                ..GraphOptions::default()
            };
            let builder = Builder::new(&config, &weights, opts).unwrap();
            let mut runs = Vec::new();
            for device in ["CPU", EXACT] {
                let mut engine =
                    DecoderEngine::new(&builder, block, device, &CompileOptions::default())
                        .unwrap();
                runs.push(run(&mut engine, &ids, 8).unwrap());
            }
            let label = format!("{name} block {block}");
            assert_eq!(
                runs[1].generated, runs[0].generated,
                "{label}: greedy tokens"
            );
            let worst = worst_of(&label, &runs[1].taps, &runs[0].taps).max(worst_of(
                &label,
                &runs[1].states,
                &runs[0].states,
            ));
            let logits = diff(&runs[1].taps["logits"], &runs[0].taps["logits"]).unwrap();
            println!(
                "{label}: FP16SIM f32 vs OpenVINO: 8 greedy tokens identical, logits max abs {:.2e}, worst tensor {worst:.2e} of max",
                logits.max_abs
            );
            // Through a whole decoder, f32 rounding in different summation orders compounds: the worst measured,
            // 1.8e-5 (tiny-full layer 4's gated-norm output, a small head the norm scales up), is f32 noise: against
            // a float64 run there FP16SIM is 3.7e-5 off in absolute terms and OpenVINO 7.3e-5.
            assert!(worst < 3e-5, "{label}: {worst:.2e}");
        }
    }
}

/// The default model rounds every stored value to fp16 and flushes fp16 subnormals: a run moves by about fp16's
/// precision from the exact one, and keeping subnormals changes the numbers (a flushed value is a lost one).
#[test]
fn fp16_arithmetic_moves_the_numbers_by_fp16_precision() {
    let dir = model_dir("tiny");
    let (ids, _) = reference_taps(&dir);
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let weights = WeightStore::open(&dir, DType::F32).unwrap();
    let builder = Builder::new(
        &config,
        &weights,
        GraphOptions {
            context: 64,
            ..GraphOptions::default()
        },
    )
    .unwrap();
    let layer = 0;
    let input_ids = &ids[..16];
    let model = Model::load(&dir, DType::F32).unwrap();
    let mut reference = ReferenceBackend::new(model, RunOptions::default(), true, "f32").unwrap();
    let taps = reference.forward(input_ids, true).unwrap().taps;
    let mut outputs = BTreeMap::new();
    for device in [EXACT, "FP16SIM", "FP16SIM:ftz=off", "FP16SIM:store=bf16"] {
        let mut runner =
            LayerRunner::new(&builder, layer, 16, device, &CompileOptions::default()).unwrap();
        assert_eq!(runner.info().device, device);
        let mut state = HostLayerState::zeros(&config, layer).unwrap();
        let out = runner
            .run(&taps["embeddings"], 0, CallPositions::TEXT, &mut state)
            .unwrap();
        outputs.insert(device, out);
    }
    let err = |device: &str, tap: &str| {
        diff(&outputs[device][tap], &outputs[EXACT][tap])
            .unwrap()
            .relative()
    };
    // The projections of layer 0 read fp16-rounded weights and inputs: off by about fp16's half ulp (2^-11).
    let qkv = err("FP16SIM", "linear_attn.qkv");
    assert!(qkv > 1e-5 && qkv < 1e-2, "qkv under fp16: {qkv:.2e}");
    // bf16 keeps 8 bits instead of 11: about 8 times worse.
    let qkv_bf16 = err("FP16SIM:store=bf16", "linear_attn.qkv");
    assert!(
        qkv_bf16 > 3.0 * qkv,
        "bf16 {qkv_bf16:.2e} vs fp16 {qkv:.2e}"
    );
    // Keeping subnormals changes what the flushing model computes.
    let flushed_vs_kept = diff(
        &outputs["FP16SIM"]["output"],
        &outputs["FP16SIM:ftz=off"]["output"],
    )
    .unwrap();
    assert!(
        flushed_vs_kept.max_abs > 0.0,
        "flushing subnormals changed nothing"
    );
    println!(
        "layer 0, 16 tokens: qkv off by {qkv:.2e} (fp16) and {qkv_bf16:.2e} (bf16) of max; flushing moved the output by {:.2e}",
        flushed_vs_kept.max_abs
    );
}
