//! The gated full-attention mixer (`self_attn`): per-head q/gate split, q/k RMSNorm, partial RoPE, GQA with a KV
//! cache, causal softmax, sigmoid output gate.

use crate::config::Config;
use crate::error::Result;
use crate::gguf::arith::Arithmetic;
use crate::gguf::arith::attention::{Shape, flash_attention_f16};
use crate::linear::Linear;
use crate::masks;
use crate::ops::{rms_norm, sigmoid, softmax_last_dim};
use crate::rope::RotaryTables;
use crate::schema::{Param, Schema};
use crate::taps::{Taps, names};
use crate::weights::WeightStore;
use candle_core::{DType, Tensor};

/// The key/value cache of one attention layer: `[Hkv, P, D]` each, keys after norm and RoPE.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Cached keys, `None` before the first token.
    pub keys: Option<Tensor>,
    /// Cached values, `None` before the first token.
    pub values: Option<Tensor>,
}

impl KvCache {
    /// Number of cached tokens.
    pub fn len(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.dim(1).unwrap_or(0))
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Weights and sizes of one attention layer.
#[derive(Debug, Clone)]
pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Tensor,
    k_norm: Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f64,
    /// [`Arithmetic::LlamaCpp`]: K and V cached in f16, llama.cpp's flash attention ([`flash_attention_f16`]).
    arithmetic: Arithmetic,
}

impl Attention {
    /// Loads layer `layer`'s `self_attn.*` tensors.
    pub fn load(w: &WeightStore, layer: usize, c: &Config) -> Result<Self> {
        let s = Schema::new(c);
        let load = |p: Param| w.load(&s.layer(layer, p));
        let linear = |p: Param| w.linear(&s.layer(layer, p));
        Ok(Attention {
            q_proj: linear(Param::QProj)?,
            k_proj: linear(Param::KProj)?,
            v_proj: linear(Param::VProj)?,
            o_proj: linear(Param::OProj)?,
            q_norm: load(Param::QNorm)?,
            k_norm: load(Param::KNorm)?,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            eps: c.rms_norm_eps,
            arithmetic: w.arithmetic(),
        })
    }

    /// `x`: `[T, hidden]` (after the input norm) → `[T, hidden]`, appending to `cache`; `rotary` holds the
    /// rotation of the same `T` tokens.
    ///
    /// Taps under `{tap}.` ([`names::SELF_ATTN_TAPS`]): `query` `[T, H, D]` and `key` `[T, Hkv, D]` after their norms
    /// and RoPE, `value` `[T, Hkv, D]`, `gate` `[T, H·D]` (before the sigmoid) and `gated_output` `[T, H·D]`, the input
    /// of `o_proj`.
    pub fn forward(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        rotary: &RotaryTables,
        taps: &mut Taps,
        tap: &str,
    ) -> Result<Tensor> {
        let (t, _) = x.dims2()?;
        let (nh, nkv, d) = (self.heads, self.kv_heads, self.head_dim);
        // Per head, the first D values are the query and the next D the gate.
        let qg = self.q_proj.forward(x)?.reshape((t, nh, 2 * d))?;
        let q = qg.narrow(2, 0, d)?;
        let gate = qg.narrow(2, d, d)?.reshape((t, nh * d))?;
        let k = self.k_proj.forward(x)?.reshape((t, nkv, d))?;
        let v = self.v_proj.forward(x)?.reshape((t, nkv, d))?;

        let q = rotary.apply(&rms_norm(&q, &self.q_norm, self.eps)?)?;
        let k = rotary.apply(&rms_norm(&k, &self.k_norm, self.eps)?)?;
        let tap_name = |name: &str| format!("{tap}.{name}");
        taps.record(|| tap_name(names::QUERY), &q)?;
        taps.record(|| tap_name(names::KEY), &k)?;
        taps.record(|| tap_name(names::VALUE), &v)?;
        taps.record(|| tap_name(names::GATE), &gate)?;

        let q = q.transpose(0, 1)?.contiguous()?; // [H, T, D]
        let mut k = k.transpose(0, 1)?.contiguous()?; // [Hkv, T, D]
        let mut v = v.transpose(0, 1)?.contiguous()?;
        let llama_cpp = self.arithmetic == Arithmetic::LlamaCpp;
        if llama_cpp {
            // llama.cpp's cache holds K and V in f16.
            k = k.to_dtype(DType::F16)?.to_dtype(DType::F32)?;
            v = v.to_dtype(DType::F16)?.to_dtype(DType::F32)?;
        }
        let past = cache.len();
        let keys = match &cache.keys {
            Some(prev) => Tensor::cat(&[prev, &k], 1)?,
            None => k,
        };
        let values = match &cache.values {
            Some(prev) => Tensor::cat(&[prev, &v], 1)?,
            None => v,
        };

        if llama_cpp {
            let shape = Shape {
                heads: nh,
                kv_heads: nkv,
                tokens: t,
                keys: past + t,
                head_dim: d,
            };
            let out = flash_attention_f16(
                &q.flatten_all()?.to_vec1()?,
                &keys.flatten_all()?.to_vec1()?,
                &values.flatten_all()?.to_vec1()?,
                shape,
                (d as f32).sqrt().recip(),
            );
            let out = Tensor::from_vec(out, (nh, t, d), x.device())?;
            cache.keys = Some(keys);
            cache.values = Some(values);
            return self.finish(out, &gate, taps, &tap_name(""));
        }
        // Query head h uses kv head h / (H / Hkv): group the query heads of each kv head together.
        let group = nh / nkv;
        let q = q.reshape((nkv, group * t, d))?;
        let scores = (q.matmul(&keys.t()?)? * (d as f64).powf(-0.5))?; // [Hkv, G·T, S]
        let mask = causal_bias(t, past, group, scores.dtype(), scores.device())?; // [G·T, S]
        let probs = softmax_last_dim(&scores.broadcast_add(&mask)?)?;
        let out = probs.matmul(&values)?.reshape((nh, t, d))?; // [H, T, D]
        cache.keys = Some(keys);
        cache.values = Some(values);
        self.finish(out, &gate, taps, &tap_name(""))
    }

    /// The gate and `o_proj` on the attention's output `[H, T, D]`.
    fn finish(&self, out: Tensor, gate: &Tensor, taps: &mut Taps, scope: &str) -> Result<Tensor> {
        let (nh, t, d) = out.dims3()?;
        let out = out.transpose(0, 1)?.reshape((t, nh * d))?;
        let gated = (out * sigmoid(gate)?)?;
        taps.record(|| format!("{scope}{}", names::GATED_OUTPUT), &gated)?;
        self.o_proj.forward(&gated)
    }
}

/// The additive causal bias `[G·T, P + T]` of [`masks::attention_bias`] (query `t`, at position `P + t`, sees keys
/// `0..=P + t`), repeated for the `G` query heads that share a kv head.
fn causal_bias(
    t: usize,
    past: usize,
    group: usize,
    dtype: candle_core::DType,
    dev: &candle_core::Device,
) -> Result<Tensor> {
    let bias = masks::attention_bias(t, past, past).repeat(group);
    Ok(Tensor::from_vec(bias, (group * t, past + t), dev)?.to_dtype(dtype)?)
}
