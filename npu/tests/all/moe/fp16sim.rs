//! FP16SIM evaluates the MoE graphs: its routing against the reference's, every flip held to the reference's margin
//! and the device's own probability error.

use crate::common::{self, ids_of};
use crate::moe::support::{chosen_names, golden, layer_outputs, open, reference_taps, rows};
use candle_core::{DType, Tensor};
use npu::devices::CompileOptions;
use npu::engine::DecoderEngine;
use npu::graphs::{Builder, GraphOptions, MoeGraphForm};
use reference::compare::diff;
use reference::taps::names;

/// Per token, the reference's margin for its routing: the smallest gap between adjacent probabilities among its
/// `k + 1` largest (a flip of the set or of the order among the chosen needs one of these gaps closed).
fn margins(logits: &Tensor, k: usize) -> Vec<f64> {
    let p = reference::ops::softmax_last_dim(&logits.to_dtype(DType::F64).unwrap()).unwrap();
    p.to_vec2::<f64>()
        .unwrap()
        .into_iter()
        .map(|mut row| {
            row.sort_by(|a, b| b.total_cmp(a));
            row[..=k]
                .windows(2)
                .map(|w| w[0] - w[1])
                .fold(f64::INFINITY, f64::min)
        })
        .collect()
}

/// Per token, the largest difference between the router probabilities of two `[T, E]` logits (softmax in f64).
fn probability_error(a: &Tensor, b: &Tensor) -> Vec<f64> {
    let p = |t: &Tensor| {
        reference::ops::softmax_last_dim(&t.to_dtype(DType::F64).unwrap())
            .unwrap()
            .to_vec2::<f64>()
            .unwrap()
    };
    p(a).iter()
        .zip(p(b))
        .map(|(x, y)| {
            x.iter()
                .zip(&y)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max)
        })
        .collect()
}

/// FP16SIM evaluates the MoE graphs. With nothing rounded it routes as the reference at every token of every layer
/// (a second executor of the graphs). In an fp16 NPU's arithmetic (`norm=fused`: the norms as NPU compilers fuse
/// them; op by op, tiny-moe's DeltaNet layers lose 40-80% of their output at the ×1024 rescaling, as the tiny
/// model's larger heads near fp16's range, and nothing is left to say about routing) the router's logits and
/// probabilities are fp16, and a choice flips where the reference's probabilities are closer than the device's own
/// error: each layer's graph runs on the reference's input to that layer, every flip is reported with the
/// reference's margin (the smallest gap among its `k + 1` largest probabilities) and must lie within twice the
/// device's probability error at that token (its router logits' softmax against the reference's, plus half an
/// fp16 step of a probability below 1). The decoder graph's routing agreement is reported too.
#[test]
fn fp16sim_routes_as_the_reference_but_where_the_margin_is_tiny() {
    let (config, weights) = open("f32");
    let g = golden();
    let ids = ids_of(&g["token_ids"]);
    let (taps, _) = reference_taps(&config, &weights, &ids);
    let k = config.moe.as_ref().unwrap().num_experts_per_tok;
    let options = |moe| GraphOptions {
        context: 96,
        moe,
        ..GraphOptions::default()
    };
    let half_step = 2f64.powi(-12);
    for device in ["FP16SIM:store=f32,ftz=off", "FP16SIM:norm=fused"] {
        for moe in [MoeGraphForm::Masked, MoeGraphForm::Gather] {
            let builder = Builder::new(&config, &weights, options(moe)).unwrap();
            let label = format!("{device} layer graphs T=16 {}", moe.name());
            let mut flips = Vec::new();
            let mut pairs = 0;
            let mut closest = (0, 0, f64::INFINITY);
            for (layer, out) in layer_outputs(&builder, device, 16, &taps)
                .iter()
                .enumerate()
            {
                let mlp = |tap| names::layer(layer, &names::mixer(names::MLP, tap));
                let ours = rows(&out[&mlp(names::EXPERTS_CHOSEN)]);
                let theirs = rows(&taps[&mlp(names::EXPERTS_CHOSEN)]);
                let logits = &taps[&mlp(names::ROUTER_LOGITS)];
                let margin = margins(logits, k);
                let error = probability_error(&out[&mlp(names::ROUTER_LOGITS)], logits);
                for (t, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                    pairs += 1;
                    if margin[t] < closest.2 {
                        closest = (layer, t, margin[t]);
                    }
                    if a != b {
                        flips.push((layer, t, a.clone(), b.clone(), margin[t], error[t]));
                    }
                }
            }
            println!(
                "{label}: routing as the reference at {}/{pairs} (token, layer) pairs; the closest call, layer \
                 {} token {} (margin {:.2e}), {}",
                pairs - flips.len(),
                closest.0,
                closest.1,
                closest.2,
                if flips.iter().any(|f| (f.0, f.1) == (closest.0, closest.1)) {
                    "flipped"
                } else {
                    "routed as the reference"
                }
            );
            for (layer, t, a, b, m, e) in &flips {
                println!(
                    "  flip: layer {layer} token {t}: {a:?}, the reference {b:?} (its margin {m:.2e}; the device's \
                     probabilities off by up to {e:.2e})"
                );
                assert!(
                    *m <= 2.0 * (e + half_step),
                    "{label}: layer {layer} token {t} flipped at a margin of {m:.2e}, beyond the device's error {e:.2e}"
                );
            }
            if device.contains("store=f32") {
                assert!(flips.is_empty(), "{label}: {flips:?}");
            }
        }
    }
    // The whole decoder: errors carry from layer to layer (a flip's token takes other experts' output onwards), so
    // only the agreement is reported.
    for device in ["FP16SIM:norm=fused", "FP16SIM"] {
        let builder = Builder::new(&config, &weights, options(MoeGraphForm::Masked)).unwrap();
        let mut engine =
            DecoderEngine::new(&builder, 16, device, &CompileOptions::default()).unwrap();
        let run = common::run(&mut engine, &ids, 1).unwrap();
        let (mut same, mut pairs) = (0, 0);
        for name in chosen_names(&config) {
            let (a, b) = (rows(&run.taps[&name]), rows(&taps[&name]));
            pairs += a.len();
            same += a.iter().zip(&b).filter(|(a, b)| a == b).count();
        }
        let logits = diff(&run.taps[names::LOGITS], &taps[names::LOGITS]).unwrap();
        println!(
            "{device} decoder graph T=16 masked: routing as the reference at {same}/{pairs} (token, layer) pairs; \
             logits {:.2e} abs from the reference",
            logits.max_abs
        );
    }
}
