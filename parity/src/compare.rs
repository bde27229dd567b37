//! Comparing a device with the reference on the same inputs: tokens, distributions, logits, every layer's hidden
//! state along the run, and the states after the prompt (the measures of [`crate::metrics`]).
//!
//! Per prompt the reference runs twice: free-running greedy (its tokens), then teacher-forced over the prompt and its
//! own tokens with every tap. A device runs three times: free-running greedy and teacher-forced on the reference's
//! tokens with the graphs as deployed (logits and states only), and teacher-forced again with graphs that output
//! every tap, for the hidden states. The report says whether the two kinds of graphs gave the same logits.

use crate::metrics::{
    TensorError, TokenAgreement, exceeds, falls_short, mean, per_slice, percentile, values,
};
use anyhow::{Context, Result, bail};
use candle_core::Tensor;
use reference::backend::{Backend, Forced, RunRecord, greedy, teacher_forced};
use reference::config::LayerKind;
use reference::model::state_names;
use reference::taps::names;
use serde::Serialize;
use std::collections::BTreeMap;

/// When a comparison fails. The defaults depend on the precision that ran ([`Thresholds::for_precision`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Thresholds {
    /// Largest NMSE of the teacher-forced logits.
    pub max_logits_nmse: f64,
    /// Largest mean `KL(P_ref ‖ P_device)` over the teacher-forced positions, in nats.
    pub max_mean_kl: f64,
    /// Smallest share of teacher-forced positions where both choose the same top token.
    pub min_top1: f64,
    /// Most teacher-forced disagreements at confident positions (where the reference's top-two margin exceeds twice
    /// the device's logit error there).
    pub max_confident_flips: usize,
    /// Largest NRMSE of a layer's output (whole run, and any single position).
    pub max_layer_nrmse: f64,
    /// Largest NRMSE of a state after the prompt.
    pub max_state_nrmse: f64,
}

impl Thresholds {
    /// The defaults for a device that computed in `precision` (as read back): tight for f32, at the levels a working
    /// fp16 port shows for f16 and bf16 (hidden states within a few percent, the same greedy tokens).
    pub fn for_precision(precision: &str) -> Self {
        if precision.eq_ignore_ascii_case("f32") {
            Thresholds {
                max_logits_nmse: 1e-8,
                max_mean_kl: 1e-6,
                min_top1: 1.0,
                max_confident_flips: 0,
                max_layer_nrmse: 1e-4,
                max_state_nrmse: 1e-4,
            }
        } else {
            Thresholds {
                max_logits_nmse: 1e-2,
                max_mean_kl: 5e-2,
                min_top1: 0.9,
                max_confident_flips: 0,
                max_layer_nrmse: 5e-2,
                max_state_nrmse: 5e-2,
            }
        }
    }
}

/// The reference's side of one prompt.
pub struct ReferenceRun {
    /// The prompt's label in reports.
    pub label: String,
    /// The prompt's tokens.
    pub prompt: Vec<u32>,
    /// The reference's greedy tokens.
    pub tokens: Vec<u32>,
    /// Teacher-forced over the prompt and its own tokens (but the last), with every tap.
    pub forced: Forced,
}

impl ReferenceRun {
    /// Runs the reference (a backend recording taps) on `prompt` with `generate` greedy tokens.
    pub fn new(
        backend: &mut dyn Backend,
        label: &str,
        prompt: &[u32],
        generate: usize,
    ) -> Result<Self> {
        let tokens = greedy(backend, prompt, generate, &[], false, |_| Ok(()))?.tokens;
        let forced = teacher_forced(backend, prompt, continuation(&tokens))?;
        Ok(ReferenceRun {
            label: label.to_string(),
            prompt: prompt.to_vec(),
            tokens,
            forced,
        })
    }
}

/// The tokens fed back after the prompt: every generated token but the last (which nothing reads).
pub fn continuation(tokens: &[u32]) -> &[u32] {
    &tokens[..tokens.len().saturating_sub(1)]
}

/// Free-running greedy agreement.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GreedyAgreement {
    /// Tokens identical before the first divergence.
    pub matched: usize,
    /// Tokens generated.
    pub total: usize,
    /// Index (among the generated tokens) of the first token that differs.
    pub first_divergence: Option<usize>,
    /// The reference's margin between its two top logits there.
    pub ref_margin_at_divergence: Option<f64>,
    /// The reference's tokens.
    pub reference: Vec<u32>,
    /// The device's tokens.
    pub device: Vec<u32>,
}

/// The class of a teacher-forced position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PositionClass {
    /// Predicting a token of the prompt.
    Prompt,
    /// Predicting a generated token.
    Generated,
}

