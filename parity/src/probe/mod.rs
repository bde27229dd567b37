//! The per-layer probe: each layer's own graph on the device against the reference, block by block, so that an
//! error is pinned to a layer, an op inside it, a state, and a position.
//!
//! - **Isolated**: every block of every layer is fed the reference's own input and the reference's incoming state
//!   at that block, so error does not accumulate: a layer that fails here is wrong by itself (ONNX Runtime's
//!   `qdq_err`).
//! - **Chained**: layer 0 gets the reference's embeddings, every later layer the device's own output of the layer
//!   before, and every layer carries its own state from block to block (`xmodel_err`): what a deployed run sees.
//!
//! Per layer the report gives the output, mixer and MLP errors, every state's error, the state's drift along the
//! positions (after every block), and the magnitudes the fp16 port diagnosed with (per head: RMS of the DeltaNet core
//! output before the gated norm, and the share of its values below fp16's smallest normal; for attention the same
//! for the scores, recomputed from the tapped queries and keys, and for the gate). For the first layer over
//! threshold, every intermediate both sides expose is compared in the order the layer computes them, which names
//! the op where the error starts; per head, each state's error says which head drifts.
//!
//! In an MoE model every probed layer also gets its routing against the reference's (where the device exposes the
//! chosen experts; isolated, no flip follows another), and its block run fed the reference's routing, so that the
//! experts' arithmetic is judged apart from the router ([`moe`]).
//!
//! A device with per-layer graphs is probed through them ([`probe_with`]); a whole-decoder set whose states are
//! ports, through its states after every block and whatever hidden outputs it has ([`decoder::probe_decoder`]).
//! [`run`] chooses, for any device under test.

pub mod decoder;
pub mod moe;
pub mod run;
pub mod vision;

pub use crate::device::LayerDevice;

use crate::images::PromptInput;
use crate::metrics::{Magnitude, TensorError, exceeds, magnitudes, nan_max, values};
use crate::routing::{LayerRouting, Reach, RoutingReport};
use anyhow::{Context, Result, bail};
use candle_core::Tensor;
use npu::engine::HostLayerState;
use npu::graphset::layout::CallPositions;
use reference::backend::{Backend, Forward, Precision, Snapshot};
use reference::config::{Config, LayerKind};
use reference::model::state_names;
use reference::taps::names;
use serde::Serialize;
use std::collections::BTreeMap;

/// How the layers are fed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Each block gets the reference's input and incoming state.
    Isolated,
    /// Each layer gets the device's own output of the layer before and carries its own state.
    Chained,
}

impl Mode {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Isolated => "isolated",
            Mode::Chained => "chained",
        }
    }
}

/// The reference's run of a prompt in the device's blocks: the taps of every position and the state before and
/// after every block.
pub struct ReferenceTrace {
    /// The prompt: token ids, or one with images (its image tokens carrying the reference tower's rows, its
    /// positions `get_rope_index`'s).
    pub input: PromptInput,
    /// Token-major taps over the prompt.
    pub taps: BTreeMap<String, Tensor>,
    /// `states[b]` is the state before block `b`; the last one is the state after the prompt.
    pub states: Vec<Snapshot>,
    /// `[start, end)` of every block.
    pub blocks: Vec<(usize, usize)>,
}

impl ReferenceTrace {
    /// Runs `input` in blocks of `block` tokens on the reference (a backend recording taps).
    pub fn new(reference: &mut dyn Backend, input: &PromptInput, block: usize) -> Result<Self> {
        reference.reset()?;
        let n = input.ids().len();
        let blocks: Vec<(usize, usize)> = (0..n)
            .step_by(block.max(1))
            .map(|s| (s, (s + block).min(n)))
            .collect();
        let mut trace = ReferenceTrace {
            input: input.clone(),
            taps: BTreeMap::new(),
            states: vec![reference.snapshot()?],
            blocks,
        };
        let mut pieces: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
        for b in 0..trace.blocks.len() {
            let f = trace.forward_block(reference, b)?;
            for (k, v) in f.taps {
                pieces.entry(k).or_default().push(v);
            }
            trace.states.push(reference.snapshot()?);
        }
        trace.taps = pieces
            .into_iter()
            .map(|(k, v)| Ok((k, Tensor::cat(&v, 0)?)))
            .collect::<Result<_>>()?;
        Ok(trace)
    }

