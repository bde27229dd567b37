//! The static NPU-style graphs of the decoder, built from the same weights the reference loads.
//!
//! Every graph has static shapes and keeps its state explicit: the caller passes each layer's incoming conv state,
//! recurrent state or KV cache and receives the new ones, so every state can be compared with the reference.
//! Attention reads a static KV context of `context` slots plus the block's own keys, selected by an additive mask.
//!
//! # Per-layer graph (the probe's unit), `T` tokens
//! Inputs: `hidden` `[T, H]`; linear layers `conv_state` `[C, K]`, `recurrent_state` `[Hv, Dk, Dv]`,
//! `token_valid` `[T]` (1 real token, 0 padding); attention layers `past_keys`, `past_values` `[Hkv, CTX, D]`,
//! `attention_mask` `[T, CTX + T]` (0 or −inf), `positions` `[3, T]` (i64, MRoPE rows).
//! Outputs: `output` `[T, H]`, `mixer_output`, `mlp_output` `[T, H]`; linear layers `conv_state_out`,
//! `recurrent_state_out` and `linear_attn.{query, key, value, g, beta, core_output}` (`core_output` `[T, Hv, Dv]`
//! is the DeltaNet output before the gated norm, unscaled); attention layers `new_keys`, `new_values`
//! `[Hkv, T, D]` and `self_attn.gated_output`. The names match the dump format's, less the `layers.{i}.` prefix.
//!
//! # Decoder graph
//! Inputs `input_ids` `[T]` (i64), `token_valid`, `positions`, `attention_mask` and every layer's state as
//! `layers.{i}.{conv_state, recurrent_state, past_keys, past_values}`; outputs `logits` `[T, V]`, `embeddings`,
//! `final_norm`, every layer's outputs as `layers.{i}.{output, mixer_output, mlp_output, …}` and the new states as
//! `layers.{i}.{conv_state_out, recurrent_state_out, new_keys, new_values}`.

use crate::error::{Error, Result};
use crate::ir::{ElemType, Graph, Unary, Value};
use reference::config::{Config, LayerKind};
use reference::deltanet::Inverse;
use reference::linear_attn::L2_NORM_EPS;
use reference::quant::{QuantKind, Storage};
use reference::weights::WeightStore;

/// How a DeltaNet block is computed inside a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaNetGraphForm {
    /// The single-token matrix form (graphs of `T = 1`).
    Matrix,
    /// The chunkwise-parallel form over the whole block with the given triangular inverse.
    Chunked(Inverse),
    /// One `Loop` op stepping the recurrence token by token, as the optimum-intel export has it (runs on CPU;
    /// NPUs cannot run `Loop`).
    Loop,
}

/// Options of the graphs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GraphOptions {
    /// DeltaNet form for blocks of more than one token (one token always uses the matrix form).
    pub form: DeltaNetGraphForm,
    /// The fp16 rescaling of the DeltaNet output (q × S, gated-norm eps × S²); 1 turns it off.
    pub output_scale: f32,
    /// Static KV context of the attention layers.
    pub context: usize,
}

impl Default for GraphOptions {
    fn default() -> Self {
        GraphOptions {
            form: DeltaNetGraphForm::Chunked(Inverse::Doubling),
            output_scale: 1024.0,
            context: 1024,
        }
    }
}

/// Builds graphs for one checkpoint.
pub struct Builder<'a> {
    config: &'a Config,
    weights: &'a WeightStore,
    opts: GraphOptions,
}

/// The delta rule's inputs inside a graph, heads first (as `reference::deltanet::Inputs`): `q`, `k` `[Hv, T, Dk]`,
/// `v` `[Hv, T, Dv]`, log-decays `decay` and write strengths `beta` `[Hv, T]`.
#[derive(Debug, Clone, Copy)]
struct Recurrence {
    q: Value,
    k: Value,
    v: Value,
    decay: Value,
    beta: Value,
}

/// The inputs a layer reads inside a graph.
struct LayerInputs {
    hidden: Value,
    valid: Option<Value>,
    mask: Option<Value>,
    angles: Option<(Value, Value)>,
}

impl<'a> Builder<'a> {
    /// A builder over a parsed config and an open weight store (f32).
    pub fn new(config: &'a Config, weights: &'a WeightStore, opts: GraphOptions) -> Result<Self> {
        if opts.context == 0 {
            return Err(Error::Config(
                "the static context must hold at least one token".into(),
            ));
        }
        reference::linear_attn::check_output_scale(opts.output_scale as f64)?;
        Ok(Builder {
            config,
            weights,
            opts,
        })
    }

    /// The config the graphs are built for.
    pub fn config(&self) -> &Config {
        self.config
    }

    /// The options.
    pub fn options(&self) -> &GraphOptions {
        &self.opts
    }

