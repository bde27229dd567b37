//! What [`super::Arithmetic::LlamaCpp`] needs of each GGUF weight: its `vec_dot_type`, from the ggml type the weight
//! store read (once, as it split the file); the order of its stored columns (llama.cpp quantizes the activations in
//! blocks of the file's column order, which the converter changed for `out_proj`); and for Q4_1/Q5_1 weights the
//! minimum of every block (their dot with Q8_1 activations adds `m · s` per block: [`super::q8_1_residuals`]), read
//! from the packed matrix in the checkpoint's row order and the file's block order.

use super::VecDotType;
use crate::gguf::GgmlType;
use crate::linear::GgufMatrix;
use half::f16;
use std::sync::Arc;

/// How llama.cpp's CPU converts the input of one weight's matrix products.
#[derive(Debug, Clone)]
pub struct InputRounding {
    /// The type the activations are rounded through.
    pub ty: VecDotType,
    /// Q4_1/Q5_1 weights: the minimum `m` of every 32-value block, `[out, in / 32]` row-major in the checkpoint's row
    /// order and the file's block order; `None` for the other types.
    pub mins: Option<Arc<[f32]>>,
    /// Column `c` of the checkpoint's weight is column `col_order[c]` of the file's (`None`: the same order). The
    /// converter reorders `linear_attn.out_proj`'s columns by value head (`ssm_out`); llama.cpp's activations are in
    /// the file's order, so its blocks of 32 (or 256) group other values than the checkpoint's order would whenever
    /// a value head is narrower than a block (`Dv = 16`: one block holds two heads).
    pub col_order: Option<Arc<[usize]>>,
}

impl InputRounding {
    /// The rounding of a weight the GGUF stores as `ty` (its type as the weight store read it: see
    /// [`crate::weights::WeightStore::ggml_type`]), kept packed as `matrix` (`None`: not a matrix kept packed), whose
    /// column order is the file's. A Q4_1/Q5_1 weight's minimums are read from the matrix's blocks, in the
    /// checkpoint's row order and the file's block order. An error (the run reports it if it uses the weight as a
    /// matrix) for a type with no CPU product, and for a Q4_1/Q5_1 weight not kept packed.
    pub fn of(ty: GgmlType, matrix: Option<&GgufMatrix>) -> std::result::Result<Self, String> {
        let vec_dot = VecDotType::of(ty)?;
        let col_order = matrix.and_then(|m| m.col_order()).map(Arc::from);
        if !matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
            return Ok(InputRounding {
                ty: vec_dot,
                mins: None,
                col_order,
            });
        }
        let Some(m) = matrix else {
            return Err(format!(
                "a {ty:?} weight that is not a matrix kept packed: its blocks' minimums are not at hand, so \
                 llama.cpp's Q8_1 block sums cannot be modelled"
            ));
        };
        // Each block starts with its f16 scale `d` and minimum `m`.
        let mins = (0..m.rows())
            .flat_map(|r| {
                m.stored_row(r)
                    .chunks_exact(ty.block_bytes())
                    .map(|b| f16::from_le_bytes([b[2], b[3]]).to_f32())
            })
            .collect();
        Ok(InputRounding {
            ty: vec_dot,
            mins: Some(mins),
            col_order,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::decode::random_blocks;
    use crate::linear::SharedMap;

    /// A `[3, cols]` matrix of random blocks of `ty`, its rows reversed, its columns reversed when `columns`.
    fn matrix(ty: GgmlType, cols: usize, columns: bool) -> (GgufMatrix, Vec<u8>) {
        let bytes = random_blocks(ty, 3 * cols / ty.block_elems(), 5).unwrap();
        let m = GgufMatrix::new(
            &SharedMap::from_vec(bytes.clone()),
            0,
            ty,
            (3, cols),
            Some(vec![2, 1, 0]),
            columns.then(|| (0..cols).rev().collect()),
        )
        .unwrap();
        (m, bytes)
    }

    #[test]
    fn the_minimums_are_the_blocks_in_the_checkpoints_row_order_and_the_files_block_order() {
        for ty in [GgmlType::Q4_1, GgmlType::Q5_1] {
            let (m, bytes) = matrix(ty, 64, false);
            let r = InputRounding::of(ty, Some(&m)).unwrap();
            assert_eq!(r.ty, VecDotType::Q8_1);
            let bb = ty.block_bytes();
            // Stored row 2 (blocks 4, 5) is the checkpoint's row 0.
            let block_min = |b: usize| f16::from_le_bytes([bytes[b * bb + 2], bytes[b * bb + 3]]);
            let expected: Vec<f32> = [4, 5, 2, 3, 0, 1].map(|b| block_min(b).to_f32()).to_vec();
            assert_eq!(r.mins.as_deref(), Some(&expected[..]), "{ty}");
            assert!(r.col_order.is_none());
            // Reordered columns: the blocks stay the file's (as llama.cpp's activations are), the order is carried.
            let (m, _) = matrix(ty, 64, true);
            let r = InputRounding::of(ty, Some(&m)).unwrap();
            assert_eq!(r.mins.as_deref(), Some(&expected[..]), "{ty}");
            let reversed: Vec<usize> = (0..64).rev().collect();
            assert_eq!(r.col_order.as_deref(), Some(&reversed[..]));
            // No packed matrix: the minimums are not at hand.
            assert!(
                InputRounding::of(ty, None)
                    .unwrap_err()
                    .contains("not a matrix")
            );
        }
        let (m, _) = matrix(GgmlType::Q4_K, 256, false);
        let r = InputRounding::of(GgmlType::Q4_K, Some(&m)).unwrap();
        assert_eq!((r.ty, r.mins, r.col_order), (VecDotType::Q8K, None, None));
        assert!(InputRounding::of(GgmlType::Q8_K, None).is_err());
    }
}
