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
//!
//! The reference's side is `trace.rs`, one layer's measures `layer.rs`, the thresholds and the drill-down `judge.rs`.

pub mod decoder;
mod judge;
mod layer;
pub mod moe;
pub mod run;
mod trace;
pub mod vision;

pub use crate::device::LayerDevice;
pub use judge::{DrillDown, ProbeThresholds, drill_down, thresholds_from};
pub use layer::{
    HeadError, HeadMagnitudes, LayerProbe, Named, head_errors, intermediates, layer_probe,
    score_magnitudes,
};
pub use trace::ReferenceTrace;

use crate::routing::{Reach, RoutingReport};
use anyhow::{Context, Result};
use candle_core::Tensor;
use layer::main_state_error;
use npu::engine::HostLayerState;
use reference::config::Config;
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
            drift.push(
                main_state_error(&ours, layer, &trace.states[b + 1], kind)?
                    .nrmse
                    .get(),
            );
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
