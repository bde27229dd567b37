//! A device's comparisons over every prompt, aggregated and checked against the thresholds.

use super::{LayerTrace, Position, PositionClass, PromptComparison, Row, Thresholds};
use crate::metrics::{Measure, TensorError, Why, exceeds, falls_short, mean, nan_max, percentile};
use crate::non_finite::{NonFinite, summary};
use crate::routing::RoutingReport;
use reference::backend::RunRecord;
use serde::Serialize;

/// Teacher-forced agreement over a set of positions; every rate and divergence undefined (`null`) over no position
/// or over positions whose logits hold NaN or infinity on either side.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Distribution {
    /// Positions.
    pub positions: usize,
    /// Share where both choose the same top token ("same top p").
    pub same_top1: Measure,
    /// Mean share of the reference's top 5 among the device's top 5.
    pub top5_overlap: Measure,
    /// `KL(P_ref ‖ P_device)`: mean, 99th percentile and maximum, in nats.
    pub kl_mean: Measure,
    /// 99th percentile of the KL.
    pub kl_p99: Measure,
    /// Largest KL.
    pub kl_max: Measure,
    /// Mean Δp (device minus reference probability of the reference's top token).
    pub delta_p_mean: Measure,
    /// RMS of Δp.
    pub delta_p_rms: Measure,
    /// Disagreements where the reference's margin is within twice the logit error (near ties).
    pub near_tie_flips: usize,
    /// Disagreements at confident positions: faults.
    pub confident_flips: usize,
    /// Largest `|P_device(eos) − P_ref(eos)|`.
    pub eos_drift_max: Measure,
    /// Mean `P_device(eos) − P_ref(eos)`.
    pub eos_drift_mean: Measure,
}

impl Distribution {
    /// The summary of `positions` (all classes together).
    pub fn of<'a>(positions: impl IntoIterator<Item = &'a Position>) -> Self {
        let p: Vec<&Position> = positions.into_iter().collect();
        let kl: Vec<f64> = p.iter().map(|x| x.agreement.kl).collect();
        let dp: Vec<f64> = p.iter().map(|x| x.agreement.delta_p).collect();
        let eos: Vec<f64> = p
            .iter()
            .map(|x| x.agreement.eos_p.1 - x.agreement.eos_p.0)
            .collect();
        let flips = |near: bool| {
            p.iter()
                .filter(|x| !x.agreement.same_top() && x.near_tie == near)
                .count()
        };
        let n = p.len();
        let rows = |f: fn(&Position) -> usize| p.iter().filter(|x| f(x) > 0).count();
        let (device, reference) = (
            rows(|x| x.agreement.non_finite),
            rows(|x| x.agreement.ref_non_finite),
        );
        let why = if device + reference > 0 {
            Some(Why::Rows { device, reference })
        } else {
            (n == 0).then_some(Why::Empty)
        };
        let m = |x: f64| Measure::of(x, why);
        Distribution {
            positions: n,
            same_top1: m(
                p.iter().filter(|x| x.agreement.same_top()).count() as f64 / n.max(1) as f64
            ),
            top5_overlap: m(mean(
                &p.iter()
                    .map(|x| x.agreement.top5_overlap)
                    .collect::<Vec<_>>(),
            )),
            kl_mean: m(mean(&kl)),
            kl_p99: m(percentile(&kl, 0.99)),
            kl_max: m(nan_max(kl.iter().copied())),
            delta_p_mean: m(mean(&dp)),
            delta_p_rms: m(mean(&dp.iter().map(|x| x * x).collect::<Vec<_>>()).sqrt()),
            near_tie_flips: flips(true),
            confident_flips: flips(false),
            eos_drift_max: m(nan_max(eos.iter().map(|x| x.abs()))),
            eos_drift_mean: m(mean(&eos)),
        }
    }
}

/// The first place where the device leaves tolerance, at every level.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FirstDivergence {
    /// The first layer whose output exceeds the layer threshold (over the whole run), with its NRMSE.
    pub layer: Option<(usize, f64)>,
    /// The first position where some layer's output exceeds the threshold, with that layer.
    pub position: Option<(usize, usize)>,
    /// The prompt and the index of the first free-running token that differs.
    pub token: Option<(String, usize)>,
    /// `diff` only: the first tensor both dumps hold, in the order the decoder computes it
    /// ([`reference::taps::names::computation_order`]), that leaves tolerance, with the measure that does: a hidden
    /// state's NRMSE over the layer threshold, a state's over the state threshold, the logits' NMSE over theirs (a
    /// NaN or an infinity always does). Where a fault first shows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor: Option<(String, f64)>,
}

/// Where a device's non-finite values first appear.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FirstNonFinite {
    /// The prompt.
    pub prompt: String,
    /// How many of its tensors hold non-finite values.
    pub tensors: usize,
    /// The first of them, in computation order.
    pub first: NonFinite,
}

