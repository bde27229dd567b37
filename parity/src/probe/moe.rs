//! The probe of an MoE model's layers: the routing report of the layers probed ([`crate::routing`], made from the
//! device's taps against the reference trace's, with what reaches what in the probe's mode), and the **fed-routing**
//! probe: each MoE layer's block run on the device on the reference's routing and residual stream after the mixer,
//! so that the experts' arithmetic is judged apart from the router's choice ([`FedRouting`], [`Blame`]).
//!
//! # Fed routing
//! The block is run on the device twice on the reference's `experts_chosen` and `expert_weights`: fed the reference's
//! residual stream after the mixer, `hidden = input + mixer_output` (both the reference's, added on the host in f32
//! as the reference and the graphs add them), and fed the device's own (its layer's input, the reference's when
//! isolated, plus its own mixer output). It applies the layer's `post_attention_layernorm`, the chosen experts with
//! those weights and the gated shared expert, and its `mlp_output` is compared with the reference's. Beside the MLP
//! on the device's own input and routing (the layer's own graph), the three split the MLP error:
//!
//! - fed the reference's input and routing: the device's arithmetic of the block alone, which neither a flip nor an
//!   error in what the block reads reaches; over threshold, the experts are to blame (or the norm, or the shared
//!   expert), whatever the routing;
//! - fed its own input and the reference's routing: that, and what the block reads; over threshold (the first
//!   within), the input is to blame (the layer's input and mixer output);
//! - its own input and routing: that, and the routing; over threshold (the others within), the routing is to blame.

use super::{LayerDevice, LayerProbe, Mode, ReferenceTrace};
use crate::metrics::{Measure, TensorError, per_slice};
use crate::routing::{Reach, RoutingReport, from_taps_with};
use anyhow::{Context, Result};
use candle_core::Tensor;
use reference::config::Config;
use reference::taps::names;
use serde::Serialize;
use std::collections::BTreeMap;

/// An MoE layer's block on the device fed the reference's routing.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FedRouting {
    /// The MLP output's error fed the reference's residual stream after the mixer and its routing: the experts'
    /// arithmetic (with the post-attention norm and the shared expert) alone.
    pub mlp: TensorError,
    /// The shared expert's output (as added), fed the same.
    pub shared: Option<TensorError>,
    /// The MLP output's error fed the device's own residual stream after the mixer and the reference's routing: the
    /// experts and what the block reads, without the routing (`None`: the device exposes no mixer output).
    pub mlp_own_input: Option<TensorError>,
    /// At the tokens whose experts the device's own routing flipped, the worst per-token MLP output NRMSE fed the
    /// reference's input and routing (`None`: no flip).
    pub mlp_nrmse_flipped: Option<Measure>,
    /// The same on the device's own input with the reference's routing.
    pub own_input_nrmse_flipped: Option<Measure>,
    /// Per token, the MLP output's NRMSE fed the reference's input and routing.
    #[serde(skip)]
    per_token: Vec<Measure>,
    /// Per token, fed the device's own input and the reference's routing.
    #[serde(skip)]
    own_input_per_token: Vec<Measure>,
}

/// What an MoE layer's MLP error comes from, by its block fed the reference's routing against the block on its own
/// (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Blame {
    /// Every figure within the threshold.
    Neither,
    /// Over it fed the reference's input and routing: the experts' arithmetic (or the post-attention norm, or the
    /// shared expert), whatever the routing.
    Experts,
    /// Within it fed the reference's input and routing, over it fed its own input and the reference's routing: what
    /// the block reads (the layer's input and mixer output).
    Input,
    /// Within it fed the reference's routing (on either input), over it on the device's own routing: the routing.
    Routing,
}

/// Whether `name` (within a layer) is among the taps the routing report reads: the chosen experts, the router
/// logits, and the mixer, MLP and layer outputs.
pub fn routing_tap(name: &str) -> bool {
    [names::MIXER_OUTPUT, names::MLP_OUTPUT, names::OUTPUT].contains(&name)
        || [names::ROUTER_LOGITS, names::EXPERTS_CHOSEN]
            .iter()
            .any(|t| name == names::mixer(names::MLP, t))
}

/// Runs layer `layer`'s block on `device` fed the reference's routing, on the reference's residual stream after the
/// mixer and on the device's own (`input`, what the layer was fed, plus the mixer output in `own`, the layer's
/// outputs under names within it): its figures, the ones at the flipped tokens left to the routing ([`attach`]);
/// `None` when the device cannot run the block alone.
pub fn fed_routing(
    device: &mut dyn LayerDevice,
    trace: &ReferenceTrace,
    layer: usize,
    input: &Tensor,
    own: &BTreeMap<String, Tensor>,
) -> Result<Option<FedRouting>> {
    let at = |name: &str| trace.tap(&names::layer(layer, name));
    let mlp_tap = |tap: &str| at(&names::mixer(names::MLP, tap));
    let (experts, weights) = (
        mlp_tap(names::EXPERTS_CHOSEN)?,
        mlp_tap(names::EXPERT_WEIGHTS)?,
    );
    let reference = at(names::MLP_OUTPUT)?;
    let mut run = |hidden: &Tensor| -> Result<Option<BTreeMap<String, Tensor>>> {
        device
            .moe_block(layer, hidden, experts, weights)
            .with_context(|| format!("layer {layer}'s MoE block fed the reference's routing"))
    };
    let Some(fed) = run(&(trace.input(layer)? + at(names::MIXER_OUTPUT)?)?)? else {
        return Ok(None);
    };
    let mlp_of = |out: &BTreeMap<String, Tensor>| -> Result<(TensorError, Vec<Measure>)> {
        let a = out
            .get(names::MLP_OUTPUT)
            .with_context(|| format!("layer {layer}: the MoE block gave no `mlp_output`"))?;
        Ok((
            TensorError::of(a, reference)?,
            per_slice(a, reference, 0)?
                .iter()
                .map(|e| e.nrmse)
                .collect(),
        ))
    };
    let (mlp, per_token) = mlp_of(&fed)?;
    let shared_name = names::mixer(names::MLP, names::SHARED_OUTPUT);
    let shared = match fed.get(&shared_name) {
        Some(a) => Some(TensorError::of(a, at(&shared_name)?)?),
        None => None,
    };
    let (mlp_own_input, own_input_per_token) = match own.get(names::MIXER_OUTPUT) {
        Some(mixed) => match run(&(input + mixed)?)? {
            Some(out) => {
                let (e, per) = mlp_of(&out)?;
                (Some(e), per)
            }
            None => (None, Vec::new()),
        },
        None => (None, Vec::new()),
    };
    Ok(Some(FedRouting {
        mlp,
        shared,
        mlp_own_input,
        mlp_nrmse_flipped: None,
        own_input_nrmse_flipped: None,
        per_token,
        own_input_per_token,
    }))
}

