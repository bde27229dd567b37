//! The matrix-vector kernel of [`super::PackedMatrix`]: integer codes and f16 scales widened to the f32 weight
//! `f32(code) · f32(scale)` (in registers on the SIMD paths), rows split across the rayon threads, each output summed
//! in the fixed order the parent module documents for [`super::matvec`].
//!
//! The product `f32(code) · f32(scale)` is exact (a code of at most 8 bits times an 11-bit significand, far from
//! f32's range limits), so each weight equals the dequantised value of [`crate::quant::QuantizedMatrix::dequantize`]
//! and, the order of the sums being the same, [`matvec_packed`] gives bit for bit what [`super::matvec`] gives on the
//! dequantised matrix stored as f32, on every path: [`QuantKernel::Avx512`] and [`QuantKernel::Avx2`] fuse each
//! multiply-add as `matvec`'s SIMD path does, [`QuantKernel::Portable`] rounds them apart as its portable path does.
//! The best path the CPU has is chosen at run time ([`QuantKernel::detect`]).
//!
//! INT4 codes are laid out for the kernels (see [`super::PackedMatrix`]): a block of 32 codes in 16 bytes, code `k`
//! of the block in the low nibble of byte `k` and code `16 + k` in its high nibble, so the low nibbles of a block
//! are accumulator lanes 0..16 and the high ones lanes 16..32, with no interleaving step.

mod avx512;

use super::kernel::{GROUP, LANES, combine, simd_available};
use super::{Elem, PackedMatrix};
use half::f16;
use rayon::prelude::*;

/// Codes in half a block: the nibbles of one half of a block's 16 bytes.
const HALF: usize = LANES / 2;

/// Where INT4 code `i` of a row of `cols` codes lies: its byte and the shift of its nibble (0 low, 4 high). The
/// first `32⌊cols/32⌋` codes are in blocks of 32 (16 bytes each, code `k < 16` of a block in the low nibble of the
/// block's byte `k`, code `16 + k` in the high nibble of byte `k`); the rest, two a byte in order (code `2m` of the
/// tail low), as [`crate::quant::pack_i4`] packs them.
#[inline(always)]
pub(super) fn int4_position(i: usize, cols: usize) -> (usize, u32) {
    if i < cols / LANES * LANES {
        let k = i % LANES;
        (i / LANES * HALF + k % HALF, 4 * (k / HALF) as u32)
    } else {
        (i / 2, 4 * (i % 2) as u32)
    }
}

/// The INT4 code in the low nibble of `byte` (two's complement).
#[inline(always)]
fn low_code(byte: u8) -> i8 {
    ((byte << 4) as i8) >> 4
}

/// One row of a packed matrix: its codes, its scales and how they are laid out.
#[derive(Clone, Copy)]
pub(super) struct PackedRow<'a> {
    /// The row's codes: two per byte (int4, placed as [`int4_position`] says) or one per byte (int8).
    pub codes: &'a [u8],
    /// Codes in the row.
    pub cols: usize,
    /// The row's scales, one per `group` inputs.
    pub scales: &'a [f16],
    /// Whether the codes are int4 (else int8).
    pub int4: bool,
    /// Inputs sharing one scale.
    pub group: usize,
}

impl PackedRow<'_> {
    /// Code `i` of the row.
    #[inline(always)]
    pub fn code(&self, i: usize) -> i8 {
        if self.int4 {
            let (byte, shift) = int4_position(i, self.cols);
            low_code(self.codes[byte] >> shift)
        } else {
            self.codes[i] as i8
        }
    }

    /// Weight `i` of the row, `f32(code) · f32(scale)` (exact).
    #[inline(always)]
    pub fn value(&self, i: usize) -> f32 {
        self.code(i) as f32 * f32::from(self.scales[i / self.group])
    }

    /// Weights `start..start + dst.len()` of the row (a group at a time, half a block of int4 codes at a time where
    /// one falls inside the group).
    pub fn widen(&self, start: usize, dst: &mut [f32]) {
        let end = start + dst.len();
        let main = self.cols / LANES * LANES;
        let mut i = start;
        while i < end {
            let g = i / self.group;
            let stop = ((g + 1) * self.group).min(end);
            let s = f32::from(self.scales[g]);
            let out = &mut dst[i - start..stop - start];
            if self.int4 {
                let mut k = i;
                while k < stop {
                    if k.is_multiple_of(HALF) && k + HALF <= stop && k + HALF <= main {
                        // The low (first half) or high (second half) nibbles of the block's 16 bytes.
                        let (first, shift) = int4_position(k, self.cols);
                        let bytes = &self.codes[first..first + HALF];
                        for (d, &byte) in out[k - i..k - i + HALF].iter_mut().zip(bytes) {
                            *d = low_code(byte >> shift) as f32 * s;
                        }
                        k += HALF;
                    } else {
                        out[k - i] = self.code(k) as f32 * s;
                        k += 1;
                    }
                }
            } else {
                for (d, &c) in out.iter_mut().zip(&self.codes[i..stop]) {
                    *d = (c as i8) as f32 * s;
                }
            }
            i = stop;
        }
    }
}

