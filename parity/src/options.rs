//! Command-line options shared by the subcommands, turned into validated run settings before any work starts.

use anyhow::{Context, Result, bail};
use candle_core::DType;
use clap::{Args, ValueEnum};
use npu::devices::InferencePrecision;
use npu::graphs::DeltaNetGraphForm;
use reference::config::Config;
use reference::deltanet::{DEFAULT_CHUNK, Form, Inverse};
use reference::model::{Model, RunOptions};
use reference::quant::WeightFormat;
use reference::tokenizer::{ChatTokenizer, Message};
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
            Some(d) if d.join("config.json").exists() => Ok(d.clone()),
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

/// One chat prompt: the user message, an optional system message, thinking mode.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct ChatPrompt {
    /// The user message.
    pub prompt: String,
    /// An optional system message.
    #[serde(default)]
    pub system: Option<String>,
    /// Thinking mode (the template's `enable_thinking`).
    #[serde(default)]
    pub think: bool,
}

impl ChatPrompt {
    /// The messages, system first.
    pub fn messages(&self) -> Vec<Message> {
        let mut m = Vec::new();
        if let Some(s) = &self.system {
            m.push(Message::new("system", s));
        }
        m.push(Message::new("user", &self.prompt));
        m
    }

    /// The token ids through the checkpoint's tokenizer and chat template.
    pub fn encode(&self, dir: &Path) -> Result<Vec<u32>> {
        let tok = ChatTokenizer::load(dir)?;
        Ok(tok.encode_chat(&self.messages(), self.think)?)
    }
}

/// The prompt of a run: token ids, or a chat message formatted with the checkpoint's template.
#[derive(Debug, Clone, Args)]
pub struct PromptArgs {
    /// The prompt as token ids, comma separated.
    #[arg(long, value_name = "1,2,3", conflicts_with = "prompt")]
    pub token_ids: Option<String>,
    /// The prompt as a user message, formatted with the checkpoint's chat template.
    #[arg(long)]
    pub prompt: Option<String>,
    /// An optional system message before --prompt.
    #[arg(long, requires = "prompt")]
    pub system: Option<String>,
    /// Thinking mode for --prompt.
    #[arg(long, requires = "prompt")]
    pub think: bool,
}

impl PromptArgs {
    /// Whether a prompt was given.
    pub fn given(&self) -> bool {
        self.token_ids.is_some() || self.prompt.is_some()
    }

    /// The token ids (checked against the vocabulary) and the prompt text if any.
    pub fn ids(&self, dir: &Path, config: &Config) -> Result<(Vec<u32>, Option<String>)> {
        let (ids, text) = match (&self.token_ids, &self.prompt) {
            (Some(t), _) => (parse_token_ids(t)?, None),
            (None, Some(p)) => {
                let chat = ChatPrompt {
                    prompt: p.clone(),
                    system: self.system.clone(),
                    think: self.think,
                };
                (chat.encode(dir)?, Some(p.clone()))
            }
            (None, None) => bail!("give the prompt as --prompt TEXT or --token-ids LIST"),
        };
        config.check_token_ids(&ids).context("--token-ids")?;
        Ok((ids, text))
    }
}

/// Parses `--token-ids 1,2,3`.
pub fn parse_token_ids(text: &str) -> Result<Vec<u32>> {
    let ids = text
        .split(',')
        .map(str::trim)
        .map(|s| {
            s.parse::<u32>()
                .map_err(|_| anyhow::anyhow!("--token-ids: `{s}` is not a token id"))
        })
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("--token-ids: no ids given");
    }
    Ok(ids)
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
    /// OpenVINO device (CPU, NPU, GPU, ...) or FP16SIM[:options] (an fp16 accelerator's arithmetic on the same
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
