//! The gated delta rule, in every form a port uses, as pure functions over tensors.
//!
//! # Shapes
//! All kernels work on one sequence with value heads first (key heads already repeated to the value heads):
//! - `q`, `k`: `[Hv, T, Dk]`: `k` l2-normalised; `q` l2-normalised and scaled by `Dk^-0.5` (and by the output
//!   scale when the fp16 rescaling is on),
//! - `v`: `[Hv, T, Dv]`,
//! - `g`: `[Hv, T]` log-decays (≤ 0), `beta`: `[Hv, T]` in (0, 1),
//! - state `S`: `[Hv, Dk, Dv]`,
//! - output `o`: `[Hv, T, Dv]`.
//!
//! Per token: `S ← exp(g_t) S; delta = beta_t (v_t − Sᵀk_t); S ← S + k_t deltaᵀ; o_t = Sᵀq_t`.
//! [`sequential`] is that loop, the oracle. [`step`] is the single-token matrix form of the NPU decoder.
//! [`chunked`] processes blocks of tokens with a triangular inverse computed by one of three [`Inverse`] methods.
//!
//! Every form is written here with tensor ops ([`chunk`], [`step_candle`]): that is the readable statement of the
//! math, the one the FP16SIM and OpenVINO graphs mirror, and the only path in f64. For f32 CPU tensors, [`chunked`]
//! with forward substitution, [`step`] and the matrix form of [`run`] take plain-memory kernels instead (the
//! `kernel` module: the same formulas, heads across threads, no per-op overhead), held to these by tests.

mod kernel;
mod tiles;

use crate::error::{Error, Result};
use crate::masks;
use candle_core::{D, DType, Device, Tensor};

/// Tokens per chunk of the chunked form unless asked otherwise: transformers' `chunk_size`.
pub const DEFAULT_CHUNK: usize = 64;

/// The inputs of the delta rule for one sequence (see the module's shape block).
#[derive(Debug, Clone)]
pub struct Inputs {
    /// Queries `[Hv, T, Dk]`.
    pub q: Tensor,
    /// Keys `[Hv, T, Dk]`.
    pub k: Tensor,
    /// Values `[Hv, T, Dv]`.
    pub v: Tensor,
    /// Log-decays `[Hv, T]`.
    pub g: Tensor,
    /// Write strengths `[Hv, T]`.
    pub beta: Tensor,
}

/// How the triangular system `(I + N)` of a chunk is inverted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inverse {
    /// Row by row (what transformers' export path and candle's scan do).
    Substitution,
    /// Exact block doubling `(D + C)^-1 = D^-1 − D^-1 C D^-1` (the NPU port's choice).
    Doubling,
    /// The series `(I − N)(I + N²)(I + N⁴)…`: exact in exact arithmetic, unstable in fp16 with correlated keys.
    Series,
}

impl Inverse {
    /// All methods, for tests and option parsing.
    pub const ALL: [Inverse; 3] = [Inverse::Substitution, Inverse::Doubling, Inverse::Series];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Inverse::Substitution => "substitution",
            Inverse::Doubling => "doubling",
            Inverse::Series => "series",
        }
    }
}

/// A form of the recurrence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// Token by token, as written (the oracle).
    Sequential,
    /// Token by token in the NPU decoder's single-token matrix form.
    Matrix,
    /// Blocks of `block` tokens in the chunkwise-parallel form.
    Chunked {
        /// Tokens per block (any size ≥ 1).
        block: usize,
        /// The triangular inverse used in each block.
        inverse: Inverse,
    },
}

impl Form {
    /// A short description (`sequential`, `matrix`, `chunked(64, doubling)`).
    pub fn describe(&self) -> String {
        match self {
            Form::Sequential => "sequential".into(),
            Form::Matrix => "matrix".into(),
            Form::Chunked { block, inverse } => format!("chunked({block}, {})", inverse.name()),
        }
    }
}

impl Inputs {
    fn check(&self, state: &Tensor) -> Result<(usize, usize, usize, usize)> {
        let (h, t, dk) = self.q.dims3()?;
        let dv = self.v.dim(D::Minus1)?;
        let ok = self.k.dims() == [h, t, dk]
            && self.v.dims() == [h, t, dv]
            && self.g.dims() == [h, t]
            && self.beta.dims() == [h, t]
            && state.dims() == [h, dk, dv];
        if !ok {
            return Err(Error::Input(format!(
                "delta rule: inconsistent shapes q {:?} k {:?} v {:?} g {:?} beta {:?} state {:?}",
                self.q.dims(),
                self.k.dims(),
                self.v.dims(),
                self.g.dims(),
                self.beta.dims(),
                state.dims()
            )));
        }
        Ok((h, t, dk, dv))
    }

