//! The element-wise, shape and layout ops of the evaluator, on stored values (the caller rounds results).

use super::value::{Data, V, Val, broadcast, broadcast_index, strides};
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use std::rc::Rc;

pub(super) fn unary(x: &V, f: impl Fn(f32) -> f32) -> Result<V> {
    Ok(Val::f(
        x.shape.clone(),
        x.floats()?.iter().map(|&v| f(v)).collect(),
    ))
}

pub(super) fn binary(a: &V, b: &V, f: fn(f32, f32) -> f32) -> Result<V> {
    let shape = broadcast(&a.shape, &b.shape)?;
    let (ia, ib) = (
        broadcast_index(&a.shape, &shape),
        broadcast_index(&b.shape, &shape),
    );
    let (av, bv) = (a.floats()?, b.floats()?);
    Ok(Val::f(
        shape,
        ia.iter().zip(&ib).map(|(&i, &j)| f(av[i], bv[j])).collect(),
    ))
}

pub(super) fn binary_int(a: &V, b: &V, f: fn(i64, i64) -> i64) -> Result<V> {
    let shape = broadcast(&a.shape, &b.shape)?;
    let (ia, ib) = (
        broadcast_index(&a.shape, &shape),
        broadcast_index(&b.shape, &shape),
    );
    let (av, bv) = (a.ints()?, b.ints()?);
    Ok(Rc::new(Val {
        shape,
        data: Data::I(ia.iter().zip(&ib).map(|(&i, &j)| f(av[i], bv[j])).collect()),
    }))
}

fn permute<T: Copy>(data: &[T], shape: &[usize], perm: &[usize]) -> (Vec<usize>, Vec<T>) {
    let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
    let st = strides(shape);
    let ost = strides(&out_shape);
    let total: usize = out_shape.iter().product();
    let v = (0..total)
        .map(|flat| {
            let mut src = 0;
            for (d, &p) in perm.iter().enumerate() {
                src += ((flat / ost[d]) % out_shape[d]) * st[p];
            }
            data[src]
        })
        .collect();
    (out_shape, v)
}

pub(super) fn transpose(x: &V, perm: &[usize]) -> Result<V> {
    Ok(Rc::new(match &x.data {
        Data::F(v) => {
            let (shape, d) = permute(v, &x.shape, perm);
            Val {
                shape,
                data: Data::F(d),
            }
        }
        Data::I(v) => {
            let (shape, d) = permute(v, &x.shape, perm);
            Val {
                shape,
                data: Data::I(d),
            }
        }
        Data::B(v) => {
            let (shape, d) = permute(v, &x.shape, perm);
            Val {
                shape,
                data: Data::B(d),
            }
        }
    }))
}

/// Elements `start..start + len` along `axis`.
pub(super) fn slice(x: &V, axis: usize, start: usize, len: usize) -> Result<V> {
    let shape = &x.shape;
    if axis >= shape.len() || start + len > shape[axis] {
        return Err(Error::Interface(format!(
            "slice {start}+{len} of axis {axis} of {shape:?}"
        )));
    }
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let mut out_shape = shape.clone();
    out_shape[axis] = len;
    let ranges: Vec<(usize, usize)> = (0..outer)
        .map(|o| {
            let from = (o * shape[axis] + start) * inner;
            (from, from + len * inner)
        })
        .collect();
    Ok(Rc::new(Val {
        shape: out_shape,
        data: match &x.data {
            Data::F(v) => Data::F(
                ranges
                    .iter()
                    .flat_map(|&(a, b)| v[a..b].iter().copied())
                    .collect(),
            ),
            Data::I(v) => Data::I(
                ranges
                    .iter()
                    .flat_map(|&(a, b)| v[a..b].iter().copied())
                    .collect(),
            ),
            Data::B(v) => Data::B(
                ranges
                    .iter()
                    .flat_map(|&(a, b)| v[a..b].iter().copied())
                    .collect(),
            ),
        },
    }))
}

pub(super) fn concat(parts: &[V], axis: usize) -> Result<V> {
    let first = parts
        .first()
        .ok_or_else(|| Error::Interface("Concat of nothing".into()))?;
    let mut shape = first.shape.clone();
    shape[axis] = parts.iter().map(|p| p.shape[axis]).sum();
    let outer: usize = shape[..axis].iter().product();
    let mut out = Vec::with_capacity(shape.iter().product());
    for o in 0..outer {
        for p in parts {
            let inner: usize = p.shape[axis..].iter().product();
            out.extend_from_slice(&p.floats()?[o * inner..(o + 1) * inner]);
        }
    }
    Ok(Val::f(shape, out))
}

