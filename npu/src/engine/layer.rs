//! One layer's graph on a device, run over whole sequences in blocks (the per-layer probe's unit): this project's
//! per-layer graph built from the checkpoint, or a set's per-layer file, through the set's interface.

use super::{Collector, HostLayerState};
use crate::devices::{CompileOptions, ExecInfo, IrPorts, compile_ir, read_ports};
use crate::error::{Error, Result};
use crate::graphs::Builder;
use crate::graphset::check::{Resolved, Subject, resolve};
use crate::graphset::layout::{self, Call, CallPositions};
use crate::graphset::{GraphFile, GraphSet, InputRole, own};
use crate::infer::{Executor, Session, prepare};
use candle_core::Tensor;
use reference::config::{Config, LayerKind};
use reference::taps::names;
use std::collections::BTreeMap;

/// One layer's graph compiled on a device, run over whole sequences (the per-layer probe).
pub struct LayerRunner {
    session: Box<dyn Executor>,
    ports: Resolved,
    config: Config,
    layer: usize,
    kind: LayerKind,
    tokens: usize,
    context: Option<usize>,
}

impl LayerRunner {
    /// Builds and compiles this project's graph of `layer` for blocks of `tokens`.
    pub fn new(
        builder: &Builder,
        layer: usize,
        tokens: usize,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        let config = builder.config().clone();
        let graph = builder.layer_graph(layer, tokens)?;
        let context = builder.options().context;
        let name = graph.name().to_string();
        let ports = resolve(
            &Subject {
                source: "this project's per-layer graphs",
                part: "layers",
                file: &name,
                tokens: Some(tokens),
                layer: Some(layer),
                context: Some(context),
            },
            &config,
            &own::layer(&config),
            &IrPorts::of_graph(&graph),
        )?;
        Ok(LayerRunner {
            session: prepare(graph, device, opts)?,
            ports,
            kind: config.layer_types[layer],
            config,
            layer,
            tokens,
            context: Some(context),
        })
    }

    /// Compiles a set's per-layer graph `file` for `device`, checked against the set's description first.
    pub fn open(
        set: &GraphSet,
        file: &GraphFile,
        config: Config,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        let part = set.layers.as_ref().ok_or_else(|| {
            Error::Config(format!(
                "{}: the set has no per-layer graphs (`layers`)",
                set.source
            ))
        })?;
        let (Some(layer), Some(tokens)) = (file.layer, file.tokens) else {
            return Err(Error::Config(format!(
                "{}: a per-layer graph needs its layer and tokens",
                set.source
            )));
        };
        if layer >= config.num_layers() {
            return Err(Error::Config(format!(
                "{}: a graph of layer {layer}, but the model has {} layers",
                set.source,
                config.num_layers()
            )));
        }
        let name = file.xml.display().to_string();
        let ports = resolve(
            &Subject {
                source: &set.source,
                part: &part.key,
                file: &name,
                tokens: Some(tokens),
                layer: Some(layer),
                context: set.context,
            },
            &config,
            &part.interface,
            &read_ports(&file.xml, &file.bin)?,
        )?;
        let mut core = crate::runtime::core()?;
        let stem = file
            .xml
            .file_stem()
            .map_or_else(|| name.clone(), |s| s.to_string_lossy().into_owned());
        let compiled = compile_ir(&mut core, &file.xml, &file.bin, &stem, device, opts)?;
        Ok(LayerRunner {
            session: Box::new(Session::new(compiled)?),
            ports,
            kind: config.layer_types[layer],
            config,
            layer,
            tokens,
            context: set.context,
        })
    }

    /// What the graph was prepared with (device, precision, compile time).
    pub fn info(&self) -> &ExecInfo {
        self.session.info()
    }

    /// Tokens per block.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Runs `hidden` `[S, H]` (after `start` tokens, at `positions`) through the layer in blocks, updating `state`;
    /// returns every token-major output over the `S` tokens, named as in the dump without the `layers.{i}.` prefix
    /// (the layer's own output as `output`).
    pub fn run(
        &mut self,
        hidden: &Tensor,
        start: usize,
        positions: CallPositions,
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
            let past = start + done;
            if self.kind == LayerKind::Full && state.cached() != past {
                return Err(Error::Interface(format!(
                    "layer {}: a KV cache of {} positions for a block at position {past}",
                    self.layer,
                    state.cached()
                )));
            }
            let ids = vec![0u32; valid];
            let call = Call {
                ids: &ids,
                tokens: self.tokens,
                past,
                context: self.context,
                positions: positions.slice(done, valid),
            };
            let graph_name = self.session.info().graph.clone();
            let at = |key: &str| format!("{graph_name} `{key}`");
            let mut inputs: Vec<(String, Tensor)> = Vec::new();
            for (role, port) in &self.ports.inputs {
                let t = match role {
                    InputRole::Hidden => layout::rows(
                        &self.config,
                        &port.spec(),
                        &hidden.narrow(0, done, valid)?,
                        &call,
                        &at(&port.key),
                    )?,
                    other => {
                        layout::fill(&self.config, *other, &port.spec(), &call, &at(&port.key))?
                    }
                };
                inputs.push((port.name.clone(), t));
            }
            inputs.extend(super::state_inputs(
                &self.config,
                &self.ports.states,
                |_| &*state,
                &call,
                &graph_name,
            )?);
            let refs: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
            let mut results = self.session.run(&refs)?;
            super::take_states(
                &self.ports.states,
                &mut results,
                std::slice::from_mut(state),
                |_| 0,
                &call,
                &graph_name,
            )?;
            let port = &self.ports.output;
            let main = results.remove(&port.name).ok_or_else(|| {
                Error::Interface(format!("the graph gave no output `{}`", port.name))
            })?;
            let main = layout::from_port(
                &main,
                &port.shape,
                &[crate::graphset::Axis::Tokens, crate::graphset::Axis::Hidden],
                &at(&port.key),
            )?;
            out.push(names::OUTPUT, &main, valid)?;
            for (dump, name) in &self.ports.taps {
                if dump == names::OUTPUT {
                    continue;
                }
                if let Some(t) = results.get(name) {
                    out.push(dump, t, valid)?;
                }
            }
            done += valid;
        }
        out.finish()
    }
}
