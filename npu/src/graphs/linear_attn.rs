//! The Gated DeltaNet mixer (`linear_attn`) as graph ops, as `reference::linear_attn` has it: projections, causal
//! convolution, the delta rule and the gated norm. On top of the reference, a `token_valid` mask lets a partly
//! filled block leave every state exactly as after its last real token.

use super::deltanet::{self, Inputs};
use super::ops::{
    gated_rms_norm, l2_normalize, linear, repeat_interleave, sigmoid, silu, softplus,
};
use super::{Builder, DeltaNetGraphForm, GraphTaps};
use crate::error::Result;
use crate::ir::{ElemType, Graph, Value};
use reference::linear_attn::L2_NORM_EPS;
use reference::schema::Param;
use reference::taps::names;

/// The recurrent state of one linear-attention layer inside a graph.
#[derive(Debug, Clone, Copy)]
pub struct LinearState {
    /// The last `K` inputs of the convolution (pre-conv `qkv` channels): `[C, K]`.
    pub conv: Value,
    /// The delta-rule state `[Hv, Dk, Dv]`.
    pub recurrent: Value,
}

/// The weights of one Gated DeltaNet layer as graph constants, and its sizes.
pub struct GatedDeltaNet {
    in_proj_qkv: Value,
    in_proj_z: Value,
    in_proj_b: Value,
    in_proj_a: Value,
    /// The kernel's columns: `conv_weight[j]` `[C]` multiplies the input `K − 1 − j` tokens back.
    conv_weight: Vec<Value>,
    /// `−exp(A_log)` `[Hv]` (computed on the host in f32, as the reference computes it in the run's dtype).
    neg_a: Value,
    dt_bias: Value,
    norm_weight: Value,
    out_proj: Value,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    eps: f32,
}

/// Options of the mixer that do not change the result in exact arithmetic.
#[derive(Debug, Clone, Copy)]
pub struct DeltaNetOptions {
    /// The form of the recurrence for blocks of more than one token.
    pub form: DeltaNetGraphForm,
    /// The fp16 rescaling: `q` is multiplied by this inside the recurrence and the gated norm's eps by its square.
    pub output_scale: f32,
}

impl GatedDeltaNet {
    /// Puts layer `layer`'s `linear_attn.*` tensors into `graph`.
    pub fn load(builder: &Builder, graph: &mut Graph, layer: usize) -> Result<Self> {
        let b = builder;
        let c = b.config();
        let (conv_dim, k) = (c.linear_conv_dim(), c.linear_conv_kernel_dim);
        let hv = c.linear_num_value_heads;
        let kernel = b.layer_host(layer, Param::Conv1d)?; // [C, 1, K]
        let conv_weight = (0..k)
            .map(|j| {
                let column: Vec<f32> = (0..conv_dim).map(|ch| kernel[ch * k + j]).collect();
                graph.const_f32(&column, &[conv_dim])
            })
            .collect::<Result<_>>()?;
        let neg_a: Vec<f32> = b
            .layer_host(layer, Param::ALog)?
            .iter()
            .map(|x| -x.exp())
            .collect();
        let dt_bias = b.layer_host(layer, Param::DtBias)?;
        let norm_weight = b.layer_host(layer, Param::LinearNorm)?;
        Ok(GatedDeltaNet {
            in_proj_qkv: b.layer_matrix(graph, layer, Param::InProjQkv)?,
            in_proj_z: b.layer_matrix(graph, layer, Param::InProjZ)?,
            in_proj_b: b.layer_matrix(graph, layer, Param::InProjB)?,
            in_proj_a: b.layer_matrix(graph, layer, Param::InProjA)?,
            conv_weight,
            neg_a: graph.const_f32(&neg_a, &[hv])?,
            dt_bias: graph.const_f32(&dt_bias, &[hv])?,
            norm_weight: graph.const_f32(&norm_weight, &[c.linear_value_head_dim])?,
            out_proj: b.layer_matrix(graph, layer, Param::OutProj)?,
            hk: c.linear_num_key_heads,
            hv,
            dk: c.linear_key_head_dim,
            dv: c.linear_value_head_dim,
            eps: c.rms_norm_eps as f32,
        })
    }

