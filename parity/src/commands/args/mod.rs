//! Command-line options shared by the subcommands, and their conversion into the plain settings the library below
//! `commands/` takes (no clap type leaves this module's commands): validated before any work starts.

mod prompt;

pub use prompt::{ImageArgs, PromptArgs};

use crate::compare::ThresholdOverrides;
use crate::device::DeviceSettings;
use crate::probe::Mode;
use crate::report::Outputs;
use anyhow::{Context, Result, bail};
use candle_core::DType;
use clap::{Args, ValueEnum};
use npu::devices::{CompileOptions, InferencePrecision, device_config};
use npu::graphs::{DEFAULT_CONTEXT, DeltaNetGraphForm, GraphOptions, MoeGraphForm};
use npu::sim::NumericModel;
use reference::config::Config;
use reference::deltanet::{DEFAULT_CHUNK, Form, Inverse};
use reference::linear_attn::PORT_OUTPUT_SCALE;
use reference::model::{Model, RunOptions};
use reference::quant::WeightFormat;
use reference::weights::WeightStore;
use std::path::{Path, PathBuf};

/// The dtype a reference run computes in (`--dtype`). (Not a device's inference precision, which is `--precision`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dtype {
    /// 32-bit floats (the default).
    F32,
    /// 64-bit floats: the high-precision ground truth.
    F64,
}

impl Dtype {
    /// The tensor dtype.
    pub fn dtype(self) -> DType {
        match self {
            Dtype::F32 => DType::F32,
            Dtype::F64 => DType::F64,
        }
    }
}

/// Delta-rule form of prompt (multi-token) forward calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrefillForm {
    /// Token by token, as written.
    Sequential,
    /// Token by token in the single-token matrix form.
    Matrix,
    /// Chunkwise parallel (see `--chunk`, `--inverse`).
    Chunked,
    /// OpenVINO only: one Loop op stepping token by token, as the optimum-intel export has it (CPU; not NPU).
    Loop,
}

/// Delta-rule form of single-token decode calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DecodeForm {
    /// The recurrence as written.
    Sequential,
    /// The NPU decoder's matrix form.
    Matrix,
}

/// How an MoE block's routed experts run in OpenVINO prompt-block graphs (one token always gathers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MoeFormArg {
    /// Gather where experts are many against the chosen (E ≥ 16·k, as the 35B-A3B's 256 and 8), else masked.
    Auto,
    /// The chosen experts' matrices gathered by index, per token and rank.
    Gather,
    /// Every expert on every token, masked by the routing (optimum-intel's exported form).
    Masked,
}

/// Triangular inverse of the chunked form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum InverseArg {
    /// Forward substitution (transformers' algorithm).
    Substitution,
    /// Exact block doubling (the NPU port's).
    Doubling,
    /// The (I − N)(I + N²)… series (unstable in fp16).
    Series,
}

/// Which model, in which precision, with which weights.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Checkpoint directory (config.json, safetensors, tokenizer). Default: the bundled tiny model.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Precision of the reference run.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: Dtype,
    /// Weights as stored: f32 (as in the checkpoint), f16, or int4 (symmetric, group 128, int8 backup; `int4:G` for
    /// another group); `int4-nncf[:G]` also gives the DeltaNet conv weights the int8 backup, as NNCF does to an
    /// optimum-intel export. The reference runs the same quantized weights, dequantized exactly.
    #[arg(long, default_value = "f32", value_parser = parse_weights, value_name = "f32|f16|int4[:G]|int4-nncf[:G]")]
    pub weights: WeightFormat,
}

fn parse_weights(s: &str) -> std::result::Result<WeightFormat, String> {
    WeightFormat::parse(s).map_err(|e| e.to_string())
}

fn parse_precision(s: &str) -> std::result::Result<InferencePrecision, String> {
    InferencePrecision::parse(s).map_err(|e| e.to_string())
}

impl ModelArgs {
    /// Reads the config and opens the weights in the chosen format.
    pub fn open(&self) -> Result<(PathBuf, Config, WeightStore)> {
        let dir = self.dir()?;
        let config = Config::from_file(&dir.join("config.json"))?;
        let store = WeightStore::open_with_format(&dir, self.dtype.dtype(), self.weights)?;
        Ok((dir, config, store))
    }

