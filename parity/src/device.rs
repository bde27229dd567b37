//! Dumps computed by static graphs on an OpenVINO device, in the reference's dump format.

use crate::dump::Dump;
use crate::options::{DeviceArgs, FormArgs};
use anyhow::{Result, bail};
use candle_core::{Device, Tensor};
use npu::devices::{CompileOptions, InferencePrecision, device_config};
use npu::engine::{DEFAULT_BLOCK, DecoderEngine};
use npu::graphs::{Builder, DEFAULT_CONTEXT, DeltaNetGraphForm, GraphOptions};
use reference::config::Config;
use reference::linear_attn::PORT_OUTPUT_SCALE;
use reference::weights::WeightStore;
use std::collections::BTreeMap;

/// Graph and compile settings resolved from the command line.
pub struct DeviceSettings {
    /// Device name.
    pub device: String,
    /// Prompt block.
    pub block: usize,
    /// Graph options.
    pub graph: GraphOptions,
    /// Compile options.
    pub compile: CompileOptions,
}

impl DeviceSettings {
    /// Validates the OpenVINO options (rejecting reference-only ones).
    pub fn resolve(dev: &DeviceArgs, form: &FormArgs) -> Result<Self> {
        let block = dev.block.unwrap_or(DEFAULT_BLOCK);
        if block == 0 {
            bail!("--block must be at least 1");
        }
        let context = dev.context.unwrap_or(DEFAULT_CONTEXT);
        if context == 0 {
            bail!("--context must be at least 1");
        }
        let graph_form = form.graph_form()?;
        let compile = CompileOptions {
            precision: dev.precision.unwrap_or(InferencePrecision::F32),
            device_config: device_config(dev.device_config.as_deref())?,
        };
        Ok(DeviceSettings {
            device: dev.device.clone().unwrap_or_else(|| "CPU".into()),
            block,
            graph: GraphOptions {
                form: graph_form,
                output_scale: form.output_scale(PORT_OUTPUT_SCALE)? as f32,
                context,
            },
            compile,
        })
    }
}

/// Compiles the decoder graphs, runs the prompt and `generate` greedy tokens, and collects the dump.
pub fn openvino_dump(
    config: &Config,
    store: &WeightStore,
    ids: &[u32],
    generate: usize,
    s: &DeviceSettings,
) -> Result<Dump> {
    let runtime = npu::runtime::load()?;
    let builder = Builder::new(config, store, s.graph)?;
    let start = std::time::Instant::now();
    let mut engine = DecoderEngine::new(&builder, s.block, &s.device, &s.compile)?;
    let compile_seconds = start.elapsed().as_secs_f64();
    let start = std::time::Instant::now();
    let run = engine.run(ids, generate)?;
    let run_seconds = start.elapsed().as_secs_f64();

    let mut tensors: BTreeMap<String, Tensor> = run.taps;
    tensors.extend(run.states);
    let ids_i64: Vec<i64> = ids.iter().map(|&x| x as i64).collect();
    tensors.insert("token_ids".into(), Tensor::new(ids_i64, &Device::Cpu)?);
    let generated: Vec<i64> = run.generated.iter().map(|&x| x as i64).collect();
    tensors.insert(
        "generated".into(),
        Tensor::from_vec(generated.clone(), generated.len(), &Device::Cpu)?,
    );

    let session = &engine.sessions()[0].compiled;
    if session.precision != s.compile.precision.hint() {
        eprintln!(
            "warning: {} computed in {} although {} was requested (the device has no such arithmetic); recorded in \
             the dump as `precision`",
            s.device,
            session.precision,
            s.compile.precision.hint()
        );
    }
    let mut metadata = BTreeMap::new();
    metadata.insert("backend".into(), "openvino".into());
    metadata.insert("openvino".into(), runtime.version.clone());
    metadata.insert("device".into(), s.device.clone());
    metadata.insert(
        "precision_requested".into(),
        s.compile.precision.hint().into(),
    );
    metadata.insert("precision".into(), session.precision.clone());
    metadata.insert("dtype".into(), "f32".into());
    if let Some(e) = &session.execution_devices {
        metadata.insert("execution_devices".into(), e.clone());
    }
    for (k, v) in &session.properties {
        metadata.insert(format!("property.{k}"), v.clone());
    }
    metadata.insert(
        "deltanet_prefill".into(),
        match s.graph.form {
            DeltaNetGraphForm::Matrix => "matrix".into(),
            DeltaNetGraphForm::Loop => "loop".into(),
            DeltaNetGraphForm::Chunked(inv) => format!("chunked({}, {})", s.block, inv.name()),
        },
    );
    metadata.insert("deltanet_decode".into(), "matrix".into());
    metadata.insert("block".into(), s.block.to_string());
    metadata.insert("context".into(), s.graph.context.to_string());
    metadata.insert("output_scale".into(), s.graph.output_scale.to_string());
    metadata.insert("weights".into(), store.format().name());
    metadata.insert("compile_seconds".into(), format!("{compile_seconds:.3}"));
    metadata.insert("run_seconds".into(), format!("{run_seconds:.3}"));
    Ok(Dump { tensors, metadata })
}
