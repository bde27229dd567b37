//! The error and agreement measures of the reports, defined as the tools porters already read define them
//! (`../shared/docs/METRICS.md`): NMSE as llama.cpp's `test-backend-ops`, NRMSE as OpenVINO NPUW's accuracy check,
//! cosine similarity, KL divergence and same-top-token rates as `llama-perplexity --kl-divergence`, and the
//! free-running first divergent token with the reference's top-two margin there.
//!
//! Every measure is computed in f64, the second tensor (`expected`) being the reference.

use anyhow::{Result, bail};
use candle_core::{DType, Tensor};
use serde::Serialize;

mod measure;
pub use measure::{Measure, Percent, Why};

/// fp16's smallest normal magnitude, 2⁻¹⁴ ≈ 6.10e-5: below it an fp16 value loses precision (or is flushed).
pub const F16_MIN_NORMAL: f64 = 6.103_515_625e-5;

/// Whether `x` is above `max`, a NaN counting as above every bound (a check never passes on a NaN).
pub fn exceeds(x: f64, max: f64) -> bool {
    !matches!(
        x.partial_cmp(&max),
        Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
    )
}

/// Whether `x` is below `min`, a NaN counting as below every bound.
pub fn falls_short(x: f64, min: f64) -> bool {
    !matches!(
        x.partial_cmp(&min),
        Some(std::cmp::Ordering::Greater | std::cmp::Ordering::Equal)
    )
}

/// How far a tensor is from the reference. Every measure is a [`Measure`]: undefined (`null`) when no values were
/// compared or when either side holds a NaN or an infinity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TensorError {
    /// Largest `|a − b|`.
    pub max_abs: Measure,
    /// `Σ(a − b)² / Σb²` (llama.cpp's NMSE; 0 when both are zero, infinite when only the reference is).
    pub nmse: Measure,
    /// `RMSE / max(0.001, range(b), range(a))` (OpenVINO NPUW's NRMSE, `NPUW_ACC_THRESH` 0.01 by default).
    pub nrmse: Measure,
    /// `‖a − b‖ / ‖b‖` (= √NMSE).
    pub rel_l2: Measure,
    /// `a·b / (‖a‖ ‖b‖)` (1 when both are zero).
    pub cosine: Measure,
    /// Elements of `a` that are NaN.
    pub nan: usize,
    /// Elements of `a` that are infinite.
    pub inf: usize,
    /// Elements of the reference `b` that are NaN.
    pub ref_nan: usize,
    /// Elements of the reference `b` that are infinite.
    pub ref_inf: usize,
    /// Elements compared.
    pub count: usize,
    /// Why the measures are undefined (`null` when they are defined).
    pub undefined: Option<Why>,
}

impl TensorError {
    /// Compares `actual` with `expected` (same shape, any float dtype). Non-finite elements on either side are
    /// counted, and leave every measure undefined.
    pub fn of(actual: &Tensor, expected: &Tensor) -> Result<Self> {
        if actual.dims() != expected.dims() {
            bail!(
                "shape {:?} against the reference's {:?}",
                actual.dims(),
                expected.dims()
            );
        }
        let a = values(actual)?;
        let b = values(expected)?;
        Ok(Self::of_slices(&a, &b))
    }

