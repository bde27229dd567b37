//! `qwen35 validate`: every check a new NPU (driver, compiler, port) needs, run on one device, each with a verdict.
//!
//! - **Setup**: the graphs ran where asked ([`setup`]: no subgraph on another device, NPUW's failover off) and in
//!   the precision asked.
//! - **Against the reference**: compare-devices over the prompt set, and the per-layer probe (the commands' own
//!   code).
//! - **The port's equivalences, the device against itself** ([`equivalence`]): prompt blocks of 1, 16 and 64;
//!   padded and unpadded prompts; a follow-up turn on a reused state against the whole conversation from scratch;
//!   prompt-lookup decoding against plain greedy; two sequences back to back against the second alone.
//! - **Length** ([`length`]): agreement with the reference against prompt length up to the static context, the
//!   first failing length found by bisection, and a prompt longer than the context refused.
//!
//! Every check is written once against the device under test ([`crate::device::DeviceUnderTest`]), whoever built
//! its graphs, and runs where the device's capabilities allow it: on a graph set made elsewhere the probe runs
//! through its per-layer graphs or its states, padding where `token_valid` is mapped, prompt lookup and prefix reuse
//! by snapshot and restore where the states are ports. A check that cannot run says which port it would need and is
//! skipped (a skipped check neither passes nor fails, [`run::skip_reason`]).
//!
//! A check that cannot run for another reason (a graph that does not compile, a device error) fails with the error as
//! its reason; the others still run.

pub mod equivalence;
pub mod images;
pub mod length;
pub mod lookup;
pub mod run;
pub mod setup;

use crate::compare::Thresholds;
use crate::metrics::{Measure, TensorError, Why, exceeds, max_abs_diff, values};
use crate::progress::Progress;
use crate::prompts::LabelledPrompt;
use anyhow::{Context as _, Result, bail};
use candle_core::Tensor;
use reference::backend::{Backend, Generation, Snapshot, greedy};
use reference::config::Config;
use serde::Serialize;
use std::time::Instant;

pub use crate::device::GraphInfo;

/// The checks, in the order the report lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckId {
    /// Every graph ran on the device asked, none fell back to another.
    ExecutionDevices,
    /// Every graph computed in the precision asked.
    Precision,
    /// compare-devices over the prompt set.
    Compare,
    /// A prompt with images: the device's vision graph, its text with its own image rows, the rope delta.
    Images,
    /// The per-layer probe.
    Probe,
    /// Prompt blocks of 1, 16 and 64 give the same tokens.
    Blocks,
    /// A padded prompt block gives what the same prompt unpadded gives.
    Padding,
    /// A follow-up turn on the reused state gives the from-scratch tokens.
    PrefixReuse,
    /// Prompt-lookup decoding gives plain greedy's tokens.
    PromptLookup,
    /// Two sequences back to back leave no state behind.
    BackToBack,
    /// Agreement with the reference against prompt length.
    Length,
    /// A prompt longer than the static context is refused.
    OverLong,
}

