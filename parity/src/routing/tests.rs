//! The routing report on constructed routings: agreement, order-only differences, near ties and confident flips,
//! stated bounds, flips downstream of others, and taps that cannot be routing.

use super::*;
use candle_core::{Device, Tensor};
use std::collections::BTreeMap;

/// Five experts, three per token: the reference's probabilities at one token, its 3rd and 4th 4e-5 apart.
const P: [f64; 5] = [0.4, 0.25, 0.15002, 0.14998, 0.05];

fn router(chosen: &[&[usize]], probs: Option<&[[f64; 5]]>) -> Router {
    Router {
        chosen: chosen.iter().map(|r| r.to_vec()).collect(),
        probabilities: probs.map(|p| p.iter().map(|r| r.to_vec()).collect()),
    }
}

fn layer(l: usize, reference: Router, device: Router) -> LayerSides {
    LayerSides {
        layer: l,
        reference,
        device,
        ..LayerSides::default()
    }
}

#[test]
fn identical_routing_agrees_everywhere() {
    let r = router(&[&[0, 1, 2], &[1, 0, 2]], Some(&[P, P]));
    let report = compare(
        "p",
        &[layer(0, r.clone(), r.clone()), layer(1, r.clone(), r)],
    )
    .unwrap();
    assert_eq!(report.pairs, 4);
    assert_eq!(report.same_set, 4);
    assert_eq!(report.same_order, 4);
    assert_eq!(report.set_agreement.get(), 1.0);
    assert_eq!(report.flip_count(), 0);
    assert_eq!(report.first_flip, None);
    assert_eq!(
        report.layers[1].router_error_max.map(|m| m.get()),
        Some(0.0)
    );
    assert_eq!(report.top_k, 3);
}

#[test]
fn an_order_only_difference_is_no_flip() {
    let reference = router(&[&[0, 1, 2]], Some(&[P]));
    let device = router(&[&[1, 0, 2]], Some(&[P]));
    let report = compare("p", &[layer(0, reference, device)]).unwrap();
    assert_eq!(report.same_set, 1);
    assert_eq!(report.same_order, 0);
    assert_eq!(report.order_only(), 1);
    assert_eq!(report.flip_count(), 0);
    assert_eq!(report.set_agreement.get(), 1.0);
}

#[test]
fn a_swap_within_twice_the_router_error_is_a_near_tie() {
    // The device moved the 3rd and 4th probabilities by 5e-5 each and swapped them: gap 4e-5 ≤ 2 × 5e-5.
    let mut q = P;
    (q[2], q[3]) = (0.14997, 0.15003);
    // A second token the reference chooses with a wide margin, 0.05.
    const R: [f64; 5] = [0.5, 0.2, 0.15, 0.1, 0.05];
    let reference = router(&[&[0, 1, 2], &[0, 1, 2]], Some(&[P, R]));
    let device = router(&[&[0, 1, 3], &[0, 1, 2]], Some(&[q, R]));
    let mut sides = layer(2, reference, device);
    sides.mlp_nrmse = Some(vec![Measure::Defined(3e-2), Measure::Defined(1e-4)]);
    let report = compare("p", &[sides]).unwrap();
    assert_eq!(report.flip_count(), 1);
    let f = &report.flips[0];
    assert_eq!((f.layer, f.token), (2, 0));
    assert_eq!(
        (f.experts_in.clone(), f.experts_out.clone()),
        (vec![3], vec![2])
    );
    assert!((f.reference_margin.unwrap() - 4e-5).abs() < 1e-12, "{f:?}");
    assert!((f.gap.unwrap() - 4e-5).abs() < 1e-12, "{f:?}");
    assert!(
        (f.router_error.unwrap().get() - 5e-5).abs() < 1e-12,
        "{f:?}"
    );
    assert_eq!(f.router_error_source, Some(ErrorSource::Measured));
    assert_eq!(f.class, FlipClass::NearTie);
    assert_eq!(report.near_tie_flips, 1);
    assert_eq!(report.confident_flips, 0);
    assert_eq!(
        report.first_flip.as_ref().map(|f| (f.layer, f.token)),
        Some((2, 0))
    );
    assert_eq!(report.first_confident, None);
    // The flip's cost against the token that agreed.
    assert_eq!(
        report.layers[0].mlp_nrmse_flipped.map(|m| m.get()),
        Some(3e-2)
    );
    assert_eq!(
        report.layers[0].mlp_nrmse_agreeing.map(|m| m.get()),
        Some(1e-4)
    );
    // The median margin of 4e-5 and 0.05; the router's own error is the larger of its two, 5e-5, well within it.
    let median = report.layers[0].margin_median.unwrap();
    assert!((median - (4e-5 + 0.05) / 2.0).abs() < 1e-12, "{median}");
    assert!((report.layers[0].router_error_independent.unwrap().get() - 5e-5).abs() < 1e-12);
    assert!(!f.router_off);
    assert_eq!(report.layers[0].router_off_flips, 0);
    assert_eq!(report.set_agreement.get(), 0.5);
}

