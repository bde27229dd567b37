//! Prompt-lookup decoding against plain greedy on the device: the same tokens, and what the drafts bought.

use super::{Agreement, Context, Finding, details, greedy_on, ties_text};
use crate::device::DeviceUnderTest;
use crate::metrics::{Measure, Why};
use anyhow::Result;
use reference::backend::{LookupOptions, prompt_lookup};
use serde::Serialize;

/// One prompt decoded both ways.
#[derive(Debug, Clone, Serialize)]
struct LookupRun {
    prompt: String,
    prompt_tokens: usize,
    agreement: Agreement,
    proposed: usize,
    accepted: usize,
    greedy_calls: usize,
    lookup_calls: usize,
    verify_calls: usize,
    refeeds: usize,
    greedy_decode_seconds: f64,
    lookup_decode_seconds: f64,
}

/// Prompt-lookup decoding gives plain greedy's tokens on every prompt of the set and on a prompt that repeats
/// itself; the acceptance rate, the forward calls and the wall-clock speed-up of the decoding (the prompt excluded,
/// the same work both ways) are measured, never judged.
pub fn lookup(
    ctx: &Context,
    dut: &mut dyn DeviceUnderTest,
    opts: LookupOptions,
    tokens: usize,
) -> Result<Finding> {
    let deployed = dut.deployed()?;
    let mut failures = Vec::new();
    let mut notes = Vec::new();
    let mut runs = Vec::new();
    for prompt in ctx.set.iter().chain(std::iter::once(ctx.repeated)) {
        let plain = greedy_on(
            deployed,
            &prompt.ids,
            tokens,
            false,
            &format!("greedy, `{}`", prompt.label),
            &mut failures,
        )?;
        let l = prompt_lookup(deployed, &prompt.ids, tokens, &[], opts)?;
        if let Some(i) = l.nan_at {
            failures.push(format!(
                "prompt lookup, `{}`: the logits hold a NaN at generated token {i}",
                prompt.label
            ));
        }
        let agreement = Agreement::of(
            &prompt.label,
            (&plain.tokens, &plain.logits),
            (&l.tokens, &l.logits),
        )?;
        failures.extend(agreement.failures(
            "prompt lookup vs greedy",
            Some(ctx.thresholds.max_logits_nmse),
        ));
        notes.extend(agreement.tie_note("prompt lookup vs greedy", ctx.thresholds.max_logits_nmse));
        runs.push(LookupRun {
            prompt: prompt.label.clone(),
            prompt_tokens: prompt.ids.len(),
            agreement,
            proposed: l.proposed,
            accepted: l.accepted,
            greedy_calls: plain.tokens.len(),
            lookup_calls: l.forward_calls,
            verify_calls: l.verify_calls,
            refeeds: l.refeeds,
            greedy_decode_seconds: plain.decode_seconds,
            lookup_decode_seconds: l.decode_seconds,
        });
    }
    let sum = |f: fn(&LookupRun) -> usize| runs.iter().map(f).sum::<usize>();
    let sum_s = |f: fn(&LookupRun) -> f64| runs.iter().map(f).sum::<f64>();
    let (proposed, accepted) = (sum(|r| r.proposed), sum(|r| r.accepted));
    // A rate over no proposal is undefined (`null`), not 0.
    let acceptance = Measure::of(
        accepted as f64 / proposed.max(1) as f64,
        (proposed == 0).then_some(Why::Empty),
    );
    let (greedy_s, lookup_s) = (
        sum_s(|r| r.greedy_decode_seconds),
        sum_s(|r| r.lookup_decode_seconds),
    );
    let speedup = greedy_s / lookup_s.max(1e-12);
    let identical = runs.iter().filter(|r| r.agreement.identical()).count();
    let repeated = runs.last().map_or(Measure::Undefined(Why::Empty), |r| {
        Measure::of(
            r.accepted as f64 / r.proposed.max(1) as f64,
            (r.proposed == 0).then_some(Why::Empty),
        )
    });
    let ties = runs
        .iter()
        .filter(|r| r.agreement.near_tie(ctx.thresholds.max_logits_nmse))
        .count();
    let figure = format!(
        "{identical}/{} prompts token-identical{}; acceptance {:.1} ({accepted}/{proposed}; `{}` {:.1}), {} vs {} \
         forward calls, decode speed-up ×{speedup:.2}",
        runs.len(),
        ties_text(ties),
        acceptance.percent(),
        ctx.repeated.label,
        repeated.percent(),
        sum(|r| r.lookup_calls),
        sum(|r| r.greedy_calls),
    );
    #[derive(Serialize)]
    struct Detail {
        max_ngram: usize,
        max_draft: usize,
        tokens: usize,
        proposed: usize,
        accepted: usize,
        acceptance: Measure,
        greedy_decode_seconds: f64,
        lookup_decode_seconds: f64,
        speedup: f64,
        runs: Vec<LookupRun>,
    }
    Ok(Finding {
        figure,
        failures,
        notes: {
            notes.push(format!(
                "speed-up: plain greedy's decode seconds over prompt lookup's ({greedy_s:.3} s / {lookup_s:.3} s), \
                 measured once on this machine, not judged; greedy calls count the prompt's"
            ));
            notes
        },
        details: details(&Detail {
            max_ngram: opts.max_ngram,
            max_draft: opts.max_draft,
            tokens,
            proposed,
            accepted,
            acceptance,
            greedy_decode_seconds: greedy_s,
            lookup_decode_seconds: lookup_s,
            speedup,
            runs,
        }),
        ..Finding::default()
    })
}