    fn host(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.weights.decoder(name, shape)?;
        Ok(t.to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// A checkpoint matrix as an f32 value in the graph, stored as the weight store's format says: f32, f16
    /// (converted in the graph), or integer codes with f16 scales dequantized in the graph as
    /// `f32(code) * f32(scale)` (exact, and bit-identical to what the reference loads from the same store).
    fn matrix(&self, g: &mut Graph, full_name: &str, shape: &[usize]) -> Result<Value> {
        let w = self.weights;
        match w.storage(full_name, shape) {
            Storage::Float => {
                let data = w
                    .get(full_name, shape)?
                    .to_dtype(candle_core::DType::F32)?
                    .flatten_all()?;
                g.const_f32(&data.to_vec1::<f32>()?, shape)
            }
            Storage::F16 => {
                let data = w
                    .get(full_name, shape)?
                    .to_dtype(candle_core::DType::F32)?
                    .flatten_all()?;
                let h: Vec<half::f16> = data
                    .to_vec1::<f32>()?
                    .iter()
                    .map(|&x| half::f16::from_f32(x))
                    .collect();
                let c = g.const_f16(&h, shape)?;
                g.convert(c, ElemType::F32)
            }
            Storage::Int4Sym { .. } | Storage::Int8Sym => {
                let q = w.quantized(full_name, shape)?.ok_or_else(|| {
                    Error::graph(
                        g.name(),
                        format!("{full_name}: the store did not quantize it"),
                    )
                })?;
                let (rows, cols) = (q.rows(), q.cols());
                let [_, groups] = q.scale_shape();
                let group = cols / groups;
                let (ty, bytes) = match q.kind() {
                    QuantKind::Int4Sym { .. } => (ElemType::I4, q.packed_codes()),
                    QuantKind::Int8Sym => (ElemType::I8, q.packed_codes()),
                };
                let codes = g.constant_bytes(ty, &[rows, groups, group], &bytes)?;
                let codes = g.convert(codes, ElemType::F32)?;
                let scales = g.const_f16(q.scales(), &[rows, groups, 1])?;
                let scales = g.convert(scales, ElemType::F32)?;
                let deq = g.mul(codes, scales)?;
                g.reshape(deq, shape)
            }
        }
    }

    fn decoder_weight(&self, g: &mut Graph, name: &str, shape: &[usize]) -> Result<Value> {
        self.matrix(g, &format!("{}{name}", self.weights.prefix()), shape)
    }

    /// `x @ Wᵀ` for a checkpoint weight `[out, in]`.
    fn linear(&self, g: &mut Graph, x: Value, name: &str, out: usize, inp: usize) -> Result<Value> {
        let w = self.decoder_weight(g, name, &[out, inp])?;
        g.matmul(x, w, false, true)
    }

    /// `x * rsqrt(mean(x²) + eps)` over the last axis.
    fn normalize(g: &mut Graph, x: Value, eps: f32) -> Result<Value> {
        let rank = g.shape(x).len();
        let sq = g.mul(x, x)?;
        let mean = g.reduce_mean(sq, &[rank - 1], true)?;
        let e = g.scalar(eps)?;
        let var = g.add(mean, e)?;
        let root = g.unary(Unary::Sqrt, var)?;
        g.div(x, root)
    }

    /// Zero-centred RMSNorm: `normalize(x) * (1 + w)` (the `1 + w` folded on the host, exactly as the reference).
    fn rms_norm(&self, g: &mut Graph, x: Value, name: &str, dim: usize) -> Result<Value> {
        let w: Vec<f32> = self.host(name, &[dim])?.iter().map(|w| w + 1.0).collect();
        let n = Self::normalize(g, x, self.config.rms_norm_eps as f32)?;
        let wc = g.const_f32(&w, &[dim])?;
        g.mul(n, wc)
    }

    /// `x * rsqrt(sum(x²) + eps)` over the last axis.
    fn l2_normalize(g: &mut Graph, x: Value) -> Result<Value> {
        let rank = g.shape(x).len();
        let sq = g.mul(x, x)?;
        let sum = g.reduce_sum(sq, &[rank - 1], true)?;
        let e = g.scalar(L2_NORM_EPS as f32)?;
        let s = g.add(sum, e)?;
        let root = g.unary(Unary::Sqrt, s)?;
        g.div(x, root)
    }

    fn mlp(&self, g: &mut Graph, x: Value, layer: usize) -> Result<Value> {
        let (h, inner) = (self.config.hidden_size, self.config.intermediate_size);
        let p = format!("layers.{layer}.mlp");
        let gate = self.linear(g, x, &format!("{p}.gate_proj.weight"), inner, h)?;
        let gate = g.unary(Unary::Swish, gate)?;
        let up = self.linear(g, x, &format!("{p}.up_proj.weight"), inner, h)?;
        let hdn = g.mul(gate, up)?;
        self.linear(g, hdn, &format!("{p}.down_proj.weight"), h, inner)
    }

    /// The Gated DeltaNet mixer on `x` (already normalised). Records its outputs under `{prefix}`.
    fn deltanet(
        &self,
        g: &mut Graph,
        x: Value,
        valid: Value,
        layer: usize,
        prefix: &str,
    ) -> Result<Value> {
        let c = self.config;
        let t = g.shape(x)[0];
        let (hk, hv, dk, dv, k) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
            c.linear_conv_kernel_dim,
        );
        let (h, conv_dim, key_dim) = (c.hidden_size, c.linear_conv_dim(), c.linear_key_dim());
        let p = format!("layers.{layer}.linear_attn");
        let conv_state = g.parameter(
            &format!("{prefix}conv_state"),
            ElemType::F32,
            &[conv_dim, k],
        );
        let rec_state = g.parameter(
            &format!("{prefix}recurrent_state"),
            ElemType::F32,
            &[hv, dk, dv],
        );

        let qkv = self.linear(g, x, &format!("{p}.in_proj_qkv.weight"), conv_dim, h)?;
        let z = self.linear(g, x, &format!("{p}.in_proj_z.weight"), hv * dv, h)?;
        let b = self.linear(g, x, &format!("{p}.in_proj_b.weight"), hv, h)?;
        let a = self.linear(g, x, &format!("{p}.in_proj_a.weight"), hv, h)?;

        // Causal depthwise conv with the carried state: rows of [state; qkv], window of K ending at each token.
        let past = g.transpose(conv_state, &[1, 0])?; // [K, C]
        let full = g.concat(&[past, qkv], 0)?; // [K + T, C]
        let w = self.host(&format!("{p}.conv1d.weight"), &[conv_dim, 1, k])?;
        let mut conv = None;
        for j in 0..k {
            let column: Vec<f32> = (0..conv_dim).map(|ch| w[ch * k + j]).collect();
            let wj = g.const_f32(&column, &[conv_dim])?;
            let window = g.slice(full, 0, 1 + j, t)?;
            let term = g.mul(window, wj)?;
            conv = Some(match conv {
                None => term,
                Some(acc) => g.add(acc, term)?,
            });
        }
        let mixed = g.unary(Unary::Swish, conv.expect("K ≥ 1"))?;
        // The new conv state ends at the last real token: rows n_valid .. n_valid + K of [state; qkv].
        let n_valid = g.reduce_sum(valid, &[0], true)?;
        let n_valid = g.convert(n_valid, ElemType::I64)?;
        let offsets = g.const_i64(&(0..k as i64).collect::<Vec<_>>(), &[k])?;
        let rows = g.add(offsets, n_valid)?;
        let kept = g.gather(full, rows, 0)?; // [K, C]
        let conv_out = g.transpose(kept, &[1, 0])?;
        g.result(conv_out, &format!("{prefix}conv_state_out"))?;

        let q = g.slice(mixed, 1, 0, key_dim)?;
        let q = g.reshape(q, &[t, hk, dk])?;
        let kk = g.slice(mixed, 1, key_dim, key_dim)?;
        let kk = g.reshape(kk, &[t, hk, dk])?;
        let v = g.slice(mixed, 1, 2 * key_dim, hv * dv)?;
        let v = g.reshape(v, &[t, hv, dv])?;
        let tap = format!("{prefix}linear_attn.");
        g.result(q, &format!("{tap}query"))?;
        g.result(kk, &format!("{tap}key"))?;
        g.result(v, &format!("{tap}value"))?;

        let beta = g.unary(Unary::Sigmoid, b)?;
        let a_log = self.host(&format!("{p}.A_log"), &[hv])?;
        let dt_bias = self.host(&format!("{p}.dt_bias"), &[hv])?;
        let dt = g.const_f32(&dt_bias, &[hv])?;
        let sp = g.add(a, dt)?;
        let sp = g.unary(Unary::SoftPlus, sp)?;
        let neg_a: Vec<f32> = a_log.iter().map(|x| -x.exp()).collect();
        let neg_a = g.const_f32(&neg_a, &[hv])?;
        let gdecay = g.mul(sp, neg_a)?; // [T, Hv]
        g.result(gdecay, &format!("{tap}g"))?;
        g.result(beta, &format!("{tap}beta"))?;
        // Padding: g = 0, beta = 0 on invalid slots.
        let valid_col = g.reshape(valid, &[t, 1])?;
        let gdecay = g.mul(gdecay, valid_col)?;
        let beta = g.mul(beta, valid_col)?;

        let scale = self.opts.output_scale;
        let qn = Self::l2_normalize(g, q)?;
        let qs = g.scalar((dk as f32).powf(-0.5) * scale)?;
        let qn = g.mul(qn, qs)?;
        let kn = Self::l2_normalize(g, kk)?;
        // Value head j reads key head j / (Hv / Hk).
        let group = hv / hk;
        let heads: Vec<i64> = (0..hv).map(|j| (j / group) as i64).collect();
        let heads = g.const_i64(&heads, &[hv])?;
        let qn = g.gather(qn, heads, 1)?;
        let kn = g.gather(kn, heads, 1)?;
        let qh = g.transpose(qn, &[1, 0, 2])?; // [Hv, T, Dk]
        let kh = g.transpose(kn, &[1, 0, 2])?;
        let vh = g.transpose(v, &[1, 0, 2])?; // [Hv, T, Dv]
        let gh = g.transpose(gdecay, &[1, 0])?; // [Hv, T]
        let bh = g.transpose(beta, &[1, 0])?;

        let x = Recurrence {
            q: qh,
            k: kh,
            v: vh,
            decay: gh,
            beta: bh,
        };
        let (o, s_new) = if t == 1 {
            Self::matrix_step(g, x, rec_state)?
        } else {
            match self.opts.form {
                DeltaNetGraphForm::Matrix => Self::matrix_steps(g, x, rec_state)?,
                DeltaNetGraphForm::Chunked(inverse) => self.chunk(g, x, rec_state, inverse)?,
                DeltaNetGraphForm::Loop => Self::loop_steps(g, x, rec_state)?,
            }
        };
        g.result(s_new, &format!("{prefix}recurrent_state_out"))?;
        let core = g.transpose(o, &[1, 0, 2])?; // [T, Hv, Dv]
        let inv = g.scalar(1.0 / scale)?;
        let core_unscaled = g.mul(core, inv)?;
        g.result(core_unscaled, &format!("{tap}core_output"))?;

        let z = g.reshape(z, &[t, hv, dv])?;
        let eps = (c.rms_norm_eps as f32) * scale * scale;
        let normed = Self::normalize(g, core, eps)?;
        let nw = self.host(&format!("{p}.norm.weight"), &[dv])?;
        let nw = g.const_f32(&nw, &[dv])?;
        let normed = g.mul(normed, nw)?;
        let gate = g.unary(Unary::Swish, z)?;
        let gated = g.mul(normed, gate)?;
        let flat = g.reshape(gated, &[t, hv * dv])?;
        self.linear(g, flat, &format!("{p}.out_proj.weight"), h, hv * dv)
    }

    /// One token: `[q;k]ᵀS` in one product, `o = d·qᵀS + (q·k)·delta`, `S' = d·S + k deltaᵀ`.
    fn matrix_step(g: &mut Graph, x: Recurrence, s: Value) -> Result<(Value, Value)> {
        let Recurrence {
            q,
            k,
            v,
            decay: gd,
            beta,
        } = x;
        let hv = g.shape(q)[0];
        let qk = g.concat(&[q, k], 1)?; // [Hv, 2, Dk]
        let read = g.matmul(qk, s, false, false)?; // [Hv, 2, Dv]
        let q_s = g.slice(read, 1, 0, 1)?;
        let k_s = g.slice(read, 1, 1, 1)?;
        let d = g.unary(Unary::Exp, gd)?;
        let d = g.reshape(d, &[hv, 1, 1])?;
        let beta = g.reshape(beta, &[hv, 1, 1])?;
        let dk_s = g.mul(k_s, d)?;
        let diff = g.sub(v, dk_s)?;
        let delta = g.mul(diff, beta)?; // [Hv, 1, Dv]
        let qk_dot = g.mul(q, k)?;
        let qk_dot = g.reduce_sum(qk_dot, &[2], true)?; // [Hv, 1, 1]
        let a = g.mul(q_s, d)?;
        let bterm = g.mul(delta, qk_dot)?;
        let o = g.add(a, bterm)?;
        let ds = g.mul(s, d)?;
        let outer = g.matmul(k, delta, true, false)?; // [Hv, Dk, Dv]
        let s_new = g.add(ds, outer)?;
        Ok((o, s_new))
    }

    /// The matrix step unrolled over every token of the block.
    fn matrix_steps(g: &mut Graph, x: Recurrence, s: Value) -> Result<(Value, Value)> {
        let Recurrence {
            q,
            k,
            v,
            decay: gd,
            beta,
        } = x;
        let t = g.shape(q)[1];
        let mut s = s;
        let mut outs = Vec::with_capacity(t);
        for i in 0..t {
            let (qi, ki, vi) = (
                g.slice(q, 1, i, 1)?,
                g.slice(k, 1, i, 1)?,
                g.slice(v, 1, i, 1)?,
            );
            let (gi, bi) = (g.slice(gd, 1, i, 1)?, g.slice(beta, 1, i, 1)?);
            let step = Recurrence {
                q: qi,
                k: ki,
                v: vi,
                decay: gi,
                beta: bi,
            };
            let (o, s_next) = Self::matrix_step(g, step, s)?;
            outs.push(o);
            s = s_next;
        }
        Ok((g.concat(&outs, 1)?, s))
    }

    /// The recurrence as a `Loop` over tokens: `S ← exp(g) S; delta = beta (v − Sᵀk); S ← S + k deltaᵀ; o = Sᵀq`.
    fn loop_steps(g: &mut Graph, x: Recurrence, s: Value) -> Result<(Value, Value)> {
        let Recurrence {
            q,
            k,
            v,
            decay: gd,
            beta,
        } = x;
        let (hv, t, dk) = (g.shape(q)[0], g.shape(q)[1], g.shape(q)[2]);
        let dv = g.shape(v)[2];
        let mut b = Graph::new(&format!("{}_deltanet_loop", g.name()));
        let qt = b.parameter("q_t", ElemType::F32, &[hv, 1, dk]);
        let kt = b.parameter("k_t", ElemType::F32, &[hv, 1, dk]);
        let vt = b.parameter("v_t", ElemType::F32, &[hv, 1, dv]);
        let gt = b.parameter("g_t", ElemType::F32, &[hv, 1]);
        let bt = b.parameter("beta_t", ElemType::F32, &[hv, 1]);
        let st = b.parameter("state", ElemType::F32, &[hv, dk, dv]);
        let decay = b.unary(Unary::Exp, gt)?;
        let decay = b.reshape(decay, &[hv, 1, 1])?;
        let s1 = b.mul(st, decay)?;
        let recalled = b.matmul(kt, s1, false, false)?; // [Hv, 1, Dv]
        let diff = b.sub(vt, recalled)?;
        let strength = b.reshape(bt, &[hv, 1, 1])?;
        let delta = b.mul(diff, strength)?;
        let outer = b.matmul(kt, delta, true, false)?; // [Hv, Dk, Dv]
        let s2 = b.add(s1, outer)?;
        let o = b.matmul(qt, s2, false, false)?; // [Hv, 1, Dv]
        b.result(s2, "loop_state_out")?;
        b.result(o, "loop_o_t")?;
        use crate::ir::{LoopInput, LoopOutput};
        let outs = g.loop_op(
            t,
            b,
            &[
                (q, LoopInput::Sliced { axis: 1 }),
                (k, LoopInput::Sliced { axis: 1 }),
                (v, LoopInput::Sliced { axis: 1 }),
                (gd, LoopInput::Sliced { axis: 1 }),
                (beta, LoopInput::Sliced { axis: 1 }),
                (s, LoopInput::Merged { result: 0 }),
            ],
            &[
                LoopOutput::Concat { result: 1, axis: 1 },
                LoopOutput::Last { result: 0 },
            ],
        )?;
        Ok((outs[0], outs[1]))
    }

    /// The chunkwise-parallel form over the whole block (see `reference::deltanet::chunk`).
    fn chunk(
        &self,
        g: &mut Graph,
        x: Recurrence,
        s0: Value,
        inverse: Inverse,
    ) -> Result<(Value, Value)> {
        let Recurrence {
            q,
            k,
            v,
            decay: gd,
            beta,
        } = x;
        let (hv, t) = (g.shape(q)[0], g.shape(q)[1]);
        // G = cumsum(g) as a product with an upper-triangular matrix of ones.
        let upper: Vec<f32> = (0..t * t)
            .map(|i| if i / t <= i % t { 1.0 } else { 0.0 })
            .collect();
        let upper = g.const_f32(&upper, &[t, t])?;
        let big_g = g.matmul(gd, upper, false, false)?; // [Hv, T]
        let gt = g.reshape(big_g, &[hv, t, 1])?;
        let gj = g.reshape(big_g, &[hv, 1, t])?;
        let diff = g.sub(gt, gj)?; // [Hv, T(t), T(j)] = G_t − G_j
        let strict: Vec<f32> = (0..t * t)
            .map(|i| if i % t < i / t { 1.0 } else { 0.0 })
            .collect();
        let incl: Vec<f32> = (0..t * t)
            .map(|i| if i % t <= i / t { 1.0 } else { 0.0 })
            .collect();
        let strict = g.const_f32(&strict, &[t, t])?;
        let incl = g.const_f32(&incl, &[t, t])?;
        let masked_exp = |g: &mut Graph, mask: Value| -> Result<Value> {
            let zeroed = g.mul(diff, mask)?;
            let e = g.unary(Unary::Exp, zeroed)?;
            g.mul(e, mask)
        };
        let decay_strict = masked_exp(g, strict)?;
        let decay_incl = masked_exp(g, incl)?;

        let beta_col = g.reshape(beta, &[hv, t, 1])?;
        let kk = g.matmul(k, k, false, true)?;
        let n = g.mul(kk, decay_strict)?;
        let n = g.mul(n, beta_col)?;
        let a_inv = self.tri_inverse(g, n, inverse)?;

        let exp_g = g.unary(Unary::Exp, gt)?; // [Hv, T, 1]
        let k_s0 = g.matmul(k, s0, false, false)?;
        let k_s0 = g.mul(k_s0, exp_g)?;
        let rhs = g.sub(v, k_s0)?;
        let rhs = g.mul(rhs, beta_col)?;
        let deltas = g.matmul(a_inv, rhs, false, false)?; // [Hv, T, Dv]

        let q_s0 = g.matmul(q, s0, false, false)?;
        let q_s0 = g.mul(q_s0, exp_g)?;
        let qk = g.matmul(q, k, false, true)?;
        let intra = g.mul(qk, decay_incl)?;
        let intra = g.matmul(intra, deltas, false, false)?;
        let o = g.add(q_s0, intra)?;

        let g_last = g.slice(big_g, 1, t - 1, 1)?; // [Hv, 1]
        let to_end = g.sub(g_last, big_g)?;
        let to_end = g.unary(Unary::Exp, to_end)?;
        let to_end = g.reshape(to_end, &[hv, t, 1])?;
        let kw = g.mul(k, to_end)?;
        let update = g.matmul(kw, deltas, true, false)?; // [Hv, Dk, Dv]
        let decay_all = g.unary(Unary::Exp, g_last)?;
        let decay_all = g.reshape(decay_all, &[hv, 1, 1])?;
        let kept = g.mul(s0, decay_all)?;
        let s = g.add(kept, update)?;
        Ok((o, s))
    }

    /// `(I + N)^-1` for `N` `[Hv, n, n]` strictly lower triangular.
    fn tri_inverse(&self, g: &mut Graph, n: Value, method: Inverse) -> Result<Value> {
        let size = g.shape(n)[1];
        let eye: Vec<f32> = (0..size * size)
            .map(|i| if i / size == i % size { 1.0 } else { 0.0 })
            .collect();
        let eye = g.const_f32(&eye, &[size, size])?;
        match method {
            Inverse::Substitution => {
                // Row i of X is e_i − N[i, :i] X[:i, :].
                let mut x = g.slice(eye, 0, 0, 1)?;
                let hv = g.shape(n)[0];
                x = g.reshape(x, &[1, 1, size])?;
                let zeros = g.const_f32(&vec![0.0; hv * size], &[hv, 1, size])?;
                x = g.add(x, zeros)?; // [Hv, 1, n]
                for i in 1..size {
                    let row_n = g.slice(n, 1, i, 1)?;
                    let coeffs = g.slice(row_n, 2, 0, i)?; // [Hv, 1, i]
                    let prod = g.matmul(coeffs, x, false, false)?; // [Hv, 1, n]
                    let e = g.slice(eye, 0, i, 1)?;
                    let row = g.sub(e, prod)?;
                    x = g.concat(&[x, row], 1)?;
                }
                Ok(x)
            }
            Inverse::Doubling => {
                let a = g.add(n, eye)?;
                let mut x = eye;
                let mut s = 1;
                while s < size {
                    let band: Vec<f32> = (0..size * size)
                        .map(|idx| {
                            let (r, c) = (idx / size, idx % size);
                            if r / (2 * s) == c / (2 * s) && r / s != c / s && r > c {
                                1.0
                            } else {
                                0.0
                            }
                        })
                        .collect();
                    let band = g.const_f32(&band, &[size, size])?;
                    let cmat = g.mul(a, band)?;
                    let xc = g.matmul(x, cmat, false, false)?;
                    let xcx = g.matmul(xc, x, false, false)?;
                    x = g.sub(x, xcx)?;
                    s *= 2;
                }
                Ok(x)
            }
            Inverse::Series => {
                let mut p = g.sub(eye, n)?;
                let mut power = n;
                let mut covered = 2;
                while covered < size {
                    power = g.matmul(power, power, false, false)?;
                    let factor = g.add(eye, power)?;
                    p = g.matmul(p, factor, false, false)?;
                    covered *= 2;
                }
                Ok(p)
            }
        }
    }

    /// RoPE angle tables `(cos, sin)` `[T, rd]` from MRoPE positions `[3, T]` (i64).
    fn rotary(&self, g: &mut Graph, positions: Value) -> Result<(Value, Value)> {
        let rd = self.config.rotary_dim();
        let half = rd / 2;
        let rope = reference::rope::Rope::new(self.config);
        // angles = positionsᵀ M with M[r, i] = inv_freq_i where frequency i reads row r: one non-zero per column.
        let mut m = vec![0f32; 3 * half];
        for i in 0..half {
            m[rope.row_of(i) * half + i] = rope.inv_freq(i) as f32;
        }
        let m = g.const_f32(&m, &[3, half])?;
        let pos = g.convert(positions, ElemType::F32)?;
        let angles = g.matmul(pos, m, true, false)?; // [T, rd/2]
        let angles = g.concat(&[angles, angles], 1)?; // [T, rd]
        Ok((g.unary(Unary::Cos, angles)?, g.unary(Unary::Sin, angles)?))
    }

    /// Rotates the first `rd` dims of `x` `[T, heads, D]`.
    fn apply_rope(&self, g: &mut Graph, x: Value, cos: Value, sin: Value) -> Result<Value> {
        let (t, d) = (g.shape(x)[0], g.shape(x)[2]);
        let rd = self.config.rotary_dim();
        let rot = g.slice(x, 2, 0, rd)?;
        let x1 = g.slice(rot, 2, 0, rd / 2)?;
        let x2 = g.slice(rot, 2, rd / 2, rd / 2)?;
        let neg = g.unary(Unary::Negative, x2)?;
        let rotated = g.concat(&[neg, x1], 2)?;
        let cos = g.reshape(cos, &[t, 1, rd])?;
        let sin = g.reshape(sin, &[t, 1, rd])?;
        let a = g.mul(rot, cos)?;
        let b = g.mul(rotated, sin)?;
        let out = g.add(a, b)?;
        if rd == d {
            return Ok(out);
        }
        let pass = g.slice(x, 2, rd, d - rd)?;
        g.concat(&[out, pass], 2)
    }

    /// The gated attention mixer on `x` (already normalised).
    fn attention(
        &self,
        g: &mut Graph,
        x: Value,
        inputs: &LayerInputs,
        layer: usize,
        prefix: &str,
    ) -> Result<Value> {
        let c = self.config;
        let t = g.shape(x)[0];
        let (nh, nkv, d, h, ctx) = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.hidden_size,
            self.opts.context,
        );
        let p = format!("layers.{layer}.self_attn");
        let past_k = g.parameter(&format!("{prefix}past_keys"), ElemType::F32, &[nkv, ctx, d]);
        let past_v = g.parameter(
            &format!("{prefix}past_values"),
            ElemType::F32,
            &[nkv, ctx, d],
        );
        let (mask, (cos, sin)) = match (inputs.mask, inputs.angles) {
            (Some(m), Some(a)) => (m, a),
            _ => {
                return Err(Error::graph(
                    g.name(),
                    "attention needs a mask and positions",
                ));
            }
        };

        let qg = self.linear(g, x, &format!("{p}.q_proj.weight"), nh * d * 2, h)?;
        let qg = g.reshape(qg, &[t, nh, 2 * d])?;
        let q = g.slice(qg, 2, 0, d)?;
        let gate = g.slice(qg, 2, d, d)?;
        let gate = g.reshape(gate, &[t, nh * d])?;
        let k = self.linear(g, x, &format!("{p}.k_proj.weight"), nkv * d, h)?;
        let k = g.reshape(k, &[t, nkv, d])?;
        let v = self.linear(g, x, &format!("{p}.v_proj.weight"), nkv * d, h)?;
        let v = g.reshape(v, &[t, nkv, d])?;
        let q = self.rms_norm(g, q, &format!("{p}.q_norm.weight"), d)?;
        let k = self.rms_norm(g, k, &format!("{p}.k_norm.weight"), d)?;
        let q = self.apply_rope(g, q, cos, sin)?;
        let k = self.apply_rope(g, k, cos, sin)?;
        let q = g.transpose(q, &[1, 0, 2])?; // [H, T, D]
        let k = g.transpose(k, &[1, 0, 2])?; // [Hkv, T, D]
        let v = g.transpose(v, &[1, 0, 2])?;
        g.result(k, &format!("{prefix}new_keys"))?;
        g.result(v, &format!("{prefix}new_values"))?;
        let keys = g.concat(&[past_k, k], 1)?; // [Hkv, CTX + T, D]
        let values = g.concat(&[past_v, v], 1)?;
        // Query head h reads kv head h / (H / Hkv): group the query heads of each kv head.
        let group = nh / nkv;
        let qg = g.reshape(q, &[nkv, group * t, d])?;
        let scores = g.matmul(qg, keys, false, true)?; // [Hkv, G·T, CTX + T]
        let sc = g.scalar((d as f32).powf(-0.5))?;
        let scores = g.mul(scores, sc)?;
        let scores = g.reshape(scores, &[nkv, group, t, ctx + t])?;
        let scores = g.add(scores, mask)?;
        let probs = g.softmax(scores, 3)?;
        let probs = g.reshape(probs, &[nkv, group * t, ctx + t])?;
        let out = g.matmul(probs, values, false, false)?; // [Hkv, G·T, D]
        let out = g.reshape(out, &[nh, t, d])?;
        let out = g.transpose(out, &[1, 0, 2])?;
        let out = g.reshape(out, &[t, nh * d])?;
        let sg = g.unary(Unary::Sigmoid, gate)?;
        let gated = g.mul(out, sg)?;
        g.result(gated, &format!("{prefix}self_attn.gated_output"))?;
        self.linear(g, gated, &format!("{p}.o_proj.weight"), h, nh * d)
    }

