//! [`super::QuantKernel::Avx512`]: the packed matrix-vector product in 512-bit registers, in the summation order of
//! [`super::super::matvec`]. Lanes `l` of the 32 accumulators are lanes 0..16 of one register and 16..32 of another
//! (the low and high nibbles of a block's 16 INT4 bytes, see [`super::int4_position`]), combined at the end exactly
//! as the 256-bit kernels combine their four registers.
//!
//! An INT4 weight is looked up, not computed: per group and row a table holds the 16 values `f32(code) · f32(scale)`
//! (the product the other kernels form, so the same bits), and `vpermps`, which reads the low four bits of each
//! 32-bit index, maps 16 bytes widened to 32-bit lanes to lanes 0..16's weights, and the same shifted right by four
//! to lanes 16..32's: 4 vector instructions per 32 weights before the multiply-adds, against 18 for widening and
//! scaling each code. An INT8 weight is widened (sign extension, conversion) and scaled, 16 at a time.
//!
//! One token's 32 lanes make two chains of dependent multiply-adds, each one step per block of 32 weights, so a
//! product of one row is bound by the multiply-add latency (4 cycles a block) before the instructions; the caller
//! runs one token over four rows at once (eight chains), more tokens over two. The weights are prefetched 8 KiB
//! ahead, as [`super::super::matvec`]'s are.

use super::super::kernel::x86::hsum;
use super::{HALF, LANES, PackedRow};
use std::arch::x86_64::*;

/// How far ahead of the codes being read the kernel asks for their cache line.
const PREFETCH_BYTES: usize = 8192;

/// The INT4 codes in nibble order, as f32: nibble `v` holds code `v` for `v < 8` and `v - 16` above.
const NIBBLE_CODES: [f32; 16] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0,
];

/// Whether the kernel takes the rows of this matrix: every half block of 16 codes under one scale (groups a multiple
/// of 16 codes, or one group a row).
pub(super) fn fits(row: &PackedRow) -> bool {
    row.group.is_multiple_of(HALF) || row.group >= row.cols
}

/// `out[r][j] = Σ_i xs[j, i] · rows[r][i]` for `R` rows of one matrix and `T` tokens (`xs` `[T, n]`).
///
/// # Safety
/// The CPU must have AVX-512F, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn dot<const R: usize, const T: usize>(
    rows: [&PackedRow; R],
    xs: &[f32],
    n: usize,
) -> [[f32; T]; R] {
    let first = rows[0];
    for row in rows {
        let code_bytes = if row.int4 { n.div_ceil(2) } else { n };
        assert!(
            row.int4 == first.int4
                && row.group == first.group
                && row.cols == n
                && row.group > 0
                && fits(row)
                && row.codes.len() >= code_bytes
                && row.scales.len() >= n.div_ceil(row.group)
        );
    }
    assert!(xs.len() >= T * n);
    // SAFETY: the features are the caller's guarantee; the shapes are asserted above.
    unsafe {
        if first.int4 {
            run::<R, T, true>(rows, xs, n)
        } else {
            run::<R, T, false>(rows, xs, n)
        }
    }
}

/// The 32 weights of a row at element `i` (a multiple of 32), lanes 0..16 and 16..32; `tab` is, per half, the
/// group's table of 16 weights (INT4) or its scale in every lane (INT8).
///
/// # Safety
/// AVX-512F, and `i + 32` codes inside the row at `codes`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn weights<const INT4: bool>(codes: *const u8, i: usize, tab: [__m512; 2]) -> [__m512; 2] {
    // SAFETY: the caller's guarantee; the loads are unaligned.
    unsafe {
        if INT4 {
            let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.add(i / 2) as *const __m128i));
            [
                _mm512_permutexvar_ps(idx, tab[0]),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(idx), tab[1]),
            ]
        } else {
            let lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(codes.add(i) as *const __m128i));
            let hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(codes.add(i + HALF) as *const __m128i));
            [
                _mm512_mul_ps(_mm512_cvtepi32_ps(lo), tab[0]),
                _mm512_mul_ps(_mm512_cvtepi32_ps(hi), tab[1]),
            ]
        }
    }
}

/// The upper 8 lanes of `v`.
#[inline]
#[target_feature(enable = "avx512f")]
fn high256(v: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
}

/// Group `g`'s table of 16 weights (INT4) or its scale in every lane (INT8), for each row.
///
/// # Safety
/// AVX-512F and F16C.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn tables<const R: usize, const INT4: bool>(
    rows: &[&PackedRow; R],
    g: usize,
    nibbles: __m512,
) -> [__m512; R] {
    rows.map(|row| {
        // The f16 scale widened in every lane (exact, as `f32::from`).
        let s = _mm512_cvtph_ps(_mm256_set1_epi16(row.scales[g].to_bits() as i16));
        if INT4 { _mm512_mul_ps(nibbles, s) } else { s }
    })
}

