//! Length: agreement with the reference against prompt length, up to the static context, and a prompt longer than
//! the context refused.
//!
//! The prompts are prefixes of one sequence (the prompt set's tokens, concatenated and repeated). At each length
//! `L` the device runs the prompt of `L` tokens from a fresh state, then one decode step on the sequence's next
//! token; both rows of logits and the state after the prompt are compared with the reference's. Probe points halve
//! from the longest length down; the first failing length is then found by bisection between the last passing
//! point below it and it, which assumes that a device once broken at some length stays broken at every longer one
//! (recurrent-state and cache-position failures do); the report says when a longer point passed after a failure.
//!
//! The reference runs the sequence incrementally (its state at a shorter length carried on), which is exact: the
//! reference computes a prompt fed in pieces as it computes it whole.
//!
//! Both checks run on any backend: on one that does not expose its state (an external IR) the length check compares
//! the logits only, and a backend without a static context has no over-long prompt to refuse.

use super::{Context, Finding, StateDiff, details};
use crate::compare::Thresholds;
use crate::device::{Capabilities, check_context};
use crate::metrics::{Measure, TensorError, TokenAgreement, Why, exceeds, max_abs_diff, values};
use crate::prompts::LabelledPrompt;
use anyhow::{Result, bail};
use candle_core::Tensor;
use reference::backend::{Backend, Snapshot, greedy};
use serde::Serialize;
use std::collections::BTreeMap;

/// What the length checks read of a validate run.
pub struct Lengths<'a> {
    /// The prompt set (the sequence is made of its tokens).
    pub set: &'a [LabelledPrompt],
    /// End-of-sequence ids.
    pub eos: &'a [u32],
    /// The thresholds against the reference.
    pub thresholds: &'a Thresholds,
    /// The static context (`None`: the backend has none).
    pub context: Option<usize>,
    /// Where the context comes from, as error messages name it (`--context`, or a set's manifest).
    pub context_source: String,
}

impl Context<'_> {
    /// What the length checks read of this run on a device of `caps`.
    pub fn lengths(&self, caps: &Capabilities) -> Lengths<'_> {
        Lengths {
            set: self.set,
            eos: self.eos,
            thresholds: &self.thresholds,
            context: caps.context,
            context_source: caps.context_source.clone(),
        }
    }
}

/// The first `n` tokens of the set's prompts concatenated and repeated.
pub fn pattern(set: &[LabelledPrompt], n: usize) -> Vec<u32> {
    set.iter()
        .flat_map(|p| p.ids.iter().copied())
        .cycle()
        .take(n)
        .collect()
}

/// The probe points: `max`, halved while at least 4.
pub fn probe_points(max: usize) -> Vec<usize> {
    let mut points = Vec::new();
    let mut l = max;
    while l >= 4 || points.is_empty() {
        points.push(l);
        if l < 2 {
            break;
        }
        l /= 2;
    }
    points.reverse();
    points
}

/// One length compared.
#[derive(Debug, Clone, Serialize)]
pub struct LengthPoint {
    /// Prompt tokens.
    pub length: usize,
    /// Whether bisection chose it (else a probe point).
    pub bisection: bool,
    /// Whether it passed.
    pub passed: bool,
    /// The last prompt position's and the decode step's logits against the reference's.
    pub logits: TensorError,
    /// Rows (of the two) where the device's top token differs from the reference's.
    pub flips: usize,
    /// Of those, the ones where the reference's top-two margin exceeds twice the logit error there.
    pub confident_flips: usize,
    /// The state after the prompt against the reference's (`None`: the backend does not expose it).
    pub state: Option<StateDiff>,
}

/// The reference's side of the sequence, fed incrementally from the nearest shorter state kept.
struct ReferenceSide<'a> {
    backend: &'a mut dyn Backend,
    sequence: &'a [u32],
    kept: BTreeMap<usize, Snapshot>,
}

impl ReferenceSide<'_> {
    /// The two rows of logits and the state after the prompt of `len` tokens.
    fn at(&mut self, len: usize) -> Result<(Tensor, Snapshot)> {
        match self.kept.range(..len).next_back() {
            Some((_, s)) => self.backend.restore(s)?,
            None => self.backend.reset()?,
        }
        let start = self.kept.range(..len).next_back().map_or(0, |(&l, _)| l);
        let last = self
            .backend
            .forward(&self.sequence[start..len], false)?
            .logits;
        let state = self.backend.snapshot()?;
        let step = self.backend.forward(&[self.sequence[len]], false)?.logits;
        self.kept.insert(len, state.clone());
        Ok((Tensor::cat(&[last, step], 0)?, state))
    }

    /// Forgets the states kept at lengths other than `keep`.
    fn keep_only(&mut self, keep: usize) {
        self.kept.retain(|&l, _| l == keep);
    }
}