/// One teacher-forced position.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Position {
    /// Row of the logits (predicting token `index + 1`).
    pub index: usize,
    /// Prompt or generated.
    pub class: PositionClass,
    /// The comparison of the two distributions.
    pub agreement: TokenAgreement,
    /// Largest `|logit − reference logit|` at this position.
    pub logits_max_abs: f64,
    /// Whether the reference's top-two margin is within twice the device's logit error here, so a flip is the
    /// size of the error rather than a fault.
    pub near_tie: bool,
}

/// The error of one tensor of a layer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// The tensor's dump name.
    pub name: String,
    /// The layer, if any.
    pub layer: Option<usize>,
    /// The error over the whole tensor.
    pub error: TensorError,
}

/// A layer's hidden states along the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerTrace {
    /// The layer.
    pub layer: usize,
    /// `linear_attention` or `full_attention`.
    pub kind: &'static str,
    /// The output's error over the whole run.
    pub output: TensorError,
    /// The mixer output's error.
    pub mixer: TensorError,
    /// The MLP output's error.
    pub mlp: TensorError,
    /// The output's NRMSE at every position.
    pub nrmse_by_position: Vec<f64>,
}

/// One prompt compared.
#[derive(Debug, Clone, Serialize)]
pub struct PromptComparison {
    /// The prompt's label.
    pub label: String,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Free-running greedy.
    pub greedy: GreedyAgreement,
    /// Every teacher-forced position.
    pub positions: Vec<Position>,
    /// The teacher-forced logits.
    pub logits: TensorError,
    /// Per layer, from the run with taps.
    pub layers: Vec<LayerTrace>,
    /// The final norm's output.
    pub final_norm: TensorError,
    /// The states after the prompt.
    pub states: Vec<Row>,
    /// Largest difference between the logits of the graphs with taps and as deployed (0: the taps changed
    /// nothing).
    pub tapped_vs_deployed: f64,
    /// Seconds of the deployed free-running prompt and decode.
    pub prompt_seconds: f64,
    /// Seconds of the deployed free-running single-token calls.
    pub decode_seconds: f64,
}

/// Compares a device (as deployed, and with taps) with the reference on one prompt; `eos` are the end-of-sequence
/// ids.
pub fn compare_prompt(
    reference: &ReferenceRun,
    deployed: &mut dyn Backend,
    tapped: &mut dyn Backend,
    eos: &[u32],
) -> Result<PromptComparison> {
    let n = reference.tokens.len();
    let free = greedy(deployed, &reference.prompt, n, &[], false, |_| Ok(()))?;
    let forced = teacher_forced(deployed, &reference.prompt, continuation(&reference.tokens))?;
    let with_taps = teacher_forced(tapped, &reference.prompt, continuation(&reference.tokens))?;
    let tapped_vs_deployed = TensorError::of(&with_taps.run.logits, &forced.run.logits)?.max_abs;
    let kinds = deployed.config().layer_types.clone();
    let mut c = compare_runs(
        &reference.label,
        &kinds,
        Side {
            prompt_tokens: reference.prompt.len(),
            tokens: &reference.tokens,
            logits: &reference.forced.run.logits,
            taps: &reference.forced.run.taps,
            states: &reference.forced.after_prompt.tensors,
        },
        Side {
            prompt_tokens: reference.prompt.len(),
            tokens: &free.tokens,
            logits: &forced.run.logits,
            taps: &with_taps.run.taps,
            states: &with_taps.after_prompt.tensors,
        },
        eos,
    )?;
    c.tapped_vs_deployed = tapped_vs_deployed;
    c.prompt_seconds = free.prompt_seconds;
    c.decode_seconds = free.decode_seconds;
    Ok(c)
}

/// One side of a comparison: what a run produced, under the dump's names.
#[derive(Clone, Copy)]
pub struct Side<'a> {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// The greedy tokens after the prompt.
    pub tokens: &'a [u32],
    /// Logits `[P, V]`: row `i` predicts token `i + 1` (the prompt's rows, then any teacher-forced ones).
    pub logits: &'a Tensor,
    /// Token-major taps over the same rows.
    pub taps: &'a BTreeMap<String, Tensor>,
    /// The states after the prompt.
    pub states: &'a BTreeMap<String, Tensor>,
}