    /// [`TensorError::of`] on flat values.
    pub fn of_slices(a: &[f64], b: &[f64]) -> Self {
        let why = Why::of_slices(a, b);
        let (mut max_abs, mut err2, mut ref2, mut act2, mut dot) = (0f64, 0f64, 0f64, 0f64, 0f64);
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        let (mut alo, mut ahi) = (f64::INFINITY, f64::NEG_INFINITY);
        let mut n = 0usize;
        for (&x, &y) in a.iter().zip(b) {
            n += 1;
            let d = x - y;
            max_abs = max_abs.max(d.abs());
            err2 += d * d;
            ref2 += y * y;
            act2 += x * x;
            dot += x * y;
            lo = lo.min(y);
            hi = hi.max(y);
            alo = alo.min(x);
            ahi = ahi.max(x);
        }
        let nmse = ratio(err2, ref2);
        let range = if n == 0 {
            0.0
        } else {
            (hi - lo).max(ahi - alo)
        };
        let rmse = if n == 0 {
            0.0
        } else {
            (err2 / n as f64).sqrt()
        };
        let cosine = if ref2 == 0.0 && act2 == 0.0 {
            1.0
        } else if ref2 == 0.0 || act2 == 0.0 {
            0.0
        } else {
            dot / (ref2.sqrt() * act2.sqrt())
        };
        // Over nothing, or over values holding NaN or infinity on either side, no measure is defined: each says why
        // (and every check over it fails), the counts say how many.
        let (nan, inf, ref_nan, ref_inf) = match why {
            Some(Why::NonFinite {
                nan,
                inf,
                ref_nan,
                ref_inf,
            }) => (nan, inf, ref_nan, ref_inf),
            _ => (0, 0, 0, 0),
        };
        TensorError {
            max_abs: Measure::of(max_abs, why),
            nmse: Measure::of(nmse, why),
            nrmse: Measure::of(rmse / range.max(0.001), why),
            rel_l2: Measure::of(nmse.sqrt(), why),
            cosine: Measure::of(cosine, why),
            nan,
            inf,
            ref_nan,
            ref_inf,
            count: a.len(),
            undefined: why,
        }
    }

    /// Whether every element on both sides was finite and at least one was compared (the measures are defined).
    pub fn finite(&self) -> bool {
        self.undefined.is_none()
    }

    /// NMSE in dB (`10·log10`), as model-conversion scripts print it.
    pub fn nmse_db(&self) -> Measure {
        self.nmse.map(|x| 10.0 * x.log10())
    }
}

/// `num / den`, 0 for 0/0 and infinity for x/0.
fn ratio(num: f64, den: f64) -> f64 {
    match (num == 0.0, den == 0.0) {
        (true, _) => 0.0,
        (false, true) => f64::INFINITY,
        (false, false) => num / den,
    }
}

/// A tensor's values, flat, in f64.
pub fn values(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?)
}

/// The error of every slice along `axis` (per head, per row): entry `i` compares `actual.index(axis, i)` with the
/// reference's. Small heads get their own scale this way, which a whole-tensor measure hides.
pub fn per_slice(actual: &Tensor, expected: &Tensor, axis: usize) -> Result<Vec<TensorError>> {
    if actual.dims() != expected.dims() {
        bail!(
            "shape {:?} against the reference's {:?}",
            actual.dims(),
            expected.dims()
        );
    }
    let n = actual.dim(axis)?;
    (0..n)
        .map(|i| {
            TensorError::of(
                &actual.narrow(axis, i, 1)?.contiguous()?,
                &expected.narrow(axis, i, 1)?.contiguous()?,
            )
        })
        .collect()
}

/// Magnitude statistics of one slice of a tensor (a head): its RMS and the share of its values that fp16 cannot
/// hold at full precision.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Magnitude {
    /// Root mean square.
    pub rms: f64,
    /// Largest magnitude.
    pub max_abs: f64,
    /// Share of the values with `0 < |x| < 2⁻¹⁴` (fp16 subnormals, flushed to zero by an NPU that flushes).
    pub below_f16_normal: f64,
}

impl Magnitude {
    /// The statistics of `x`.
    pub fn of(x: &[f64]) -> Self {
        let n = x.len().max(1) as f64;
        let rms = (x.iter().map(|v| v * v).sum::<f64>() / n).sqrt();
        let max_abs = nan_max(x.iter().map(|v| v.abs()));
        let small = x
            .iter()
            .filter(|v| **v != 0.0 && v.abs() < F16_MIN_NORMAL)
            .count();
        Magnitude {
            rms,
            max_abs,
            below_f16_normal: small as f64 / n,
        }
    }
}

/// [`Magnitude`] of every slice of `t` along `axis`.
pub fn magnitudes(t: &Tensor, axis: usize) -> Result<Vec<Magnitude>> {
    let n = t.dim(axis)?;
    (0..n)
        .map(|i| {
            Ok(Magnitude::of(&values(
                &t.narrow(axis, i, 1)?.contiguous()?,
            )?))
        })
        .collect()
}

