//! llama.cpp's CPU attention, as its default context runs it: K and V cached in f16, flash attention with the query
//! in f16 and an f16 accumulator (ggml's `ggml_compute_forward_flash_attn_ext_f16_one_chunk`, which the CPU takes
//! for fewer than 64 query rows a call and for decode; the tiled path of longer prompts accumulates in f32 and is
//! not modelled).
//!
//! Per query row (head `h`, its kv head `h / (H / Hkv)`): `q16 = f16(q)`; `M = −∞`, `S = 0`, `acc = 0` (f16); for each
//! key `j` the row may see, in order: `s = (k16_j · q16) · scale` in f32 ([`dot_f16`]); when `s > M`,
//! `acc ← f16(acc · e^{M − s})` ([`scale_f16`]), `S ← S · e^{M − s} + 1`, `M ← s`, `w = 1`; otherwise
//! `w = e^{s − M}`, `S ← S + w`; then `acc ← f16(acc + v16_j · w)` ([`mad_f16`]). The output is `f32(acc) · (1 / S)`.
//!
//! The vector kernels follow ggml's on a CPU with AVX-512F and no AVX512-FP16 (the fixtures' AMD Zen 4): 64 values
//! a step in four 16-lane f32 registers, each multiply-add fused, the tail (`n mod 64` values: all of them for a
//! head dim of 16) in scalar code, unfused, the dot's tail summed in f64. The order of the dot's sums and the
//! fusing decide f16 roundings of the accumulator (one ulp of f16 is 5e-4 relative), so they are kept: on AVX2
//! (32 a step) or AVX512-FP16 (f16 arithmetic) ggml rounds differently.

use half::f16;

/// Rounds to f16 and back (the KV cache's and the query's conversion: round to nearest even).
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// The sizes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Query heads `H`.
    pub heads: usize,
    /// Key/value heads `Hkv` (`H` a multiple of it).
    pub kv_heads: usize,
    /// New tokens `T`.
    pub tokens: usize,
    /// Cached keys and values `S` (the past and the new tokens: `S ≥ T`).
    pub keys: usize,
    /// Head dim `D`.
    pub head_dim: usize,
}

/// llama.cpp's CPU flash attention of `q` over the cache (see the module's doc).
///
/// # Shapes
/// - `q`: `[H, T, D]`, f32 (after the norm and RoPE; rounded to f16 here)
/// - `keys`, `values`: `[Hkv, S, D]`, values already f16 (the cache's)
/// - returns `[H, T, D]`
///
/// Query `t` is at position `S − T + t` and sees keys `0..=S − T + t`.
pub fn flash_attention_f16(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    shape: Shape,
    scale: f32,
) -> Vec<f32> {
    let Shape {
        heads,
        kv_heads,
        tokens,
        keys: s_len,
        head_dim: d,
    } = shape;
    let group = heads / kv_heads;
    let past = s_len - tokens;
    let mut out = vec![0f32; heads * tokens * d];
    let mut q16 = vec![0f32; d];
    let mut acc = vec![0f32; d];
    for h in 0..heads {
        let kv = h / group;
        let k_head = &keys[kv * s_len * d..(kv + 1) * s_len * d];
        let v_head = &values[kv * s_len * d..(kv + 1) * s_len * d];
        for t in 0..tokens {
            let row = &q[(h * tokens + t) * d..(h * tokens + t + 1) * d];
            for (a, &b) in q16.iter_mut().zip(row) {
                *a = round_f16(b);
            }
            acc.iter_mut().for_each(|a| *a = 0.0);
            let mut m = f32::NEG_INFINITY;
            let mut sum = 0f32;
            for j in 0..=past + t {
                let s = dot_f16(&k_head[j * d..(j + 1) * d], &q16) * scale;
                let mut ms = 1f32;
                let mut vs = 1f32;
                if s > m {
                    ms = (m - s).exp();
                    m = s;
                    scale_f16(&mut acc, ms);
                } else {
                    vs = (s - m).exp();
                }
                mad_f16(&mut acc, &v_head[j * d..(j + 1) * d], vs);
                sum = sum * ms + vs;
            }
            let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
            let o = &mut out[(h * tokens + t) * d..(h * tokens + t + 1) * d];
            for (o, &a) in o.iter_mut().zip(&acc) {
                *o = a * inv;
            }
        }
    }
    out
}

/// Values a step of ggml's f16 vector kernels with AVX-512F (`GGML_F16_STEP`): four registers of 16 f32 lanes.
const STEP: usize = 64;