/// Compares two runs of one prompt (the second side measured against the first, the reference), layers of
/// `kinds`; `eos` are the end-of-sequence ids.
pub fn compare_runs(
    label: &str,
    kinds: &[LayerKind],
    reference: Side,
    device: Side,
    eos: &[u32],
) -> Result<PromptComparison> {
    let t = reference.prompt_tokens;
    let ref_rows: Vec<Vec<f64>> = rows(reference.logits)?;
    let dev_rows: Vec<Vec<f64>> = rows(device.logits)?;
    if ref_rows.len() != dev_rows.len() {
        bail!(
            "{} rows of logits against the reference's {}",
            dev_rows.len(),
            ref_rows.len()
        );
    }
    let n = reference.tokens.len().min(device.tokens.len());
    let first_divergence = reference
        .tokens
        .iter()
        .zip(device.tokens)
        .position(|(a, b)| a != b)
        .or((reference.tokens.len() != device.tokens.len()).then_some(n));
    let greedy = GreedyAgreement {
        matched: first_divergence.unwrap_or(n),
        total: reference.tokens.len(),
        first_divergence,
        ref_margin_at_divergence: first_divergence
            .and_then(|i| ref_rows.get(t - 1 + i))
            .map(|r| TokenAgreement::of(r, r, eos).ref_margin),
        reference: reference.tokens.to_vec(),
        device: device.tokens.to_vec(),
    };

    let positions = ref_rows
        .iter()
        .zip(&dev_rows)
        .enumerate()
        .map(|(index, (r, d))| {
            let agreement = TokenAgreement::of(d, r, eos);
            let logits_max_abs = r.iter().zip(d).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
            Position {
                index,
                class: if index + 1 < t {
                    PositionClass::Prompt
                } else {
                    PositionClass::Generated
                },
                agreement,
                logits_max_abs,
                near_tie: agreement.ref_margin <= 2.0 * logits_max_abs,
            }
        })
        .collect();

    let tap = |name: &str| -> Result<(&Tensor, &Tensor)> {
        Ok((
            device
                .taps
                .get(name)
                .with_context(|| format!("the device run has no tap `{name}`"))?,
            reference
                .taps
                .get(name)
                .with_context(|| format!("the reference run has no tap `{name}`"))?,
        ))
    };
    let error = |name: &str| -> Result<TensorError> {
        let (a, b) = tap(name)?;
        TensorError::of(a, b).with_context(|| format!("`{name}`"))
    };
    let mut layers = Vec::with_capacity(kinds.len());
    for (layer, kind) in kinds.iter().enumerate() {
        let output = names::layer(layer, names::OUTPUT);
        let (a, b) = tap(&output)?;
        layers.push(LayerTrace {
            layer,
            kind: kind.name(),
            output: error(&output)?,
            mixer: error(&names::layer(layer, names::MIXER_OUTPUT))?,
            mlp: error(&names::layer(layer, names::MLP_OUTPUT))?,
            nrmse_by_position: per_slice(a, b, 0)?.iter().map(|e| e.nrmse).collect(),
        });
    }
    let mut states = Vec::new();
    for (layer, &kind) in kinds.iter().enumerate() {
        for name in state_names(layer, kind) {
            let (Some(a), Some(b)) = (device.states.get(&name), reference.states.get(&name)) else {
                continue;
            };
            states.push(Row {
                error: TensorError::of(a, b).with_context(|| format!("state `{name}`"))?,
                name,
                layer: Some(layer),
            });
        }
    }
    Ok(PromptComparison {
        label: label.to_string(),
        prompt_tokens: t,
        greedy,
        positions,
        logits: TensorError::of(device.logits, reference.logits)?,
        layers,
        final_norm: error(names::FINAL_NORM)?,
        states,
        tapped_vs_deployed: 0.0,
        prompt_seconds: 0.0,
        decode_seconds: 0.0,
    })
}

/// The rows of a `[T, V]` tensor as f64 vectors.
pub fn rows(t: &Tensor) -> Result<Vec<Vec<f64>>> {
    let (n, v) = t.dims2()?;
    let flat = values(t)?;
    Ok((0..n).map(|i| flat[i * v..(i + 1) * v].to_vec()).collect())
}

