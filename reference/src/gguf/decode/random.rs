//! Random blocks of any ggml type whose values are finite and moderate: the weights of property tests and of
//! synthetic benchmark files (valid scales, random codes), with no per-type knowledge of where a block's scales lie.

use super::{Decoder, dequantize_on};
use crate::error::{Error, Result};
use crate::gguf::GgmlType;

/// The largest magnitude a value of a drawn block may have (2^20): products of many stay far from f32's range.
const LARGEST: f32 = 1_048_576.0;

/// Draws of a block before giving up (a type none of whose random blocks fits: none is known).
const DRAWS: usize = 10_000;

/// `count` blocks of `ty`, each its bytes drawn at random until every value the scalar decoder gives it is finite
/// and at most 2^20 in magnitude; the same `seed` gives the same bytes. An error for the integer types (no
/// values) or when no block fits in 10 000 draws.
pub fn random_blocks(ty: GgmlType, count: usize, seed: u64) -> Result<Vec<u8>> {
    let (bytes, elems) = (ty.block_bytes(), ty.block_elems());
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out = vec![0u8; count * bytes];
    let mut values = vec![0f32; elems];
    for block in out.chunks_exact_mut(bytes) {
        let mut fits = false;
        for _ in 0..DRAWS {
            for chunk in block.chunks_mut(8) {
                let r = next().to_le_bytes();
                chunk.copy_from_slice(&r[..chunk.len()]);
            }
            dequantize_on(ty, block, &mut values, Decoder::Scalar)?;
            if values.iter().all(|v| v.abs() <= LARGEST) {
                fits = true;
                break;
            }
        }
        if !fits {
            return Err(Error::Input(format!(
                "{ty}: no random block with finite values of at most 2^20 in {DRAWS} draws"
            )));
        }
    }
    Ok(out)
}