impl CheckId {
    /// The command-line and JSON name.
    pub fn name(self) -> &'static str {
        match self {
            CheckId::ExecutionDevices => "execution-devices",
            CheckId::Precision => "precision",
            CheckId::Compare => "compare",
            CheckId::Images => "images",
            CheckId::Probe => "probe",
            CheckId::Blocks => "blocks",
            CheckId::Padding => "padding",
            CheckId::PrefixReuse => "prefix-reuse",
            CheckId::PromptLookup => "prompt-lookup",
            CheckId::BackToBack => "back-to-back",
            CheckId::Length => "length",
            CheckId::OverLong => "over-long",
        }
    }

    /// What the check asserts, in a few words.
    pub fn title(self) -> &'static str {
        match self {
            CheckId::ExecutionDevices => "every graph ran on the device asked",
            CheckId::Precision => "every graph computed in the precision asked",
            CheckId::Compare => "compare-devices over the prompt set",
            CheckId::Images => {
                "a prompt with images: the device's vision graph and its text, the text after the images"
            }
            CheckId::Probe => "every layer's own graph against the reference",
            CheckId::Blocks => "prompt blocks of different sizes give the same tokens",
            CheckId::Padding => "a padded prompt block equals the prompt unpadded",
            CheckId::PrefixReuse => {
                "a follow-up turn on the reused state equals the conversation from scratch"
            }
            CheckId::PromptLookup => "prompt-lookup decoding gives plain greedy's tokens",
            CheckId::BackToBack => "a sequence after another equals it alone on a fresh device",
            CheckId::Length => "agreement with the reference up to the static context",
            CheckId::OverLong => "a prompt longer than the static context is refused",
        }
    }

    /// Where to look next when the check fails.
    pub fn next(self) -> &'static str {
        match self {
            CheckId::ExecutionDevices => {
                "EXECUTION_DEVICES per graph below; the device config's NPUW_* fallback settings"
            }
            CheckId::Precision => {
                "the precision read back per graph below; --allow-precision accepts a known substitute"
            }
            CheckId::Compare => {
                "qwen35 compare-devices --report r.md (the appendix below): first layer over threshold"
            }
            CheckId::Images => {
                "qwen35 probe --image (each vision block's own graph, the decoder's layers on the image rows); the \
                 rope delta a state keeps after an image (snapshot, restore, reset)"
            }
            CheckId::Probe => {
                "qwen35 probe --mode isolated: the layer and the op where the error starts"
            }
            CheckId::Blocks => {
                "the padded block graph: qwen35 probe --block N, and the token_valid masking"
            }
            CheckId::Padding => {
                "token_valid masking of padded rows (decay and write strength), the attention mask of the padding"
            }
            CheckId::PrefixReuse => {
                "the state hand-off: snapshot/restore of conv and recurrent states and of the KV cache positions"
            }
            CheckId::PromptLookup => {
                "the verify block's logits of every row, and the restore before re-feeding the accepted tokens"
            }
            CheckId::BackToBack => {
                "reset: a state the device keeps between sequences (stateful graphs, caches)"
            }
            CheckId::Length => {
                "qwen35 probe --mode chained on a prompt of the first failing length: the state drift per block"
            }
            CheckId::OverLong => "the static context check before a prompt is run (--context)",
        }
    }

    /// Every check, in order.
    pub const ALL: [CheckId; 12] = [
        CheckId::ExecutionDevices,
        CheckId::Precision,
        CheckId::Compare,
        CheckId::Images,
        CheckId::Probe,
        CheckId::Blocks,
        CheckId::Padding,
        CheckId::PrefixReuse,
        CheckId::PromptLookup,
        CheckId::BackToBack,
        CheckId::Length,
        CheckId::OverLong,
    ];
}

/// What a check found.
#[derive(Debug, Clone, Default)]
pub struct Finding {
    /// Why the check did not apply (then it does not fail).
    pub skipped: Option<String>,
    /// The key figure, one line.
    pub figure: String,
    /// Why it failed (empty: it passed).
    pub failures: Vec<String>,
    /// What else the report should say.
    pub notes: Vec<String>,
    /// Everything measured, for the JSON report.
    pub details: serde_json::Value,
}

/// One check's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// The check.
    pub id: CheckId,
    /// What it asserts.
    pub title: &'static str,
    /// Whether it passed: `None` when it was skipped (it did not apply, so it neither passes nor fails).
    pub passed: Option<bool>,
    /// Why it did not apply, if it did not.
    pub skipped: Option<String>,
    /// The key figure.
    pub figure: String,
    /// Why it failed.
    pub failures: Vec<String>,
    /// Further remarks.
    pub notes: Vec<String>,
    /// Where to look next on failure.
    pub next: &'static str,
    /// Wall-clock seconds it took.
    pub seconds: f64,
    /// Everything measured.
    pub details: serde_json::Value,
}

impl Check {
    /// Runs `f` as check `id`: an error becomes a failure naming it (the other checks still run).
    pub fn run(id: CheckId, progress: &Progress, f: impl FnOnce() -> Result<Finding>) -> Check {
        progress.step(id.name());
        let start = Instant::now();
        let finding = f().unwrap_or_else(|e| Finding {
            figure: "could not run".into(),
            failures: vec![format!("could not run: {e:#}")],
            ..Finding::default()
        });
        Check::of(id, finding, start.elapsed().as_secs_f64())
    }

    /// The check `id` from what it found.
    pub fn of(id: CheckId, f: Finding, seconds: f64) -> Check {
        Check {
            id,
            title: id.title(),
            passed: (f.skipped.is_none() || !f.failures.is_empty())
                .then_some(f.failures.is_empty()),
            skipped: f.skipped,
            figure: f.figure,
            failures: f.failures,
            notes: f.notes,
            next: id.next(),
            seconds,
            details: f.details,
        }
    }
}

impl Check {
    /// Whether it ran and failed.
    pub fn failed(&self) -> bool {
        self.passed == Some(false)
    }

    /// `PASS`, `FAIL` or `SKIP`.
    pub fn verdict(&self) -> &'static str {
        match self.passed {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "SKIP",
        }
    }
}

