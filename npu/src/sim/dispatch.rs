//! One node's op on its stored arguments: the op's name and attributes mapped to the functions that compute it
//! ([`super::ops`], the products), and the reductions (summed in f32 or in the storage format).

use super::eval::Evaluator;
use super::numeric::Accumulation;
use super::ops::{
    binary, binary_int, concat, convert, gather, gelu_erf, gelu_tanh, one_hot_node, slice, softmax,
    transpose, unary,
};
use super::value::{Data, V, Val, strides};
use crate::error::{Error, Result};
use crate::ir::Node;
use std::rc::Rc;

impl Evaluator {
    /// One op on its (already stored) arguments; the caller rounds the result. `fused`: a node of a fused
    /// normalization's statistic (a reduction then sums in f32 whatever the accumulation).
    pub(super) fn op(&self, op: &str, node: &Node, a: &[V], fused: bool) -> Result<V> {
        let attr = |k: &str| node.attr(k).unwrap_or("");
        Ok(match op {
            "Add" | "Subtract" | "Multiply" | "Divide" => {
                if let (Data::I(_), Data::I(_)) = (&a[0].data, &a[1].data) {
                    let f: fn(i64, i64) -> i64 = match op {
                        "Add" => |x, y| x + y,
                        "Subtract" => |x, y| x - y,
                        "Multiply" => |x, y| x * y,
                        _ => |x, y| if y == 0 { 0 } else { x / y },
                    };
                    return binary_int(&a[0], &a[1], f);
                }
                let f: fn(f32, f32) -> f32 = match op {
                    "Add" => |x, y| x + y,
                    "Subtract" => |x, y| x - y,
                    "Multiply" => |x, y| x * y,
                    _ => |x, y| x / y,
                };
                binary(&a[0], &a[1], f)?
            }
            "Exp" => unary(&a[0], f32::exp)?,
            "Sqrt" => unary(&a[0], f32::sqrt)?,
            "Sigmoid" => unary(&a[0], |x| 1.0 / (1.0 + (-x).exp()))?,
            "Negative" => unary(&a[0], |x| -x)?,
            "Sin" => unary(&a[0], f32::sin)?,
            "Cos" => unary(&a[0], f32::cos)?,
            "SoftPlus" => unary(&a[0], |x| {
                // OpenVINO's SoftPlus returns x beyond the threshold where ln(1 + e^x) rounds to x.
                if x > 20.0 { x } else { x.exp().ln_1p() }
            })?,
            "Swish" => unary(&a[0], |x| x / (1.0 + (-x).exp()))?,
            "Gelu" => match attr("approximation_mode") {
                "TANH" => unary(&a[0], gelu_tanh)?,
                "ERF" | "" => unary(&a[0], gelu_erf)?,
                other => {
                    return Err(Error::Interface(format!("Gelu approximation_mode {other}")));
                }
            },
            "MatMul" => self.matmul(
                &a[0],
                &a[1],
                attr("transpose_a") == "true",
                attr("transpose_b") == "true",
            )?,
            "Reshape" => {
                let shape: Vec<usize> = a[1].ints()?.iter().map(|&d| d as usize).collect();
                Rc::new(Val {
                    shape,
                    data: a[0].data.clone(),
                })
            }
            "Transpose" => {
                let perm: Vec<usize> = a[1].ints()?.iter().map(|&d| d as usize).collect();
                transpose(&a[0], &perm)?
            }
            "Concat" => {
                let axis: usize = attr("axis")
                    .parse()
                    .map_err(|_| Error::Interface("Concat axis".into()))?;
                concat(a, axis)?
            }
            "Slice" => {
                let (start, stop, step, axis) = (
                    a[1].ints()?[0],
                    a[2].ints()?[0],
                    a[3].ints()?[0],
                    a[4].ints()?[0] as usize,
                );
                if step != 1 {
                    return Err(Error::Interface(format!("Slice step {step}")));
                }
                slice(&a[0], axis, start as usize, (stop - start) as usize)?
            }
            "Gather" => {
                let axis = a[2].ints()?[0] as usize;
                gather(&a[0], &a[1], axis)?
            }
            "ReduceSum" | "ReduceMean" => {
                let axes: Vec<usize> = a[1].ints()?.iter().map(|&d| d as usize).collect();
                self.reduce(
                    &a[0],
                    &axes,
                    attr("keep_dims") == "true",
                    op == "ReduceMean",
                    fused,
                )?
            }
            "SoftMax" => {
                let axis: usize = attr("axis")
                    .parse()
                    .map_err(|_| Error::Interface("SoftMax axis".into()))?;
                softmax(&a[0], axis)?
            }
            "Convert" => convert(&a[0], attr("destination_type"))?,
            "OneHot" => one_hot_node(node, a)?,
            other => {
                return Err(Error::Interface(format!(
                    "{other} is not an op FP16SIM evaluates"
                )));
            }
        })
    }

    fn reduce(&self, x: &V, axes: &[usize], keep: bool, mean: bool, fused: bool) -> Result<V> {
        let xs = x.floats()?;
        let shape = &x.shape;
        let reduced: Vec<usize> = shape
            .iter()
            .enumerate()
            .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
            .collect();
        let count: usize = axes.iter().map(|&a| shape[a]).product();
        let st = strides(shape);
        let rst = strides(&reduced);
        let mut acc = vec![0f32; reduced.iter().product()];
        let acc_storage = self.model.accumulation == Accumulation::Storage
            && !self.model.is_exact_f32()
            && !fused;
        for (flat, &v) in xs.iter().enumerate() {
            let mut r = 0;
            for d in 0..shape.len() {
                let c = (flat / st[d]) % shape[d];
                if !axes.contains(&d) {
                    r += c * rst[d];
                }
            }
            acc[r] += v;
            if acc_storage {
                acc[r] = self.model.round(acc[r]);
            }
        }
        if mean {
            for v in &mut acc {
                *v /= count as f32;
            }
        }
        let out_shape = if keep {
            reduced
        } else {
            shape
                .iter()
                .enumerate()
                .filter(|(i, _)| !axes.contains(i))
                .map(|(_, &d)| d)
                .collect()
        };
        Ok(Val::f(out_shape, acc))
    }
}
