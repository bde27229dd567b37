//! FP16SIM's matrix product at the real model's sizes: the same rounding points as the op-by-op evaluator
//! ([`super::eval`]'s plain product, its specification), in the same order, so that every result is the same to the
//! last bit; only the work is arranged for the machine.
//!
//! - The rounding of one value to the storage format ([`round_lane`]) is integer arithmetic on the f32's bits, the
//!   same function as [`NumericModel::round`] (round to nearest even, overflow to infinity, subnormals rounded or
//!   flushed) without a branch, so that eight of them run in one vector register.
//! - `out[i][j] = Σ_t term(a[i][t]·w[j][t])` is summed in the order of `t` for every output, as the plain product
//!   sums it; the vector lanes are eight rows `j` of `w` (interleaved per tile), never the terms of one sum.
//! - Rows of `w` are produced a tile at a time by a [`Rows`] source (a dense value, or a checkpoint matrix decoded
//!   from its packed codes as the dequantization ops would compute it) and tiles run in parallel (rayon).

use super::numeric::{Accumulation, NumericModel, Storage};
use crate::error::Result;
use rayon::prelude::*;

/// Lanes per vector of terms.
const LANES: usize = 8;
/// Values of `w` a tile decodes at once (about 256 KiB of f32).
const TILE_VALUES: usize = 1 << 16;

/// The storage format as a const parameter.
pub(super) const F16: u8 = 0;
pub(super) const BF16: u8 = 1;
pub(super) const F32: u8 = 2;

/// How a product's terms are summed, as a const parameter: unrounded (the model is exact f32), in f32 (each term
/// rounded), or in the storage format (each partial sum rounded too).
const EXACT: u8 = 0;
const ACC_F32: u8 = 1;
const ACC_STORAGE: u8 = 2;

/// [`NumericModel::round`] of storage `S` (flushing subnormals when `FTZ`), branch-free on the bits: the f16 and
/// bf16 cases add half an ulp (less one, plus the kept lowest bit: ties to even) and clear what lies below; an f16
/// subnormal is rounded by f32 addition at the scale where f32's ulp is f16's smallest subnormal.
#[inline(always)]
pub(super) fn round_lane<const S: u8, const FTZ: bool>(x: f32) -> f32 {
    let bits = x.to_bits();
    let sign = bits & 0x8000_0000;
    let a = bits & 0x7fff_ffff;
    let nan = a > 0x7f80_0000;
    let r = match S {
        F16 => {
            let normal = a.wrapping_add(0x0fff + ((a >> 13) & 1)) & !0x1fff;
            // Beyond the largest finite f16 (65504) a rounded value is infinite.
            let normal = if normal > 0x477f_e000 {
                0x7f80_0000
            } else {
                normal
            };
            // Below f16's smallest normal (2⁻¹⁴): a multiple of 2⁻²⁴, which is f32's ulp at 0.5.
            let sub = ((f32::from_bits(a) + 0.5) - 0.5).to_bits();
            let r = if a < 0x3880_0000 { sub } else { normal };
            let r = if nan { a | 0x0040_0000 } else { r };
            if FTZ && r < 0x3880_0000 { 0 } else { r }
        }
        BF16 => {
            let r = a.wrapping_add(0x7fff + ((a >> 16) & 1)) & 0xffff_0000;
            let r = if nan { a | 0x0040_0000 } else { r };
            if FTZ && r < 0x0080_0000 { 0 } else { r }
        }
        _ => {
            if FTZ && a < 0x0080_0000 {
                0
            } else {
                a
            }
        }
    };
    f32::from_bits(r | sign)
}

/// `out[j] = round(round(codes[j]) · scale)`: a group of dequantized weights as the ops `Convert` and `Multiply`
/// store them (in AVX2 where the CPU has it).
pub(super) fn dequantize<const S: u8, const FTZ: bool>(codes: &[f32], scale: f32, out: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        done = unsafe { avx2::dequantize::<S, FTZ>(codes, scale, out) };
    }
    for (o, &c) in out[done..].iter_mut().zip(&codes[done..]) {
        *o = round_lane::<S, FTZ>(round_lane::<S, FTZ>(c) * scale);
    }
}