/// What every check shares: the model, the prompts and the thresholds for the precision the device read back.
pub struct Context<'a> {
    /// The model's config.
    pub config: &'a Config,
    /// The prompt set.
    pub set: &'a [LabelledPrompt],
    /// A prompt that repeats itself (drafts hit).
    pub repeated: &'a LabelledPrompt,
    /// Greedy tokens per prompt.
    pub tokens: usize,
    /// End-of-sequence ids.
    pub eos: &'a [u32],
    /// The thresholds for the precision the device read back.
    pub thresholds: Thresholds,
}

/// Two runs of the same tokens compared: the run under test against a base run (another graph, another path, or
/// the reference).
#[derive(Debug, Clone, Serialize)]
pub struct Agreement {
    /// What was compared.
    pub label: String,
    /// Tokens of the base run.
    pub tokens: usize,
    /// Tokens identical before the first divergence.
    pub matched: usize,
    /// The first token that differs (or where one run stopped and the other did not).
    pub first_divergence: Option<usize>,
    /// At the first divergence: the base run's margin between its two top logits, and the largest difference
    /// between the two runs' logits there.
    pub margin_at_divergence: Option<(f64, f64)>,
    /// The logits each token was chosen from, over the tokens both chose from the same history (up to and with
    /// the first divergence), against the base run's.
    pub logits: TensorError,
}

impl Agreement {
    /// Whether the two runs are token-identical: no divergence over at least one token, and logits defined over
    /// them (no verdict is reached over NaN or over nothing).
    pub fn identical(&self) -> bool {
        self.first_divergence.is_none() && self.tokens > 0 && self.logits.finite()
    }

    /// Compares `tokens` (chosen from `logits`) with the base run's.
    pub fn of(label: &str, base: (&[u32], &[Tensor]), test: (&[u32], &[Tensor])) -> Result<Self> {
        let n = base.0.len().min(test.0.len());
        let first_divergence = base.0.iter().zip(test.0).position(|(a, b)| a != b).or((base
            .0
            .len()
            != test.0.len())
        .then_some(n));
        let rows = first_divergence.map_or(n, |d| (d + 1).min(n));
        let logits = if rows == 0 {
            TensorError::of_slices(&[], &[])
        } else {
            TensorError::of(
                &Tensor::stack(&test.1[..rows], 0)?,
                &Tensor::stack(&base.1[..rows], 0)?,
            )?
        };
        let margin_at_divergence = match first_divergence {
            Some(d) if d < n => {
                let (b, t) = (values(&base.1[d])?, values(&test.1[d])?);
                let diff = max_abs_diff(&b, &t);
                let mut sorted = b.clone();
                sorted.sort_by(|x, y| y.total_cmp(x));
                Some((
                    sorted[0] - sorted.get(1).copied().unwrap_or(f64::NEG_INFINITY),
                    diff,
                ))
            }
            _ => None,
        };
        Ok(Agreement {
            label: label.to_string(),
            tokens: base.0.len(),
            matched: first_divergence.unwrap_or(n),
            first_divergence,
            margin_at_divergence,
            logits,
        })
    }

    /// Whether the first divergence is a near tie: the base run's top-two margin there within twice the two runs'
    /// largest logit difference there (compare-devices' rule), so the flip is the size of the arithmetic's error,
    /// and that error itself acceptable (the logits finite and within `max_nmse`): a divergence where the logits
    /// are far apart is a failure, whatever the margin.
    pub fn near_tie(&self, max_nmse: f64) -> bool {
        self.logits.finite()
            && !exceeds(self.logits.nmse.get(), max_nmse)
            && self
                .margin_at_divergence
                .is_some_and(|(margin, diff)| margin <= 2.0 * diff)
    }

    /// The failures of an equivalence of two computations of the same thing. With `max_nmse` (two different
    /// computations) the tokens must be identical up to a near tie and the logits within `max_nmse`; without it
    /// (the same computation twice) tokens and logits must be bit-identical.
    pub fn failures(&self, what: &str, max_nmse: Option<f64>) -> Vec<String> {
        let mut f = Vec::new();
        if let Some(d) = self.first_divergence {
            let tie = max_nmse.is_some_and(|max| self.near_tie(max));
            if !tie {
                f.push(format!(
                    "{what}, `{}`: token {d} differs ({} of {} identical){}",
                    self.label,
                    self.matched,
                    self.tokens,
                    self.margin_at_divergence
                        .map_or(String::new(), |(m, diff)| format!(
                            "; margin {m:.2e} there, logits {diff:.2e} apart"
                        ))
                ));
            }
        }
        match max_nmse {
            Some(max) if exceeds(self.logits.nmse.get(), max) || !self.logits.finite() => {
                f.push(format!(
                    "{what}, `{}`: logits NMSE {:.2e} > {max:.1e} (--max-nmse)",
                    self.label, self.logits.nmse
                ))
            }
            None if self.logits.max_abs.get() != 0.0 || !self.logits.finite() => f.push(format!(
                "{what}, `{}`: logits differ by up to {:.2e} (bit-identical expected)",
                self.label, self.logits.max_abs
            )),
            _ => {}
        }
        f
    }

