//! The port's equivalence checks: the device against itself, each time two ways of computing the same tokens
//! (prompt lookup against plain greedy is in [`super::lookup`]).
//!
//! Where the two ways run different graphs or different call patterns (blocks of another size, a padded block, a
//! prompt split at a reused state, a verify block instead of single tokens), rounding differs: the tokens must be
//! identical and the logits (and states) within the thresholds a device is held to against the reference
//! (`--max-nmse`, `--max-state-nrmse`): agreeing with itself is no harder than agreeing with the reference. A token
//! that differs at a near tie (the base run's top-two margin there within twice the two runs' largest logit
//! difference there, compare-devices' rule) is the size of the arithmetic's error, not a fault: it is noted, not
//! failed (at f32 the logits differ by ~1e-5, so only exact ties are forgiven; at bf16 by up to ~2). Where
//! they run the very same graphs on the very same inputs (a sequence after another against it alone), the device
//! must be deterministic: bit-identical tokens, logits and states.

use super::{Agreement, Context, Device, Finding, StateDiff, details, run, ties_text};
use crate::commands::compare_devices::LabelledPrompt;
use crate::metrics::{TensorError, exceeds};
use anyhow::Result;
use reference::backend::{Backend, Generation, continue_greedy, greedy};
use serde::Serialize;

/// One prompt at one block size.
#[derive(Debug, Clone, Serialize)]
struct BlockRun {
    block: usize,
    prompt: String,
    tokens: Vec<u32>,
    /// Against the first block size's run of the same prompt.
    against_first: Agreement,
    /// Tokens identical to the reference's before the first divergence.
    reference_matched: usize,
}

/// Prompt blocks of every size in `blocks` give the same greedy tokens on every prompt (the deployed device is
/// reused for its own block size, other sizes are compiled).
pub fn blocks(
    ctx: &Context,
    deployed: &mut Device,
    blocks: &[usize],
    reference: &[Vec<u32>],
) -> Result<Finding> {
    let max_nmse = ctx.thresholds.max_logits_nmse;
    let mut failures = Vec::new();
    let mut notes = Vec::new();
    let mut runs: Vec<BlockRun> = Vec::new();
    let mut first: Vec<Generation> = Vec::new();
    for (i, &block) in blocks.iter().enumerate() {
        let mut compiled;
        let dev: &mut Device = if block == ctx.settings.block {
            deployed
        } else {
            compiled = ctx.open(block, &format!("block {block}"))?;
            &mut compiled
        };
        for (p, (prompt, ref_tokens)) in ctx.set.iter().zip(reference).enumerate() {
            let what = format!("block {block}, `{}`", prompt.label);
            let g = run(dev, &prompt.ids, ctx.tokens, false, &what, &mut failures)?;
            let base = if i == 0 { &g } else { &first[p] };
            let against_first = Agreement::of(
                &prompt.label,
                (&base.tokens, &base.logits),
                (&g.tokens, &g.logits),
            )?;
            if i > 0 {
                let what = format!("block {block} vs {}", blocks[0]);
                failures.extend(against_first.failures(&what, Some(max_nmse)));
                notes.extend(against_first.tie_note(&what, max_nmse));
            }
            let reference_matched = ref_tokens
                .iter()
                .zip(&g.tokens)
                .take_while(|(a, b)| a == b)
                .count();
            runs.push(BlockRun {
                block,
                prompt: prompt.label.clone(),
                tokens: g.tokens.clone(),
                against_first,
                reference_matched,
            });
            if i == 0 {
                first.push(g);
            }
        }
    }
    let others = runs.iter().filter(|r| r.block != blocks[0]);
    let worst = others
        .clone()
        .map(|r| r.against_first.logits)
        .max_by(|a, b| a.nmse.total_cmp(&b.nmse));
    let identical = others
        .clone()
        .filter(|r| r.against_first.first_divergence.is_none())
        .count();
    let ties = others
        .clone()
        .filter(|r| r.against_first.near_tie(max_nmse))
        .count();
    let sizes: Vec<String> = blocks.iter().map(|b| b.to_string()).collect();
    let figure = format!(
        "blocks {}: {identical}/{} runs token-identical to block {}{}; logits NMSE ≤ {} (max |Δ| {})",
        sizes.join("/"),
        others.count(),
        blocks[0],
        ties_text(ties),
        worst.map_or("-".into(), |w| format!("{:.1e}", w.nmse)),
        worst.map_or("-".into(), |w| format!("{:.1e}", w.max_abs)),
    );
    let ref_matched: usize = runs.iter().map(|r| r.reference_matched).sum();
    notes.push(format!(
        "against the reference's greedy tokens: {ref_matched}/{} over every block size and prompt (free-running; \
         the compare check judges those)",
        runs.len() * ctx.tokens
    ));
    #[derive(Serialize)]
    struct Detail {
        blocks: Vec<usize>,
        tokens: usize,
        runs: Vec<BlockRun>,
    }
    Ok(Finding {
        figure,
        failures,
        notes,
        details: details(&Detail {
            blocks: blocks.to_vec(),
            tokens: ctx.tokens,
            runs,
        }),
        ..Finding::default()
    })
}