/// A source of the rows of the right-hand matrix `w` (`[n, k]`): rows `r0..r1` written to `out`
/// (`(r1 - r0) · k` values, row-major), each value as the graph stores it.
pub(super) trait Rows: Sync {
    fn rows<const S: u8, const FTZ: bool>(
        &self,
        r0: usize,
        r1: usize,
        out: &mut [f32],
    ) -> Result<()>;
}

/// Rows of a dense value (already stored: copied as they are).
pub(super) struct Dense<'a>(pub &'a [f32], pub usize);

impl Rows for Dense<'_> {
    fn rows<const S: u8, const FTZ: bool>(
        &self,
        r0: usize,
        r1: usize,
        out: &mut [f32],
    ) -> Result<()> {
        out.copy_from_slice(&self.0[r0 * self.1..r1 * self.1]);
        Ok(())
    }
}

/// `a @ wᵀ` for `a` `[m, k]` and `w` `[n, k]` (from `w`), every term rounded and summed as `model` says; the
/// result (`[m, n]`) is not rounded (the caller rounds it, as it rounds every op's result).
pub(super) fn products<W: Rows>(
    model: &NumericModel,
    a: &[f32],
    m: usize,
    k: usize,
    n: usize,
    w: &W,
) -> Result<Vec<f32>> {
    let acc = if model.is_exact_f32() {
        EXACT
    } else if model.accumulation == Accumulation::Storage {
        ACC_STORAGE
    } else {
        ACC_F32
    };
    macro_rules! run {
        ($s:expr, $ftz:expr) => {
            match acc {
                EXACT => dispatch::<$s, $ftz, EXACT, W>(a, m, k, n, w),
                ACC_F32 => dispatch::<$s, $ftz, ACC_F32, W>(a, m, k, n, w),
                _ => dispatch::<$s, $ftz, ACC_STORAGE, W>(a, m, k, n, w),
            }
        };
    }
    match (model.storage, model.flush_subnormals) {
        (Storage::F16, true) => run!(F16, true),
        (Storage::F16, false) => run!(F16, false),
        (Storage::Bf16, true) => run!(BF16, true),
        (Storage::Bf16, false) => run!(BF16, false),
        (Storage::F32, true) => run!(F32, true),
        (Storage::F32, false) => run!(F32, false),
    }
}

/// The kernel in the widest vectors the CPU has (AVX2 where it is there: the same operations, eight lanes).
fn dispatch<const S: u8, const FTZ: bool, const ACC: u8, W: Rows>(
    a: &[f32],
    m: usize,
    k: usize,
    n: usize,
    w: &W,
) -> Result<Vec<f32>> {
    #[cfg(target_arch = "x86_64")]
    let wide = std::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    let wide = false;
    let mut out = vec![0f32; m * n];
    if n == 0 || m == 0 {
        return Ok(out);
    }
    // Tiles of whole lane groups of rows; more tiles than threads when there are rows enough.
    let tile = ((TILE_VALUES / k.max(1)).max(1).div_ceil(LANES) * LANES)
        .min(n.div_ceil(LANES) * LANES)
        .max(LANES);
    let starts: Vec<usize> = (0..n).step_by(tile).collect();
    let blocks: Vec<Result<Vec<f32>>> = starts
        .par_iter()
        .map(|&r0| {
            let r1 = (r0 + tile).min(n);
            let mut rows = vec![0f32; (r1 - r0) * k];
            w.rows::<S, FTZ>(r0, r1, &mut rows)?;
            Ok(tile_products::<S, FTZ, ACC>(a, m, k, &rows, r1 - r0, wide))
        })
        .collect();
    for (&r0, block) in starts.iter().zip(blocks) {
        let block = block?;
        let width = block.len() / m;
        for i in 0..m {
            out[i * n + r0..i * n + r0 + width].copy_from_slice(&block[i * width..(i + 1) * width]);
        }
    }
    Ok(out)
}

