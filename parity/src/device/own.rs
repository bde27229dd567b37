//! This project's graphs, built from the checkpoint, as the device under test.

use super::fault::{Fault, Faulty, FaultyLayers};
use super::layers::OneLayerAtATime;
use super::{Capabilities, DeviceSettings, DeviceUnderTest, GraphInfo, GraphLog, LayerDevice};
use anyhow::{Context, Result};
use npu::engine::DecoderEngine;
use npu::graphs::{Builder, GraphOptions};
use npu::graphset::PromptRule;
use reference::backend::{Backend, RunRecord};
use reference::config::Config;
use reference::weights::WeightStore;

/// This project's decoder graphs on a device (prompt blocks of the settings' size and single-token decode), with
/// every other graph a check needs built on demand from the same checkpoint and settings.
pub struct OwnGraphs<'a> {
    config: &'a Config,
    store: &'a WeightStore,
    settings: DeviceSettings,
    fault: Option<Fault>,
    deployed: Option<Faulty<DecoderEngine>>,
    tapped: Option<Faulty<DecoderEngine>>,
    /// What the deployed graphs ran, kept when they are released.
    record: Option<RunRecord>,
    /// How the deployed graphs were last told to feed a prompt, applied again when they are compiled again.
    padded: Option<bool>,
    caps: Capabilities,
    log: GraphLog,
}

impl<'a> OwnGraphs<'a> {
    /// This project's graphs for `settings`, misbehaving as `fault` says (tests only); the deployed graphs (logits
    /// and states only) are compiled when a check first runs them.
    pub fn open(
        config: &'a Config,
        store: &'a WeightStore,
        settings: DeviceSettings,
        fault: Option<Fault>,
    ) -> Result<Self> {
        let interface = npu::graphset::own::decoder(config, false, false);
        let mut blocks = vec![1, settings.block];
        blocks.dedup();
        let caps = Capabilities {
            kind: "this project's graphs",
            states: true,
            states_note: "",
            hidden: true,
            token_valid: interface.has("token_valid"),
            single_token: true,
            layer_graphs: true,
            fed_routing: true,
            any_block: true,
            blocks,
            block: Some(settings.block),
            context: Some(settings.graph.context),
            context_source: "--context".into(),
        };
        Ok(OwnGraphs {
            config,
            store,
            fault,
            deployed: None,
            tapped: None,
            record: None,
            padded: None,
            caps,
            settings,
            log: GraphLog::default(),
        })
    }

    /// The deployed graphs, compiled on first use.
    fn engine(&mut self) -> Result<&mut Faulty<DecoderEngine>> {
        if self.deployed.is_none() {
            let engine = compile(
                self.config,
                self.store,
                &self.settings,
                self.settings.block,
                Graphs::Deployed,
                &self.log,
                "deployed",
            )?;
            self.record = Some(engine.record().clone());
            let mut engine = faulty(engine, self.fault, self.settings.block);
            if let Some(padded) = self.padded {
                set_rule(&mut engine, padded)?;
            }
            self.deployed = Some(engine);
        }
        self.deployed
            .as_mut()
            .context("the deployed graphs are compiled")
    }
}

/// Pads a prompt's last block, or feeds it unpadded.
fn set_rule(engine: &mut Faulty<DecoderEngine>, padded: bool) -> Result<()> {
    let rule = if padded {
        PromptRule::Padded
    } else {
        PromptRule::Blocks
    };
    engine.set_padded(padded);
    Ok(engine.inner_mut().set_prompt_rule(rule)?)
}

/// Which decoder graphs to compile.
#[derive(Clone, Copy, PartialEq)]
enum Graphs {
    /// As deployed: the prompt-block graph and the 1-token decode graph, logits and states only.
    Deployed,
    /// Every tap as an output, in the prompt-block graph alone (single tokens run padded in it): one compiled copy
    /// of the weights where the deployed set holds two.
    Tapped,
}

/// `engine`, compiled for prompt blocks of `block`, with the fault its graphs carry.
fn faulty(engine: DecoderEngine, fault: Option<Fault>, block: usize) -> Faulty<DecoderEngine> {
    let context = engine.context();
    Faulty::new(engine, Fault::for_block(fault, block)).with_context(context)
}