    /// `x`: `[T, hidden]` (after the input norm) → `([T, hidden], new state)`; `token_valid` `[T]` masks padded
    /// slots out of every state.
    ///
    /// Taps under `{tap}.`, as the reference's (`reference::taps::names::LINEAR_ATTN_TAPS`): the projections `qkv`,
    /// `z`, `b`, `a`; `conv_output`; `query`, `key`, `value` (after conv and SiLU); `g`, `beta`; `query_normed`,
    /// `key_normed`; `core_output` (the recurrence's output before the gated norm, without the output scale) and
    /// `gated_norm_output`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        graph: &mut Graph,
        x: Value,
        state: LinearState,
        token_valid: Value,
        opts: &DeltaNetOptions,
        taps: GraphTaps,
        tap: &str,
    ) -> Result<(Value, LinearState)> {
        let t = graph.shape(x)[0];
        let qkv = linear(graph, x, self.in_proj_qkv)?;
        let z = linear(graph, x, self.in_proj_z)?;
        let b = linear(graph, x, self.in_proj_b)?;
        let a = linear(graph, x, self.in_proj_a)?;
        let z = graph.reshape(z, &[t, self.hv, self.dv])?;
        let tap_name = |name: &str| format!("{tap}.{name}");
        taps.record(graph, || tap_name(names::QKV), qkv)?;
        taps.record(graph, || tap_name(names::Z), z)?;
        taps.record(graph, || tap_name(names::B), b)?;
        taps.record(graph, || tap_name(names::A), a)?;

        let (conv_out, conv_state) =
            causal_conv(graph, qkv, state.conv, &self.conv_weight, token_valid)?;
        taps.record(graph, || tap_name(names::CONV_OUTPUT), conv_out)?;
        let mixed = silu(graph, conv_out)?;
        let key_dim = self.hk * self.dk;
        let q = graph.slice(mixed, 1, 0, key_dim)?;
        let q = graph.reshape(q, &[t, self.hk, self.dk])?;
        let k = graph.slice(mixed, 1, key_dim, key_dim)?;
        let k = graph.reshape(k, &[t, self.hk, self.dk])?;
        let v = graph.slice(mixed, 1, 2 * key_dim, self.hv * self.dv)?;
        let v = graph.reshape(v, &[t, self.hv, self.dv])?;

        let beta = sigmoid(graph, b)?;
        let a_dt = graph.add(a, self.dt_bias)?;
        let sp = softplus(graph, a_dt)?;
        let g = graph.mul(sp, self.neg_a)?; // [T, Hv]
        taps.record(graph, || tap_name(names::QUERY), q)?;
        taps.record(graph, || tap_name(names::KEY), k)?;
        taps.record(graph, || tap_name(names::VALUE), v)?;
        taps.record(graph, || tap_name(names::G), g)?;
        taps.record(graph, || tap_name(names::BETA), beta)?;

        let scale = opts.output_scale;
        let q = l2_normalize(graph, q, L2_NORM_EPS as f32)?;
        let k = l2_normalize(graph, k, L2_NORM_EPS as f32)?;
        taps.record(graph, || tap_name(names::QUERY_NORMED), q)?;
        taps.record(graph, || tap_name(names::KEY_NORMED), k)?;
        let q_scale = graph.scalar((self.dk as f32).powf(-0.5) * scale)?;
        let q = graph.mul(q, q_scale)?;
        let group = self.hv / self.hk;
        let heads_first2 = |graph: &mut Graph, x: Value| graph.transpose(x, &[1, 0]);
        let heads_first3 = |graph: &mut Graph, x: Value| graph.transpose(x, &[1, 0, 2]);
        let inputs = Inputs {
            q: {
                let q = heads_first3(graph, q)?;
                repeat_interleave(graph, q, group, 0)?
            },
            k: {
                let k = heads_first3(graph, k)?;
                repeat_interleave(graph, k, group, 0)?
            },
            v: heads_first3(graph, v)?,
            g: heads_first2(graph, g)?,
            beta: heads_first2(graph, beta)?,
        }
        .mask_padding(graph, token_valid)?;
        let (o, recurrent) = deltanet::run(graph, opts.form, inputs, state.recurrent)?;
        let core = graph.transpose(o, &[1, 0, 2])?; // [T, Hv, Dv]
        if opts.output_scale == 1.0 {
            taps.record(graph, || tap_name(names::CORE_OUTPUT), core)?;
        } else {
            let unscale = graph.scalar(1.0 / scale)?;
            let core_unscaled = graph.mul(core, unscale)?;
            taps.record(graph, || tap_name(names::CORE_OUTPUT), core_unscaled)?;
        }

        let normed = gated_rms_norm(graph, core, z, self.norm_weight, self.eps * scale * scale)?;
        taps.record(graph, || tap_name(names::GATED_NORM_OUTPUT), normed)?;
        let normed = graph.reshape(normed, &[t, self.hv * self.dv])?;
        let out = linear(graph, normed, self.out_proj)?;
        Ok((
            out,
            LinearState {
                conv: conv_state,
                recurrent,
            },
        ))
    }
}