#[test]
fn a_swap_the_router_error_cannot_explain_is_confident() {
    // The device's router output is the reference's (error 0), yet it took the 5th expert for the 1st: gap 0.35.
    let reference = router(&[&[0, 1, 2]], Some(&[P]));
    let device = router(&[&[4, 1, 2]], Some(&[P]));
    let report = compare("p", &[layer(1, reference, device)]).unwrap();
    let f = &report.flips[0];
    assert_eq!(f.class, FlipClass::Confident);
    assert!((f.gap.unwrap() - 0.35).abs() < 1e-12, "{f:?}");
    // The margin is the reference's alone: it says nothing of which experts were swapped.
    assert!((f.reference_margin.unwrap() - 4e-5).abs() < 1e-12, "{f:?}");
    assert_eq!(f.router_error.map(|m| m.get()), Some(0.0));
    assert_eq!(report.confident_flips, 1);
    assert_eq!(report.first_confident.as_ref().map(|f| f.layer), Some(1));
}

#[test]
fn a_near_tie_only_because_the_router_is_far_off_is_marked() {
    // The device's router moved the 1st expert's probability by 0.3 and took the 4th for it: gap 0.25 ≤ 2 × 0.3, a
    // near tie by the rule, but an error larger than any margin of the reference's (4e-5 and 0.05).
    let q = [0.1, 0.25, 0.15, 0.45, 0.05];
    const R: [f64; 5] = [0.5, 0.2, 0.15, 0.1, 0.05];
    let reference = router(&[&[0, 1, 2], &[0, 1, 2], &[0, 1, 2]], Some(&[P, R, R]));
    let device = router(&[&[3, 1, 2], &[0, 1, 2], &[0, 1, 2]], Some(&[q, R, R]));
    let report = compare("p", &[layer(0, reference, device)]).unwrap();
    let f = &report.flips[0];
    assert_eq!(f.class, FlipClass::NearTie);
    assert!(f.router_off, "{f:?}");
    assert_eq!(report.layers[0].router_off_flips, 1);
    assert!((report.layers[0].margin_median.unwrap() - 0.05).abs() < 1e-12);
}

#[test]
fn the_bound_is_twice_the_router_error_inclusive() {
    assert_eq!(classify(Some(2e-4), Some(1e-4), false), FlipClass::NearTie);
    assert_eq!(
        classify(Some(2.000001e-4), Some(1e-4), false),
        FlipClass::Confident
    );
    assert_eq!(
        classify(Some(1e-9), Some(f64::NAN), false),
        FlipClass::Confident
    );
    assert_eq!(
        classify(Some(f64::NAN), Some(1.0), false),
        FlipClass::Confident
    );
    assert_eq!(classify(Some(1e-9), Some(1.0), true), FlipClass::Confident);
    assert_eq!(classify(None, Some(1.0), false), FlipClass::Unclassified);
    assert_eq!(classify(Some(1e-9), None, false), FlipClass::Unclassified);
}

