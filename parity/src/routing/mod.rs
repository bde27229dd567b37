//! The routing report of an MoE decoder: at every layer and token, whether the side under test chose the experts the
//! reference chose, and for each token where it did not (a *flip*) whether rounding can have decided it or the
//! routing is computed wrongly, and what the flip cost. Written once, for every check that has both sides' routing
//! taps (`diff`, `compare-devices`, `validate`; see [`from_taps`]); plain data in and out.
//!
//! # Agreement
//! Per layer, the share of tokens whose chosen expert **set** equals the reference's. That the experts also come in
//! the same order (descending probability) is a separate, weaker fact: an order-only difference changes nothing the
//! layer computes, since each expert's weight travels with it.
//!
//! # Classification of a flip
//! With `p` the reference's router probabilities at the token (softmax of its `router_logits`, in f64):
//!
//! - the **gap** the flip overturned is `max p(out) − min p(in)` over the experts the reference chose and the
//!   device did not (`out`) and those the device chose and the reference did not (`in`): the device ranked every
//!   `in` above every `out`, so each of those pairs was reversed. For the usual flip (the reference's k-th expert
//!   swapped for its (k+1)-th) the gap is the reference's **margin** `p_k − p_{k+1}`, which is reported too.
//! - the device's **router error** `δ` at the token is `max_e |p_dev(e) − p(e)|` from the device's own
//!   `router_logits` (*measured*), plus the error the caller states for what those logits do not show
//!   (`--router-tolerance`: a softmax or top-k computed more coarsely than the logits it outputs); without the
//!   device's router logits the stated error alone, without either none.
//! - the flip is a **near tie** when `gap ≤ 2δ`: reversing two probabilities `gap` apart moves one of them by at
//!   least `gap / 2`, so an error of `δ` at that token can have decided it (as compare-devices calls a token flip a
//!   near tie within twice the logit error). It is **confident** when `gap > 2δ` (or the device chose one expert
//!   twice): the device's choice is not what its router output allows, so the selection (top-k, the expert indices)
//!   or, judged against a stated bound, the router itself is computed wrongly. **Unclassified** when the reference's
//!   router logits or the device's router error are unknown. A NaN anywhere in the comparison makes the flip
//!   confident: nothing can be said to excuse it.
//!
//! # Cause and cost
//! A flip's cost is the error of that layer's MLP output (and output) at the token, against the worst among the
//! layer's tokens that chose the reference's set. A flip can follow from an earlier one: a flip at layer `l'` and
//! token `t'` moves every later layer's input at tokens `t ≥ t'` (through the residual stream and the mixers), so a
//! flip at `(l, t)` with such a flip at `l' < l` is *downstream* and names it ([`Flip::upstream`]); its input error
//! (the previous layer's output, or the embeddings, at the token) is reported too. The first flip, by layer then
//! token, is the one to look at first. A flip is a near tie by the rule whenever the router error is large, however
//! it got large: a flip whose measured router error exceeds the reference's median margin at the layer is marked
//! [`Flip::router_off`] (an error that size would flip a typical token), and on an independent flip that says the
//! router, or its input, is computed wrongly there rather than rounding a near tie. Per layer the router's *own*
//! error, its largest over the tokens no earlier flip reaches, is reported beside its largest overall.

mod taps;
#[cfg(test)]
mod tests;

pub use taps::{chosen_name, from_taps, from_taps_with};

use crate::metrics::{log_softmax, nan_max, percentile};
use anyhow::{Result, bail};
use serde::Serialize;

/// One side's routing at one layer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Router {
    /// `[T][k]`: the experts each token chose, in the side's order (descending probability).
    pub chosen: Vec<Vec<usize>>,
    /// `[T][E]`: the router's probabilities, when the side has its router logits.
    pub probabilities: Option<Vec<Vec<f64>>>,
}

/// One layer of both sides: their routing and the error of what the layer computed at every token.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LayerSides {
    /// The layer.
    pub layer: usize,
    /// The reference's routing.
    pub reference: Router,
    /// The routing under test.
    pub device: Router,
    /// `[T]`: the NRMSE of the layer's MLP output at each token, when both sides have it.
    pub mlp_nrmse: Option<Vec<f64>>,
    /// `[T]`: the NRMSE of the layer's output at each token.
    pub output_nrmse: Option<Vec<f64>>,
    /// `[T]`: the NRMSE of the layer's input at each token (the previous layer's output, or the embeddings).
    pub input_nrmse: Option<Vec<f64>>,
    /// `[T]`: the NRMSE of the layer's mixer output at each token (with the input, what the router reads).
    pub mixer_nrmse: Option<Vec<f64>>,
}

/// What a flip is, by the rule of the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FlipClass {
    /// The reference's gap is within twice the device's router error: rounding can have decided it.
    NearTie,
    /// Beyond what the device's router error allows: the routing is computed wrongly.
    Confident,
    /// The reference's router logits, or the device's router error, are unknown.
    Unclassified,
}