    /// The prompt's token ids.
    pub fn ids(&self) -> &[u32] {
        self.input.ids()
    }

    /// Runs block `b` of the prompt on `backend` (with every logit and tap): its ids, or its piece of the prompt
    /// with images (the reference's rows and positions).
    pub fn forward_block(&self, backend: &mut dyn Backend, b: usize) -> Result<Forward> {
        let (start, end) = self.blocks[b];
        Ok(match &self.input {
            PromptInput::Ids(ids) => backend.forward(&ids[start..end], true)?,
            PromptInput::Images(p) => {
                backend.forward_embedded(&p.slice(start, end - start)?, true)?
            }
        })
    }

    /// The positions of block `b`'s tokens, as a per-layer graph is given them: text following the block's start,
    /// or the prompt's three MRoPE rows there.
    pub fn positions(&self, b: usize) -> CallPositions<'_> {
        let (start, end) = self.blocks[b];
        match &self.input {
            PromptInput::Ids(_) => CallPositions::TEXT,
            PromptInput::Images(p) => {
                CallPositions::Rows(p.positions.0.each_ref().map(|r| &r[start..end]))
            }
        }
    }

    fn tap(&self, name: &str) -> Result<&Tensor> {
        self.taps
            .get(name)
            .with_context(|| format!("the reference has no tap `{name}`"))
    }

    /// Layer `layer`'s input over the prompt: the embeddings, or the previous layer's output.
    pub fn input(&self, layer: usize) -> Result<&Tensor> {
        if layer == 0 {
            self.tap(names::EMBEDDINGS)
        } else {
            self.tap(&names::layer(layer - 1, names::OUTPUT))
        }
    }
}

/// One tensor's error.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Named {
    /// The tensor (within the layer).
    pub name: String,
    /// Its error.
    pub error: TensorError,
}

/// Per-head magnitudes of one intermediate, both sides.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HeadMagnitudes {
    /// The intermediate (`linear_attn.core_output`, `self_attn.scores`, `self_attn.gate`).
    pub name: String,
    /// The reference's, per head.
    pub reference: Vec<Magnitude>,
    /// The device's, per head.
    pub device: Vec<Magnitude>,
}

/// One head's error in a state.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct HeadError {
    /// The head (a DeltaNet value head, or an attention KV head).
    pub head: usize,
    /// Its NRMSE.
    pub nrmse: f64,
    /// Its relative L2 error.
    pub rel_l2: f64,
}

/// One layer probed.
#[derive(Debug, Clone, Serialize)]
pub struct LayerProbe {
    /// The layer.
    pub layer: usize,
    /// `linear_attention` or `full_attention`.
    pub kind: &'static str,
    /// The layer's output (`None`: the device exposes no hidden state of this layer).
    pub output: Option<TensorError>,
    /// The mixer's output.
    pub mixer: Option<TensorError>,
    /// The MLP's output.
    pub mlp: Option<TensorError>,
    /// The states after the prompt.
    pub states: Vec<Named>,
    /// Per head, the main state's error after the prompt (the recurrent state, or the key cache).
    pub state_heads: Vec<HeadError>,
    /// Positions at the end of every block.
    pub block_ends: Vec<usize>,
    /// The main state's NRMSE after every block (the recurrent state, or the key cache).
    pub state_drift: Vec<f64>,
    /// Every intermediate both sides expose, in the order the layer computes them.
    pub intermediates: Vec<Named>,
    /// Per-head magnitudes of the intermediates an fp16 device loses precision on.
    pub magnitudes: Vec<HeadMagnitudes>,
    /// An MoE layer's routing against the reference's (`None`: a dense layer, or the device exposes no chosen
    /// experts).
    pub routing: Option<LayerRouting>,
    /// An MoE layer's block fed the reference's routing (`None`: a dense layer, or not run; the report says why).
    pub fed_routing: Option<moe::FedRouting>,
    /// What the MLP error comes from, by the two (`None` without both).
    pub blame: Option<moe::Blame>,
    /// Whether an output (the MLP's fed the reference's routing included) or a state exceeds its threshold.
    pub over: bool,
    /// The thresholds it was judged by (per layer when they come from a baseline device).
    pub thresholds: ProbeThresholds,
}

/// The thresholds of the probe.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ProbeThresholds {
    /// Largest NRMSE of a layer's outputs and intermediates.
    pub max_nrmse: f64,
    /// Largest NRMSE of a state (after the prompt, and after every block).
    pub max_state_nrmse: f64,
}

