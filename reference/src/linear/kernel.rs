//! The matrix-vector kernel of [`super::matvec`]: stored rows widened to f32 (in registers on the SIMD path), rows
//! split across the rayon threads, each output summed in the fixed order the parent module documents.

use super::{Elem, MappedMatrix};
use rayon::prelude::*;

/// Widens one row of stored values to f32 (exact).
pub(super) fn widen(src: &[u8], elem: Elem, dst: &mut [f32]) {
    match elem {
        Elem::Bf16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f32::from_bits((u16::from_le_bytes([s[0], s[1]]) as u32) << 16);
            }
        }
        Elem::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
        Elem::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
    }
}

/// One stored value widened to f32.
#[inline(always)]
fn value(src: &[u8], elem: Elem, i: usize) -> f32 {
    match elem {
        Elem::Bf16 => {
            f32::from_bits((u16::from_le_bytes([src[2 * i], src[2 * i + 1]]) as u32) << 16)
        }
        Elem::F16 => half::f16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f32(),
        Elem::F32 => {
            f32::from_le_bytes([src[4 * i], src[4 * i + 1], src[4 * i + 2], src[4 * i + 3]])
        }
    }
}

/// `y = x W^T` for `t` tokens: `x` is `[t, cols]` row-major f32, the result `[t, rows]`. Rows of `W` are split
/// across the rayon threads; each row is read once for all tokens. The summation order is in the module docs.
pub fn matvec(w: &MappedMatrix, x: &[f32], t: usize) -> Vec<f32> {
    assert_eq!(x.len(), t * w.cols, "matvec: x must be [t, cols]");
    let rows = w.rows;
    // Per row, the t outputs; transposed to [t, rows] at the end.
    let mut yt = vec![0f32; rows * t];
    if rows == 0 || t == 0 {
        return vec![0f32; rows * t];
    }
    let simd = simd_available(w.elem);
    // About 16 tasks per thread (enough to balance them), each of at least 256 KiB of weights (so the scheduling
    // costs nothing next to the reads). The split decides only which thread computes a row, never how.
    let row_bytes = (w.cols * w.elem.size()).max(1);
    let threads = rayon::current_num_threads().max(1);
    let rows_per_task = rows
        .div_ceil(16 * threads)
        .max((256 << 10) / row_bytes)
        .max(1);
    yt.par_chunks_mut(rows_per_task * t)
        .enumerate()
        .for_each(|(task, out)| {
            let first = task * rows_per_task;
            for (k, y) in out.chunks_mut(t).enumerate() {
                let row = w.row_bytes(first + k);
                for (g, ys) in y.chunks_mut(GROUP).enumerate() {
                    let xs = &x[g * GROUP * w.cols..(g * GROUP + ys.len()) * w.cols];
                    dot_rows(row, w.elem, xs, w.cols, ys, simd);
                }
            }
        });
    token_major(yt, rows, t)
}

/// Whether the SIMD kernel can run for this storage type on this CPU.
pub(super) fn simd_available(elem: Elem) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let base = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        match elem {
            Elem::F16 => base && is_x86_feature_detected!("f16c"),
            _ => base,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = elem;
        false
    }
}

/// Tokens one pass over a weight row serves (a row is then re-read from the L1 cache for the next group).
pub(super) const GROUP: usize = 2;

/// Lanes of the accumulators.
pub(super) const LANES: usize = 32;

/// `ys[j] = Σ_i xs[j, i] · row[i]` for up to [`GROUP`] tokens `j`.
pub(super) fn dot_rows(row: &[u8], elem: Elem, xs: &[f32], n: usize, ys: &mut [f32], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is true only when the CPU has AVX2, FMA (and F16C for f16), checked by `simd_available`.
        unsafe {
            match ys.len() {
                1 => x86::dot::<1>(row, elem, xs, n, ys),
                _ => x86::dot::<GROUP>(row, elem, xs, n, ys),
            }
        }
        return;
    }
    let _ = simd;
    portable_dot(row, elem, xs, n, ys);
}

/// The portable kernel: the same order as the SIMD one, multiply and add rounded separately.
pub(super) fn portable_dot(row: &[u8], elem: Elem, xs: &[f32], n: usize, ys: &mut [f32]) {
    let main = n / LANES * LANES;
    let mut wbuf = [0f32; LANES];
    for (j, y) in ys.iter_mut().enumerate() {
        let x = &xs[j * n..(j + 1) * n];
        let mut acc = [0f32; LANES];
        let mut i = 0;
        while i < main {
            widen(
                &row[i * elem.size()..(i + LANES) * elem.size()],
                elem,
                &mut wbuf,
            );
            for l in 0..LANES {
                acc[l] += x[i + l] * wbuf[l];
            }
            i += LANES;
        }
        let mut sum = combine(&acc);
        for (k, &xk) in x.iter().enumerate().skip(main) {
            sum += xk * value(row, elem, k);
        }
        *y = sum;
    }
}

