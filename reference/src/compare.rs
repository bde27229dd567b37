//! Tensor comparison with a labelled report: the worst element, its index, and the error relative to the expected
//! tensor's largest magnitude (the measure every parity figure of this project uses).
//!
//! A tolerance relative to the whole tensor's largest value hides small heads: a DeltaNet head whose log-decays are
//! 1e-5 sits beside one whose are 5, and 1e-4 of the tensor's max is ten times the small head's values. So
//! [`diff_slices`] measures each slice along an axis (a head, a row) against its own largest magnitude, and
//! [`slicing`] says along which axis each tap and state of a run is compared.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::taps::names;
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

/// Both tensors as flat f64 vectors, after checking that their shapes agree.
fn flat_pair(actual: &Tensor, expected: &Tensor) -> Result<(Vec<f64>, Vec<f64>)> {
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
fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
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

/// How far `actual` is from `expected`, slice by slice along one axis (per head, per row).
///
/// Each slice is measured against its own largest magnitude: `max |a − e|` over the slice divided by `max |e|` over
/// the slice, so a head whose values are 1e-5 gets the same relative scrutiny as one whose values are 5.
///
/// **Zero and tiny slices.** A slice whose largest magnitude is under the floor `F = ε · S` (`S` the whole expected
/// tensor's largest magnitude, `ε` the [`epsilon`] of the coarser of the two dtypes: 1.19e-7 for f32) is measured
/// against `F` instead: an all-zero slice (a padded head, an unwritten cache row) then has a defined measure, and
/// passes a check at `rtol` only if its error is under `rtol · ε · S`, that is if it is as (practically) exactly zero
/// as the expected slice. The floor is deliberately that low: it only keeps the measure defined and never hides an
/// error larger than a fraction of one rounding unit at the tensor's scale. A slice that legitimately carries
/// absolute rounding noise above that (tiny values computed from terms of the tensor's scale that cancel) fails the
/// check and is reported as under the floor; such a tensor's noise must be explained, not tolerated here. Slices
/// under the floor are counted in the report. When the whole expected tensor is zero the floor is zero, and any
/// error in it is an infinite relative error.
///
/// Data computed in a coarser precision than it is stored in (an fp16 device's dump, stored as f32) should set the
/// precision it was computed in with [`SliceDiff::with_epsilon`].
#[derive(Debug, Clone, PartialEq)]
pub struct SliceDiff {
    /// The axis the slices are taken along.
    pub axis: usize,
    /// What one slice is, for the report (`head`, `row`, ...).
    pub what: &'static str,
    /// One comparison per index along the axis, each against its own slice's scale (indices are of the whole
    /// tensor as compared).
    pub slices: Vec<Diff>,
    /// The whole tensor's comparison (the measure [`diff`] gives).
    pub whole: Diff,
    /// The precision the floor is taken from (see the type's documentation).
    pub epsilon: f64,
}

impl SliceDiff {
    /// The floor `ε · S` under which a slice is measured against `F` instead of its own largest magnitude.
    pub fn floor(&self) -> f64 {
        self.epsilon * self.whole.scale
    }

    /// The same comparison with the floor taken from another precision (e.g. [`epsilon`]`(DType::F16)` for data an
    /// fp16 device computed).
    pub fn with_epsilon(mut self, epsilon: f64) -> Self {
        self.epsilon = epsilon;
        self
    }

    /// The same comparison, its slices called `what` in the report.
    pub fn named(mut self, what: &'static str) -> Self {
        self.what = what;
        self
    }

    /// Whether slice `i`'s largest magnitude is under the floor.
    pub fn under_floor(&self, i: usize) -> bool {
        self.slices[i].scale < self.floor()
    }

    /// Slice `i`'s error relative to its largest magnitude, or to the floor when that is larger; infinite for a
    /// non-finite element, or for an error in a slice whose measure is zero.
    pub fn slice_relative(&self, i: usize) -> f64 {
        let d = &self.slices[i];
        let scale = d.scale.max(self.floor());
        if d.non_finite > 0 || (d.max_abs > 0.0 && scale == 0.0) {
            f64::INFINITY
        } else if d.max_abs == 0.0 {
            0.0
        } else {
            d.max_abs / scale
        }
    }

    /// The index of the slice with the largest relative error (`None` when the axis is empty).
    pub fn worst(&self) -> Option<usize> {
        (0..self.slices.len())
            .max_by(|&i, &j| self.slice_relative(i).total_cmp(&self.slice_relative(j)))
    }

    /// The worst slice's relative error.
    pub fn relative(&self) -> f64 {
        self.worst().map_or(0.0, |i| self.slice_relative(i))
    }

    /// Whether every slice's relative error is at most `rtol` (every element finite).
    pub fn within(&self, rtol: f64) -> bool {
        self.whole.non_finite == 0 && (0..self.slices.len()).all(|i| self.slice_relative(i) <= rtol)
    }
}

impl fmt::Display for SliceDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.slices.len();
        let Some(i) = self.worst() else {
            return write!(f, "no {}s along axis {}", self.what, self.axis);
        };
        let d = &self.slices[i];
        write!(
            f,
            "worst {} {i} of {n} (axis {}): max |diff| {:.3e} ({:.3e} of ",
            self.what,
            self.axis,
            d.max_abs,
            self.slice_relative(i)
        )?;
        if self.under_floor(i) {
            write!(
                f,
                "the floor {:.3e}, its own max |expected| {:.3e} being under it)",
                self.floor(),
                d.scale
            )?;
        } else {
            write!(f, "its max |expected| {:.3e})", d.scale)?;
        }
        write!(
            f,
            " at {:?}: {} vs {}; whole tensor {:.3e} of max |expected| {:.3e}",
            d.worst_index,
            d.worst_values.0,
            d.worst_values.1,
            self.whole.relative(),
            self.whole.scale
        )?;
        let under = (0..n).filter(|&j| self.under_floor(j)).count();
        if under > 0 {
            write!(
                f,
                "; {under} of {n} {}s under the floor {:.3e} (epsilon {:.2e} x max)",
                self.what,
                self.floor(),
                self.epsilon
            )?;
        }
        if self.whole.non_finite > 0 {
            write!(f, "; {} non-finite elements", self.whole.non_finite)?;
        }
        Ok(())
    }
}

