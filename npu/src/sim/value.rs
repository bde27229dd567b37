//! The evaluator's values: a shape and its data (floats, integers or booleans), row-major, and the strides and
//! numpy broadcasting the ops index them by.

use crate::error::{Error, Result};
use std::rc::Rc;

/// The data of a value.
#[derive(Debug, Clone)]
pub(super) enum Data {
    F(Vec<f32>),
    I(Vec<i64>),
    B(Vec<bool>),
}

/// A value: a shape and its data, row-major.
#[derive(Debug, Clone)]
pub(super) struct Val {
    pub(super) shape: Vec<usize>,
    pub(super) data: Data,
}

pub(super) type V = Rc<Val>;

impl Val {
    pub(super) fn f(shape: Vec<usize>, data: Vec<f32>) -> V {
        Rc::new(Val {
            shape,
            data: Data::F(data),
        })
    }

    pub(super) fn floats(&self) -> Result<&[f32]> {
        match &self.data {
            Data::F(v) => Ok(v),
            _ => Err(Error::Interface("a float value was expected".into())),
        }
    }

    pub(super) fn ints(&self) -> Result<Vec<i64>> {
        match &self.data {
            Data::I(v) => Ok(v.clone()),
            Data::F(v) => Ok(v.iter().map(|&x| x as i64).collect()),
            Data::B(v) => Ok(v.iter().map(|&b| b as i64).collect()),
        }
    }
}

/// Row-major strides of a shape.
pub(super) fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// The numpy broadcast of two shapes.
pub(super) fn broadcast(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    (0..n)
        .map(|i| {
            let x = if i + a.len() >= n {
                a[i + a.len() - n]
            } else {
                1
            };
            let y = if i + b.len() >= n {
                b[i + b.len() - n]
            } else {
                1
            };
            match (x, y) {
                (x, y) if x == y => Ok(x),
                (1, y) => Ok(y),
                (x, 1) => Ok(x),
                _ => Err(Error::Interface(format!(
                    "{a:?} and {b:?} do not broadcast"
                ))),
            }
        })
        .collect()
}

/// For every element of `out` (a broadcast shape), the flat index into a value of shape `shape`.
pub(super) fn broadcast_index(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let n = out.len();
    let st = strides(shape);
    let offset = n - shape.len();
    let total: usize = out.iter().product();
    let out_st = strides(out);
    (0..total)
        .map(|flat| {
            let mut idx = 0;
            for (d, &os) in out_st.iter().enumerate() {
                let coord = (flat / os) % out[d];
                if d >= offset && shape[d - offset] != 1 {
                    idx += coord * st[d - offset];
                }
            }
            idx
        })
        .collect()
}
