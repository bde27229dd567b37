//! The gated full-attention mixer (`self_attn`) as graph ops (`reference::attention`): per-head q/gate split, q/k
//! RMSNorm, partial RoPE, GQA over a static KV cache selected by an additive mask, sigmoid output gate.

use super::ops::{linear, rms_norm, sigmoid};
use super::rope::RotaryTables;
use super::{Builder, GraphTaps};
use crate::error::Result;
use crate::ir::{Graph, Value};
use reference::schema::Param;
use reference::taps::names;

/// A static KV cache inside a graph: `[Hkv, CTX, D]` each, of which the mask says which slots are filled.
#[derive(Debug, Clone, Copy)]
pub struct KvCache {
    /// Cached keys (after norm and RoPE).
    pub keys: Value,
    /// Cached values.
    pub values: Value,
}

/// The weights of one attention layer as graph constants, and its sizes.
pub struct Attention {
    q_proj: Value,
    k_proj: Value,
    v_proj: Value,
    o_proj: Value,
    /// `1 + q_norm.weight`.
    q_norm: Value,
    /// `1 + k_norm.weight`.
    k_norm: Value,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f32,
}

impl Attention {
    /// Puts layer `layer`'s `self_attn.*` tensors into `graph`.
    pub fn load(builder: &Builder, graph: &mut Graph, layer: usize) -> Result<Self> {
        let c = builder.config();
        Ok(Attention {
            q_proj: builder.layer_matrix(graph, layer, Param::QProj)?,
            k_proj: builder.layer_matrix(graph, layer, Param::KProj)?,
            v_proj: builder.layer_matrix(graph, layer, Param::VProj)?,
            o_proj: builder.layer_matrix(graph, layer, Param::OProj)?,
            q_norm: builder.norm_weight(graph, &builder.schema().layer(layer, Param::QNorm))?,
            k_norm: builder.norm_weight(graph, &builder.schema().layer(layer, Param::KNorm))?,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            eps: c.rms_norm_eps as f32,
        })
    }

    /// `x`: `[T, hidden]` (after the input norm) → `([T, hidden], the block's own keys and values [Hkv, T, D])`.
    /// `cache` holds `CTX` slots, `attention_mask` `[T, CTX + T]` selects the filled ones and the causal new keys;
    /// `rotary` holds the rotation of the same `T` tokens.
    ///
    /// Taps under `{tap}.`, as the reference's (`reference::taps::names::SELF_ATTN_TAPS`): `query`, `key` after
    /// their norms and RoPE, `value`, `gate` (before the sigmoid) and `gated_output` `[T, H·D]`, the input of
    /// `o_proj`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        graph: &mut Graph,
        x: Value,
        cache: KvCache,
        attention_mask: Value,
        rotary: &RotaryTables,
        taps: GraphTaps,
        tap: &str,
    ) -> Result<(Value, KvCache)> {
        let t = graph.shape(x)[0];
        let (nh, nkv, d) = (self.heads, self.kv_heads, self.head_dim);
        let ctx = graph.shape(cache.keys)[1];
        // Per head, the first D values are the query and the next D the gate.
        let qg = linear(graph, x, self.q_proj)?;
        let qg = graph.reshape(qg, &[t, nh, 2 * d])?;
        let q = graph.slice(qg, 2, 0, d)?;
        let gate = graph.slice(qg, 2, d, d)?;
        let gate = graph.reshape(gate, &[t, nh * d])?;
        let k = linear(graph, x, self.k_proj)?;
        let k = graph.reshape(k, &[t, nkv, d])?;
        let v = linear(graph, x, self.v_proj)?;
        let v = graph.reshape(v, &[t, nkv, d])?;

        let q = rms_norm(graph, q, self.q_norm, self.eps)?;
        let q = rotary.apply(graph, q)?;
        let k = rms_norm(graph, k, self.k_norm, self.eps)?;
        let k = rotary.apply(graph, k)?;
        let tap_name = |name: &str| format!("{tap}.{name}");
        taps.record(graph, || tap_name(names::QUERY), q)?;
        taps.record(graph, || tap_name(names::KEY), k)?;
        taps.record(graph, || tap_name(names::VALUE), v)?;
        taps.record(graph, || tap_name(names::GATE), gate)?;

        let q = graph.transpose(q, &[1, 0, 2])?; // [H, T, D]
        let k = graph.transpose(k, &[1, 0, 2])?; // [Hkv, T, D]
        let v = graph.transpose(v, &[1, 0, 2])?;
        let keys = graph.concat(&[cache.keys, k], 1)?; // [Hkv, CTX + T, D]
        let values = graph.concat(&[cache.values, v], 1)?;

        // Query head h uses kv head h / (H / Hkv): group the query heads of each kv head together.
        let group = nh / nkv;
        let q = graph.reshape(q, &[nkv, group * t, d])?;
        let scores = graph.matmul(q, keys, false, true)?; // [Hkv, G·T, CTX + T]
        let scale = graph.scalar((d as f32).powf(-0.5))?;
        let scores = graph.mul(scores, scale)?;
        let scores = graph.reshape(scores, &[nkv, group, t, ctx + t])?;
        let scores = graph.add(scores, attention_mask)?;
        let probs = graph.softmax(scores, 3)?;
        let probs = graph.reshape(probs, &[nkv, group * t, ctx + t])?;
        let out = graph.matmul(probs, values, false, false)?; // [Hkv, G·T, D]
        let out = graph.reshape(out, &[nh, t, d])?;
        let out = graph.transpose(out, &[1, 0, 2])?;
        let out = graph.reshape(out, &[t, nh * d])?;
        let gate = sigmoid(graph, gate)?;
        let gated = graph.mul(out, gate)?;
        taps.record(graph, || tap_name(names::GATED_OUTPUT), gated)?;
        let out = linear(graph, gated, self.o_proj)?;
        Ok((out, KvCache { keys: k, values: v }))
    }
}