impl ProbeThresholds {
    /// The defaults for a device that computed in `precision`: tight at f32, the fp16 port's level otherwise.
    pub fn for_precision(precision: &Precision) -> Self {
        if precision.is_full() {
            ProbeThresholds {
                max_nrmse: 1e-4,
                max_state_nrmse: 1e-4,
            }
        } else {
            ProbeThresholds {
                max_nrmse: 5e-2,
                max_state_nrmse: 5e-2,
            }
        }
    }
}

/// Where the error starts inside the first layer over threshold.
#[derive(Debug, Clone, Serialize)]
pub struct DrillDown {
    /// The layer.
    pub layer: usize,
    /// The first intermediate over threshold, in the order the layer computes them, else the first state over
    /// threshold.
    pub first_over: Option<String>,
    /// Every intermediate both sides expose, in that order.
    pub intermediates: Vec<Named>,
}

/// How the layers are probed.
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// Isolated or chained.
    pub mode: Mode,
    /// The thresholds (judged again by the caller once the precision is read back).
    pub thresholds: ProbeThresholds,
    /// Whether each MoE layer's block is also run fed the reference's routing, where the device can.
    pub fed_routing: bool,
    /// The prompt's label, as the routing report names it.
    pub prompt: String,
}

/// What the probe found.
#[derive(Debug, Clone)]
pub struct Probed {
    /// Every probed layer.
    pub layers: Vec<LayerProbe>,
    /// An MoE model's routing over the probed layers (`None`: a dense model, or no chosen experts exposed).
    pub routing: Option<RoutingReport>,
    /// On an MoE model, why its blocks were not fed the reference's routing (`None`: they were, or a dense model).
    pub fed_routing_note: Option<String>,
}

/// Runs the probe of `layers` (sorted; chained mode runs every layer up to the last) through a device's per-layer
/// graphs, each MoE layer's block also fed the reference's routing: [`probe_with`] by default options, the layers
/// alone.
pub fn probe(
    config: &Config,
    trace: &ReferenceTrace,
    device: &mut dyn LayerDevice,
    layers: &[usize],
    mode: Mode,
    thresholds: ProbeThresholds,
) -> Result<Vec<LayerProbe>> {
    let opts = ProbeOptions {
        mode,
        thresholds,
        fed_routing: true,
        prompt: "the prompt".into(),
    };
    Ok(probe_with(config, trace, device, layers, &opts)?.layers)
}

/// The note of an MoE model's blocks not fed the reference's routing when the device's per-layer graphs cannot run
/// the block alone.
pub const FED_ROUTING_NOT_AVAILABLE: &str = "the MoE blocks were not fed the reference's routing: not available for \
     graphs made elsewhere (the block is built from the checkpoint, alone; a set's graphs hold it only behind its \
     router)";

