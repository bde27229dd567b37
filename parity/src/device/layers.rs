//! A device's per-layer graphs (the probe's unit): this project's, built from the checkpoint, or a set's per-layer
//! files.

use anyhow::{Context, Result, bail};
use candle_core::Tensor;
use npu::devices::CompileOptions;
use npu::engine::{HostLayerState, LayerRunner, MoeBlockRunner};
use npu::graphs::Builder;
use npu::graphset::GraphSet;
use npu::graphset::layout::CallPositions;
use reference::backend::{Precision, RunRecord};
use reference::config::Config;
use std::collections::BTreeMap;

/// Something that runs one layer over one block: a device's per-layer graphs (or, in tests, a corrupted one).
pub trait LayerDevice {
    /// Runs layer `layer` on `hidden` `[T, H]` (`T` at most [`LayerDevice::block`], after `start` tokens, at
    /// `positions`: text, or an image's MRoPE rows), updating `state`; returns the outputs under the dump's names
    /// less the `layers.{i}.` prefix.
    fn run(
        &mut self,
        layer: usize,
        hidden: &Tensor,
        start: usize,
        positions: CallPositions,
        state: &mut HostLayerState,
    ) -> Result<BTreeMap<String, Tensor>>;

    /// Runs layer `layer`'s MoE block on the routing given to it, over whole sequences: `hidden` `[S, H]` the residual
    /// stream after the mixer (the layer's input plus its mixer output), `experts` `[S, k]` the chosen experts,
    /// `weights` `[S, k]` their weights; returns `mlp_output` and the block's taps under the dump's names less the
    /// `layers.{i}.` prefix. `None` when the device has no such graph: graphs made elsewhere hold the block only
    /// inside the layer, behind its router (the default).
    fn moe_block(
        &mut self,
        layer: usize,
        hidden: &Tensor,
        experts: &Tensor,
        weights: &Tensor,
    ) -> Result<Option<BTreeMap<String, Tensor>>> {
        let _ = (layer, hidden, experts, weights);
        Ok(None)
    }

    /// Tokens per block.
    fn block(&self) -> usize;

    /// The static KV context, if any.
    fn context(&self) -> Option<usize>;

    /// What runs.
    fn record(&self) -> RunRecord;
}

/// The per-layer graphs of a device.
pub struct DeviceLayers {
    runners: BTreeMap<usize, LayerRunner>,
    block: usize,
    context: Option<usize>,
    record: RunRecord,
}

impl DeviceLayers {
    /// Builds and compiles this project's graphs of `layers` for blocks of `block` tokens.
    pub fn build(
        builder: &Builder,
        layers: &[usize],
        block: usize,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        let start = std::time::Instant::now();
        let mut runners = BTreeMap::new();
        for &l in layers {
            runners.insert(l, LayerRunner::new(builder, l, block, device, opts)?);
        }
        let infos: Vec<_> = runners.values().map(|r| r.info()).collect();
        if infos.is_empty() {
            bail!("no layer to probe");
        }
        let record = RunRecord {
            taps: true,
            compile_seconds: Some(start.elapsed().as_secs_f64()),
            ..npu::engine::record_of(&infos, builder, block, opts)?
        };
        Ok(DeviceLayers {
            runners,
            block,
            context: Some(builder.options().context),
            record,
        })
    }

    /// Compiles the per-layer graphs of `layers` for blocks of `block` tokens that `set` holds; `record` is what the
    /// set's decoder (or chain) ran, its compile time replaced.
    pub fn open(
        set: &GraphSet,
        config: &Config,
        layers: &[usize],
        block: usize,
        device: &str,
        opts: &CompileOptions,
        record: &RunRecord,
    ) -> Result<Self> {
        let start = std::time::Instant::now();
        let part = set
            .layers
            .as_ref()
            .with_context(|| format!("{}: no per-layer graphs (`layers`)", set.source))?;
        let mut runners = BTreeMap::new();
        for &l in layers {
            let g = part
                .graphs
                .iter()
                .find(|g| g.layer == Some(l) && g.tokens == Some(block))
                .with_context(|| {
                    format!(
                        "{}: layer {l} has no graph of {block} tokens (it has {:?})",
                        set.source,
                        set.layer_blocks().get(&l).cloned().unwrap_or_default()
                    )
                })?;
            runners.insert(l, LayerRunner::open(set, g, config.clone(), device, opts)?);
        }
        let first = runners.values().next().context("no layer to probe")?;
        let info = first.info();
        let record = RunRecord {
            taps: true,
            precision: Some(Precision::parse(&info.precision)),
            execution_devices: info.execution_devices.clone(),
            compile_seconds: Some(start.elapsed().as_secs_f64()),
            block: Some(block),
            from_cache: runners
                .values()
                .filter_map(|r| Some((r.info().graph.clone(), r.info().loaded_from_cache?)))
                .collect(),
            ..record.clone()
        };
        Ok(DeviceLayers {
            runners,
            block,
            context: set.context,
            record,
        })
    }

    /// What every graph was prepared with.
    pub fn infos(&self) -> Vec<&npu::devices::ExecInfo> {
        self.runners.values().map(|r| r.info()).collect()
    }
}