impl FlipClass {
    /// The class as the reports write it.
    pub fn name(self) -> &'static str {
        match self {
            FlipClass::NearTie => "near tie",
            FlipClass::Confident => "confident",
            FlipClass::Unclassified => "unclassified",
        }
    }
}

/// Where the router error a flip was judged against comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorSource {
    /// The device's own router logits against the reference's, at the token.
    Measured,
    /// A bound the caller stated (`--router-tolerance`), the device giving no router logits.
    Stated,
    /// The measured error plus the stated one.
    MeasuredPlusStated,
}

/// A layer and token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct At {
    /// The layer.
    pub layer: usize,
    /// The token (row of the taps).
    pub token: usize,
}

/// One token at one layer where the device chose other experts than the reference.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Flip {
    /// The prompt.
    pub prompt: String,
    /// The layer.
    pub layer: usize,
    /// The token (row of the taps).
    pub token: usize,
    /// The reference's experts, in its order.
    pub reference: Vec<usize>,
    /// The device's experts, in its order.
    pub device: Vec<usize>,
    /// Experts the device chose and the reference did not.
    pub experts_in: Vec<usize>,
    /// Experts the reference chose and the device did not.
    pub experts_out: Vec<usize>,
    /// The reference's `p_k − p_{k+1}` at the token.
    pub reference_margin: Option<f64>,
    /// `max p(out) − min p(in)` under the reference: what the device's choice overturned.
    pub gap: Option<f64>,
    /// `max_e |p_dev(e) − p_ref(e)|` at the token, when the device has its router logits.
    pub measured_router_error: Option<f64>,
    /// The router error the flip was judged against (measured, stated, or their sum).
    pub router_error: Option<f64>,
    /// Where `router_error` comes from.
    pub router_error_source: Option<ErrorSource>,
    /// The device chose one expert more than once.
    pub repeated: bool,
    /// Near tie, confident or unclassified.
    pub class: FlipClass,
    /// The NRMSE of the layer's MLP output at the token.
    pub mlp_nrmse: Option<f64>,
    /// The NRMSE of the layer's output at the token.
    pub output_nrmse: Option<f64>,
    /// The NRMSE of the layer's input at the token.
    pub input_nrmse: Option<f64>,
    /// The NRMSE of the layer's mixer output at the token (the router reads the norm of input plus mixer output).
    pub mixer_nrmse: Option<f64>,
    /// The first earlier flip that reaches this one (an earlier layer, this token or one before, as [`Reach`]
    /// says); `None`: this one is independent.
    pub upstream: Option<At>,
    /// The measured router error at the token exceeds the reference's median margin at the layer: a near tie only
    /// because the router is far off there (on an independent flip: the router, or its input, computed wrongly).
    pub router_off: bool,
}

impl Flip {
    /// Whether an earlier flip can have caused this one.
    pub fn downstream(&self) -> bool {
        self.upstream.is_some()
    }
}

/// One layer's routing.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerRouting {
    /// The layer.
    pub layer: usize,
    /// Tokens compared.
    pub tokens: usize,
    /// Tokens whose expert set equals the reference's.
    pub same_set: usize,
    /// Tokens with the same experts in the same order.
    pub same_order: usize,
    /// `same_set / tokens`.
    pub set_agreement: f64,
    /// Flips that are near ties.
    pub near_tie_flips: usize,
    /// Confident flips.
    pub confident_flips: usize,
    /// Flips not classified.
    pub unclassified_flips: usize,
    /// Flips an earlier flip reaches.
    pub downstream_flips: usize,
    /// The largest measured router error over the layer's tokens (`None`: the device has no router logits).
    pub router_error_max: Option<f64>,
    /// The largest measured router error over the tokens no earlier flip reaches: the router's own error, before
    /// any routing divergence feeds it.
    pub router_error_independent: Option<f64>,
    /// The reference's median `p_k − p_{k+1}` over the layer's tokens: how close its choices typically are.
    pub margin_median: Option<f64>,
    /// Flips whose measured router error exceeds the median margin ([`Flip::router_off`]).
    pub router_off_flips: usize,
    /// The reference's margin at every token (for the median of merged prompts).
    #[serde(skip)]
    margins: Vec<f64>,
    /// The worst MLP output NRMSE at a flipped token.
    pub mlp_nrmse_flipped: Option<f64>,
    /// The worst MLP output NRMSE at a token with the reference's set.
    pub mlp_nrmse_agreeing: Option<f64>,
}

