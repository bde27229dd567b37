//! Named intermediate tensors recorded during a run (the parity harness's view inside the model).
//!
//! Every tap is token-major (`[T, …]`); when a prompt is fed in several forward calls the pieces are concatenated
//! along the token axis, so a tap always covers every token seen since the recorder was created. A streaming
//! recorder ([`Taps::stream`]) keeps nothing: it hands each piece to a [`TapSink`] as soon as it is computed, with
//! the position of its first row, so that what a run holds does not grow with layers × tokens.

use crate::error::{Error, Result};
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

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

    /// The MoE block's scope (`layers.{i}.mlp.*`; a dense MLP has no taps of its own).
    pub const MLP: &str = "mlp";
    /// MoE: the router's logits `x W_rᵀ`, before the softmax `[T, E]`.
    pub const ROUTER_LOGITS: &str = "router_logits";
    /// MoE: the chosen experts, in descending router probability `[T, k]` (i64).
    pub const EXPERTS_CHOSEN: &str = "experts_chosen";
    /// MoE: the chosen experts' weights, their probabilities renormalised to sum 1 `[T, k]`.
    pub const EXPERT_WEIGHTS: &str = "expert_weights";
    /// MoE: the shared expert's output as added to the routed experts', `sigmoid(shared_expert_gate · x)` times the
    /// shared expert `[T, H]`.
    pub const SHARED_OUTPUT: &str = "shared_output";

    /// The MoE block's taps, in the order they are computed.
    pub const MOE_TAPS: [&str; 4] = [ROUTER_LOGITS, EXPERTS_CHOSEN, EXPERT_WEIGHTS, SHARED_OUTPUT];

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
        } else if let Some(tap) = rest.strip_prefix("mlp.") {
            // After the mixer output (100), before the MLP output (110).
            within(&MOE_TAPS, tap).map(|i| 101 + i)
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
            .map(|i| 100 + 10 * i)
        };
        // A layer's name outside the format comes after the layer's known tensors.
        (1, layer, step.unwrap_or(200))
    }
}

/// Where a streaming recorder sends the taps as they are computed (a dump being written, …).
pub trait TapSink: Send {
    /// Takes rows `[position, position + R)` of the tap `name` (`R = tensor.dim(0)`, token-major), `position`
    /// counting tokens from the start of the sequence. The pieces of one name come in order of position.
    fn put(&mut self, name: &str, position: usize, tensor: &Tensor) -> Result<()>;
}

/// A sink shared between whoever owns it and the recorders (and backends) that stream to it.
pub type SharedTapSink = Arc<Mutex<dyn TapSink>>;

/// Hands `tensor` to `sink` as rows of `name` from `position` (a poisoned lock is an error, never a panic).
pub fn put(sink: &SharedTapSink, name: &str, position: usize, tensor: &Tensor) -> Result<()> {
    sink.lock()
        .map_err(|_| Error::Sink("the tap sink was poisoned by an earlier panic".into()))?
        .put(name, position, tensor)
}

/// What a recorder does with a tap.
#[derive(Default)]
enum Mode {
    /// Nothing.
    #[default]
    Off,
    /// Keeps it, appended to the rows recorded before under its name.
    Keep,
    /// Sends it to `sink`: rows of each name from `start` on, `rows` counting those sent so far per name.
    Stream {
        sink: SharedTapSink,
        start: usize,
        rows: BTreeMap<String, usize>,
    },
}

impl std::fmt::Debug for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mode::Off => f.write_str("Off"),
            Mode::Keep => f.write_str("Keep"),
            Mode::Stream { start, rows, .. } => f
                .debug_struct("Stream")
                .field("start", start)
                .field("rows", rows)
                .finish_non_exhaustive(),
        }
    }
}

/// A recorder of named intermediates; a disabled recorder costs nothing.
#[derive(Debug, Default)]
pub struct Taps {
    mode: Mode,
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
            mode: Mode::Keep,
            tensors: BTreeMap::new(),
        }
    }

    /// A recorder that keeps nothing and sends every tap to `sink` as it is recorded, the first row of each name
    /// being the sequence's token `position` (the state's position when the run starts).
    pub fn stream(sink: SharedTapSink, position: usize) -> Self {
        Taps {
            mode: Mode::Stream {
                sink,
                start: position,
                rows: BTreeMap::new(),
            },
            tensors: BTreeMap::new(),
        }
    }

    /// Whether taps are being recorded (kept or streamed).
    pub fn enabled(&self) -> bool {
        !matches!(self.mode, Mode::Off)
    }

    /// Records `tensor` under `name`: appends it along the token axis if the name was recorded before, or sends it
    /// to the sink of a streaming recorder.
    pub fn record(&mut self, name: impl FnOnce() -> String, tensor: &Tensor) -> Result<()> {
        let name = match &mut self.mode {
            Mode::Off => return Ok(()),
            Mode::Keep => name(),
            Mode::Stream { sink, start, rows } => {
                let name = name();
                let sent = rows.entry(name.clone()).or_insert(0);
                let position = *start + *sent;
                *sent += tensor.dim(0)?;
                return put(sink, &name, position, tensor);
            }
        };
        let merged = match self.tensors.remove(&name) {
            Some(prev) => Tensor::cat(&[&prev, tensor], 0)?,
            None => tensor.clone(),
        };
        self.tensors.insert(name, merged);
        Ok(())
    }

    /// The tap recorded under `name` (a streaming recorder keeps none).
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Remembers what it was sent: (name, position, rows).
    #[derive(Default)]
    struct Log(Vec<(String, usize, usize)>);

    impl TapSink for Log {
        fn put(&mut self, name: &str, position: usize, tensor: &Tensor) -> Result<()> {
            self.0.push((name.to_string(), position, tensor.dim(0)?));
            Ok(())
        }
    }

    #[test]
    fn the_moe_taps_come_between_the_mixer_output_and_the_mlp_output() {
        let order: Vec<_> = [
            "layers.1.linear_attn.gated_norm_output",
            "layers.1.mixer_output",
            "layers.1.mlp.router_logits",
            "layers.1.mlp.experts_chosen",
            "layers.1.mlp.expert_weights",
            "layers.1.mlp.shared_output",
            "layers.1.mlp_output",
            "layers.1.output",
            "layers.1.conv_state",
            "layers.1.value_cache",
            "layers.2.embeddings_unknown",
        ]
        .iter()
        .map(|n| names::computation_order(n))
        .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
        assert!(order[..10].iter().all(|o| o.2 < 200));
    }

    #[test]
    fn a_streaming_recorder_sends_each_piece_at_its_position_and_keeps_nothing() {
        let log = Arc::new(Mutex::new(Log::default()));
        let mut taps = Taps::stream(log.clone(), 7);
        let rows = |n| Tensor::zeros((n, 2), DType::F32, &Device::Cpu).unwrap();
        assert!(taps.enabled());
        taps.record(|| "a".into(), &rows(3)).unwrap();
        taps.record(|| "b".into(), &rows(3)).unwrap();
        taps.record(|| "a".into(), &rows(2)).unwrap();
        assert!(taps.tensors().is_empty() && taps.get("a").is_none());
        assert_eq!(
            log.lock().unwrap().0,
            [("a".into(), 7, 3), ("b".into(), 7, 3), ("a".into(), 10, 2)]
        );
        // The in-memory recorder concatenates, as before.
        let mut kept = Taps::on();
        kept.record(|| "a".into(), &rows(3)).unwrap();
        kept.record(|| "a".into(), &rows(2)).unwrap();
        assert_eq!(kept.get("a").unwrap().dims(), &[5, 2]);
    }
}
