//! Small tensor functions shared by the layers. Every function computes in the dtype of its input: precision is
//! chosen once, when the weights are loaded, never here.

use crate::error::Result;
use candle_core::{CpuStorage, CustomOp1, D, Layout, Shape, Tensor};

/// `x W^T` for a weight stored as `[out, in]` (PyTorch's `nn.Linear` layout). `x`: `[T, in]` → `[T, out]`.
pub fn linear(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    Ok(x.matmul(&weight.t()?)?)
}

/// The logistic function `1 / (1 + exp(-x))`; saturates to exactly 0 or 1, never NaN.
pub fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok((x.neg()?.exp()? + 1.0)?.recip()?)
}

/// `x * sigmoid(x)`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    Ok(x.silu()?)
}

/// `log(1 + exp(x))`, evaluated as `max(x, 0) + log1p(exp(-|x|))` element by element: no overflow for large `x`,
/// full relative precision for very negative `x`.
pub fn softplus(x: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1_no_bwd(&Softplus)?)
}

struct Softplus;

fn softplus_f64(x: f64) -> f64 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

impl CustomOp1 for Softplus {
    fn name(&self) -> &'static str {
        "softplus"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("softplus: the input must be contiguous");
        };
        fn map<T: Copy>(data: &[T], range: (usize, usize), f: impl Fn(T) -> T) -> Vec<T> {
            data[range.0..range.1].iter().map(|&x| f(x)).collect()
        }
        let range = (start, end);
        let out = match storage {
            CpuStorage::F32(d) => CpuStorage::F32(map(d, range, |x| softplus_f64(x as f64) as f32)),
            CpuStorage::F64(d) => CpuStorage::F64(map(d, range, softplus_f64)),
            CpuStorage::F16(d) => CpuStorage::F16(map(d, range, |x| {
                half::f16::from_f64(softplus_f64(x.to_f64()))
            })),
            CpuStorage::BF16(d) => CpuStorage::BF16(map(d, range, |x| {
                half::bf16::from_f64(softplus_f64(x.to_f64()))
            })),
            _ => candle_core::bail!("softplus: unsupported dtype"),
        };
        Ok((out, layout.shape().clone()))
    }
}

/// Zero-centred RMSNorm over the last dimension: `x * rsqrt(mean(x^2) + eps) * (1 + w)`.
/// Used by the input/post-attention norms, the final norm and the attention q/k norms.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let scale = (weight + 1.0)?;
    Ok(normalize(x, eps)?.broadcast_mul(&scale)?)
}

/// `x * rsqrt(mean(x^2) + eps)` over the last dimension.
pub fn normalize(x: &Tensor, eps: f64) -> Result<Tensor> {
    let inv = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv)?)
}

/// The gated norm of the linear-attention layer, per head over the last dimension:
/// `w * (o * rsqrt(mean(o^2) + eps)) * silu(z)`, with a plain (not zero-centred) weight shared by all heads.
pub fn gated_rms_norm(o: &Tensor, z: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let normed = normalize(o, eps)?.broadcast_mul(weight)?;
    Ok((normed * silu(z)?)?)
}

/// L2 normalisation over the last dimension: `x * rsqrt(sum(x^2) + eps)`.
pub fn l2_normalize(x: &Tensor, eps: f64) -> Result<Tensor> {
    let inv = (x.sqr()?.sum_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv)?)
}

/// Softmax over the last dimension, `-inf` entries giving exactly zero weight.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    Ok(e.broadcast_div(&sum)?)
}

/// Repeats each head `n` times in place along dimension `dim` (repeat-interleave: heads `a a b b`, not `a b a b`).
pub fn repeat_interleave(x: &Tensor, n: usize, dim: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x.clone());
    }
    let mut dims = x.dims().to_vec();
    let x = x.unsqueeze(dim + 1)?;
    let mut expanded = x.dims().to_vec();
    expanded[dim + 1] = n;
    let x = x.broadcast_as(expanded)?.contiguous()?;
    dims[dim] *= n;
    Ok(x.reshape(dims)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn softplus_is_exact_and_never_overflows() {
        let xs = [-1000.0f64, -40.0, -5.0, 0.0, 3.0, 30.0, 1000.0];
        let t = Tensor::new(&xs[..], &Device::Cpu).unwrap();
        let y: Vec<f64> = softplus(&t).unwrap().to_vec1().unwrap();
        for (x, y) in xs.iter().zip(&y) {
            assert!(y.is_finite());
            let expected = if *x > 30.0 { *x } else { x.exp().ln_1p() };
            assert!(
                (y - expected).abs() <= 1e-15 * expected.abs().max(1e-300),
                "softplus({x}) = {y}"
            );
        }
        // Relative precision where 1 + exp(x) would round to 1.
        assert!((y[1] / (-40.0f64).exp() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn sigmoid_saturates_without_nan() {
        let t = Tensor::new(&[-1e4f32, 0.0, 1e4], &Device::Cpu).unwrap();
        assert_eq!(
            sigmoid(&t).unwrap().to_vec1::<f32>().unwrap(),
            vec![0.0, 0.5, 1.0]
        );
    }

    #[test]
    fn repeat_interleave_orders_heads_aabb() {
        let t = Tensor::new(&[[1f32, 1.], [2., 2.]], &Device::Cpu).unwrap(); // [H=2, D=2]
        let r = repeat_interleave(&t, 2, 0).unwrap();
        assert_eq!(
            r.to_vec2::<f32>().unwrap(),
            vec![vec![1., 1.], vec![1., 1.], vec![2., 2.], vec![2., 2.]]
        );
    }

    #[test]
    fn rms_norm_weight_is_zero_centred() {
        // A zero weight must leave the normalised vector unscaled: (1 + 0) * x / rms(x).
        let x = Tensor::new(&[[3f64, 4.0]], &Device::Cpu).unwrap();
        let w = Tensor::zeros(2, candle_core::DType::F64, &Device::Cpu).unwrap();
        let y = rms_norm(&x, &w, 0.0).unwrap().to_vec2::<f64>().unwrap();
        let rms = (12.5f64).sqrt();
        assert!((y[0][0] - 3.0 / rms).abs() < 1e-15 && (y[0][1] - 4.0 / rms).abs() < 1e-15);
    }
}