/// The agreement of two next-token distributions (one position), the reference's first.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TokenAgreement {
    /// The reference's top token.
    pub ref_top: u32,
    /// The other side's top token.
    pub top: u32,
    /// The reference's margin between its two largest logits (a near tie when small).
    pub ref_margin: f64,
    /// `KL(P_ref ‖ P)` in nats: how much the other distribution loses on the reference's (llama.cpp's direction).
    pub kl: f64,
    /// Share of the reference's top 5 tokens among the other side's top 5.
    pub top5_overlap: f64,
    /// `P(ref_top) − P_ref(ref_top)`: llama.cpp's Δp.
    pub delta_p: f64,
    /// Probability of the end-of-sequence tokens under the reference, and under the other side.
    pub eos_p: (f64, f64),
    /// Logits of the other side that are NaN or infinite (a row with any chooses no token: it never agrees).
    pub non_finite: usize,
    /// Logits of the reference that are NaN or infinite (a dump given as the reference can hold them).
    pub ref_non_finite: usize,
}

impl TokenAgreement {
    /// Compares the logits `[V]` of one position; `eos` are the end-of-sequence ids.
    pub fn of(logits: &[f64], reference: &[f64], eos: &[u32]) -> Self {
        let p = log_softmax(logits);
        let q = log_softmax(reference);
        let kl = q
            .iter()
            .zip(&p)
            .map(|(&lq, &lp)| {
                let pq = lq.exp();
                if pq == 0.0 { 0.0 } else { pq * (lq - lp) }
            })
            .sum::<f64>();
        let kl = if kl.is_nan() { kl } else { kl.max(0.0) };
        let top_ref = top_k(reference, 5);
        let top = top_k(logits, 5);
        let overlap =
            top_ref.iter().filter(|i| top.contains(i)).count() as f64 / top_ref.len() as f64;
        let ref_top = top_ref[0];
        let second = top_k(reference, 2);
        let ref_margin = if second.len() > 1 {
            reference[second[0]] - reference[second[1]]
        } else {
            f64::INFINITY
        };
        // Undefined (NaN) on a side whose row is not all finite, even when no end-of-sequence id is known.
        let eos_p = |l: &[f64]| -> f64 {
            if l.iter().any(|x| !x.is_finite()) {
                return f64::NAN;
            }
            eos.iter()
                .filter_map(|&e| l.get(e as usize))
                .map(|x| x.exp())
                .sum()
        };
        // Over a row holding NaN or infinity on either side, no agreement measure is defined.
        let defined = Why::of_slices(logits, reference).is_none();
        let or_nan = |x: f64| if defined { x } else { f64::NAN };
        TokenAgreement {
            ref_top: ref_top as u32,
            top: top[0] as u32,
            ref_margin,
            kl: or_nan(kl),
            top5_overlap: or_nan(overlap),
            delta_p: or_nan(p[ref_top].exp() - q[ref_top].exp()),
            eos_p: (eos_p(&q), eos_p(&p)),
            non_finite: logits.iter().filter(|x| !x.is_finite()).count(),
            ref_non_finite: reference.iter().filter(|x| !x.is_finite()).count(),
        }
    }

    /// Whether both sides choose the same token (never when either row holds a non-finite logit).
    pub fn same_top(&self) -> bool {
        self.ref_top == self.top && self.non_finite == 0 && self.ref_non_finite == 0
    }
}

/// `log softmax(x)`, stable.
pub fn log_softmax(x: &[f64]) -> Vec<f64> {
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + x.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
    x.iter().map(|v| v - lse).collect()
}

