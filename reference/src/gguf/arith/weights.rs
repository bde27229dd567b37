//! What [`super::Arithmetic::LlamaCpp`] needs of each GGUF weight: its `vec_dot_type`, from the ggml type the weight
//! store read (once, as it split the file), and for Q4_1/Q5_1 weights the minimum of every block (their dot with
//! Q8_1 activations adds `m · s` per block: [`super::q8_1_residuals`]), read from the packed matrix in the
//! checkpoint's row order.

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
    /// order; `None` for the other types.
    pub mins: Option<Arc<[f32]>>,
}

impl InputRounding {
    /// The rounding of a weight the GGUF stores as `ty` (its type as the weight store read it: see
    /// [`crate::weights::WeightStore::ggml_type`]), kept packed as `matrix` (`None`: not a matrix kept packed). A
    /// Q4_1/Q5_1 weight's minimums are read from the matrix's blocks, in the checkpoint's row order. An error (the
    /// run reports it if it uses the weight as a matrix) for a type with no CPU product, and for a Q4_1/Q5_1 weight
    /// not kept packed or whose columns the converter reordered (its blocks would not be the checkpoint's).
    pub fn of(ty: GgmlType, matrix: Option<&GgufMatrix>) -> std::result::Result<Self, String> {
        let vec_dot = VecDotType::of(ty)?;
        if !matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
            return Ok(InputRounding {
                ty: vec_dot,
                mins: None,
            });
        }
        let Some(m) = matrix else {
            return Err(format!(
                "a {ty:?} weight that is not a matrix kept packed: its blocks' minimums are not at hand, so \
                 llama.cpp's Q8_1 block sums cannot be modelled"
            ));
        };
        if m.reorders_columns() {
            return Err(format!(
                "a {ty:?} weight whose columns the converter reordered: its blocks are not the checkpoint's, so \
                 llama.cpp's Q8_1 block sums cannot be modelled"
            ));
        }
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
        })
    }
}