/// Compares two tensors of the same shape slice by slice along `axis` (see [`SliceDiff`]); slices are called
/// `slice` in the report until [`SliceDiff::named`].
pub fn diff_slices(actual: &Tensor, expected: &Tensor, axis: usize) -> Result<SliceDiff> {
    let dims = actual.dims().to_vec();
    if axis >= dims.len() {
        return Err(Error::Input(format!(
            "axis {axis} of a tensor of shape {dims:?}"
        )));
    }
    let (a, e) = flat_pair(actual, expected)?;
    let n = dims[axis];
    let inner: usize = dims[axis + 1..].iter().product();
    let empty = Diff {
        max_abs: 0.0,
        scale: 0.0,
        worst_index: vec![0; dims.len()],
        worst_values: (0.0, 0.0),
        non_finite: 0,
        count: 0,
    };
    let mut slices = vec![empty.clone(); n];
    let mut worst: Vec<Option<usize>> = vec![None; n];
    for (i, (&x, &y)) in a.iter().zip(&e).enumerate() {
        let s = (i / inner) % n;
        let d = &mut slices[s];
        d.count += 1;
        if !x.is_finite() || !y.is_finite() {
            if d.non_finite == 0 {
                worst[s] = Some(i);
            }
            d.non_finite += 1;
            continue;
        }
        d.scale = d.scale.max(y.abs());
        let diff = (x - y).abs();
        if diff > d.max_abs {
            d.max_abs = diff;
            if d.non_finite == 0 {
                worst[s] = Some(i);
            }
        }
    }
    for (d, w) in slices.iter_mut().zip(&worst) {
        if let Some(i) = *w {
            d.worst_values = (a[i], e[i]);
            d.worst_index = unravel(i, &dims);
        }
    }
    // The whole tensor: its worst element is the first slice's first non-finite one, else the largest error.
    let mut whole = empty;
    whole.count = a.len();
    for d in &slices {
        whole.scale = whole.scale.max(d.scale);
        whole.max_abs = whole.max_abs.max(d.max_abs);
        whole.non_finite += d.non_finite;
    }
    let pick = slices
        .iter()
        .find(|d| d.non_finite > 0)
        .or_else(|| slices.iter().max_by(|x, y| x.max_abs.total_cmp(&y.max_abs)));
    if let Some(d) = pick {
        whole.worst_index = d.worst_index.clone();
        whole.worst_values = d.worst_values;
    }
    Ok(SliceDiff {
        axis,
        what: "slice",
        slices,
        whole,
        epsilon: epsilon(actual.dtype()).max(epsilon(expected.dtype())),
    })
}

