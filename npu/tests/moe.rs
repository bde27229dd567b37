//! The MoE decoder's graphs (`npu::graphs::moe`) on tiny-moe: the decoder and per-layer graphs on the CPU device
//! against the reference and transformers' goldens, in both forms (gathered and masked experts) and through decode
//! steps after a prompt; INT4/INT8 experts against the reference on the same packed weights; FP16SIM's routing
//! against the reference's, every flip reported with the reference's margin.

use candle_core::{DType, Tensor};
use npu::devices::CompileOptions;
use npu::engine::{DecoderEngine, HostLayerState, LayerRunner, MoeBlockRunner};
use npu::graphs::{Builder, GraphOptions, MoeGraphForm};
use npu::graphset::layout::CallPositions;
use reference::backend::{Backend, ReferenceBackend};
use reference::compare::diff;
use reference::config::Config;
use reference::model::{Model, RunOptions};
use reference::quant::WeightFormat;
use reference::taps::{Taps, names};
use reference::weights::WeightStore;
use std::collections::BTreeMap;
use std::path::PathBuf;

mod common;
use common::{Worst, ids_of};

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny-moe")
}

/// transformers' goldens of tiny-moe (`scripts/make_moe_goldens.py`).
fn golden() -> BTreeMap<String, Tensor> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/goldens/tiny-moe.safetensors");
    candle_core::safetensors::load(&path, &candle_core::Device::Cpu)
        .unwrap()
        .into_iter()
        .collect()
}

fn open(format: &str) -> (Config, WeightStore) {
    let dir = model_dir();
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let format = WeightFormat::parse(format).unwrap();
    (
        config,
        WeightStore::open_with_format(&dir, DType::F32, format).unwrap(),
    )
}

/// `layers.{i}.mlp.experts_chosen` of every layer.
fn chosen_names(config: &Config) -> Vec<String> {
    (0..config.num_layers())
        .map(|i| names::layer(i, &names::mixer(names::MLP, names::EXPERTS_CHOSEN)))
        .collect()
}

/// One call's outputs under the dump's names: its taps and the logits of every row.
type Outputs = BTreeMap<String, Tensor>;

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

/// Rows of an i64 `[T, k]` tensor.
fn rows(t: &Tensor) -> Vec<Vec<i64>> {
    assert_eq!(t.dtype(), DType::I64, "experts_chosen is i64");
    t.to_vec2::<i64>().unwrap()
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

/// The graph shapes both tests run: prompt blocks of 16 in each MoE form, and one token (which always gathers).
const FORMS: [(usize, MoeGraphForm); 3] = [
    (16, MoeGraphForm::Masked),
    (16, MoeGraphForm::Gather),
    (1, MoeGraphForm::Gather),
];

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

/// The reference's prompt taps and states, one forward call.
fn reference_taps(
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
fn layer_outputs(builder: &Builder, device: &str, tokens: usize, taps: &Outputs) -> Vec<Outputs> {
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