    /// Tokens `start..start + len`.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Inputs> {
        Ok(Inputs {
            q: self.q.narrow(1, start, len)?,
            k: self.k.narrow(1, start, len)?,
            v: self.v.narrow(1, start, len)?,
            g: self.g.narrow(1, start, len)?,
            beta: self.beta.narrow(1, start, len)?,
        })
    }

    /// Applies a `token_valid` mask `[T]` (1 = real token, 0 = padding): `g = 0, beta = 0` on padded slots, so they
    /// leave the state exactly as it was.
    pub fn mask_padding(&self, token_valid: &Tensor) -> Result<Inputs> {
        let valid = token_valid.to_dtype(self.g.dtype())?.unsqueeze(0)?;
        Ok(Inputs {
            q: self.q.clone(),
            k: self.k.clone(),
            v: self.v.clone(),
            g: self.g.broadcast_mul(&valid)?,
            beta: self.beta.broadcast_mul(&valid)?,
        })
    }

    /// Appends `pad` zero tokens and the matching `token_valid` mask (ones, then zeros).
    fn pad_to(&self, pad: usize) -> Result<(Inputs, Tensor)> {
        let t = self.g.dim(1)?;
        let dtype = self.g.dtype();
        let mut valid = vec![1f64; t];
        valid.resize(t + pad, 0.0);
        let valid = Tensor::from_vec(valid, t + pad, self.g.device())?.to_dtype(dtype)?;
        let padded = Inputs {
            q: self.q.pad_with_zeros(1, 0, pad)?,
            k: self.k.pad_with_zeros(1, 0, pad)?,
            v: self.v.pad_with_zeros(1, 0, pad)?,
            g: self.g.pad_with_zeros(1, 0, pad)?,
            beta: self.beta.pad_with_zeros(1, 0, pad)?,
        };
        Ok((padded, valid))
    }
}

/// Runs the recurrence over the whole input in the given form, from `state`; returns `(o, final state)`.
pub fn run(form: Form, x: &Inputs, state: &Tensor) -> Result<(Tensor, Tensor)> {
    match form {
        Form::Sequential => sequential(x, state),
        Form::Matrix if kernel::applies(x, state) => kernel::matrix(x, state),
        Form::Matrix => {
            let (_, t, _, _) = x.check(state)?;
            let mut s = state.clone();
            let mut outs = Vec::with_capacity(t);
            for i in 0..t {
                let (o, s_next) = step_candle(&x.narrow(i, 1)?, &s)?;
                outs.push(o);
                s = s_next;
            }
            Ok((Tensor::cat(&outs, 1)?, s))
        }
        Form::Chunked { block, inverse } => chunked(x, state, block, inverse),
    }
}

/// The recurrence token by token, exactly as written: the oracle every other form is held to.
pub fn sequential(x: &Inputs, state: &Tensor) -> Result<(Tensor, Tensor)> {
    let (h, t, dk, dv) = x.check(state)?;
    let mut s = state.clone();
    let mut outs = Vec::with_capacity(t);
    for i in 0..t {
        let q = x.q.narrow(1, i, 1)?; // [H, 1, Dk]
        let k = x.k.narrow(1, i, 1)?;
        let v = x.v.narrow(1, i, 1)?; // [H, 1, Dv]
        let decay = x.g.narrow(1, i, 1)?.exp()?.reshape((h, 1, 1))?;
        let beta = x.beta.narrow(1, i, 1)?.reshape((h, 1, 1))?;
        s = s.broadcast_mul(&decay)?;
        let recalled = k.matmul(&s)?; // Sᵀk as a row: [H, 1, Dv]
        let delta = (v - recalled)?.broadcast_mul(&beta)?;
        s = (s + k.reshape((h, dk, 1))?.matmul(&delta)?)?;
        outs.push(q.matmul(&s)?);
    }
    let o = if t == 0 {
        Tensor::zeros((h, 0, dv), x.v.dtype(), x.v.device())?
    } else {
        Tensor::cat(&outs, 1)?
    };
    Ok((o, s))
}