/// ggml's `ggml_vec_dot_f16` of two rows of f16 values (held as f32): lane `l` of register `r` sums the products of
/// elements `64c + 16r + l` in increasing `c` (each product exact in f32), registers are added `(0 + 2) + (1 + 3)`,
/// the 16 lanes halved pairwise (`l + (l + 8)`, `+ 4`, `+ 2`, `+ 1`: `_mm512_reduce_add_ps`), and the tail added
/// in f64.
pub fn dot_f16(x: &[f32], y: &[f32]) -> f32 {
    let n = x.len().min(y.len());
    let np = n & !(STEP - 1);
    let mut reg = [[0f32; 16]; 4];
    for c in (0..np).step_by(STEP) {
        for (r, lanes) in reg.iter_mut().enumerate() {
            for (l, lane) in lanes.iter_mut().enumerate() {
                let i = c + 16 * r + l;
                *lane += x[i] * y[i];
            }
        }
    }
    let mut v = [0f32; 16];
    for l in 0..16 {
        v[l] = (reg[0][l] + reg[2][l]) + (reg[1][l] + reg[3][l]);
    }
    let mut width = 16;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            v[l] += v[l + width];
        }
    }
    let mut sum = v[0] as f64;
    for i in np..n {
        sum += (x[i] * y[i]) as f64;
    }
    sum as f32
}

/// ggml's `ggml_vec_scale_f16`: `y ← f16(y · v)`.
pub fn scale_f16(y: &mut [f32], v: f32) {
    y.iter_mut().for_each(|a| *a = round_f16(*a * v));
}

/// ggml's `ggml_vec_mad_f16`: `y ← f16(y + x · v)`, the multiply-add fused on the vector part (`n` rounded down to
/// 64), a rounded product then a rounded sum on the tail.
pub fn mad_f16(y: &mut [f32], x: &[f32], v: f32) {
    let np = y.len() & !(STEP - 1);
    for (i, (a, &b)) in y.iter_mut().zip(x).enumerate() {
        *a = if i < np {
            round_f16(b.mul_add(v, *a))
        } else {
            round_f16(*a + b * v)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain causal softmax attention in f64 (the oracle): the f16 model must come within f16 rounding of it.
    fn exact(q: &[f32], k: &[f32], v: &[f32], s: Shape, scale: f32) -> Vec<f64> {
        let d = s.head_dim;
        let past = s.keys - s.tokens;
        let mut out = vec![0f64; s.heads * s.tokens * d];
        for h in 0..s.heads {
            let kv = h / (s.heads / s.kv_heads);
            for t in 0..s.tokens {
                let qr = &q[(h * s.tokens + t) * d..][..d];
                let scores: Vec<f64> = (0..=past + t)
                    .map(|j| {
                        let kr = &k[(kv * s.keys + j) * d..][..d];
                        qr.iter()
                            .zip(kr)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|x| (x - mx).exp()).collect();
                let z: f64 = w.iter().sum();
                for (j, wj) in w.iter().enumerate() {
                    let vr = &v[(kv * s.keys + j) * d..][..d];
                    for i in 0..d {
                        out[(h * s.tokens + t) * d + i] += wj / z * vr[i] as f64;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn flash_attention_f16_is_softmax_attention_to_f16_rounding_and_rounds_its_accumulator() {
        let shape = Shape {
            heads: 4,
            kv_heads: 2,
            tokens: 3,
            keys: 5,
            head_dim: 16,
        };
        let val = |i: usize| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 2.0;
        let q: Vec<f32> = (0..4 * 3 * 16).map(val).collect();
        let k: Vec<f32> = (0..2 * 5 * 16).map(|i| round_f16(val(i + 11))).collect();
        let v: Vec<f32> = (0..2 * 5 * 16).map(|i| round_f16(val(i + 29))).collect();
        let got = flash_attention_f16(&q, &k, &v, shape, 0.25);
        let want = exact(&q, &k, &v, shape, 0.25);
        let worst = got
            .iter()
            .zip(&want)
            .map(|(&a, &b)| (a as f64 - b).abs())
            .fold(0f64, f64::max);
        // Within f16 rounding of values of magnitude ≤ 1 (a few ulps of 2^-11), yet not f32-exact: the accumulator
        // is rounded to f16 at every key.
        assert!(worst < 4e-3, "{worst}");
        assert!(worst > 1e-6, "{worst}");
        // The first query of the last head sees keys 0..=2 only: a later key's value does not reach it.
        let mut v2 = v.clone();
        v2[(5 - 1) * 16 + 16 * 5] = 100.0;
        let again = flash_attention_f16(&q, &k, &v2, shape, 0.25);
        assert_eq!(
            again[3 * 3 * 16..3 * 3 * 16 + 16],
            got[3 * 3 * 16..3 * 3 * 16 + 16]
        );
    }
}