/// A device against the reference over every prompt.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceReport {
    /// The device.
    pub device: String,
    /// What the device ran (as deployed).
    pub record: RunRecord,
    /// The thresholds applied.
    pub thresholds: Thresholds,
    /// Free-running greedy: tokens matched before the first divergence, over all prompts.
    pub greedy_matched: usize,
    /// Tokens generated over all prompts.
    pub greedy_total: usize,
    /// Teacher-forced agreement, every position.
    pub all: Distribution,
    /// Over the prompt positions.
    pub prompt_positions: Distribution,
    /// Over the generated positions.
    pub generated_positions: Distribution,
    /// Over the near-tie positions.
    pub near_ties: Distribution,
    /// Over the confident positions.
    pub confident: Distribution,
    /// Worst logits error over the prompts.
    pub logits: TensorError,
    /// Per layer, the worst over the prompts.
    pub layers: Vec<LayerTrace>,
    /// The final norm, the worst over the prompts (`None` when not available).
    pub final_norm: Option<TensorError>,
    /// Why the layers, the final norm and the states were not compared (see
    /// [`PromptComparison::not_available`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_available: Option<String>,
    /// Per state, the worst over the prompts.
    pub states: Vec<Row>,
    /// Largest logits difference between the graphs with taps and as deployed.
    pub tapped_vs_deployed: Measure,
    /// Where the device first leaves tolerance.
    pub first_divergence: FirstDivergence,
    /// An MoE model's routing against the reference's over every prompt, where both sides expose the chosen
    /// experts; flips are judged against the measured router error plus `thresholds.router_tolerance`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routing: Option<RoutingReport>,
    /// The first tensor (in computation order, of the first prompt that has one) where the device produced NaN or
    /// infinity; `null` when every value was finite.
    pub first_non_finite: Option<FirstNonFinite>,
    /// Deployed prompt throughput, tokens per second.
    pub prompt_tokens_per_s: f64,
    /// Deployed decode throughput, tokens per second.
    pub decode_tokens_per_s: f64,
    /// Why the device failed (empty: it passed).
    pub failures: Vec<String>,
    /// `diff` only: every tensor both dumps hold.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tensors: Vec<Row>,
    /// `diff` only: tensors only the dump under test holds.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub only_in_actual: Vec<String>,
    /// `diff` only: tensors only the reference dump holds.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub only_in_reference: Vec<String>,
    /// A prompt with images: the device's vision tower (its static vision graph) against the reference's, per tap
    /// (`vision.merger` is the image embeddings the decoder runs on).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub vision: Vec<Row>,
    /// A prompt with images: which vision graph made the device's image rows (the device's own, built from the
    /// checkpoint, or a set's, by name).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vision_graph: Option<String>,
    /// Every prompt.
    pub prompts: Vec<PromptComparison>,
}

/// The worse of two errors, by NRMSE.
fn worse(a: TensorError, b: TensorError) -> TensorError {
    if b.nrmse.get() > a.nrmse.get() || (!b.finite() && a.finite()) {
        b
    } else {
        a
    }
}

/// The worse of two errors either of which may be absent.
fn worse_of(a: Option<TensorError>, b: Option<TensorError>) -> Option<TensorError> {
    match (a, b) {
        (Some(a), Some(b)) => Some(worse(a, b)),
        (a, b) => a.or(b),
    }
}

