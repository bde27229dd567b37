//! The decoders of every ggml tensor type: packed blocks to f32, bit for bit as ggml's own `to_float` decoders
//! (`dequantize_row_*` in `ggml-quants.c`, `ggml_fp16_to_fp32_row`, `ggml_bf16_to_fp32_row`).
//!
//! [`dequantize`] takes any whole number of blocks (a row of a tensor is one: its `ne[0]` is a multiple of the
//! block), so a store that keeps the packed bytes decodes one row, or one run of a row's blocks, at a time. The
//! legacy types (Q4_0 to Q8_1) and the K-quants (Q2_K to Q8_K) go through candle's decoders
//! (`candle_core::quantized::k_quants`), which compute the same products in the same order as ggml's; the IQ types,
//! the ternary and 1/2-bit types, MXFP4 and NVFP4 are decoded here from ggml's formulas ([`iq`], [`low_bit`]), their
//! codebooks in [`grids`].
//!
//! Two [`Decoder`]s: the scalar one above for every type, and on x86-64 with AVX2 and F16C vectorised decoders of
//! the common weight types (F16, BF16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K: [`x86`]), which compute the same f32 operations
//! on the same operands eight values at a time, so they give the same bits; [`dequantize`] runs the fastest the CPU
//! has, [`dequantize_on`] a chosen one. Neither allocates: candle's decoders read the blocks in place (or from a
//! stack copy when the bytes are not aligned for them), so a store decoding a row at a time pays only the decoding.
//! [`random_blocks`] draws blocks of any type with finite values, for tests and synthetic benchmark files.
//!
//! Held to two references by `reference/tests/all/gguf_decode.rs` (every decoder the CPU runs): the vectors of
//! `testdata/gguf/decode/` (made by `scripts/make_gguf_decode_vectors.py`) are ggml's own C decoders' output, and the `gguf` Python package's numpy
//! decoders agree with them bit for bit wherever they exist (F16 NaNs aside: ggml returns them quiet, numpy keeps a
//! signalling NaN signalling; ggml's behaviour is the one followed here).
//!
//! Q8_1 has no decoder in ggml (an activation type, never in a file): it decodes as `d * q`, the inverse of ggml's
//! quantizer. The integer types (I8 to I64) are not weights' types and are refused; F64 rounds to nearest f32.

mod grids;
pub(crate) mod iq;
pub(crate) mod low_bit;
mod random;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use random::random_blocks;

use super::types::GgmlType;
use crate::error::{Error, Result};
use candle_core::quantized::k_quants::{self, GgmlType as CandleBlock};

/// Decodes `bytes`, a whole number of blocks of `ty`, into `out`, which must hold exactly their elements, with the
/// fastest [`Decoder`] this CPU runs (every decoder gives the same bits).
///
/// Errors (never panics) when `bytes` is not a whole number of blocks, when `out` does not hold exactly as many
/// values as the blocks do, or when `ty` is an integer type (no weights' type). The types ggml removed (ids 4, 5,
/// 31-33, 36-38) are not [`GgmlType`]s at all: [`GgmlType::from_id`] refuses them.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    dequantize_on(ty, bytes, out, Decoder::detect())
}

/// Which decoders [`dequantize_on`] runs. Each gives the bits of ggml's own decoder for every block (the SIMD ones
/// compute the same f32 products and differences, each rounded once, in registers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoder {
    /// Portable code for every type: [`iq`], [`low_bit`] and candle's decoders, read in place.
    Scalar,
    /// AVX2 and F16C: [`x86`]'s decoders for F16, BF16, Q4_0, Q8_0, Q4_K, Q5_K and Q6_K ([`Decoder::vectorises`]),
    /// the scalar ones for the other types.
    Avx2,
}

impl Decoder {
    /// The fastest decoder this CPU runs (checked at run time).
    pub fn detect() -> Self {
        if Decoder::Avx2.available() {
            Decoder::Avx2
        } else {
            Decoder::Scalar
        }
    }

    /// Whether this CPU can run the decoder.
    pub fn available(self) -> bool {
        match self {
            Decoder::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Decoder::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Decoder::Avx2 => false,
        }
    }

    /// Whether the decoder has a code of its own for `ty` (else it runs the scalar one).
    pub fn vectorises(self, ty: GgmlType) -> bool {
        use GgmlType::*;
        self == Decoder::Avx2 && matches!(ty, F16 | BF16 | Q4_0 | Q8_0 | Q4_K | Q5_K | Q6_K)
    }
}

