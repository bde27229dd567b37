//! Tensor comparison with a labelled report: the worst element, its index, and the error relative to the expected
//! tensor's largest magnitude (the measure every parity figure of this project uses).
//!
//! A tolerance relative to the whole tensor's largest value hides small heads: a DeltaNet head whose log-decays are
//! 1e-5 sits beside one whose are 5, and 1e-4 of the tensor's max is ten times the small head's values. So
//! [`diff_slices`] measures each slice along an axis (a head, a row) against its own largest magnitude, and
//! [`slicing`] says along which axis each tap and state of a run is compared.

mod families;
mod slices;

pub use families::WorstByFamily;
pub use slices::{SliceDiff, Slicing, diff_sliced, diff_slices, slicing};

use crate::error::{Error, Result};
use candle_core::{DType, Tensor};
use std::fmt;

/// How far `actual` is from `expected`.
#[derive(Debug, Clone, PartialEq)]
pub struct Diff {
    /// Largest `|actual − expected|`; infinite when an element is NaN or infinite on either side (the error there
    /// is unbounded: never the largest over the finite part alone, which would look fine).
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
    /// Whether the comparison measured anything: some elements compared, every one finite on both sides.
    pub fn defined(&self) -> bool {
        self.count > 0 && self.non_finite == 0
    }

    /// `max_abs / scale` (`max_abs` itself when the expected tensor is all zeros); infinite when an element is
    /// non-finite, and when nothing was compared.
    pub fn relative(&self) -> f64 {
        if !self.defined() {
            f64::INFINITY
        } else if self.scale > 0.0 {
            self.max_abs / self.scale
        } else {
            self.max_abs
        }
    }

    /// Whether something was compared, every element is finite and `max_abs <= atol + rtol * scale`.
    pub fn within(&self, atol: f64, rtol: f64) -> bool {
        self.defined() && self.max_abs <= atol + rtol * self.scale
    }
}

impl fmt::Display for Diff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.count == 0 {
            return write!(f, "undefined: nothing compared (no elements)");
        }
        if self.non_finite > 0 {
            return write!(
                f,
                "undefined: {} of {} elements non-finite, the first at {:?}: {} vs {}",
                self.non_finite,
                self.count,
                self.worst_index,
                self.worst_values.0,
                self.worst_values.1
            );
        }
        write!(
            f,
            "max |diff| {:.3e} ({:.3e} of max |expected| {:.3e}) at {:?}: {} vs {}",
            self.max_abs,
            self.relative(),
            self.scale,
            self.worst_index,
            self.worst_values.0,
            self.worst_values.1,
        )
    }
}

/// Both tensors as flat f64 vectors, after checking that their shapes agree.
pub(crate) fn flat_pair(actual: &Tensor, expected: &Tensor) -> Result<(Vec<f64>, Vec<f64>)> {
    if actual.dims() != expected.dims() {
        return Err(Error::Input(format!(
            "shape {:?} vs expected {:?}",
            actual.dims(),
            expected.dims()
        )));
    }
    let a = actual.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let e = expected.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    Ok((a, e))
}

/// The multi-index of flat (row-major) position `i` in a tensor of shape `dims`.
pub(crate) fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut index = vec![0; dims.len()];
    for (slot, &dim) in index.iter_mut().zip(dims).rev() {
        *slot = i % dim;
        i /= dim;
    }
    index
}

/// Compares two tensors of the same shape (any float or integer dtype; computed in f64).
pub fn diff(actual: &Tensor, expected: &Tensor) -> Result<Diff> {
    let (a, e) = flat_pair(actual, expected)?;
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
        out.worst_index = unravel(i, actual.dims());
    }
    if out.non_finite > 0 {
        out.max_abs = f64::INFINITY;
    }
    Ok(out)
}