#[test]
fn without_the_devices_router_logits_a_stated_bound_classifies() {
    let reference = router(&[&[0, 1, 2]], Some(&[P]));
    let device = router(&[&[0, 1, 3]], None);
    let mut report = compare("p", &[layer(0, reference, device)]).unwrap();
    assert_eq!(report.flips[0].class, FlipClass::Unclassified);
    assert_eq!(report.unclassified_flips, 1);
    assert_eq!(report.layers[0].router_error_max, None);
    report.classify(Some(1e-4));
    assert_eq!(report.flips[0].class, FlipClass::NearTie);
    assert_eq!(
        report.flips[0].router_error_source,
        Some(ErrorSource::Stated)
    );
    assert_eq!(report.near_tie_flips, 1);
    report.classify(Some(1e-6));
    assert_eq!(report.flips[0].class, FlipClass::Confident);
    assert_eq!(report.confident_flips, 1);
    report.classify(None);
    assert_eq!(report.flips[0].class, FlipClass::Unclassified);
    // A stated error adds to a measured one: 0 + 0.06 covers the gap of 0.10002, 0 + 0.05 does not.
    let mut measured = compare(
        "p",
        &[layer(
            0,
            router(&[&[0, 1, 2]], Some(&[P])),
            router(&[&[0, 1, 4]], Some(&[P])),
        )],
    )
    .unwrap();
    measured.classify(Some(0.06));
    assert_eq!(measured.flips[0].class, FlipClass::NearTie);
    assert_eq!(
        measured.flips[0].router_error_source,
        Some(ErrorSource::MeasuredPlusStated)
    );
    measured.classify(Some(0.05));
    assert_eq!(measured.flips[0].class, FlipClass::Confident);
    assert_eq!(measured.flips[0].router_error.map(|m| m.get()), Some(0.05));
    measured.classify(None);
    assert_eq!(
        measured.flips[0].router_error_source,
        Some(ErrorSource::Measured)
    );
}

#[test]
fn without_the_references_router_logits_flips_stay_unclassified() {
    let mut report = compare(
        "p",
        &[layer(
            0,
            router(&[&[0, 1, 2]], None),
            router(&[&[0, 1, 3]], Some(&[P])),
        )],
    )
    .unwrap();
    report.classify(Some(1.0));
    assert_eq!(report.flips[0].gap, None);
    assert_eq!(report.flips[0].class, FlipClass::Unclassified);
}

#[test]
fn an_expert_chosen_twice_is_confident() {
    let report = compare(
        "p",
        &[layer(
            0,
            router(&[&[0, 1, 2]], Some(&[P])),
            router(&[&[0, 0, 1]], Some(&[P])),
        )],
    )
    .unwrap();
    let f = &report.flips[0];
    assert!(f.repeated);
    assert_eq!(
        (f.experts_in.clone(), f.experts_out.clone()),
        (vec![0], vec![2])
    );
    assert_eq!(f.class, FlipClass::Confident);
}

#[test]
fn a_flip_after_an_earlier_one_at_or_before_its_token_is_downstream() {
    let same = |n: usize| vec![vec![0, 1, 2]; n];
    let mut d0 = same(6);
    d0[2] = vec![0, 1, 3];
    let mut d1 = same(6);
    d1[1] = vec![0, 1, 3]; // before layer 0's flip: nothing upstream reaches it
    d1[4] = vec![0, 1, 3]; // after it: downstream
    let probs = Some(vec![P.to_vec(); 6]);
    let r = Router {
        chosen: same(6),
        probabilities: probs.clone(),
    };
    let sides = |l: usize, chosen: Vec<Vec<usize>>| {
        let mut s = layer(
            l,
            r.clone(),
            Router {
                chosen,
                probabilities: probs.clone(),
            },
        );
        s.input_nrmse = Some((0..6).map(|t| Measure::Defined(t as f64 * 1e-3)).collect());
        s
    };
    let report = compare("p", &[sides(0, d0), sides(1, d1)]).unwrap();
    let at: Vec<(usize, usize, Option<At>)> = report
        .flips
        .iter()
        .map(|f| (f.layer, f.token, f.upstream))
        .collect();
    assert_eq!(
        at,
        [
            (0, 2, None),
            (1, 1, None),
            (1, 4, Some(At { layer: 0, token: 2 }))
        ]
    );
    assert_eq!(report.downstream_flips, 1);
    assert_eq!(report.layers[1].downstream_flips, 1);
    assert_eq!(report.flips[2].input_nrmse.map(|m| m.get()), Some(4e-3));
    // The router's own error at layer 1 is measured on tokens 0 and 1 only (layer 0's flip at token 2 reaches the
    // rest): there the device's probabilities are the reference's.
    assert_eq!(
        report.layers[1].router_error_independent.map(|m| m.get()),
        Some(0.0)
    );
    let first = report.first_flip.unwrap();
    assert_eq!((first.layer, first.token), (0, 2));
    // These are confident: the router error is 0 while the gap is 4e-5.
    assert_eq!(report.confident_flips, 3);
}