/// Indices of the `k` largest values, largest first (lower index first on ties, as argmax). A NaN ranks below every
/// number (a total order: the sort never sees an inconsistent comparison), so it is never a top token while a
/// number is left; whether a row held one is for the caller to count ([`TokenAgreement::non_finite`]).
pub fn top_k(x: &[f64], k: usize) -> Vec<usize> {
    let key = |i: usize| {
        if x[i].is_nan() {
            f64::NEG_INFINITY
        } else {
            x[i]
        }
    };
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| {
        key(b)
            .total_cmp(&key(a))
            .then(x[a].is_nan().cmp(&x[b].is_nan()))
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx
}

/// The largest of `x`, 0 when empty, NaN when any is NaN (`f64::max` would drop it and report a number that looks
/// fine).
pub fn nan_max(x: impl IntoIterator<Item = f64>) -> f64 {
    x.into_iter().fold(0f64, |m, v| {
        if m.is_nan() || v.is_nan() {
            f64::NAN
        } else {
            m.max(v)
        }
    })
}

/// The largest `|a − b|` over two equally long slices: undefined (NaN, `null` in the JSON) over nothing or when
/// either side holds a NaN or an infinity, as every [`Measure`].
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    let max = nan_max(a.iter().zip(b).map(|(x, y)| (x - y).abs()));
    Measure::of(max, Why::of_slices(a, b)).get()
}

