//! The decoder and per-layer graphs on the CPU device against the reference and transformers' goldens, in both
//! forms and through decode steps after a prompt; f16, INT8 and INT4 experts against the reference on the same
//! packed weights.

use crate::common::{self, Worst, ids_of};
use crate::moe::support::{
    FORMS, Outputs, chosen_names, golden, layer_outputs, open, reference_taps, rows,
};
use npu::devices::CompileOptions;
use npu::engine::DecoderEngine;
use npu::graphs::{Builder, GraphOptions, MoeGraphForm};
use reference::backend::{Backend, ReferenceBackend};
use reference::compare::diff;
use reference::config::Config;
use reference::model::{Model, RunOptions};
use reference::taps::names;
use reference::weights::WeightStore;

/// The prompt in one `forward` from a fresh state, then each of `decode` as a single-token call (the states carried
/// between them): each call's outputs.
fn steps(backend: &mut dyn Backend, ids: &[u32], decode: &[u32]) -> Vec<Outputs> {
    backend.reset().unwrap();
    std::iter::once(ids)
        .chain(decode.chunks(1))
        .map(|call| {
            let f = backend.forward(call, true).unwrap();
            let mut out = f.taps;
            out.insert(names::LOGITS.into(), f.logits);
            out
        })
        .collect()
}

fn reference_steps(
    config: &Config,
    weights: &WeightStore,
    ids: &[u32],
    decode: &[u32],
) -> Vec<Outputs> {
    let model = Model::from_weights(config.clone(), weights).unwrap();
    let name = weights.format().name();
    let mut backend = ReferenceBackend::new(model, RunOptions::default(), true, &name).unwrap();
    steps(&mut backend, ids, decode)
}

/// Holds `actual` to `expected` on the tensors `names` (each must be in both): the chosen experts equal (same
/// experts, same order) at every token and layer, every other tensor within the graph tests' tolerances
/// (`common::Worst`). Returns the (token, layer) routing pairs compared.
fn check<'a>(
    label: &str,
    names: impl IntoIterator<Item = &'a String>,
    actual: &Outputs,
    expected: &Outputs,
    config: &Config,
    worst: &mut Worst,
) -> usize {
    let chosen = chosen_names(config);
    let mut pairs = 0;
    for name in names {
        let get = |side: &Outputs, who: &str| {
            side.get(name)
                .unwrap_or_else(|| panic!("{label}: {who} gave no {name}"))
                .clone()
        };
        let (a, e) = (get(actual, "the device"), get(expected, "the reference"));
        if chosen.contains(name) {
            let (a, e) = (rows(&a), rows(&e));
            assert_eq!(a.len(), e.len(), "{label} {name}");
            for (t, (a, e)) in a.iter().zip(&e).enumerate() {
                assert_eq!(
                    a, e,
                    "{label} {name}: token {t} chose {a:?}, the reference {e:?}"
                );
            }
            pairs += e.len();
        } else {
            worst.check(label, name, &a, &e, config);
        }
    }
    pairs
}

/// What a single-token call is compared on: the MoE block's taps, each layer's mixer, MLP and layer outputs, the
/// logits. (A mixer's own taps at one token are held per head or channel to that one value, which f32 cancellation
/// in a channel near zero can miss by 1e-3 of it; the prompt compares them over its 71 tokens.)
fn step_names(config: &Config) -> Vec<String> {
    let mut out = vec![names::LOGITS.to_string()];
    for layer in 0..config.num_layers() {
        for tap in [names::MIXER_OUTPUT, names::MLP_OUTPUT, names::OUTPUT] {
            out.push(names::layer(layer, tap));
        }
        for tap in names::MOE_TAPS {
            out.push(names::layer(layer, &names::mixer(names::MLP, tap)));
        }
    }
    out
}

/// Every tap an MoE block records, in every layer, is among `out`'s tensors.
fn has_moe_taps(label: &str, out: &Outputs, config: &Config) {
    for layer in 0..config.num_layers() {
        for tap in names::MOE_TAPS {
            let name = names::layer(layer, &names::mixer(names::MLP, tap));
            assert!(out.contains_key(&name), "{label}: no {name}");
        }
    }
}

