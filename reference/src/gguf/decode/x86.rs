//! The AVX2 decoders ([`super::Decoder::Avx2`]) of the common weight types: F16, BF16, Q4_0, Q8_0, Q4_K, Q5_K and
//! Q6_K, eight values a register.
//!
//! Each computes, per value, exactly the f32 operations of the scalar decoder (ggml's `dequantize_row_*`, candle's
//! `to_float`) on the same operands: the block's scales widened from f16 as the scalar code widens them, the
//! per-sub-block factors (`d · sc`, `dmin · m`) computed as scalars in the same order, then the code converted to
//! f32 (exact: a small integer) and multiplied, and for the K-quants with a minimum the product less it, each
//! operation rounded once (no fused multiply-add, as the scalar code has none). So every value has the scalar
//! decoder's bits, NaNs and infinities included (the only operand that can be one is a scale, never two at once).

use super::super::types::GgmlType;
use super::f16_at;
use std::arch::x86_64::*;

/// Decodes `bytes`, whole blocks of `ty`, into `out` (exactly their values).
///
/// # Safety
/// The CPU has AVX2 and F16C, and `ty` is one of the types [`super::Decoder::Avx2`] vectorises.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn decode(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(
        bytes.len() / ty.block_bytes() * ty.block_elems(),
        out.len(),
        "{ty}: whole blocks and their values"
    );
    let blocks = bytes
        .chunks_exact(ty.block_bytes())
        .zip(out.chunks_exact_mut(ty.block_elems()));
    // SAFETY (every arm): the caller's guarantee; each block and its values have the type's sizes.
    unsafe {
        match ty {
            GgmlType::F16 => f16s(bytes, out),
            GgmlType::BF16 => bf16s(bytes, out),
            GgmlType::Q4_0 => blocks.for_each(|(b, o)| q4_0(b, o)),
            GgmlType::Q8_0 => blocks.for_each(|(b, o)| q8_0(b, o)),
            GgmlType::Q4_K => blocks.for_each(|(b, o)| q4_k(b, o)),
            GgmlType::Q5_K => blocks.for_each(|(b, o)| q5_k(b, o)),
            GgmlType::Q6_K => blocks.for_each(|(b, o)| q6_k(b, o)),
            other => unreachable!("{other} has no AVX2 decoder"),
        }
    }
}

/// Bytes `at..at + 8` of `block`, each zero-extended to a 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn u8x8(block: &[u8], at: usize) -> __m256i {
    assert!(at + 8 <= block.len());
    // SAFETY: the 8 bytes read are inside `block` (asserted); the load is unaligned.
    unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(block.as_ptr().add(at) as *const __m128i)) }
}

/// Stores `v` at `out[at..at + 8]`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn store(out: &mut [f32], at: usize, v: __m256) {
    assert!(at + 8 <= out.len());
    // SAFETY: the 8 values written are inside `out` (asserted); the store is unaligned.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(at), v) }
}

/// Eight 32-bit integer codes as f32 (exact: they are small).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn float(v: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(v)
}

/// `d · q` per lane (`q` the code, `d` the block's factor): the scalar decoders' `q as f32 * d`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn scaled(q: __m256i, d: __m256) -> __m256 {
    _mm256_mul_ps(float(q), d)
}

/// `d · q − m` per lane, the product rounded, then the difference: the K-quants' `d1 * q as f32 - m1`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn scaled_less(q: __m256i, d: __m256, m: __m256) -> __m256 {
    _mm256_sub_ps(_mm256_mul_ps(d, float(q)), m)
}

/// F16 values, eight at a time with `vcvtph2ps` (exact; NaNs come out quiet, as the scalar path's).
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16s(bytes: &[u8], out: &mut [f32]) {
    let main = out.len() / 8 * 8;
    for i in (0..main).step_by(8) {
        // SAFETY: values `i..i + 8` are bytes `2i..2i + 16`, inside `bytes` (`bytes.len() == 2 · out.len()`).
        let v = unsafe {
            _mm256_cvtph_ps(_mm_loadu_si128(bytes.as_ptr().add(2 * i) as *const __m128i))
        };
        // SAFETY: inside `out`.
        unsafe { store(out, i, v) };
    }
    for (i, v) in out.iter_mut().enumerate().skip(main) {
        *v = f16_at(bytes, 2 * i);
    }
}

