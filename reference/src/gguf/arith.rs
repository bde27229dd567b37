//! llama.cpp's CPU arithmetic, modelled as an option of the reference ([`Arithmetic::LlamaCpp`]), as FP16SIM models
//! an fp16 NPU: like for like, the reference's layers then agree with llama.cpp's own to f32 rounding, so a real bug
//! stands out by orders of magnitude instead of hiding under the quantization noise of the activations.
//!
//! # What ggml's CPU back end does (llama.cpp 0c1e570, x86 with AVX2/AVX-512; read in `ggml/src/ggml-cpu/`)
//!
//! - **Matrix products** (`ggml_compute_forward_mul_mat`): for a weight of type `T` the f32 activations are first
//!   converted to `T`'s `vec_dot_type` (the CPU type traits' table in `ggml-cpu.c`, [`VecDotType::of`]): F32 for F32
//!   weights (no conversion), F16 for F16, BF16 for BF16, Q8_0 for Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4, NVFP4, Q1_0, Q2_0,
//!   Q8_1 for Q4_1 and Q5_1, Q8_K for the K-quants, the other IQ types and TQ1_0/TQ2_0. The dot is then integer per
//!   block times the scales. The model here rounds the activation through that type's quantization, bit for bit as
//!   ggml's x86 `quantize_row_*` (the `from_float` the CPU calls, [`VecDotType::round_trip`]), and multiplies the
//!   dequantized value with the exactly decoded weight in f32: ggml's product of the two quantized vectors then
//!   differs from the reference's only by the order of the f32 sums (and, for Q8_1, by the block sum `s` it stores
//!   in f16: see [`VecDotType::Q8_1`]). The blocks are those of the file's column order, which for `out_proj`
//!   (`ssm_out`, its columns reordered by value head) is not the checkpoint's ([`InputRounding::col_order`]). An MoE
//!   layer's expert products (`mul_mat_id`) convert their inputs the same way, per expert.
//! - **Attention** (flash attention, which llama.cpp's default `flash_attn_type = auto` enables on the CPU): K and V
//!   are stored in the KV cache as f16, the query is converted to f16 before its dot with each key, and the
//!   softmax-weighted sum of the values is accumulated in f16 (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`,
//!   the path of prompts shorter than 64 tokens and of decode): [`attention::flash_attention_f16`].
//! - Everything else (norms, RoPE, the convolution, the gated delta rule, SiLU, the gates) is f32 on the CPU, as in
//!   the reference (the f32 GGUF's linear-attention layer 0 agrees with the reference to 6.3e-8).
//!
//! The quantizers are ggml's x86 ones (the fixtures were made on an AVX-512 CPU): `quantize_row_q8_0` there computes
//! the inverse scale as `127 / amax` and rounds half to even (`_mm256_round_ps`), where the portable reference code
//! (ARM, ...) uses `1 / d` and `roundf` (half away from zero): the codes can differ on other CPUs.

use super::GgmlType;
use crate::error::{Error, Result};
use half::{bf16, f16};

pub mod attention;
pub use weights::InputRounding;

/// How the reference computes on a GGUF model's weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Arithmetic {
    /// The reference's own: f32 products of the f32 activations with the exactly decoded weights, an f32 KV cache.
    #[default]
    Reference,
    /// llama.cpp's CPU back end: the activations of each matrix product rounded through the weight's
    /// `vec_dot_type`, K and V cached in f16, flash attention with an f16 accumulator (see the module's doc).
    LlamaCpp,
}

impl Arithmetic {
    /// The name on the command line (`reference`, `llama-cpp`).
    pub fn name(self) -> &'static str {
        match self {
            Arithmetic::Reference => "reference",
            Arithmetic::LlamaCpp => "llama-cpp",
        }
    }
}