/// The prompt a padding check runs: the first of the set whose length is not a multiple of `block`, else the
/// first one less its last token.
fn padded_prompt(set: &[LabelledPrompt], block: usize) -> LabelledPrompt {
    match set.iter().find(|p| p.ids.len() % block != 0) {
        Some(p) => LabelledPrompt {
            label: p.label.clone(),
            ids: p.ids.clone(),
        },
        None => LabelledPrompt {
            label: format!("{} less its last token", set[0].label),
            ids: set[0].ids[..set[0].ids.len() - 1].to_vec(),
        },
    }
}

/// A prompt whose last block is padded gives the logits of every prompt position, the state after it and the
/// greedy tokens of the same prompt run unpadded, in one block exactly its length.
pub fn padding(ctx: &Context, deployed: &mut Device) -> Result<Finding> {
    let block = ctx.settings.block;
    if block == 1 {
        return Ok(Finding {
            skipped: Some("the prompt block is 1 token: nothing is padded".into()),
            figure: "not applicable (--block 1)".into(),
            ..Finding::default()
        });
    }
    let prompt = padded_prompt(ctx.set, block);
    let n = prompt.ids.len();
    if n < 2 {
        return Ok(Finding {
            skipped: Some("the prompt has one token: it runs in the single-token graph".into()),
            figure: "not applicable (1-token prompt)".into(),
            ..Finding::default()
        });
    }
    let t = &ctx.thresholds;
    let mut failures = Vec::new();
    let padded = run(
        deployed,
        &prompt.ids,
        ctx.tokens,
        true,
        "padded",
        &mut failures,
    )?;
    let mut exact = ctx.open(n, &format!("block {n} (the unpadded prompt)"))?;
    let unpadded = run(
        &mut exact,
        &prompt.ids,
        ctx.tokens,
        true,
        "unpadded",
        &mut failures,
    )?;
    let prompt_logits = TensorError::of(&padded.prompt.logits, &unpadded.prompt.logits)?;
    if exceeds(prompt_logits.nmse, t.max_logits_nmse) || !prompt_logits.finite() {
        failures.push(format!(
            "the prompt positions' logits: NMSE {:.2e} > {:.1e} (--max-nmse)",
            prompt_logits.nmse, t.max_logits_nmse
        ));
    }
    let state = StateDiff::of(&padded.after_prompt, &unpadded.after_prompt)?;
    if exceeds(state.nrmse, t.max_state_nrmse) || !state.finite {
        failures.push(format!(
            "the state after the prompt: {} NRMSE {:.2e} > {:.1e} (--max-state-nrmse)",
            state.worst, state.nrmse, t.max_state_nrmse
        ));
    }
    let generated = Agreement::of(
        &prompt.label,
        (&unpadded.tokens, &unpadded.logits),
        (&padded.tokens, &padded.logits),
    )?;
    failures.extend(generated.failures("padded vs unpadded", Some(t.max_logits_nmse)));
    let notes = generated
        .tie_note("padded vs unpadded", t.max_logits_nmse)
        .into_iter()
        .collect();
    let pad = (block - n % block) % block;
    let figure = format!(
        "{n} tokens in blocks of {block} ({pad} padded) vs one block of {n}: prompt logits NMSE {:.1e}, state NRMSE \
         {:.1e}, {}/{} tokens identical",
        prompt_logits.nmse, state.nrmse, generated.matched, generated.tokens
    );
    #[derive(Serialize)]
    struct Detail {
        prompt: String,
        prompt_tokens: usize,
        block: usize,
        padded_slots: usize,
        prompt_logits: TensorError,
        state: StateDiff,
        generated: Agreement,
    }
    Ok(Finding {
        figure,
        failures,
        notes,
        details: details(&Detail {
            prompt: prompt.label,
            prompt_tokens: n,
            block,
            padded_slots: pad,
            prompt_logits,
            state,
            generated,
        }),
        ..Finding::default()
    })
}