impl DeviceReport {
    /// Aggregates the prompts of one device and applies the thresholds.
    pub fn new(
        device: &str,
        record: RunRecord,
        thresholds: Thresholds,
        prompts: Vec<PromptComparison>,
    ) -> Self {
        let all_positions: Vec<&Position> = prompts.iter().flat_map(|p| &p.positions).collect();
        let class = |c: PositionClass| {
            Distribution::of(all_positions.iter().copied().filter(|p| p.class == c))
        };
        let mut layers: Vec<LayerTrace> = prompts[0].layers.clone();
        let mut states: Vec<Row> = prompts[0].states.clone();
        let (mut logits, mut final_norm) = (prompts[0].logits, prompts[0].final_norm);
        for p in &prompts[1..] {
            for (acc, l) in layers.iter_mut().zip(&p.layers) {
                acc.output = worse(acc.output, l.output);
                acc.mixer = worse_of(acc.mixer, l.mixer);
                acc.mlp = worse_of(acc.mlp, l.mlp);
            }
            for (acc, s) in states.iter_mut().zip(&p.states) {
                acc.error = worse(acc.error, s.error);
            }
            logits = worse(logits, p.logits);
            final_norm = worse_of(final_norm, p.final_norm);
        }
        // Positions along the run: the first prompt's trace (the per-prompt traces are in `prompts`).
        let layer_over = layers
            .iter()
            .find(|l| {
                exceeds(l.output.nrmse.get(), thresholds.max_layer_nrmse) || !l.output.finite()
            })
            .map(|l| (l.layer, l.output.nrmse.get()));
        let position_over = prompts[0]
            .layers
            .iter()
            .filter_map(|l| {
                l.nrmse_by_position
                    .iter()
                    .position(|&e| exceeds(e, thresholds.max_layer_nrmse))
                    .map(|p| (p, l.layer))
            })
            .min();
        let token = prompts
            .iter()
            .find_map(|p| p.greedy.first_divergence.map(|i| (p.label.clone(), i)));
        let (prompt_tokens, prompt_s, decode_tokens, decode_s) =
            prompts.iter().fold((0, 0.0, 0, 0.0), |acc, p| {
                (
                    acc.0 + p.prompt_tokens,
                    acc.1 + p.prompt_seconds,
                    acc.2 + p.greedy.total.saturating_sub(1),
                    acc.3 + p.decode_seconds,
                )
            });
        let all = Distribution::of(all_positions.iter().copied());
        let routing =
            RoutingReport::merge(prompts.iter().filter_map(|p| p.routing.as_ref())).map(|mut r| {
                r.classify(thresholds.router_tolerance);
                r
            });
        let mut report = DeviceReport {
            device: device.to_string(),
            record,
            thresholds,
            greedy_matched: prompts.iter().map(|p| p.greedy.matched).sum(),
            greedy_total: prompts.iter().map(|p| p.greedy.total).sum(),
            all,
            prompt_positions: class(PositionClass::Prompt),
            generated_positions: class(PositionClass::Generated),
            near_ties: Distribution::of(all_positions.iter().copied().filter(|p| p.near_tie)),
            confident: Distribution::of(all_positions.iter().copied().filter(|p| !p.near_tie)),
            logits,
            layers,
            final_norm,
            states,
            not_available: prompts.iter().find_map(|p| p.not_available.clone()),
            tapped_vs_deployed: prompts
                .iter()
                .map(|p| p.tapped_vs_deployed)
                .reduce(Measure::worst)
                .unwrap_or(Measure::Undefined(Why::Empty)),
            first_non_finite: prompts.iter().find_map(|p| {
                Some(FirstNonFinite {
                    prompt: p.label.clone(),
                    tensors: p.non_finite.len(),
                    first: p.non_finite.first()?.clone(),
                })
            }),
            first_divergence: FirstDivergence {
                layer: layer_over,
                position: position_over,
                token,
                tensor: None,
            },
            routing,
            prompt_tokens_per_s: prompt_tokens as f64 / prompt_s.max(1e-9),
            decode_tokens_per_s: decode_tokens as f64 / decode_s.max(1e-9),
            failures: vec![],
            tensors: vec![],
            only_in_actual: vec![],
            only_in_reference: vec![],
            vision: Vec::new(),
            vision_graph: None,
            prompts,
        };
        report.failures = report.check();
        report
    }

    /// Every threshold the report exceeds, as sentences.
    fn check(&self) -> Vec<String> {
        let t = &self.thresholds;
        let mut f = Vec::new();
        for p in &self.prompts {
            if let Some(s) = summary(&p.non_finite) {
                f.push(format!("prompt `{}`: {s}", p.label));
            }
            if let Some(s) = summary(&p.reference_non_finite) {
                f.push(format!(
                    "prompt `{}`: the reference's side holds {s}",
                    p.label
                ));
            }
            if let Some(i) = p.greedy.device_nan_at {
                f.push(format!(
                    "prompt `{}`: the logits hold a NaN at generated token {i} (free-running greedy stopped there)",
                    p.label
                ));
            }
        }
        if exceeds(self.logits.nmse.get(), t.max_logits_nmse) || !self.logits.finite() {
            f.push(format!(
                "logits NMSE {:.2e} > {:.1e} (--max-nmse)",
                self.logits.nmse, t.max_logits_nmse
            ));
        }
        if exceeds(self.all.kl_mean.get(), t.max_mean_kl) {
            f.push(format!(
                "mean KL {:.2e} > {:.1e} (--max-kl)",
                self.all.kl_mean, t.max_mean_kl
            ));
        }
        if falls_short(self.all.same_top1.get(), t.min_top1) {
            f.push(format!(
                "same top-1 {:.1} < {:.1}% (--min-token-agreement)",
                self.all.same_top1.percent(),
                100.0 * t.min_top1
            ));
        }
        if self.all.confident_flips > t.max_confident_flips {
            f.push(format!(
                "{} confident teacher-forced disagreements > {} (--max-confident-flips)",
                self.all.confident_flips, t.max_confident_flips
            ));
        }
        if let Some(r) = &self.routing
            && let Some(first) = &r.first_confident
        {
            f.push(format!(
                "{} confident routing flip(s), the first at layer {} token {} of prompt `{}`: the device chose \
                 experts its router error cannot explain",
                r.confident_flips, first.layer, first.token, first.prompt
            ));
        }
        for l in &self.layers {
            if exceeds(l.output.nrmse.get(), t.max_layer_nrmse) || !l.output.finite() {
                f.push(format!(
                    "layer {} output NRMSE {:.2e} > {:.1e} (--max-layer-nrmse)",
                    l.layer, l.output.nrmse, t.max_layer_nrmse
                ));
            }
        }
        for s in &self.states {
            if exceeds(s.error.nrmse.get(), t.max_state_nrmse) || !s.error.finite() {
                f.push(format!(
                    "{} NRMSE {:.2e} > {:.1e} (--max-state-nrmse)",
                    s.name, s.error.nrmse, t.max_state_nrmse
                ));
            }
        }
        f
    }

    /// Whether every threshold held.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}