/// BF16 values, eight at a time: each 16 bits moved to the top of an f32.
#[target_feature(enable = "avx2,f16c")]
unsafe fn bf16s(bytes: &[u8], out: &mut [f32]) {
    let main = out.len() / 8 * 8;
    for i in (0..main).step_by(8) {
        // SAFETY: values `i..i + 8` are bytes `2i..2i + 16`, inside `bytes`.
        let h = unsafe { _mm_loadu_si128(bytes.as_ptr().add(2 * i) as *const __m128i) };
        let v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        // SAFETY: inside `out`.
        unsafe { store(out, i, v) };
    }
    for i in main..out.len() {
        out[i] =
            f32::from_bits(u32::from(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])) << 16);
    }
}

/// Q4_0 (18 bytes, 32 values): `d` (f16), then 16 bytes whose low nibbles are values 0..16 and high nibbles values
/// 16..32, each `(nibble − 8) · d`.
#[target_feature(enable = "avx2,f16c")]
unsafe fn q4_0(block: &[u8], out: &mut [f32]) {
    let d = _mm256_set1_ps(f16_at(block, 0));
    let (mask, eight) = (_mm256_set1_epi32(0xF), _mm256_set1_epi32(8));
    for k in 0..2 {
        // SAFETY: bytes `2 + 8k..2 + 8k + 8` of the block, values inside its 32.
        unsafe {
            let q = u8x8(block, 2 + 8 * k);
            let low = _mm256_sub_epi32(_mm256_and_si256(q, mask), eight);
            let high = _mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight);
            store(out, 8 * k, scaled(low, d));
            store(out, 16 + 8 * k, scaled(high, d));
        }
    }
}

/// Q8_0 (34 bytes, 32 values): `d` (f16), then 32 signed codes, each `q · d`.
#[target_feature(enable = "avx2,f16c")]
unsafe fn q8_0(block: &[u8], out: &mut [f32]) {
    let d = _mm256_set1_ps(f16_at(block, 0));
    for k in 0..4 {
        assert!(2 + 8 * k + 8 <= block.len());
        // SAFETY: bytes `2 + 8k..2 + 8k + 8` of the block (asserted), values inside its 32.
        unsafe {
            let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                block.as_ptr().add(2 + 8 * k) as *const __m128i
            ));
            store(out, 8 * k, scaled(q, d));
        }
    }
}

/// The 6-bit scale and minimum of sub-block `j` (of 8) of a Q4_K or Q5_K block's 12 scale bytes (ggml's
/// `get_scale_min_k4`).
#[inline]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The factors `d · sc` and `dmin · m` of sub-block `j` of a Q4_K or Q5_K block, each in every lane, computed as
/// the scalar decoder computes them.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn factors(d: f32, min: f32, scales: &[u8], j: usize) -> (__m256, __m256) {
    let (sc, m) = scale_min_k4(j, scales);
    (
        _mm256_set1_ps(d * sc as f32),
        _mm256_set1_ps(min * m as f32),
    )
}

/// Q4_K (144 bytes, 256 values): `d`, `dmin` (f16), 12 bytes of 6-bit scales and minimums, 128 bytes of codes. Per
/// 64 values `j`: 32 bytes whose low nibbles are values `64j..64j + 32` (sub-block `2j`) and high nibbles the next
/// 32 (sub-block `2j + 1`), each `(d · sc) · q − dmin · m`.
#[target_feature(enable = "avx2,f16c")]
unsafe fn q4_k(block: &[u8], out: &mut [f32]) {
    let (d, min) = (f16_at(block, 0), f16_at(block, 2));
    let scales = &block[4..16];
    let mask = _mm256_set1_epi32(0xF);
    for j in 0..4 {
        let (d1, m1) = factors(d, min, scales, 2 * j);
        let (d2, m2) = factors(d, min, scales, 2 * j + 1);
        for k in 0..4 {
            // SAFETY: bytes `16 + 32j + 8k..+ 8` of the block, values inside its 256.
            unsafe {
                let q = u8x8(block, 16 + 32 * j + 8 * k);
                let low = _mm256_and_si256(q, mask);
                let high = _mm256_srli_epi32(q, 4);
                store(out, 64 * j + 8 * k, scaled_less(low, d1, m1));
                store(out, 64 * j + 32 + 8 * k, scaled_less(high, d2, m2));
            }
        }
    }
}

