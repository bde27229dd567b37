//! Property tests: the comparison functions fed tensors with NaN, ±∞ and subnormals at random places always end in a
//! finding (counted, the first located, the check failed), never a panic nor a pass.

use candle_core::{Device, Tensor};
use parity::compare::{DeviceReport, Side, Thresholds, compare_runs};
use parity::metrics::{TensorError, TokenAgreement, percentile, top_k};
use parity::non_finite::NonFinite;
use proptest::prelude::*;
use reference::backend::{Precision, RunRecord};
use reference::config::LayerKind;
use std::collections::BTreeMap;

/// A value to plant: NaN, ±∞, a subnormal or a normal number.
fn special() -> impl Strategy<Value = f32> {
    prop_oneof![
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        Just(f32::MIN_POSITIVE / 4.0),
        Just(-f32::MIN_POSITIVE / 1024.0),
        -4.0f32..4.0,
    ]
}

/// Clean values and the places and values planted in them.
fn planted(len: usize) -> impl Strategy<Value = (Vec<f32>, Vec<(usize, f32)>)> {
    (
        proptest::collection::vec(-3.0f32..3.0, len),
        proptest::collection::vec((0..len, special()), 0..6),
    )
}

fn apply(clean: &[f32], plants: &[(usize, f32)]) -> Vec<f32> {
    let mut v = clean.to_vec();
    for &(i, x) in plants {
        v[i] = x;
    }
    v
}

fn wide(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn tensor_errors_count_and_locate_every_non_finite_value((clean, plants) in planted(48)) {
        let dirty = apply(&clean, &plants);
        let (a, b) = (wide(&dirty), wide(&clean));
        let e = TensorError::of_slices(&a, &b);
        let nan = dirty.iter().filter(|x| x.is_nan()).count();
        let inf = dirty.iter().filter(|x| x.is_infinite()).count();
        prop_assert_eq!((e.nan, e.inf), (nan, inf));
        let first = dirty.iter().position(|x| !x.is_finite());
        let found = NonFinite::of_values("layers.0.output", &[6, 8], &a);
        prop_assert_eq!(found.as_ref().map(|f| f.first[0] * 8 + f.first[1]), first);
        if first.is_some() {
            prop_assert!(!e.finite());
            prop_assert!(!e.nrmse.is_defined() && !e.nmse.is_defined() && !e.cosine.is_defined());
        } else {
            prop_assert!(e.finite() && e.nrmse.get().is_finite());
        }
        let p99 = percentile(&a, 0.99);
        if dirty.iter().any(|x| x.is_nan()) {
            prop_assert!(p99.is_nan());
        } else if first.is_none() {
            prop_assert!(p99.is_finite());
        }
    }

    #[test]
    fn token_agreement_never_panics_and_a_non_finite_row_never_agrees((clean, plants) in planted(32)) {
        let dirty = wide(&apply(&clean, &plants));
        let reference = wide(&clean);
        let a = TokenAgreement::of(&dirty, &reference, &[0, 3]);
        let bad = dirty.iter().filter(|x| !x.is_finite()).count();
        prop_assert_eq!(a.non_finite, bad);
        if bad > 0 {
            prop_assert!(!a.same_top());
            prop_assert!(a.eos_p.1.is_nan());
        }
        // The reverse: a reference row with non-finite values.
        let r = TokenAgreement::of(&reference, &dirty, &[0]);
        prop_assert_eq!(r.ref_non_finite, bad);
        prop_assert!(bad == 0 || !r.same_top());
        let top = top_k(&dirty, 5);
        prop_assert_eq!(top.len(), 5);
        let mut sorted = top.clone();
        sorted.sort();
        sorted.dedup();
        prop_assert_eq!(sorted.len(), 5);
        // No NaN outranks a number.
        if let Some(first_nan) = top.iter().position(|&i| dirty[i].is_nan()) {
            prop_assert!(top[first_nan..].iter().all(|&i| dirty[i].is_nan()));
        }
    }

    #[test]
    fn a_run_with_a_planted_value_fails_its_report((clean, plants) in planted(4 * 16), layer in 0usize..2) {
        let dev = Device::Cpu;
        let t = |v: Vec<f32>| Tensor::from_vec(v, (4, 16), &dev).unwrap();
        let dirty = apply(&clean, &plants);
        let non_finite = dirty.iter().any(|x| !x.is_finite());
        let name = format!("layers.{layer}.output");
        let mut ref_taps = BTreeMap::new();
        let mut dev_taps = BTreeMap::new();
        for l in 0..2 {
            let n = format!("layers.{l}.output");
            ref_taps.insert(n.clone(), t(clean.clone()));
            dev_taps.insert(n, t(clean.clone()));
        }
        dev_taps.insert(name.clone(), t(dirty.clone()));
        // Logits [4, 16]: the planted values in the logits too, on the second run.
        let logits = t(clean.clone());
        let states = BTreeMap::new();
        for dirty_logits in [false, true] {
            let dev_logits = if dirty_logits { t(dirty.clone()) } else { logits.clone() };
            let c = compare_runs(
                "p",
                &[Some(LayerKind::Linear), Some(LayerKind::Linear)],
                Side { prompt_tokens: 5, tokens: &[], logits: &logits, taps: &ref_taps, states: &states },
                Side { prompt_tokens: 5, tokens: &[], logits: &dev_logits, taps: &dev_taps, states: &states },
                &[1],
            ).unwrap();
            let report = DeviceReport::new(
                "d",
                RunRecord::default(),
                Thresholds::for_precision(&Precision::F32),
                vec![c],
            );
            if non_finite {
                prop_assert!(!report.passed());
                let first = &report.first_non_finite.as_ref().unwrap().first;
                prop_assert_eq!(&first.name, &name, "the layer comes before the logits");
                prop_assert!(serde_json::to_string(&report).is_ok());
            } else {
                prop_assert!(report.first_non_finite.is_none());
            }
        }
    }
}