impl LayerDevice for DeviceLayers {
    fn run(
        &mut self,
        layer: usize,
        hidden: &Tensor,
        start: usize,
        positions: CallPositions,
        state: &mut HostLayerState,
    ) -> Result<BTreeMap<String, Tensor>> {
        let runner = self
            .runners
            .get_mut(&layer)
            .with_context(|| format!("layer {layer} was not compiled"))?;
        Ok(runner.run(hidden, start, positions, state)?)
    }

    fn block(&self) -> usize {
        self.block
    }

    fn context(&self) -> Option<usize> {
        self.context
    }

    fn record(&self) -> RunRecord {
        self.record.clone()
    }
}

/// This project's per-layer graphs compiled a layer at a time, as the probe reaches each, the one before released
/// first (the probe runs every block of a layer before the next): a probe of every layer never holds more than one
/// layer's weights compiled, its MoE block fed a routing included (compiled once the layer's own graph is released,
/// and kept for the layer's next feed). Each graph is logged as it compiles.
pub struct OneLayerAtATime<'a> {
    builder: Builder<'a>,
    device: String,
    opts: CompileOptions,
    layers: Vec<usize>,
    block: usize,
    current: Option<(usize, LayerRunner)>,
    moe_block: Option<(usize, MoeBlockRunner)>,
    record: RunRecord,
    log: &'a super::GraphLog,
}

impl<'a> OneLayerAtATime<'a> {
    /// The graphs of `layers` for blocks of `block` tokens, the first compiled now (what it reads back is the
    /// record's), each graph logged in `log` as `probe layers`.
    pub fn build(
        builder: Builder<'a>,
        layers: &[usize],
        block: usize,
        device: &str,
        opts: &CompileOptions,
        log: &'a super::GraphLog,
    ) -> Result<Self> {
        let &first = layers.first().context("no layer to probe")?;
        let start = std::time::Instant::now();
        let runner = LayerRunner::new(&builder, first, block, device, opts)?;
        log.add("probe layers", [runner.info()]);
        let record = RunRecord {
            taps: true,
            compile_seconds: Some(start.elapsed().as_secs_f64()),
            ..npu::engine::record_of(&[runner.info()], &builder, block, opts)?
        };
        Ok(OneLayerAtATime {
            builder,
            device: device.to_string(),
            opts: opts.clone(),
            layers: layers.to_vec(),
            block,
            current: Some((first, runner)),
            moe_block: None,
            record,
            log,
        })
    }
}

impl OneLayerAtATime<'_> {
    /// Logs a graph compiled since `start` under `purpose`, adding its time (and whether the model cache served it)
    /// to the record.
    fn compiled(
        &mut self,
        purpose: &str,
        info: &npu::devices::ExecInfo,
        start: std::time::Instant,
    ) {
        self.log.add(purpose, [info]);
        let seconds = self.record.compile_seconds.unwrap_or(0.0) + start.elapsed().as_secs_f64();
        self.record.compile_seconds = Some(seconds);
        if let Some(cached) = info.loaded_from_cache {
            self.record.from_cache.insert(info.graph.clone(), cached);
        }
    }
}

impl LayerDevice for OneLayerAtATime<'_> {
    fn run(
        &mut self,
        layer: usize,
        hidden: &Tensor,
        start: usize,
        positions: CallPositions,
        state: &mut HostLayerState,
    ) -> Result<BTreeMap<String, Tensor>> {
        if !self.layers.contains(&layer) {
            bail!("layer {layer} was not compiled");
        }
        if self.current.as_ref().map(|(l, _)| *l) != Some(layer) {
            // Released before the next is built: one layer's weights compiled at a time.
            self.current = None;
            self.moe_block = None;
            let t = std::time::Instant::now();
            let runner =
                LayerRunner::new(&self.builder, layer, self.block, &self.device, &self.opts)?;
            self.compiled("probe layers", runner.info(), t);
            self.current = Some((layer, runner));
        }
        let (_, runner) = self.current.as_mut().context("a layer is compiled")?;
        Ok(runner.run(hidden, start, positions, state)?)
    }

    /// This project's MoE block graph of the layer, built from the checkpoint and compiled once the layer's own
    /// graph is released (one layer's experts compiled at a time); kept until another layer is run.
    fn moe_block(
        &mut self,
        layer: usize,
        hidden: &Tensor,
        experts: &Tensor,
        weights: &Tensor,
    ) -> Result<Option<BTreeMap<String, Tensor>>> {
        if !self.layers.contains(&layer) {
            bail!("layer {layer} was not compiled");
        }
        if self.moe_block.as_ref().map(|(l, _)| *l) != Some(layer) {
            self.current = None;
            self.moe_block = None;
            let t = std::time::Instant::now();
            let runner =
                MoeBlockRunner::new(&self.builder, layer, self.block, &self.device, &self.opts)?;
            self.compiled("probe MoE block (fed routing)", runner.info(), t);
            self.moe_block = Some((layer, runner));
        }
        let (_, runner) = self.moe_block.as_mut().context("a block is compiled")?;
        Ok(Some(runner.run(hidden, experts, weights)?))
    }

    fn block(&self) -> usize {
        self.block
    }

    fn context(&self) -> Option<usize> {
        Some(self.builder.options().context)
    }

    fn record(&self) -> RunRecord {
        self.record.clone()
    }
}