/// The type ggml's CPU converts a matrix product's f32 activations to before the dot with a weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VecDotType {
    /// No conversion (F32 weights).
    F32,
    /// Rounded to f16, to nearest even (F16 weights; F16C's `vcvtps2ph`).
    F16,
    /// Rounded to bf16, to nearest even (BF16 weights).
    Bf16,
    /// Blocks of 32: `d = amax / 127` stored as f16, codes `round_half_even(x · (127 / amax))`.
    Q8_0,
    /// Q8_0's codes and scale, plus the block sum `s = f16(d · Σq)` with the unrounded `d`, which the Q4_1/Q5_1 dot
    /// multiplies by the weight block's minimum: the round trip models the codes, [`q8_1_residuals`] what `s` adds.
    Q8_1,
    /// Blocks of 256: `d = 1 / (127 / amax)` kept in f32, codes `round_half_even(x · 127 / amax)`.
    Q8K,
}

impl VecDotType {
    /// The `vec_dot_type` of a weight of type `ty` in ggml's CPU type traits; an error for a type with no CPU dot
    /// product (Q8_1, Q8_K, the integer types, F64).
    pub fn of(ty: GgmlType) -> std::result::Result<Self, String> {
        use GgmlType as T;
        Ok(match ty {
            T::F32 => VecDotType::F32,
            T::F16 => VecDotType::F16,
            T::BF16 => VecDotType::Bf16,
            T::Q4_0 | T::Q5_0 | T::Q8_0 | T::IQ4_NL | T::MXFP4 | T::NVFP4 | T::Q1_0 | T::Q2_0 => {
                VecDotType::Q8_0
            }
            T::Q4_1 | T::Q5_1 => VecDotType::Q8_1,
            T::Q2_K
            | T::Q3_K
            | T::Q4_K
            | T::Q5_K
            | T::Q6_K
            | T::IQ2_XXS
            | T::IQ2_XS
            | T::IQ2_S
            | T::IQ3_XXS
            | T::IQ3_S
            | T::IQ1_S
            | T::IQ1_M
            | T::IQ4_XS
            | T::TQ1_0
            | T::TQ2_0 => VecDotType::Q8K,
            T::Q8_1 | T::Q8_K | T::I8 | T::I16 | T::I32 | T::I64 | T::F64 => {
                return Err(format!(
                    "a {ty:?} weight has no matrix product on ggml's CPU (no vec_dot), so there is no llama.cpp \
                     arithmetic to model"
                ));
            }
        })
    }

    /// The values per block the conversion works on (1 for the float types).
    pub fn block(self) -> usize {
        match self {
            VecDotType::F32 | VecDotType::F16 | VecDotType::Bf16 => 1,
            VecDotType::Q8_0 | VecDotType::Q8_1 => 32,
            VecDotType::Q8K => 256,
        }
    }

    /// Rounds one row of activations in place through the conversion: each value becomes what ggml's dot product
    /// multiplies the weight by (`f16(d) · q` for Q8_0/Q8_1, `d · q` in f32 for Q8_K, the rounded value for
    /// F16/BF16). An error when the row is not a whole number of blocks (ggml asserts it).
    pub fn round_trip(self, row: &mut [f32]) -> Result<()> {
        let block = self.block();
        if !row.len().is_multiple_of(block) {
            return Err(Error::Input(format!(
                "a row of {} activations is not a whole number of {block}-value {self:?} blocks",
                row.len()
            )));
        }
        match self {
            VecDotType::F32 => {}
            VecDotType::F16 => row.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32()),
            VecDotType::Bf16 => row.iter_mut().for_each(|x| *x = round_bf16(*x)),
            VecDotType::Q8_0 | VecDotType::Q8_1 => row.chunks_exact_mut(32).for_each(q8_0_block),
            VecDotType::Q8K => row.chunks_exact_mut(256).for_each(q8_k_block),
        }
        Ok(())
    }
}