/// A follow-up turn run on the state kept after turn 1 (its prompt and greedy answer) gives the tokens of the whole
/// conversation run from scratch. The state is snapshot after turn 1, the from-scratch run goes in between, and the
/// snapshot is restored for the follow-up (so a device that cannot go back to a state fails). Turn 1 is the first
/// prompt of the set, the follow-up the shortest other one ([`follow_up`]).
pub fn prefix_reuse(
    ctx: &Context,
    deployed: &mut Device,
    reference: &mut dyn Backend,
) -> Result<Finding> {
    let t = &ctx.thresholds;
    let turn1 = &ctx.set[0];
    let follow = follow_up(ctx.set);
    let mut failures = Vec::new();
    let answer = run(
        deployed,
        &turn1.ids,
        ctx.tokens,
        false,
        "turn 1",
        &mut failures,
    )?;
    // greedy feeds every token but the last: feed it, so the state holds turn 1 and its whole answer.
    if let Some(&last) = answer.tokens.last() {
        deployed.forward(&[last], false)?;
    }
    let kept = deployed.snapshot()?;
    let mut conversation = turn1.ids.clone();
    conversation.extend(&answer.tokens);
    conversation.extend(&follow.ids);
    let scratch = run(
        deployed,
        &conversation,
        ctx.tokens,
        false,
        "from scratch",
        &mut failures,
    )?;
    deployed.restore(&kept)?;
    let back = deployed.snapshot()?;
    if back.position != kept.position {
        failures.push(format!(
            "restoring the state kept after turn 1 (position {}) left the device at position {}",
            kept.position, back.position
        ));
        return Ok(Finding {
            figure: "the device did not go back to the kept state".into(),
            failures,
            ..Finding::default()
        });
    }
    let reused = continue_greedy(deployed, &follow.ids, ctx.tokens, &[], false, |_| Ok(()))?;
    if let Some(i) = reused.nan_at {
        failures.push(format!(
            "reused: the logits hold a NaN at generated token {i}"
        ));
    }
    let agreement = Agreement::of(
        &follow.label,
        (&scratch.tokens, &scratch.logits),
        (&reused.tokens, &reused.logits),
    )?;
    failures.extend(agreement.failures("reused vs from scratch", Some(t.max_logits_nmse)));
    let mut notes: Vec<String> = agreement
        .tie_note("reused vs from scratch", t.max_logits_nmse)
        .into_iter()
        .collect();
    let state = StateDiff::of(&reused.after_prompt, &scratch.after_prompt)?;
    if exceeds(state.nrmse, t.max_state_nrmse) || !state.finite {
        failures.push(format!(
            "the state after the follow-up: {} NRMSE {:.2e} > {:.1e} (--max-state-nrmse)",
            state.worst, state.nrmse, t.max_state_nrmse
        ));
    }
    let ref_tokens = greedy(reference, &conversation, ctx.tokens, &[], false, |_| Ok(()))?.tokens;
    let reference_matched = ref_tokens
        .iter()
        .zip(&reused.tokens)
        .take_while(|(a, b)| a == b)
        .count();
    let figure = format!(
        "turn 1 {} + answer {} tokens kept, follow-up {} tokens: {}/{} tokens identical, logits NMSE {:.1e}, state \
         NRMSE {:.1e}",
        turn1.ids.len(),
        answer.tokens.len(),
        follow.ids.len(),
        agreement.matched,
        agreement.tokens,
        agreement.logits.nmse,
        state.nrmse
    );
    #[derive(Serialize)]
    struct Detail {
        turn1: String,
        turn1_tokens: usize,
        answer: Vec<u32>,
        follow_up: String,
        follow_up_tokens: usize,
        agreement: Agreement,
        state: StateDiff,
        reference_matched: usize,
    }
    Ok(Finding {
        figure,
        failures,
        notes: {
            notes.push(format!(
                "against the reference on the whole conversation: {reference_matched}/{} tokens",
                ref_tokens.len()
            ));
            notes
        },
        details: details(&Detail {
            turn1: turn1.label.clone(),
            turn1_tokens: turn1.ids.len(),
            answer: answer.tokens,
            follow_up: follow.label.clone(),
            follow_up_tokens: follow.ids.len(),
            agreement,
            state,
            reference_matched,
        }),
        ..Finding::default()
    })
}