/// Machine epsilon of a dtype (the gap between 1 and the next number): f64 2.2e-16, f32 1.19e-7, f16 9.8e-4,
/// bf16 7.8e-3; 0 for integer types, which are exact, and for a dtype this version does not know (no floor: the
/// strict choice).
pub fn epsilon(dtype: DType) -> f64 {
    match dtype {
        DType::U8 | DType::U32 | DType::I16 | DType::I32 | DType::I64 => 0.0,
        DType::F64 => f64::EPSILON,
        DType::F32 => f32::EPSILON as f64,
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        DType::F8E4M3 | DType::F6E2M3 => 2f64.powi(-3),
        DType::F6E3M2 => 2f64.powi(-2),
        DType::F4 => 2f64.powi(-1),
        DType::F8E8M0 => 1.0,
        _ => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
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
        assert!(!d.within(1.0, 1.0) && !d.defined());
        assert_eq!((d.max_abs, d.relative()), (f64::INFINITY, f64::INFINITY));
        assert_eq!(d.worst_index, vec![0, 1]);
        assert!(d.to_string().starts_with("undefined: 1 of 4"), "{d}");
        // Nothing compared is no agreement either.
        let empty = Tensor::zeros((0, 3), DType::F32, &Device::Cpu).unwrap();
        let d = diff(&empty, &empty).unwrap();
        assert!(!d.defined() && !d.within(1.0, 1.0), "{d}");
        assert!(
            d.to_string().starts_with("undefined: nothing compared"),
            "{d}"
        );
    }

    /// `[T = 2, H = 3]`: head 0 tiny, head 1 large, head 2 exactly zero.
    fn heads() -> Tensor {
        Tensor::new(&[[5e-5f32, 4.0, 0.0], [-2e-5, -5.0, 0.0]], &Device::Cpu).unwrap()
    }

    #[test]
    fn a_small_head_is_measured_against_itself() {
        let e = heads();
        // Head 0 off by a relative 1e-3: nothing at the whole tensor's scale, everything at the head's.
        let a = Tensor::new(&[[5.005e-5f32, 4.0, 0.0], [-2e-5, -5.0, 0.0]], &Device::Cpu).unwrap();
        assert!(diff(&a, &e).unwrap().within(0.0, 1e-4));
        let d = diff_slices(&a, &e, 1).unwrap().named("head");
        assert_eq!(d.slices.len(), 3);
        assert_eq!(d.worst(), Some(0));
        assert!((d.relative() - 1e-3).abs() < 1e-5, "{d}");
        assert!(!d.within(1e-4) && d.within(2e-3));
        assert_eq!(d.slices[0].worst_index, vec![0, 0]);
        assert_eq!(d.slices[0].scale, 5e-5f32 as f64);
        assert_eq!(d.whole.scale, 5.0);
        let text = d.to_string();
        assert!(text.starts_with("worst head 0 of 3 (axis 1)"), "{text}");
        // Along the other axis, token 0 holds the error, measured against token 0's max.
        let rows = diff_slices(&a, &e, 0).unwrap();
        assert_eq!(rows.worst(), Some(0));
        assert!(rows.within(1e-4));
    }

    #[test]
    fn zero_and_tiny_slices_fall_back_to_the_floor() {
        let e = heads();
        let d = diff_slices(&e, &e, 1).unwrap();
        assert_eq!(d.epsilon, f32::EPSILON as f64);
        assert_eq!(d.floor(), 5.0 * f32::EPSILON as f64);
        assert!(d.under_floor(2) && !d.under_floor(0));
        assert_eq!(d.relative(), 0.0);
        assert!(d.within(0.0));
        // Noise in the zero head is measured against the floor: a thousandth of a rounding unit at the tensor's
        // scale passes at 1e-2, a whole unit fails at 1e-4.
        let unit = 5.0 * f32::EPSILON;
        let noisy =
            |x: f32| Tensor::new(&[[5e-5f32, 4.0, x], [-2e-5, -5.0, 0.0]], &Device::Cpu).unwrap();
        let d = diff_slices(&noisy(unit * 1e-3), &e, 1).unwrap();
        assert!(d.within(1e-2) && !d.within(1e-4), "{d}");
        let d = diff_slices(&noisy(unit), &e, 1).unwrap();
        assert_eq!(d.worst(), Some(2));
        assert!((d.relative() - 1.0).abs() < 1e-6, "{d}");
        assert!(d.to_string().contains("under the floor"), "{d}");
        // A coarser precision raises the floor.
        let d = d.with_epsilon(epsilon(DType::F16));
        assert!(d.relative() < 2e-4, "{d}");
        // An all-zero expected tensor has no floor: any error is infinitely large.
        let zero = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
        let one = Tensor::new(&[[0f32, 1e-30], [0.0, 0.0]], &Device::Cpu).unwrap();
        assert!(diff_slices(&zero, &zero, 0).unwrap().within(0.0));
        assert!(!diff_slices(&one, &zero, 0).unwrap().within(1e10));
    }

    #[test]
    fn non_finite_slices_are_the_worst() {
        let e = heads();
        let a = Tensor::new(
            &[[5e-5f32, 4.5, 0.0], [-2e-5, -5.0, f32::NAN]],
            &Device::Cpu,
        )
        .unwrap();
        let d = diff_slices(&a, &e, 1).unwrap();
        assert_eq!(d.worst(), Some(2));
        assert_eq!(d.slices[2].worst_index, vec![1, 2]);
        assert_eq!(d.whole.non_finite, 1);
        // Unbounded, never the finite part's 0.5.
        assert_eq!(d.whole.max_abs, f64::INFINITY);
        assert_eq!(d.whole.relative(), f64::INFINITY);
        assert!(!d.within(1.0));
        let text = d.to_string();
        assert!(
            text.starts_with("undefined: 1 of 6 elements non-finite, the first in slice 2"),
            "{text}"
        );
        assert!(diff_slices(&a, &e, 2).is_err());
    }

    #[test]
    fn run_tensors_are_sliced_per_head() {
        let config = Config::from_json_str(
            &crate::synthetic::small_config_json().to_string(),
            "config.json",
        )
        .unwrap();
        let heads = config.num_attention_heads;
        let d = config.head_dim;
        let s = slicing("layers.3.self_attn.gated_output", &config).unwrap();
        assert_eq!((s.axis, s.split_last), (1, Some(heads)));
        // [T = 2, Hq * D] with head 1 small and off by a relative 1e-3.
        let mut values = vec![1f32; 2 * heads * d];
        for t in 0..2 {
            for x in &mut values[t * heads * d + d..t * heads * d + 2 * d] {
                *x = 1e-4;
            }
        }
        let e = Tensor::from_vec(values.clone(), (2, heads * d), &Device::Cpu).unwrap();
        values[d + 3] *= 1.001;
        let a = Tensor::from_vec(values, (2, heads * d), &Device::Cpu).unwrap();
        let sd = diff_sliced("layers.3.self_attn.gated_output", &a, &e, &config)
            .unwrap()
            .unwrap();
        assert_eq!(sd.worst(), Some(1));
        assert_eq!(sd.slices[1].worst_index, vec![0, 1, 3]);
        assert!(!sd.within(1e-4) && sd.whole.within(0.0, 1e-4), "{sd}");
        assert_eq!(slicing("linear_attn.g", &config).unwrap().axis, 1);
        assert_eq!(
            slicing("layers.0.recurrent_state", &config).unwrap().axis,
            0
        );
        assert_eq!(
            slicing("layers.0.conv_state", &config).unwrap().what,
            "channel"
        );
        assert_eq!(
            slicing("layers.3.value_cache", &config).unwrap().what,
            "kv head"
        );
        assert!(slicing("layers.0.output", &config).is_none());
        assert!(slicing("logits", &config).is_none());
    }
}
