//! Building the backends a command runs: the reference, the static graphs on an OpenVINO device, and an external
//! IR (graphs made elsewhere), from the validated command-line options.

use crate::options::{FormArgs, GraphArgs, ModelArgs};
use anyhow::{Result, bail};
use npu::devices::{CompileOptions, InferencePrecision, device_config};
use npu::engine::DecoderEngine as ExternalBackend;
use npu::engine::{DEFAULT_BLOCK, DecoderEngine};
use npu::graphs::{Builder, DEFAULT_CONTEXT, GraphOptions};
use npu::graphset::GraphSet as IrManifest;
use npu::sim::NumericModel;
use reference::backend::{Backend, ReferenceBackend};
use reference::config::Config;
use reference::linear_attn::PORT_OUTPUT_SCALE;
use reference::model::{Model, RunOptions};
use reference::quant::WeightFormat;
use reference::weights::WeightStore;
use std::path::{Path, PathBuf};

/// Fails unless `device` can run here: the FP16SIM pseudo-device with valid options, or an OpenVINO device that is
/// present (the error names the ones that are).
pub fn check_device(device: &str) -> Result<()> {
    if NumericModel::is_sim(device) {
        NumericModel::parse(device, &[])?;
        return Ok(());
    }
    let core = npu::runtime::core()?;
    npu::devices::require(&core, device)?;
    Ok(())
}

/// Every OpenVINO device present (the FP16SIM pseudo-device is compared only when named).
pub fn available_devices() -> Result<Vec<String>> {
    let core = npu::runtime::core().map_err(|e| {
        anyhow::anyhow!(
            "{e} (FP16SIM needs no runtime: pass --devices FP16SIM to compare with it alone)"
        )
    })?;
    Ok(npu::devices::available(&core)?)
}

/// Graph and compile settings resolved from the command line.
#[derive(Debug, Clone)]
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
    /// Validates the OpenVINO options of `device` (rejecting reference-only ones).
    pub fn resolve(device: &str, dev: &GraphArgs, form: &FormArgs) -> Result<Self> {
        let block = dev.block.unwrap_or(DEFAULT_BLOCK);
        if block == 0 {
            bail!("--block must be at least 1");
        }
        let context = dev.context.unwrap_or(DEFAULT_CONTEXT);
        if context == 0 {
            bail!("--context must be at least 1");
        }
        let graph_form = form.graph_form()?;
        if NumericModel::is_sim(device) && dev.precision.is_some() {
            bail!(
                "--precision applies to OpenVINO devices; {device}'s arithmetic comes from its options \
                 ({}:store=f16|bf16|f32,ftz=on|off,acc=f32|f16,state=f16|f32,norm=ops|fused)",
                npu::sim::DEVICE
            );
        }
        let cache_dir = cache_dir(device, dev)?;
        let compile = CompileOptions {
            precision: dev.precision.unwrap_or(InferencePrecision::F32),
            device_config: device_config(dev.device_config.as_deref())?,
            cache_dir,
        };
        Ok(DeviceSettings {
            device: device.to_string(),
            block,
            graph: GraphOptions {
                form: graph_form,
                output_scale: form.output_scale(PORT_OUTPUT_SCALE)? as f32,
                context,
                taps: true,
            },
            compile,
        })
    }
}

/// The model cache directory for `device`: `--cache-dir`, none with `--no-cache`, else the default one for devices
/// that cache by default (NPU), else none. FP16SIM compiles nothing: `--cache-dir` is refused for it.
pub fn cache_dir(device: &str, dev: &GraphArgs) -> Result<Option<std::path::PathBuf>> {
    let sim = NumericModel::is_sim(device);
    if sim && dev.cache_dir.is_some() {
        bail!("--cache-dir applies to OpenVINO devices; {device} compiles nothing");
    }
    Ok(match (&dev.cache_dir, dev.no_cache) {
        (_, true) => None,
        (Some(dir), false) => Some(dir.clone()),
        (None, false) if !sim && npu::devices::caches_by_default(device) => Some(
            crate::bundled::cache_root()
                .join("qwen35-parity")
                .join("ov-cache"),
        ),
        (None, false) => None,
    })
}