    /// A note on a divergence forgiven as a near tie under `max_nmse` (`None`: none).
    pub fn tie_note(&self, what: &str, max_nmse: f64) -> Option<String> {
        let (d, (m, diff)) = (self.first_divergence?, self.margin_at_divergence?);
        self.near_tie(max_nmse).then(|| {
            format!(
                "{what}, `{}`: token {d} differs at a near tie (margin {m:.2e} ≤ 2 × {diff:.2e}, the logits' \
                 difference there); {} of {} identical",
                self.label, self.matched, self.tokens
            )
        })
    }
}

/// How far one state is from another.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StateDiff {
    /// The state tensor with the largest NRMSE.
    pub worst: String,
    /// Its NRMSE (undefined when a state holds NaN or infinity, or when there is no state tensor).
    pub nrmse: Measure,
    /// The largest `|a − b|` over every state tensor (undefined as the NRMSE).
    pub max_abs: Measure,
    /// Whether every value of both states is finite.
    pub finite: bool,
}

impl StateDiff {
    /// `test` against `base`: the same position and the same tensors, compared one by one.
    pub fn of(test: &Snapshot, base: &Snapshot) -> Result<Self> {
        if test.position != base.position {
            bail!(
                "the states are at positions {} and {}",
                test.position,
                base.position
            );
        }
        let none = Measure::Undefined(Why::Empty);
        let mut diff = StateDiff {
            worst: String::new(),
            nrmse: none,
            max_abs: none,
            finite: true,
        };
        for (name, b) in &base.tensors {
            let Some(t) = test.tensors.get(name) else {
                bail!("one state has `{name}` and the other not");
            };
            let e = TensorError::of(t, b).with_context(|| format!("state `{name}`"))?;
            // The first undefined measure stays: no number is taken over values that hold NaN.
            diff.max_abs = match diff.max_abs {
                Measure::Undefined(Why::Empty) => e.max_abs,
                m => m.worst(e.max_abs),
            };
            diff.finite &= e.finite();
            let replace = match diff.nrmse {
                Measure::Undefined(Why::Empty) => true,
                Measure::Undefined(_) => false,
                Measure::Defined(worst) => !e.nrmse.is_defined() || e.nrmse.get() > worst,
            };
            if diff.worst.is_empty() || replace {
                diff.worst = name.clone();
                diff.nrmse = e.nrmse;
            }
        }
        diff.finite &= diff.nrmse.is_defined();
        Ok(diff)
    }
}

/// The state `test` against `base`, a failure under `what` in `failures` when it is over `--max-state-nrmse` or
/// not finite.
pub(crate) fn state_within(
    test: &Snapshot,
    base: &Snapshot,
    what: &str,
    max_state_nrmse: f64,
    failures: &mut Vec<String>,
) -> Result<StateDiff> {
    let s = StateDiff::of(test, base)?;
    if exceeds(s.nrmse.get(), max_state_nrmse) || !s.finite {
        failures.push(format!(
            "{what}: {} NRMSE {:.2e} > {max_state_nrmse:.1e} (--max-state-nrmse)",
            s.worst, s.nrmse
        ));
    }
    Ok(s)
}

/// ` (N at near ties)` when some runs diverged at a near tie.
pub(crate) fn ties_text(ties: usize) -> String {
    match ties {
        0 => String::new(),
        1 => " (1 diverges at a near tie)".into(),
        n => format!(" ({n} diverge at near ties)"),
    }
}

/// Greedy on `dev`, its NaN (if any) recorded in `failures` under `what`.
pub(crate) fn greedy_on(
    dev: &mut dyn Backend,
    ids: &[u32],
    tokens: usize,
    all_logits: bool,
    what: &str,
    failures: &mut Vec<String>,
) -> Result<Generation> {
    let g = greedy(dev, ids, tokens, &[], all_logits, |_| Ok(()))?;
    if let Some(i) = g.nan_at {
        failures.push(format!(
            "{what}: the logits hold a NaN at generated token {i}"
        ));
    }
    Ok(g)
}

/// Serializes check details (never fails for the plain structs of this module).
pub fn details<T: Serialize>(value: &T) -> serde_json::Value {
    serde_json::to_value(value).unwrap_or(serde_json::Value::Null)
}
