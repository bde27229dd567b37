//! Where a run computes and how OpenVINO graphs are built and compiled (`--backend`, `--device`, `--precision`,
//! `--block`, `--context`, `--device-config`, `--cache-dir`): the device's settings, validated, and the graph
//! options refused where they do not apply.

use super::FormArgs;
use crate::device::DeviceSettings;
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use npu::devices::{CompileOptions, InferencePrecision, device_config};
use npu::graphs::{DEFAULT_CONTEXT, GraphOptions};
use npu::sim::NumericModel;
use reference::linear_attn::PORT_OUTPUT_SCALE;
use std::path::{Path, PathBuf};

fn parse_precision(s: &str) -> std::result::Result<InferencePrecision, String> {
    InferencePrecision::parse(s).map_err(|e| e.to_string())
}

/// The backend that computes a dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// The candle CPU reference.
    Reference,
    /// Static graphs on an OpenVINO device.
    Openvino,
}

/// How the OpenVINO graphs are built and compiled (besides the DeltaNet form of [`FormArgs`]).
#[derive(Debug, Clone, Args)]
pub struct GraphArgs {
    /// Inference precision asked of an OpenVINO device (f32, or f16 as an NPU computes); what actually ran is read
    /// back and recorded. Default f32. (FP16SIM takes its arithmetic from its options.)
    #[arg(long, value_parser = parse_precision, value_name = "f32|f16")]
    pub precision: Option<InferencePrecision>,
    /// Prompt block of the OpenVINO graphs (the prompt runs in padded blocks of N tokens). Default 16.
    #[arg(long, value_name = "N")]
    pub block: Option<usize>,
    /// Static KV context of the OpenVINO graphs. Default 1024.
    #[arg(long, value_name = "N")]
    pub context: Option<usize>,
    /// Device properties as a JSON object (default: the QWEN35_DEVICE_CONFIG environment variable, if set).
    #[arg(long, value_name = "FILE.json")]
    pub device_config: Option<PathBuf>,
    /// OpenVINO's on-disk model cache: compiled graphs are stored there and later compiles of the same graph, device
    /// and properties load them (reports say which did). Default: on for NPU devices, in `qwen35-parity/ov-cache`
    /// under the user's cache directory; off for the others.
    #[arg(long, value_name = "DIR", conflicts_with = "no_cache")]
    pub cache_dir: Option<PathBuf>,
    /// Compile every graph afresh, with no model cache (even on NPU).
    #[arg(long)]
    pub no_cache: bool,
}

impl GraphArgs {
    /// The options given, by flag.
    fn given(&self) -> Vec<&'static str> {
        [
            ("--precision", self.precision.is_some()),
            ("--block", self.block.is_some()),
            ("--context", self.context.is_some()),
            ("--device-config", self.device_config.is_some()),
            ("--cache-dir", self.cache_dir.is_some()),
            ("--no-cache", self.no_cache),
        ]
        .into_iter()
        .filter_map(|(n, g)| g.then_some(n))
        .collect()
    }
}

/// Where and how a dump is computed.
#[derive(Debug, Clone, Args)]
pub struct DeviceArgs {
    /// Which backend computes the dump.
    #[arg(long, value_enum, default_value = "reference")]
    pub backend: Backend,
    /// OpenVINO device (CPU, NPU, GPU, ...) or `FP16SIM[:options]` (an fp16 accelerator's arithmetic on the same
    /// graphs: store=f16|bf16|f32, ftz=on|off, acc=f32|f16, state=f16|f32, norm=ops|fused). Default CPU.
    #[arg(long)]
    pub device: Option<String>,
    /// The graph and compile options.
    #[command(flatten)]
    pub graph: GraphArgs,
}

impl DeviceArgs {
    /// Fails if an OpenVINO-only option is given to the reference backend.
    pub fn check_reference(&self) -> Result<()> {
        let mut given = self.graph.given();
        if self.device.is_some() {
            given.insert(0, "--device");
        }
        match given.as_slice() {
            [] => Ok(()),
            [one] => bail!("{one} only applies to --backend openvino"),
            many => bail!("{} only apply to --backend openvino", many.join(", ")),
        }
    }
}