    /// [`ModelArgs::open`], and the reference model on those weights.
    pub fn load(&self) -> Result<(PathBuf, Config, WeightStore, Model)> {
        let (dir, config, store) = self.open()?;
        let model = Model::from_weights(config.clone(), &store)?;
        Ok((dir, config, store, model))
    }

    /// The model directory, checked to hold a config: `--model`, or the bundled tiny model.
    pub fn dir(&self) -> Result<PathBuf> {
        match &self.model {
            Some(d) if d.join("config.json").is_file() => Ok(d.clone()),
            Some(d) if !d.exists() => bail!("--model {}: no such directory", d.display()),
            Some(d) if !d.is_dir() => bail!(
                "--model {}: a file; --model takes the checkpoint's directory (the one holding config.json)",
                d.display()
            ),
            Some(d) => bail!("--model {}: no config.json in this directory", d.display()),
            None => crate::bundled::model_dir(),
        }
    }
}

/// How the reference computes (none of these change the result in exact arithmetic).
#[derive(Debug, Clone, Args)]
pub struct FormArgs {
    /// Delta-rule form for the prompt (OpenVINO: matrix, chunked or loop).
    #[arg(long, value_enum, default_value = "chunked")]
    pub deltanet_form: PrefillForm,
    /// Reference only: tokens per chunk of the chunked form (default 64, transformers' chunk size; an OpenVINO chunk
    /// is the whole --block).
    #[arg(long, value_name = "N")]
    pub chunk: Option<usize>,
    /// Triangular inverse of the chunked form. Default: substitution on the reference (transformers' algorithm),
    /// doubling on OpenVINO (the NPU port's).
    #[arg(long, value_enum)]
    pub inverse: Option<InverseArg>,
    /// Reference only: delta-rule form for single-token decode (default matrix; OpenVINO decodes in the matrix form).
    #[arg(long, value_enum)]
    pub decode_form: Option<DecodeForm>,
    /// Reference only: feed the prompt in forward calls of at most N tokens (state carried between them).
    #[arg(long, value_name = "N")]
    pub prefill_block: Option<usize>,
    /// DeltaNet output rescaling: q times S inside the recurrence, gated-norm eps times S² (1 = off). Default: 1 on
    /// the reference, 1024 on OpenVINO (as the NPU port).
    #[arg(long, value_name = "S")]
    pub output_scale: Option<f64>,
    /// OpenVINO only, MoE models: how prompt blocks run the routed experts (one token always gathers). Default
    /// auto: gathered when the experts number at least 16 times the chosen, masked otherwise.
    #[arg(long, value_enum)]
    pub moe_form: Option<MoeFormArg>,
}

impl FormArgs {
    /// The validated run options.
    pub fn run_options(&self) -> Result<RunOptions> {
        let chunk = self.chunk.unwrap_or(DEFAULT_CHUNK);
        if chunk == 0 {
            bail!("--chunk must be at least 1");
        }
        if self.deltanet_form != PrefillForm::Chunked
            && (self.chunk.is_some() || self.inverse.is_some())
        {
            bail!("--chunk and --inverse apply to --deltanet-form chunked");
        }
        if self.prefill_block == Some(0) {
            bail!("--prefill-block must be at least 1");
        }
        if self.moe_form.is_some() {
            bail!(
                "--moe-form applies to OpenVINO graphs; the reference runs each token's chosen experts only"
            );
        }
        let output_scale = self.output_scale(1.0)?;
        let inverse = self.inverse(Inverse::Substitution);
        Ok(RunOptions {
            prefill: match self.deltanet_form {
                PrefillForm::Loop => {
                    bail!(
                        "--deltanet-form loop is an OpenVINO graph form; the reference's token loop is `sequential`"
                    )
                }
                PrefillForm::Sequential => Form::Sequential,
                PrefillForm::Matrix => Form::Matrix,
                PrefillForm::Chunked => Form::Chunked {
                    block: chunk,
                    inverse,
                },
            },
            decode: match self.decode_form.unwrap_or(DecodeForm::Matrix) {
                DecodeForm::Sequential => Form::Sequential,
                DecodeForm::Matrix => Form::Matrix,
            },
            prefill_block: self.prefill_block,
            output_scale,
        })
    }

