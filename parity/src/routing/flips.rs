//! Finding the flips: the two sides' routing compared layer by layer and token by token (agreement of the set and
//! of the order, the gap each flip overturned, the router error at the token, the earlier flip that reaches it).

use super::tally::{classify, share};
use super::{At, ErrorSource, Flip, LayerRouting, LayerSides, Reach, Router, RoutingReport};
use crate::metrics::{Measure, Why, log_softmax, nan_max, percentile};
use anyhow::{Result, bail};

/// The reference's `p_k − p_{k+1}` of a probability row.
fn margin(p: &[f64], k: usize) -> Option<f64> {
    let mut sorted = p.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    Some(sorted.get(k.checked_sub(1)?)? - sorted.get(k)?)
}

/// A side's router probabilities at token `t`, when it has them.
fn probs(side: &Router, t: usize) -> Option<&Vec<f64>> {
    side.probabilities.as_ref()?.get(t)
}

/// `a` without the elements of `b` (as multisets).
fn minus(a: &[usize], b: &[usize]) -> Vec<usize> {
    let mut rest = b.to_vec();
    a.iter()
        .copied()
        .filter(|x| match rest.iter().position(|y| y == x) {
            Some(i) => {
                rest.swap_remove(i);
                false
            }
            None => true,
        })
        .collect()
}

/// A row sorted: the set of experts (with repeats kept, so a repeat never equals a set without it).
fn as_set(row: &[usize]) -> Vec<usize> {
    let mut s = row.to_vec();
    s.sort_unstable();
    s
}

/// The router's probabilities of a logits row, in f64 (softmax).
pub fn probabilities(logits: &[f64]) -> Vec<f64> {
    log_softmax(logits).into_iter().map(f64::exp).collect()
}

/// Compares the routing of one prompt, layer by layer (`layers` in the decoder's order), of a run whose layers each
/// read the output of the one before ([`Reach::Chained`]; [`compare_with`] for another). Fails when the two sides
/// do not hold the same tokens or the same number of experts per token; flips are classified against the measured
/// router error only ([`RoutingReport::classify`] adds a stated one).
pub fn compare(prompt: &str, layers: &[LayerSides]) -> Result<RoutingReport> {
    compare_with(prompt, layers, &Reach::Chained)
}

