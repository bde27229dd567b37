//! Plain-memory f32 kernels of the chunked form (with forward substitution) and of the single-token matrix form:
//! the fast paths [`super::chunked`], [`super::step`] and [`super::run`] take for f32 CPU tensors.
//!
//! The math is the one [`super::chunk`] and [`super::step_candle`] state with tensor ops; only the evaluation differs:
//! - Heads are independent, so they are split across rayon tasks; each head walks its chunks in order, in
//!   per-head scratch buffers, with the state kept in place in the output buffer.
//! - Products are small blocked matrix products ([`super::tiles`]) on contiguous rows: each output is a chain of
//!   multiply-adds over the inner index in increasing order. Keys are transposed once per chunk so that `K Kᵀ`, `Q Kᵀ`
//!   and the state update `Kᵀ D` all read contiguous rows.
//! - The triangular system is not inverted: `(I + N) D = rhs` is solved by forward substitution, row `t` being
//!   `D_t = rhs_t − Σ_{j<t} N[t, j] D_j` (the sum in increasing `j`). That is the substitution [`super::tri_inverse`]
//!   performs, applied to the right-hand side instead of to the identity, so `(I + N)^-1` is never formed.
//! - The decays `exp(G_t − G_j)` are evaluated only for `j ≤ t` (log-space masking: an exponent above the diagonal
//!   is never formed, so strong decays cannot overflow), once per chunk for `N`, the output's intra-chunk term and
//!   the decays to the chunk's end. Their exponent is the sum `g_{j+1} + … + g_t` accumulated directly, not the
//!   difference of the cumulative sums `G_t − G_j`: that difference keeps the rounding error of the large `G`
//!   (about `|G|·2^-24`) however close `t` and `j` are, which with decays near −20 per token cost ~3e-5 of the
//!   outputs in f32 (see the tests); summed directly, the kernel stays at the sequential form's accuracy, as the
//!   tensor form does (its segment sums). `exp(G_t)` itself (the decay from the chunk's start) uses the cumulative
//!   sum, accumulated in order.
//! - A last block shorter than `block` is processed as a chunk of its own length. That is exactly what the padded,
//!   masked block of [`super::chunked`] computes: a padded token has `g = 0, beta = 0`, so its row of `N` and of the
//!   right-hand side are zero, its `D` row is zero, it adds nothing to the state, `G` does not move, and its outputs
//!   are dropped.
//!
//! The loops are plain Rust written so the compiler vectorises them (a [`super::tiles`] register tile is eight AVX2
//! accumulators). On x86-64 CPUs with AVX2 and FMA the same code is compiled with those features (checked at run
//! time) and each multiply-add is fused (one rounding); elsewhere it is rounded twice. Both are within f32 rounding
//! of the tensor forms; neither is bit-identical to them (candle sums its products in another order).
//!
//! Measured (T = 1024, Hv = 32, Dk = Dv = 128, a shared 2-core machine, runs of one binary interleaved): the
//! portable build 202 ms, the AVX2 one 77 ms. An AVX-512F build of the same source measured the same as AVX2
//! (76-81 ms both), so it is not kept; a 6 × 16 tile was slower (151 ms against 82-88 ms
//! in the runs before and after).

use super::Inputs;
use super::tiles::{COLS, Tri, gemm, madd};
use crate::error::{Error, Result};
use candle_core::{DType, Device, Storage, Tensor};
use rayon::prelude::*;

/// The sizes of one head's sequence.
#[derive(Debug, Clone, Copy)]
struct Dims {
    t: usize,
    dk: usize,
    dv: usize,
}

/// Whether the fast path applies: every tensor f32 and on the CPU.
pub(super) fn applies(x: &Inputs, state: &Tensor) -> bool {
    [&x.q, &x.k, &x.v, &x.g, &x.beta, state]
        .iter()
        .all(|t| t.dtype() == DType::F32 && t.device().is_cpu())
}