/// Which kernel [`matvec_packed_on`] runs. Every path sums in the order of [`super::matvec`]; the two SIMD ones give
/// the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKernel {
    /// AVX-512F: an INT4 code looks its weight up in a table of the group's 16 values `f32(code) · f32(scale)`
    /// (`vpermps`, half a block of 16 codes at once), an INT8 code is widened 16 at a time; one token's product runs
    /// over four rows at once, so that eight chains of fused multiply-adds, not two, hide their latency. Matrices
    /// whose groups are not a multiple of 16 codes (and shorter than a row) take [`QuantKernel::Avx2`]'s kernel.
    Avx512,
    /// AVX2, FMA and F16C: 32 codes widened and scaled per step, one row at a time.
    Avx2,
    /// Portable code: multiply and add rounded separately (as [`super::matvec`]'s portable path).
    Portable,
}

impl QuantKernel {
    /// The fastest kernel this CPU runs (checked at run time).
    pub fn detect() -> Self {
        [QuantKernel::Avx512, QuantKernel::Avx2]
            .into_iter()
            .find(|k| k.available())
            .unwrap_or(QuantKernel::Portable)
    }

    /// Whether this CPU can run the kernel.
    pub fn available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            QuantKernel::Avx512 => {
                simd_available(Elem::F16) && std::arch::is_x86_feature_detected!("avx512f")
            }
            #[cfg(not(target_arch = "x86_64"))]
            QuantKernel::Avx512 => false,
            QuantKernel::Avx2 => simd_available(Elem::F16),
            QuantKernel::Portable => true,
        }
    }
}

/// `y = x W^T` for `t` tokens: `x` is `[t, cols]` row-major f32, the result `[t, rows]`. Rows of `W` are split
/// across the rayon threads; each row is read once for every `GROUP` tokens. The summation order is that of
/// [`super::matvec`]; the kernel is [`QuantKernel::detect`]'s.
pub fn matvec_packed(w: &PackedMatrix, x: &[f32], t: usize) -> Vec<f32> {
    matvec_packed_on(w, x, t, QuantKernel::detect())
}

/// [`matvec_packed`] on a chosen kernel (benches and tests compare them); panics if the CPU cannot run it.
pub fn matvec_packed_on(w: &PackedMatrix, x: &[f32], t: usize, kernel: QuantKernel) -> Vec<f32> {
    assert_eq!(x.len(), t * w.cols(), "matvec: x must be [t, cols]");
    assert!(kernel.available(), "matvec: this CPU cannot run {kernel:?}");
    let rows = w.rows();
    if rows == 0 || t == 0 {
        return vec![0f32; rows * t];
    }
    // The task split of `matvec`: about 16 tasks per thread, each of at least 256 KiB of codes.
    let row_bytes = w.row_bytes().max(1);
    let threads = rayon::current_num_threads().max(1);
    let rows_per_task = rows
        .div_ceil(16 * threads)
        .max((256 << 10) / row_bytes)
        .max(1);
    let mut yt = vec![0f32; rows * t];
    yt.par_chunks_mut(rows_per_task * t)
        .enumerate()
        .for_each(|(task, out)| task_rows(w, task * rows_per_task, x, t, out, kernel));
    super::kernel::token_major(yt, rows, t)
}