/// Q5_K (176 bytes, 256 values): as Q4_K with a fifth bit per value: `d`, `dmin`, 12 scale bytes, 32 bytes of high
/// bits (bit `2j` of byte `l` for value `64j + l`, bit `2j + 1` for value `64j + 32 + l`), 128 bytes of nibbles.
#[target_feature(enable = "avx2,f16c")]
unsafe fn q5_k(block: &[u8], out: &mut [f32]) {
    let (d, min) = (f16_at(block, 0), f16_at(block, 2));
    let scales = &block[4..16];
    let (mask, one) = (_mm256_set1_epi32(0xF), _mm256_set1_epi32(1));
    for j in 0..4 {
        let (d1, m1) = factors(d, min, scales, 2 * j);
        let (d2, m2) = factors(d, min, scales, 2 * j + 1);
        let (shift1, shift2) = (
            _mm_cvtsi32_si128(2 * j as i32),
            _mm_cvtsi32_si128(2 * j as i32 + 1),
        );
        for k in 0..4 {
            // SAFETY: high bits at bytes `16 + 8k..+ 8`, nibbles at `48 + 32j + 8k..+ 8`, values inside the
            // block's 256.
            unsafe {
                let h = u8x8(block, 16 + 8 * k);
                let q = u8x8(block, 48 + 32 * j + 8 * k);
                let h1 = _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, shift1), one), 4);
                let h2 = _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, shift2), one), 4);
                let low = _mm256_or_si256(_mm256_and_si256(q, mask), h1);
                let high = _mm256_or_si256(_mm256_srli_epi32(q, 4), h2);
                store(out, 64 * j + 8 * k, scaled_less(low, d1, m1));
                store(out, 64 * j + 32 + 8 * k, scaled_less(high, d2, m2));
            }
        }
    }
}

/// Q6_K (210 bytes, 256 values): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 signed 8-bit scales,
/// `d` (f16). Per half `n` (128 values), for `l < 32`: values `l`, `l + 32`, `l + 64`, `l + 96` take the low nibble
/// of byte `l`, of byte `l + 32`, the high nibble of byte `l`, of byte `l + 32`, with bits 0-1, 2-3, 4-5, 6-7 of
/// high byte `l` on top, less 32; each `(d · sc) · q` with the scale of its 16 values.
#[target_feature(enable = "avx2,f16c")]
unsafe fn q6_k(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 208);
    let mask = _mm256_set1_epi32(0xF);
    for n in 0..2 {
        let (ql, qh, sc) = (64 * n, 128 + 32 * n, 192 + 8 * n);
        for l in (0..32).step_by(8) {
            let is = l / 16;
            // The factor `d · sc` of the values `32k + l..`, as the scalar decoder computes it.
            let factor = |k: usize| d * (block[sc + is + 2 * k] as i8) as f32;
            let f = [
                splat(factor(0)),
                splat(factor(1)),
                splat(factor(2)),
                splat(factor(3)),
            ];
            // SAFETY: bytes `ql + l..+ 8`, `ql + l + 32..+ 8` and `qh + l..+ 8` of the block, values inside its 256.
            unsafe {
                let a = u8x8(block, ql + l);
                let b = u8x8(block, ql + l + 32);
                let h = u8x8(block, qh + l);
                let base = 128 * n + l;
                store(out, base, scaled(q6(_mm256_and_si256(a, mask), h, 0), f[0]));
                store(
                    out,
                    base + 32,
                    scaled(q6(_mm256_and_si256(b, mask), h, 2), f[1]),
                );
                store(
                    out,
                    base + 64,
                    scaled(q6(_mm256_srli_epi32(a, 4), h, 4), f[2]),
                );
                store(
                    out,
                    base + 96,
                    scaled(q6(_mm256_srli_epi32(b, 4), h, 6), f[3]),
                );
            }
        }
    }
}

/// A Q6_K code: `low | ((high >> shift) & 3) << 4`, less 32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q6(low: __m256i, high: __m256i, shift: i32) -> __m256i {
    let top = _mm256_and_si256(
        _mm256_srl_epi32(high, _mm_cvtsi32_si128(shift)),
        _mm256_set1_epi32(3),
    );
    _mm256_sub_epi32(
        _mm256_or_si256(low, _mm256_slli_epi32(top, 4)),
        _mm256_set1_epi32(32),
    )
}

/// `v` in every lane.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn splat(v: f32) -> __m256 {
    _mm256_set1_ps(v)
}