    /// One decoder block on `inputs.hidden`; outputs recorded under `prefix`.
    fn block(
        &self,
        g: &mut Graph,
        inputs: &LayerInputs,
        layer: usize,
        prefix: &str,
    ) -> Result<Value> {
        let h = self.config.hidden_size;
        let x = self.rms_norm(
            g,
            inputs.hidden,
            &format!("layers.{layer}.input_layernorm.weight"),
            h,
        )?;
        let mixed = match self.config.layer_types[layer] {
            LayerKind::Linear => {
                let valid = inputs.valid.ok_or_else(|| {
                    Error::graph(g.name(), "a linear-attention layer needs token_valid")
                })?;
                self.deltanet(g, x, valid, layer, prefix)?
            }
            LayerKind::Full => self.attention(g, x, inputs, layer, prefix)?,
        };
        g.result(mixed, &format!("{prefix}mixer_output"))?;
        let hdn = g.add(inputs.hidden, mixed)?;
        let m_in = self.rms_norm(
            g,
            hdn,
            &format!("layers.{layer}.post_attention_layernorm.weight"),
            h,
        )?;
        let m = self.mlp(g, m_in, layer)?;
        g.result(m, &format!("{prefix}mlp_output"))?;
        g.add(hdn, m)
    }

    /// The per-layer graph of `layer` for blocks of `tokens` tokens (see the module docs for its interface).
    pub fn layer_graph(&self, layer: usize, tokens: usize) -> Result<Graph> {
        self.check_tokens(tokens)?;
        let c = self.config;
        let kind = *c.layer_types.get(layer).ok_or_else(|| {
            Error::Config(format!(
                "layer {layer} does not exist ({} layers)",
                c.num_layers()
            ))
        })?;
        let mut g = Graph::new(&format!("layer{layer}_{}_t{tokens}", kind.name()));
        let hidden = g.parameter("hidden", ElemType::F32, &[tokens, c.hidden_size]);
        let inputs = match kind {
            LayerKind::Linear => LayerInputs {
                hidden,
                valid: Some(g.parameter("token_valid", ElemType::F32, &[tokens])),
                mask: None,
                angles: None,
            },
            LayerKind::Full => {
                let mask = g.parameter(
                    "attention_mask",
                    ElemType::F32,
                    &[tokens, self.opts.context + tokens],
                );
                let positions = g.parameter("positions", ElemType::I64, &[3, tokens]);
                let angles = self.rotary(&mut g, positions)?;
                LayerInputs {
                    hidden,
                    valid: None,
                    mask: Some(mask),
                    angles: Some(angles),
                }
            }
        };
        let out = self.block(&mut g, &inputs, layer, "")?;
        g.result(out, "output")?;
        Ok(g)
    }