/// The chunked form with forward substitution over blocks of `block` tokens (f32 CPU tensors, see [`applies`]).
pub(super) fn chunked(x: &Inputs, state: &Tensor, block: usize) -> Result<(Tensor, Tensor)> {
    chunked_on(x, state, block, simd_available())
}

/// [`chunked`] on the AVX2 + FMA build of the kernel (`simd`, which the CPU must have) or the portable one.
fn chunked_on(x: &Inputs, state: &Tensor, block: usize, simd: bool) -> Result<(Tensor, Tensor)> {
    if block == 0 {
        return Err(Error::Input("chunk block size must be at least 1".into()));
    }
    over_heads(x, state, |x, o, s, dims| {
        chunked_head(x, o, s, dims, block, simd)
    })
}

/// The matrix form token by token (f32 CPU tensors, see [`applies`]): per token `[q;k]ᵀS` in one pass over `S`,
/// `delta = beta (v − d·kᵀS)`, `o = d·qᵀS + (q·k) delta`, `S' = d·S + k deltaᵀ`, with `d = exp(g)`.
pub(super) fn matrix(x: &Inputs, state: &Tensor) -> Result<(Tensor, Tensor)> {
    matrix_on(x, state, simd_available())
}

/// [`matrix`] on the AVX2 + FMA build of the kernel (`simd`, which the CPU must have) or the portable one.
fn matrix_on(x: &Inputs, state: &Tensor, simd: bool) -> Result<(Tensor, Tensor)> {
    over_heads(x, state, |x, o, s, dims| matrix_head(x, o, s, dims, simd))
}

/// Runs `head(x, o, S, dims)` for every head, split across the rayon threads, `S` starting as the head's incoming
/// state; returns `(o [H, T, Dv], S [H, Dk, Dv])`.
fn over_heads(
    x: &Inputs,
    state: &Tensor,
    head: impl Fn(Head, &mut [f32], &mut [f32], Dims) + Sync,
) -> Result<(Tensor, Tensor)> {
    let (h, t, dk, dv) = x.check(state)?;
    let dims = Dims { t, dk, dv };
    let (o, s) = with_slices(x, state, |[q, k, v, g, beta, s0]| {
        let mut o = vec![0f32; h * t * dv];
        let mut s = s0.to_vec();
        o.par_chunks_mut((t * dv).max(1))
            .zip(s.par_chunks_mut((dk * dv).max(1)))
            .enumerate()
            .for_each(|(i, (o, s))| head(head_inputs([q, k, v, g, beta], dims, i), o, s, dims));
        (o, s)
    })?;
    let cpu = Device::Cpu;
    Ok((
        Tensor::from_vec(o, (h, t, dv), &cpu)?,
        Tensor::from_vec(s, (h, dk, dv), &cpu)?,
    ))
}

/// Calls `f` on the values of `q, k, v, g, beta, state`, borrowed from their storage (contiguous copies first
/// where a tensor is a strided view).
fn with_slices<R>(x: &Inputs, state: &Tensor, f: impl FnOnce([&[f32]; 6]) -> R) -> Result<R> {
    let tensors = [&x.q, &x.k, &x.v, &x.g, &x.beta, state]
        .map(|t| t.contiguous())
        .into_iter()
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let mut slices: Vec<&[f32]> = Vec::with_capacity(6);
    for (storage, layout) in &guards {
        let Storage::Cpu(cpu) = &**storage else {
            return Err(Error::Input(
                "delta-rule kernel: tensor not on the CPU".into(),
            ));
        };
        let start = layout.start_offset();
        let values = cpu.as_slice::<f32>()?;
        slices.push(&values[start..start + layout.shape().elem_count()]);
    }
    let slices: [&[f32]; 6] = slices.try_into().expect("six tensors");
    Ok(f(slices))
}

/// One head's inputs: `q`, `k` `[T, Dk]`, `v` `[T, Dv]`, `g`, `beta` `[T]`.
#[derive(Clone, Copy)]
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
}

