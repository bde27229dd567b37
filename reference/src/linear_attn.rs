//! The Gated DeltaNet mixer (`linear_attn`): projections, causal convolution, the delta rule and the gated norm.

use crate::config::Config;
use crate::deltanet::{self, Form, Inputs};
use crate::error::{Error, Result};
use crate::linear::Linear;
use crate::ops::{gated_rms_norm, l2_normalize, repeat_interleave, sigmoid, silu, softplus};
use crate::schema::{Param, Schema};
use crate::taps::{Taps, names};
use crate::weights::WeightStore;
use candle_core::{DType, Tensor};

/// The fixed epsilon of the q/k l2 normalisation (not `rms_norm_eps`).
pub const L2_NORM_EPS: f64 = 1e-6;

/// The recurrent state of one linear-attention layer.
#[derive(Debug, Clone)]
pub struct LinearState {
    /// The last `K` inputs of the convolution (pre-conv `qkv` channels): `[C, K]`.
    pub conv: Tensor,
    /// The delta-rule state `[Hv, Dk, Dv]`.
    pub recurrent: Tensor,
}

/// Weights and sizes of one Gated DeltaNet layer.
#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    /// Depthwise kernel `[C, K]`; column `K - 1` multiplies the current token.
    conv_weight: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    norm_weight: Tensor,
    out_proj: Linear,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    kernel: usize,
    eps: f64,
}

/// Options of the mixer that do not change the result in exact arithmetic.
#[derive(Debug, Clone, Copy)]
pub struct DeltaNetOptions {
    /// The form of the recurrence.
    pub form: Form,
    /// The fp16 rescaling: `q` is multiplied by this inside the recurrence and the gated norm's eps by its square.
    /// `1` turns it off; the NPU port uses `1024`.
    pub output_scale: f64,
}

impl GatedDeltaNet {
    /// Loads layer `layer`'s `linear_attn.*` tensors.
    pub fn load(w: &WeightStore, layer: usize, c: &Config) -> Result<Self> {
        let s = Schema::new(c);
        let load = |p: Param| w.load(&s.layer(layer, p));
        let linear = |p: Param| w.linear(&s.layer(layer, p));
        let conv_dim = c.linear_conv_dim();
        let k = c.linear_conv_kernel_dim;
        Ok(GatedDeltaNet {
            in_proj_qkv: linear(Param::InProjQkv)?,
            in_proj_z: linear(Param::InProjZ)?,
            in_proj_b: linear(Param::InProjB)?,
            in_proj_a: linear(Param::InProjA)?,
            conv_weight: load(Param::Conv1d)?.reshape((conv_dim, k))?,
            a_log: load(Param::ALog)?,
            dt_bias: load(Param::DtBias)?,
            norm_weight: load(Param::LinearNorm)?,
            out_proj: linear(Param::OutProj)?,
            hk: c.linear_num_key_heads,
            hv: c.linear_num_value_heads,
            dk: c.linear_key_head_dim,
            dv: c.linear_value_head_dim,
            kernel: k,
            eps: c.rms_norm_eps,
        })
    }

    /// A zero state for this layer.
    pub fn zero_state(&self, dtype: DType) -> Result<LinearState> {
        let dev = self.a_log.device();
        let conv_dim = 2 * self.hk * self.dk + self.hv * self.dv;
        Ok(LinearState {
            conv: Tensor::zeros((conv_dim, self.kernel), dtype, dev)?,
            recurrent: Tensor::zeros((self.hv, self.dk, self.dv), dtype, dev)?,
        })
    }