/// The routing of every layer of one or more prompts, device against reference.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoutingReport {
    /// Experts per token.
    pub top_k: usize,
    /// (token, layer) pairs compared.
    pub pairs: usize,
    /// Pairs with the reference's set.
    pub same_set: usize,
    /// Pairs with the reference's experts in its order.
    pub same_order: usize,
    /// `same_set / pairs`.
    pub set_agreement: f64,
    /// Flips that are near ties.
    pub near_tie_flips: usize,
    /// Confident flips.
    pub confident_flips: usize,
    /// Flips not classified.
    pub unclassified_flips: usize,
    /// Flips an earlier flip reaches.
    pub downstream_flips: usize,
    /// Flips whose router error exceeds the reference's median margin ([`Flip::router_off`]).
    pub router_off_flips: usize,
    /// The router error stated for what the device's router logits do not show (`None`: not given).
    pub stated_router_error: Option<f64>,
    /// The first flip, by layer then token (then prompt).
    pub first_flip: Option<Flip>,
    /// The first confident flip.
    pub first_confident: Option<Flip>,
    /// Per layer.
    pub layers: Vec<LayerRouting>,
    /// Every flip, prompt by prompt, by layer then token.
    pub flips: Vec<Flip>,
}

/// Which earlier flips can reach a token: how the run fed its layers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Reach {
    /// Each layer read the device's own output of the layer before and carried its own state (a decoder run, the
    /// chained probe): a flip at layer `l'` and token `t'` reaches every later layer's tokens `t ≥ t'`.
    #[default]
    Chained,
    /// The device was given the reference's state before every block `[start, end)` and its own hidden state went
    /// from layer to layer within the block (a decoder probed isolated): a flip reaches the later layers' tokens from
    /// its own to the end of its block.
    Blocks(Vec<(usize, usize)>),
    /// Each layer read the reference's input and state (the per-layer probe, isolated): no flip reaches another.
    Isolated,
}

impl Reach {
    /// Whether a flip at `from` (an earlier layer) reaches token `token`.
    pub fn reaches(&self, from: At, token: usize) -> bool {
        match self {
            Reach::Chained => from.token <= token,
            Reach::Blocks(blocks) => {
                from.token <= token
                    && blocks
                        .iter()
                        .any(|&(start, end)| start <= from.token && token < end)
            }
            Reach::Isolated => false,
        }
    }
}

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
        let at = |v: &Option<Vec<f64>>, t: usize| v.as_ref().and_then(|v| v.get(t)).copied();
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
            let delta = match (probs(r, t), probs(d, t)) {
                (Some(pr), Some(pd)) if pr.len() == pd.len() => {
                    Some(nan_max(pr.iter().zip(pd).map(|(x, y)| (x - y).abs())))
                }
                (Some(_), Some(_)) => Some(f64::NAN),
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
                class: classify(gap, delta, repeated),
                mlp_nrmse: at(&sides.mlp_nrmse, t),
                output_nrmse: at(&sides.output_nrmse, t),
                input_nrmse: at(&sides.input_nrmse, t),
                mixer_nrmse: at(&sides.mixer_nrmse, t),
                upstream,
                router_off: matches!((delta, median), (Some(d), Some(m)) if d > m),
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
            router_error_max: (!deltas.is_empty()).then(|| nan_max(deltas)),
            router_error_independent: (!independent.is_empty()).then(|| nan_max(independent)),
            margin_median: median,
            router_off_flips: 0,
            margins,
            mlp_nrmse_flipped: None,
            mlp_nrmse_agreeing: (!agreeing.is_empty()).then(|| nan_max(agreeing)),
        });
    }
    let mut report = RoutingReport {
        top_k,
        pairs: 0,
        same_set: 0,
        same_order: 0,
        set_agreement: f64::NAN,
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

/// `n / of`, NaN when nothing was counted.
fn share(n: usize, of: usize) -> f64 {
    if of == 0 {
        f64::NAN
    } else {
        n as f64 / of as f64
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
                (Some(d), Some(s)) => (Some(d + s), Some(ErrorSource::MeasuredPlusStated)),
                (Some(d), None) => (Some(d), Some(ErrorSource::Measured)),
                (None, Some(s)) => (Some(s), Some(ErrorSource::Stated)),
                (None, None) => (None, None),
            };
            f.class = classify(f.gap, f.router_error, f.repeated);
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
    fn tally(&mut self) {
        for l in &mut self.layers {
            let mine: Vec<&Flip> = self.flips.iter().filter(|f| f.layer == l.layer).collect();
            let count = |c: FlipClass| mine.iter().filter(|f| f.class == c).count();
            l.near_tie_flips = count(FlipClass::NearTie);
            l.confident_flips = count(FlipClass::Confident);
            l.unclassified_flips = count(FlipClass::Unclassified);
            l.downstream_flips = mine.iter().filter(|f| f.downstream()).count();
            let worst: Vec<f64> = mine.iter().filter_map(|f| f.mlp_nrmse).collect();
            l.mlp_nrmse_flipped = (!worst.is_empty()).then(|| nan_max(worst));
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

/// The larger of two optional values, both ≥ 0 (NaN wins, as in [`nan_max`]).
fn max_of(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(nan_max([a, b])),
        (a, b) => a.or(b),
    }
}