    /// `--output-scale`, or `default`, validated.
    pub fn output_scale(&self, default: f64) -> Result<f64> {
        let s = self.output_scale.unwrap_or(default);
        reference::linear_attn::check_output_scale(s)
            .map_err(|e| anyhow::anyhow!("--output-scale: {e}"))?;
        Ok(s)
    }

    /// The DeltaNet form of OpenVINO graphs (`--deltanet-form` matrix, chunked or loop; chunked uses `--inverse`,
    /// block doubling by default). Reference-only options are refused.
    pub fn graph_form(&self) -> Result<DeltaNetGraphForm> {
        if self.prefill_block.is_some() {
            bail!(
                "--prefill-block applies to the reference; OpenVINO prompts run in blocks of --block"
            );
        }
        if self.chunk.is_some() {
            bail!(
                "--chunk applies to the reference; an OpenVINO chunk is the whole block (--block)"
            );
        }
        if self.decode_form.is_some_and(|d| d != DecodeForm::Matrix) {
            bail!("--decode-form: OpenVINO decode graphs use the matrix form");
        }
        if self.deltanet_form != PrefillForm::Chunked && self.inverse.is_some() {
            bail!("--inverse applies to --deltanet-form chunked");
        }
        Ok(match self.deltanet_form {
            PrefillForm::Chunked => DeltaNetGraphForm::Chunked(self.inverse(Inverse::Doubling)),
            PrefillForm::Matrix => DeltaNetGraphForm::Matrix,
            PrefillForm::Loop => DeltaNetGraphForm::Loop,
            PrefillForm::Sequential => bail!(
                "--deltanet-form sequential is the reference's oracle; OpenVINO graphs use matrix, chunked or loop"
            ),
        })
    }

    /// `--moe-form` (auto by default) as the graphs take it.
    pub fn moe_form(&self) -> MoeGraphForm {
        match self.moe_form {
            None | Some(MoeFormArg::Auto) => MoeGraphForm::Auto,
            Some(MoeFormArg::Gather) => MoeGraphForm::Gather,
            Some(MoeFormArg::Masked) => MoeGraphForm::Masked,
        }
    }

    /// `--inverse`, or `default`.
    pub fn inverse(&self, default: Inverse) -> Inverse {
        match self.inverse {
            None => default,
            Some(InverseArg::Substitution) => Inverse::Substitution,
            Some(InverseArg::Doubling) => Inverse::Doubling,
            Some(InverseArg::Series) => Inverse::Series,
        }
    }
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
        ("--chunk", form.chunk.is_some()),
        ("--inverse", form.inverse.is_some()),
        ("--decode-form", form.decode_form.is_some()),
        ("--prefill-block", form.prefill_block.is_some()),
        ("--output-scale", form.output_scale.is_some()),
        ("--moe-form", form.moe_form.is_some()),
        ("--block", graph.block.is_some()),
        ("--context", graph.context.is_some()),
    ];
    if let Some((flag, _)) = not_here.iter().find(|(_, given)| *given) {
        bail!(
            "{flag} applies to this project's graphs, not to graphs made elsewhere (--ir {})",
            ir.display()
        );
    }
    Ok(())
}

impl ModelArgs {
    /// A set made elsewhere (`--ir DIR`) and the checkpoint the reference runs against it: `--model`, else the one
    /// the set's manifest names, else the bundled model.
    pub fn open_set(&self, dir: &Path) -> Result<crate::device::set::SetSource> {
        let set = npu::graphset::manifest::open(dir)
            .map_err(|e| anyhow::Error::new(e).context(format!("--ir {}", dir.display())))?;
        if self.model.is_none()
            && let Some(m) = &set.model
            && !m.join("config.json").is_file()
        {
            bail!(
                "--ir {}: {}'s `model` is {}, which holds no config.json; fix it or give --model",
                dir.display(),
                set.source,
                m.display()
            );
        }
        let model = ModelArgs {
            model: self.model.clone().or(set.model.clone()),
            ..self.clone()
        };
        let (checkpoint, config, store) = model.open()?;
        Ok(crate::device::set::SetSource::new(
            dir, set, checkpoint, config, store,
        ))
    }
}