    /// The whole decoder for blocks of `tokens` tokens, every cache an explicit input and output.
    pub fn decoder_graph(&self, tokens: usize) -> Result<Graph> {
        self.check_tokens(tokens)?;
        let c = self.config;
        let mut g = Graph::new(&format!("decoder_t{tokens}"));
        let ids = g.parameter("input_ids", ElemType::I64, &[tokens]);
        let valid = g.parameter("token_valid", ElemType::F32, &[tokens]);
        let mask = g.parameter(
            "attention_mask",
            ElemType::F32,
            &[tokens, self.opts.context + tokens],
        );
        let positions = g.parameter("positions", ElemType::I64, &[3, tokens]);
        let angles = self.rotary(&mut g, positions)?;
        let embed = self.decoder_weight(
            &mut g,
            "embed_tokens.weight",
            &[c.vocab_size, c.hidden_size],
        )?;
        let mut hidden = g.gather(embed, ids, 0)?;
        g.result(hidden, "embeddings")?;
        for layer in 0..c.num_layers() {
            let inputs = LayerInputs {
                hidden,
                valid: Some(valid),
                mask: Some(mask),
                angles: Some(angles),
            };
            hidden = self.block(&mut g, &inputs, layer, &format!("layers.{layer}."))?;
            g.result(hidden, &format!("layers.{layer}.output"))?;
        }
        let normed = self.rms_norm(&mut g, hidden, "norm.weight", c.hidden_size)?;
        g.result(normed, "final_norm")?;
        let head = if c.tie_word_embeddings {
            embed
        } else {
            self.matrix(&mut g, "lm_head.weight", &[c.vocab_size, c.hidden_size])?
        };
        let logits = g.matmul(normed, head, false, true)?;
        g.result(logits, "logits")?;
        Ok(g)
    }

    fn check_tokens(&self, tokens: usize) -> Result<()> {
        if tokens == 0 {
            return Err(Error::Config("a graph needs at least one token".into()));
        }
        Ok(())
    }
}
