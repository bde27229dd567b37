//! Named intermediate tensors recorded during a run (the parity harness's view inside the model).
//!
//! Every tap is token-major (`[T, …]`); when a prompt is fed in several forward calls the pieces are concatenated
//! along the token axis, so a tap always covers every token seen since the recorder was created.

use crate::error::Result;
use candle_core::Tensor;
use std::collections::BTreeMap;

/// The names of the taps, shared by every backend that writes them (the reference, the OpenVINO graphs) and by
/// whoever reads them. A layer's tap is `layers.{i}.{name}` ([`names::layer`]); a mixer's own taps are
/// `layers.{i}.{mixer}.{name}`, the mixer being [`names::LINEAR_ATTN`] or [`names::SELF_ATTN`].
pub mod names {
    /// Token embeddings `[T, H]`.
    pub const EMBEDDINGS: &str = "embeddings";
    /// After the final RMSNorm `[T, H]`.
    pub const FINAL_NORM: &str = "final_norm";
    /// Logits `[T, V]`.
    pub const LOGITS: &str = "logits";
    /// A layer's output, the residual stream after it `[T, H]`.
    pub const OUTPUT: &str = "output";
    /// A layer's mixer output before the residual add `[T, H]`.
    pub const MIXER_OUTPUT: &str = "mixer_output";
    /// A layer's MLP output before the residual add `[T, H]`.
    pub const MLP_OUTPUT: &str = "mlp_output";
    /// The Gated DeltaNet mixer's scope.
    pub const LINEAR_ATTN: &str = "linear_attn";
    /// The attention mixer's scope.
    pub const SELF_ATTN: &str = "self_attn";
    /// DeltaNet: `in_proj_qkv`'s output, before the conv `[T, C]`.
    pub const QKV: &str = "qkv";
    /// DeltaNet: `in_proj_z`'s output, the gate of the gated norm `[T, Hv, Dv]`.
    pub const Z: &str = "z";
    /// DeltaNet: `in_proj_b`'s output, before the sigmoid `[T, Hv]`.
    pub const B: &str = "b";
    /// DeltaNet: `in_proj_a`'s output, before the softplus `[T, Hv]`.
    pub const A: &str = "a";
    /// DeltaNet: the causal conv's output, before the SiLU `[T, C]`.
    pub const CONV_OUTPUT: &str = "conv_output";
    /// DeltaNet: queries after conv and SiLU, before the l2 norm `[T, Hk, Dk]`; attention: queries after q_norm and
    /// RoPE `[T, Hq, D]`.
    pub const QUERY: &str = "query";
    /// DeltaNet: keys after conv and SiLU `[T, Hk, Dk]`; attention: keys after k_norm and RoPE `[T, Hkv, D]`.
    pub const KEY: &str = "key";
    /// DeltaNet: values after conv and SiLU `[T, Hv, Dv]`; attention: `v_proj`'s output `[T, Hkv, D]`.
    pub const VALUE: &str = "value";
    /// DeltaNet: queries after the l2 norm, before the `Dk^-0.5` (and output) scaling `[T, Hk, Dk]`.
    pub const QUERY_NORMED: &str = "query_normed";
    /// DeltaNet: keys after the l2 norm `[T, Hk, Dk]`.
    pub const KEY_NORMED: &str = "key_normed";
    /// DeltaNet log-decays `[T, Hv]`.
    pub const G: &str = "g";
    /// DeltaNet write strengths `[T, Hv]`.
    pub const BETA: &str = "beta";
    /// The delta rule's output before the gated norm, unscaled `[T, Hv, Dv]`.
    pub const CORE_OUTPUT: &str = "core_output";
    /// DeltaNet: the gated norm's output, the `out_proj` input `[T, Hv, Dv]`.
    pub const GATED_NORM_OUTPUT: &str = "gated_norm_output";
    /// Attention: the output gate before the sigmoid `[T, Hq·D]`.
    pub const GATE: &str = "gate";
    /// Attention output times `sigmoid(gate)`, the `o_proj` input `[T, Hq·D]`.
    pub const GATED_OUTPUT: &str = "gated_output";