/// Runs the probe of `layers` (sorted; chained mode runs every layer up to the last) through a device's per-layer
/// graphs, as `opts` says.
pub fn probe_with(
    config: &Config,
    trace: &ReferenceTrace,
    device: &mut dyn LayerDevice,
    layers: &[usize],
    opts: &ProbeOptions,
) -> Result<Probed> {
    let (mode, thresholds) = (opts.mode, opts.thresholds);
    let mut out = Vec::new();
    let last = *layers.iter().max().context("no layer to probe")?;
    let mut chained_input: Option<Tensor> = None;
    // Isolated: each layer's routing on its own; chained: the taps the routing reads of every layer run.
    let mut routings = Vec::new();
    let mut routing_taps: BTreeMap<String, Tensor> = BTreeMap::new();
    let mut fed = BTreeMap::new();
    let mut fed_note = None;
    for layer in 0..=last {
        let wanted = layers.contains(&layer);
        if mode == Mode::Isolated && !wanted {
            continue;
        }
        let kind = config.layer_types[layer];
        let input = match (&chained_input, mode) {
            (Some(x), Mode::Chained) => x.clone(),
            _ => trace.input(layer)?.clone(),
        };
        let mut state = HostLayerState::zeros(config, layer)?;
        let mut pieces: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
        let mut drift = Vec::new();
        for (b, &(start, end)) in trace.blocks.iter().enumerate() {
            if mode == Mode::Isolated {
                state = HostLayerState::from_snapshot(
                    config,
                    layer,
                    device.context(),
                    &trace.states[b],
                )?;
            }
            let x = input.narrow(0, start, end - start)?;
            let r = device.run(layer, &x, start, trace.positions(b), &mut state)?;
            for (k, v) in r {
                pieces.entry(k).or_default().push(v);
            }
            let ours: BTreeMap<String, Tensor> = state.dump_tensors(layer)?.into_iter().collect();
            drift.push(main_state_error(&ours, layer, &trace.states[b + 1], kind)?.nrmse);
        }
        let device_taps: BTreeMap<String, Tensor> = pieces
            .into_iter()
            .map(|(k, v)| Ok((k, Tensor::cat(&v, 0)?)))
            .collect::<Result<_>>()?;
        let output = device_taps
            .get(names::OUTPUT)
            .context("the layer graph has no output")?
            .clone();
        if wanted {
            let ours: BTreeMap<String, Tensor> = state.dump_tensors(layer)?.into_iter().collect();
            out.push(layer_probe(
                layer,
                kind,
                &device_taps,
                &ours,
                trace,
                drift,
                thresholds,
            )?);
        }
        match mode {
            Mode::Isolated => routings.extend(moe::isolated_routing(
                config,
                trace,
                layer,
                &device_taps,
                &opts.prompt,
            )?),
            Mode::Chained => routing_taps.extend(
                device_taps
                    .iter()
                    .filter(|(k, _)| moe::routing_tap(k))
                    .map(|(k, v)| (names::layer(layer, k), v.clone())),
            ),
        }
        if wanted && config.moe.is_some() && opts.fed_routing {
            match moe::fed_routing(device, trace, layer, &input, &device_taps)? {
                Some(f) => {
                    fed.insert(layer, f);
                }
                None => fed_note = Some(FED_ROUTING_NOT_AVAILABLE.to_string()),
            }
        }
        chained_input = Some(output);
    }
    let routing = match mode {
        Mode::Isolated => RoutingReport::merge(&routings),
        Mode::Chained => moe::run_routing(
            config,
            trace,
            routing_taps,
            Reach::Chained,
            layers,
            &opts.prompt,
        )?,
    };
    moe::attach(&mut out, routing.as_ref(), fed);
    Ok(Probed {
        layers: out,
        routing,
        fed_routing_note: fed_note,
    })
}

/// The name of a layer's main state: the recurrent state, or the key cache.
fn main_state(layer: usize, kind: LayerKind) -> String {
    let [first, second] = state_names(layer, kind);
    match kind {
        LayerKind::Linear => second,
        LayerKind::Full => first,
    }
}

/// The main state's error (`ours`: the layer's states under the dump's names) against the reference's.
fn main_state_error(
    ours: &BTreeMap<String, Tensor>,
    layer: usize,
    reference: &Snapshot,
    kind: LayerKind,
) -> Result<TensorError> {
    let name = main_state(layer, kind);
    match (ours.get(&name), reference.tensors.get(&name)) {
        (Some(a), Some(b)) => TensorError::of(a, b),
        (None, None) => Ok(TensorError::of_slices(&[], &[])),
        _ => bail!("state `{name}`: one side has it and the other not"),
    }
}

/// Per head (axis 0 of the state in the dump's layout), the error of `a` against `b`.
pub fn head_errors(a: &Tensor, b: &Tensor) -> Result<Vec<HeadError>> {
    if a.dims() != b.dims() || a.rank() == 0 {
        bail!(
            "a state of shape {:?} against the reference's {:?}",
            a.dims(),
            b.dims()
        );
    }
    (0..a.dim(0)?)
        .map(|h| {
            let e = TensorError::of(&a.get(h)?, &b.get(h)?)?;
            Ok(HeadError {
                head: h,
                nrmse: e.nrmse,
                rel_l2: e.rel_l2,
            })
        })
        .collect()
}

/// The intermediates of a layer kind, in the order the layer computes them (names within the layer).
pub fn intermediates(kind: LayerKind) -> Vec<String> {
    let (mixer, taps): (&str, &[&str]) = match kind {
        LayerKind::Linear => (names::LINEAR_ATTN, &names::LINEAR_ATTN_TAPS),
        LayerKind::Full => (names::SELF_ATTN, &names::SELF_ATTN_TAPS),
    };
    let mut v: Vec<String> = taps.iter().map(|t| names::mixer(mixer, t)).collect();
    v.extend([names::MIXER_OUTPUT, names::MLP_OUTPUT, names::OUTPUT].map(String::from));
    v
}