fn head_inputs<'a>([q, k, v, g, beta]: [&'a [f32]; 5], d: Dims, head: usize) -> Head<'a> {
    let (t, dk, dv) = (d.t, d.dk, d.dv);
    Head {
        q: &q[head * t * dk..(head + 1) * t * dk],
        k: &k[head * t * dk..(head + 1) * t * dk],
        v: &v[head * t * dv..(head + 1) * t * dv],
        g: &g[head * t..(head + 1) * t],
        beta: &beta[head * t..(head + 1) * t],
    }
}

/// Whether the AVX2 + FMA build of the kernels can run on this CPU.
fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// One head of the chunked form, updating `s` `[Dk, Dv]` in place and writing `o` `[T, Dv]`.
fn chunked_head(x: Head, o: &mut [f32], s: &mut [f32], d: Dims, block: usize, simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is true only when the CPU has AVX2 and FMA (`simd_available`).
        unsafe { x86::chunked_head(x, o, s, d, block) };
        return;
    }
    let _ = simd;
    chunked_head_impl::<false>(x, o, s, d, block);
}

/// One head of the matrix form, updating `s` `[Dk, Dv]` in place and writing `o` `[T, Dv]`.
fn matrix_head(x: Head, o: &mut [f32], s: &mut [f32], d: Dims, simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is true only when the CPU has AVX2 and FMA (`simd_available`).
        unsafe { x86::matrix_head(x, o, s, d) };
        return;
    }
    let _ = simd;
    matrix_head_impl::<false>(x, o, s, d);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Dims, Head};

    /// [`super::chunked_head_impl`] compiled for AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn chunked_head(
        x: Head,
        o: &mut [f32],
        s: &mut [f32],
        d: Dims,
        block: usize,
    ) {
        super::chunked_head_impl::<true>(x, o, s, d, block);
    }

    /// [`super::matrix_head_impl`] compiled for AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn matrix_head(x: Head, o: &mut [f32], s: &mut [f32], d: Dims) {
        super::matrix_head_impl::<true>(x, o, s, d);
    }
}

/// Per-head scratch of the chunked form, sized for chunks of up to `c` tokens.
struct Scratch {
    /// Chunk-local `G = cumsum(g)`: `[c]`.
    big_g: Vec<f32>,
    /// The chunk's keys transposed: `[Dk, c]` (row stride `c`).
    kt: Vec<f32>,
    /// `K Kᵀ`, then `N`: `[c, c]`.
    kk: Vec<f32>,
    /// `Q Kᵀ`, then the masked, decayed intra-chunk scores: `[c, c]`.
    qk: Vec<f32>,
    /// `exp(G_t − G_j)` for `j ≤ t`, the exponent summed directly: `[c, c]`.
    decay: Vec<f32>,
    /// `K S0`, then `diag(exp(G_last − G)) D`: `[c, Dv]`.
    ks: Vec<f32>,
    /// The right-hand side, then the solution `D`: `[c, Dv]`.
    delta: Vec<f32>,
}

#[inline(always)]
fn chunked_head_impl<const FMA: bool>(
    x: Head,
    o: &mut [f32],
    s: &mut [f32],
    d: Dims,
    block: usize,
) {
    let (t, dk, dv) = (d.t, d.dk, d.dv);
    let c = block.min(t);
    let mut w = Scratch {
        big_g: vec![0.0; c],
        kt: vec![0.0; dk * c],
        kk: vec![0.0; c * c],
        qk: vec![0.0; c * c],
        decay: vec![0.0; c * c],
        ks: vec![0.0; c * dv],
        delta: vec![0.0; c * dv],
    };
    let mut start = 0;
    while start < t {
        let len = c.min(t - start);
        let part = Head {
            q: &x.q[start * dk..(start + len) * dk],
            k: &x.k[start * dk..(start + len) * dk],
            v: &x.v[start * dv..(start + len) * dv],
            g: &x.g[start..start + len],
            beta: &x.beta[start..start + len],
        };
        chunk_impl::<FMA>(
            part,
            &mut o[start * dv..(start + len) * dv],
            s,
            &mut w,
            len,
            dk,
            dv,
        );
        start += len;
    }
}