    /// `x`: `[T, hidden]` (after the input norm) → `[T, hidden]`, updating `state`.
    ///
    /// Taps under `{tap}.` ([`names::LINEAR_ATTN_TAPS`]): the projections `qkv` `[T, C]`, `z` `[T, Hv, Dv]`, `b`,
    /// `a` `[T, Hv]`; `conv_output` `[T, C]` (before the SiLU); `query`, `key` `[T, Hk, Dk]` and `value`
    /// `[T, Hv, Dv]` (after conv and SiLU, before the l2 norm); `g`, `beta` `[T, Hv]`; `query_normed`, `key_normed`
    /// (after the l2 norm); `core_output` `[T, Hv, Dv]` (the recurrence's output before the gated norm, reported
    /// without the output scale) and `gated_norm_output` `[T, Hv, Dv]` (the `out_proj` input).
    pub fn forward(
        &self,
        x: &Tensor,
        state: &mut LinearState,
        opts: &DeltaNetOptions,
        taps: &mut Taps,
        tap: &str,
    ) -> Result<Tensor> {
        let (t, _) = x.dims2()?;
        let qkv = self.in_proj_qkv.forward(x)?;
        let z = self.in_proj_z.forward(x)?;
        let b = self.in_proj_b.forward(x)?;
        let a = self.in_proj_a.forward(x)?;
        let z = z.reshape((t, self.hv, self.dv))?;
        let tap_name = |name: &str| format!("{tap}.{name}");
        taps.record(|| tap_name(names::QKV), &qkv)?;
        taps.record(|| tap_name(names::Z), &z)?;
        taps.record(|| tap_name(names::B), &b)?;
        taps.record(|| tap_name(names::A), &a)?;

        let (conv_out, conv_state) = causal_conv(&qkv, &state.conv, &self.conv_weight)?;
        taps.record(|| tap_name(names::CONV_OUTPUT), &conv_out)?;
        let mixed = silu(&conv_out)?;
        let key_dim = self.hk * self.dk;
        let q = mixed
            .narrow(1, 0, key_dim)?
            .reshape((t, self.hk, self.dk))?;
        let k = mixed
            .narrow(1, key_dim, key_dim)?
            .reshape((t, self.hk, self.dk))?;
        let v = mixed
            .narrow(1, 2 * key_dim, self.hv * self.dv)?
            .reshape((t, self.hv, self.dv))?;

        let beta = sigmoid(&b)?;
        let g = self
            .a_log
            .exp()?
            .neg()?
            .unsqueeze(0)?
            .broadcast_mul(&softplus(&a.broadcast_add(&self.dt_bias)?)?)?;
        taps.record(|| tap_name(names::QUERY), &q)?;
        taps.record(|| tap_name(names::KEY), &k)?;
        taps.record(|| tap_name(names::VALUE), &v)?;
        taps.record(|| tap_name(names::G), &g)?;
        taps.record(|| tap_name(names::BETA), &beta)?;

        let scale = opts.output_scale;
        check_output_scale(scale)?;
        let q = l2_normalize(&q, L2_NORM_EPS)?;
        let k = l2_normalize(&k, L2_NORM_EPS)?;
        taps.record(|| tap_name(names::QUERY_NORMED), &q)?;
        taps.record(|| tap_name(names::KEY_NORMED), &k)?;
        let q = (q * ((self.dk as f64).powf(-0.5) * scale))?;
        let group = self.hv / self.hk;
        let heads_first = |x: Tensor| -> Result<Tensor> { Ok(x.transpose(0, 1)?.contiguous()?) };
        let inputs = Inputs {
            q: repeat_interleave(&heads_first(q)?, group, 0)?,
            k: repeat_interleave(&heads_first(k)?, group, 0)?,
            v: heads_first(v)?,
            g: heads_first(g)?,
            beta: heads_first(beta)?,
        };
        let (o, recurrent) = deltanet::run(opts.form, &inputs, &state.recurrent)?;
        let core = o.transpose(0, 1)?.contiguous()?; // [T, Hv, Dv]
        taps.record(|| tap_name(names::CORE_OUTPUT), &(&core / scale)?)?;

        let normed = gated_rms_norm(&core, &z, &self.norm_weight, self.eps * scale * scale)?;
        taps.record(|| tap_name(names::GATED_NORM_OUTPUT), &normed)?;
        let out = self
            .out_proj
            .forward(&normed.reshape((t, self.hv * self.dv))?)?;
        *state = LinearState {
            conv: conv_state,
            recurrent,
        };
        Ok(out)
    }
}

/// The NPU port's DeltaNet output rescaling (q × 1024 inside the recurrence, gated-norm eps × 1024²).
pub const PORT_OUTPUT_SCALE: f64 = 1024.0;

/// Largest accepted DeltaNet output scale (2^16; the NPU port uses 2^10).
pub const MAX_OUTPUT_SCALE: f64 = 65536.0;

/// The DeltaNet output rescaling must be a power of two in `1..=2^16`: only then is it exact (every product and sum
/// scales without rounding, and `eps · scale²` stays a normal f32), which is the whole point of the trick.
pub fn check_output_scale(scale: f64) -> Result<()> {
    let power_of_two = scale.is_finite() && scale >= 1.0 && scale.log2().fract() == 0.0;
    if !power_of_two || scale > MAX_OUTPUT_SCALE {
        return Err(Error::Input(format!(
            "output scale {scale}: must be a power of two from 1 to {MAX_OUTPUT_SCALE} (1 = off, the NPU port uses 1024)"
        )));
    }
    Ok(())
}

/// Depthwise causal convolution over time with a carried state, no bias.
///
/// `x`: `[T, C]` new inputs; `state`: `[C, K]` the previous `K` inputs (zeros at the start); `weight`: `[C, K]`.
/// `out[t, c] = Σ_j weight[c, j] · x[c, t − K + 1 + j]` (so `weight[:, K − 1]` multiplies the current token).
/// Returns `(out [T, C], new state [C, K])`, the new state being the last `K` inputs.
pub fn causal_conv(x: &Tensor, state: &Tensor, weight: &Tensor) -> Result<(Tensor, Tensor)> {
    let (t, c) = x.dims2()?;
    let (c2, k) = state.dims2()?;
    if c != c2 || weight.dims() != [c, k] {
        return Err(Error::Input(format!(
            "causal conv: input {:?}, state {:?} and weight {:?} disagree",
            x.dims(),
            state.dims(),
            weight.dims()
        )));
    }
    let full = Tensor::cat(&[&state.t()?, x], 0)?; // [K + T, C]
    let mut out = full
        .narrow(0, 1, t)?
        .broadcast_mul(&weight.narrow(1, 0, 1)?.t()?)?;
    for j in 1..k {
        out = (out
            + full
                .narrow(0, 1 + j, t)?
                .broadcast_mul(&weight.narrow(1, j, 1)?.t()?)?)?;
    }
    let new_state = full.narrow(0, t, k)?.t()?.contiguous()?;
    Ok((out, new_state))
}