/// [`dequantize`] on a chosen decoder (tests and benches compare them); an error when the CPU cannot run it.
pub fn dequantize_on(ty: GgmlType, bytes: &[u8], out: &mut [f32], decoder: Decoder) -> Result<()> {
    let (block_elems, block_bytes) = (ty.block_elems(), ty.block_bytes());
    if !bytes.len().is_multiple_of(block_bytes) {
        return Err(Error::Input(format!(
            "{ty}: {} bytes are not a whole number of {block_bytes}-byte blocks",
            bytes.len()
        )));
    }
    let blocks = bytes.len() / block_bytes;
    if blocks.checked_mul(block_elems) != Some(out.len()) {
        return Err(Error::Input(format!(
            "{ty}: {blocks} blocks of {block_elems} elements ({} bytes) decode to {} values, not the {} asked for",
            bytes.len(),
            blocks.saturating_mul(block_elems),
            out.len()
        )));
    }
    if !decoder.available() {
        return Err(Error::Input(format!(
            "{ty}: this CPU cannot run the {decoder:?} decoder"
        )));
    }
    #[cfg(target_arch = "x86_64")]
    if decoder.vectorises(ty) {
        // SAFETY: `available` found AVX2 and F16C; `bytes` holds whole blocks of `ty` and `out` their values
        // (both checked above).
        unsafe { x86::decode(ty, bytes, out) };
        return Ok(());
    }
    use GgmlType::*;
    match ty {
        F32 => each_element(bytes, out, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        // half's conversion uses the CPU's F16C instructions where it has them (as ggml does): NaNs come out quiet
        // either way.
        F16 => each_element(bytes, out, |b| f16_bits(u16::from_le_bytes([b[0], b[1]]))),
        BF16 => each_element(bytes, out, |b| {
            f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
        }),
        F64 => each_element(bytes, out, |b| {
            f64::from_le_bytes(b.try_into().expect("8-byte element")) as f32
        }),
        I8 | I16 | I32 | I64 => {
            return Err(Error::Input(format!(
                "{ty}: an integer tensor type, not a weight's: it has no f32 decoding"
            )));
        }
        Q4_0 => with_candle::<k_quants::BlockQ4_0>(bytes, out),
        Q4_1 => with_candle::<k_quants::BlockQ4_1>(bytes, out),
        Q5_0 => with_candle::<k_quants::BlockQ5_0>(bytes, out),
        Q5_1 => with_candle::<k_quants::BlockQ5_1>(bytes, out),
        Q8_0 => with_candle::<k_quants::BlockQ8_0>(bytes, out),
        Q8_1 => with_candle::<k_quants::BlockQ8_1>(bytes, out),
        Q2_K => with_candle::<k_quants::BlockQ2K>(bytes, out),
        Q3_K => with_candle::<k_quants::BlockQ3K>(bytes, out),
        Q4_K => with_candle::<k_quants::BlockQ4K>(bytes, out),
        Q5_K => with_candle::<k_quants::BlockQ5K>(bytes, out),
        Q6_K => with_candle::<k_quants::BlockQ6K>(bytes, out),
        Q8_K => with_candle::<k_quants::BlockQ8K>(bytes, out),
        IQ2_XXS => blockwise(bytes, out, ty, iq::iq2_xxs),
        IQ2_XS => blockwise(bytes, out, ty, iq::iq2_xs),
        IQ2_S => blockwise(bytes, out, ty, iq::iq2_s),
        IQ3_XXS => blockwise(bytes, out, ty, iq::iq3_xxs),
        IQ3_S => blockwise(bytes, out, ty, iq::iq3_s),
        IQ1_S => blockwise(bytes, out, ty, iq::iq1_s),
        IQ1_M => blockwise(bytes, out, ty, iq::iq1_m),
        IQ4_NL => blockwise(bytes, out, ty, iq::iq4_nl),
        IQ4_XS => blockwise(bytes, out, ty, iq::iq4_xs),
        TQ1_0 => blockwise(bytes, out, ty, low_bit::tq1_0),
        TQ2_0 => blockwise(bytes, out, ty, low_bit::tq2_0),
        Q1_0 => blockwise(bytes, out, ty, low_bit::q1_0),
        Q2_0 => blockwise(bytes, out, ty, low_bit::q2_0),
        MXFP4 => blockwise(bytes, out, ty, low_bit::mxfp4),
        NVFP4 => blockwise(bytes, out, ty, low_bit::nvfp4),
    }
    Ok(())
}

/// An f16 (bits) as ggml widens it: exact for every finite value and infinity; a NaN keeps its sign and payload and
/// comes out quiet (as ggml's conversion, and x86's `vcvtph2ps`, return it).
pub(crate) fn f16_bits(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Reads the little-endian f16 at `at` of a block and widens it.
pub(crate) fn f16_at(block: &[u8], at: usize) -> f32 {
    f16_bits(u16::from_le_bytes([block[at], block[at + 1]]))
}

/// One value per element of a plain float type.
fn each_element(bytes: &[u8], out: &mut [f32], widen: impl Fn(&[u8]) -> f32) {
    let width = bytes.len() / out.len().max(1);
    for (value, element) in out.iter_mut().zip(bytes.chunks_exact(width.max(1))) {
        *value = widen(element);
    }
}

/// Decodes block by block with one of this module's block decoders (`decode(block, values)`).
fn blockwise(bytes: &[u8], out: &mut [f32], ty: GgmlType, decode: fn(&[u8], &mut [f32])) {
    let blocks = bytes.chunks_exact(ty.block_bytes());
    for (block, values) in blocks.zip(out.chunks_exact_mut(ty.block_elems())) {
        decode(block, values);
    }
}

/// The bytes of blocks copied at a time into an aligned buffer when a row's bytes are not aligned for candle's
/// block type (a stack buffer of whole blocks of every type).
const CANDLE_CHUNK_BYTES: usize = 16 * 292;

/// A buffer on a 16-byte boundary (at least every candle block type's alignment).
#[repr(C, align(16))]
struct Aligned([u8; CANDLE_CHUNK_BYTES]);

/// Decodes through candle's decoder of the block type `B`. Candle's blocks are `#[repr(C)]` structs of plain
/// integers and halves with ggml's layout, so the bytes are read as blocks in place where they are aligned for `B`
/// (a GGUF's tensor data is), else copied into an aligned stack buffer, a few blocks at a time: no allocation.
fn with_candle<B: CandleBlock>(bytes: &[u8], out: &mut [f32]) {
    let size = std::mem::size_of::<B>();
    const { assert!(std::mem::align_of::<B>() <= 16) };
    if bytes.as_ptr().cast::<B>().is_aligned() {
        // SAFETY: the pointer is aligned for `B` and the `bytes.len() / size` blocks lie inside `bytes`, borrowed
        // for the call; every bit pattern is a valid `B` (its fields are integers and halves only: candle's `zeros`
        // relies on the same), and the layout is ggml's (`size == block_bytes`, checked by
        // `candle_blocks_have_ggmls_layout`).
        let blocks =
            unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<B>(), bytes.len() / size) };
        B::to_float(blocks, out);
        return;
    }
    let mut buffer = Aligned([0; CANDLE_CHUNK_BYTES]);
    let per_chunk = CANDLE_CHUNK_BYTES / size;
    for (chunk, values) in bytes
        .chunks(per_chunk * size)
        .zip(out.chunks_mut(per_chunk * B::BLCK_SIZE))
    {
        let n = chunk.len() / size;
        buffer.0[..n * size].copy_from_slice(chunk);
        // SAFETY: as above, on the buffer's first `n` blocks (it is aligned to 16 bytes, at least `B`'s alignment).
        let blocks = unsafe { std::slice::from_raw_parts(buffer.0.as_ptr().cast::<B>(), n) };
        B::to_float(blocks, values);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candle_blocks_have_ggmls_layout() {
        use std::mem::size_of;
        let sizes = [
            (
                GgmlType::Q4_0,
                size_of::<k_quants::BlockQ4_0>(),
                k_quants::BlockQ4_0::BLCK_SIZE,
            ),
            (
                GgmlType::Q4_1,
                size_of::<k_quants::BlockQ4_1>(),
                k_quants::BlockQ4_1::BLCK_SIZE,
            ),
            (
                GgmlType::Q5_0,
                size_of::<k_quants::BlockQ5_0>(),
                k_quants::BlockQ5_0::BLCK_SIZE,
            ),
            (
                GgmlType::Q5_1,
                size_of::<k_quants::BlockQ5_1>(),
                k_quants::BlockQ5_1::BLCK_SIZE,
            ),
            (
                GgmlType::Q8_0,
                size_of::<k_quants::BlockQ8_0>(),
                k_quants::BlockQ8_0::BLCK_SIZE,
            ),
            (
                GgmlType::Q8_1,
                size_of::<k_quants::BlockQ8_1>(),
                k_quants::BlockQ8_1::BLCK_SIZE,
            ),
            (
                GgmlType::Q2_K,
                size_of::<k_quants::BlockQ2K>(),
                k_quants::BlockQ2K::BLCK_SIZE,
            ),
            (
                GgmlType::Q3_K,
                size_of::<k_quants::BlockQ3K>(),
                k_quants::BlockQ3K::BLCK_SIZE,
            ),
            (
                GgmlType::Q4_K,
                size_of::<k_quants::BlockQ4K>(),
                k_quants::BlockQ4K::BLCK_SIZE,
            ),
            (
                GgmlType::Q5_K,
                size_of::<k_quants::BlockQ5K>(),
                k_quants::BlockQ5K::BLCK_SIZE,
            ),
            (
                GgmlType::Q6_K,
                size_of::<k_quants::BlockQ6K>(),
                k_quants::BlockQ6K::BLCK_SIZE,
            ),
            (
                GgmlType::Q8_K,
                size_of::<k_quants::BlockQ8K>(),
                k_quants::BlockQ8K::BLCK_SIZE,
            ),
        ];
        for (ty, bytes, elems) in sizes {
            assert_eq!((bytes, elems), (ty.block_bytes(), ty.block_elems()), "{ty}");
        }
    }

    #[test]
    fn a_length_that_does_not_fit_is_an_error_naming_the_type() {
        for ty in super::super::types::ALL {
            let (elems, bytes) = (ty.block_elems(), ty.block_bytes());
            let integer = matches!(
                ty,
                GgmlType::I8 | GgmlType::I16 | GgmlType::I32 | GgmlType::I64
            );
            let block = vec![0u8; 2 * bytes];
            let mut out = vec![0f32; 2 * elems];
            assert_eq!(dequantize(ty, &block, &mut out).is_ok(), !integer, "{ty}");
            // A partial block, one value too many or too few: errors, never a panic.
            let cases: [(&[u8], usize); 3] = [
                (&block[..2 * bytes - 1], 2 * elems),
                (&block, 2 * elems + 1),
                (&block, 2 * elems - 1),
            ];
            for (bytes, values) in cases {
                let mut out = vec![0f32; values];
                let message = dequantize(ty, bytes, &mut out).unwrap_err().to_string();
                assert!(message.starts_with(&format!("{ty}:")), "{message}");
            }
        }
    }

    /// Every type with values (the integer types have none).
    fn decodable() -> impl Iterator<Item = GgmlType> {
        super::super::types::ALL.into_iter().filter(|ty| {
            !matches!(
                ty,
                GgmlType::I8 | GgmlType::I16 | GgmlType::I32 | GgmlType::I64
            )
        })
    }

    /// `n` bytes of the xorshift stream at `state`.
    fn random_bytes(state: &mut u64, n: usize) -> Vec<u8> {
        (0..n)
            .map(|_| {
                *state ^= *state << 13;
                *state ^= *state >> 7;
                *state ^= *state << 17;
                *state as u8
            })
            .collect()
    }

    /// Every decoder the CPU runs gives the scalar decoder's bits on blocks of random bytes (NaN and infinite
    /// scales included), for runs of blocks of several lengths, read at aligned and unaligned addresses.
    #[test]
    fn every_decoder_gives_the_scalar_bits_on_random_bytes() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let decoders = [Decoder::Scalar, Decoder::Avx2];
        let mut vectorised = 0;
        for ty in decodable() {
            let (elems, bytes) = (ty.block_elems(), ty.block_bytes());
            for blocks in [1, 2, 3, 9, 17, 300] {
                let raw = random_bytes(&mut state, blocks * bytes);
                let mut expected = vec![0f32; blocks * elems];
                dequantize_on(ty, &raw, &mut expected, Decoder::Scalar).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                for decoder in decoders.into_iter().filter(|d| d.available()) {
                    vectorised += usize::from(decoder.vectorises(ty));
                    for offset in [0, 1] {
                        // The same bytes at an address aligned for every block type, and at one that is not.
                        let mut buf = vec![0u8; offset + blocks * bytes];
                        buf[offset..].copy_from_slice(&raw);
                        let src = &buf[offset..];
                        let mut got = vec![f32::NAN; blocks * elems];
                        dequantize_on(ty, src, &mut got, decoder).unwrap();
                        assert!(
                            bits(&got) == bits(&expected),
                            "{ty} {decoder:?}: {blocks} blocks at offset {offset}"
                        );
                    }
                }
            }
        }
        if Decoder::Avx2.available() {
            assert_eq!(vectorised, 7 * 6, "the vectorised types, each length once");
        }
    }

    #[test]
    fn decoding_a_row_at_a_time_is_decoding_the_whole() {
        // Rows of 3 blocks of random bytes (finite scales or not: only the split is compared).
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for ty in decodable() {
            let (elems, bytes) = (ty.block_elems(), ty.block_bytes());
            let packed = random_bytes(&mut state, 3 * 67 * bytes);
            let mut whole = vec![0f32; 3 * 67 * elems];
            dequantize(ty, &packed, &mut whole).unwrap();
            let mut rows = vec![0f32; whole.len()];
            for (row, values) in packed.chunks(3 * bytes).zip(rows.chunks_mut(3 * elems)) {
                dequantize(ty, row, values).unwrap();
            }
            let same = whole
                .iter()
                .zip(&rows)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{ty}");
        }
    }
}
