//! Random checkpoints with the real shapes of Qwen3.5-9B or Qwen3.5-35B-A3B, written the way the real repository is:
//! a nested `config.json` (`model_type: qwen3_5` or `qwen3_5_moe`, the decoder under `text_config`, a
//! `vision_config`), bf16 safetensors in shards of at most a few GB with a `model.safetensors.index.json`, the
//! decoder under `model.language_model.`, and the vision tower (`model.visual.*`) and multi-token-prediction head
//! (`mtp.*`) the real checkpoint also holds (the decoder never reads them; they are there so that loaders meet the
//! real layout).
//!
//! Values are seeded and deterministic: every tensor draws from its own generator, seeded by the checkpoint's seed and
//! the tensor's name, in fixed blocks of [`BLOCK`] elements that each have their own generator too. Blocks are
//! generated in parallel and written in order, so the files are byte-identical for a seed whatever the thread count.
//! The writer streams: one batch of blocks is in memory at a time, never a whole tensor.
//!
//! Scales (see [`plan::Init`] for each tensor's):
//! - projections `N(0, 1/fan_in)`, so unit-RMS inputs give unit-RMS outputs; `in_proj_a` `N(0, 0.25/fan_in)` (the
//!   per-token spread of the decay around its head's centre);
//! - the embedding `N(0, 1)` and the LM head `N(0, 1/H)` (logits of standard deviation about 1);
//! - zero-centred RMSNorm weights (scale `1 + w`) `N(0, 0.1²)`, the gated norm's plain weight `1 + N(0, 0.1²)`;
//! - the depthwise conv kernel `N(0, 1/K)`;
//! - decays as Mamba-2 initialises them: `A = exp(A_log)` uniform in `[1, 16]`, and `dt_bias` the
//!   inverse softplus of a `dt` log-uniform in `[1e-3, 1e-1]`, so the per-token decay `exp(−A·softplus(a + dt_bias))`
//!   sits between about 0.2 and 0.999 per head;
//! - the vision tower and the MTP head: weights `N(0, 1/fan_in)`, biases `N(0, 0.02²)`, LayerNorm weights
//!   `1 + N(0, 0.1²)`;
//! - the MoE block (Qwen3.5-35B-A3B): the router, every expert's and the shared expert's projections and the shared
//!   expert's gate `N(0, 1/fan_in)` like any projection (router logits of unit spread; each expert's output near
//!   unit RMS, and their weighted sum, whose weights sum to 1, no larger).
//!
//! [`Arch::Qwen35_9b`] is the real model (SPEC: hidden 4096, FFN 12288, vocab 248320, 16 q / 4 kv heads of 256 with
//! a rotary dim of 64, 16 key / 32 value heads of 128 in the linear layers, conv kernel 4, eps 1e-6) with any number
//! of layers in the real pattern (L L L F repeated); [`Arch::Qwen35_35bA3b`] the MoE one (hidden 2048, 2 kv heads,
//! 256 experts of width 512, 8 per token, a shared expert of width 512; the rest as the 9B), its experts stored
//! fused in the decoder and one by one in the MTP layer as the released checkpoint has them ([`plan()`]);
//! [`Arch::Tiny`] and [`Arch::TinyMoe`] are the same structures at toy sizes, for tests.

pub mod arch;
pub mod plan;
pub mod write;

pub use arch::Arch;
pub use plan::{Init, TensorPlan, config_json, plan};
pub use write::{Shard, Summary, planned_bytes, shards, write_checkpoint};

/// Elements per independently seeded block of a tensor (64 Ki).
pub const BLOCK: usize = 1 << 16;

/// The largest shard the writer fills by default, in bytes (5 GB, as `save_pretrained` shards by default).
pub const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;

/// What to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthOptions {
    /// The model's architecture and dimensions.
    pub arch: Arch,
    /// Decoder layers (the pattern L L L F repeated, cut after this many).
    pub layers: usize,
    /// The seed of every value.
    pub seed: u64,
    /// The largest shard in bytes (a tensor larger than this gets a shard of its own).
    pub shard_bytes: u64,
}