/// One token in the NPU decoder's matrix form: `[q;k]ᵀS` in one product, `o = d·qᵀS + (q·k)·delta`,
/// `S' = d·S + k deltaᵀ`, with `d = exp(g)`. Inputs hold `T = 1`; returns `(o [H,1,Dv], S')`. f32 CPU tensors take
/// the plain-memory kernel, everything else [`step_candle`].
pub fn step(x: &Inputs, state: &Tensor) -> Result<(Tensor, Tensor)> {
    one_token(x, state)?;
    if kernel::applies(x, state) {
        return kernel::matrix(x, state);
    }
    step_candle(x, state)
}

/// The sizes `(H, T, Dk, Dv)` of a single-token input; an error unless `T = 1`.
fn one_token(x: &Inputs, state: &Tensor) -> Result<(usize, usize, usize, usize)> {
    let dims = x.check(state)?;
    if dims.1 != 1 {
        return Err(Error::Input(format!(
            "the matrix step takes one token, got {}",
            dims.1
        )));
    }
    Ok(dims)
}

/// [`step`] written with tensor ops, for any dtype and device (the statement the f32 kernel is held to).
pub fn step_candle(x: &Inputs, state: &Tensor) -> Result<(Tensor, Tensor)> {
    let (h, _, dk, _) = one_token(x, state)?;
    let qk = Tensor::cat(&[&x.q, &x.k], 1)?; // [H, 2, Dk]
    let read = qk.matmul(state)?; // [H, 2, Dv]: qᵀS, kᵀS
    let q_s = read.narrow(1, 0, 1)?;
    let k_s = read.narrow(1, 1, 1)?;
    let d = x.g.exp()?.reshape((h, 1, 1))?;
    let beta = x.beta.reshape((h, 1, 1))?;
    let delta = (&x.v - k_s.broadcast_mul(&d)?)?.broadcast_mul(&beta)?;
    let qk_dot = (&x.q * &x.k)?.sum_keepdim(D::Minus1)?; // [H, 1, 1]
    let o = (q_s.broadcast_mul(&d)? + delta.broadcast_mul(&qk_dot)?)?;
    let s = (state.broadcast_mul(&d)? + x.k.reshape((h, dk, 1))?.matmul(&delta)?)?;
    Ok((o, s))
}

/// The chunkwise-parallel form over blocks of `block` tokens; the last block is padded and masked, so any length
/// and any block size give the sequential result. With forward substitution on f32 CPU tensors this runs the
/// plain-memory kernel; otherwise [`chunked_candle`]. Both sum each decay exponent `G_t − G_j` directly rather than
/// as a difference of cumulative sums, which keeps strong decays at the sequential form's accuracy.
pub fn chunked(
    x: &Inputs,
    state: &Tensor,
    block: usize,
    inverse: Inverse,
) -> Result<(Tensor, Tensor)> {
    if inverse == Inverse::Substitution && kernel::applies(x, state) {
        return kernel::chunked(x, state, block);
    }
    chunked_candle(x, state, block, inverse)
}

/// [`chunked`] written with tensor ops, block by block with [`chunk`], for any dtype, device and inverse (the
/// statement the f32 kernel is held to).
pub fn chunked_candle(
    x: &Inputs,
    state: &Tensor,
    block: usize,
    inverse: Inverse,
) -> Result<(Tensor, Tensor)> {
    let (_, t, _, _) = x.check(state)?;
    if block == 0 {
        return Err(Error::Input("chunk block size must be at least 1".into()));
    }
    let mut s = state.clone();
    let mut outs = Vec::new();
    let mut start = 0;
    while start < t {
        let len = block.min(t - start);
        let part = x.narrow(start, len)?;
        let (o, s_next) = if len == block {
            chunk(&part, &s, inverse, None)?
        } else {
            let (padded, valid) = part.pad_to(block - len)?;
            let (o, s_next) = chunk(&padded, &s, inverse, Some(&valid))?;
            (o.narrow(1, 0, len)?, s_next)
        };
        outs.push(o);
        s = s_next;
        start += len;
    }
    if outs.is_empty() {
        return sequential(x, state);
    }
    Ok((Tensor::cat(&outs, 1)?, s))
}