/// Teacher-forced agreement over a set of positions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Distribution {
    /// Positions.
    pub positions: usize,
    /// Share where both choose the same top token ("same top p").
    pub same_top1: f64,
    /// Mean share of the reference's top 5 among the device's top 5.
    pub top5_overlap: f64,
    /// `KL(P_ref ‖ P_device)`: mean, 99th percentile and maximum, in nats.
    pub kl_mean: f64,
    /// 99th percentile of the KL.
    pub kl_p99: f64,
    /// Largest KL.
    pub kl_max: f64,
    /// Mean Δp (device minus reference probability of the reference's top token).
    pub delta_p_mean: f64,
    /// RMS of Δp.
    pub delta_p_rms: f64,
    /// Disagreements where the reference's margin is within twice the logit error (near ties).
    pub near_tie_flips: usize,
    /// Disagreements at confident positions: faults.
    pub confident_flips: usize,
    /// Largest `|P_device(eos) − P_ref(eos)|`.
    pub eos_drift_max: f64,
    /// Mean `P_device(eos) − P_ref(eos)`.
    pub eos_drift_mean: f64,
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
        Distribution {
            positions: n,
            same_top1: if n == 0 {
                f64::NAN
            } else {
                p.iter().filter(|x| x.agreement.same_top()).count() as f64 / n as f64
            },
            top5_overlap: mean(
                &p.iter()
                    .map(|x| x.agreement.top5_overlap)
                    .collect::<Vec<_>>(),
            ),
            kl_mean: mean(&kl),
            kl_p99: percentile(&kl, 0.99),
            kl_max: kl.iter().copied().fold(0.0, f64::max),
            delta_p_mean: mean(&dp),
            delta_p_rms: mean(&dp.iter().map(|x| x * x).collect::<Vec<_>>()).sqrt(),
            near_tie_flips: flips(true),
            confident_flips: flips(false),
            eos_drift_max: eos.iter().fold(0f64, |m, x| m.max(x.abs())),
            eos_drift_mean: mean(&eos),
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
    /// The final norm, the worst over the prompts.
    pub final_norm: TensorError,
    /// Per state, the worst over the prompts.
    pub states: Vec<Row>,
    /// Largest logits difference between the graphs with taps and as deployed.
    pub tapped_vs_deployed: f64,
    /// Where the device first leaves tolerance.
    pub first_divergence: FirstDivergence,
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
    /// Every prompt.
    pub prompts: Vec<PromptComparison>,
}

/// The worse of two errors, by NRMSE.
fn worse(a: TensorError, b: TensorError) -> TensorError {
    if b.nrmse > a.nrmse || (!b.finite() && a.finite()) {
        b
    } else {
        a
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
                acc.mixer = worse(acc.mixer, l.mixer);
                acc.mlp = worse(acc.mlp, l.mlp);
            }
            for (acc, s) in states.iter_mut().zip(&p.states) {
                acc.error = worse(acc.error, s.error);
            }
            logits = worse(logits, p.logits);
            final_norm = worse(final_norm, p.final_norm);
        }
        // Positions along the run: the first prompt's trace (the per-prompt traces are in `prompts`).
        let layer_over = layers
            .iter()
            .find(|l| exceeds(l.output.nrmse, thresholds.max_layer_nrmse) || !l.output.finite())
            .map(|l| (l.layer, l.output.nrmse));
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
            tapped_vs_deployed: prompts
                .iter()
                .map(|p| p.tapped_vs_deployed)
                .fold(0.0, f64::max),
            first_divergence: FirstDivergence {
                layer: layer_over,
                position: position_over,
                token,
            },
            prompt_tokens_per_s: prompt_tokens as f64 / prompt_s.max(1e-9),
            decode_tokens_per_s: decode_tokens as f64 / decode_s.max(1e-9),
            failures: vec![],
            tensors: vec![],
            only_in_actual: vec![],
            only_in_reference: vec![],
            prompts,
        };
        report.failures = report.check();
        report
    }

    /// Every threshold the report exceeds, as sentences.
    fn check(&self) -> Vec<String> {
        let t = &self.thresholds;
        let mut f = Vec::new();
        if exceeds(self.logits.nmse, t.max_logits_nmse) || !self.logits.finite() {
            f.push(format!(
                "logits NMSE {:.2e} > {:.1e} (--max-nmse)",
                self.logits.nmse, t.max_logits_nmse
            ));
        }
        if exceeds(self.all.kl_mean, t.max_mean_kl) {
            f.push(format!(
                "mean KL {:.2e} > {:.1e} (--max-kl)",
                self.all.kl_mean, t.max_mean_kl
            ));
        }
        if falls_short(self.all.same_top1, t.min_top1) {
            f.push(format!(
                "same top-1 {:.1}% < {:.1}% (--min-token-agreement)",
                100.0 * self.all.same_top1,
                100.0 * t.min_top1
            ));
        }
        if self.all.confident_flips > t.max_confident_flips {
            f.push(format!(
                "{} confident teacher-forced disagreements > {} (--max-confident-flips)",
                self.all.confident_flips, t.max_confident_flips
            ));
        }
        for l in &self.layers {
            if exceeds(l.output.nrmse, t.max_layer_nrmse) || !l.output.finite() {
                f.push(format!(
                    "layer {} output NRMSE {:.2e} > {:.1e} (--max-layer-nrmse)",
                    l.layer, l.output.nrmse, t.max_layer_nrmse
                ));
            }
        }
        for s in &self.states {
            if exceeds(s.error.nrmse, t.max_state_nrmse) || !s.error.finite() {
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
