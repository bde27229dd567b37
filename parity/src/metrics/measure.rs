//! A measure over two tensors (an error, a similarity, a largest difference): defined only over at least one value
//! compared and only when every value on both sides is finite. Anything else is [`Measure::Undefined`], with why:
//! `null` in the JSON, `undefined (3 NaN on the device side)` in the text, and a failure in every check, never a
//! number that looks fine (`max_abs 0` over all-NaN tensors, `cosine 1` over nothing).

use serde::{Serialize, Serializer};
use std::fmt;

/// Why a measure is undefined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// No values were compared.
    Empty,
    /// The measure divides by zero (an NMSE against a reference that is all zero while the other side is not).
    DivisionByZero,
    /// Values of one tensor (a measure of one side, as a range) that are NaN or infinite.
    Values {
        /// NaN.
        nan: usize,
        /// Infinities.
        inf: usize,
    },
    /// Rows (positions of logits) holding NaN or infinity, on the side under test and on the reference's.
    Rows {
        /// Rows of the side under test.
        device: usize,
        /// Rows of the reference.
        reference: usize,
    },
    /// Values that are NaN or infinite, on the side under test and on the reference's.
    NonFinite {
        /// NaN on the side under test (the device).
        nan: usize,
        /// Infinities on the side under test.
        inf: usize,
        /// NaN on the reference side.
        ref_nan: usize,
        /// Infinities on the reference side.
        ref_inf: usize,
    },
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Why::Empty => write!(f, "no values compared"),
            Why::DivisionByZero => write!(f, "a division by zero: the reference is zero"),
            Why::Rows { device, reference } => {
                let parts: Vec<String> = [(device, "device"), (reference, "reference")]
                    .iter()
                    .filter(|(n, _)| *n > 0)
                    .map(|(n, side)| format!("{n} row(s) with NaN or Inf on the {side} side"))
                    .collect();
                write!(f, "{}", parts.join(", "))
            }
            Why::Values { nan, inf } => write!(f, "{nan} NaN / {inf} Inf among the values"),
            Why::NonFinite {
                nan,
                inf,
                ref_nan,
                ref_inf,
            } => {
                let side = |nan: usize, inf: usize, side: &str| -> Option<String> {
                    let mut parts = Vec::new();
                    if nan > 0 {
                        parts.push(format!("{nan} NaN"));
                    }
                    if inf > 0 {
                        parts.push(format!("{inf} Inf"));
                    }
                    (!parts.is_empty()).then(|| format!("{} on the {side} side", parts.join(" / ")))
                };
                let parts: Vec<String> = [
                    side(nan, inf, "device"),
                    side(ref_nan, ref_inf, "reference"),
                ]
                .into_iter()
                .flatten()
                .collect();
                if parts.is_empty() {
                    write!(f, "non-finite values")
                } else {
                    write!(f, "{}", parts.join(", "))
                }
            }
        }
    }
}

impl Serialize for Why {
    /// What [`fmt::Display`] says: `3 NaN on the device side`, `no values compared`.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl Why {
    /// Why a measure over `a` (under test) and `b` (the reference) is undefined, or `None` when it is defined.
    pub fn of_slices(a: &[f64], b: &[f64]) -> Option<Why> {
        let count = |x: &[f64]| {
            (
                x.iter().filter(|v| v.is_nan()).count(),
                x.iter().filter(|v| v.is_infinite()).count(),
            )
        };
        let ((nan, inf), (ref_nan, ref_inf)) = (count(a), count(b));
        if nan + inf + ref_nan + ref_inf > 0 {
            Some(Why::NonFinite {
                nan,
                inf,
                ref_nan,
                ref_inf,
            })
        } else if a.is_empty() || b.is_empty() {
            Some(Why::Empty)
        } else {
            None
        }
    }
}

/// A measure that is undefined unless it is defined.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Measure {
    /// A number over finite values.
    Defined(f64),
    /// No number: why.
    Undefined(Why),
}

impl Measure {
    /// `x` unless `why` says the values it was computed from leave it undefined; a NaN or infinite `x` is undefined
    /// too (JSON has no number for it).
    pub fn of(x: f64, why: Option<Why>) -> Self {
        match why {
            Some(w) => Measure::Undefined(w),
            None if x.is_infinite() => Measure::Undefined(Why::DivisionByZero),
            None if x.is_nan() => Measure::Undefined(Why::NonFinite {
                nan: 0,
                inf: 0,
                ref_nan: 0,
                ref_inf: 0,
            }),
            None => Measure::Defined(x),
        }
    }

    /// The number, when defined.
    pub fn defined(&self) -> Option<f64> {
        match *self {
            Measure::Defined(x) => Some(x),
            Measure::Undefined(_) => None,
        }
    }