/// One layer's probe from what the device gave: its outputs under the dump's names less the layer prefix (as many
/// as it exposes), its states after the prompt under the dump's names, and the main state's drift per block.
pub fn layer_probe(
    layer: usize,
    kind: LayerKind,
    device: &BTreeMap<String, Tensor>,
    states_after: &BTreeMap<String, Tensor>,
    trace: &ReferenceTrace,
    state_drift: Vec<f64>,
    t: ProbeThresholds,
) -> Result<LayerProbe> {
    let pair = |name: &str| -> Result<Option<(&Tensor, &Tensor)>> {
        match device.get(name) {
            None => Ok(None),
            Some(a) => Ok(Some((a, trace.tap(&names::layer(layer, name))?))),
        }
    };
    let error = |name: &str| -> Result<Option<TensorError>> {
        pair(name)?
            .map(|(a, b)| TensorError::of(a, b).with_context(|| format!("layer {layer} `{name}`")))
            .transpose()
    };
    let mut inter = Vec::new();
    for name in intermediates(kind) {
        if let Some(e) = error(&name)? {
            inter.push(Named { error: e, name });
        }
    }
    let after = trace.states.last().context("no reference state")?;
    let mut states = Vec::new();
    for name in state_names(layer, kind) {
        if let (Some(a), Some(b)) = (states_after.get(&name), after.tensors.get(&name)) {
            states.push(Named {
                error: TensorError::of(a, b).with_context(|| format!("state `{name}`"))?,
                name,
            });
        }
    }
    let main = main_state(layer, kind);
    let state_heads = match (states_after.get(&main), after.tensors.get(&main)) {
        (Some(a), Some(b)) => head_errors(a, b)?,
        _ => Vec::new(),
    };
    let mut magnitudes_found = Vec::new();
    match kind {
        LayerKind::Linear => {
            let name = names::mixer(names::LINEAR_ATTN, names::CORE_OUTPUT);
            if let Some((a, b)) = pair(&name)? {
                magnitudes_found.push(HeadMagnitudes {
                    name,
                    reference: magnitudes(b, 1)?,
                    device: magnitudes(a, 1)?,
                });
            }
        }
        LayerKind::Full => {
            let q = names::mixer(names::SELF_ATTN, names::QUERY);
            let k = names::mixer(names::SELF_ATTN, names::KEY);
            let gate = names::mixer(names::SELF_ATTN, names::GATE);
            if let (Some((qa, qb)), Some((ka, kb))) = (pair(&q)?, pair(&k)?) {
                magnitudes_found.push(HeadMagnitudes {
                    name: names::mixer(names::SELF_ATTN, "scores"),
                    reference: score_magnitudes(qb, kb)?,
                    device: score_magnitudes(qa, ka)?,
                });
                if let Some((ga, gb)) = pair(&gate)? {
                    let heads = qa.dim(1)?;
                    let per_head = |g: &Tensor| -> Result<Tensor> {
                        let (tt, width) = g.dims2()?;
                        Ok(g.reshape((tt, heads, width / heads))?)
                    };
                    magnitudes_found.push(HeadMagnitudes {
                        name: gate,
                        reference: magnitudes(&per_head(gb)?, 1)?,
                        device: magnitudes(&per_head(ga)?, 1)?,
                    });
                }
            }
        }
    }
    let mut probe = LayerProbe {
        layer,
        kind: kind.name(),
        output: error(names::OUTPUT)?,
        mixer: error(names::MIXER_OUTPUT)?,
        mlp: error(names::MLP_OUTPUT)?,
        states,
        state_heads,
        block_ends: trace.blocks.iter().map(|b| b.1).collect(),
        state_drift,
        intermediates: inter,
        magnitudes: magnitudes_found,
        routing: None,
        fed_routing: None,
        blame: None,
        over: false,
        thresholds: t,
    };
    probe.judge(t);
    Ok(probe)
}