/// Compares the device with the reference at one length.
fn compare_at(
    ctx: &Lengths,
    device: &mut dyn Backend,
    reference: &mut ReferenceSide,
    len: usize,
    bisection: bool,
) -> Result<LengthPoint> {
    let (ref_rows, ref_state) = reference.at(len)?;
    let sequence = reference.sequence;
    device.reset()?;
    let last = device.forward(&sequence[..len], false)?.logits;
    let state = if device.exposes_state() {
        Some(device.snapshot()?)
    } else {
        None
    };
    let step = device.forward(&[sequence[len]], false)?.logits;
    let rows = Tensor::cat(&[last, step], 0)?;
    let logits = TensorError::of(&rows, &ref_rows)?;
    let (mut flips, mut confident_flips) = (0, 0);
    for r in 0..2 {
        let d = values(&rows.get(r)?)?;
        let e = values(&ref_rows.get(r)?)?;
        let a = TokenAgreement::of(&d, &e, ctx.eos);
        if !a.same_top() {
            flips += 1;
            let max_abs = max_abs_diff(&d, &e);
            if a.ref_margin > 2.0 * max_abs {
                confident_flips += 1;
            }
        }
    }
    let state = state.map(|s| StateDiff::of(&s, &ref_state)).transpose()?;
    let t = ctx.thresholds;
    let passed = !exceeds(logits.nmse.get(), t.max_logits_nmse)
        && logits.finite()
        && confident_flips == 0
        && state
            .as_ref()
            .is_none_or(|s| !exceeds(s.nrmse.get(), t.max_state_nrmse) && s.finite);
    Ok(LengthPoint {
        length: len,
        bisection,
        passed,
        logits,
        flips,
        confident_flips,
        state,
    })
}

/// Agreement against prompt length from the shortest probe point to `max_length` (each prompt and one decode step
/// must fit the static context), and the first failing length by bisection.
pub fn length(
    ctx: &Lengths,
    device: &mut dyn Backend,
    reference: &mut dyn Backend,
    max_length: usize,
) -> Result<Finding> {
    let sequence = pattern(ctx.set, max_length + 1);
    let mut reference = ReferenceSide {
        backend: reference,
        sequence: &sequence,
        kept: BTreeMap::new(),
    };
    let mut points: Vec<LengthPoint> = Vec::new();
    for len in probe_points(max_length) {
        points.push(compare_at(ctx, device, &mut reference, len, false)?);
    }
    let first_fail = points.iter().find(|p| !p.passed).map(|p| p.length);
    let mut first_failing = None;
    let mut bracket = None;
    let mut notes = Vec::new();
    if let Some(fail) = first_fail {
        let mut lo = points
            .iter()
            .filter(|p| p.passed && p.length < fail)
            .map(|p| p.length)
            .max()
            .unwrap_or(0);
        let mut hi = fail;
        bracket = Some((lo, hi));
        reference.keep_only(lo);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            let p = compare_at(ctx, device, &mut reference, mid, true)?;
            if p.passed {
                lo = mid;
                reference.keep_only(lo);
            } else {
                hi = mid;
            }
            points.push(p);
        }
        first_failing = Some(hi);
        let later: Vec<String> = points
            .iter()
            .filter(|p| !p.bisection && p.passed && p.length > fail)
            .map(|p| p.length.to_string())
            .collect();
        if !later.is_empty() {
            notes.push(format!(
                "not monotonic: length(s) {} passed after {fail} failed; the bisection assumes a failure persists",
                later.join(", ")
            ));
        }
    }
    points.sort_by_key(|p| p.length);
    let worst_logits = points
        .iter()
        .max_by(|a, b| a.logits.nmse.get().total_cmp(&b.logits.nmse.get()))
        .map(|p| (p.length, p.logits.nmse));
    let worst_state = points
        .iter()
        .filter_map(|p| p.state.as_ref().map(|s| (p.length, s.nrmse)))
        .max_by(|a, b| a.1.get().total_cmp(&b.1.get()));
    let probed = points.iter().filter(|p| !p.bisection).count();
    let mut failures = Vec::new();
    let figure = match (first_failing, bracket) {
        (Some(first), Some((lo, hi))) => {
            let p = points.iter().find(|p| p.length == first);
            failures.push(format!(
                "the device leaves the thresholds from a prompt of {first} tokens on (bisection between {lo} and \
                 {hi}){}",
                p.map_or(String::new(), |p| format!(
                    ": logits NMSE {:.2e}, {} confident flip(s){}",
                    p.logits.nmse,
                    p.confident_flips,
                    p.state.as_ref().map_or(String::new(), |s| format!(
                        ", state NRMSE {:.2e} ({})",
                        s.nrmse, s.worst
                    ))
                ))
            ));
            format!(
                "first failing length {first} (bisection between {lo} and {hi}); {} of {probed} probe points pass",
                points.iter().filter(|p| !p.bisection && p.passed).count()
            )
        }
        _ => format!(
            "lengths {}…{max_length} ({probed} points) pass; worst logits NMSE {:.1e} (L={}){}",
            points.first().map_or(0, |p| p.length),
            worst_logits.map_or(Measure::Undefined(Why::Empty), |w| w.1),
            worst_logits.map_or(0, |w| w.0),
            worst_state.map_or(String::new(), |(l, nrmse)| format!(
                ", state NRMSE {nrmse:.1e} (L={l})"
            )),
        ),
    };
    notes.push(format!(
        "each length: a fresh prompt on the device, then one decode step; {}",
        match ctx.context {
            Some(c) => format!("the context holds {c}"),
            None => "the device has no static context".into(),
        }
    ));
    if let Some(hidden) = device.state_hidden() {
        notes.push(format!("the logits only: the device's state is {hidden}"));
    }
    #[derive(Serialize)]
    struct Detail {
        max_length: usize,
        context: Option<usize>,
        first_failing: Option<usize>,
        bisection_between: Option<(usize, usize)>,
        points: Vec<LengthPoint>,
    }
    Ok(Finding {
        figure,
        failures,
        notes,
        details: details(&Detail {
            max_length,
            context: ctx.context,
            first_failing,
            bisection_between: bracket,
            points,
        }),
        ..Finding::default()
    })
}