impl GraphArgs {
    /// The settings of this project's graphs on `device` (validated; options that do not apply refused by name).
    pub fn settings(&self, device: &str, form: &FormArgs) -> Result<DeviceSettings> {
        let context = self.context.unwrap_or(DEFAULT_CONTEXT);
        if context == 0 {
            bail!("--context must be at least 1");
        }
        // The default block never exceeds a small context; a block given that does is refused.
        let block = self
            .block
            .unwrap_or(npu::engine::DEFAULT_BLOCK.min(context));
        if block == 0 {
            bail!("--block must be at least 1");
        }
        if block > context {
            bail!(
                "--block {block}: a prompt block longer than the static context of {context} (--context) never fits"
            );
        }
        if crate::device::llamacpp::is_llamacpp(device) {
            return self.llamacpp_settings(device, form, context);
        }
        let graph_form = form.graph_form()?;
        if NumericModel::is_sim(device) && self.precision.is_some() {
            bail!(
                "--precision applies to OpenVINO devices; {device}'s arithmetic comes from its options \
                 ({}:store=f16|bf16|f32,ftz=on|off,acc=f32|f16,state=f16|f32,norm=ops|fused)",
                npu::sim::DEVICE
            );
        }
        Ok(DeviceSettings {
            device: device.to_string(),
            block,
            graph: GraphOptions {
                form: graph_form,
                output_scale: form.output_scale(PORT_OUTPUT_SCALE)? as f32,
                context,
                taps: true,
                embeddings_input: false,
                moe: form.moe_form(),
            },
            compile: self.compile(device)?,
        })
    }

    /// llama.cpp's settings: the context alone (`--context`, llama.cpp's context; each call is one batch). The
    /// options of this project's graphs and of OpenVINO are refused by name: llama.cpp builds its own graphs.
    fn llamacpp_settings(
        &self,
        device: &str,
        form: &FormArgs,
        context: usize,
    ) -> Result<DeviceSettings> {
        let refused = [
            ("--precision", self.precision.is_some()),
            ("--block", self.block.is_some()),
            ("--device-config", self.device_config.is_some()),
            ("--cache-dir", self.cache_dir.is_some()),
            (
                "--deltanet-form",
                form.deltanet_form != super::form::PrefillForm::Chunked,
            ),
        ];
        let given = refused
            .into_iter()
            .chain(form.form_flags())
            .find(|(_, g)| *g);
        if let Some((flag, _)) = given {
            bail!(
                "{flag} applies to OpenVINO graphs; {device} runs llama.cpp's own graphs on the GGUF file (its \
                 arithmetic is modelled on the reference by --arithmetic llama-cpp)"
            );
        }
        Ok(DeviceSettings {
            device: device.to_string(),
            block: context,
            graph: GraphOptions {
                context,
                ..GraphOptions::default()
            },
            compile: CompileOptions {
                precision: InferencePrecision::F32,
                device_config: Default::default(),
                cache_dir: None,
            },
        })
    }

    /// The compile options on `device`: `--precision` (f32 by default), `--device-config` and the model cache.
    pub fn compile(&self, device: &str) -> Result<CompileOptions> {
        let precision = self.precision.unwrap_or(InferencePrecision::F32);
        let device_config = device_config(self.device_config.as_deref());
        // The file's error names the file; the flag is named here (the environment variable names itself).
        let device_config = match self.device_config {
            Some(_) => device_config.context("--device-config")?,
            None => device_config?,
        };
        // The precision is --precision's alone: a device configuration asking another one would run it while the
        // report says otherwise.
        if let Some(hint) = device_config.get("INFERENCE_PRECISION_HINT")
            && !hint.eq_ignore_ascii_case(precision.hint())
        {
            let config = match &self.device_config {
                Some(p) => format!("--device-config {}", p.display()),
                None => "QWEN35_DEVICE_CONFIG".to_string(),
            };
            let asked = if self.precision.is_some() {
                "--precision"
            } else {
                "the default --precision"
            };
            bail!(
                "{config} sets INFERENCE_PRECISION_HINT {hint} but {asked} is {}: give the precision with \
                 --precision only",
                precision.hint()
            );
        }
        Ok(CompileOptions {
            precision,
            device_config,
            cache_dir: self.cache_dir(device)?,
        })
    }

    /// The model cache directory for `device`: `--cache-dir`, none with `--no-cache`, else the default one for
    /// devices that cache by default (NPU), else none. FP16SIM compiles nothing: `--cache-dir` is refused for it.
    pub fn cache_dir(&self, device: &str) -> Result<Option<PathBuf>> {
        let sim = NumericModel::is_sim(device);
        if sim && self.cache_dir.is_some() {
            bail!("--cache-dir applies to OpenVINO devices; {device} compiles nothing");
        }
        Ok(match (&self.cache_dir, self.no_cache) {
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

    /// `self` without `--precision` (FP16SIM's arithmetic comes from its options).
    pub fn for_sim(&self) -> GraphArgs {
        GraphArgs {
            precision: None,
            ..self.clone()
        }
    }
}

/// Fails when an option of this project's graphs is given with `--ir DIR` (they do not apply to graphs made
/// elsewhere), naming it.
pub fn refuse_graph_flags(form: &FormArgs, graph: &GraphArgs, ir: &Path) -> Result<()> {
    let not_here = [
        ("--block", graph.block.is_some()),
        ("--context", graph.context.is_some()),
    ];
    let given = form
        .form_flags()
        .into_iter()
        .chain(not_here)
        .find(|(_, g)| *g);
    if let Some((flag, _)) = given {
        bail!(
            "{flag} applies to this project's graphs, not to graphs made elsewhere (--ir {})",
            ir.display()
        );
    }
    Ok(())
}