/// The 32 lane accumulators combined in the documented order: `(l + (l+8)) + ((l+16) + (l+24))` for `l < 8`, then
/// the 8 lanes reduced as `(l, l+4)`, `(l, l+2)`, `(l, l+1)` (what the SIMD path's adds and [`x86::hsum`] do).
pub(super) fn combine(acc: &[f32; LANES]) -> f32 {
    let mut s = [0f32; 8];
    for l in 0..8 {
        s[l] = (acc[l] + acc[l + 8]) + (acc[l + 16] + acc[l + 24]);
    }
    for l in 0..4 {
        s[l] += s[l + 4];
    }
    for l in 0..2 {
        s[l] += s[l + 2];
    }
    s[0] + s[1]
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::{Elem, GROUP, LANES, MAX_GROUPS, value};
    use std::arch::x86_64::*;

    /// How far ahead of the current weight bytes the kernel asks for a cache line (8 KiB). The hardware
    /// prefetcher alone leaves the stream ~20% below this (LM head, bf16, 2 threads: medians of 10 runs, 20.3 →
    /// 24.4 GB/s on a shared machine); prefetching past the end of the matrix is harmless (never faults).
    const PREFETCH_BYTES: usize = 8192;

    /// Eight stored values at element `i` widened to f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(row: &[u8], elem: Elem, i: usize) -> __m256 {
        // SAFETY (all arms): the caller guarantees `i + 8 <= n`, so the bytes read are inside `row`; the loads are
        // unaligned.
        unsafe {
            match elem {
                Elem::Bf16 => {
                    let h = _mm_loadu_si128(row.as_ptr().add(2 * i) as *const __m128i);
                    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                }
                Elem::F16 => {
                    _mm256_cvtph_ps(_mm_loadu_si128(row.as_ptr().add(2 * i) as *const __m128i))
                }
                Elem::F32 => _mm256_loadu_ps(row.as_ptr().add(4 * i) as *const f32),
            }
        }
    }

    /// Adds lanes `l` and `l + 4`, then `l` and `l + 2`, then lanes 0 and 1.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::linear) fn hsum(v: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        _mm_cvtss_f32(s1)
    }

    /// The SIMD kernel for `T` tokens (see the module docs for the order).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot<const T: usize>(
        row: &[u8],
        elem: Elem,
        xs: &[f32],
        n: usize,
        ys: &mut [f32],
    ) {
        assert!(xs.len() >= T * n && ys.len() >= T && row.len() >= n * elem.size());
        let main = n / LANES * LANES;
        let mut acc = [[_mm256_setzero_ps(); 4]; T];
        // SAFETY: the row holds elements `0..n` (asserted).
        unsafe {
            steps::<T>(row, 0, elem, xs, n, 0..main, &mut acc);
            finish::<T>(&acc, row, 0, elem, xs, n, ys);
        }
    }

    /// Elements `range` (a run of whole 32-element steps) of a row added to the `T` tokens' lane accumulators:
    /// `acc[j]` lane `l` of register `q` gets `x[j, i] · w[i]` (fused) for `i = 32s + 8q + l`, steps in order. `row`
    /// holds the row's elements from `first` on.
    ///
    /// # Safety
    /// `row` holds elements `first..range.end` (`range.start >= first`) and `xs` `T` tokens of `n` inputs, `range`
    /// inside `0..n`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn steps<const T: usize>(
        row: &[u8],
        first: usize,
        elem: Elem,
        xs: &[f32],
        n: usize,
        range: std::ops::Range<usize>,
        acc: &mut [[__m256; 4]; T],
    ) {
        debug_assert!(range.start >= first && (range.end - first) * elem.size() <= row.len());
        debug_assert!(range.end <= n && xs.len() >= T * n);
        let mut a = *acc;
        let mut i = range.start;
        while i < range.end {
            // SAFETY: `i + LANES <= range.end <= n`, inside `row` (from `first`) and every token's slice of `xs`
            // (the caller's guarantee).
            unsafe {
                let at = i - first;
                // One cache line per 64 bytes this iteration reads (one for bf16/f16, two for f32).
                let ahead = row.as_ptr().wrapping_add(at * elem.size() + PREFETCH_BYTES);
                for line in (0..LANES * elem.size()).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
                }
                let w = [
                    load8(row, elem, at),
                    load8(row, elem, at + 8),
                    load8(row, elem, at + 16),
                    load8(row, elem, at + 24),
                ];
                for (j, aj) in a.iter_mut().enumerate() {
                    let x = xs.as_ptr().add(j * n + i);
                    for (q, (aq, wq)) in aj.iter_mut().zip(&w).enumerate() {
                        *aq = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(8 * q)), *wq, *aq);
                    }
                }
            }
            i += LANES;
        }
        *acc = a;
    }

    /// The `T` tokens' outputs: each one's lane accumulators combined in the documented order, then the last
    /// `n mod 32` products added one at a time (fused). `row` holds the row's elements from `first` on.
    ///
    /// # Safety
    /// `row` holds elements `first..n`, `first <= 32⌊n/32⌋`; `xs` holds `T` tokens of `n` inputs and `ys` `T`
    /// outputs.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn finish<const T: usize>(
        acc: &[[__m256; 4]; T],
        row: &[u8],
        first: usize,
        elem: Elem,
        xs: &[f32],
        n: usize,
        ys: &mut [f32],
    ) {
        let main = n / LANES * LANES;
        for (j, a) in acc.iter().enumerate() {
            let lanes = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
            let mut sum = hsum(lanes);
            for k in main..n {
                sum = xs[j * n + k].mul_add(value(row, elem, k - first), sum);
            }
            ys[j] = sum;
        }
    }

    /// [`super::dot_segments`] on AVX2/FMA/F16C.
    ///
    /// # Safety
    /// The CPU has them; the arguments are as [`super::dot_segments`] asserts.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_segments(
        n: usize,
        xs: &[f32],
        ys: &mut [f32],
        buf: &mut [f32],
        fill: &mut dyn FnMut(std::ops::Range<usize>, &mut [f32]),
    ) {
        let t = ys.len();
        let main = n / LANES * LANES;
        let groups = t.div_ceil(GROUP);
        let mut acc = [[[_mm256_setzero_ps(); 4]; GROUP]; MAX_GROUPS];
        let segment = buf.len();
        let mut start = 0;
        loop {
            let end = (start + segment).min(n);
            let values = &mut buf[..end - start];
            fill(start..end, values);
            let bytes = super::super::gguf::f32_bytes(values);
            for (g, a) in acc.iter_mut().enumerate().take(groups) {
                let xg = &xs[g * GROUP * n..];
                // SAFETY: `bytes` holds elements `start..end` of the row; the steps are whole and inside `0..n`;
                // `xg` holds the group's tokens (1 or GROUP of them).
                unsafe {
                    if g * GROUP + 1 == t {
                        let one: &mut [[__m256; 4]; 1] = (&mut a[..1]).try_into().expect("one");
                        steps::<1>(&bytes, start, Elem::F32, xg, n, start..end.min(main), one);
                    } else {
                        steps::<GROUP>(&bytes, start, Elem::F32, xg, n, start..end.min(main), a);
                    }
                }
            }
            if end == n {
                for (g, a) in acc.iter().enumerate().take(groups) {
                    let (xg, yg) = (&xs[g * GROUP * n..], &mut ys[g * GROUP..]);
                    // SAFETY: `bytes` holds elements `start..n`, and `start <= main` (segments are whole steps).
                    unsafe {
                        if g * GROUP + 1 == t {
                            let one: &[[__m256; 4]; 1] = (&a[..1]).try_into().expect("one");
                            finish::<1>(one, &bytes, start, Elem::F32, xg, n, yg);
                        } else {
                            finish::<GROUP>(a, &bytes, start, Elem::F32, xg, n, yg);
                        }
                    }
                }
                return;
            }
            start = end;
        }
    }
}