/// The decoder graphs in both forms, and single-token graphs alone, on the CPU device: the prompt's every tap
/// against the reference's and transformers' (the same experts at every token and layer), then four decode steps
/// after it, each against the reference's, then 16 greedy tokens equal to transformers'.
#[test]
fn decoder_graphs_match_the_reference_in_both_forms() {
    let (config, weights) = open("f32");
    let g = golden();
    let ids = ids_of(&g["token_ids"]);
    let generated = ids_of(&g["generated"]);
    let decode = &generated[..4];
    let reference = reference_steps(&config, &weights, &ids, decode);
    for (block, moe) in FORMS {
        let opts = GraphOptions {
            context: 96,
            moe,
            ..GraphOptions::default()
        };
        let builder = Builder::new(&config, &weights, opts).unwrap();
        let mut engine =
            DecoderEngine::new(&builder, block, "CPU", &CompileOptions::default()).unwrap();
        let start = std::time::Instant::now();
        let device = steps(&mut engine, &ids, decode);
        let seconds = start.elapsed().as_secs_f64();
        let label = format!("tiny-moe block {block} {}", moe.name());
        let mut worst = Worst::default();
        has_moe_taps(&label, &device[0], &config);
        let mut pairs = check(
            &format!("{label} prompt"),
            device[0].keys(),
            &device[0],
            &reference[0],
            &config,
            &mut worst,
        );
        for (s, (d, r)) in device.iter().zip(&reference).enumerate().skip(1) {
            let at = format!("{label} decode step {s}");
            pairs += check(&at, &step_names(&config), d, r, &config, &mut worst);
        }
        // transformers' goldens: every tensor they hold (the MoE taps, mixer, MLP and layer outputs, logits).
        let mut golden_worst = Worst::default();
        let golden_names = g.keys().filter(|n| *n != "token_ids" && *n != "generated");
        check(
            &format!("{label} prompt vs transformers"),
            golden_names,
            &device[0],
            &g,
            &config,
            &mut golden_worst,
        );
        let run = common::run(&mut engine, &ids, 16).unwrap();
        assert_eq!(run.generated, generated, "{label}: greedy tokens");
        let logits = diff(&device[0]["logits"], &g["logits"]).unwrap();
        println!(
            "{label}: the reference's experts at all {pairs} (token, layer) pairs of the prompt and 4 decode steps; \
             16 greedy tokens as transformers; prompt logits {:.2e} abs from transformers; worst tensor {:.2e} \
             (reference), {:.2e} (transformers) of its head's (or tensor's) max; prompt and 4 steps {seconds:.3} s\n{}",
            logits.max_abs,
            worst.overall(),
            golden_worst.overall(),
            worst.report()
        );
    }
}

/// Every per-layer graph, both forms and a single token, on the reference's input to its layer: every output and
/// MoE tap within tolerance, the reference's experts at every token.
#[test]
fn layer_graphs_match_the_reference_in_both_forms() {
    let (config, weights) = open("f32");
    let ids = ids_of(&golden()["token_ids"]);
    let (taps, _) = reference_taps(&config, &weights, &ids);
    for (tokens, moe) in FORMS {
        let opts = GraphOptions {
            context: 96,
            moe,
            ..GraphOptions::default()
        };
        let builder = Builder::new(&config, &weights, opts).unwrap();
        let label = format!("tiny-moe layer graphs T={tokens} {}", moe.name());
        let mut worst = Worst::default();
        let mut pairs = 0;
        for (layer, out) in layer_outputs(&builder, "CPU", tokens, &taps)
            .iter()
            .enumerate()
        {
            for tap in names::MOE_TAPS {
                let name = names::layer(layer, &names::mixer(names::MLP, tap));
                assert!(out.contains_key(&name), "{label}: no {name}");
            }
            let at = format!("{label} layer {layer}");
            pairs += check(&at, out.keys(), out, &taps, &config, &mut worst);
        }
        println!(
            "{label}: the reference's experts at all {pairs} (token, layer) pairs; worst error {:.2e} of its head's \
             (or tensor's) max\n{}",
            worst.overall(),
            worst.report()
        );
    }
}

/// Graphs holding f16, INT8 or INT4 experts (every matrix of the block, router and shared expert included) equal the
/// reference run on the same packed weights, in both forms: device error and quantization error told apart.
#[test]
fn quantized_experts_equal_the_reference_on_the_same_weights() {
    let g = golden();
    let ids = ids_of(&g["token_ids"]);
    let decode = &ids_of(&g["generated"])[..2];
    let (config, f32_weights) = open("f32");
    let f32_logits = reference_steps(&config, &f32_weights, &ids, &[])
        .remove(0)
        .remove(names::LOGITS)
        .unwrap();
    // int4 (group 128) holds no 32- or 16-wide matrix in whole groups: every matrix INT8. int4:16 every matrix INT4;
    // int4:32 the gate and up experts INT4, the down experts (16 wide) INT8.
    for (format, moe) in [
        ("f16", MoeGraphForm::Masked),
        ("int4", MoeGraphForm::Gather),
        ("int4:16", MoeGraphForm::Masked),
        ("int4:32", MoeGraphForm::Gather),
    ] {
        let (config, weights) = open(format);
        let reference = reference_steps(&config, &weights, &ids, decode);
        let builder = Builder::new(
            &config,
            &weights,
            GraphOptions {
                context: 96,
                moe,
                ..GraphOptions::default()
            },
        )
        .unwrap();
        let mut engine =
            DecoderEngine::new(&builder, 16, "CPU", &CompileOptions::default()).unwrap();
        let device = steps(&mut engine, &ids, decode);
        let label = format!("tiny-moe {format} {}", moe.name());
        let mut worst = Worst::default();
        let mut pairs = 0;
        has_moe_taps(&label, &device[0], &config);
        for (s, (d, r)) in device.iter().zip(&reference).enumerate() {
            let at = format!("{label} call {s}");
            let names: Vec<String> = match s {
                0 => d.keys().cloned().collect(),
                _ => step_names(&config),
            };
            pairs += check(&at, &names, d, r, &config, &mut worst);
        }
        let device_error = diff(&device[0]["logits"], &reference[0]["logits"]).unwrap();
        let quant_error = diff(&device[0]["logits"], &f32_logits).unwrap();
        println!(
            "{label}: device vs reference on the same weights: the same experts at all {pairs} pairs, logits \
             {:.2e}, worst tap {:.2e} of its head's (or tensor's) max; vs the f32 weights: logits {:.2e}",
            device_error.max_abs,
            worst.overall(),
            quant_error.max_abs
        );
        assert!(
            quant_error.max_abs > 10.0 * device_error.max_abs.max(1e-6),
            "{label}: quantization changed nothing?"
        );
    }
}