/// One chunk of `l` tokens from state `s` (updated in place); `o` `[l, Dv]`. The formulas are [`super::chunk`]'s.
#[inline(always)]
fn chunk_impl<const FMA: bool>(
    x: Head,
    o: &mut [f32],
    s: &mut [f32],
    w: &mut Scratch,
    l: usize,
    dk: usize,
    dv: usize,
) {
    // G = cumsum(g), in order. The decays between two tokens of the chunk, exp(G_t − G_j) for j ≤ t only, take
    // their exponent as the sum g_{j+1} + … + g_t itself (accumulated from j = t down), not as the difference of
    // two cumulative sums: G_t and G_j carry an absolute rounding error of about |G|·2^-24, which their difference
    // keeps however small it is (with g near −20 per token, |G| reaches ~10³ in a chunk of 64 and the decays of
    // nearby tokens would be off by ~10^-4 relative).
    let mut acc = 0f32;
    for (gc, &gi) in w.big_g[..l].iter_mut().zip(x.g) {
        acc += gi;
        *gc = acc;
    }
    let big_g = &w.big_g[..l];
    let decay = &mut w.decay[..l * l];
    for i in 0..l {
        let row = &mut decay[i * l..i * l + i + 1];
        let mut exponent = 0f32;
        row[i] = 1.0;
        for j in (0..i).rev() {
            exponent += x.g[j + 1];
            row[j] = exponent.exp();
        }
    }

    // Kᵀ: [Dk, l].
    let kt = &mut w.kt[..dk * l];
    for (i, krow) in x.k.chunks_exact(dk).enumerate() {
        for (p, &kv) in krow.iter().enumerate() {
            kt[p * l + i] = kv;
        }
    }
    let kt = &w.kt[..dk * l];

    // K Kᵀ and Q Kᵀ (lower parts), K S0 and Q S0 (Q S0 straight into o).
    let kk = &mut w.kk[..l * l];
    kk.fill(0.0);
    gemm::<FMA>(x.k, kt, kk, (l, dk, l), Tri::LowerC);
    let qk = &mut w.qk[..l * l];
    qk.fill(0.0);
    gemm::<FMA>(x.q, kt, qk, (l, dk, l), Tri::LowerC);
    let ks = &mut w.ks[..l * dv];
    ks.fill(0.0);
    gemm::<FMA>(x.k, s, ks, (l, dk, dv), Tri::Full);
    o.fill(0.0);
    gemm::<FMA>(x.q, s, o, (l, dk, dv), Tri::Full);

    // N = diag(beta) [exp(G_t − G_j) k_t·k_j]_{j<t}; rhs = diag(beta) (V − diag(exp G) K S0).
    for i in 0..l {
        let b = x.beta[i];
        for j in 0..i {
            kk[i * l + j] = b * (decay[i * l + j] * kk[i * l + j]);
        }
    }
    let delta = &mut w.delta[..l * dv];
    for i in 0..l {
        let b = x.beta[i];
        let e = big_g[i].exp();
        for ((r, &vv), &kv) in delta[i * dv..(i + 1) * dv]
            .iter_mut()
            .zip(&x.v[i * dv..(i + 1) * dv])
            .zip(&ks[i * dv..(i + 1) * dv])
        {
            *r = b * (vv - e * kv);
        }
    }

    // (I + N) D = rhs by forward substitution, in place.
    solve_lower::<FMA>(kk, l, delta, dv);

    // O = diag(exp G) Q S0 + [exp(G_t − G_j) q_t·k_j]_{j≤t} D.
    for i in 0..l {
        let e = big_g[i].exp();
        for v in &mut o[i * dv..(i + 1) * dv] {
            *v *= e;
        }
        for j in 0..l {
            qk[i * l + j] = if j <= i {
                decay[i * l + j] * qk[i * l + j]
            } else {
                0.0
            };
        }
    }
    gemm::<FMA>(qk, delta, o, (l, l, dv), Tri::LowerA);

    // S_T = exp(G_last) S0 + Kᵀ diag(exp(G_last − G)) D, the decays to the end being the last row of `decay`.
    let e_last = big_g[l - 1].exp();
    for v in s.iter_mut() {
        *v *= e_last;
    }
    for i in 0..l {
        let e = decay[(l - 1) * l + i];
        for (dw, &dd) in ks[i * dv..(i + 1) * dv]
            .iter_mut()
            .zip(&delta[i * dv..(i + 1) * dv])
        {
            *dw = e * dd;
        }
    }
    gemm::<FMA>(kt, ks, s, (dk, l, dv), Tri::Full);
}

