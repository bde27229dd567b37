//! [`super::PromptKernel::Avx512`]'s vector code: the weights widened into the panels, the register tile, and the
//! lanes combined in [`super::super::matvec`]'s order.
//!
//! Widening is exact: a bf16 value shifted into the high half of an f32, an f16 value converted (`vcvtph2ps`), an
//! f32 copied, and a code times its f16 scale formed as the packed kernels form it, `f32(code) · f32(scale)` (an
//! INT4 code looked up in the group's table of the 16 products with `vpermps`, an INT8 code converted and
//! multiplied), so the panels hold the very values [`super::super::matvec`] and [`super::super::matvec_packed`]
//! multiply.

use super::super::kernel::x86::hsum;
use super::super::quant_kernel::PackedRow;
use super::super::{Elem, kernel::LANES};
use super::{Isa, check_panel, widen_packed_by_steps};
use std::arch::x86_64::*;
use std::ops::Range;

/// Half a step: the lanes of one 512-bit register.
const HALF: usize = LANES / 2;

/// Rows in the register tile.
const ROWS: usize = 4;

/// Tokens in the register tile (24 accumulators, 10 loads per 24 fused multiply-adds).
const TOKENS: usize = 6;

/// AVX-512F (with AVX2, FMA and F16C): two halves of 16 lanes, a tile of 4 rows × 6 tokens.
pub(super) struct Avx512;

impl Isa for Avx512 {
    const WIDTH: usize = HALF;
    const ROWS: usize = ROWS;
    const TOKENS: usize = TOKENS;
    // The token block's inputs for 48 half steps, 18 KiB, stay in the L1 cache.
    const STEPS: usize = 48;

    unsafe fn tile(panel: &[f32], xs: &[f32], len: usize, acc: &mut [f32], first: bool) {
        // SAFETY: the caller's guarantee.
        unsafe { tile(panel, xs, len, acc, first) }
    }

    unsafe fn widen_stored(
        row: &[u8],
        elem: Elem,
        steps: Range<usize>,
        dst: &mut [f32],
        stride: usize,
        second: usize,
    ) {
        // SAFETY: the caller's guarantee.
        unsafe { widen_stored(row, elem, steps, dst, stride, second) }
    }

    unsafe fn widen_packed(
        row: &PackedRow,
        steps: Range<usize>,
        dst: &mut [f32],
        stride: usize,
        second: usize,
    ) {
        // SAFETY: the caller's guarantee.
        unsafe { widen_packed(row, steps, dst, stride, second) }
    }

    unsafe fn combine(acc: &[f32], part: usize) -> f32 {
        // SAFETY: the caller's guarantee.
        unsafe { combine(acc, &acc[part..]) }
    }

    unsafe fn prefetch(values: &[f32]) {
        // SAFETY: the caller's guarantee.
        unsafe { prefetch(values) }
    }
}

/// The INT4 codes in nibble order, as f32: nibble `v` holds code `v` for `v < 8` and `v - 16` above.
const NIBBLE_CODES: [f32; 16] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0,
];

/// Steps `steps` of `row`'s stored values (`elem`) widened into `dst`, the 16 of half `h` of step `s` at
/// `dst[h · second + (s - steps.start) · stride..][..16]`.
///
/// # Safety
/// The CPU has AVX-512F, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn widen_stored(
    row: &[u8],
    elem: Elem,
    steps: Range<usize>,
    dst: &mut [f32],
    stride: usize,
    second: usize,
) {
    check_panel(dst, HALF, steps.len(), stride, second);
    assert!(row.len() >= steps.end * LANES * elem.size());
    let (src, out) = (row.as_ptr(), dst.as_mut_ptr());
    for (k, s) in steps.enumerate() {
        for h in 0..2 {
            let i = s * LANES + h * HALF;
            // SAFETY: `i + 16 <= 32 · steps.end`, inside the row (asserted); the 16 values written at
            // `h · second + k · stride` are inside `dst` (`check_panel`). The loads and stores are unaligned.
            unsafe {
                let v = match elem {
                    Elem::Bf16 => {
                        let h16 = _mm256_loadu_si256(src.add(2 * i) as *const __m256i);
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h16)))
                    }
                    Elem::F16 => {
                        _mm512_cvtph_ps(_mm256_loadu_si256(src.add(2 * i) as *const __m256i))
                    }
                    Elem::F32 => _mm512_loadu_ps(src.add(4 * i) as *const f32),
                };
                _mm512_storeu_ps(out.add(h * second + k * stride), v);
            }
        }
    }
}

