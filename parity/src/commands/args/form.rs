//! How the reference and the graphs compute (`--deltanet-form`, `--chunk`, `--inverse`, `--decode-form`,
//! `--prefill-block`, `--output-scale`, `--moe-form`, `--arithmetic`): the reference's run options, or the graphs' forms, each
//! refusing the options that do not apply.

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use npu::graphs::{DeltaNetGraphForm, MoeGraphForm};
use reference::config::Config;
use reference::deltanet::{DEFAULT_CHUNK, Form, Inverse};
use reference::gguf::arith::Arithmetic;
use reference::model::RunOptions;
use reference::weights::WeightStore;
use std::path::Path;

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
    /// Reference only, GGUF models: `llama-cpp` models llama.cpp's CPU arithmetic on the file's ggml types (each
    /// product's activations rounded through the weight's vec_dot type, an f16 KV cache, flash attention with an
    /// f16 accumulator: docs/llamacpp.md); default `reference` (f32 products, f32 cache).
    #[arg(long, value_enum)]
    pub arithmetic: Option<ArithmeticArg>,
}

/// How the reference computes on a GGUF's weights (`--arithmetic`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ArithmeticArg {
    /// The reference's own f32 arithmetic.
    Reference,
    /// llama.cpp's CPU back end.
    LlamaCpp,
}

impl FormArgs {
    /// Each option of the DeltaNet and MoE forms that has a value only when given, and whether it was given: what a
    /// device that builds no graphs of this project refuses by name.
    pub fn form_flags(&self) -> [(&'static str, bool); 6] {
        [
            ("--chunk", self.chunk.is_some()),
            ("--inverse", self.inverse.is_some()),
            ("--decode-form", self.decode_form.is_some()),
            ("--prefill-block", self.prefill_block.is_some()),
            ("--output-scale", self.output_scale.is_some()),
            ("--moe-form", self.moe_form.is_some()),
        ]
    }

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

    /// Sets `--arithmetic` on the reference's weights: `llama-cpp` is refused, naming the flag, unless `store` holds a
    /// GGUF file's weights in their own types in f32.
    pub fn apply_arithmetic(&self, store: &mut WeightStore) -> Result<()> {
        let arithmetic = match self.arithmetic {
            None | Some(ArithmeticArg::Reference) => Arithmetic::Reference,
            Some(ArithmeticArg::LlamaCpp) => Arithmetic::LlamaCpp,
        };
        store
            .set_arithmetic(arithmetic)
            .map_err(|e| anyhow::anyhow!("--{e}"))
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
        if self.arithmetic.is_some() {
            bail!(
                "--arithmetic applies to the reference (it models llama.cpp's CPU there); OpenVINO graphs compute \
                 as their --precision says"
            );
        }
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

    /// Fails when `--moe-form` is given with a model that has no experts (`dir`'s `config`), naming both: the one
    /// check of the flag against the model, made where a command opens the model for its forms
    /// ([`super::ModelArgs::open_for`]).
    pub(super) fn check_model(&self, dir: &Path, config: &Config) -> Result<()> {
        if self.moe_form.is_some() && config.moe.is_none() {
            bail!(
                "--moe-form applies to MoE models; the model {} is dense (its config.json names no experts)",
                dir.display()
            );
        }
        Ok(())
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
