//! Comparisons slice by slice (per head, per row), each slice against its own scale, and the slicing of every tap
//! and state of a run.

use super::{Diff, epsilon, flat_pair, unravel};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::taps::names;
use candle_core::Tensor;
use std::fmt;

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
    /// The whole tensor's comparison (the measure [`super::diff`] gives).
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
        if self.whole.non_finite > 0 {
            return write!(
                f,
                "undefined: {} of {} elements non-finite, the first in {} {i} of {n} (axis {}) at {:?}: {} vs {}",
                self.whole.non_finite,
                self.whole.count,
                self.what,
                self.axis,
                d.worst_index,
                d.worst_values.0,
                d.worst_values.1
            );
        }
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
        if d.non_finite > 0 {
            // Unbounded at a NaN or infinity, never the finite part's largest error.
            d.max_abs = f64::INFINITY;
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