/// One block of the chunkwise-parallel form, from incoming state `S0`, with an optional `token_valid` mask `[T]`.
/// With `G = cumsum(g)`:
/// ```text
/// N   = diag(beta) [exp(G_t − G_j) k_t·k_j]_{j<t}
/// D   = (I + N)^-1 diag(beta) (V − diag(exp G) K S0)
/// O   = diag(exp G) Q S0 + [exp(G_t − G_j) q_t·k_j]_{j<=t} D
/// S_T = exp(G_T) S0 + Kᵀ diag(exp(G_T − G)) D
/// ```
/// `G_t − G_j` is evaluated as the segment sum `g_{j+1} + … + g_t` ([`segment_sums`]), which keeps strong decays
/// at the sequential form's accuracy, and is masked in log space (zero above the diagonal before `exp`), so they
/// cannot overflow either.
pub fn chunk(
    x: &Inputs,
    state: &Tensor,
    inverse: Inverse,
    token_valid: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let masked;
    let x = match token_valid {
        Some(valid) => {
            masked = x.mask_padding(valid)?;
            &masked
        }
        None => x,
    };
    let (h, t, _, _) = x.check(state)?;
    let dtype = x.g.dtype();
    let dev = x.g.device();

    let big_g = cumsum(&x.g)?; // [H, T]
    let strict = mask_tensor(masks::causal(t, false), t, dtype, dev)?;
    let inclusive = mask_tensor(masks::causal(t, true), t, dtype, dev)?;
    let seg = segment_sums(&x.g, &strict, &inclusive)?; // [H, T(t), T(j)] = G_t − G_j, summed directly
    let decay_strict = masked_exp(&seg, &strict)?;
    let decay_incl = masked_exp(&seg, &inclusive)?;

    let beta = x.beta.unsqueeze(2)?; // [H, T, 1]
    let kt = x.k.transpose(1, 2)?;
    let n = (x.k.matmul(&kt)? * decay_strict)?.broadcast_mul(&beta)?;
    let a_inv = tri_inverse(&n, inverse)?;

    let exp_g = big_g.exp()?.unsqueeze(2)?; // [H, T, 1]
    let k_s0 = x.k.matmul(state)?; // [H, T, Dv]
    let rhs = (&x.v - k_s0.broadcast_mul(&exp_g)?)?.broadcast_mul(&beta)?;
    let deltas = a_inv.matmul(&rhs)?; // [H, T, Dv]

    let q_s0 = x.q.matmul(state)?.broadcast_mul(&exp_g)?;
    let intra = (x.q.matmul(&kt)? * &decay_incl)?;
    let o = (q_s0 + intra.matmul(&deltas)?)?;

    let g_last = big_g.narrow(1, t - 1, 1)?; // [H, 1]
    // exp(G_T − G_t): [H, T, 1], the last row of the decays (its exponent summed directly too).
    let to_end = decay_incl.narrow(1, t - 1, 1)?.transpose(1, 2)?;
    let k_weighted = x.k.broadcast_mul(&to_end)?;
    let s = (state.broadcast_mul(&g_last.exp()?.reshape((h, 1, 1))?)?
        + k_weighted.transpose(1, 2)?.matmul(&deltas)?)?;
    Ok((o, s))
}

/// The exponents of the decays between two tokens of a block, `[H, T(t), T(j)]`: `g_{j+1} + … + g_t` for `j < t`
/// and exactly 0 elsewhere, as the product `inclusive · (g ⊙ strict)` (`Σ_i [i ≤ t] g_i [j < i]`).
///
/// Not `G_t − G_j`: the cumulative sums carry an absolute rounding error of about `|G|·ε` (ε the dtype's), which
/// their difference keeps however close `t` and `j` are, so with strong decays the decay between neighbours
/// would be off by `|G|·ε` relative (f32, −20 per token, a block of 64: `|G|` ≈ 1.3e3, about 1e-4). Each entry
/// here sums only its own terms, all of one sign (`g ≤ 0`), so its error is relative to itself. The diagonal and
/// above are exact zeros by construction.
fn segment_sums(g: &Tensor, strict: &Tensor, inclusive: &Tensor) -> Result<Tensor> {
    let terms = g.unsqueeze(2)?.broadcast_mul(strict)?; // [H, T(i), T(j)] = g_i [j < i]
    Ok(inclusive.broadcast_matmul(&terms)?)
}

/// Cumulative sum along the token axis of `[H, T]`, accumulated in order.
fn cumsum(g: &Tensor) -> Result<Tensor> {
    fn rows<T: candle_core::WithDType>(g: &Tensor) -> Result<Tensor> {
        let mut v: Vec<Vec<T>> = g.to_vec2()?;
        for row in &mut v {
            for i in 1..row.len() {
                let prev = row[i - 1];
                row[i] += prev;
            }
        }
        Ok(Tensor::new(v, g.device())?)
    }
    match g.dtype() {
        DType::F32 if g.dim(1)? > 0 => return rows::<f32>(g),
        DType::F64 if g.dim(1)? > 0 => return rows::<f64>(g),
        _ => {}
    }
    let t = g.dim(1)?;
    let mut acc = g.narrow(1, 0, 1)?;
    let mut cols = vec![acc.clone()];
    for i in 1..t {
        acc = (acc + g.narrow(1, i, 1)?)?;
        cols.push(acc.clone());
    }
    Ok(Tensor::cat(&cols, 1)?)
}