#[test]
fn a_flip_reaches_only_what_the_run_fed_on() {
    // Layer 0 flips at token 2; layer 1 at tokens 3 and 5; blocks [0, 4) and [4, 6).
    let same = |n: usize| vec![vec![0, 1, 2]; n];
    let flipped = |at: &[usize]| {
        let mut d = same(6);
        for &t in at {
            d[t] = vec![0, 1, 3];
        }
        d
    };
    let probs = Some(vec![P.to_vec(); 6]);
    let sides = |l: usize, chosen: Vec<Vec<usize>>| {
        layer(
            l,
            Router {
                chosen: same(6),
                probabilities: probs.clone(),
            },
            Router {
                chosen,
                probabilities: probs.clone(),
            },
        )
    };
    let layers = [sides(0, flipped(&[2])), sides(1, flipped(&[3, 5]))];
    let upstream = |reach: Reach| -> Vec<Option<At>> {
        let report = compare_with("p", &layers, &reach).unwrap();
        assert_eq!(report.flip_count(), 3);
        report.flips[1..].iter().map(|f| f.upstream).collect()
    };
    let l0 = Some(At { layer: 0, token: 2 });
    assert_eq!(upstream(Reach::Chained), [l0, l0]);
    // The state given back at token 4: layer 0's flip reaches token 3 of its block, not token 5 of the next.
    assert_eq!(upstream(Reach::Blocks(vec![(0, 4), (4, 6)])), [l0, None]);
    assert_eq!(upstream(Reach::Isolated), [None, None]);
    // Isolated, the router's own error at layer 1 counts every token.
    let mut report = compare_with("p", &layers, &Reach::Isolated).unwrap();
    assert_eq!(report.downstream_flips, 0);
    report.retain_layers(&[1]);
    assert_eq!(
        (report.pairs, report.flip_count(), report.layers.len()),
        (6, 2, 1)
    );
    assert_eq!(report.first_flip.map(|f| (f.layer, f.token)), Some((1, 3)));
}

#[test]
fn prompts_merge_layer_by_layer() {
    let r = router(&[&[0, 1, 2], &[0, 1, 2]], Some(&[P, P]));
    let a = compare("a", &[layer(0, r.clone(), r.clone())]).unwrap();
    let b = compare(
        "b",
        &[layer(
            0,
            r.clone(),
            router(&[&[0, 1, 2], &[0, 1, 4]], Some(&[P, P])),
        )],
    )
    .unwrap();
    let m = RoutingReport::merge([&a, &b]).unwrap();
    assert_eq!(m.pairs, 4);
    assert_eq!(m.same_set, 3);
    assert_eq!(m.layers.len(), 1);
    assert_eq!(m.layers[0].confident_flips, 1);
    assert_eq!(m.first_flip.unwrap().prompt, "b");
    assert_eq!(RoutingReport::merge([]), None);
}

#[test]
fn sides_of_different_lengths_or_widths_are_refused() {
    let r = router(&[&[0, 1, 2]], Some(&[P]));
    let shorter = router(&[], None);
    assert!(compare("p", &[layer(0, r.clone(), shorter)]).is_err());
    let narrower = router(&[&[0, 1]], None);
    assert!(compare("p", &[layer(0, r, narrower)]).is_err());
}