/// Adds the products of the 32 weights at element `i` of every row (`codes`; `tab` per row and half as
/// [`weights`] takes it) with every token's inputs (`xs`, `T` rows of `n`) to the accumulators.
///
/// # Safety
/// AVX-512F; `i + 32 <= n`, the rows' codes and the inputs as [`dot`] asserts them.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn block<const R: usize, const T: usize, const INT4: bool>(
    codes: &[*const u8; R],
    tab: &[[__m512; 2]; R],
    xs: *const f32,
    n: usize,
    i: usize,
    acc: &mut [[[__m512; 2]; T]; R],
) {
    for ((&p, t), a) in codes.iter().zip(tab).zip(acc) {
        let ahead = p.wrapping_add(if INT4 { i / 2 } else { i } + PREFETCH_BYTES);
        _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
        // SAFETY: the caller's guarantee.
        unsafe {
            let w = weights::<INT4>(p, i, *t);
            for (j, aj) in a.iter_mut().enumerate() {
                let x = xs.add(j * n + i);
                aj[0] = _mm512_fmadd_ps(_mm512_loadu_ps(x), w[0], aj[0]);
                aj[1] = _mm512_fmadd_ps(_mm512_loadu_ps(x.add(HALF)), w[1], aj[1]);
            }
        }
    }
}

/// [`dot`] for INT4 (`INT4`) or INT8 codes, its checks done.
///
/// # Safety
/// As [`dot`], with the shapes it asserts.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn run<const R: usize, const T: usize, const INT4: bool>(
    rows: [&PackedRow; R],
    xs: &[f32],
    n: usize,
) -> [[f32; T]; R] {
    let main = n / LANES * LANES;
    let group = rows[0].group;
    // SAFETY: 16 values.
    let nibbles = unsafe { _mm512_loadu_ps(NIBBLE_CODES.as_ptr()) };
    let codes = rows.map(|row| row.codes.as_ptr());
    let x = xs.as_ptr();
    let mut acc = [[[_mm512_setzero_ps(); 2]; T]; R];
    if group.is_multiple_of(LANES) || group >= n {
        // Every block inside one group: per group, one table a row for the blocks of the group.
        let run = if group >= n { main } else { group };
        let (mut g, mut start) = (0, 0);
        while start < main {
            // SAFETY: `g` is a group of the rows (`start < main <= n`).
            let tab = unsafe { tables::<R, INT4>(&rows, g, nibbles) }.map(|t| [t, t]);
            let end = (start + run).min(main);
            let mut i = start;
            while i < end {
                // SAFETY: `i + 32 <= main <= n`; the rows and inputs are as `dot` asserts.
                unsafe { block::<R, T, INT4>(&codes, &tab, x, n, i, &mut acc) };
                i += LANES;
            }
            g += 1;
            start = end;
        }
    } else {
        // Groups of an odd number of half blocks: a block's halves may lie in two groups. The next group, and
        // the codes left in the current one (a half block lies inside one group: `fits`).
        let mut current = [_mm512_setzero_ps(); R];
        let mut tab = [[_mm512_setzero_ps(); 2]; R];
        let (mut g, mut left) = (0, 0);
        let mut i = 0;
        while i < main {
            for h in 0..2 {
                if left == 0 {
                    // SAFETY: `g` is a group of the rows (the half at `i + 16h < main` starts it).
                    current = unsafe { tables::<R, INT4>(&rows, g, nibbles) };
                    g += 1;
                    left = group;
                }
                for (t, c) in tab.iter_mut().zip(&current) {
                    t[h] = *c;
                }
                left -= HALF;
            }
            // SAFETY: as above.
            unsafe { block::<R, T, INT4>(&codes, &tab, x, n, i, &mut acc) };
            i += LANES;
        }
    }
    let mut out = [[0f32; T]; R];
    for ((o, a), row) in out.iter_mut().zip(&acc).zip(rows) {
        for (j, (y, [lo, hi])) in o.iter_mut().zip(a).enumerate() {
            // Lanes 0..8, 8..16, 16..24, 24..32: the 256-bit kernels' four registers, added as they add them.
            let lanes = _mm256_add_ps(
                _mm256_add_ps(_mm512_castps512_ps256(*lo), high256(*lo)),
                _mm256_add_ps(_mm512_castps512_ps256(*hi), high256(*hi)),
            );
            let mut sum = hsum(lanes);
            for k in main..n {
                sum = xs[j * n + k].mul_add(row.value(k), sum);
            }
            *y = sum;
        }
    }
    out
}