pub(super) fn gather(data: &V, indices: &V, axis: usize) -> Result<V> {
    let idx = indices.ints()?;
    let shape = &data.shape;
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let dim = shape[axis] as i64;
    let mut out_shape = shape[..axis].to_vec();
    out_shape.extend_from_slice(&indices.shape);
    out_shape.extend_from_slice(&shape[axis + 1..]);
    // The flat ranges of `data` the output takes, in order.
    let mut ranges = Vec::with_capacity(outer * idx.len());
    for o in 0..outer {
        for &i in &idx {
            let i = if i < 0 { i + dim } else { i };
            if !(0..dim).contains(&i) {
                return Err(Error::Interface(format!(
                    "Gather index {i} outside 0..{dim}"
                )));
            }
            let from = (o * dim as usize + i as usize) * inner;
            ranges.push(from..from + inner);
        }
    }
    fn take<T: Copy>(v: &[T], ranges: &[std::ops::Range<usize>]) -> Vec<T> {
        ranges
            .iter()
            .flat_map(|r| v[r.clone()].iter().copied())
            .collect()
    }
    // Floats (values) or integers (indices, or integer codes gathered before they are dequantized).
    Ok(match &data.data {
        Data::I(v) => Rc::new(Val {
            shape: out_shape,
            data: Data::I(take(v, &ranges)),
        }),
        _ => Val::f(out_shape, take(data.floats()?, &ranges)),
    })
}

pub(super) fn softmax(x: &V, axis: usize) -> Result<V> {
    let shape = &x.shape;
    let v = x.floats()?;
    let inner: usize = shape[axis + 1..].iter().product();
    let n = shape[axis];
    let outer: usize = shape[..axis].iter().product();
    let mut out = vec![0f32; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| (o * n + k) * inner + i;
            let max = (0..n).map(|k| v[at(k)]).fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = (0..n).map(|k| (v[at(k)] - max).exp()).sum();
            for k in 0..n {
                out[at(k)] = (v[at(k)] - max).exp() / sum;
            }
        }
    }
    Ok(Val::f(shape.clone(), out))
}

pub(super) fn convert(x: &V, to: &str) -> Result<V> {
    Ok(Rc::new(match to {
        "f32" | "f16" => Val {
            shape: x.shape.clone(),
            data: Data::F(match &x.data {
                Data::F(v) => v.clone(),
                Data::I(v) => v.iter().map(|&i| i as f32).collect(),
                Data::B(v) => v.iter().map(|&b| b as i32 as f32).collect(),
            }),
        },
        "i64" => Val {
            shape: x.shape.clone(),
            data: Data::I(x.ints()?),
        },
        other => return Err(Error::Interface(format!("Convert to {other}"))),
    }))
}

pub(super) fn from_tensor(t: &Tensor) -> Result<V> {
    let shape = t.dims().to_vec();
    let flat = t.flatten_all()?;
    Ok(Rc::new(match t.dtype() {
        DType::I64 => Val {
            shape,
            data: Data::I(flat.to_vec1::<i64>()?),
        },
        _ => Val {
            shape,
            data: Data::F(flat.to_dtype(DType::F32)?.to_vec1::<f32>()?),
        },
    }))
}

pub(super) fn to_tensor(v: &Val) -> Result<Tensor> {
    let dev = &Device::Cpu;
    Ok(match &v.data {
        Data::F(x) => Tensor::from_vec(x.clone(), v.shape.clone(), dev)?,
        Data::I(x) => Tensor::from_vec(x.clone(), v.shape.clone(), dev)?,
        Data::B(x) => Tensor::from_vec(
            x.iter().map(|&b| b as i64).collect::<Vec<_>>(),
            v.shape.clone(),
            dev,
        )?,
    })
}

/// `x/2 · (1 + erf(x/√2))`, evaluated in f64 (the caller rounds).
pub(super) fn gelu_erf(x: f32) -> f32 {
    let x = x as f64;
    (0.5 * x * (1.0 + candle_core::cpu::erf::erf_f64(x * std::f64::consts::FRAC_1_SQRT_2))) as f32
}