/// The follow-up turn of the prefix-reuse check: the shortest prompt of the set after the first (the first again
/// when it is alone).
pub fn follow_up(set: &[LabelledPrompt]) -> &LabelledPrompt {
    set[1..]
        .iter()
        .min_by_key(|p| p.ids.len())
        .unwrap_or(&set[0])
}

/// A sequence run after another on the device gives exactly what it gives alone on a freshly compiled device: the
/// same graphs on the same inputs, so the tokens, the logits of every prompt position and of every token, and the
/// state after the prompt must be bit-identical (any difference is state left behind, or a device that is not
/// deterministic, which a user needs to know as much).
pub fn back_to_back(ctx: &Context, deployed: &mut Device) -> Result<Finding> {
    let first = ctx.repeated;
    let second = &ctx.set[0];
    let mut failures = Vec::new();
    let mut fresh = ctx.open(ctx.settings.block, "fresh (back-to-back)")?;
    let alone = run(
        &mut fresh,
        &second.ids,
        ctx.tokens,
        true,
        "alone",
        &mut failures,
    )?;
    run(
        deployed,
        &first.ids,
        ctx.tokens,
        false,
        "the first sequence",
        &mut failures,
    )?;
    let after = run(
        deployed,
        &second.ids,
        ctx.tokens,
        true,
        "the second sequence",
        &mut failures,
    )?;
    let prompt_logits = TensorError::of(&after.prompt.logits, &alone.prompt.logits)?;
    if prompt_logits.max_abs != 0.0 || !prompt_logits.finite() {
        failures.push(format!(
            "the prompt positions' logits differ by up to {:.2e} (bit-identical expected)",
            prompt_logits.max_abs
        ));
    }
    let state = StateDiff::of(&after.after_prompt, &alone.after_prompt)?;
    if state.max_abs != 0.0 || !state.finite {
        failures.push(format!(
            "the state after the prompt differs by up to {:.2e}, most in {} (bit-identical expected)",
            state.max_abs, state.worst
        ));
    }
    let generated = Agreement::of(
        &second.label,
        (&alone.tokens, &alone.logits),
        (&after.tokens, &after.logits),
    )?;
    failures.extend(generated.failures("after another vs alone", None));
    let figure = format!(
        "`{}` after `{}` vs alone on a fresh device: {}/{} tokens, max |Δ| logits {:.1e}, state {:.1e}",
        second.label,
        first.label,
        generated.matched,
        generated.tokens,
        prompt_logits.max_abs.max(generated.logits.max_abs),
        state.max_abs
    );
    #[derive(Serialize)]
    struct Detail {
        first: String,
        second: String,
        prompt_logits: TensorError,
        state: StateDiff,
        generated: Agreement,
    }
    Ok(Finding {
        figure,
        failures,
        details: details(&Detail {
            first: first.label.clone(),
            second: second.label.clone(),
            prompt_logits,
            state,
            generated,
        }),
        ..Finding::default()
    })
}
