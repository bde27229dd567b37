//! Comparing a device with the reference on the same inputs: tokens, distributions, logits, every layer's hidden
//! state along the run, and the states after the prompt (the measures of [`crate::metrics`]).
//!
//! Per prompt the reference runs twice: free-running greedy (its tokens), then teacher-forced over the prompt and its
//! own tokens with every tap. A device runs three times: free-running greedy and teacher-forced on the reference's
//! tokens with the graphs as deployed (logits and states only), and teacher-forced again with graphs that output
//! every tap, for the hidden states. The report says whether the two kinds of graphs gave the same logits. Each
//! kind runs every prompt before the next is compiled, and is released after, so that one copy of the weights is
//! resident at a time.

mod aggregate;
pub mod run;

pub use aggregate::{DeviceReport, Distribution, FirstDivergence, FirstNonFinite};

use crate::device::{Capabilities, DeviceUnderTest};
use crate::images::PromptInput;
use crate::metrics::{Measure, TensorError, TokenAgreement, max_abs_diff, per_slice, values};
use crate::non_finite::{NonFinite, scan_all};
use crate::routing::{self, RoutingReport};
use anyhow::{Context, Result, bail};
use candle_core::Tensor;
use reference::backend::{Backend, Forced, Generation, Precision};
use reference::config::LayerKind;
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
    /// A router probability error the device's router logits do not show (all of it for a device that outputs
    /// none), added to the measured one when its routing flips are classified (`None`: the measured error alone;
    /// see [`crate::routing`]).
    pub router_tolerance: Option<f64>,
}

impl Thresholds {
    /// The defaults for a device that computed in `precision` (as read back): [`crate::thresholds`]'s.
    pub fn for_precision(precision: &Precision) -> Self {
        let d = crate::thresholds::for_precision(precision);
        Thresholds {
            max_logits_nmse: d.logits_nmse,
            max_mean_kl: d.mean_kl,
            min_top1: d.min_top1,
            max_confident_flips: d.confident_flips,
            max_layer_nrmse: d.layer_nrmse,
            max_state_nrmse: d.state_nrmse,
            router_tolerance: None,
        }
    }
}

/// Thresholds given on the command line, each overriding its default for the precision that ran.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ThresholdOverrides {
    /// `--max-nmse`.
    pub max_nmse: Option<f64>,
    /// `--max-kl`.
    pub max_kl: Option<f64>,
    /// `--min-token-agreement`.
    pub min_token_agreement: Option<f64>,
    /// `--max-confident-flips`.
    pub max_confident_flips: Option<usize>,
    /// `--max-layer-nrmse`.
    pub max_layer_nrmse: Option<f64>,
    /// `--max-state-nrmse`.
    pub max_state_nrmse: Option<f64>,
    /// `--router-tolerance`.
    pub router_tolerance: Option<f64>,
}

impl ThresholdOverrides {
    /// The thresholds for a device that computed in `precision`: the defaults, overridden where given.
    pub fn resolve(&self, precision: &Precision) -> Thresholds {
        let d = Thresholds::for_precision(precision);
        Thresholds {
            max_logits_nmse: self.max_nmse.unwrap_or(d.max_logits_nmse),
            max_mean_kl: self.max_kl.unwrap_or(d.max_mean_kl),
            min_top1: self.min_token_agreement.unwrap_or(d.min_top1),
            max_confident_flips: self.max_confident_flips.unwrap_or(d.max_confident_flips),
            max_layer_nrmse: self.max_layer_nrmse.unwrap_or(d.max_layer_nrmse),
            max_state_nrmse: self.max_state_nrmse.unwrap_or(d.max_state_nrmse),
            router_tolerance: self.router_tolerance.or(d.router_tolerance),
        }
    }

    /// Fails on a threshold outside its range, naming the flag.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("--max-nmse", self.max_nmse),
            ("--max-kl", self.max_kl),
            ("--max-layer-nrmse", self.max_layer_nrmse),
            ("--max-state-nrmse", self.max_state_nrmse),
            ("--router-tolerance", self.router_tolerance),
        ];
        for (flag, v) in positive {
            if let Some(v) = v
                && !(v >= 0.0 && v.is_finite())
            {
                bail!("{flag} {v}: must be a finite number ≥ 0");
            }
        }
        if let Some(v) = self.min_token_agreement
            && !(0.0..=1.0).contains(&v)
        {
            bail!("--min-token-agreement {v}: must be between 0 and 1");
        }
        Ok(())
    }
}