/// The routing of one layer probed isolated, from its outputs `own` (names within the layer): its input is the
/// reference's, so no flip follows another. `None` for a dense layer or a device without the chosen experts.
pub fn isolated_routing(
    config: &Config,
    trace: &ReferenceTrace,
    layer: usize,
    own: &BTreeMap<String, Tensor>,
    prompt: &str,
) -> Result<Option<RoutingReport>> {
    let mut device: BTreeMap<String, Tensor> = own
        .iter()
        .filter(|(k, _)| routing_tap(k))
        .map(|(k, v)| (names::layer(layer, k), v.clone()))
        .collect();
    let input = match layer {
        0 => names::EMBEDDINGS.to_string(),
        l => names::layer(l - 1, names::OUTPUT),
    };
    device.insert(input, trace.input(layer)?.clone());
    from_taps_with(
        prompt,
        config.num_layers(),
        &trace.taps,
        &device,
        &Reach::Isolated,
    )
}

/// The routing of a run whose device taps `device` are under the dump's names (every layer run), its layer 0 fed the
/// reference's embeddings; earlier flips reach later tokens as the probe's `mode` fed the layers (`blocks`: the
/// blocks the reference's state was given back at, for a decoder probed isolated). Kept to the layers `probed`.
pub fn run_routing(
    config: &Config,
    trace: &ReferenceTrace,
    mut device: BTreeMap<String, Tensor>,
    reach: Reach,
    probed: &[usize],
    prompt: &str,
) -> Result<Option<RoutingReport>> {
    if !device.contains_key(names::EMBEDDINGS) {
        device.insert(names::EMBEDDINGS.into(), trace.input(0)?.clone());
    }
    let report = from_taps_with(prompt, config.num_layers(), &trace.taps, &device, &reach)?;
    Ok(report.map(|mut r| {
        r.retain_layers(probed);
        r
    }))
}

/// How earlier flips reach later tokens in a decoder probed in `mode`.
pub fn decoder_reach(mode: Mode, trace: &ReferenceTrace) -> Reach {
    match mode {
        Mode::Isolated => Reach::Blocks(trace.blocks.clone()),
        Mode::Chained => Reach::Chained,
    }
}

/// The tokens of layer `layer` whose experts flipped in `report`.
pub fn flipped_tokens(report: Option<&RoutingReport>, layer: usize) -> Vec<usize> {
    report.map_or_else(Vec::new, |r| {
        r.flips
            .iter()
            .filter(|f| f.layer == layer)
            .map(|f| f.token)
            .collect()
    })
}

/// Gives every probed layer its routing and its fed-routing figures (`fed` by layer, their figure at the flipped
/// tokens filled in) and judges it again.
pub fn attach(
    layers: &mut [LayerProbe],
    routing: Option<&RoutingReport>,
    mut fed: BTreeMap<usize, FedRouting>,
) {
    for l in layers {
        l.routing = routing.and_then(|r| r.layers.iter().find(|x| x.layer == l.layer).cloned());
        l.fed_routing = fed.remove(&l.layer).map(|mut f| {
            let flipped = flipped_tokens(routing, l.layer);
            let at_flips = |per_token: &[Measure]| {
                flipped
                    .iter()
                    .filter_map(|&t| per_token.get(t).copied())
                    .reduce(Measure::worst)
            };
            f.mlp_nrmse_flipped = at_flips(&f.per_token);
            f.own_input_nrmse_flipped = at_flips(&f.own_input_per_token);
            f
        });
        l.judge(l.thresholds);
    }
}

/// The blame of a layer by its MLP error on its own input and routing (`own`) and fed the reference's routing
/// (`fed`), the bound `over` says an error exceeds (module docs). `None` without the block fed.
pub fn blame(
    own: Option<&TensorError>,
    fed: Option<&FedRouting>,
    over: impl Fn(&TensorError) -> bool,
) -> Option<Blame> {
    let fed = fed?;
    Some(if over(&fed.mlp) {
        Blame::Experts
    } else if fed.mlp_own_input.as_ref().is_some_and(&over) {
        Blame::Input
    } else if own.is_some_and(&over) {
        Blame::Routing
    } else {
        Blame::Neither
    })
}