/// `a @ rowsᵀ` for one tile of `count` rows: `[m, count]`; `wide`: the AVX2 kernel (the CPU has it).
fn tile_products<const S: u8, const FTZ: bool, const ACC: u8>(
    a: &[f32],
    m: usize,
    k: usize,
    rows: &[f32],
    count: usize,
    wide: bool,
) -> Vec<f32> {
    let mut out = vec![0f32; m * count];
    let mut lanes = vec![0f32; k * LANES];
    let mut sums = vec![0f32; m * LANES];
    for g in (0..count).step_by(LANES) {
        let width = (count - g).min(LANES);
        // Eight rows interleaved: lanes[t·8 + l] = w[g + l][t] (missing rows zero, their sums dropped).
        lanes.fill(0.0);
        for l in 0..width {
            let row = &rows[(g + l) * k..(g + l + 1) * k];
            for (t, &v) in row.iter().enumerate() {
                lanes[t * LANES + l] = v;
            }
        }
        #[cfg(target_arch = "x86_64")]
        if wide {
            // SAFETY: `wide` is set only where the CPU has AVX2.
            unsafe { avx2::group::<S, FTZ, ACC>(a, m, k, &lanes, &mut sums) };
        } else {
            group::<S, FTZ, ACC>(a, m, k, &lanes, &mut sums);
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = wide;
            group::<S, FTZ, ACC>(a, m, k, &lanes, &mut sums);
        }
        for i in 0..m {
            out[i * count + g..i * count + g + width]
                .copy_from_slice(&sums[i * LANES..i * LANES + width]);
        }
    }
    out
}

/// One lane group: `sums[i·8 + l] = Σ_t term(a[i][t] · lanes[t·8 + l])`, in the order of `t`.
fn group<const S: u8, const FTZ: bool, const ACC: u8>(
    a: &[f32],
    m: usize,
    k: usize,
    lanes: &[f32],
    sums: &mut [f32],
) {
    for i in 0..m {
        let x = &a[i * k..(i + 1) * k];
        let mut acc = [0f32; LANES];
        for (t, &xv) in x.iter().enumerate() {
            let w = &lanes[t * LANES..(t + 1) * LANES];
            for l in 0..LANES {
                let p = xv * w[l];
                acc[l] = match ACC {
                    EXACT => acc[l] + p,
                    ACC_F32 => acc[l] + round_lane::<S, FTZ>(p),
                    _ => round_lane::<S, FTZ>(acc[l] + round_lane::<S, FTZ>(p)),
                };
            }
        }
        sums[i * LANES..(i + 1) * LANES].copy_from_slice(&acc);
    }
}