/// `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`, evaluated in f64 (the caller rounds).
pub(super) fn gelu_tanh(x: f32) -> f32 {
    let x = x as f64;
    let k = (2.0 / std::f64::consts::PI).sqrt();
    (0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())) as f32
}

/// `TopK-11` with mode `max`, sorted by value and stable: along `axis`, the `k` largest values in descending order
/// (equal values in ascending index order) and their indices. The values are the input's, unchanged.
pub(super) fn topk(x: &V, k: usize, axis: usize) -> Result<(V, V)> {
    let shape = &x.shape;
    if axis >= shape.len() || k > shape[axis] {
        return Err(Error::Interface(format!(
            "TopK {k} along axis {axis} of {shape:?}"
        )));
    }
    let v = x.floats()?;
    let n = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let outer: usize = shape[..axis].iter().product();
    let mut out_shape = shape.clone();
    out_shape[axis] = k;
    let total: usize = out_shape.iter().product();
    let (mut values, mut indices) = (vec![0f32; total], vec![0i64; total]);
    let mut order: Vec<usize> = Vec::with_capacity(n);
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| (o * n + j) * inner + i;
            order.clear();
            order.extend(0..n);
            // A stable sort: equal values keep ascending index order.
            order.sort_by(|&a, &b| v[at(b)].total_cmp(&v[at(a)]));
            for (r, &j) in order.iter().take(k).enumerate() {
                let to = (o * k + r) * inner + i;
                values[to] = v[at(j)];
                indices[to] = j as i64;
            }
        }
    }
    Ok((
        Val::f(out_shape.clone(), values),
        Rc::new(Val {
            shape: out_shape,
            data: Data::I(indices),
        }),
    ))
}

/// `OneHot-1` along a new last axis: `on` where the index equals the class, `off` elsewhere (an index outside
/// `0..depth` gives a row of `off`).
pub(super) fn one_hot(indices: &V, depth: usize, on: f32, off: f32) -> Result<V> {
    let idx = indices.ints()?;
    let mut out = vec![off; idx.len() * depth];
    for (row, &i) in out.chunks_exact_mut(depth.max(1)).zip(&idx) {
        if (0..depth as i64).contains(&i) {
            row[i as usize] = on;
        }
    }
    let mut shape = indices.shape.clone();
    shape.push(depth);
    Ok(Val::f(shape, out))
}

/// A `TopK` node on its arguments (data, k): `[values, indices]`. Only the form the graph builder writes is
/// evaluated (mode `max`, sorted by value); `stable` or not, equal values come in ascending index order, which is
/// what a stable sort gives and one order an unstable one may give.
pub(super) fn topk_node(node: &crate::ir::Node, a: &[V]) -> Result<Vec<V>> {
    let attr = |k: &str| node.attr(k).unwrap_or("");
    if attr("mode") != "max" || attr("sort") != "value" {
        return Err(Error::Interface(format!(
            "TopK mode {} sort {}: FP16SIM evaluates mode max sorted by value",
            attr("mode"),
            attr("sort")
        )));
    }
    let rank = a[0].shape.len() as i64;
    let axis: i64 = attr("axis")
        .parse()
        .map_err(|_| Error::Interface("TopK axis".into()))?;
    let axis = if axis < 0 { axis + rank } else { axis };
    let k = a[1].ints()?.first().copied().unwrap_or(0);
    if axis < 0 || k < 0 {
        return Err(Error::Interface(format!("TopK axis {axis}, k {k}")));
    }
    let (values, indices) = topk(&a[0], k as usize, axis as usize)?;
    Ok(vec![values, indices])
}

/// A `OneHot` node on its arguments (indices, depth, on, off), its new axis last (the form the builder writes).
pub(super) fn one_hot_node(node: &crate::ir::Node, a: &[V]) -> Result<V> {
    let axis = node.attr("axis").unwrap_or("-1");
    if axis != "-1" && axis != a[0].shape.len().to_string() {
        return Err(Error::Interface(format!(
            "OneHot axis {axis}: FP16SIM evaluates a new last axis"
        )));
    }
    let depth = a[1].ints()?.first().copied().unwrap_or(0).max(0) as usize;
    one_hot(&a[0], depth, a[2].floats()?[0], a[3].floats()?[0])
}