/// `x` rounded to bf16 and widened back: round to nearest even on the upper 16 bits, a NaN kept a (quiet) NaN.
pub fn round_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return bf16::from_bits(((x.to_bits() >> 16) | 0x40) as u16).to_f32();
    }
    let u = x.to_bits();
    let rounded = u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16;
    bf16::from_bits(rounded as u16).to_f32()
}

/// The largest magnitude of a block (0 for an all-zero block).
fn amax(block: &[f32]) -> f32 {
    block.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// `round(v)` to the nearest integer, ties to even, saturated to i8 (SSE's round-to-nearest then `packs`); an
/// integer code, so never -0 (`+ 0.0` turns -0 into +0 and leaves every other value).
fn code(v: f32) -> f32 {
    v.round_ties_even().clamp(-128.0, 127.0) + 0.0
}

/// One Q8_0 (or Q8_1) block as ggml's x86 `quantize_row_q8_0` quantizes it, dequantized: `f16(amax / 127) · q` with
/// `q = round_half_even(x · (127 / amax))`.
fn q8_0_block(block: &mut [f32]) {
    let m = amax(block);
    let d = f16::from_f32(m / 127.0).to_f32();
    let id = if m != 0.0 { 127.0 / m } else { 0.0 };
    for x in block.iter_mut() {
        *x = d * code(*x * id);
    }
}

/// One Q8_K block as ggml's `quantize_row_q8_K_ref` (the x86 `quantize_row_q8_K`) quantizes it, dequantized:
/// `d · q` in f32 with `iscale = −127 / max` (`max` the first element of the largest magnitude, with its sign),
/// `q = round_half_even(iscale · x)` at most 127, `d = 1 / iscale` (a zero code takes the sign of `d`).
fn q8_k_block(block: &mut [f32]) {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &x in block.iter() {
        if x.abs() > amax {
            amax = x.abs();
            max = x;
        }
    }
    if amax == 0.0 {
        block.iter_mut().for_each(|x| *x = 0.0);
        return;
    }
    let iscale = -127.0 / max;
    let d = 1.0 / iscale;
    for x in block.iter_mut() {
        *x = d * code(iscale * *x).min(127.0);
    }
}

/// The `s − f16(d)·Σq` of each 32-value block of a row as ggml's x86 `quantize_row_q8_1` quantizes it: the Q8_1
/// block sum `s = f16(d · Σq)` (with the unrounded `d = amax / 127`) minus the sum of the block's round-tripped
/// values. A Q4_1/Q5_1 dot multiplies `s` by the weight block's minimum `m` where the round trip's product has
/// `m · f16(d)·Σq`: adding `m` times this residual makes the two equal. An error for a partial block.
pub fn q8_1_residuals(row: &[f32]) -> Result<Vec<f32>> {
    if !row.len().is_multiple_of(32) {
        return Err(Error::Input(format!(
            "a row of {} activations is not a whole number of 32-value Q8_1 blocks",
            row.len()
        )));
    }
    Ok(row
        .chunks_exact(32)
        .map(|block| {
            let m = amax(block);
            let d = m / 127.0;
            let id = if m != 0.0 { 127.0 / m } else { 0.0 };
            let sum: f32 = block.iter().map(|&x| code(x * id)).sum();
            f16::from_f32(d * sum).to_f32() - f16::from_f32(d).to_f32() * sum
        })
        .collect())
}

pub mod weights;

#[cfg(test)]
mod tests {
    use super::*;

    fn q8_0(x: &[f32]) -> Vec<f32> {
        let mut v = x.to_vec();
        VecDotType::Q8_0.round_trip(&mut v).unwrap();
        v
    }

    #[test]
    fn q8_0_scale_is_amax_over_127_in_f16_and_codes_round_half_to_even() {
        // amax 127: d = 1 exactly, id = 1, so the codes are x rounded half to even (2.5 → 2, 3.5 → 4, -2.5 → -2).
        let mut x = vec![0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = 3.5;
        x[3] = -2.5;
        x[4] = -0.5;
        x[5] = 0.49;
        let y = q8_0(&x);
        assert_eq!(&y[..6], &[127.0, 2.0, 4.0, -2.0, -0.0, 0.0]);
        // amax 1: d = f16(1/127) = 0.007873535 (f16 bits 0x2008), codes round(x · 127).
        let mut x = vec![0f32; 32];
        x[0] = -1.0;
        x[1] = 0.5;
        let y = q8_0(&x);
        let d = f16::from_bits(0x2008).to_f32();
        assert_eq!(f16::from_f32(1.0 / 127.0).to_bits(), 0x2008);
        assert_eq!(y[0], -127.0 * d);
        assert_eq!(y[1], 64.0 * d); // 63.5 → 64 (even)
        assert_eq!(y[2], 0.0);
    }

    /// The rows `scripts/ggml_quant_oracle.c` feeds ggml's own quantizers: 16 rows of 4096 xorshift values in
    /// [-1, 1) times a scale per row (1e-6, where f16(d) is subnormal; 3e-3; 1e4; 0.37·r), row 3 with a zero
    /// first Q8_K block, row 4 of half-integer codes (exact ties).
    fn oracle_rows() -> Vec<Vec<f32>> {
        (0..16u64)
            .map(|rep| {
                let mut st = 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(rep + 1) | 1;
                let scale = match rep {
                    0 => 1e-6f32,
                    1 => 3e-3,
                    2 => 1e4,
                    r => r as f32 * 0.37,
                };
                let mut x: Vec<f32> = (0..4096)
                    .map(|_| {
                        st ^= st << 13;
                        st ^= st >> 7;
                        st ^= st << 17;
                        (((st >> 40) as f64 / (1u64 << 24) as f64) as f32 * 2.0 - 1.0) * scale
                    })
                    .collect();
                if rep == 3 {
                    x[..256].iter_mut().for_each(|v| *v = 0.0);
                }
                if rep == 4 {
                    for (i, v) in x.iter_mut().enumerate() {
                        *v = ((i % 255) as f32 - 127.0) * 0.5;
                    }
                }
                x
            })
            .collect()
    }

    /// FNV-1a over the little-endian bits of every value.
    fn fnv(values: impl Iterator<Item = f32>) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for v in values {
            for b in v.to_bits().to_le_bytes() {
                h ^= b as u64;
                h = h.wrapping_mul(0x100_0000_01b3);
            }
        }
        h
    }

    #[test]
    fn the_round_trips_equal_ggmls_own_x86_quantizers_bit_for_bit() {
        // Hashes printed by scripts/ggml_quant_oracle.c, which calls llama.cpp 0c1e570's `quantize_row_q8_0` and
        // `quantize_row_q8_1` (ggml-cpu/arch/x86/quants.c, AVX2) and `quantize_row_q8_K_ref` on the same rows and
        // hashes `f16(d) · q` (Q8_0, Q8_1) and `d · q` (Q8_K).
        for (ty, want) in [
            (VecDotType::Q8_0, 0xf0fe_03c0_5693_2651u64),
            (VecDotType::Q8_1, 0xf0fe_03c0_5693_2651),
            (VecDotType::Q8K, 0x19df_0237_96f0_7363),
        ] {
            let rows: Vec<f32> = oracle_rows()
                .into_iter()
                .flat_map(|mut r| {
                    ty.round_trip(&mut r).unwrap();
                    r
                })
                .collect();
            assert_eq!(fnv(rows.into_iter()), want, "{ty:?}");
        }
        // Row 5's first values, printed by the oracle: Q8_0 d = f16 0x22f7, codes 63 -23 -44 -106; Q8_K d =
        // 0x1.d1c174p-7, codes 60 -22 -42 -101.
        let row = &oracle_rows()[5];
        let mut q0 = row.clone();
        VecDotType::Q8_0.round_trip(&mut q0).unwrap();
        let d0 = f16::from_bits(0x22f7).to_f32();
        assert_eq!(&q0[..4], &[63.0 * d0, -23.0 * d0, -44.0 * d0, -106.0 * d0]);
        let mut qk = row.clone();
        VecDotType::Q8K.round_trip(&mut qk).unwrap();
        let dk = f32::from_bits(0x3c68_e0ba);
        assert_eq!(&qk[..4], &[60.0 * dk, -22.0 * dk, -42.0 * dk, -101.0 * dk]);
    }

    #[test]
    fn q8_k_scale_is_kept_in_f32_and_negating_a_row_negates_its_values() {
        let mut row: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut neg: Vec<f32> = row.iter().map(|x| -x).collect();
        let x = row.clone();
        VecDotType::Q8K.round_trip(&mut row).unwrap();
        VecDotType::Q8K.round_trip(&mut neg).unwrap();
        let m = 50.0f32 / 7.0;
        let iscale = 127.0 / m;
        for (i, (&y, &n)) in row.iter().zip(&neg).enumerate() {
            assert_eq!(y.to_bits(), (-n).to_bits(), "{i}");
            assert_eq!(y, (1.0 / iscale) * (iscale * x[i]).round_ties_even(), "{i}");
        }
        // The largest element maps to exactly ±127 codes.
        assert_eq!(
            row.iter().fold(0f32, |a, b| a.max(b.abs())),
            127.0 * (1.0 / iscale)
        );
    }

    #[test]
    fn zero_blocks_stay_zero_and_partial_blocks_are_refused() {
        let mut z = vec![0f32; 256];
        VecDotType::Q8K.round_trip(&mut z).unwrap();
        VecDotType::Q8_0.round_trip(&mut z).unwrap();
        assert!(z.iter().all(|&v| v == 0.0));
        let e = VecDotType::Q8_0.round_trip(&mut [1.0; 48]).unwrap_err();
        assert!(e.to_string().contains("48"), "{e}");
        assert!(VecDotType::Q8K.round_trip(&mut [1.0; 32]).is_err());
        VecDotType::F16.round_trip(&mut [1.0; 3]).unwrap();
    }

    #[test]
    fn half_precision_conversions_round_to_nearest_even() {
        // f16: 1 + 2^-11 is halfway between 1 and 1 + 2^-10 → 1 (even); 1 + 3·2^-11 → 1 + 2^-9.
        let mut v = [1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11), 65520.0];
        VecDotType::F16.round_trip(&mut v).unwrap();
        assert_eq!(v, [1.0, 1.0 + 2f32.powi(-9), f32::INFINITY]);
        // bf16: 1 + 2^-8 halfway → 1; 1 + 3·2^-8 → 1 + 2^-6; NaN stays NaN.
        assert_eq!(round_bf16(1.0 + 2f32.powi(-8)), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        assert!(round_bf16(f32::NAN).is_nan());
    }

    #[test]
    fn every_weight_type_has_its_ggml_vec_dot_type() {
        use GgmlType as T;
        for (ty, want) in [
            (T::F32, VecDotType::F32),
            (T::F16, VecDotType::F16),
            (T::BF16, VecDotType::Bf16),
            (T::Q4_0, VecDotType::Q8_0),
            (T::Q5_0, VecDotType::Q8_0),
            (T::Q8_0, VecDotType::Q8_0),
            (T::IQ4_NL, VecDotType::Q8_0),
            (T::Q4_1, VecDotType::Q8_1),
            (T::Q5_1, VecDotType::Q8_1),
            (T::Q4_K, VecDotType::Q8K),
            (T::Q6_K, VecDotType::Q8K),
            (T::IQ4_XS, VecDotType::Q8K),
            (T::IQ2_XXS, VecDotType::Q8K),
        ] {
            assert_eq!(VecDotType::of(ty), Ok(want), "{ty:?}");
        }
        assert!(VecDotType::of(T::Q8_K).unwrap_err().contains("Q8_K"));
    }
}