/// [`group`] and [`round_lane`] in AVX2: the same integer and f32 operations on eight lanes (no fused multiply-add:
/// a term is rounded to f32 before it is rounded to storage, as everywhere).
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::{ACC_F32, BF16, EXACT, F16, LANES};
    use std::arch::x86_64::*;

    /// [`super::round_lane`] of eight values.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn round<const S: u8, const FTZ: bool>(x: __m256) -> __m256 {
        let bits = _mm256_castps_si256(x);
        let sign = _mm256_and_si256(bits, _mm256_set1_epi32(i32::MIN));
        let a = _mm256_and_si256(bits, _mm256_set1_epi32(i32::MAX));
        let nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f80_0000));
        let quiet = _mm256_or_si256(a, _mm256_set1_epi32(0x0040_0000));
        let below = |r: __m256i, limit: i32| _mm256_cmpgt_epi32(_mm256_set1_epi32(limit), r);
        let r = match S {
            F16 => {
                let lsb = _mm256_and_si256(_mm256_srli_epi32::<13>(a), _mm256_set1_epi32(1));
                let up = _mm256_add_epi32(a, _mm256_add_epi32(_mm256_set1_epi32(0x0fff), lsb));
                let normal = _mm256_and_si256(up, _mm256_set1_epi32(!0x1fff));
                let over = _mm256_cmpgt_epi32(normal, _mm256_set1_epi32(0x477f_e000));
                let normal = _mm256_blendv_epi8(normal, _mm256_set1_epi32(0x7f80_0000), over);
                if FTZ {
                    // Flushed, every f16 subnormal is zero: below 2⁻¹⁴ a value rounds to zero, but from the tie
                    // 2⁻¹⁴ − 2⁻²⁵ (to even) up, where it rounds to 2⁻¹⁴.
                    let up = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x387f_dfff));
                    let small = _mm256_and_si256(up, _mm256_set1_epi32(0x3880_0000));
                    let r = _mm256_blendv_epi8(normal, small, below(a, 0x3880_0000));
                    _mm256_blendv_epi8(r, quiet, nan)
                } else {
                    let half = _mm256_set1_ps(0.5);
                    let sub = _mm256_castps_si256(_mm256_sub_ps(
                        _mm256_add_ps(_mm256_castsi256_ps(a), half),
                        half,
                    ));
                    let r = _mm256_blendv_epi8(normal, sub, below(a, 0x3880_0000));
                    _mm256_blendv_epi8(r, quiet, nan)
                }
            }
            BF16 => {
                let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(a), _mm256_set1_epi32(1));
                let up = _mm256_add_epi32(a, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
                let r = _mm256_and_si256(up, _mm256_set1_epi32(0xffff_0000u32 as i32));
                let r = _mm256_blendv_epi8(r, quiet, nan);
                if FTZ {
                    _mm256_andnot_si256(below(r, 0x0080_0000), r)
                } else {
                    r
                }
            }
            _ => {
                if FTZ {
                    _mm256_andnot_si256(below(a, 0x0080_0000), a)
                } else {
                    a
                }
            }
        };
        _mm256_castsi256_ps(_mm256_or_si256(r, sign))
    }

    /// [`super::dequantize`] of the whole lane groups of `codes`; returns how many values it wrote.
    #[target_feature(enable = "avx2")]
    pub(super) fn dequantize<const S: u8, const FTZ: bool>(
        codes: &[f32],
        scale: f32,
        out: &mut [f32],
    ) -> usize {
        let n = codes.len().min(out.len()) / LANES * LANES;
        let s = _mm256_set1_ps(scale);
        for j in (0..n).step_by(LANES) {
            // SAFETY: j + 8 <= n, within both slices.
            unsafe {
                let c = round::<S, FTZ>(_mm256_loadu_ps(codes.as_ptr().add(j)));
                let v = round::<S, FTZ>(_mm256_mul_ps(c, s));
                _mm256_storeu_ps(out.as_mut_ptr().add(j), v);
            }
        }
        n
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn step<const S: u8, const FTZ: bool, const ACC: u8>(acc: __m256, p: __m256) -> __m256 {
        match ACC {
            EXACT => _mm256_add_ps(acc, p),
            ACC_F32 => _mm256_add_ps(acc, round::<S, FTZ>(p)),
            _ => round::<S, FTZ>(_mm256_add_ps(acc, round::<S, FTZ>(p))),
        }
    }

    /// [`super::group`]: two rows of `a` at a time (two independent sums per lane, one load of `w`).
    #[target_feature(enable = "avx2")]
    pub(super) fn group<const S: u8, const FTZ: bool, const ACC: u8>(
        a: &[f32],
        m: usize,
        k: usize,
        lanes: &[f32],
        sums: &mut [f32],
    ) {
        assert!(a.len() >= m * k && lanes.len() >= k * LANES && sums.len() >= m * LANES);
        let w_at = |t: usize| {
            // SAFETY: t < k, and lanes holds k · 8 values (asserted above).
            unsafe { _mm256_loadu_ps(lanes.as_ptr().add(t * LANES)) }
        };
        let mut i = 0;
        while i + 2 <= m {
            let (x0, x1) = (&a[i * k..(i + 1) * k], &a[(i + 1) * k..(i + 2) * k]);
            let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for t in 0..k {
                let w = w_at(t);
                acc0 = step::<S, FTZ, ACC>(acc0, _mm256_mul_ps(_mm256_set1_ps(x0[t]), w));
                acc1 = step::<S, FTZ, ACC>(acc1, _mm256_mul_ps(_mm256_set1_ps(x1[t]), w));
            }
            // SAFETY: sums holds m · 8 values (asserted above) and i + 1 < m.
            unsafe {
                _mm256_storeu_ps(sums.as_mut_ptr().add(i * LANES), acc0);
                _mm256_storeu_ps(sums.as_mut_ptr().add((i + 1) * LANES), acc1);
            }
            i += 2;
        }
        if i < m {
            let x = &a[i * k..(i + 1) * k];
            let mut acc = _mm256_setzero_ps();
            for (t, &xv) in x.iter().enumerate() {
                acc = step::<S, FTZ, ACC>(acc, _mm256_mul_ps(_mm256_set1_ps(xv), w_at(t)));
            }
            // SAFETY: sums holds m · 8 values and i < m.
            unsafe { _mm256_storeu_ps(sums.as_mut_ptr().add(i * LANES), acc) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(storage: Storage, ftz: bool) -> NumericModel {
        NumericModel {
            storage,
            flush_subnormals: ftz,
            ..NumericModel::default()
        }
    }

    fn lane(m: &NumericModel, x: f32) -> f32 {
        match (m.storage, m.flush_subnormals) {
            (Storage::F16, true) => round_lane::<F16, true>(x),
            (Storage::F16, false) => round_lane::<F16, false>(x),
            (Storage::Bf16, true) => round_lane::<BF16, true>(x),
            (Storage::Bf16, false) => round_lane::<BF16, false>(x),
            (Storage::F32, true) => round_lane::<F32, true>(x),
            (Storage::F32, false) => round_lane::<F32, false>(x),
        }
    }

    /// The branch-free rounding is the model's rounding on a stride through every f32 bit pattern (every sign,
    /// exponent and a spread of mantissas, ties and overflow included) and on the boundaries named.
    #[test]
    fn the_lane_rounding_is_the_models_rounding() {
        let named = [
            0.0f32,
            -0.0,
            65504.0,
            65519.99,
            65520.0,
            -65520.0,
            6.103_515_6e-5,
            6.1e-5,
            6.103_515e-5,
            2.980_232_2e-8,
            2.980_233e-8,
            5.960_464_5e-8,
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        for storage in [Storage::F16, Storage::Bf16, Storage::F32] {
            for ftz in [true, false] {
                let m = model(storage, ftz);
                let check = |x: f32| {
                    let (want, got) = (m.round(x), lane(&m, x));
                    assert!(
                        want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()),
                        "{storage:?} ftz={ftz}: {x:e} ({:#010x}) rounds to {want:e}, the lane gives {got:e}",
                        x.to_bits()
                    );
                };
                named.iter().for_each(|&x| check(x));
                (0..=u32::MAX)
                    .step_by(997)
                    .for_each(|b| check(f32::from_bits(b)));
                // Every tie and neighbour of f16's and bf16's rounding in [1, 2) and in the subnormal range.
                for base in [
                    0x3f80_0000u32,
                    0x3300_0000,
                    0x3400_1000,
                    0x0000_1000,
                    0x387f_8000,
                ] {
                    (0..1 << 16).for_each(|d| check(f32::from_bits(base + d)));
                }
            }
        }
    }

    /// The tiled product is the term-by-term sum in order, for every accumulation, at sizes that leave partial
    /// lane groups and tiles.
    #[test]
    fn the_tiled_product_sums_every_term_in_order() {
        let (m, k, n) = (3, 37, 21);
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.021)
            .collect();
        for acc in [Accumulation::F32, Accumulation::Storage] {
            for storage in [Storage::F16, Storage::Bf16, Storage::F32] {
                let m_ = NumericModel {
                    accumulation: acc,
                    flush_subnormals: storage != Storage::F32,
                    ..model(storage, true)
                };
                let got = products(&m_, &a, m, k, n, &Dense(&w, k)).unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let mut s = 0f32;
                        for t in 0..k {
                            let p = a[i * k + t] * w[j * k + t];
                            if m_.is_exact_f32() {
                                s += p;
                            } else {
                                s += m_.round(p);
                                if acc == Accumulation::Storage {
                                    s = m_.round(s);
                                }
                            }
                        }
                        assert_eq!(s.to_bits(), got[i * n + j].to_bits(), "{m_} [{i}, {j}]");
                    }
                }
            }
        }
    }

    /// The AVX2 rounding and product (where the CPU has AVX2) are the scalar ones, lane for lane.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_kernel_is_the_scalar_kernel() {
        use std::arch::x86_64::*;
        if !std::is_x86_feature_detected!("avx2") {
            return;
        }
        fn both<const S: u8, const FTZ: bool>() {
            let mut x = [0f32; LANES];
            // A stride through every bit pattern, then every pattern around f16's smallest normal and its ties.
            let around = (0x387f_0000u32..0x3881_0000).chain(0xb87f_0000..0xb881_0000);
            for (n, b) in (0..=u32::MAX).step_by(1009).chain(around).enumerate() {
                x[n % LANES] = f32::from_bits(b);
                if n % LANES != LANES - 1 {
                    continue;
                }
                let mut got = [0f32; LANES];
                // SAFETY: the CPU has AVX2 (checked above); both arrays hold eight values.
                unsafe {
                    let v = _mm256_loadu_ps(x.as_ptr());
                    _mm256_storeu_ps(got.as_mut_ptr(), avx2::round::<S, FTZ>(v));
                }
                for l in 0..LANES {
                    let want = round_lane::<S, FTZ>(x[l]);
                    assert!(
                        want.to_bits() == got[l].to_bits() || (want.is_nan() && got[l].is_nan()),
                        "S={S} FTZ={FTZ}: {:e}: {want:e} against {:e}",
                        x[l],
                        got[l]
                    );
                }
            }
        }
        both::<F16, true>();
        both::<F16, false>();
        both::<BF16, true>();
        both::<BF16, false>();
        both::<F32, true>();
        both::<F32, false>();
        let (m, k, count) = (5, 29, 13);
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 31 % 89) as f32 - 44.0) * 0.017)
            .collect();
        let rows: Vec<f32> = (0..count * k)
            .map(|i| ((i * 47 % 83) as f32 - 41.0) * 0.029)
            .collect();
        fn pair<const S: u8, const FTZ: bool, const ACC: u8>(
            a: &[f32],
            rows: &[f32],
            m: usize,
            k: usize,
            c: usize,
        ) {
            let wide = tile_products::<S, FTZ, ACC>(a, m, k, rows, c, true);
            let narrow = tile_products::<S, FTZ, ACC>(a, m, k, rows, c, false);
            let wb: Vec<u32> = wide.iter().map(|x| x.to_bits()).collect();
            let nb: Vec<u32> = narrow.iter().map(|x| x.to_bits()).collect();
            assert_eq!(wb, nb, "S={S} FTZ={FTZ} ACC={ACC}");
        }
        pair::<F16, true, ACC_F32>(&a, &rows, m, k, count);
        pair::<F16, false, ACC_STORAGE>(&a, &rows, m, k, count);
        pair::<BF16, true, ACC_F32>(&a, &rows, m, k, count);
        pair::<BF16, true, ACC_STORAGE>(&a, &rows, m, k, count);
        pair::<F32, true, ACC_F32>(&a, &rows, m, k, count);
        pair::<F32, false, EXACT>(&a, &rows, m, k, count);
    }
}
