//! Tensor comparison with a labelled report: the worst element, its index, and the error relative to the expected
//! tensor's largest magnitude (the measure every parity figure of this project uses).

use crate::error::{Error, Result};
use candle_core::{DType, Tensor};
use std::fmt;

/// How far `actual` is from `expected`.
#[derive(Debug, Clone, PartialEq)]
pub struct Diff {
    /// Largest `|actual − expected|`.
    pub max_abs: f64,
    /// Largest `|expected|` (the scale errors are measured against).
    pub scale: f64,
    /// Multi-index of the worst element.
    pub worst_index: Vec<usize>,
    /// `actual` and `expected` at the worst element.
    pub worst_values: (f64, f64),
    /// Number of elements where either side is NaN or infinite.
    pub non_finite: usize,
    /// Elements compared.
    pub count: usize,
}

impl Diff {
    /// `max_abs / scale` (`max_abs` itself when the expected tensor is all zeros).
    pub fn relative(&self) -> f64 {
        if self.scale > 0.0 {
            self.max_abs / self.scale
        } else {
            self.max_abs
        }
    }

    /// Whether every element is finite and `max_abs <= atol + rtol * scale`.
    pub fn within(&self, atol: f64, rtol: f64) -> bool {
        self.non_finite == 0 && self.max_abs <= atol + rtol * self.scale
    }
}

impl fmt::Display for Diff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "max |diff| {:.3e} ({:.3e} of max |expected| {:.3e}) at {:?}: {} vs {}",
            self.max_abs,
            self.relative(),
            self.scale,
            self.worst_index,
            self.worst_values.0,
            self.worst_values.1,
        )?;
        if self.non_finite > 0 {
            write!(f, "; {} non-finite elements", self.non_finite)?;
        }
        Ok(())
    }
}

/// Compares two tensors of the same shape (any float or integer dtype; computed in f64).
pub fn diff(actual: &Tensor, expected: &Tensor) -> Result<Diff> {
    if actual.dims() != expected.dims() {
        return Err(Error::Input(format!(
            "shape {:?} vs expected {:?}",
            actual.dims(),
            expected.dims()
        )));
    }
    let a: Vec<f64> = actual.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let e: Vec<f64> = expected.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let mut out = Diff {
        max_abs: 0.0,
        scale: 0.0,
        worst_index: vec![0; actual.rank()],
        worst_values: (0.0, 0.0),
        non_finite: 0,
        count: a.len(),
    };
    let mut worst = None;
    for (i, (&x, &y)) in a.iter().zip(&e).enumerate() {
        if !x.is_finite() || !y.is_finite() {
            out.non_finite += 1;
            worst.get_or_insert(i);
            continue;
        }
        out.scale = out.scale.max(y.abs());
        let d = (x - y).abs();
        if d > out.max_abs {
            out.max_abs = d;
            worst = Some(i);
        }
    }
    if let Some(i) = worst {
        out.worst_values = (a[i], e[i]);
        let mut rem = i;
        for (slot, &dim) in out.worst_index.iter_mut().zip(actual.dims()).rev() {
            *slot = rem % dim;
            rem /= dim;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn reports_worst_element_and_scale() {
        let e = Tensor::new(&[[1f32, -4.0], [2.0, 0.5]], &Device::Cpu).unwrap();
        let a = Tensor::new(&[[1f32, -4.0], [2.5, 0.5]], &Device::Cpu).unwrap();
        let d = diff(&a, &e).unwrap();
        assert_eq!(d.worst_index, vec![1, 0]);
        assert_eq!(d.max_abs, 0.5);
        assert_eq!(d.scale, 4.0);
        assert!(d.within(0.0, 0.125) && !d.within(0.0, 0.12));
        let nan = Tensor::new(&[[1f32, f32::NAN], [2.0, 0.5]], &Device::Cpu).unwrap();
        let d = diff(&nan, &e).unwrap();
        assert_eq!(d.non_finite, 1);
        assert!(!d.within(1.0, 1.0));
    }
}