/// How a tensor of a run is compared slice by slice: along `axis`, after splitting the last dimension into
/// `split_last` equal parts when set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slicing {
    /// The axis of the (possibly split) tensor the slices are taken along.
    pub axis: usize,
    /// Split the last dimension `[…, H·D]` into `[…, H, D]` first, with `H` this.
    pub split_last: Option<usize>,
    /// What one slice is, for the report.
    pub what: &'static str,
}

impl Slicing {
    /// Compares `actual` with `expected` under this slicing.
    pub fn diff(&self, actual: &Tensor, expected: &Tensor) -> Result<SliceDiff> {
        let view = |t: &Tensor| -> Result<Tensor> {
            let Some(parts) = self.split_last else {
                return Ok(t.clone());
            };
            let mut dims = t.dims().to_vec();
            let last = dims.pop().unwrap_or(0);
            if parts == 0 || !last.is_multiple_of(parts) {
                return Err(Error::Input(format!(
                    "cannot split the last dimension of shape {:?} into {parts} {}s",
                    t.dims(),
                    self.what
                )));
            }
            dims.extend([parts, last / parts]);
            Ok(t.reshape(dims)?)
        };
        Ok(diff_slices(&view(actual)?, &view(expected)?, self.axis)?.named(self.what))
    }
}

/// The slicing under which a tap or state of a run is compared, by its name in the dump format (`layers.{i}.` may be
/// left off), or `None` for a tensor compared whole:
/// - `linear_attn.{qkv,conv_output}` `[T, C]`: per channel (axis 1); every other DeltaNet tap (`[T, H, D]` or
///   `[T, Hv]`): per head (axis 1);
/// - `self_attn.{query,key,value}` `[T, H, D]`: per head (axis 1); `self_attn.{gate,gated_output}` `[T, Hq·D]`:
///   viewed as `[T, Hq, D]`, per head;
/// - `recurrent_state` `[Hv, Dk, Dv]`: per value head (axis 0);
/// - `conv_state` `[C, K]`: per channel row (axis 0);
/// - `key_cache`, `value_cache` `[Hkv, T, D]`: per kv head (axis 0).
pub fn slicing(name: &str, config: &Config) -> Option<Slicing> {
    let tail = match name.strip_prefix("layers.") {
        Some(rest) => rest.split_once('.').map_or(rest, |(_, t)| t),
        None => name,
    };
    let along = |axis, what| {
        Some(Slicing {
            axis,
            split_last: None,
            what,
        })
    };
    let per_head_of_flat = |heads| {
        Some(Slicing {
            axis: 1,
            split_last: Some(heads),
            what: "head",
        })
    };
    if let Some(tap) = tail.strip_prefix(&format!("{}.", names::LINEAR_ATTN)) {
        return match tap {
            names::QKV | names::CONV_OUTPUT => along(1, "channel"),
            t if names::LINEAR_ATTN_TAPS.contains(&t) => along(1, "head"),
            _ => None,
        };
    }
    if let Some(tap) = tail.strip_prefix(&format!("{}.", names::SELF_ATTN)) {
        return match tap {
            names::QUERY | names::KEY | names::VALUE => along(1, "head"),
            names::GATE | names::GATED_OUTPUT => per_head_of_flat(config.num_attention_heads),
            _ => None,
        };
    }
    match tail {
        names::RECURRENT_STATE => along(0, "value head"),
        names::CONV_STATE => along(0, "channel"),
        names::KEY_CACHE | names::VALUE_CACHE => along(0, "kv head"),
        _ => None,
    }
}

/// Compares a tap or state of a run per slice under [`slicing`], or `None` for a tensor compared whole.
pub fn diff_sliced(
    name: &str,
    actual: &Tensor,
    expected: &Tensor,
    config: &Config,
) -> Result<Option<SliceDiff>> {
    slicing(name, config)
        .map(|s| s.diff(actual, expected))
        .transpose()
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
        assert_eq!(d.whole.max_abs, 0.5);
        assert!(!d.within(1.0));
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