/// `(I + N) D = rhs` for strictly lower triangular `n` `[l, l]`, `d` `[l, Dv]` holding `rhs` on entry and `D` on
/// return: `D_t = rhs_t − Σ_{j<t} N[t, j] D_j`, summed in increasing `j`, a band of [`COLS`] columns at a time.
#[inline(always)]
fn solve_lower<const FMA: bool>(n: &[f32], l: usize, d: &mut [f32], dv: usize) {
    let mut c0 = 0;
    while c0 < dv {
        let width = COLS.min(dv - c0);
        for i in 1..l {
            let (done, rest) = d.split_at_mut(i * dv);
            let row = &mut rest[c0..c0 + width];
            if width == COLS {
                let mut acc = [0f32; COLS];
                acc.copy_from_slice(row);
                for (j, &nij) in n[i * l..i * l + i].iter().enumerate() {
                    let dj: &[f32; COLS] =
                        done[j * dv + c0..j * dv + c0 + COLS].try_into().unwrap();
                    for (a, &b) in acc.iter_mut().zip(dj) {
                        *a = madd::<FMA>(-nij, b, *a);
                    }
                }
                row.copy_from_slice(&acc);
            } else {
                for (j, &nij) in n[i * l..i * l + i].iter().enumerate() {
                    let dj = &done[j * dv + c0..j * dv + c0 + width];
                    for (a, &b) in row.iter_mut().zip(dj) {
                        *a = madd::<FMA>(-nij, b, *a);
                    }
                }
            }
        }
        c0 += width;
    }
}