impl Inputs {
    /// Applies a `token_valid` mask `[T]` (1 = real token, 0 = padding): `g = 0, beta = 0` on padded slots, so they
    /// leave the state exactly as it was (`reference::deltanet::Inputs::mask_padding`).
    pub fn mask_padding(self, graph: &mut Graph, token_valid: Value) -> Result<Inputs> {
        let t = graph.shape(token_valid)[0];
        let valid = graph.reshape(token_valid, &[1, t])?;
        Ok(Inputs {
            g: graph.mul(self.g, valid)?,
            beta: graph.mul(self.beta, valid)?,
            ..self
        })
    }
}

/// Depthwise causal convolution over time with a carried state, no bias (`reference::linear_attn::causal_conv`).
///
/// `x`: `[T, C]` new inputs; `state`: `[C, K]` the previous `K` inputs; `weight[j]`: column `j` of the kernel `[C]`.
/// `out[t, c] = Σ_j weight[j][c] · x[c, t − K + 1 + j]`. Returns `(out [T, C], new state [C, K])`, the new state
/// being the last `K` inputs up to the last real token (`token_valid` counts them).
pub fn causal_conv(
    graph: &mut Graph,
    x: Value,
    state: Value,
    weight: &[Value],
    token_valid: Value,
) -> Result<(Value, Value)> {
    let t = graph.shape(x)[0];
    let k = weight.len();
    let past = graph.transpose(state, &[1, 0])?; // [K, C]
    let full = graph.concat(&[past, x], 0)?; // [K + T, C]
    let mut out = None;
    for (j, &w) in weight.iter().enumerate() {
        let window = graph.slice(full, 0, 1 + j, t)?;
        let term = graph.mul(window, w)?;
        out = Some(match out {
            None => term,
            Some(acc) => graph.add(acc, term)?,
        });
    }
    let out =
        out.ok_or_else(|| crate::error::Error::graph(graph.name(), "a conv kernel of width 0"))?;
    // The new state: rows n_valid .. n_valid + K of [state; x].
    let n_valid = graph.reduce_sum(token_valid, &[0], true)?;
    let n_valid = graph.convert(n_valid, ElemType::I64)?;
    let offsets = graph.const_i64(&(0..k as i64).collect::<Vec<_>>(), &[k])?;
    let rows = graph.add(offsets, n_valid)?;
    let kept = graph.gather(full, rows, 0)?; // [K, C]
    let new_state = graph.transpose(kept, &[1, 0])?;
    Ok((out, new_state))
}
