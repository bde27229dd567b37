//! One layer's graph on a device, run over whole sequences in blocks (the per-layer probe's unit).

use super::{BlockInputs, Collector, HostLayerState, pad_rows};
use crate::devices::CompileOptions;
use crate::error::{Error, Result};
use crate::graphs::{Builder, ports};
use crate::infer::{Executor, prepare};
use candle_core::Tensor;
use reference::config::LayerKind;
use std::collections::BTreeMap;

/// One layer's graph compiled on a device, run over whole sequences (the per-layer probe).
pub struct LayerRunner {
    session: Box<dyn Executor>,
    layer: usize,
    kind: LayerKind,
    tokens: usize,
    context: usize,
}

impl LayerRunner {
    /// Builds and compiles the graph of `layer` for blocks of `tokens`.
    pub fn new(
        builder: &Builder,
        layer: usize,
        tokens: usize,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        let graph = builder.layer_graph(layer, tokens)?;
        Ok(LayerRunner {
            session: prepare(graph, device, opts)?,
            layer,
            kind: builder.config().layer_types[layer],
            tokens,
            context: builder.options().context,
        })
    }

    /// What the graph was prepared with (device, precision, compile time).
    pub fn info(&self) -> &crate::devices::ExecInfo {
        self.session.info()
    }

    /// Runs `hidden` `[S, H]` (positions `start..`) through the layer in blocks, updating `state`; returns every
    /// token-major output over the `S` tokens, named as in the dump without the `layers.{i}.` prefix.
    pub fn run(
        &mut self,
        hidden: &Tensor,
        start: usize,
        state: &mut HostLayerState,
    ) -> Result<BTreeMap<String, Tensor>> {
        if state.kind() != self.kind {
            return Err(Error::Interface(format!(
                "layer {}: a {} state for a {} layer",
                self.layer,
                state.kind().name(),
                self.kind.name()
            )));
        }
        let s = hidden.dim(0)?;
        let mut out = Collector::default();
        let mut done = 0;
        while done < s {
            let valid = self.tokens.min(s - done);
            let x = pad_rows(&hidden.narrow(0, done, valid)?, self.tokens)?;
            let b = BlockInputs::new(
                self.tokens,
                valid,
                start + done,
                state.cached(),
                self.context,
            )?;
            let mut inputs = vec![(ports::HIDDEN.to_string(), x)];
            inputs.extend(b.named());
            inputs.extend(state.feed(""));
            let mut results = self.session.run_declared(&inputs)?;
            state.take_from(&mut results, "", valid)?;
            for (name, t) in &results {
                out.push(name, t, valid)?;
            }
            done += valid;
        }
        out.finish()
    }
}
