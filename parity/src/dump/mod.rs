//! The dump: one safetensors file per run holding the prompt, every intermediate, the states after the prompt and
//! the greedy continuation, under names every backend shares.

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

pub mod layout;
pub mod llamacpp;
mod run;
pub mod stream;

pub use run::{ImageDump, POSITIONS, Written, run_dump, write_dump, write_image_dump};

/// The tensors of a dump and what they hold (`T` prompt tokens, `H` hidden size, `V` vocabulary, `N` generated
/// tokens, `C = 2·Hk·Dk + Hv·Dv` conv channels, `K` conv width). Floats are in the run's dtype (f32, or f64 for a
/// `--dtype f64` run).
pub const FORMAT: &str = "\
DUMP FORMAT (safetensors; T prompt tokens, H hidden, V vocabulary, N generated)
  token_ids                       i64 [T]        the prompt
  embeddings                      [T, H]         token embeddings
  layers.{i}.output               [T, H]         residual stream after layer i (before the final norm)
  layers.{i}.mixer_output         [T, H]         linear_attn / self_attn output, before the residual add
  layers.{i}.mlp_output           [T, H]         MLP output, before the residual add
  final_norm                      [T, H]         after the final RMSNorm
  logits                          [T, V]         every prompt position
  generated                       i64 [N]        greedy continuation (N tokens; fewer when a NaN stops it: nan_at)
 linear-attention layers (Gated DeltaNet; Hk/Hv key/value heads, Dk/Dv head dims, C = 2 Hk Dk + Hv Dv, K conv width):
  layers.{i}.linear_attn.qkv      [T, C]         in_proj_qkv output, before the conv
  layers.{i}.linear_attn.z        [T, Hv, Dv]    in_proj_z output (the gated norm's gate)
  layers.{i}.linear_attn.b        [T, Hv]        in_proj_b output, before the sigmoid
  layers.{i}.linear_attn.a        [T, Hv]        in_proj_a output, before the softplus
  layers.{i}.linear_attn.conv_output [T, C]      the causal conv's output, before the SiLU
  layers.{i}.linear_attn.query    [T, Hk, Dk]    after conv + SiLU, before the l2 norm
  layers.{i}.linear_attn.key      [T, Hk, Dk]
  layers.{i}.linear_attn.value    [T, Hv, Dv]
  layers.{i}.linear_attn.g        [T, Hv]        log-decay
  layers.{i}.linear_attn.beta     [T, Hv]
  layers.{i}.linear_attn.query_normed [T, Hk, Dk] after the l2 norm (before the Dk^-0.5 and output scaling)
  layers.{i}.linear_attn.key_normed [T, Hk, Dk]  after the l2 norm
  layers.{i}.linear_attn.core_output [T, Hv, Dv] delta-rule output before the gated norm (unscaled)
  layers.{i}.linear_attn.gated_norm_output [T, Hv, Dv] the gated norm's output (out_proj input)
  layers.{i}.conv_state           [C, K]         last K conv inputs after the prompt
  layers.{i}.recurrent_state      [Hv, Dk, Dv]   delta-rule state after the prompt
 full-attention layers (Hq/Hkv heads, D head dim):
  layers.{i}.self_attn.query      [T, Hq, D]     after q_norm and RoPE
  layers.{i}.self_attn.key        [T, Hkv, D]    after k_norm and RoPE
  layers.{i}.self_attn.value      [T, Hkv, D]
  layers.{i}.self_attn.gate       [T, Hq*D]      output gate before the sigmoid
  layers.{i}.self_attn.gated_output [T, Hq*D]    o_proj input (attention times sigmoid(gate))
  layers.{i}.key_cache            [Hkv, T, D]    keys after q/k norm and RoPE
  layers.{i}.value_cache          [Hkv, T, D]
 an MoE block in place of the MLP (E experts, k per token):
  layers.{i}.mlp.router_logits    [T, E]         the router's logits, before the softmax
  layers.{i}.mlp.experts_chosen   i64 [T, k]     the chosen experts, in descending probability (diff scores routing)
  layers.{i}.mlp.expert_weights   [T, k]         their weights, renormalised over the k
  layers.{i}.mlp.shared_output    [T, H]         the shared expert times its gate
Metadata (strings): backend, dtype, weights, deltanet_prefill, deltanet_decode, output_scale, model, prompt,
prompt_seconds, decode_seconds, nan_at (the generated token whose logits held a NaN, when one stopped the
generation); the reference adds prefill_block; OpenVINO adds openvino (version), device, precision_requested,
precision (read back), execution_devices, property.* (every property set, read back), block, context,
compile_seconds. A dump written by another program needs only the tensors it has; comparisons use the
names both sides hold.";

/// A dump in memory (as [`Dump::read`] gives it; `qwen35 dump` writes its file as the run goes, [`write_dump`]).
#[derive(Debug, Default)]
pub struct Dump {
    /// Tensors by name (see [`FORMAT`]).
    pub tensors: BTreeMap<String, Tensor>,
    /// Run description.
    pub metadata: BTreeMap<String, String>,
}

impl Dump {
    /// Writes the dump.
    pub fn write(&self, path: &Path) -> Result<()> {
        reference::io::save_safetensors(path, &self.tensors, &self.metadata)
            .with_context(|| format!("writing the dump {}", path.display()))
    }

    /// Reads a dump written by any backend.
    pub fn read(path: &Path) -> Result<Self> {
        // The file is read whole and its tensors copied out of it: twice its size, known before either.
        let size = std::fs::metadata(path)
            .with_context(|| format!("reading {}", path.display()))?
            .len();
        crate::memory::need(
            &format!(
                "the dump {} ({size} bytes, read and its tensors)",
                path.display()
            ),
            size.saturating_mul(2),
        )?;
        let bytes =
            reference::inputs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| anyhow::anyhow!("{}: not a safetensors dump: {e}", path.display()))?;
        let metadata = meta
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        // Every layer up to the highest a name mentions is walked by a comparison: that many, checked before.
        if let Some((name, layer)) = meta
            .tensors()
            .into_keys()
            .filter_map(|k| Some((k.clone(), layer_of(&k)?)))
            .max_by_key(|(_, l)| *l)
        {
            crate::memory::need(
                &format!(
                    "{}: `{name}` names layer {layer}, so a comparison walks {} layers",
                    path.display(),
                    layer.saturating_add(1)
                ),
                LAYER_BYTES.saturating_mul(layer.saturating_add(1)),
            )?;
        }
        let tensors: BTreeMap<String, Tensor> =
            candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
                .with_context(|| format!("{}: reading tensors", path.display()))?
                .into_iter()
                .collect();
        // A dump written from llama.cpp's evaluation callback: its names mapped to the dump's, here and only here.
        if llamacpp::is_llamacpp(&tensors) {
            let (tensors, metadata) = llamacpp::convert(path, tensors, metadata)?;
            return Ok(Dump { tensors, metadata });
        }
        Ok(Dump { tensors, metadata })
    }

    /// The tensor called `name`, or an error naming the dump.
    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .with_context(|| format!("the dump has no tensor `{name}`"))
    }
}

/// What a comparison holds for each layer up to the highest a dump names, whatever the dump holds of it: the
/// layer's kind, its rows of the report and their names (an upper bound).
const LAYER_BYTES: u64 = 1024;

/// The layer a dump's tensor name is of (`layers.{i}.…`), as a number that may be beyond any model (`u64`: an index
/// too large even for that is refused by the caller's checks as no layer at all).
pub fn layer_of(name: &str) -> Option<u64> {
    name.strip_prefix("layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// Token ids as an i64 tensor (the dump's type for ids).
pub fn id_tensor(ids: &[u32]) -> Result<Tensor> {
    let v: Vec<i64> = ids.iter().map(|&x| x as i64).collect();
    Ok(Tensor::from_vec(v, ids.len(), &Device::Cpu)?)
}
