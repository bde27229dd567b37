//! One layer probed: what the device gave for a layer, measured against the reference's trace (its outputs, every
//! intermediate in computation order, its states and their drift per block, per-head errors and magnitudes).

use super::moe;
use super::{ProbeThresholds, ReferenceTrace};
use crate::metrics::{Magnitude, TensorError, magnitudes, values};
use crate::routing::LayerRouting;
use anyhow::{Context, Result, bail};
use candle_core::Tensor;
use reference::backend::Snapshot;
use reference::config::LayerKind;
use reference::model::state_names;
use reference::taps::names;
use serde::Serialize;
use std::collections::BTreeMap;

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

/// The name of a layer's main state: the recurrent state, or the key cache.
fn main_state(layer: usize, kind: LayerKind) -> String {
    let [first, second] = state_names(layer, kind);
    match kind {
        LayerKind::Linear => second,
        LayerKind::Full => first,
    }
}

/// The main state's error (`ours`: the layer's states under the dump's names) against the reference's.
pub(super) fn main_state_error(
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
                nrmse: e.nrmse.get(),
                rel_l2: e.rel_l2.get(),
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