/// The outputs of rows `first..` (`out.len() / t` of them), `out[k · t + j]` for row `first + k` and token `j`.
fn task_rows(
    w: &PackedMatrix,
    first: usize,
    x: &[f32],
    t: usize,
    out: &mut [f32],
    kernel: QuantKernel,
) {
    let cols = w.cols();
    #[cfg(target_arch = "x86_64")]
    if kernel == QuantKernel::Avx512 && avx512::fits(&w.row(first)) {
        let count = out.len() / t;
        let mut k = 0;
        while k < count {
            // Several rows at once, so that more chains of multiply-adds hide their latency: four for one token
            // (eight chains), two for more.
            let rows = if t == 1 && k + 4 <= count {
                4
            } else if k + 2 <= count {
                2
            } else {
                1
            };
            for start in (0..t).step_by(GROUP) {
                let len = GROUP.min(t - start);
                // SAFETY: `kernel.available()` (asserted by the caller) says the CPU has AVX-512F, AVX2, FMA and
                // F16C; the rows are rows of one matrix, which `fits` the kernel.
                unsafe {
                    match (rows, len) {
                        (4, _) => avx512_rows::<4, 1>(w, first + k, x, start, t, &mut out[k * t..]),
                        (2, 1) => avx512_rows::<2, 1>(w, first + k, x, start, t, &mut out[k * t..]),
                        (2, _) => {
                            avx512_rows::<2, GROUP>(w, first + k, x, start, t, &mut out[k * t..])
                        }
                        (_, 1) => avx512_rows::<1, 1>(w, first + k, x, start, t, &mut out[k * t..]),
                        _ => avx512_rows::<1, GROUP>(w, first + k, x, start, t, &mut out[k * t..]),
                    }
                }
            }
            k += rows;
        }
        return;
    }
    let simd = kernel != QuantKernel::Portable;
    for (k, y) in out.chunks_mut(t).enumerate() {
        let row = w.row(first + k);
        for (g, ys) in y.chunks_mut(GROUP).enumerate() {
            let xs = &x[g * GROUP * cols..(g * GROUP + ys.len()) * cols];
            dot_rows(&row, xs, cols, ys, simd);
        }
    }
}

/// The outputs of rows `first..first + R` for tokens `start..start + T` of `x` (`t` tokens): into `out[r · t + j]`.
///
/// # Safety
/// The CPU must have AVX-512F, AVX2, FMA and F16C, and the matrix must fit [`avx512::dot`].
#[cfg(target_arch = "x86_64")]
unsafe fn avx512_rows<const R: usize, const T: usize>(
    w: &PackedMatrix,
    first: usize,
    x: &[f32],
    start: usize,
    t: usize,
    out: &mut [f32],
) {
    let cols = w.cols();
    let rows: [PackedRow; R] = std::array::from_fn(|r| w.row(first + r));
    let xs = &x[start * cols..(start + T) * cols];
    // SAFETY: the caller's guarantee.
    let y = unsafe { avx512::dot::<R, T>(rows.each_ref(), xs, cols) };
    for (r, yr) in y.iter().enumerate() {
        out[r * t + start..][..T].copy_from_slice(yr);
    }
}

/// `ys[j] = Σ_i xs[j, i] · row[i]` for up to [`GROUP`] tokens `j`.
fn dot_rows(row: &PackedRow, xs: &[f32], n: usize, ys: &mut [f32], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is true only for a kernel the CPU runs other than the portable one, so the CPU has AVX2,
        // FMA and F16C (`QuantKernel::available`).
        unsafe {
            match ys.len() {
                1 => x86::dot::<1>(row, xs, n, ys),
                _ => x86::dot::<GROUP>(row, xs, n, ys),
            }
        }
        return;
    }
    let _ = simd;
    portable_dot(row, xs, n, ys);
}