    /// Whether the measure is defined.
    pub fn is_defined(&self) -> bool {
        self.defined().is_some()
    }

    /// The number, NaN when undefined (for the bounds of [`super::exceeds`] and [`super::falls_short`], where a NaN
    /// fails every check).
    pub fn get(&self) -> f64 {
        self.defined().unwrap_or(f64::NAN)
    }

    /// Why it is undefined, if it is.
    pub fn why(&self) -> Option<Why> {
        match *self {
            Measure::Defined(_) => None,
            Measure::Undefined(w) => Some(w),
        }
    }

    /// `f` of the number, the same reason when undefined.
    pub fn map(self, f: impl FnOnce(f64) -> f64) -> Self {
        match self {
            Measure::Defined(x) => Measure::of(f(x), None),
            u => u,
        }
    }
}

impl Measure {
    /// The larger of two measures; undefined when either is (the first's reason first): a largest difference is
    /// never taken over a part of the values that leaves out the undefined one.
    pub fn worst(self, other: Measure) -> Measure {
        match (self, other) {
            (Measure::Defined(a), Measure::Defined(b)) => Measure::Defined(a.max(b)),
            (Measure::Undefined(w), _) | (_, Measure::Undefined(w)) => Measure::Undefined(w),
        }
    }

    /// The largest of some measures ([`Measure::worst`]: undefined when one is); `None` when there are none.
    pub fn worst_of(x: impl IntoIterator<Item = Measure>) -> Option<Measure> {
        x.into_iter().reduce(Measure::worst)
    }
}

impl Measure {
    /// The measure as a percentage for the text: `{:.1}` prints `97.5%`, or `undefined (why)` with no `%`.
    pub fn percent(self) -> Percent {
        Percent(self)
    }
}

/// A share printed as a percentage ([`Measure::percent`]).
#[derive(Debug, Clone, Copy)]
pub struct Percent(Measure);

impl fmt::Display for Percent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self.0 {
            Measure::Defined(x) => format!("{:.*}%", f.precision().unwrap_or(1), 100.0 * x),
            u => u.to_string(),
        };
        write!(f, "{text:>0$}", f.width().unwrap_or(0))
    }
}

impl Serialize for Measure {
    /// The number, or `null` when undefined.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.defined() {
            Some(x) => s.serialize_f64(x),
            None => s.serialize_none(),
        }
    }
}

/// The number as `f64` prints it (with the formatter's precision and flags), or `undefined (why)`.
macro_rules! forward {
    ($($trait:ident),*) => {$(
        impl fmt::$trait for Measure {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self {
                    Measure::Defined(x) => fmt::$trait::fmt(x, f),
                    Measure::Undefined(w) => write!(f, "undefined ({w})"),
                }
            }
        }
    )*};
}
forward!(Display, LowerExp);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undefined_unless_defined() {
        assert_eq!(Why::of_slices(&[], &[]), Some(Why::Empty));
        assert_eq!(Why::of_slices(&[1.0], &[2.0]), None);
        let w = Why::of_slices(
            &[f64::NAN, f64::NAN, f64::NAN, 1.0],
            &[1.0, f64::INFINITY, 1.0, 1.0],
        )
        .unwrap();
        assert_eq!(
            w.to_string(),
            "3 NaN on the device side, 1 Inf on the reference side"
        );
        let m = Measure::of(0.0, Some(w));
        assert_eq!(format!("{m:.2e}"), format!("undefined ({w})"));
        assert_eq!(serde_json::to_value(m).unwrap(), serde_json::Value::Null);
        assert!(m.get().is_nan() && !m.is_defined());
        let d = Measure::of(0.5, None);
        assert_eq!(format!("{d:.1e}"), "5.0e-1");
        assert_eq!(serde_json::to_value(d).unwrap(), serde_json::json!(0.5));
        assert!(!Measure::of(f64::NAN, None).is_defined());
        assert_eq!(Measure::of(4.0, None).map(f64::sqrt), Measure::Defined(2.0));
        assert_eq!(d.worst(Measure::Defined(0.25)), d);
        assert_eq!(d.worst(m), m);
        assert_eq!(m.worst(d), m);
        assert_eq!(format!("{:.1}", Measure::Defined(0.975).percent()), "97.5%");
        assert_eq!(
            format!("{:>6.0}", Measure::Defined(0.5).percent()),
            "   50%"
        );
        assert!(format!("{:.1}", m.percent()).starts_with("undefined ("));
        let rows = Why::Rows {
            device: 0,
            reference: 2,
        };
        assert_eq!(
            rows.to_string(),
            "2 row(s) with NaN or Inf on the reference side"
        );
    }
}
