//! The ternary, 1- and 2-bit and FP4 block decoders, from ggml's formulas (`dequantize_row_tq1_0`, `_tq2_0`,
//! `_q1_0`, `_q2_0`, `_mxfp4`, `_nvfp4` in `ggml-quants.c`, the scale conversions of `ggml-impl.h`). Each takes one
//! block's bytes and writes its values.
//!
//! Layouts (bytes): TQ1_0 `qs[48] | qh[4] | d` (five base-3 digits per byte, scaled by 256/243); TQ2_0 `qs[64] | d`;
//! Q1_0 `d | qs[16]` (one sign bit per value); Q2_0 `d | qs[16]` (2 bits: -1, 0, 1, 2); MXFP4 `e | qs[16]` (an E8M0
//! exponent, E2M1 nibbles); NVFP4 `d[4] | qs[32]` (four UE4M3 scales, one per 16 values).

use super::f16_at;

/// E2M1 values doubled (`kvalues_mxfp4`): the scales below are halved to match.
const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// One base-3 digit of a TQ1_0 byte: ggml multiplies the byte by 3^n (wrapping in a byte) and takes the top of 3x.
fn trit(byte: u8, n: u32) -> f32 {
    let q = byte.wrapping_mul(3u8.pow(n));
    let xi = ((u16::from(q) * 3) >> 8) as i16;
    f32::from(xi - 1)
}

/// TQ1_0: ternary, 1.69 bits per weight.
pub(crate) fn tq1_0(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 52);
    let (qs, qh) = (&block[0..48], &block[48..52]);
    let mut out = y.iter_mut();
    let mut put = |value: f32| *out.next().expect("256 values") = value;
    for n in 0..5 {
        for &q in &qs[0..32] {
            put(trit(q, n) * d);
        }
    }
    for n in 0..5 {
        for &q in &qs[32..48] {
            put(trit(q, n) * d);
        }
    }
    for n in 0..4 {
        for &q in qh {
            put(trit(q, n) * d);
        }
    }
}

/// TQ2_0: ternary, 2.06 bits per weight.
pub(crate) fn tq2_0(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 64);
    for half in 0..2 {
        for l in 0..4 {
            for m in 0..32 {
                let q = (block[32 * half + m] >> (2 * l)) & 3;
                y[128 * half + 32 * l + m] = f32::from(i16::from(q) - 1) * d;
            }
        }
    }
}

/// Q1_0: one bit per value, `+d` or `-d`.
pub(crate) fn q1_0(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 0);
    for (j, value) in y.iter_mut().enumerate() {
        let bit = (block[2 + j / 8] >> (j % 8)) & 1;
        *value = if bit != 0 { d } else { -d };
    }
}

/// Q2_0: two bits per value, `(q - 1) * d`.
pub(crate) fn q2_0(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 0);
    for (j, value) in y.iter_mut().enumerate() {
        let q = (block[2 + j / 4] >> (2 * (j % 4))) & 3;
        *value = f32::from(i16::from(q) - 1) * d;
    }
}

/// Half of an E8M0 scale (`ggml_e8m0_to_fp32_half`): `2^(e - 128)`, the two smallest as subnormals.
fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// MXFP4: E2M1 values, one E8M0 scale per 32.
pub(crate) fn mxfp4(block: &[u8], y: &mut [f32]) {
    let d = e8m0_half(block[0]);
    for (j, &q) in block[1..17].iter().enumerate() {
        y[j] = f32::from(KVALUES_MXFP4[usize::from(q & 0xf)]) * d;
        y[j + 16] = f32::from(KVALUES_MXFP4[usize::from(q >> 4)]) * d;
    }
}

/// `2^k` for the small exponents of UE4M3 (exact).
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// Half of a UE4M3 scale (`ggml_ue4m3_to_fp32`): 4 exponent bits (bias 7), 3 mantissa bits; 0 and 0x7F are zero,
/// the top bit is ignored.
fn ue4m3_half(x: u8) -> f32 {
    if x == 0 || x == 0x7f {
        return 0.0;
    }
    let exp = i32::from((x >> 3) & 0xf);
    let man = f32::from(x & 0x7);
    let raw = if exp == 0 {
        man * pow2(-9)
    } else {
        (1.0 + man / 8.0) * pow2(exp - 7)
    };
    raw * 0.5
}

/// NVFP4: E2M1 values, one UE4M3 scale per 16, blocks of 64.
pub(crate) fn nvfp4(block: &[u8], y: &mut [f32]) {
    for s in 0..4 {
        let d = ue4m3_half(block[s]);
        let qs = &block[4 + 8 * s..4 + 8 * s + 8];
        let out = &mut y[16 * s..16 * s + 16];
        for (j, &q) in qs.iter().enumerate() {
            out[j] = f32::from(KVALUES_MXFP4[usize::from(q & 0xf)]) * d;
            out[j + 8] = f32::from(KVALUES_MXFP4[usize::from(q >> 4)]) * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scales_decode_as_ggml_documents_them() {
        assert_eq!(e8m0_half(127), 0.5);
        assert_eq!(e8m0_half(128), 1.0);
        assert_eq!(e8m0_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_half(1), 2f32.powi(-127));
        assert_eq!(ue4m3_half(0x38), 0.5); // 1.0 * 2^0, halved
        assert_eq!(ue4m3_half(0x7e), 224.0); // 1.75 * 2^8, halved
        assert_eq!(ue4m3_half(0x01), 2f32.powi(-10));
        assert_eq!(ue4m3_half(0x7f), 0.0);
    }

    #[test]
    fn every_ternary_byte_decodes_to_its_digits() {
        // A TQ1_0 byte stores five base-3 digits d0..d4 as ceil(256 * value / 243); trit(byte, n) returns d_n - 1.
        for value in 0..243u16 {
            let byte = ((value * 256).div_ceil(243)) as u8;
            let mut rest = value;
            let mut digits = [0u16; 5];
            for k in (0..5).rev() {
                digits[k] = rest % 3;
                rest /= 3;
            }
            for (n, digit) in digits.iter().enumerate() {
                assert_eq!(
                    trit(byte, n as u32),
                    f32::from(*digit as i16 - 1),
                    "{value} {n}"
                );
            }
        }
    }
}