/// [`compare`] of a run whose earlier flips reach later tokens as `reach` says.
pub fn compare_with(prompt: &str, layers: &[LayerSides], reach: &Reach) -> Result<RoutingReport> {
    let mut flips: Vec<Flip> = Vec::new();
    let mut out = Vec::with_capacity(layers.len());
    let mut top_k = 0;
    for sides in layers {
        let (r, d) = (&sides.reference, &sides.device);
        let l = sides.layer;
        if r.chosen.len() != d.chosen.len() {
            bail!(
                "layer {l}: experts chosen for {} tokens against the reference's {}",
                d.chosen.len(),
                r.chosen.len()
            );
        }
        let k = r.chosen.first().map_or(0, Vec::len);
        for (t, (a, b)) in r.chosen.iter().zip(&d.chosen).enumerate() {
            if a.len() != k || b.len() != k {
                bail!(
                    "layer {l} token {t}: {} experts chosen against the reference's {} (every token chooses {k})",
                    b.len(),
                    a.len()
                );
            }
        }
        if top_k != 0 && k != 0 && k != top_k {
            bail!("layer {l}: {k} experts per token, where earlier layers chose {top_k}");
        }
        top_k = top_k.max(k);
        let at = |v: &Option<Vec<Measure>>, t: usize| v.as_ref().and_then(|v| v.get(t)).copied();
        let (mut same_set, mut same_order) = (0, 0);
        let mut deltas = Vec::new();
        let mut independent = Vec::new();
        let mut agreeing = Vec::new();
        let margins: Vec<f64> = (0..r.chosen.len())
            .filter_map(|t| margin(probs(r, t)?, k))
            .collect();
        let median = (!margins.is_empty()).then(|| percentile(&margins, 0.5));
        // The earlier layers' flips, by layer then token: the first of them that reaches a token is its upstream.
        let earlier = flips.len();
        let upstream_of = |flips: &[Flip], t: usize| {
            flips[..earlier]
                .iter()
                .map(|f| At {
                    layer: f.layer,
                    token: f.token,
                })
                .find(|&at| reach.reaches(at, t))
        };
        for (t, (a, b)) in r.chosen.iter().zip(&d.chosen).enumerate() {
            // Undefined where either side's probabilities hold NaN or infinity, or their widths differ.
            let delta = match (probs(r, t), probs(d, t)) {
                (Some(pr), Some(pd)) if pr.len() == pd.len() => Some(Measure::of(
                    nan_max(pr.iter().zip(pd).map(|(x, y)| (x - y).abs())),
                    Why::of_slices(pd, pr),
                )),
                (Some(_), Some(_)) => Some(Measure::Undefined(Why::Empty)),
                _ => None,
            };
            deltas.extend(delta);
            let upstream = upstream_of(&flips, t);
            if upstream.is_none() {
                independent.extend(delta);
            }
            if as_set(a) == as_set(b) {
                same_set += 1;
                same_order += usize::from(a == b);
                agreeing.extend(at(&sides.mlp_nrmse, t));
                continue;
            }
            let (experts_in, experts_out) = (minus(b, a), minus(a, b));
            let repeated = as_set(b).windows(2).any(|w| w[0] == w[1]);
            let pr = probs(r, t);
            let p = |e: usize| pr.and_then(|p| p.get(e)).copied().unwrap_or(f64::NAN);
            let gap = pr.map(|_| {
                nan_max(experts_out.iter().map(|&e| p(e)))
                    - nan_min(experts_in.iter().map(|&e| p(e)))
            });
            flips.push(Flip {
                prompt: prompt.to_string(),
                layer: l,
                token: t,
                reference: a.clone(),
                device: b.clone(),
                experts_in,
                experts_out,
                reference_margin: pr.and_then(|p| margin(p, k)),
                gap,
                measured_router_error: delta,
                router_error: delta,
                router_error_source: delta.map(|_| ErrorSource::Measured),
                repeated,
                class: classify(gap, delta.map(|d| d.get()), repeated),
                mlp_nrmse: at(&sides.mlp_nrmse, t),
                output_nrmse: at(&sides.output_nrmse, t),
                input_nrmse: at(&sides.input_nrmse, t),
                mixer_nrmse: at(&sides.mixer_nrmse, t),
                upstream,
                router_off: matches!((delta.and_then(|d| d.defined()), median), (Some(d), Some(m)) if d > m),
            });
        }
        let tokens = r.chosen.len();
        out.push(LayerRouting {
            layer: l,
            tokens,
            same_set,
            same_order,
            set_agreement: share(same_set, tokens),
            near_tie_flips: 0,
            confident_flips: 0,
            unclassified_flips: 0,
            downstream_flips: 0,
            router_error_max: Measure::worst_of(deltas),
            router_error_independent: Measure::worst_of(independent),
            margin_median: median,
            router_off_flips: 0,
            margins,
            mlp_nrmse_flipped: None,
            mlp_nrmse_agreeing: Measure::worst_of(agreeing),
        });
    }
    let mut report = RoutingReport {
        top_k,
        pairs: 0,
        same_set: 0,
        same_order: 0,
        set_agreement: Measure::Undefined(Why::Empty),
        near_tie_flips: 0,
        confident_flips: 0,
        unclassified_flips: 0,
        downstream_flips: 0,
        router_off_flips: 0,
        stated_router_error: None,
        first_flip: None,
        first_confident: None,
        layers: out,
        flips,
    };
    report.tally();
    Ok(report)
}

/// The smallest of `x`, NaN when any is NaN or `x` is empty.
fn nan_min(x: impl IntoIterator<Item = f64>) -> f64 {
    let mut min: Option<f64> = None;
    for v in x {
        if v.is_nan() {
            return f64::NAN;
        }
        min = Some(min.map_or(v, |m| m.min(v)));
    }
    min.unwrap_or(f64::NAN)
}