/// A prompt one token longer than the static context is refused, with an error naming the context, by the
/// commands' check and by the device itself (never cut to fit). Skipped when the device has no static context.
pub fn over_long(ctx: &Lengths, device: &mut dyn Backend) -> Result<Finding> {
    let Some(context) = ctx.context else {
        return Ok(Finding {
            skipped: Some(
                "the device has no static context: it takes sequences of any length, so none is over-long".into(),
            ),
            figure: "skipped: no static context, so no prompt is over-long".into(),
            ..Finding::default()
        });
    };
    let ids = pattern(ctx.set, context + 1);
    let command = match check_context(ids.len(), 1, context, &ctx.context_source) {
        Ok(()) => bail!("the commands' context check accepted {} tokens", ids.len()),
        Err(e) => format!("{e:#}"),
    };
    let mut failures = Vec::new();
    let refused = match greedy(device, &ids, 1, &[], false, |_| Ok(())) {
        Ok(g) => {
            failures.push(format!(
                "the device ran a prompt of {} tokens on a static context of {context} (and chose token {:?}): \
                 cut or overflowed, silently",
                ids.len(),
                g.tokens.first()
            ));
            None
        }
        Err(e) => {
            let message = e.to_string();
            if !message.contains("context") {
                failures.push(format!(
                    "the device refused the prompt, but its error does not name the context: {message}"
                ));
            }
            Some(message)
        }
    };
    device.reset()?;
    #[derive(Serialize)]
    struct Detail {
        prompt_tokens: usize,
        context: usize,
        command_error: String,
        device_error: Option<String>,
    }
    Ok(Finding {
        figure: format!(
            "{} tokens on a context of {context}: {}",
            ids.len(),
            if refused.is_some() { "refused" } else { "RUN" }
        ),
        notes: vec![format!("the commands say: {command}")]
            .into_iter()
            .chain(refused.iter().map(|m| format!("the device says: {m}")))
            .collect(),
        failures,
        details: details(&Detail {
            prompt_tokens: ids.len(),
            context,
            command_error: command,
            device_error: refused,
        }),
        ..Finding::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_points_halve_from_the_longest() {
        assert_eq!(probe_points(1023), vec![7, 15, 31, 63, 127, 255, 511, 1023]);
        assert_eq!(probe_points(96), vec![6, 12, 24, 48, 96]);
        assert_eq!(probe_points(3), vec![3]);
        assert_eq!(probe_points(1), vec![1]);
    }
}
