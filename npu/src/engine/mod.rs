//! Running a graph set over a whole sequence, through its interface ([`crate::graphset`]): this project's graphs
//! and graphs made elsewhere alike. Prompts in blocks by the set's host rule, explicit caches kept on the host in the
//! dump's layout and handed between calls. Produces the reference's dump names, so the two can be compared tensor
//! for tensor.

mod chain;
mod decoder;
pub(crate) mod ir_cache;
pub use ir_cache::KEEP as IR_CACHE_KEEP;
mod layer;
mod moe_block;
mod own;
mod record;
mod state;
mod vision;

pub use chain::LayerChain;
pub use decoder::{DecoderEngine, SET_BACKEND, STATE_NOT_EXPOSED};
pub use layer::LayerRunner;
pub use moe_block::MoeBlockRunner;
pub use record::record_of;
pub use state::HostLayerState;
pub use vision::SetVision;

use crate::error::{Error, Result};
use crate::graphset::check::LayerState;
use crate::graphset::layout::{self, Call};
use candle_core::Tensor;
use reference::config::Config;
use reference::taps::{SharedTapSink, names, put};
use std::collections::BTreeMap;

/// One graph of a decoder set, ready to run: what [`own`] compiles this project's graphs into and [`decoder`] runs
/// (with the graphs of sets made elsewhere).
struct SetGraph {
    /// Tokens per call (`None`: any).
    tokens: Option<usize>,
    exec: Box<dyn crate::infer::Executor>,
    ports: crate::graphset::check::Resolved,
}

/// Tokens per prompt block of the decoder graphs unless asked otherwise (the NPU port's smaller block).
pub const DEFAULT_BLOCK: usize = 16;

pub use crate::graphset::layout::pad_rows;

/// Collects token-major outputs across blocks (valid rows only).
#[derive(Default)]
pub(crate) struct Collector(BTreeMap<String, Vec<Tensor>>);

impl Collector {
    pub(crate) fn push(&mut self, name: &str, t: &Tensor, valid: usize) -> Result<()> {
        self.0
            .entry(name.to_string())
            .or_default()
            .push(t.narrow(0, 0, valid)?);
        Ok(())
    }

    pub(crate) fn finish(self) -> Result<BTreeMap<String, Tensor>> {
        self.0
            .into_iter()
            .map(|(k, v)| Ok((k, Tensor::cat(&v, 0)?)))
            .collect()
    }
}

/// Sends one graph call's outputs to `sink`, its first row being token `position`: every tap (but a `logits` tap),
/// then the logits when they cover each of the call's `rows` (a set giving the last slot's only gives none).
pub(crate) fn stream(
    sink: &SharedTapSink,
    position: usize,
    rows: usize,
    logits: &Tensor,
    taps: BTreeMap<String, Tensor>,
) -> Result<()> {
    for (name, t) in taps {
        if name != names::LOGITS {
            put(sink, &name, position, &t)?;
        }
    }
    if logits.dim(0)? == rows {
        put(sink, names::LOGITS, position, logits)?;
    }
    Ok(())
}

/// The state inputs of a call: every state port of `ports` fed from its layer's host state (`state_of(layer)`), in
/// the port's layout; `graph` names the graph in errors.
pub(crate) fn state_inputs<'s>(
    config: &Config,
    ports: &[LayerState],
    state_of: impl Fn(usize) -> &'s HostLayerState,
    call: &Call,
    graph: &str,
) -> Result<Vec<(String, Tensor)>> {
    ports
        .iter()
        .map(|st| {
            let t = state_of(st.layer).get(st.kind).ok_or_else(|| {
                Error::Interface(format!("layer {} has no {}", st.layer, st.kind.key()))
            })?;
            let at = format!("{graph} `{}`", st.key);
            Ok((
                st.input.clone(),
                layout::state_in(config, st.kind, &st.spec, t, call, &at)?,
            ))
        })
        .collect()
}

/// Takes every state output of `ports` out of a call's outputs into its layer's host state (`states[index(layer)]`),
/// in the dump's layout (a cache's valid rows).
pub(crate) fn take_states(
    ports: &[LayerState],
    outputs: &mut BTreeMap<String, Tensor>,
    states: &mut [HostLayerState],
    index: impl Fn(usize) -> usize,
    call: &Call,
    graph: &str,
) -> Result<()> {
    for st in ports {
        let t = outputs
            .remove(&st.output)
            .ok_or_else(|| Error::Interface(format!("the graph gave no output `{}`", st.output)))?;
        let state = states
            .get_mut(index(st.layer))
            .ok_or_else(|| Error::Interface(format!("no state of layer {}", st.layer)))?;
        let before = state.get(st.kind).ok_or_else(|| {
            Error::Interface(format!("layer {} has no {}", st.layer, st.kind.key()))
        })?;
        let at = format!("{graph} `{}`", st.key);
        let new = layout::state_out(st.kind, &st.spec, st.update, &t, before, call, &at)?;
        state.set(st.kind, new)?;
    }
    Ok(())
}
