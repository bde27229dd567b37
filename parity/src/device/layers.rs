//! A device's per-layer graphs (the probe's unit): this project's, built from the checkpoint, or a set's per-layer
//! files.

use anyhow::{Context, Result, bail};
use candle_core::Tensor;
use npu::devices::CompileOptions;
use npu::engine::{HostLayerState, LayerRunner};
use npu::graphs::Builder;
use npu::graphset::GraphSet;
use reference::backend::{Precision, RunRecord};
use reference::config::Config;
use std::collections::BTreeMap;

/// Something that runs one layer over one block: a device's per-layer graphs (or, in tests, a corrupted one).
pub trait LayerDevice {
    /// Runs layer `layer` on `hidden` `[T, H]` (`T` at most [`LayerDevice::block`], at positions `start..`),
    /// updating `state`; returns the outputs under the dump's names less the `layers.{i}.` prefix.
    fn run(
        &mut self,
        layer: usize,
        hidden: &Tensor,
        start: usize,
        state: &mut HostLayerState,
    ) -> Result<BTreeMap<String, Tensor>>;

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
        state: &mut HostLayerState,
    ) -> Result<BTreeMap<String, Tensor>> {
        let runner = self
            .runners
            .get_mut(&layer)
            .with_context(|| format!("layer {layer} was not compiled"))?;
        Ok(runner.run(hidden, start, state)?)
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