impl LayerProbe {
    /// Decides `over` under `t`: an output (an MoE block's fed the reference's routing included), a state after
    /// the prompt or after any block over its threshold, or not finite; and what an MoE layer's MLP error comes from.
    pub fn judge(&mut self, t: ProbeThresholds) {
        let over_nrmse = |e: &TensorError, max: f64| !e.finite() || exceeds(e.nrmse, max);
        self.thresholds = t;
        self.blame = moe::blame(self.mlp.as_ref(), self.fed_routing.as_ref(), |e| {
            over_nrmse(e, t.max_nrmse)
        });
        self.over = [self.output, self.mixer, self.mlp]
            .iter()
            .flatten()
            .chain(self.fed_routing.as_ref().map(|f| &f.mlp))
            .any(|e| over_nrmse(e, t.max_nrmse))
            || self
                .states
                .iter()
                .any(|s| over_nrmse(&s.error, t.max_state_nrmse))
            || self
                .state_drift
                .iter()
                .any(|&e| exceeds(e, t.max_state_nrmse));
    }

    /// The largest NRMSE of its outputs, and of its states (after the prompt and after any block).
    pub fn worst(&self) -> (f64, f64) {
        let outputs = [self.output, self.mixer, self.mlp]
            .into_iter()
            .flatten()
            .chain(self.fed_routing.as_ref().map(|f| f.mlp))
            .map(|e| e.nrmse);
        let states = self
            .states
            .iter()
            .map(|s| s.error.nrmse)
            .chain(self.state_drift.iter().copied());
        (nan_max(outputs), nan_max(states))
    }

    /// The worst state after the prompt: its name and NRMSE.
    pub fn worst_state(&self) -> Option<&Named> {
        self.states
            .iter()
            .max_by(|a, b| a.error.nrmse.total_cmp(&b.error.nrmse))
    }
}

/// Thresholds from a baseline device (FP16SIM): layer `l` may be `factor` times as far from the reference as the
/// baseline's layer `l`, and never held tighter than `floor` (so an exact baseline does not demand exactness).
pub fn thresholds_from(
    baseline: &[LayerProbe],
    factor: f64,
    floor: ProbeThresholds,
) -> BTreeMap<usize, ProbeThresholds> {
    baseline
        .iter()
        .map(|b| {
            let (outputs, states) = b.worst();
            (
                b.layer,
                ProbeThresholds {
                    max_nrmse: (factor * outputs).max(floor.max_nrmse),
                    max_state_nrmse: (factor * states).max(floor.max_state_nrmse),
                },
            )
        })
        .collect()
}

/// Per query head, the magnitudes of the causal attention scores `q_t·k_s / √D` (`s ≤ t`), recomputed in f64 from
/// the queries `[T, Hq, D]` and keys `[T, Hkv, D]` as tapped (after norm and RoPE).
pub fn score_magnitudes(q: &Tensor, k: &Tensor) -> Result<Vec<Magnitude>> {
    let (t, hq, d) = q.dims3()?;
    let hkv = k.dim(1)?;
    let (qv, kv) = (values(q)?, values(k)?);
    let group = hq / hkv.max(1);
    let scale = (d as f64).powf(-0.5);
    Ok((0..hq)
        .map(|h| {
            let kh = h / group.max(1);
            let mut scores = Vec::with_capacity(t * (t + 1) / 2);
            for i in 0..t {
                let qi = &qv[(i * hq + h) * d..(i * hq + h + 1) * d];
                for j in 0..=i {
                    let kj = &kv[(j * hkv + kh) * d..(j * hkv + kh + 1) * d];
                    scores.push(scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>());
                }
            }
            Magnitude::of(&scores)
        })
        .collect())
}

/// The drill-down of the first layer over threshold (`None` when every layer holds), judged by that layer's own
/// threshold: the first intermediate over it in computation order, else the first state over it.
pub fn drill_down(layers: &[LayerProbe]) -> Option<DrillDown> {
    let first = layers.iter().find(|l| l.over)?;
    let t = first.thresholds;
    let over = |e: &TensorError, max: f64| !e.finite() || exceeds(e.nrmse, max);
    Some(DrillDown {
        layer: first.layer,
        first_over: first
            .intermediates
            .iter()
            .find(|n| over(&n.error, t.max_nrmse))
            .map(|n| n.name.clone())
            .or_else(|| {
                let prefix = format!("layers.{}.", first.layer);
                first
                    .states
                    .iter()
                    .find(|n| over(&n.error, t.max_state_nrmse))
                    .map(|n| n.name.strip_prefix(&prefix).unwrap_or(&n.name).to_string())
            }),
        intermediates: first.intermediates.clone(),
    })
}