    /// A DeltaNet layer's conv state after the prompt: the last `K` conv inputs `[C, K]`.
    pub const CONV_STATE: &str = "conv_state";
    /// A DeltaNet layer's recurrent state after the prompt `[Hv, Dk, Dv]`.
    pub const RECURRENT_STATE: &str = "recurrent_state";
    /// An attention layer's cached keys after the prompt (after norm and RoPE) `[Hkv, T, D]`.
    pub const KEY_CACHE: &str = "key_cache";
    /// An attention layer's cached values after the prompt `[Hkv, T, D]`.
    pub const VALUE_CACHE: &str = "value_cache";

    /// The DeltaNet mixer's taps, in the order they are computed.
    pub const LINEAR_ATTN_TAPS: [&str; 14] = [
        QKV,
        Z,
        B,
        A,
        CONV_OUTPUT,
        QUERY,
        KEY,
        VALUE,
        G,
        BETA,
        QUERY_NORMED,
        KEY_NORMED,
        CORE_OUTPUT,
        GATED_NORM_OUTPUT,
    ];

    /// The attention mixer's taps, in the order they are computed.
    pub const SELF_ATTN_TAPS: [&str; 5] = [QUERY, KEY, VALUE, GATE, GATED_OUTPUT];

    /// `layers.{layer}.{name}`.
    pub fn layer(layer: usize, name: &str) -> String {
        format!("layers.{layer}.{name}")
    }

    /// `{mixer}.{name}` (e.g. `linear_attn.g`), the name of a mixer's tap within its layer.
    pub fn mixer(mixer: &str, name: &str) -> String {
        format!("{mixer}.{name}")
    }

    /// Where a dump name comes in the order the decoder computes: the embeddings, then layer by layer its mixer's
    /// taps (in [`LINEAR_ATTN_TAPS`] or [`SELF_ATTN_TAPS`] order), the mixer output, the MLP output, the layer
    /// output and the layer's states, then the final norm and the logits. Names outside the format sort last (by
    /// name, which the caller's ordering adds). Sorting by this key finds the tensor where a fault first shows.
    pub fn computation_order(name: &str) -> (u8, usize, usize) {
        match name {
            EMBEDDINGS => return (0, 0, 0),
            FINAL_NORM => return (2, 0, 0),
            LOGITS => return (3, 0, 0),
            _ => {}
        }
        let Some((layer, rest)) = name
            .strip_prefix("layers.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(l, rest)| Some((l.parse::<usize>().ok()?, rest)))
        else {
            return (4, 0, 0);
        };
        let within = |taps: &[&str], tap: &str| taps.iter().position(|t| *t == tap);
        let step = if let Some(tap) = rest.strip_prefix("linear_attn.") {
            within(&LINEAR_ATTN_TAPS, tap).map(|i| 1 + i)
        } else if let Some(tap) = rest.strip_prefix("self_attn.") {
            within(&SELF_ATTN_TAPS, tap).map(|i| 1 + i)
        } else {
            [
                MIXER_OUTPUT,
                MLP_OUTPUT,
                OUTPUT,
                CONV_STATE,
                RECURRENT_STATE,
                KEY_CACHE,
                VALUE_CACHE,
            ]
            .iter()
            .position(|t| *t == rest)
            .map(|i| 100 + i)
        };
        // A layer's name outside the format comes after the layer's known tensors.
        (1, layer, step.unwrap_or(200))
    }
}

/// A recorder of named intermediates; a disabled recorder costs nothing.
#[derive(Debug, Default)]
pub struct Taps {
    enabled: bool,
    tensors: BTreeMap<String, Tensor>,
}

impl Taps {
    /// A recorder that keeps nothing.
    pub fn off() -> Self {
        Taps::default()
    }

    /// A recorder that keeps every tap.
    pub fn on() -> Self {
        Taps {
            enabled: true,
            tensors: BTreeMap::new(),
        }
    }

    /// Whether taps are being recorded.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Records `tensor` under `name`, appending along the token axis if the name was recorded before.
    pub fn record(&mut self, name: impl FnOnce() -> String, tensor: &Tensor) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let name = name();
        let merged = match self.tensors.remove(&name) {
            Some(prev) => Tensor::cat(&[&prev, tensor], 0)?,
            None => tensor.clone(),
        };
        self.tensors.insert(name, merged);
        Ok(())
    }

    /// The tap recorded under `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// All taps, by name.
    pub fn tensors(&self) -> &BTreeMap<String, Tensor> {
        &self.tensors
    }

    /// Takes the recorded taps, leaving the recorder empty.
    pub fn take(&mut self) -> BTreeMap<String, Tensor> {
        std::mem::take(&mut self.tensors)
    }
}