/// Percentile `q` (0..=1) of `x` by linear interpolation (NaN for an empty slice, or when any value is NaN).
pub fn percentile(x: &[f64], q: f64) -> f64 {
    if x.is_empty() || x.iter().any(|v| v.is_nan()) {
        return f64::NAN;
    }
    let mut v = x.to_vec();
    v.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    if v[lo] == v[hi] {
        // Equal ends (infinities included: ∞ − ∞ would make a NaN of a defined percentile).
        return v[lo];
    }
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// The mean of `x` (NaN for an empty slice).
pub fn mean(x: &[f64]) -> f64 {
    if x.is_empty() {
        f64::NAN
    } else {
        x.iter().sum::<f64>() / x.len() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn definitions_on_small_cases() {
        let e = TensorError::of_slices(&[1.0, 2.0, 4.0], &[1.0, 2.0, 3.0]);
        assert_eq!(e.max_abs.get(), 1.0);
        assert!((e.nmse.get() - 1.0 / 14.0).abs() < 1e-15);
        // RMSE 1/√3 over the larger range (actual: 3).
        assert!((e.nrmse.get() - (1.0f64 / 3.0).sqrt() / 3.0).abs() < 1e-15);
        assert!((e.rel_l2.get() - (1.0f64 / 14.0).sqrt()).abs() < 1e-15);
        let zero = TensorError::of_slices(&[0.0; 3], &[0.0; 3]);
        assert_eq!(
            (zero.nmse.get(), zero.cosine.get(), zero.nrmse.get()),
            (0.0, 1.0, 0.0)
        );
        let nan = TensorError::of_slices(&[f64::NAN, f64::INFINITY, 1.0], &[1.0, 1.0, 1.0]);
        assert_eq!((nan.nan, nan.inf), (1, 1));
        assert!(!nan.finite() && !nan.nmse.is_defined() && !nan.max_abs.is_defined());
        assert!(exceeds(nan.nrmse.get(), 1.0) && !exceeds(0.5, 1.0) && falls_short(f64::NAN, 0.0));
    }

    /// Every measure over values holding a NaN or an infinity on either side, or over nothing, is undefined and
    /// says why; over finite values, every one is defined.
    #[test]
    fn undefined_over_non_finite_or_nothing() {
        use proptest::prelude::*;
        let value = prop_oneof![
            6 => -1e3f64..1e3,
            1 => Just(f64::NAN),
            1 => Just(f64::INFINITY),
            1 => Just(f64::NEG_INFINITY),
            1 => Just(0.0),
        ];
        let pairs = (0usize..12).prop_flat_map(move |n| {
            (
                proptest::collection::vec(value.clone(), n),
                proptest::collection::vec(value.clone(), n),
            )
        });
        proptest!(ProptestConfig::with_cases(400), |((a, b) in pairs)| {
            let e = TensorError::of_slices(&a, &b);
            let all = [e.max_abs, e.nmse, e.nrmse, e.rel_l2, e.cosine];
            let finite = !a.is_empty() && a.iter().chain(&b).all(|x| x.is_finite());
            prop_assert_eq!(e.finite(), finite);
            // Over finite values, NMSE (and √NMSE) against an all-zero reference is a division by zero: undefined
            // too; every other measure is defined.
            let err2: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
            let by_zero = b.iter().all(|y| *y == 0.0) && err2 != 0.0;
            let defined = [finite, finite && !by_zero, finite, finite && !by_zero, finite];
            let json = serde_json::to_value(e).unwrap();
            for (i, k) in ["max_abs", "nmse", "nrmse", "rel_l2", "cosine"].iter().enumerate() {
                prop_assert_eq!(all[i].is_defined(), defined[i], "{}: {:?}", k, e);
                prop_assert_eq!(json[k].is_null(), !defined[i], "{}: {}", k, json);
            }
            prop_assert_eq!(json["undefined"].is_null(), finite);
            if !finite {
                let text = format!("{:.2e}", e.max_abs);
                prop_assert!(text.starts_with("undefined ("), "{}", text);
            }
        });
        let empty = TensorError::of_slices(&[], &[]);
        assert_eq!(empty.undefined, Some(Why::Empty));
        assert_eq!(
            format!("{}", empty.cosine),
            "undefined (no values compared)"
        );
        let nan = TensorError::of_slices(&[f64::NAN; 3], &[1.0; 3]);
        assert_eq!(
            format!("{:.1e}", nan.nmse),
            "undefined (3 NaN on the device side)"
        );
        let reference = TensorError::of_slices(&[1.0; 2], &[f64::INFINITY, 1.0]);
        assert_eq!((reference.ref_inf, reference.inf), (1, 0));
        assert!(!reference.finite());
    }

    #[test]
    fn kl_and_tops() {
        let same = TokenAgreement::of(&[1.0, 3.0, 2.0], &[1.0, 3.0, 2.0], &[0]);
        assert_eq!(same.kl, 0.0);
        assert!(same.same_top() && same.top5_overlap == 1.0 && same.delta_p == 0.0);
        assert_eq!(same.ref_margin, 1.0);
        assert!(
            TokenAgreement::of(&[f64::NAN, 0.0, 0.0], &[1.0, 3.0, 2.0], &[0])
                .kl
                .is_nan()
        );
        let swapped = TokenAgreement::of(&[1.0, 2.0, 3.0], &[1.0, 3.0, 2.0], &[0]);
        assert!(!swapped.same_top() && swapped.kl > 0.0 && swapped.delta_p < 0.0);
        // KL(P_ref || P) by hand for two tokens.
        let (p, q) = ([0.0f64, 0.0], [0.0f64, 2f64.ln()]); // P uniform, P_ref = (1/3, 2/3)
        let kl = TokenAgreement::of(&p, &q, &[]).kl;
        let expected =
            (1.0 / 3.0) * ((1.0f64 / 3.0) / 0.5).ln() + (2.0 / 3.0) * ((2.0f64 / 3.0) / 0.5).ln();
        assert!((kl - expected).abs() < 1e-12);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.5), 2.0);
        assert_eq!(top_k(&[1.0, 5.0, 5.0, 0.0], 2), vec![1, 2]);
        // NaN ranks last; all-NaN rows never agree.
        assert_eq!(top_k(&[f64::NAN, 2.0, f64::NAN, 3.0], 3), vec![3, 1, 0]);
        let nan_row = TokenAgreement::of(&[f64::NAN; 3], &[3.0, 1.0, 2.0], &[0]);
        assert!(!nan_row.same_top() && nan_row.non_finite == 3 && nan_row.kl.is_nan());
        assert!(nan_max([1.0, f64::NAN, 3.0]).is_nan() && nan_max([1.0, 3.0]) == 3.0);
        assert!(percentile(&[1.0, f64::NAN], 0.5).is_nan());
        assert!(max_abs_diff(&[1.0, f64::NAN], &[1.0, 1.0]).is_nan());
    }
}