/// Builds and compiles this project's decoder graphs for `settings` (with every tap as an output, or as deployed),
/// warning when the device computes in another precision than asked: a backend on its own, for a command that
/// only runs it (`dump`, `bench`).
pub fn engine(
    config: &Config,
    store: &WeightStore,
    settings: &DeviceSettings,
    taps: bool,
) -> Result<DecoderEngine> {
    let log = GraphLog::default();
    let graphs = if taps {
        Graphs::Tapped
    } else {
        Graphs::Deployed
    };
    let e = compile(config, store, settings, settings.block, graphs, &log, "")?;
    let r = e.record();
    if !npu::sim::NumericModel::is_sim(&settings.device)
        && r.precision.as_ref() != r.precision_requested.as_ref()
    {
        crate::errln!(
            "warning: {} computed in {} although {} was requested (the device has no such arithmetic); recorded \
             as `precision`",
            settings.device,
            r.precision_text(),
            settings.compile.precision.hint()
        );
    }
    Ok(e)
}

/// Builds and compiles the decoder graphs `graphs` with prompt blocks of `block`, logging them as `purpose`.
fn compile(
    config: &Config,
    store: &WeightStore,
    settings: &DeviceSettings,
    block: usize,
    graphs: Graphs,
    log: &GraphLog,
    purpose: &str,
) -> Result<DecoderEngine> {
    if !npu::sim::NumericModel::is_sim(&settings.device) {
        npu::runtime::load()?;
    }
    let graph = GraphOptions {
        taps: graphs == Graphs::Tapped,
        ..settings.graph
    };
    let builder = Builder::new(config, store, graph)?;
    let (device, opts) = (&settings.device, &settings.compile);
    let mut engine = match graphs {
        Graphs::Deployed => DecoderEngine::new(&builder, block, device, opts),
        Graphs::Tapped => DecoderEngine::padded_only(&builder, block, device, opts),
    }
    .with_context(|| format!("compiling the graphs with --block {block}"))?;
    // Graphs taking embeddings (a prompt with images) look the text tokens' rows up in the reference's table.
    if graph.embeddings_input {
        engine.set_host_embeddings(reference::model::TokenTable::load(config, store)?);
    }
    log.add(purpose, engine.infos());
    Ok(engine)
}

impl DeviceUnderTest for OwnGraphs<'_> {
    fn label(&self) -> &str {
        &self.settings.device
    }

    fn device(&self) -> &str {
        &self.settings.device
    }

    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn record(&mut self) -> Result<RunRecord> {
        if let Some(r) = &self.record {
            return Ok(r.clone());
        }
        Ok(self.engine()?.record().clone())
    }

    fn deployed(&mut self) -> Result<&mut dyn Backend> {
        Ok(self.engine()?)
    }

    fn tapped(&mut self) -> Result<Option<&mut dyn Backend>> {
        if self.tapped.is_none() {
            let engine = compile(
                self.config,
                self.store,
                &self.settings,
                self.settings.block,
                Graphs::Tapped,
                &self.log,
                "taps",
            )?;
            self.tapped = Some(faulty(engine, self.fault, self.settings.block));
        }
        Ok(self.tapped.as_mut().map(|t| t as &mut dyn Backend))
    }

    fn with_block(&mut self, block: usize) -> Result<Box<dyn Backend + '_>> {
        if block == self.settings.block {
            // The deployed graphs themselves: a call of more than a block runs in blocks anyway.
            return Ok(Box::new(super::pieces::Pieces {
                inner: self.engine()?,
                block,
            }));
        }
        let engine = compile(
            self.config,
            self.store,
            &self.settings,
            block,
            Graphs::Deployed,
            &self.log,
            &format!("block {block}"),
        )?;
        Ok(Box::new(faulty(engine, self.fault, block)))
    }

    fn set_padding(&mut self, padded: bool) -> Result<()> {
        set_rule(self.engine()?, padded)?;
        self.padded = Some(padded);
        Ok(())
    }

    fn release(&mut self) {
        self.deployed = None;
        self.tapped = None;
    }

    fn fresh(&self) -> Result<Box<dyn Backend>> {
        let engine = compile(
            self.config,
            self.store,
            &self.settings,
            self.settings.block,
            Graphs::Deployed,
            &self.log,
            "fresh (back-to-back)",
        )?;
        Ok(Box::new(faulty(engine, self.fault, self.settings.block)))
    }

    fn layers(&self, layers: &[usize], block: usize) -> Result<Option<Box<dyn LayerDevice + '_>>> {
        let builder = Builder::new(
            self.config,
            self.store,
            GraphOptions {
                taps: true,
                ..self.settings.graph
            },
        )?;
        let d = OneLayerAtATime::build(
            builder,
            layers,
            block,
            &self.settings.device,
            &self.settings.compile,
            &self.log,
        )?;
        Ok(Some(match self.fault {
            Some(fault @ (Fault::LayerGraph(_) | Fault::LayerRouting(_))) => {
                Box::new(FaultyLayers {
                    inner: Box::new(d),
                    fault,
                })
            }
            _ => Box::new(d),
        }))
    }

    fn graphs(&self) -> Vec<GraphInfo> {
        self.log.all()
    }
}