/// One head of the matrix form over its `T` tokens (see [`matrix`]).
#[inline(always)]
fn matrix_head_impl<const FMA: bool>(x: Head, o: &mut [f32], s: &mut [f32], d: Dims) {
    let (dk, dv) = (d.dk, d.dv);
    let mut q_s = vec![0f32; dv];
    let mut k_s = vec![0f32; dv];
    let mut delta = vec![0f32; dv];
    for t in 0..d.t {
        let q = &x.q[t * dk..(t + 1) * dk];
        let k = &x.k[t * dk..(t + 1) * dk];
        let v = &x.v[t * dv..(t + 1) * dv];
        let decay = x.g[t].exp();
        let beta = x.beta[t];
        // qᵀS and kᵀS in one pass over the rows of S.
        q_s.fill(0.0);
        k_s.fill(0.0);
        for ((&qi, &ki), srow) in q.iter().zip(k).zip(s.chunks_exact(dv)) {
            for ((a, b), &sv) in q_s.iter_mut().zip(k_s.iter_mut()).zip(srow) {
                *a = madd::<FMA>(qi, sv, *a);
                *b = madd::<FMA>(ki, sv, *b);
            }
        }
        let mut qk = 0f32;
        for (&qi, &ki) in q.iter().zip(k) {
            qk = madd::<FMA>(qi, ki, qk);
        }
        for ((dl, &vv), &ksv) in delta.iter_mut().zip(v).zip(&k_s) {
            *dl = beta * (vv - ksv * decay);
        }
        for ((ov, &qsv), &dl) in o[t * dv..(t + 1) * dv].iter_mut().zip(&q_s).zip(&delta) {
            *ov = madd::<FMA>(qk, dl, qsv * decay);
        }
        // S' = d·S + k deltaᵀ.
        for (&ki, srow) in k.iter().zip(s.chunks_exact_mut(dv)) {
            for (sv, &dl) in srow.iter_mut().zip(&delta) {
                *sv = madd::<FMA>(ki, dl, *sv * decay);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The portable build against the AVX2 one and the tensor forms (the integration tests reach only the build
    //! this CPU selects).

    use super::*;
    use crate::deltanet::{chunked_candle, sequential, step_candle};
    use crate::synthetic::Rng;

    fn inputs(h: usize, t: usize, dk: usize, dv: usize, seed: u64) -> (Inputs, Tensor) {
        let mut rng = Rng::new(seed);
        let f = DType::F32;
        let unit = |x: Tensor| {
            let norm = x.sqr().unwrap().sum_keepdim(2).unwrap().sqrt().unwrap();
            x.broadcast_div(&norm).unwrap()
        };
        let q = (unit(rng.normal_tensor(&[h, t, dk], 1.0, f).unwrap()) * (dk as f64).powf(-0.5))
            .unwrap();
        let x = Inputs {
            q,
            k: unit(rng.normal_tensor(&[h, t, dk], 1.0, f).unwrap()),
            v: rng.normal_tensor(&[h, t, dv], 1.0, f).unwrap(),
            g: rng.uniform_tensor(&[h, t], -10.0, 0.0, f).unwrap(),
            beta: rng.uniform_tensor(&[h, t], 0.01, 0.99, f).unwrap(),
        };
        (x, rng.normal_tensor(&[h, dk, dv], 0.5, f).unwrap())
    }

    /// The largest difference relative to the expected tensor's largest magnitude.
    fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a.len(), b.len());
        let scale = b
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()))
            .max(f32::MIN_POSITIVE);
        let worst = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(a.iter().all(|v| v.is_finite()), "non-finite output");
        worst / scale
    }

    #[test]
    fn both_builds_equal_the_tensor_forms() {
        for (t, block, dk, dv) in [
            (1, 64, 8, 8),
            (5, 4, 9, 20),
            (65, 64, 16, 33),
            (70, 16, 32, 16),
        ] {
            let (x, s0) = inputs(3, t, dk, dv, t as u64);
            let (o_seq, s_seq) = sequential(&x, &s0).unwrap();
            let (o_ref, s_ref) =
                chunked_candle(&x, &s0, block, crate::deltanet::Inverse::Substitution).unwrap();
            let mut builds = vec![false];
            if simd_available() {
                builds.push(true);
            }
            for simd in builds {
                let what = format!("T {t}, block {block}, Dk {dk}, Dv {dv}, simd {simd}");
                let (o, s) = chunked_on(&x, &s0, block, simd).unwrap();
                for (name, a, b) in [
                    ("o", &o, &o_ref),
                    ("S", &s, &s_ref),
                    ("o", &o, &o_seq),
                    ("S", &s, &s_seq),
                ] {
                    let d = rel_diff(a, b);
                    assert!(d < 2e-5, "chunked {name}, {what}: {d:e}");
                }
                let (o, s) = matrix_on(&x, &s0, simd).unwrap();
                let d = (rel_diff(&o, &o_seq), rel_diff(&s, &s_seq));
                assert!(d.0 < 2e-5 && d.1 < 2e-5, "matrix, {what}: {d:?}");
                let first = x.narrow(0, 1).unwrap();
                let (o, s) = matrix_on(&first, &s0, simd).unwrap();
                let (o_step, s_step) = step_candle(&first, &s0).unwrap();
                let d = (rel_diff(&o, &o_step), rel_diff(&s, &s_step));
                assert!(d.0 < 2e-6 && d.1 < 2e-6, "one step, {what}: {d:?}");
            }
        }
    }
}
