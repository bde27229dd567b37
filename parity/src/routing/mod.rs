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
//!
//! The comparison is in `flips.rs`, the verdicts and counts in `tally.rs`, both sides read from taps in `taps.rs`.

mod flips;
mod tally;
mod taps;
#[cfg(test)]
mod tests;

pub use flips::{compare, compare_with, probabilities};
pub use tally::classify;
pub use taps::{chosen_name, from_taps, from_taps_with};

use crate::metrics::Measure;
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
    pub mlp_nrmse: Option<Vec<Measure>>,
    /// `[T]`: the NRMSE of the layer's output at each token.
    pub output_nrmse: Option<Vec<Measure>>,
    /// `[T]`: the NRMSE of the layer's input at each token (the previous layer's output, or the embeddings).
    pub input_nrmse: Option<Vec<Measure>>,
    /// `[T]`: the NRMSE of the layer's mixer output at each token (with the input, what the router reads).
    pub mixer_nrmse: Option<Vec<Measure>>,
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
    pub measured_router_error: Option<Measure>,
    /// The router error the flip was judged against (measured, stated, or their sum).
    pub router_error: Option<Measure>,
    /// Where `router_error` comes from.
    pub router_error_source: Option<ErrorSource>,
    /// The device chose one expert more than once.
    pub repeated: bool,
    /// Near tie, confident or unclassified.
    pub class: FlipClass,
    /// The NRMSE of the layer's MLP output at the token.
    pub mlp_nrmse: Option<Measure>,
    /// The NRMSE of the layer's output at the token.
    pub output_nrmse: Option<Measure>,
    /// The NRMSE of the layer's input at the token.
    pub input_nrmse: Option<Measure>,
    /// The NRMSE of the layer's mixer output at the token (the router reads the norm of input plus mixer output).
    pub mixer_nrmse: Option<Measure>,
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
    /// `same_set / tokens` (undefined over no token).
    pub set_agreement: Measure,
    /// Flips that are near ties.
    pub near_tie_flips: usize,
    /// Confident flips.
    pub confident_flips: usize,
    /// Flips not classified.
    pub unclassified_flips: usize,
    /// Flips an earlier flip reaches.
    pub downstream_flips: usize,
    /// The largest measured router error over the layer's tokens (`None`: the device has no router logits).
    pub router_error_max: Option<Measure>,
    /// The largest measured router error over the tokens no earlier flip reaches: the router's own error, before
    /// any routing divergence feeds it.
    pub router_error_independent: Option<Measure>,
    /// The reference's median `p_k − p_{k+1}` over the layer's tokens: how close its choices typically are.
    pub margin_median: Option<f64>,
    /// Flips whose measured router error exceeds the median margin ([`Flip::router_off`]).
    pub router_off_flips: usize,
    /// The reference's margin at every token (for the median of merged prompts).
    #[serde(skip)]
    margins: Vec<f64>,
    /// The worst MLP output NRMSE at a flipped token.
    pub mlp_nrmse_flipped: Option<Measure>,
    /// The worst MLP output NRMSE at a token with the reference's set.
    pub mlp_nrmse_agreeing: Option<Measure>,
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
    /// `same_set / pairs` (undefined over no pair).
    pub set_agreement: Measure,
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
