//! The seven bugs a candle port of Qwen3.5 from GGUF had to hunt down against transformers (issue 33's seed: the
//! decay sign, the convolution kernel's orientation, the dropped attention gate, RoPE on the whole head, the GQA norm
//! grouping, the norm epsilon, the KV heads read off the wrong layer), planted where a porter's loader would hold
//! them: in the config read from the metadata ([`Fault::config`]) or in the tensors as they are mapped onto the
//! checkpoint's ([`Fault::layout`], [`Fault::tensors`]). Each variant's doc says what the port did and what the
//! same slip is in this loader, where the model code is the reference's own and only the mapping can go wrong.
//!
//! Test-only: no command takes a fault. [`crate::gguf::write_checkpoint`] (hidden from the docs) writes a GGUF's
//! faulty mapping as the checkpoint directory the weight store would have served, so that a test runs it, dumps
//! it and holds `qwen35 diff` to naming each fault at its layer and tensor (`parity/tests/all/gguf_faults.rs`).

use super::{CheckpointTensor, Layout, meta_err};
use crate::config::Config;
use crate::error::Result;
use crate::gguf::file::GgufFile;
use serde_json::{Map, Value, json};

/// A bug of the candle port, planted in the GGUF's mapping.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Bug 1, the decay's sign. The port read `ssm_a`, which the converter already wrote as `-exp(A_log)`, and
    /// negated it once more as its model expected a positive rate: the sign the file carries was applied twice,
    /// and the state grew where it should decay. In this reference the model applies `-exp(·)` to the `A_log` the
    /// loader hands it (a positive rate cannot be expressed), so the same slip, forgetting that the file already
    /// holds the transformed value, is the loader handing `ssm_a` over unchanged (reordered, not inverted) as
    /// `A_log`: the model then applies the file's `-exp` a second time, and every rate `exp(A_log)` becomes
    /// `exp(ssm_a) = exp(-exp(A_log))`, in (0, 1). (A literal second negation, a positive `ssm_a`, has no `A_log`:
    /// the loader refuses it, naming the tensor; see `layout::a_log`.)
    DecaySign,
    /// Bug 2, the convolution kernel's orientation. The port applied the depthwise kernel backwards against
    /// PyTorch's left-padded `Conv1d` (its fix reversed the kernel). Here: every channel's `K` taps are reversed as
    /// `ssm_conv1d` is mapped, so the first tap multiplies the current token.
    ConvOrientation,
    /// Bug 3, the dropped output gate. `attn_q` holds each head's query and output gate together; the port used
    /// the query and never applied `sigmoid(gate)` before `o_proj`. Here, as the mapping of `attn_q` and
    /// `attn_output`: each head's gate rows are zeroed (`sigmoid(0) = 1/2`) and `o_proj` doubled, so the model
    /// computes `o_proj(attn)` exactly (halving and doubling are exact in binary floating point), the port's
    /// ungated output.
    DroppedGate,
    /// Bug 4, RoPE on the whole head. The port read `rope.dimension_count` and did not use it, rotating all of
    /// `head_dim` instead of its first `rd`. Here: the config's rotary factor is 1 (rotary dim = head dim), and
    /// the MRoPE sections, which no longer fit, are left out (text positions never need them).
    WholeHeadRope,
    /// Bug 5, the GQA norm grouping. The port built the full attention's paired q/k RMSNorm for the query heads
    /// (`head_count_kv` was not threaded through its construction: 8×8 where the keys have 2 heads), so the keys
    /// were normalised as queries. The reference's norm groups by head itself (per head over `head_dim`, one `[D]`
    /// weight shared by the heads, as the checkpoint has it), so no loader can regroup it; what a loader that
    /// builds the pair from the query side gets wrong is the keys' norm: here `k_norm` is mapped from
    /// `attn_q_norm`.
    KeyNormGrouping,
    /// Bug 6, the SSM norm's epsilon. The port ignored `attention.layer_norm_rms_epsilon` (1e-6) and used a
    /// hard-coded 1e-5 for every norm; it showed most in the DeltaNet layers' gated norm, whose input is small.
    /// Here: the config's `rms_norm_eps` is 1e-5 whatever the metadata says. The reference, like the port, has one
    /// epsilon for every norm, so the input norm of layer 0 is the first it changes.
    NormEps,
    /// Bug 7, the KV heads read off the wrong layer. The port inferred the full attention's KV head count from
    /// `blk.0`, a linear-attention layer, instead of `attention.head_count_kv`. Here: the config's
    /// `num_key_value_heads` is the head count `blk.0` shows (the length of its `ssm_a`, one element a value
    /// head). The KV heads shape `k_proj` and `v_proj`, so a count that differs cannot run silently in this
    /// reference: the weight store refuses the first full-attention layer's `k_proj`, naming it and the key.
    KvHeadsFromLayer0,
}