/// A square `[n, n]` mask (see [`crate::masks`]) as a tensor of `dtype`.
fn mask_tensor(values: Vec<f64>, n: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::from_vec(values, (n, n), dev)?.to_dtype(dtype)?)
}

/// `exp(x)` where `mask` is 1 and exactly 0 elsewhere; masked entries are zeroed before `exp`, so a positive
/// exponent above the diagonal can never overflow into `inf · 0 = NaN`.
fn masked_exp(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok(x.broadcast_mul(mask)?.exp()?.broadcast_mul(mask)?)
}

/// `(I + N)^-1` for a batch `[H, n, n]` of strictly lower triangular `N`, by the chosen method.
pub fn tri_inverse(n: &Tensor, method: Inverse) -> Result<Tensor> {
    let (h, size, size2) = n.dims3()?;
    if size != size2 {
        return Err(Error::Input(format!(
            "tri_inverse: {:?} is not square",
            n.dims()
        )));
    }
    let dtype = n.dtype();
    let dev = n.device();
    let eye = Tensor::eye(size, dtype, dev)?
        .unsqueeze(0)?
        .broadcast_as((h, size, size))?;
    match method {
        Inverse::Substitution if matches!(dtype, DType::F32 | DType::F64) && size > 0 => {
            match dtype {
                DType::F32 => substitution::<f32>(n),
                _ => substitution::<f64>(n),
            }
        }
        Inverse::Substitution => {
            // Row i of X = (I + N)^-1 is e_i − N[i, :i] X[:i, :].
            let mut x = eye.narrow(1, 0, 1)?.contiguous()?;
            for i in 1..size {
                let coeffs = n.narrow(1, i, 1)?.narrow(2, 0, i)?; // [H, 1, i]
                let row = (eye.narrow(1, i, 1)? - coeffs.matmul(&x)?)?;
                x = Tensor::cat(&[&x, &row], 1)?;
            }
            Ok(x)
        }
        Inverse::Doubling => {
            // X starts as the inverse of the unit diagonal; each pass doubles the block size of the sub-inverse.
            let a = (&eye + n)?;
            let mut x = eye.contiguous()?;
            let mut s = 1;
            while s < size {
                // The lower off-diagonal halves of the 2s blocks.
                let off = mask_tensor(masks::block_band(size, s), size, dtype, dev)?;
                let c = a.broadcast_mul(&off)?;
                x = (&x - x.matmul(&c)?.matmul(&x)?)?;
                s *= 2;
            }
            Ok(x)
        }
        Inverse::Series => {
            let mut p = (&eye - n)?;
            let mut power = n.clone();
            let mut covered = 2;
            while covered < size {
                power = power.matmul(&power)?;
                p = p.matmul(&(&eye + &power)?)?;
                covered *= 2;
            }
            Ok(p)
        }
    }
}

/// Forward substitution on plain memory, one head per rayon task: row `i` of `X = (I + N)^-1` is
/// `e_i − Σ_{j<i} N[i, j] X[j, :]`, the sum taken in increasing `j` (only columns `≤ i` are non-zero).
fn substitution<T: candle_core::WithDType>(n: &Tensor) -> Result<Tensor> {
    use rayon::prelude::*;
    let (h, size, _) = n.dims3()?;
    let values: Vec<T> = n.contiguous()?.flatten_all()?.to_vec1()?;
    let mut x = vec![T::zero(); h * size * size];
    x.par_chunks_mut(size * size)
        .zip(values.par_chunks(size * size))
        .for_each(|(x, n)| {
            for i in 0..size {
                let (done, rest) = x.split_at_mut(i * size);
                let row = &mut rest[..size];
                for j in 0..i {
                    let c = n[i * size + j];
                    let xj = &done[j * size..j * size + j + 1];
                    for (r, &v) in row[..=j].iter_mut().zip(xj) {
                        *r -= c * v;
                    }
                }
                row[i] += T::one();
            }
        });
    Ok(Tensor::from_vec(x, (h, size, size), n.device())?)
}
