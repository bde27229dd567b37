//! The probe of a whole-decoder set whose states are ports, layer by layer through its states: the prompt runs in
//! the trace's blocks, the state after every block is compared with the reference's per layer (the drift curve),
//! and whatever hidden outputs the graphs have give each layer's output, mixer and intermediates.
//!
//! - **Isolated**: before every block the device is given the reference's state there (every layer's), so a state
//!   that goes wrong in a block is that block's own error. Inside a block a layer reads the device's own hidden
//!   state from the layer before, so the error of an early layer does reach later ones within the block.
//! - **Chained**: the device carries its own state from block to block, as deployed.
//!
//! An MoE model's routing is compared where the hidden outputs hold the chosen experts (isolated, a flip reaches the
//! later layers within its block only); its blocks cannot be fed the reference's routing (a decoder holds them only
//! behind their routers).

use super::{
    FED_ROUTING_NOT_AVAILABLE, Mode, ProbeOptions, Probed, ReferenceTrace, layer_probe,
    main_state_error, moe,
};
use anyhow::{Context, Result};
use candle_core::Tensor;
use reference::backend::Backend;
use reference::config::Config;
use std::collections::BTreeMap;

/// Probes `layers` of a decoder `device` (whose states are ports) against the reference's trace.
pub fn probe_decoder(
    config: &Config,
    trace: &ReferenceTrace,
    device: &mut dyn Backend,
    layers: &[usize],
    opts: &ProbeOptions,
) -> Result<Probed> {
    let (mode, thresholds) = (opts.mode, opts.thresholds);
    device.reset()?;
    let mut pieces: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
    let mut drift: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for b in 0..trace.blocks.len() {
        if mode == Mode::Isolated {
            device
                .restore(&trace.states[b])
                .context("giving the device the reference's state before a block")?;
        }
        let f = trace.forward_block(device, b)?;
        for (k, v) in f.taps {
            pieces.entry(k).or_default().push(v);
        }
        let after = device.snapshot()?;
        for &layer in layers {
            let kind = config.layer_types[layer];
            let e = main_state_error(&after.tensors, layer, &trace.states[b + 1], kind)?;
            drift.entry(layer).or_default().push(e.nrmse.get());
        }
    }
    let taps: BTreeMap<String, Tensor> = pieces
        .into_iter()
        .map(|(k, v)| Ok((k, Tensor::cat(&v, 0)?)))
        .collect::<Result<_>>()?;
    let after = device.snapshot()?;
    let mut out = Vec::new();
    for &layer in layers {
        let prefix = format!("layers.{layer}.");
        let own: BTreeMap<String, Tensor> = taps
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix(&prefix)?.to_string(), v.clone())))
            .collect();
        out.push(layer_probe(
            layer,
            config.layer_types[layer],
            &own,
            &after.tensors,
            trace,
            drift.remove(&layer).unwrap_or_default(),
            thresholds,
        )?);
    }
    let routing = moe::run_routing(
        config,
        trace,
        taps,
        moe::decoder_reach(mode, trace),
        layers,
        &opts.prompt,
    )?;
    moe::attach(&mut out, routing.as_ref(), Default::default());
    let fed_routing_note =
        (config.moe.is_some() && opts.fed_routing).then(|| FED_ROUTING_NOT_AVAILABLE.to_string());
    Ok(Probed {
        layers: out,
        routing,
        fed_routing_note,
    })
}
