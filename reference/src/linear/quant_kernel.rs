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
mod tests {
    use super::super::kernel::portable_dot as mapped_portable_dot;
    use super::super::{MappedMatrix, SharedMap, matvec};
    use super::*;
    use crate::quant::{QuantKind, QuantizedMatrix, quantize_int4_sym, quantize_int8_sym};
    use candle_core::{Device, Tensor};

    /// Deterministic values in [-1, 1), each row scaled by its own magnitude; every seventh row zero.
    fn weights(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let mut w = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            let magnitude = 2f32.powi((r % 5) as i32 - 3);
            for _ in 0..cols {
                let v = next() * magnitude;
                w.push(if r % 7 == 6 { 0.0 } else { v });
            }
        }
        w
    }

    fn quantized(kind: QuantKind, rows: usize, cols: usize, seed: u64) -> QuantizedMatrix {
        let w = weights(rows, cols, seed);
        match kind {
            QuantKind::Int4Sym { group } => quantize_int4_sym(&w, rows, cols, group).unwrap(),
            QuantKind::Int8Sym => quantize_int8_sym(&w, rows, cols).unwrap(),
        }
    }

    /// The dequantised matrix as f32 bytes at byte offset `pad` (odd: loads must not assume alignment).
    fn dequantized(q: &QuantizedMatrix, pad: usize) -> MappedMatrix {
        let mut bytes = vec![0u8; pad];
        for v in q.dequantize() {
            bytes.extend(v.to_le_bytes());
        }
        MappedMatrix::new(
            &SharedMap::from_vec(bytes),
            pad,
            q.rows(),
            q.cols(),
            Elem::F32,
        )
        .unwrap()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// `matvec_packed` (SIMD where available) and the portable kernel against `matvec` and its portable kernel on
    /// the dequantised f32 matrix: the same bits for every token count.
    fn check(kind: QuantKind, rows: usize, cols: usize) {
        let q = quantized(kind, rows, cols, 1 + rows as u64 * 31 + cols as u64);
        let p = PackedMatrix::from_quantized(&q).unwrap();
        let m = dequantized(&q, 3);
        assert_eq!(bits(&p.rows_f32(0, rows)), bits(&q.dequantize()));
        for t in 1..=8 {
            let x = weights(t, cols, 7 + t as u64);
            let a = matvec_packed(&p, &x, t);
            let b = matvec(&m, &x, t);
            assert_eq!(bits(&a), bits(&b), "{kind:?} [{rows}, {cols}] T={t}");
            for r in 0..rows {
                let mut ya = vec![0f32; t];
                let mut yb = vec![0f32; t];
                portable_dot(&p.row(r), &x, cols, &mut ya);
                mapped_portable_dot(m.row_bytes(r), Elem::F32, &x, cols, &mut yb);
                assert_eq!(
                    bits(&ya),
                    bits(&yb),
                    "portable {kind:?} [{rows}, {cols}] T={t} row {r}"
                );
            }
        }
    }

    #[test]
    fn packed_matvec_equals_the_f32_matvec_on_the_dequantised_values_bit_for_bit() {
        use QuantKind::*;
        for (kind, rows, cols) in [
            // Groups that are whole 32-lane blocks, one group a row, and groups that split blocks (odd ones too).
            (Int4Sym { group: 128 }, 9, 256),
            (Int4Sym { group: 32 }, 5, 96),
            (Int4Sym { group: 64 }, 3, 64),
            (Int4Sym { group: 33 }, 7, 33),
            (Int4Sym { group: 8 }, 6, 40),
            (Int4Sym { group: 16 }, 4, 112),
            (Int4Sym { group: 48 }, 3, 144),
            (Int4Sym { group: 3 }, 5, 15),
            (Int4Sym { group: 5 }, 11, 65),
            (Int4Sym { group: 1 }, 2, 7),
            (Int4Sym { group: 31 }, 3, 31),
            (Int8Sym, 1, 1),
            (Int8Sym, 3, 17),
            (Int8Sym, 4, 31),
            (Int8Sym, 6, 32),
            (Int8Sym, 9, 33),
            (Int8Sym, 33, 100),
            (Int8Sym, 13, 257),
        ] {
            check(kind, rows, cols);
        }
    }

    #[test]
    fn packed_matvec_splits_rows_across_threads_without_changing_a_bit() {
        for kind in [QuantKind::Int4Sym { group: 32 }, QuantKind::Int8Sym] {
            let (rows, cols) = (3000, 96);
            let q = quantized(kind, rows, cols, 3);
            let p = PackedMatrix::from_quantized(&q).unwrap();
            let x = weights(3, cols, 5);
            let many = matvec_packed(&p, &x, 3);
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            let one = pool.install(|| matvec_packed(&p, &x, 3));
            assert_eq!(bits(&many), bits(&one), "{kind:?}");
            assert_eq!(bits(&many), bits(&matvec(&dequantized(&q, 0), &x, 3)));
        }
    }

    #[test]
    fn packing_keeps_every_code_and_scale_and_blocks_pack_as_the_whole() {
        for (kind, rows, cols) in [
            (QuantKind::Int4Sym { group: 5 }, 23, 15),
            (QuantKind::Int4Sym { group: 16 }, 20, 64),
            (QuantKind::Int8Sym, 17, 9),
        ] {
            let w = weights(rows, cols, 9);
            let quant = |r: std::ops::Range<usize>| match kind {
                QuantKind::Int4Sym { group } => {
                    quantize_int4_sym(&w[r.start * cols..r.end * cols], r.len(), cols, group)
                }
                QuantKind::Int8Sym => {
                    quantize_int8_sym(&w[r.start * cols..r.end * cols], r.len(), cols)
                }
            };
            let whole = quant(0..rows).unwrap();
            let p = PackedMatrix::from_quantized(&whole).unwrap();
            assert_eq!(p.to_quantized().unwrap(), whole);
            if let QuantKind::Int4Sym { .. } = kind {
                // Every code is where `int4_position` puts it.
                let row_bytes = p.row_bytes();
                for (i, &c) in whole.codes().iter().enumerate() {
                    let (byte, shift) = int4_position(i % cols, cols);
                    assert_eq!(low_code(p.codes[i / cols * row_bytes + byte] >> shift), c);
                }
            }
            for block in [1, 4, rows, rows + 3] {
                let b = PackedMatrix::from_row_blocks(kind, rows, cols, block, quant).unwrap();
                assert_eq!(b.codes, p.codes, "{kind:?} blocks of {block}");
                assert_eq!(b.scales, p.scales, "{kind:?} blocks of {block}");
            }
            // A block of the wrong shape, a failing block, and a group that does not divide the width are errors.
            let wrong = PackedMatrix::from_row_blocks(kind, rows, cols, 4, |_| quant(0..1));
            assert!(wrong.unwrap_err().to_string().contains("expected"));
            let failing = PackedMatrix::from_row_blocks(kind, rows, cols, 4, |r| {
                if r.start >= 8 {
                    Err(crate::error::Error::Input("block refused".into()))
                } else {
                    quant(r)
                }
            });
            assert!(failing.unwrap_err().to_string().contains("block refused"));
        }
        let e = PackedMatrix::from_row_blocks(QuantKind::Int4Sym { group: 7 }, 2, 16, 1, |_| {
            unreachable!("the group is checked first")
        });
        assert!(e.unwrap_err().to_string().contains("does not divide"));
    }

    #[test]
    fn int4_rows_hold_blocks_of_32_as_low_and_high_nibbles_and_the_tail_in_order() {
        // One row of 34 codes: code k of the block is k % 16 - 8, so byte k holds nibble (k - 8) & 15 = k ^ 8 twice;
        // the tail (-8, -7) is one byte, in order.
        let codes: Vec<i8> = (0..34).map(|k| (k % 16) as i8 - 8).collect();
        let q = QuantizedMatrix::from_parts(
            QuantKind::Int4Sym { group: 34 },
            1,
            34,
            codes,
            vec![f16::ONE],
        )
        .unwrap();
        let p = PackedMatrix::from_quantized(&q).unwrap();
        let mut expected: Vec<u8> = (0..16u8).map(|k| (k ^ 8) * 0x11).collect();
        expected.push(0x98);
        assert_eq!(*p.codes, expected);
        assert_eq!(p.to_quantized().unwrap(), q);
    }

    #[test]
    fn packed_lookup_and_gemm_path_equal_the_dense_dequantised_matrix() {
        let (rows, cols) = (37, 64);
        let q = quantized(QuantKind::Int4Sym { group: 16 }, rows, cols, 11);
        let p = PackedMatrix::from_quantized(&q).unwrap();
        let deq = q.dequantize();
        let dense = Tensor::from_vec(deq.clone(), (rows, cols), &Device::Cpu).unwrap();
        assert_eq!(
            bits(
                &p.to_tensor()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            ),
            bits(&deq)
        );
        let g = p.gather(&[5, 0, 36]).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(bits(&g[0]), bits(&deq[5 * cols..6 * cols]));
        assert_eq!(bits(&g[2]), bits(&deq[36 * cols..37 * cols]));
        assert!(p.gather(&[37]).is_err());
        for t in [MATVEC_T + 1, 11, 40] {
            let xs = weights(t, cols, 2);
            let x = Tensor::from_vec(xs.clone(), (t, cols), &Device::Cpu).unwrap();
            // A prompt: the packed product in the matvec's order where the CPU has AVX-512F, else candle's GEMM.
            let expected: Vec<f32> = match crate::linear::PromptKernel::detect() {
                crate::linear::PromptKernel::Avx512 => matvec_packed(&p, &xs, t),
                crate::linear::PromptKernel::Gemm => crate::ops::linear(&x, &dense)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap(),
            };
            let y: Vec<f32> = p
                .forward(&x)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(bits(&y), bits(&expected), "T={t}");
            // Several blocks of rows (the last one short): each block's outputs are candle's product of those rows
            // of the dense matrix, in place (candle's GEMM may order its sums differently for another row count).
            for block in [1, 8, 36] {
                let y = p.forward_gemm(&x, block).unwrap().to_vec2::<f32>().unwrap();
                for start in (0..rows).step_by(block) {
                    let count = block.min(rows - start);
                    let part = crate::ops::linear(&x, &dense.narrow(0, start, count).unwrap())
                        .unwrap()
                        .to_vec2::<f32>()
                        .unwrap();
                    for (yj, pj) in y.iter().zip(&part) {
                        assert_eq!(
                            bits(&yj[start..start + count]),
                            bits(pj),
                            "T={t}, blocks of {block}"
                        );
                    }
                }
            }
        }
        // Few tokens: the matvec; wrong inputs are errors.
        let x = Tensor::from_vec(weights(2, cols, 4), (2, cols), &Device::Cpu).unwrap();
        let y = p
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(bits(&y), bits(&matvec(&dequantized(&q, 0), &xs, 2)));
        assert!(
            p.forward(
                &Tensor::zeros((2, cols + 1), candle_core::DType::F32, &Device::Cpu).unwrap()
            )
            .is_err()
        );
        assert!(
            p.forward(&x.to_dtype(candle_core::DType::F64).unwrap())
                .is_err()
        );
    }

    const MATVEC_T: usize = super::super::MATVEC_MAX_TOKENS;
}