/// Builds and compiles the decoder graphs on the device: a backend. `taps` builds the graphs with every tap as an
/// output (for dumps and hidden-state comparisons) or with logits and states only (as deployed). Warns when the
/// device computes in another precision than the one requested.
pub fn open_device(
    config: &Config,
    store: &WeightStore,
    settings: &DeviceSettings,
    taps: bool,
) -> Result<DecoderEngine> {
    let engine = compile_device(config, store, settings, taps)?;
    let record = engine.record();
    if !NumericModel::is_sim(&settings.device)
        && record.precision.as_deref() != Some(settings.compile.precision.hint())
    {
        eprintln!(
            "warning: {} computed in {} although {} was requested (the device has no such arithmetic); recorded as \
             `precision`",
            settings.device,
            record
                .precision
                .as_deref()
                .unwrap_or("an unreported precision"),
            settings.compile.precision.hint()
        );
    }
    Ok(engine)
}

/// [`open_device`] without the warning (for a caller that reports the precision itself).
pub fn compile_device(
    config: &Config,
    store: &WeightStore,
    settings: &DeviceSettings,
    taps: bool,
) -> Result<DecoderEngine> {
    if !NumericModel::is_sim(&settings.device) {
        npu::runtime::load()?;
    }
    let graph = GraphOptions {
        taps,
        ..settings.graph
    };
    let builder = Builder::new(config, store, graph)?;
    Ok(DecoderEngine::new(
        &builder,
        settings.block,
        &settings.device,
        &settings.compile,
    )?)
}

/// The reference on the store's weights (the very weights a device runs, dequantized exactly).
pub fn open_reference(
    config: &Config,
    store: &WeightStore,
    opts: RunOptions,
    taps: bool,
) -> Result<ReferenceBackend> {
    let model = Model::from_weights(config.clone(), store)?;
    Ok(ReferenceBackend::new(
        model,
        opts,
        taps,
        &store.format().name(),
    )?)
}

/// Fails unless `prompt` tokens and `generate` greedy tokens fit a device's static context (the last generated token
/// is never fed back, so it needs no slot): a long prompt is refused, never cut.
pub fn check_context(prompt: usize, generate: usize, context: usize) -> Result<()> {
    check_context_of(prompt, generate, context, "--context")
}

/// [`check_context`] for a context that comes from `source` (a flag, or an IR's manifest), which the error names.
pub fn check_context_of(
    prompt: usize,
    generate: usize,
    context: usize,
    source: &str,
) -> Result<()> {
    let needed = prompt + generate.saturating_sub(1);
    if needed > context {
        bail!(
            "{prompt} prompt tokens and {generate} generated need {needed} cache slots, but the static context holds \
             {context} ({source})"
        );
    }
    Ok(())
}

/// An external stateful IR (`dir`: the IR and its `manifest.json`, or optimum-intel's interface without one)
/// compiled on an OpenVINO `device` as a backend at the logits and token level: its hidden states and its state are
/// not exposed ([`Backend::exposes_state`] is false). `config` is the checkpoint's the IR was exported from.
pub fn open_external(
    dir: &Path,
    config: &Config,
    device: &str,
    compile: &CompileOptions,
) -> Result<ExternalBackend> {
    refuse_sim(device, dir)?;
    let manifest = npu::graphset::manifest::open(dir)?;
    let backend = ExternalBackend::open(&manifest, config.clone(), device, compile, None)?;
    warn_precision(device, &backend, compile);
    Ok(backend)
}

/// Fails for the FP16SIM pseudo-device, which runs this project's graphs only.
fn refuse_sim(device: &str, dir: &Path) -> Result<()> {
    if NumericModel::is_sim(device) {
        bail!(
            "{device} evaluates this project's own graphs; an external IR runs on an OpenVINO device (--ir {})",
            dir.display()
        );
    }
    Ok(())
}

/// Warns when `device` computed the IR in another precision than asked.
fn warn_precision(device: &str, backend: &ExternalBackend, compile: &CompileOptions) {
    let record = backend.record();
    if record.precision.as_deref() != Some(compile.precision.hint()) {
        eprintln!(
            "warning: {device} computed the IR in {} although {} was requested; recorded as `precision`",
            record
                .precision
                .as_deref()
                .unwrap_or("an unreported precision"),
            compile.precision.hint()
        );
    }
}