/// Thresholds: each overrides the default for the precision that ran (see `Thresholds::for_precision`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ThresholdArgs {
    /// Largest NMSE of the teacher-forced logits (default 1e-8 at f32, 1e-2 at f16/bf16).
    #[arg(long, value_name = "X")]
    pub max_nmse: Option<f64>,
    /// Largest mean KL(P_ref ‖ P_device) in nats (default 1e-6 at f32, 5e-2 at f16/bf16).
    #[arg(long, value_name = "X")]
    pub max_kl: Option<f64>,
    /// Smallest share of teacher-forced positions with the same top token (default 1 at f32, 0.9 at f16/bf16).
    #[arg(long, value_name = "X")]
    pub min_token_agreement: Option<f64>,
    /// Most teacher-forced disagreements at confident positions (default 0).
    #[arg(long, value_name = "N")]
    pub max_confident_flips: Option<usize>,
    /// Largest NRMSE of a layer's output, over the run and at any position (default 1e-4 at f32, 5e-2 at f16/bf16).
    #[arg(long, value_name = "X")]
    pub max_layer_nrmse: Option<f64>,
    /// Largest NRMSE of a state after the prompt (default 1e-4 at f32, 5e-2 at f16/bf16).
    #[arg(long, value_name = "X")]
    pub max_state_nrmse: Option<f64>,
    /// MoE: a router probability error the device's router logits do not show (all of it when it outputs none),
    /// added to the measured one to classify routing flips: a near tie when the reference's gap is within twice
    /// the total (default: the measured error alone; without router logits, unclassified).
    #[arg(long, value_name = "P")]
    pub router_tolerance: Option<f64>,
}

impl ThresholdArgs {
    /// The thresholds given, validated.
    pub fn overrides(&self) -> Result<ThresholdOverrides> {
        let o = ThresholdOverrides {
            max_nmse: self.max_nmse,
            max_kl: self.max_kl,
            min_token_agreement: self.min_token_agreement,
            max_confident_flips: self.max_confident_flips,
            max_layer_nrmse: self.max_layer_nrmse,
            max_state_nrmse: self.max_state_nrmse,
            router_tolerance: self.router_tolerance,
        };
        o.validate()?;
        Ok(o)
    }
}

/// Where the reports go.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ReportArgs {
    /// Write the report as JSON (stable keys, `schema_version`).
    #[arg(long, value_name = "FILE.json")]
    pub json: Option<PathBuf>,
    /// Write the report as Markdown (machine, versions, what ran, every table), to paste into a bug report.
    #[arg(long, value_name = "FILE.md")]
    pub report: Option<PathBuf>,
    /// Draw the error per layer and per position as an SVG chart.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

impl ReportArgs {
    /// The outputs asked for (checked at the command's start with its other paths: see
    /// [`crate::outputs::DeclarePaths`]).
    pub fn outputs(&self) -> Result<Outputs> {
        Ok(Outputs {
            json: self.json.clone(),
            report: self.report.clone(),
            plot: self.plot.clone(),
        })
    }
}

/// How the probe feeds the layers (`--mode`, `--probe-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// Each block gets the reference's input and incoming state.
    Isolated,
    /// Each layer gets the device's own output of the layer before and carries its own state.
    Chained,
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Mode {
        match m {
            ModeArg::Isolated => Mode::Isolated,
            ModeArg::Chained => Mode::Chained,
        }
    }
}

/// Two positive sizes written `AxB` (`x` or `X` between), as `flag` takes them; `example` shows the form in the
/// error (`HxW in patches, e.g. 32x32`).
pub fn parse_pair(flag: &str, text: &str, example: &str) -> Result<(usize, usize)> {
    let parse = |x: &str| x.trim().parse::<usize>().ok().filter(|&n| n > 0);
    match text
        .split_once(['x', 'X'])
        .map(|(a, b)| (parse(a), parse(b)))
    {
        Some((Some(a), Some(b))) => Ok((a, b)),
        _ => bail!("{flag} {text}: expected {example}"),
    }
}
