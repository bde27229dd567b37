//! The verdicts and counts of a routing report: a flip's class by the rule of the module docs, the report judged
//! again against a stated router error, several prompts' reports merged, some layers kept, and every count redone.

use super::{ErrorSource, Flip, FlipClass, LayerRouting, RoutingReport};
use crate::metrics::{Measure, Why, percentile};

/// The class of a flip whose overturned gap is `gap`, judged against the router error `delta`: near tie when
/// `gap ≤ 2·delta`, confident otherwise (a NaN on either side included); unclassified when either is unknown.
pub fn classify(gap: Option<f64>, delta: Option<f64>, repeated: bool) -> FlipClass {
    if repeated {
        return FlipClass::Confident;
    }
    match (gap, delta) {
        (Some(g), Some(d)) if g <= 2.0 * d => FlipClass::NearTie,
        (Some(_), Some(_)) => FlipClass::Confident,
        _ => FlipClass::Unclassified,
    }
}

/// `n / of`, undefined when nothing was counted.
pub(super) fn share(n: usize, of: usize) -> Measure {
    if of == 0 {
        Measure::Undefined(Why::Empty)
    } else {
        Measure::Defined(n as f64 / of as f64)
    }
}

impl RoutingReport {
    /// Judges every flip against its measured router error plus `stated` (a probability error the caller
    /// assumes for what the device's router logits do not show; without them, the whole error; `None`: the
    /// measured one alone, and a flip without it stays unclassified), and recounts.
    pub fn classify(&mut self, stated: Option<f64>) {
        self.stated_router_error = stated;
        for f in &mut self.flips {
            (f.router_error, f.router_error_source) = match (f.measured_router_error, stated) {
                (Some(d), Some(s)) => (
                    Some(d.map(|d| d + s)),
                    Some(ErrorSource::MeasuredPlusStated),
                ),
                (Some(d), None) => (Some(d), Some(ErrorSource::Measured)),
                (None, Some(s)) => (Some(Measure::of(s, None)), Some(ErrorSource::Stated)),
                (None, None) => (None, None),
            };
            f.class = classify(f.gap, f.router_error.map(|e| e.get()), f.repeated);
        }
        self.tally();
    }

    /// The reports of several prompts as one (layers summed by index, flips in prompt order), judged against the
    /// first one's stated router error; `None` when there are none.
    pub fn merge<'a>(reports: impl IntoIterator<Item = &'a RoutingReport>) -> Option<Self> {
        let mut it = reports.into_iter();
        let mut merged = it.next()?.clone();
        for r in it {
            merged.top_k = merged.top_k.max(r.top_k);
            for l in &r.layers {
                match merged.layers.iter_mut().find(|m| m.layer == l.layer) {
                    Some(m) => {
                        m.tokens += l.tokens;
                        m.same_set += l.same_set;
                        m.same_order += l.same_order;
                        m.router_error_max = max_of(m.router_error_max, l.router_error_max);
                        m.router_error_independent =
                            max_of(m.router_error_independent, l.router_error_independent);
                        m.margins.extend(&l.margins);
                        m.mlp_nrmse_agreeing = max_of(m.mlp_nrmse_agreeing, l.mlp_nrmse_agreeing);
                    }
                    None => merged.layers.push(l.clone()),
                }
            }
            merged.flips.extend(r.flips.iter().cloned());
        }
        merged.layers.sort_by_key(|l| l.layer);
        merged.tally();
        Some(merged)
    }

    /// Recounts the layers' and the whole's flips by class, the agreement and the first flips.
    pub(super) fn tally(&mut self) {
        for l in &mut self.layers {
            let mine: Vec<&Flip> = self.flips.iter().filter(|f| f.layer == l.layer).collect();
            let count = |c: FlipClass| mine.iter().filter(|f| f.class == c).count();
            l.near_tie_flips = count(FlipClass::NearTie);
            l.confident_flips = count(FlipClass::Confident);
            l.unclassified_flips = count(FlipClass::Unclassified);
            l.downstream_flips = mine.iter().filter(|f| f.downstream()).count();
            l.mlp_nrmse_flipped = Measure::worst_of(mine.iter().filter_map(|f| f.mlp_nrmse));
            l.set_agreement = share(l.same_set, l.tokens);
            l.margin_median = (!l.margins.is_empty()).then(|| percentile(&l.margins, 0.5));
            l.router_off_flips = mine.iter().filter(|f| f.router_off).count();
        }
        let sum = |f: fn(&LayerRouting) -> usize| self.layers.iter().map(f).sum::<usize>();
        self.pairs = sum(|l| l.tokens);
        self.same_set = sum(|l| l.same_set);
        self.same_order = sum(|l| l.same_order);
        self.set_agreement = share(self.same_set, self.pairs);
        self.near_tie_flips = sum(|l| l.near_tie_flips);
        self.confident_flips = sum(|l| l.confident_flips);
        self.unclassified_flips = sum(|l| l.unclassified_flips);
        self.downstream_flips = sum(|l| l.downstream_flips);
        self.router_off_flips = sum(|l| l.router_off_flips);
        // By layer then token; `min_by_key` keeps the earlier prompt on a tie.
        let first = |only_confident: bool| {
            self.flips
                .iter()
                .filter(|f| !only_confident || f.class == FlipClass::Confident)
                .min_by_key(|f| (f.layer, f.token))
                .cloned()
        };
        self.first_flip = first(false);
        self.first_confident = first(true);
    }

    /// Keeps the layers `keep` and their flips alone, and recounts (a flip's `upstream` may still name a layer left
    /// out: it was run, and reaches the flip).
    pub fn retain_layers(&mut self, keep: &[usize]) {
        self.layers.retain(|l| keep.contains(&l.layer));
        self.flips.retain(|f| keep.contains(&f.layer));
        self.tally();
    }

    /// Flips in all.
    pub fn flip_count(&self) -> usize {
        self.flips.len()
    }

    /// Pairs with the reference's set but another order.
    pub fn order_only(&self) -> usize {
        self.same_set - self.same_order
    }
}

/// The larger of two optional measures (undefined when either is: [`Measure::worst`]).
fn max_of(a: Option<Measure>, b: Option<Measure>) -> Option<Measure> {
    Measure::worst_of(a.into_iter().chain(b))
}