/// An external IR directory as a command opens it (`--ir DIR`): its manifest, and the checkpoint and weights the
/// reference runs against it.
pub struct ExternalIr {
    /// The directory given.
    pub dir: PathBuf,
    /// Its manifest (or optimum-intel's interface).
    pub manifest: IrManifest,
    /// The model options with the checkpoint resolved: `--model`, else the one the manifest names, else the bundled
    /// model.
    pub model: ModelArgs,
    /// The checkpoint directory.
    pub checkpoint: PathBuf,
    /// Its config.
    pub config: Config,
    /// The weights the reference runs (`--weights`).
    pub store: WeightStore,
    /// Set when the manifest says the IR holds other weights than `--weights` gives the reference.
    pub weights_warning: Option<String>,
}

impl ExternalIr {
    /// Reads the manifest of `dir` and opens the checkpoint with `model`'s options.
    pub fn open(dir: &Path, model: &ModelArgs) -> Result<Self> {
        let manifest = npu::graphset::manifest::open(dir)
            .map_err(|e| anyhow::Error::new(e).context(format!("--ir {}", dir.display())))?;
        let model = ModelArgs {
            model: model.model.clone().or_else(|| {
                manifest
                    .model
                    .clone()
                    .filter(|m| m.join("config.json").exists())
            }),
            ..model.clone()
        };
        let (checkpoint, config, store) = model.open()?;
        let weights_warning = manifest.reference_weights.as_ref().and_then(|w| {
            (WeightFormat::parse(w).ok() != Some(store.format())).then(|| {
                format!(
                    "{} says the IR holds the weights of `--weights {w}`; the reference runs `--weights {}`",
                    manifest.source,
                    store.format()
                )
            })
        });
        Ok(ExternalIr {
            dir: dir.to_path_buf(),
            manifest,
            model,
            checkpoint,
            config,
            store,
            weights_warning,
        })
    }

    /// The directory's own name, for labels.
    pub fn name(&self) -> String {
        self.dir.file_name().map_or_else(
            || self.dir.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    }

    /// Compiles the IR on `device` (an OpenVINO device), warning when it computes in another precision than
    /// asked (see [`open_external`]).
    pub fn open_on(&self, device: &str, compile: &CompileOptions) -> Result<ExternalBackend> {
        let backend = self.compile(device, compile)?;
        warn_precision(device, &backend, compile);
        Ok(backend)
    }

    /// [`ExternalIr::open_on`] without the warning (for a caller that reports the precision itself).
    pub fn compile(&self, device: &str, compile: &CompileOptions) -> Result<ExternalBackend> {
        refuse_sim(device, &self.dir)?;
        let backend =
            ExternalBackend::open(&self.manifest, self.config.clone(), device, compile, None)
                .map_err(|e| {
                    anyhow::Error::new(e).context(format!("--ir {}", self.dir.display()))
                })?;
        Ok(backend)
    }
}

/// Fails when an option of this project's graphs is given with `--ir DIR` (they do not apply to an IR made
/// elsewhere), naming it.
pub fn refuse_graph_flags(form: &FormArgs, graph: &GraphArgs, ir: &Path) -> Result<()> {
    let not_here = [
        ("--chunk", form.chunk.is_some()),
        ("--inverse", form.inverse.is_some()),
        ("--decode-form", form.decode_form.is_some()),
        ("--prefill-block", form.prefill_block.is_some()),
        ("--output-scale", form.output_scale.is_some()),
        ("--block", graph.block.is_some()),
        ("--context", graph.context.is_some()),
    ];
    if let Some((flag, _)) = not_here.iter().find(|(_, given)| *given) {
        bail!(
            "{flag} applies to this project's graphs, not to an external IR (--ir {})",
            ir.display()
        );
    }
    Ok(())
}

/// The compile options of an external IR on `device`: `--precision` (f32 by default), `--device-config` and the
/// model cache.
pub fn external_compile_options(device: &str, graph: &GraphArgs) -> Result<CompileOptions> {
    Ok(CompileOptions {
        precision: graph.precision.unwrap_or(InferencePrecision::F32),
        device_config: device_config(graph.device_config.as_deref())?,
        cache_dir: cache_dir(device, graph)?,
    })
}
