//! [`Linear::RoundedInput`]: a product whose activations are first rounded as llama.cpp's CPU converts them
//! ([`crate::gguf::arith`]).

use super::Linear;
use crate::error::{Error, Result};
use crate::gguf::arith::{InputRounding, VecDotType, q8_1_residuals};
use candle_core::{DType, Tensor};

/// `inner`'s product with `x` `[T, in]` (f32) rounded row by row as `r` says ([`VecDotType::round_trip`]), plus, for
/// a weight with block minimums (Q4_1, Q5_1), each block's minimum times the Q8_1 block-sum residual
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
    let original: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let mut values = original.clone();
    for row in values.chunks_mut(width.max(1)) {
        r.ty.round_trip(row)?;
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
    for row in original.chunks(width.max(1)) {
        residuals.extend(q8_1_residuals(row)?);
    }
    let residuals = Tensor::from_vec(residuals, (t, blocks), x.device())?;
    let mins = Tensor::from_slice(mins, (out, blocks), x.device())?;
    Ok((y + residuals.matmul(&mins.t()?)?)?)
}