/// The reference's side of one prompt.
pub struct ReferenceRun {
    /// The prompt's label in reports.
    pub label: String,
    /// The prompt's tokens.
    pub prompt: Vec<u32>,
    /// What the reference ran (its ids, or the prompt with its own vision tower's image rows).
    pub input: PromptInput,
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
        Self::of_input(backend, label, PromptInput::Ids(prompt.to_vec()), generate)
    }

    /// [`ReferenceRun::new`] of any prompt (one with images too).
    pub fn of_input(
        backend: &mut dyn Backend,
        label: &str,
        input: PromptInput,
        generate: usize,
    ) -> Result<Self> {
        let prompt = input.ids().to_vec();
        let g = input.greedy(backend, generate, false)?;
        if let Some(i) = g.nan_at {
            bail!(
                "the reference's logits hold a NaN at generated token {i}: the checkpoint is broken"
            );
        }
        let tokens = g.tokens;
        let forced = input.forced(backend, continuation(&tokens))?;
        Ok(ReferenceRun {
            label: label.to_string(),
            prompt,
            input,
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
    /// The generated token at which the device's logits held a NaN (its generation stopped there).
    pub device_nan_at: Option<usize>,
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
    /// size of the error rather than a fault (never where either side's logits are not finite).
    pub near_tie: bool,
}

impl Position {
    /// Row `index` of a teacher-forced run over a prompt of `prompt_tokens`: `device` against `reference`.
    pub fn of(
        index: usize,
        prompt_tokens: usize,
        reference: &[f64],
        device: &[f64],
        eos: &[u32],
    ) -> Self {
        let agreement = TokenAgreement::of(device, reference, eos);
        let logits_max_abs = max_abs_diff(reference, device);
        Position {
            index,
            class: if index + 1 < prompt_tokens {
                PositionClass::Prompt
            } else {
                PositionClass::Generated
            },
            agreement,
            logits_max_abs,
            near_tie: agreement.non_finite == 0
                && agreement.ref_non_finite == 0
                && agreement.ref_margin <= 2.0 * logits_max_abs,
        }
    }
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
    /// `linear_attention`, `full_attention`, or `unknown` (a dump that does not say).
    pub kind: &'static str,
    /// The output's error over the whole run.
    pub output: TensorError,
    /// The mixer output's error (`None`: one side has no mixer output).
    pub mixer: Option<TensorError>,
    /// The MLP output's error (`None`: one side has no MLP output).
    pub mlp: Option<TensorError>,
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
    /// The final norm's output (`None` when the backend exposes no hidden state).
    pub final_norm: Option<TensorError>,
    /// The states after the prompt.
    pub states: Vec<Row>,
    /// Every tensor of the device's side (logits, hidden states, states) holding NaN or infinity, in the order the
    /// decoder computes them: the first is where the fault shows first.
    pub non_finite: Vec<NonFinite>,
    /// The same for the reference's side (a dump given as the reference can hold them).
    pub reference_non_finite: Vec<NonFinite>,
    /// Why the layers, the final norm and the states were not compared (a backend that exposes neither, such as
    /// an external IR); `None` when they were.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_available: Option<String>,
    /// An MoE model's routing against the reference's, where both sides expose the chosen experts (in the JSON
    /// once, merged over the prompts, as the device's `routing`).
    #[serde(skip)]
    pub routing: Option<RoutingReport>,
    /// Largest difference between the logits of the graphs with taps and as deployed (0: the taps changed
    /// nothing).
    pub tapped_vs_deployed: Measure,
    /// Seconds of the deployed free-running prompt and decode.
    pub prompt_seconds: f64,
    /// Seconds of the deployed free-running single-token calls.
    pub decode_seconds: f64,
}

/// What the deployed graphs gave on one prompt: free-running greedy, then teacher-forced on the reference's tokens.
pub struct DeployedRun {
    /// The free-running greedy run.
    pub free: Generation,
    /// Teacher-forced on the reference's tokens.
    pub forced: Forced,
}

/// Runs the deployed graphs on `input` (one reference run's prompt, with the device's own image rows if any):
/// free-running greedy for as many tokens as the reference made, then teacher-forced on the reference's tokens.
pub fn deployed_run(
    reference: &ReferenceRun,
    input: &PromptInput,
    dut: &mut dyn DeviceUnderTest,
) -> Result<DeployedRun> {
    let n = reference.tokens.len();
    let free = input.greedy(dut.deployed()?, n, false)?;
    let forced = input.forced(dut.deployed()?, continuation(&reference.tokens))?;
    Ok(DeployedRun { free, forced })
}

/// The tapped graphs teacher-forced on one reference run's tokens, when they are other graphs than the deployed ones
/// (`None` otherwise: the deployed run carries whatever hidden outputs there are).
pub fn tapped_run(
    reference: &ReferenceRun,
    input: &PromptInput,
    dut: &mut dyn DeviceUnderTest,
) -> Result<Option<Forced>> {
    match dut.tapped()? {
        Some(tapped) => Ok(Some(input.forced(tapped, continuation(&reference.tokens))?)),
        None => Ok(None),
    }
}

/// Compares a device under test with the reference on one prompt, from what its graphs gave there
/// ([`deployed_run`], [`tapped_run`]); `eos` are the end-of-sequence ids. Tokens and logits come from the graphs as
/// deployed (free-running greedy, then teacher-forced on the reference's tokens); hidden states and states from the
/// graphs with taps where they are other graphs, else from the deployed ones; what the device does not expose is
/// named in [`PromptComparison::not_available`].
pub fn compare_prompt(
    reference: &ReferenceRun,
    caps: &Capabilities,
    kinds: &[Option<LayerKind>],
    deployed: &DeployedRun,
    tapped: Option<&Forced>,
    eos: &[u32],
) -> Result<PromptComparison> {
    let (free, forced) = (&deployed.free, &deployed.forced);
    let tapped_vs_deployed = match tapped {
        Some(t) => TensorError::of(&t.run.logits, &forced.run.logits)?.max_abs,
        // The taps were read from the deployed graphs themselves.
        None => Measure::Defined(0.0),
    };
    let taps = tapped.unwrap_or(forced);
    let mut c = compare_runs(
        &reference.label,
        kinds,
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
            taps: &taps.run.taps,
            states: &taps.after_prompt.tensors,
        },
        eos,
    )?;
    let mut missing = Vec::new();
    if !caps.hidden {
        missing.push(
            "hidden states: the graphs output none (a set maps them under `decoder.taps`)"
                .to_string(),
        );
    }
    if !caps.states {
        missing.push(format!("states: {}", caps.states_note));
    }
    c.not_available = (!missing.is_empty()).then(|| missing.join("; "));
    c.tapped_vs_deployed = tapped_vs_deployed;
    c.greedy.device_nan_at = free.nan_at;
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

/// Compares two runs of one prompt (the second side measured against the first, the reference), over whatever both
/// sides hold: each layer whose output both have (its mixer and MLP outputs where both have them), the final norm,
/// every state both have, and an MoE model's routing where both have the chosen experts. `kinds` are the layers' kinds where known; `eos` are the end-of-sequence ids.
pub fn compare_runs(
    label: &str,
    kinds: &[Option<LayerKind>],
    reference: Side,
    device: Side,
    eos: &[u32],
) -> Result<PromptComparison> {
    let mut c = compare_tokens(label, reference, device, eos)?;
    let both = |name: &str| -> Option<(&Tensor, &Tensor)> {
        Some((device.taps.get(name)?, reference.taps.get(name)?))
    };
    let error = |name: &str| -> Result<Option<TensorError>> {
        both(name)
            .map(|(a, b)| TensorError::of(a, b).with_context(|| format!("`{name}`")))
            .transpose()
    };
    for (layer, kind) in kinds.iter().enumerate() {
        let output = names::layer(layer, names::OUTPUT);
        let Some((a, b)) = both(&output) else {
            continue;
        };
        c.layers.push(LayerTrace {
            layer,
            kind: kind.map_or("unknown", |k| k.name()),
            output: TensorError::of(a, b).with_context(|| format!("`{output}`"))?,
            mixer: error(&names::layer(layer, names::MIXER_OUTPUT))?,
            mlp: error(&names::layer(layer, names::MLP_OUTPUT))?,
            nrmse_by_position: per_slice(a, b, 0)?.iter().map(|e| e.nrmse.get()).collect(),
        });
    }
    for layer in 0..kinds.len() {
        for kind in npu::graphset::StateKind::ALL {
            let name = kind.dump_name(layer);
            let (Some(a), Some(b)) = (device.states.get(&name), reference.states.get(&name)) else {
                continue;
            };
            c.states.push(Row {
                error: TensorError::of(a, b).with_context(|| format!("state `{name}`"))?,
                name,
                layer: Some(layer),
            });
        }
    }
    c.final_norm = error(names::FINAL_NORM)?;
    c.routing = routing::from_taps(label, kinds.len(), reference.taps, device.taps)?;
    c.non_finite = non_finite_of(&device)?;
    c.reference_non_finite = non_finite_of(&reference)?;
    Ok(c)
}

/// Every tensor of one side holding a non-finite value (its logits, taps and states), in computation order.
fn non_finite_of(side: &Side) -> Result<Vec<NonFinite>> {
    let logits = names::LOGITS.to_string();
    scan_all(
        std::iter::once((&logits, side.logits))
            .chain(side.taps.iter())
            .chain(side.states.iter()),
    )
}

/// The token-level part of [`compare_runs`]: greedy agreement, every teacher-forced position and the logits (no
/// layers, final norm or states).
pub fn compare_tokens(
    label: &str,
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
        device_nan_at: None,
    };

    let positions = ref_rows
        .iter()
        .zip(&dev_rows)
        .enumerate()
        .map(|(index, (r, d))| Position::of(index, t, r, d, eos))
        .collect();

    Ok(PromptComparison {
        label: label.to_string(),
        prompt_tokens: t,
        greedy,
        positions,
        logits: TensorError::of(device.logits, reference.logits)?,
        layers: Vec::new(),
        final_norm: None,
        states: Vec::new(),
        non_finite: Vec::new(),
        reference_non_finite: Vec::new(),
        not_available: None,
        routing: None,
        tapped_vs_deployed: Measure::Defined(0.0),
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
