//! The dump: one safetensors file per run holding the prompt, every intermediate, the states after the prompt and
//! the greedy continuation, under names every backend shares.

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor};
use reference::model::{Model, RunOptions, greedy_continue};
use reference::taps::Taps;
use std::collections::BTreeMap;
use std::path::Path;

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
  generated                       i64 [N]        greedy continuation (exactly N tokens, no early stop)
 linear-attention layers (Gated DeltaNet; Hk/Hv key/value heads, Dk/Dv head dims, C = 2 Hk Dk + Hv Dv, K conv width):
  layers.{i}.linear_attn.query    [T, Hk, Dk]    after conv + SiLU, before the l2 norm
  layers.{i}.linear_attn.key      [T, Hk, Dk]
  layers.{i}.linear_attn.value    [T, Hv, Dv]
  layers.{i}.linear_attn.g        [T, Hv]        log-decay
  layers.{i}.linear_attn.beta     [T, Hv]
  layers.{i}.linear_attn.core_output [T, Hv, Dv] delta-rule output before the gated norm (unscaled)
  layers.{i}.conv_state           [C, K]         last K conv inputs after the prompt
  layers.{i}.recurrent_state      [Hv, Dk, Dv]   delta-rule state after the prompt
 full-attention layers (Hq/Hkv heads, D head dim):
  layers.{i}.self_attn.gated_output [T, Hq*D]    o_proj input (attention times sigmoid(gate))
  layers.{i}.key_cache            [Hkv, T, D]    keys after q/k norm and RoPE
  layers.{i}.value_cache          [Hkv, T, D]
Metadata (strings): backend, dtype, weights, deltanet_prefill, deltanet_decode, output_scale, model, prompt; the
reference adds prefill_block; OpenVINO adds openvino (version), device, precision_requested, precision (read back),
execution_devices, property.* (every property set, read back), block, context, compile_seconds, run_seconds.";

/// A dump in memory.
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
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| anyhow::anyhow!("{}: not a safetensors dump: {e}", path.display()))?;
        let metadata = meta
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
            .with_context(|| format!("{}: reading tensors", path.display()))?
            .into_iter()
            .collect();
        Ok(Dump { tensors, metadata })
    }

    /// The tensor called `name`, or an error naming the dump.
    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .with_context(|| format!("the dump has no tensor `{name}`"))
    }
}

/// Runs the reference on `ids`, then `generate` greedy tokens, and collects the dump.
pub fn reference_dump(
    model: &Model,
    ids: &[u32],
    generate: usize,
    opts: &RunOptions,
) -> Result<Dump> {
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    let mut state = model.new_state()?;
    let mut taps = Taps::on();
    let logits = model.prefill(ids, &mut state, opts, &mut taps)?;
    let mut tensors = taps.take();
    let ids_i64: Vec<i64> = ids.iter().map(|&x| x as i64).collect();
    tensors.insert("token_ids".into(), Tensor::new(ids_i64, &Device::Cpu)?);
    tensors.extend(state.named_tensors());
    let generated = if generate > 0 {
        greedy_continue(model, &mut state, logits, generate, &[], opts, |_| Ok(()))?
    } else {
        vec![]
    };
    let generated: Vec<i64> = generated.into_iter().map(|x| x as i64).collect();
    tensors.insert(
        "generated".into(),
        Tensor::from_vec(generated.clone(), generated.len(), &Device::Cpu)?,
    );
    let mut metadata = BTreeMap::new();
    metadata.insert("backend".into(), "reference".into());
    metadata.insert(
        "dtype".into(),
        match model.dtype() {
            DType::F64 => "f64".into(),
            _ => "f32".into(),
        },
    );
    metadata.insert("deltanet_prefill".into(), opts.prefill.describe());
    metadata.insert("deltanet_decode".into(), opts.decode.describe());
    metadata.insert("output_scale".into(), opts.output_scale.to_string());
    metadata.insert(
        "prefill_block".into(),
        opts.prefill_block
            .map_or("whole prompt".into(), |b| b.to_string()),
    );
    Ok(Dump { tensors, metadata })
}