/// The most token groups [`dot_segments`] sums at once (all of [`super::MATVEC_MAX_TOKENS`]).
const MAX_GROUPS: usize = super::MATVEC_MAX_TOKENS.div_ceil(GROUP);

/// `ys[j] = Σ_i xs[j, i] · w[i]` for the `ys.len()` tokens of `xs` (at most [`super::MATVEC_MAX_TOKENS`]) and one
/// row `w` of `n` f32 values that `fill(range, dst)` writes a segment at a time (`buf.len()` values, a multiple of 32,
/// into `buf`): each output has the bits [`dot_rows`] gives on the whole row on the SIMD path (the same fused
/// multiply-adds in the same order), with only a segment of the row at hand, so a decoded row stays in the L1 cache.
/// `None` (nothing computed) where the SIMD path does not run (`simd_available(Elem::F32)`): the caller then decodes
/// the whole row for the portable one.
pub(super) fn dot_segments(
    n: usize,
    xs: &[f32],
    ys: &mut [f32],
    buf: &mut [f32],
    fill: &mut dyn FnMut(std::ops::Range<usize>, &mut [f32]),
) -> Option<()> {
    assert!(ys.len() <= super::MATVEC_MAX_TOKENS && xs.len() >= ys.len() * n);
    assert!(!buf.is_empty() && buf.len().is_multiple_of(LANES));
    #[cfg(target_arch = "x86_64")]
    if simd_available(Elem::F32) {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked); the sizes are asserted.
        unsafe { x86::dot_segments(n, xs, ys, buf, fill) };
        return Some(());
    }
    let _ = fill;
    None
}

/// `yt`, the products row-major by output row (`[rows, t]`), as the `[t, rows]` a linear layer returns.
pub(super) fn token_major(yt: Vec<f32>, rows: usize, t: usize) -> Vec<f32> {
    if t == 1 {
        return yt;
    }
    let mut y = vec![0f32; rows * t];
    for r in 0..rows {
        for j in 0..t {
            y[j * rows + r] = yt[r * t + j];
        }
    }
    y
}
