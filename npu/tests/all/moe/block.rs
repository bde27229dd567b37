//! The MoE block graph fed a routing (the probe's fed-routing graph) against its own layer graph and the reference.

use crate::common::{Worst, ids_of};
use crate::moe::support::{FORMS, golden, layer_outputs, open, reference_taps, rows};
use candle_core::Tensor;
use npu::devices::CompileOptions;
use npu::engine::MoeBlockRunner;
use npu::graphs::{Builder, GraphOptions};
use reference::taps::names;

/// `[T, H]` `a + b` in f32 on the host, as the graphs and the reference add the mixer's output to the residual.
fn add(a: &Tensor, b: &Tensor) -> Tensor {
    (a + b).unwrap()
}

/// The largest `|a − b|` over two tensors, and the largest `|b|`.
fn max_abs(a: &Tensor, b: &Tensor) -> (f64, f64) {
    let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (a, b) = (v(a), v(b));
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max);
    (diff, b.iter().map(|y| y.abs() as f64).fold(0.0, f64::max))
}

/// The MoE block graph fed a routing (the probe's fed-routing graph, `Builder::moe_block_graph`), on the CPU device,
/// both forms and a single token. Fed its own layer graph's routing and residual stream after the mixer (the
/// layer's input plus the graph's `mixer_output`, added on the host in f32 as the graph adds them), it gives the
/// layer graph's `mlp_output` and `shared_output` bit for bit; fed the reference's routing and residual stream, the
/// reference's `mlp_output` within the graph tests' tolerance; fed every chosen expert moved to the next index, an
/// `mlp_output` far from it (the routing given is the routing used).
#[test]
fn an_moe_block_fed_a_routing_computes_the_layer_graphs_mlp_output() {
    let (config, weights) = open("f32");
    let ids = ids_of(&golden()["token_ids"]);
    let (taps, _) = reference_taps(&config, &weights, &ids);
    let experts = config.moe.as_ref().unwrap().num_experts as i64;
    for (tokens, moe) in FORMS {
        let opts = GraphOptions {
            context: 96,
            moe,
            ..GraphOptions::default()
        };
        let builder = Builder::new(&config, &weights, opts).unwrap();
        let label = format!("tiny-moe MoE block T={tokens} {}", moe.name());
        let mut worst = Worst::default();
        let mut moved = f64::INFINITY;
        for (layer, out) in layer_outputs(&builder, "CPU", tokens, &taps)
            .iter()
            .enumerate()
        {
            let at = |name: &str| names::layer(layer, name);
            let mlp = |tap| at(&names::mixer(names::MLP, tap));
            let input = match layer {
                0 => taps[names::EMBEDDINGS].clone(),
                l => taps[&names::layer(l - 1, names::OUTPUT)].clone(),
            };
            let mut runner =
                MoeBlockRunner::new(&builder, layer, tokens, "CPU", &CompileOptions::default())
                    .unwrap();
            // Its own layer graph's routing and residual stream: the same numbers.
            let own = runner
                .run(
                    &add(&input, &out[&at(names::MIXER_OUTPUT)]),
                    &out[&mlp(names::EXPERTS_CHOSEN)],
                    &out[&mlp(names::EXPERT_WEIGHTS)],
                )
                .unwrap();
            for (name, theirs) in [
                (names::MLP_OUTPUT.to_string(), at(names::MLP_OUTPUT)),
                (
                    names::mixer(names::MLP, names::SHARED_OUTPUT),
                    mlp(names::SHARED_OUTPUT),
                ),
            ] {
                let (d, of) = max_abs(&own[&name], &out[&theirs]);
                assert_eq!(
                    d, 0.0,
                    "{label} layer {layer} `{name}`: {d:.2e} of {of:.2e}"
                );
            }
            // The reference's routing and residual stream: the reference's output.
            let mut fed = |experts: &Tensor| {
                runner
                    .run(
                        &add(&input, &taps[&at(names::MIXER_OUTPUT)]),
                        experts,
                        &taps[&mlp(names::EXPERT_WEIGHTS)],
                    )
                    .unwrap()
                    .remove(names::MLP_OUTPUT)
                    .unwrap()
            };
            let chosen = &taps[&mlp(names::EXPERTS_CHOSEN)];
            let reference = &taps[&at(names::MLP_OUTPUT)];
            worst.check(
                &format!("{label} layer {layer}"),
                names::MLP_OUTPUT,
                &fed(chosen),
                reference,
                &config,
            );
            // Every chosen expert moved to the next index: another routing, another output.
            let next: Vec<Vec<i64>> = rows(chosen)
                .iter()
                .map(|r| r.iter().map(|e| (e + 1) % experts).collect())
                .collect();
            let next = Tensor::new(next, &candle_core::Device::Cpu).unwrap();
            let (d, of) = max_abs(&fed(&next), reference);
            moved = moved.min(d / of);
        }
        println!(
            "{label}: fed its layer graph's routing, mlp_output and shared_output bit for bit at every layer; fed \
             the reference's, within {:.2e} of its max; each chosen expert moved to the next index, off by at least \
             {moved:.2e} of the max",
            worst.overall()
        );
        assert!(moved > 0.05, "{label}: another routing, the same output?");
    }
}
