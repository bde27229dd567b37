//! [`Linear::RoundedInput`]: a product whose activations are first rounded as llama.cpp's CPU converts them
//! ([`crate::gguf::arith`]).

use super::Linear;
use crate::error::{Error, Result};
use crate::gguf::arith::{InputRounding, VecDotType, q8_1_residuals};
use candle_core::{DType, Tensor};

/// `inner`'s product with `x` `[T, in]` (f32) rounded row by row as `r` says ([`VecDotType::round_trip`]), in
/// blocks of the file's column order when the converter reordered the weight's columns (`r.col_order`), plus, for a
/// weight with block minimums (Q4_1, Q5_1), each block's minimum times the Q8_1 block-sum residual
/// ([`q8_1_residuals`]).
pub(super) fn forward(r: &InputRounding, inner: &Linear, x: &Tensor) -> Result<Tensor> {
    if r.ty == VecDotType::F32 {
        return inner.forward(x);
    }
    if x.dtype() != DType::F32 {
        return Err(Error::Input(format!(
            "llama.cpp's arithmetic rounds f32 activations, not {:?}",
            x.dtype()
        )));
    }
    let (t, width) = x.dims2()?;
    let mut stored: Vec<f32> = x.flatten_all()?.to_vec1()?;
    // Each row as llama.cpp holds it: in the file's column order, where its blocks are.
    if let Some(order) = &r.col_order {
        if order.len() != width {
            return Err(Error::Input(format!(
                "a column order of {} for a weight of {width} columns",
                order.len()
            )));
        }
        for row in stored.chunks_mut(width.max(1)) {
            let checkpoint = row.to_vec();
            for (c, &to) in order.iter().enumerate() {
                row[to] = checkpoint[c];
            }
        }
    }
    let mut values = stored.clone();
    for row in values.chunks_mut(width.max(1)) {
        r.ty.round_trip(row)?;
        if let Some(order) = &r.col_order {
            let file_order = row.to_vec();
            for (c, &from) in order.iter().enumerate() {
                row[c] = file_order[from];
            }
        }
    }
    let y = inner.forward(&Tensor::from_vec(values, (t, width), x.device())?)?;
    let Some(mins) = &r.mins else {
        return Ok(y);
    };
    let blocks = width / 32;
    let out = y.dim(1)?;
    if mins.len() != out * blocks {
        return Err(Error::Input(format!(
            "{} block minimums for a [{out}, {width}] weight",
            mins.len()
        )));
    }
    let mut residuals = Vec::with_capacity(t * blocks);
    for row in stored.chunks(width.max(1)) {
        residuals.extend(q8_1_residuals(row)?);
    }
    let residuals = Tensor::from_vec(residuals, (t, blocks), x.device())?;
    let mins = Tensor::from_slice(mins, (out, blocks), x.device())?;
    Ok((y + residuals.matmul(&mins.t()?)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// `out_proj`'s columns as the converter stores them for 2 key and 4 value heads of 16 (checkpoint head
    /// `k·2 + j` is the file's `j·2 + k`): a Q8_0 block of 32 holds checkpoint heads 0 and 2, not 0 and 1. The
    /// activations are rounded in the file's blocks, as llama.cpp holds them, and given back in the checkpoint's order.
    #[test]
    fn activations_are_rounded_in_blocks_of_the_files_column_order() {
        let order: Vec<usize> = (0..64)
            .map(|c| [0, 2, 1, 3][c / 16] * 16 + c % 16)
            .collect();
        // Head 0 large, the others small: which head shares head 0's block decides their scale.
        let x: Vec<f32> = (0..64)
            .map(|c| {
                if c < 16 {
                    100.0 - 0.37 * c as f32
                } else {
                    0.5 + 0.013 * c as f32
                }
            })
            .collect();
        let r = InputRounding {
            ty: VecDotType::Q8_0,
            mins: None,
            col_order: Some(order.clone().into()),
        };
        let eye = Linear::Dense(Tensor::eye(64, DType::F32, &Device::Cpu).unwrap());
        let input = Tensor::from_vec(x.clone(), (1, 64), &Device::Cpu).unwrap();
        let y: Vec<f32> = forward(&r, &eye, &input)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut file = vec![0f32; 64];
        for (c, &to) in order.iter().enumerate() {
            file[to] = x[c];
        }
        VecDotType::Q8_0.round_trip(&mut file).unwrap();
        let want: Vec<f32> = order.iter().map(|&from| file[from]).collect();
        assert_eq!(y, want);
        let mut checkpoint_blocks = x.clone();
        VecDotType::Q8_0.round_trip(&mut checkpoint_blocks).unwrap();
        assert_ne!(y, checkpoint_blocks);
        // A column order of another width is refused.
        let short = InputRounding {
            col_order: Some(order[..32].to_vec().into()),
            ..r
        };
        assert!(forward(&short, &eye, &input).is_err());
    }
}