/// Steps `steps` of a packed row's weights `f32(code) · f32(scale)` into `dst`, the 16 of half `h` of step `s` at
/// `dst[h · second + (s - steps.start) · stride..][..16]`. Rows whose groups split a half step (16 codes) are widened
/// by [`PackedRow::widen`].
///
/// # Safety
/// The CPU has AVX-512F, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn widen_packed(
    row: &PackedRow,
    steps: Range<usize>,
    dst: &mut [f32],
    stride: usize,
    second: usize,
) {
    let group = row.group;
    if group == 0 || !(group.is_multiple_of(HALF) || group >= row.cols) {
        widen_packed_by_steps(row, HALF, steps, dst, stride, second);
        return;
    }
    check_panel(dst, HALF, steps.len(), stride, second);
    assert!(steps.end <= row.cols / LANES);
    let code_bytes = if row.int4 {
        row.cols.div_ceil(2)
    } else {
        row.cols
    };
    assert!(row.codes.len() >= code_bytes && row.scales.len() >= row.cols.div_ceil(group));
    // SAFETY: 16 values.
    let nibbles = unsafe { _mm512_loadu_ps(NIBBLE_CODES.as_ptr()) };
    let (codes, out) = (row.codes.as_ptr(), dst.as_mut_ptr());
    for (k, s) in steps.enumerate() {
        for h in 0..2 {
            let i = s * LANES + h * HALF;
            // The half step's scale (one group holds it: `group` is a multiple of 16 or the whole row), widened
            // in every lane (exact, as `f32::from`).
            let scale = _mm512_cvtph_ps(_mm256_set1_epi16(row.scales[i / group].to_bits() as i16));
            // SAFETY: the codes of step `s` are inside the row (asserted): 16 bytes at `16s` for INT4 (lanes
            // 0..16 in the low nibbles, 16..32 in the high ones), 16 at `i` for INT8; the 16 values written at
            // `h · second + k · stride` are inside `dst` (`check_panel`). The loads and stores are unaligned.
            unsafe {
                let v = if row.int4 {
                    let bytes = _mm_loadu_si128(codes.add(s * HALF) as *const __m128i);
                    let idx = _mm512_cvtepu8_epi32(bytes);
                    let idx = if h == 0 {
                        idx
                    } else {
                        _mm512_srli_epi32::<4>(idx)
                    };
                    // `vpermps` reads the low four bits of each index: the nibble.
                    _mm512_permutexvar_ps(idx, _mm512_mul_ps(nibbles, scale))
                } else {
                    let c = _mm512_cvtepi8_epi32(_mm_loadu_si128(codes.add(i) as *const __m128i));
                    _mm512_mul_ps(_mm512_cvtepi32_ps(c), scale)
                };
                _mm512_storeu_ps(out.add(h * second + k * stride), v);
            }
        }
    }
}

/// The register tile: for [`ROWS`] rows and [`TOKENS`] tokens, `len` half steps of one half `h` added to the 16
/// lane accumulators of that half of each output: lane `l` of half step `s` adds `x[32s + 16h + l] · w[32s + 16h + l]`
/// (fused), steps in order.
///
/// `panel` is the rows' `[step][row][16]` weights of the half from the first step on, `xs` the tokens'
/// `[step][token][16]` inputs; `acc` holds the accumulators between calls, `[row][token][16]`, and is read unless
/// `first` (then they start at zero, as [`super::super::matvec`]'s do). All three are 64-byte aligned, in whole
/// lines of 16 values.
///
/// # Safety
/// The CPU has AVX-512F, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn tile(panel: &[f32], xs: &[f32], len: usize, acc: &mut [f32], first: bool) {
    assert!(
        panel.len() >= len * ROWS * HALF
            && xs.len() >= len * TOKENS * HALF
            && acc.len() >= ROWS * TOKENS * HALF
    );
    let aligned = |p: *const f32| (p as usize).is_multiple_of(64);
    assert!(aligned(panel.as_ptr()) && aligned(xs.as_ptr()) && aligned(acc.as_ptr()));
    let (w, x, out) = (panel.as_ptr(), xs.as_ptr(), acc.as_mut_ptr());
    let mut a = [[_mm512_setzero_ps(); TOKENS]; ROWS];
    if !first {
        for (r, ar) in a.iter_mut().enumerate() {
            for (j, v) in ar.iter_mut().enumerate() {
                // SAFETY: inside `acc`, aligned (asserted).
                *v = unsafe { _mm512_load_ps(out.add((r * TOKENS + j) * HALF)) };
            }
        }
    }
    for s in 0..len {
        // SAFETY: half step `s < len` of the panel and of the inputs, aligned (asserted).
        unsafe {
            let ws: [__m512; ROWS] =
                std::array::from_fn(|r| _mm512_load_ps(w.add((s * ROWS + r) * HALF)));
            for j in 0..TOKENS {
                let xj = _mm512_load_ps(x.add((s * TOKENS + j) * HALF));
                for (ar, wr) in a.iter_mut().zip(&ws) {
                    ar[j] = _mm512_fmadd_ps(xj, *wr, ar[j]);
                }
            }
        }
    }
    for (r, ar) in a.iter().enumerate() {
        for (j, v) in ar.iter().enumerate() {
            // SAFETY: inside `acc`, aligned (asserted).
            unsafe { _mm512_store_ps(out.add((r * TOKENS + j) * HALF), *v) };
        }
    }
}

/// Asks for the cache lines of `values` in the L2 cache (a hint: nothing is read).
///
/// # Safety
/// The CPU has AVX-512F, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn prefetch(values: &[f32]) {
    for line in values.chunks(HALF) {
        _mm_prefetch::<_MM_HINT_T1>(line.as_ptr() as *const i8);
    }
}

/// The upper 8 lanes of `v`.
#[inline]
#[target_feature(enable = "avx512f")]
fn high256(v: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
}

/// One output's 32 lane accumulators (lanes 0..16 in `first`, 16..32 in `second`) combined in
/// [`super::super::matvec`]'s order: lanes 0..8, 8..16, 16..24, 24..32 added as `(l + (l+8)) + ((l+16) + (l+24))`,
/// then reduced as `(l, l+4)`, `(l, l+2)`, `(l, l+1)`.
///
/// # Safety
/// The CPU has AVX-512F, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn combine(first: &[f32], second: &[f32]) -> f32 {
    assert!(first.len() >= HALF && second.len() >= HALF);
    // SAFETY: 16 values each (asserted).
    let (lo, hi) = unsafe {
        (
            _mm512_loadu_ps(first.as_ptr()),
            _mm512_loadu_ps(second.as_ptr()),
        )
    };
    hsum(_mm256_add_ps(
        _mm256_add_ps(_mm512_castps512_ps256(lo), high256(lo)),
        _mm256_add_ps(_mm512_castps512_ps256(hi), high256(hi)),
    ))
}