fn taps(chosen: &[[i64; 3]], logits: Option<&[[f32; 5]]>) -> BTreeMap<String, Tensor> {
    let mut m = BTreeMap::new();
    let flat: Vec<i64> = chosen.iter().flatten().copied().collect();
    m.insert(
        chosen_name(0),
        Tensor::from_vec(flat, (chosen.len(), 3), &Device::Cpu).unwrap(),
    );
    if let Some(l) = logits {
        let flat: Vec<f32> = l.iter().flatten().copied().collect();
        m.insert(
            "layers.0.mlp.router_logits".into(),
            Tensor::from_vec(flat, (l.len(), 5), &Device::Cpu).unwrap(),
        );
    }
    m
}

#[test]
fn taps_give_the_report_and_bad_taps_are_named() {
    let logits = [[2.0f32, 1.5, 1.0, 0.99, 0.0]];
    let reference = taps(&[[0, 1, 2]], Some(&logits));
    let device = taps(&[[0, 1, 3]], Some(&logits));
    let report = from_taps("p", 4, &reference, &device).unwrap().unwrap();
    assert_eq!(report.layers.len(), 1);
    assert_eq!(report.flips[0].class, FlipClass::Confident);
    // A dense model's taps: no routing.
    assert_eq!(
        from_taps("p", 4, &BTreeMap::new(), &BTreeMap::new()).unwrap(),
        None
    );
    // An index beyond the router's width, and one side routing fewer tokens.
    let err = from_taps("p", 1, &reference, &taps(&[[0, 1, 7]], None))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("layers.0.mlp.experts_chosen") && err.contains("below 5"),
        "{err}"
    );
    let err = from_taps("p", 1, &reference, &taps(&[[0, 1, 2], [0, 1, 2]], None))
        .unwrap_err()
        .to_string();
    assert!(err.contains("layers.0.mlp.experts_chosen"), "{err}");
}

#[test]
fn routing_figures_over_nan_or_nothing_are_undefined_never_numbers() {
    // The device's router probabilities NaN at token 0 (a flip there) and its MLP output NaN at that token: every
    // figure taken over them is undefined, `null` in the JSON, `undefined (…)` in the text; a layer of no tokens
    // has no agreement.
    let mut q = P;
    q[0] = f64::NAN;
    let reference = router(&[&[0, 1, 2], &[0, 1, 2]], Some(&[P, P]));
    let device = router(&[&[4, 1, 2], &[0, 1, 2]], Some(&[q, P]));
    let mut sides = layer(0, reference, device);
    sides.mlp_nrmse = Some(vec![Measure::of(f64::NAN, None), Measure::Defined(1e-4)]);
    let empty = layer(1, router(&[], None), router(&[], None));
    let report = compare("p", &[sides, empty]).unwrap();
    let f = &report.flips[0];
    assert!(!f.measured_router_error.unwrap().is_defined(), "{f:?}");
    assert!(!f.mlp_nrmse.unwrap().is_defined(), "{f:?}");
    let l0 = &report.layers[0];
    for m in [
        l0.router_error_max,
        l0.router_error_independent,
        l0.mlp_nrmse_flipped,
    ] {
        assert!(!m.unwrap().is_defined(), "{l0:?}");
    }
    assert_eq!(l0.mlp_nrmse_agreeing.map(|m| m.get()), Some(1e-4));
    assert!(!report.layers[1].set_agreement.is_defined());
    let json = serde_json::to_value(&report).unwrap();
    for key in [
        "router_error_max",
        "router_error_independent",
        "mlp_nrmse_flipped",
    ] {
        assert!(
            json["layers"][0][key].is_null(),
            "{key}: {}",
            json["layers"][0]
        );
    }
    assert!(json["layers"][1]["set_agreement"].is_null());
    assert!(json["flips"][0]["measured_router_error"].is_null());
    let text = crate::report::routing::flip_line(f, Some(l0));
    assert!(
        text.contains("router error undefined (1 NaN on the device side)")
            && text.contains("NRMSE there undefined"),
        "{text}"
    );
}
