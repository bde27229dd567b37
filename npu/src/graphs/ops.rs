//! Small graph functions shared by the blocks, as `reference::ops` has them: the same names, the same math, written
//! as IR ops on [`Graph`] values.

use crate::error::Result;
use crate::ir::{Graph, Unary, Value};

/// `x W^T` for a weight stored as `[out, in]` (PyTorch's `nn.Linear` layout). `x`: `[T, in]` → `[T, out]`.
pub fn linear(graph: &mut Graph, x: Value, weight: Value) -> Result<Value> {
    graph.matmul(x, weight, false, true)
}

/// The logistic function `1 / (1 + exp(-x))`.
pub fn sigmoid(graph: &mut Graph, x: Value) -> Result<Value> {
    graph.unary(Unary::Sigmoid, x)
}

/// `x * sigmoid(x)`.
pub fn silu(graph: &mut Graph, x: Value) -> Result<Value> {
    graph.unary(Unary::Swish, x)
}

/// `log(1 + exp(x))`.
pub fn softplus(graph: &mut Graph, x: Value) -> Result<Value> {
    graph.unary(Unary::SoftPlus, x)
}

/// Zero-centred RMSNorm over the last dimension: `normalize(x) * (1 + w)`. `one_plus_w` is the folded constant
/// `1 + w` (folded on the host in f32, as the reference adds it in f32).
pub fn rms_norm(graph: &mut Graph, x: Value, one_plus_w: Value, eps: f32) -> Result<Value> {
    let n = normalize(graph, x, eps)?;
    graph.mul(n, one_plus_w)
}

/// `x * rsqrt(mean(x^2) + eps)` over the last dimension (as `x / sqrt(…)`).
pub fn normalize(graph: &mut Graph, x: Value, eps: f32) -> Result<Value> {
    let rank = graph.shape(x).len();
    let sq = graph.mul(x, x)?;
    let mean = graph.reduce_mean(sq, &[rank - 1], true)?;
    let e = graph.scalar(eps)?;
    let var = graph.add(mean, e)?;
    let root = graph.unary(Unary::Sqrt, var)?;
    graph.div(x, root)
}

/// The gated norm of the linear-attention layer, per head over the last dimension:
/// `w * (o * rsqrt(mean(o^2) + eps)) * silu(z)`, with a plain (not zero-centred) weight shared by all heads.
pub fn gated_rms_norm(
    graph: &mut Graph,
    o: Value,
    z: Value,
    weight: Value,
    eps: f32,
) -> Result<Value> {
    let normed = normalize(graph, o, eps)?;
    let normed = graph.mul(normed, weight)?;
    let gate = silu(graph, z)?;
    graph.mul(normed, gate)
}

/// L2 normalisation over the last dimension: `x * rsqrt(sum(x^2) + eps)` (as `x / sqrt(…)`).
pub fn l2_normalize(graph: &mut Graph, x: Value, eps: f32) -> Result<Value> {
    let rank = graph.shape(x).len();
    let sq = graph.mul(x, x)?;
    let sum = graph.reduce_sum(sq, &[rank - 1], true)?;
    let e = graph.scalar(eps)?;
    let s = graph.add(sum, e)?;
    let root = graph.unary(Unary::Sqrt, s)?;
    graph.div(x, root)
}

/// Repeats each head `n` times in place along `axis` (repeat-interleave: heads `a a b b`, not `a b a b`), as one
/// `Gather` of head `j / n` for output head `j`.
pub fn repeat_interleave(graph: &mut Graph, x: Value, n: usize, axis: usize) -> Result<Value> {
    if n == 1 {
        return Ok(x);
    }
    let heads = graph.shape(x)[axis];
    let index: Vec<i64> = (0..heads * n).map(|j| (j / n) as i64).collect();
    let index = graph.const_i64(&index, &[heads * n])?;
    graph.gather(x, index, axis)
}

/// An f32 constant of exact values given in f64 (the masks of `reference::masks`: 0, 1, −inf).
pub fn exact_const(graph: &mut Graph, values: &[f64], shape: &[usize]) -> Result<Value> {
    let data: Vec<f32> = values.iter().map(|&x| x as f32).collect();
    graph.const_f32(&data, shape)
}
