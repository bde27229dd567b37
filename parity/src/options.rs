//! Command-line options shared by the subcommands, turned into validated run settings before any work starts.

use anyhow::{Result, bail};
use candle_core::DType;
use clap::{Args, ValueEnum};
use reference::deltanet::{Form, Inverse};
use reference::model::RunOptions;
use std::path::PathBuf;

/// The bundled tiny model, used when `--model` is not given.
pub fn bundled_model() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/models/tiny"
    ))
}

/// Precision of a reference run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    /// 32-bit floats (the default).
    F32,
    /// 64-bit floats: the high-precision ground truth.
    F64,
}

impl Precision {
    /// The tensor dtype.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::F64 => DType::F64,
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

/// Which model, in which precision.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Checkpoint directory (config.json, safetensors, tokenizer). Default: the bundled tiny model.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Precision of the reference run.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: Precision,
}

impl ModelArgs {
    /// The model directory, checked to exist.
    pub fn dir(&self) -> Result<PathBuf> {
        let dir = self.model.clone().unwrap_or_else(bundled_model);
        if !dir.join("config.json").exists() {
            match &self.model {
                Some(d) => bail!("--model {}: no config.json in this directory", d.display()),
                None => bail!(
                    "the bundled model is missing ({}); pass --model DIR",
                    dir.display()
                ),
            }
        }
        Ok(dir)
    }
}

/// How the reference computes (none of these change the result in exact arithmetic).
#[derive(Debug, Clone, Args)]
pub struct FormArgs {
    /// Delta-rule form for the prompt.
    #[arg(long, value_enum, default_value = "chunked")]
    pub deltanet_form: PrefillForm,
    /// Tokens per chunk of the chunked form.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub chunk: usize,
    /// Triangular inverse of the chunked form.
    #[arg(long, value_enum, default_value = "substitution")]
    pub inverse: InverseArg,
    /// Delta-rule form for single-token decode.
    #[arg(long, value_enum, default_value = "matrix")]
    pub decode_form: DecodeForm,
    /// Feed the prompt in forward calls of at most N tokens (state carried between them).
    #[arg(long, value_name = "N")]
    pub prefill_block: Option<usize>,
    /// DeltaNet output rescaling: q times S inside the recurrence, gated-norm eps times S² (1 = off; the NPU uses 1024).
    #[arg(long, default_value_t = 1.0, value_name = "S")]
    pub output_scale: f64,
}

impl FormArgs {
    /// The validated run options.
    pub fn run_options(&self) -> Result<RunOptions> {
        if self.chunk == 0 {
            bail!("--chunk must be at least 1");
        }
        if self.prefill_block == Some(0) {
            bail!("--prefill-block must be at least 1");
        }
        if !(self.output_scale.is_finite() && self.output_scale > 0.0) {
            bail!(
                "--output-scale must be a positive number, got {}",
                self.output_scale
            );
        }
        let inverse = match self.inverse {
            InverseArg::Substitution => Inverse::Substitution,
            InverseArg::Doubling => Inverse::Doubling,
            InverseArg::Series => Inverse::Series,
        };
        Ok(RunOptions {
            prefill: match self.deltanet_form {
                PrefillForm::Sequential => Form::Sequential,
                PrefillForm::Matrix => Form::Matrix,
                PrefillForm::Chunked => Form::Chunked {
                    block: self.chunk,
                    inverse,
                },
            },
            decode: match self.decode_form {
                DecodeForm::Sequential => Form::Sequential,
                DecodeForm::Matrix => Form::Matrix,
            },
            prefill_block: self.prefill_block,
            output_scale: self.output_scale,
        })
    }
}

/// Parses `--token-ids 1,2,3`.
pub fn parse_token_ids(text: &str) -> Result<Vec<u32>> {
    let ids = text
        .split(',')
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
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