impl Fault {
    /// Every fault, in the seed's order.
    pub const ALL: [Fault; 7] = [
        Fault::DecaySign,
        Fault::ConvOrientation,
        Fault::DroppedGate,
        Fault::WholeHeadRope,
        Fault::KeyNormGrouping,
        Fault::NormEps,
        Fault::KvHeadsFromLayer0,
    ];

    /// A short name (`decay-sign`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Fault::DecaySign => "decay-sign",
            Fault::ConvOrientation => "conv-orientation",
            Fault::DroppedGate => "dropped-gate",
            Fault::WholeHeadRope => "whole-head-rope",
            Fault::KeyNormGrouping => "key-norm-grouping",
            Fault::NormEps => "norm-eps",
            Fault::KvHeadsFromLayer0 => "kv-heads-from-layer-0",
        }
    }

    /// The converter change the faulty loader undoes in place of `layout`.
    pub(super) fn layout(self, layout: Layout) -> Layout {
        match (self, layout) {
            // The value heads put back in order, `-exp` not inverted.
            (Fault::DecaySign, Layout::Decay) => Layout::HeadRows,
            _ => layout,
        }
    }

    /// Plants the fault in the config's JSON (`config.json`'s keys) read from `file`'s metadata.
    pub(super) fn config(self, file: &GgufFile, c: &mut Map<String, Value>) -> Result<()> {
        match self {
            Fault::WholeHeadRope => {
                if let Some(Value::Object(rope)) = c.get_mut("rope_parameters") {
                    rope.insert("partial_rotary_factor".into(), json!(1.0));
                    rope.remove("mrope_section");
                }
            }
            Fault::NormEps => {
                c.insert("rms_norm_eps".into(), json!(1e-5));
            }
            Fault::KvHeadsFromLayer0 => {
                let name = "blk.0.ssm_a";
                let info = file.tensor(name).ok_or_else(|| {
                    meta_err(
                        file,
                        name,
                        "missing: layer 0 is not linear attention".into(),
                    )
                })?;
                c.insert("num_key_value_heads".into(), json!(info.numel()));
            }
            _ => {}
        }
        Ok(())
    }

    /// Plants the fault in the tensors mapped onto the checkpoint's names (`config` is the faulty loader's).
    pub(super) fn tensors(self, tensors: &mut [CheckpointTensor], config: &Config) {
        let is = |t: &CheckpointTensor, key: &str| {
            t.name.starts_with("model.layers.") && t.name.ends_with(key)
        };
        match self {
            Fault::ConvOrientation => {
                for t in tensors
                    .iter_mut()
                    .filter(|t| is(t, ".linear_attn.conv1d.weight"))
                {
                    let k = config.linear_conv_kernel_dim;
                    for taps in t.values.chunks_exact_mut(k) {
                        taps.reverse();
                    }
                }
            }
            Fault::DroppedGate => {
                let (d, cols) = (config.head_dim, config.hidden_size);
                for t in tensors.iter_mut() {
                    if is(t, ".self_attn.q_proj.weight") {
                        // Per head `2·D` rows: the query, then the gate.
                        for head in t.values.chunks_exact_mut(2 * d * cols) {
                            head[d * cols..].fill(0.0);
                        }
                    } else if is(t, ".self_attn.o_proj.weight") {
                        t.values.iter_mut().for_each(|w| *w *= 2.0);
                    }
                }
            }
            Fault::KeyNormGrouping => {
                let queries: Vec<(String, Vec<f32>)> = tensors
                    .iter()
                    .filter(|t| is(t, ".self_attn.q_norm.weight"))
                    .map(|t| (t.name.replace(".q_norm.", ".k_norm."), t.values.clone()))
                    .collect();
                for (name, values) in queries {
                    if let Some(k) = tensors.iter_mut().find(|t| t.name == name) {
                        k.values = values;
                    }
                }
            }
            _ => {}
        }
    }
}
