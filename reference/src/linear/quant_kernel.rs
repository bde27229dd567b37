//! The matrix-vector kernel of [`super::PackedMatrix`]: integer codes and f16 scales widened to the f32 weight
//! `f32(code) · f32(scale)` (in registers on the SIMD path), rows split across the rayon threads, each output summed
//! in the fixed order the parent module documents for [`super::matvec`].
//!
//! The product `f32(code) · f32(scale)` is exact (a code of at most 8 bits times an 11-bit significand, far from
//! f32's range limits), so each weight equals the dequantised value of [`crate::quant::QuantizedMatrix::dequantize`]
//! and, the order of the sums being the same, [`matvec_packed`] gives bit for bit what [`super::matvec`] gives on the
//! dequantised matrix stored as f32, on either path (SIMD or portable; the SIMD path here needs AVX2, FMA and F16C).

use super::kernel::{GROUP, LANES, combine, simd_available};
use super::{Elem, PackedMatrix};
use half::f16;
use rayon::prelude::*;

/// One row of a packed matrix: its codes, its scales and how they are laid out.
#[derive(Clone, Copy)]
pub(super) struct PackedRow<'a> {
    /// The row's codes: two per byte (int4, element `2k` in the low nibble) or one per byte (int8).
    pub codes: &'a [u8],
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
            let byte = self.codes[i / 2];
            let nibble = if i & 1 == 0 { byte << 4 } else { byte & 0xF0 };
            (nibble as i8) >> 4
        } else {
            self.codes[i] as i8
        }
    }

    /// Weight `i` of the row, `f32(code) · f32(scale)` (exact).
    #[inline(always)]
    pub fn value(&self, i: usize) -> f32 {
        self.code(i) as f32 * f32::from(self.scales[i / self.group])
    }

    /// Weights `start..start + dst.len()` of the row (a group at a time, two int4 codes a byte where whole bytes
    /// fall inside the group).
    pub fn widen(&self, start: usize, dst: &mut [f32]) {
        let end = start + dst.len();
        let mut i = start;
        while i < end {
            let g = i / self.group;
            let stop = ((g + 1) * self.group).min(end);
            let s = f32::from(self.scales[g]);
            let out = &mut dst[i - start..stop - start];
            if self.int4 {
                let mut k = 0;
                if i & 1 == 1 {
                    out[0] = self.code(i) as f32 * s;
                    k = 1;
                }
                let pairs = (out.len() - k) / 2;
                let first = (i + k) / 2;
                for (pair, &byte) in out[k..k + 2 * pairs]
                    .chunks_exact_mut(2)
                    .zip(&self.codes[first..first + pairs])
                {
                    pair[0] = (((byte << 4) as i8) >> 4) as f32 * s;
                    pair[1] = ((byte as i8) >> 4) as f32 * s;
                }
                if k + 2 * pairs < out.len() {
                    out[out.len() - 1] = self.code(stop - 1) as f32 * s;
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

/// `y = x W^T` for `t` tokens: `x` is `[t, cols]` row-major f32, the result `[t, rows]`. Rows of `W` are split
/// across the rayon threads; each row is read once for every `GROUP` tokens. The summation order is that of
/// [`super::matvec`].
pub fn matvec_packed(w: &PackedMatrix, x: &[f32], t: usize) -> Vec<f32> {
    assert_eq!(x.len(), t * w.cols(), "matvec: x must be [t, cols]");
    let rows = w.rows();
    let cols = w.cols();
    if rows == 0 || t == 0 {
        return vec![0f32; rows * t];
    }
    let simd = simd_available(Elem::F16);
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
        .for_each(|(task, out)| {
            let first = task * rows_per_task;
            for (k, y) in out.chunks_mut(t).enumerate() {
                let row = w.row(first + k);
                for (g, ys) in y.chunks_mut(GROUP).enumerate() {
                    let xs = &x[g * GROUP * cols..(g * GROUP + ys.len()) * cols];
                    dot_rows(&row, xs, cols, ys, simd);
                }
            }
        });
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

/// `ys[j] = Σ_i xs[j, i] · row[i]` for up to [`GROUP`] tokens `j`.
fn dot_rows(row: &PackedRow, xs: &[f32], n: usize, ys: &mut [f32], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is true only when the CPU has AVX2, FMA and F16C, checked by `simd_available`.
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
                // Bytes `i/2 .. i/2 + 16` hold elements `i .. i + 32`, element `2k` in byte k's low nibble.
                let bytes = _mm_loadu_si128(row.codes.as_ptr().add(i / 2) as *const __m128i);
                let mask = _mm_set1_epi8(0x0F);
                let low = _mm_and_si128(bytes, mask);
                let high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
                // Interleaved back into element order, then each nibble sign-extended: (v ^ 8) - 8.
                let eight = _mm_set1_epi8(8);
                let sign = |v: __m128i| _mm_sub_epi8(_mm_xor_si128(v, eight), eight);
                (
                    sign(_mm_unpacklo_epi8(low, high)),
                    sign(_mm_unpackhi_epi8(low, high)),
                )
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
                // Rows of an even width are exactly `pack_i4` of their codes.
                if cols % 2 == 0 {
                    assert_eq!(*p.codes, crate::quant::pack_i4(whole.codes()).unwrap());
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
            let x = Tensor::from_vec(weights(t, cols, 2), (t, cols), &Device::Cpu).unwrap();
            let expected = crate::ops::linear(&x, &dense)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            assert_eq!(p.forward(&x).unwrap().to_vec2::<f32>().unwrap(), expected);
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