/// The portable kernel: the order of [`super::matvec`]'s portable path, multiply and add rounded separately.
pub(super) fn portable_dot(row: &PackedRow, xs: &[f32], n: usize, ys: &mut [f32]) {
    let main = n / LANES * LANES;
    let mut wbuf = [0f32; LANES];
    for (j, y) in ys.iter_mut().enumerate() {
        let x = &xs[j * n..(j + 1) * n];
        let mut acc = [0f32; LANES];
        let mut i = 0;
        while i < main {
            row.widen(i, &mut wbuf);
            for l in 0..LANES {
                acc[l] += x[i + l] * wbuf[l];
            }
            i += LANES;
        }
        let mut sum = combine(&acc);
        for (k, &xk) in x.iter().enumerate().skip(main) {
            sum += xk * row.value(k);
        }
        *y = sum;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::kernel::x86::hsum;
    use super::{LANES, PackedRow};
    use std::arch::x86_64::*;

    /// The 32 weights at element `i` (a multiple of 32) whose scale is `s` in every lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load32(row: &PackedRow, i: usize, s: __m256) -> [__m256; 4] {
        let widen8 = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
        // SAFETY: the caller guarantees `i + 32 <= n`, so the 16 (int4) or 32 (int8) bytes read from element `i` on
        // are inside the row's codes; the loads are unaligned.
        let (a, b) = unsafe {
            if row.int4 {
                // Bytes `i/2 .. i/2 + 16` hold elements `i .. i + 32`: element `i + k` in byte k's low nibble,
                // `i + 16 + k` in its high nibble (`int4_position`).
                let bytes = _mm_loadu_si128(row.codes.as_ptr().add(i / 2) as *const __m128i);
                let mask = _mm_set1_epi8(0x0F);
                let low = _mm_and_si128(bytes, mask);
                let high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
                // Each nibble sign-extended: (v ^ 8) - 8.
                let eight = _mm_set1_epi8(8);
                let sign = |v: __m128i| _mm_sub_epi8(_mm_xor_si128(v, eight), eight);
                (sign(low), sign(high))
            } else {
                let p = row.codes.as_ptr().add(i);
                (
                    _mm_loadu_si128(p as *const __m128i),
                    _mm_loadu_si128(p.add(16) as *const __m128i),
                )
            }
        };
        [
            _mm256_mul_ps(widen8(a), s),
            _mm256_mul_ps(widen8(_mm_srli_si128(a, 8)), s),
            _mm256_mul_ps(widen8(b), s),
            _mm256_mul_ps(widen8(_mm_srli_si128(b, 8)), s),
        ]
    }

    /// The SIMD kernel for `T` tokens (the order of `super::super::matvec`'s SIMD path).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot<const T: usize>(
        row: &PackedRow,
        xs: &[f32],
        n: usize,
        ys: &mut [f32],
    ) {
        let code_bytes = if row.int4 { n.div_ceil(2) } else { n };
        assert!(
            xs.len() >= T * n
                && ys.len() >= T
                && row.codes.len() >= code_bytes
                && row.group > 0
                && row.scales.len() >= n.div_ceil(row.group)
        );
        let main = n / LANES * LANES;
        let mut acc = [[_mm256_setzero_ps(); 4]; T];
        // The scale is one value per block of 32 when groups are whole blocks or the row has one group; then the
        // blocks of a group share one broadcast scale. Other group sizes widen each block element by element.
        let segment = if row.group.is_multiple_of(LANES) || row.group >= n {
            Some(row.group)
        } else {
            None
        };
        let mut g = 0;
        let mut end = 0;
        let mut s = _mm256_setzero_ps();
        let mut buf = [0f32; LANES];
        let mut i = 0;
        while i < main {
            let w = match segment {
                Some(seg) => {
                    if i == end {
                        // The f16 scale widened in every lane by F16C (exact, as `f32::from`).
                        s = _mm256_cvtph_ps(_mm_set1_epi16(row.scales[g].to_bits() as i16));
                        g += 1;
                        end += seg;
                    }
                    // SAFETY: `i + LANES <= main <= n`.
                    unsafe { load32(row, i, s) }
                }
                None => {
                    row.widen(i, &mut buf);
                    // SAFETY: `buf` holds 32 values.
                    unsafe {
                        let p = buf.as_ptr();
                        [
                            _mm256_loadu_ps(p),
                            _mm256_loadu_ps(p.add(8)),
                            _mm256_loadu_ps(p.add(16)),
                            _mm256_loadu_ps(p.add(24)),
                        ]
                    }
                }
            };
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: `i + LANES <= n`, inside token `j`'s slice of `xs`.
                let x = unsafe { xs.as_ptr().add(j * n + i) };
                for (q, (aq, wq)) in a.iter_mut().zip(&w).enumerate() {
                    // SAFETY: as above.
                    *aq = _mm256_fmadd_ps(unsafe { _mm256_loadu_ps(x.add(8 * q)) }, *wq, *aq);
                }
            }
            i += LANES;
        }
        for (j, a) in acc.iter().enumerate() {
            let lanes = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
            let mut sum = hsum(lanes);
            for k in main..n {
                sum = xs[j * n + k].mul_add(row.value(k), sum);
            }
            ys[j] = sum;
        }
    }
}

#[cfg(test)]
mod tests;
