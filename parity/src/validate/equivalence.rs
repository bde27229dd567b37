//! The port's equivalence checks: the device against itself, each time two ways of computing the same tokens
//! (prompt lookup against plain greedy is in [`super::lookup`]). Each is written once against the device under test.
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

use super::{Agreement, Context, Finding, StateDiff, details, greedy_on, state_within, ties_text};
use crate::device::DeviceUnderTest;
use crate::metrics::{Measure, TensorError, Why, exceeds};
use crate::prompts::LabelledPrompt;
use anyhow::Result;
use reference::backend::{Backend, Generation, continue_greedy, greedy};
use serde::Serialize;

/// One prompt fed at one block size.
#[derive(Debug, Clone, Serialize)]
struct BlockRun {
    /// Tokens per call at most.
    block: usize,
    prompt: String,
    /// Calls the prompt took.
    calls: usize,
    tokens: Vec<u32>,
    /// The logits of every prompt position against the deployed run's.
    prompt_logits: TensorError,
    /// The greedy tokens against the deployed run's.
    against_deployed: Agreement,
    /// Tokens identical to the reference's before the first divergence.
    reference_matched: usize,
}

/// Every prompt fed in calls of at most each block size of `blocks` gives the logits of every prompt position and
/// the greedy tokens of the deployed graphs (this project's graphs compile each block size; a set's calls are cut
/// into pieces its host rule runs). A block size that is the deployed one, or that holds a whole prompt on a graph
/// of any tokens per call, is the base run itself and is not run again.
pub fn blocks(
    ctx: &Context,
    dut: &mut dyn DeviceUnderTest,
    blocks: &[usize],
    reference: &[Vec<u32>],
) -> Result<Finding> {
    let max_nmse = ctx.thresholds.max_logits_nmse;
    let caps = dut.capabilities().clone();
    let mut failures = Vec::new();
    let mut notes = Vec::new();
    let mut base: Vec<Generation> = Vec::new();
    for prompt in ctx.set {
        let what = format!("deployed, `{}`", prompt.label);
        base.push(greedy_on(
            dut.deployed()?,
            &prompt.ids,
            ctx.tokens,
            true,
            &what,
            &mut failures,
        )?);
    }
    let mut runs: Vec<BlockRun> = Vec::new();
    for &block in blocks {
        let same_as_deployed = |len: usize| match caps.block {
            Some(b) => b == block,
            None => block >= len,
        };
        if ctx.set.iter().all(|p| same_as_deployed(p.ids.len())) {
            notes.push(format!(
                "block {block}: the deployed call pattern itself, not run again"
            ));
            continue;
        }
        // Another block size compiles other graphs: the deployed ones are released first.
        dut.release();
        let mut dev = dut.with_block(block)?;
        for ((prompt, ref_tokens), whole) in ctx.set.iter().zip(reference).zip(&base) {
            if same_as_deployed(prompt.ids.len()) {
                continue;
            }
            let what = format!("block {block}, `{}`", prompt.label);
            let g = greedy_on(
                dev.as_mut(),
                &prompt.ids,
                ctx.tokens,
                true,
                &what,
                &mut failures,
            )?;
            let what = format!("blocks of {block} vs deployed");
            let prompt_logits = TensorError::of(&g.prompt.logits, &whole.prompt.logits)?;
            if exceeds(prompt_logits.nmse.get(), max_nmse) || !prompt_logits.finite() {
                failures.push(format!(
                    "{what}, `{}`: the prompt positions' logits NMSE {:.2e} > {max_nmse:.1e} (--max-nmse)",
                    prompt.label, prompt_logits.nmse
                ));
            }
            let against_deployed = Agreement::of(
                &prompt.label,
                (&whole.tokens, &whole.logits),
                (&g.tokens, &g.logits),
            )?;
            failures.extend(against_deployed.failures(&what, Some(max_nmse)));
            notes.extend(against_deployed.tie_note(&what, max_nmse));
            let reference_matched = ref_tokens
                .iter()
                .zip(&g.tokens)
                .take_while(|(a, b)| a == b)
                .count();
            runs.push(BlockRun {
                block,
                prompt: prompt.label.clone(),
                calls: prompt.ids.len().div_ceil(block),
                tokens: g.tokens,
                prompt_logits,
                against_deployed,
                reference_matched,
            });
        }
    }
    let identical = runs
        .iter()
        .filter(|r| r.against_deployed.identical())
        .count();
    let ties = runs
        .iter()
        .filter(|r| r.against_deployed.near_tie(max_nmse))
        .count();
    let worst = |f: fn(&BlockRun) -> &TensorError| {
        runs.iter()
            .map(f)
            .max_by(|a, b| a.nmse.get().total_cmp(&b.nmse.get()))
            .map_or("-".into(), |e| format!("{:.1e}", e.nmse))
    };
    let max_abs = runs
        .iter()
        .flat_map(|r| [r.prompt_logits.max_abs, r.against_deployed.logits.max_abs])
        .reduce(Measure::worst)
        .unwrap_or(Measure::Undefined(Why::Empty));
    let sizes: Vec<String> = blocks.iter().map(|b| b.to_string()).collect();
    let deployed = caps
        .block
        .map_or("one call".to_string(), |b| format!("blocks of {b}"));
    let figure = format!(
        "blocks {} vs the deployed {deployed}: {identical}/{} runs token-identical{}; prompt logits NMSE ≤ {}, \
         generated ≤ {} (max |Δ| {max_abs:.1e})",
        sizes.join("/"),
        runs.len(),
        ties_text(ties),
        worst(|r| &r.prompt_logits),
        worst(|r| &r.against_deployed.logits),
    );
    let ref_matched: usize = runs.iter().map(|r| r.reference_matched).sum();
    notes.push(format!(
        "against the reference's greedy tokens: {ref_matched}/{} over every block size and prompt (free-running; \
         the compare check judges those)",
        runs.len() * ctx.tokens
    ));
    if !caps.any_block {
        notes.push(
            "a set's graphs are fixed: each block size feeds the prompt in calls of at most that many tokens, which \
             the set's host rule runs on its graphs"
                .into(),
        );
    }
    #[derive(Serialize)]
    struct Detail {
        blocks: Vec<usize>,
        deployed_block: Option<usize>,
        tokens: usize,
        runs: Vec<BlockRun>,
    }
    Ok(Finding {
        figure,
        failures,
        notes,
        details: details(&Detail {
            blocks: blocks.to_vec(),
            deployed_block: caps.block,
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
        Some(p) => p.clone(),
        None => LabelledPrompt {
            label: format!("{} less its last token", set[0].label),
            ids: set[0].ids[..set[0].ids.len() - 1].to_vec(),
        },
    }
}

/// A prompt whose last block is padded (`token_valid` marking the empty slots) gives the logits of every prompt
/// position, the state after it and the greedy tokens of the same prompt fed unpadded: its full blocks, then its tail
/// token by token.
pub fn padding(ctx: &Context, dut: &mut dyn DeviceUnderTest) -> Result<Finding> {
    let caps = dut.capabilities().clone();
    let Some(block) = caps.block.filter(|&b| b > 1) else {
        let why = match caps.block {
            Some(_) => "the prompt block is 1 token: nothing is padded",
            None => "the graphs take any number of tokens per call: nothing is padded",
        };
        return Ok(Finding {
            skipped: Some(why.into()),
            figure: format!("skipped: {why}"),
            ..Finding::default()
        });
    };
    let prompt = padded_prompt(ctx.set, block);
    let n = prompt.ids.len();
    if n < 2 {
        return Ok(Finding {
            skipped: Some("the prompt has one token: it runs in the single-token graph".into()),
            figure: "skipped: a 1-token prompt runs in the single-token graph".into(),
            ..Finding::default()
        });
    }
    let t = &ctx.thresholds;
    let mut failures = Vec::new();
    let padded = greedy_on(
        dut.deployed()?,
        &prompt.ids,
        ctx.tokens,
        true,
        "padded",
        &mut failures,
    )?;
    dut.set_padding(false)?;
    let unpadded = greedy_on(
        dut.deployed()?,
        &prompt.ids,
        ctx.tokens,
        true,
        "unpadded",
        &mut failures,
    );
    dut.set_padding(true)?;
    let unpadded = unpadded?;
    let prompt_logits = TensorError::of(&padded.prompt.logits, &unpadded.prompt.logits)?;
    if exceeds(prompt_logits.nmse.get(), t.max_logits_nmse) || !prompt_logits.finite() {
        failures.push(format!(
            "the prompt positions' logits: NMSE {:.2e} > {:.1e} (--max-nmse)",
            prompt_logits.nmse, t.max_logits_nmse
        ));
    }
    let state = if caps.states {
        Some(state_within(
            &padded.after_prompt,
            &unpadded.after_prompt,
            "the state after the prompt",
            t.max_state_nrmse,
            &mut failures,
        )?)
    } else {
        None
    };
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
    let (full, tail) = (n / block * block, n % block);
    let figure = format!(
        "{n} tokens in blocks of {block} ({pad} padded) vs {full} in full blocks and {tail} single tokens: prompt \
         logits NMSE {:.1e}, {}{}/{} tokens identical",
        prompt_logits.nmse,
        state
            .as_ref()
            .map_or(String::new(), |s| format!("state NRMSE {:.1e}, ", s.nrmse)),
        generated.matched,
        generated.tokens
    );
    #[derive(Serialize)]
    struct Detail {
        prompt: String,
        prompt_tokens: usize,
        block: usize,
        padded_slots: usize,
        prompt_logits: TensorError,
        state: Option<StateDiff>,
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
/// conversation run from scratch. Where the states are ports, the state is snapshot after turn 1, the from-scratch
/// run goes in between, and the snapshot is restored on the host for the follow-up (so a device that cannot go back
/// to a state fails); where they are not (a stateful IR), the follow-up simply continues the state the device kept,
/// and the from-scratch run comes after it. Turn 1 is the first prompt of the set, the follow-up the shortest other
/// one ([`follow_up`]).
pub fn prefix_reuse(
    ctx: &Context,
    dut: &mut dyn DeviceUnderTest,
    reference: &mut dyn Backend,
) -> Result<Finding> {
    let t = &ctx.thresholds;
    let (states, states_note) = (dut.capabilities().states, dut.capabilities().states_note);
    let turn1 = &ctx.set[0];
    let follow = follow_up(ctx.set);
    let mut failures = Vec::new();
    let device = dut.deployed()?;
    let answer = greedy_on(
        device,
        &turn1.ids,
        ctx.tokens,
        false,
        "turn 1",
        &mut failures,
    )?;
    // greedy feeds every token but the last: feed it, so the state holds turn 1 and its whole answer.
    if let Some(&last) = answer.tokens.last() {
        device.forward(&[last], false)?;
    }
    let expected = turn1.ids.len() + answer.tokens.len();
    let mut conversation = turn1.ids.clone();
    conversation.extend(&answer.tokens);
    conversation.extend(&follow.ids);
    let (reused, scratch) = if states {
        let kept = device.snapshot()?;
        let scratch = greedy_on(
            device,
            &conversation,
            ctx.tokens,
            false,
            "from scratch",
            &mut failures,
        )?;
        device.restore(&kept)?;
        let back = device.position()?;
        if back != kept.position {
            failures.push(format!(
                "restoring the state kept after turn 1 (position {}) left the device at position {back}",
                kept.position
            ));
            return Ok(Finding {
                figure: "the device did not go back to the kept state".into(),
                failures,
                ..Finding::default()
            });
        }
        let reused = continue_greedy(device, &follow.ids, ctx.tokens, &[], false, |_| Ok(()))?;
        (reused, scratch)
    } else {
        let kept = device.position()?;
        if kept != expected {
            failures.push(format!(
                "after turn 1 and its answer ({expected} tokens) the device is at position {kept}"
            ));
            return Ok(Finding {
                figure: "the device lost count of turn 1".into(),
                failures,
                ..Finding::default()
            });
        }
        let reused = continue_greedy(device, &follow.ids, ctx.tokens, &[], false, |_| Ok(()))?;
        let scratch = greedy_on(
            device,
            &conversation,
            ctx.tokens,
            false,
            "from scratch",
            &mut failures,
        )?;
        (reused, scratch)
    };
    if let Some(i) = reused.nan_at {
        failures.push(format!(
            "reused: the logits hold a NaN at generated token {i}"
        ));
    }
    let what = "reused vs from scratch";
    let agreement = Agreement::of(
        &follow.label,
        (&scratch.tokens, &scratch.logits),
        (&reused.tokens, &reused.logits),
    )?;
    failures.extend(agreement.failures(what, Some(t.max_logits_nmse)));
    let mut notes: Vec<String> = agreement
        .tie_note(what, t.max_logits_nmse)
        .into_iter()
        .collect();
    let state = if states {
        Some(state_within(
            &reused.after_prompt,
            &scratch.after_prompt,
            "the state after the follow-up",
            t.max_state_nrmse,
            &mut failures,
        )?)
    } else {
        notes.push(format!(
            "no snapshot: the follow-up continues the state the device kept after turn 1; the logits only, its state \
             is {states_note}"
        ));
        None
    };
    let ref_tokens = greedy(reference, &conversation, ctx.tokens, &[], false, |_| Ok(()))?.tokens;
    let reference_matched = ref_tokens
        .iter()
        .zip(&reused.tokens)
        .take_while(|(a, b)| a == b)
        .count();
    notes.push(format!(
        "against the reference on the whole conversation: {reference_matched}/{} tokens",
        ref_tokens.len()
    ));
    let figure = format!(
        "turn 1 {} + answer {} tokens kept{}, follow-up {} tokens: {}/{} tokens identical, logits NMSE {:.1e}{}",
        turn1.ids.len(),
        answer.tokens.len(),
        if states {
            " (snapshot, restored)"
        } else {
            " in the device"
        },
        follow.ids.len(),
        agreement.matched,
        agreement.tokens,
        agreement.logits.nmse,
        state
            .as_ref()
            .map_or(String::new(), |s| format!(", state NRMSE {:.1e}", s.nrmse))
    );
    #[derive(Serialize)]
    struct Detail {
        turn1: String,
        turn1_tokens: usize,
        answer: Vec<u32>,
        follow_up: String,
        follow_up_tokens: usize,
        restored: bool,
        agreement: Agreement,
        state: Option<StateDiff>,
        reference_matched: usize,
    }
    Ok(Finding {
        figure,
        failures,
        notes,
        details: details(&Detail {
            turn1: turn1.label.clone(),
            turn1_tokens: turn1.ids.len(),
            answer: answer.tokens,
            follow_up: follow.label.clone(),
            follow_up_tokens: follow.ids.len(),
            restored: states,
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
/// state after the prompt (where it is exposed) must be bit-identical (any difference is state left behind, or a
/// device that is not deterministic, which a user needs to know as much).
pub fn back_to_back(ctx: &Context, dut: &mut dyn DeviceUnderTest) -> Result<Finding> {
    let (states, states_note) = (dut.capabilities().states, dut.capabilities().states_note);
    let first = ctx.repeated;
    let second = &ctx.set[0];
    let mut failures = Vec::new();
    // The fresh copy is compiled with the deployed graphs released: one copy of the weights at a time.
    dut.release();
    let mut fresh = dut.fresh()?;
    let alone = greedy_on(
        fresh.as_mut(),
        &second.ids,
        ctx.tokens,
        true,
        "alone",
        &mut failures,
    )?;
    drop(fresh);
    greedy_on(
        dut.deployed()?,
        &first.ids,
        ctx.tokens,
        false,
        "the first sequence",
        &mut failures,
    )?;
    let after = greedy_on(
        dut.deployed()?,
        &second.ids,
        ctx.tokens,
        true,
        "the second sequence",
        &mut failures,
    )?;
    let prompt_logits = TensorError::of(&after.prompt.logits, &alone.prompt.logits)?;
    if prompt_logits.max_abs.get() != 0.0 || !prompt_logits.finite() {
        failures.push(format!(
            "the prompt positions' logits differ by up to {:.2e} (bit-identical expected)",
            prompt_logits.max_abs
        ));
    }
    let state = if states {
        let s = StateDiff::of(&after.after_prompt, &alone.after_prompt)?;
        if s.max_abs.get() != 0.0 || !s.finite {
            failures.push(format!(
                "the state after the prompt differs by up to {:.2e}, most in {} (bit-identical expected)",
                s.max_abs, s.worst
            ));
        }
        Some(s)
    } else {
        None
    };
    let generated = Agreement::of(
        &second.label,
        (&alone.tokens, &alone.logits),
        (&after.tokens, &after.logits),
    )?;
    failures.extend(generated.failures("after another vs alone", None));
    let figure = format!(
        "`{}` after `{}` vs alone on a fresh device: {}/{} tokens, max |Δ| logits {:.1e}{}",
        second.label,
        first.label,
        generated.matched,
        generated.tokens,
        prompt_logits.max_abs.worst(generated.logits.max_abs),
        state
            .as_ref()
            .map_or(String::new(), |s| format!(", state {:.1e}", s.max_abs))
    );
    let notes = if states {
        Vec::new()
    } else {
        vec![format!("the logits only: the state is {states_note}")]
    };
    #[derive(Serialize)]
    struct Detail {
        first: String,
        second: String,
        prompt_logits: TensorError,
        state: Option<StateDiff>,
        generated: Agreement,
    }
    Ok(Finding {
        figure,
        failures,
        notes,
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
