//! The checks of `validate --ir`: an external stateful IR (graphs made elsewhere, [`npu::external`]) on a device,
//! at the logits and token level.
//!
//! Such an IR takes any number of tokens per call and keeps its caches inside OpenVINO, where nothing can read or
//! set them: [`Backend::snapshot`] and [`Backend::restore`] fail, a reset is a fresh infer request. So the
//! equivalences change form. **Blocks** becomes the prompt fed in one call against the same prompt fed in pieces
//! (of 1 and 16 tokens by default), the state carried from piece to piece inside the IR. **Prefix reuse** continues
//! the state the IR kept after turn 1 (no snapshot needed) against the whole conversation from scratch.
//! **Back-to-back** runs a sequence after another, reset in between, against it alone on a freshly compiled IR.
//! What needs this project's graphs or the state is skipped, with the reason ([`skipped`]): the probe (no per-layer
//! graphs), padding (nothing is padded), prompt lookup (it restores a state). The length checks are
//! [`super::length`]'s, comparing logits only.

use super::fault::Faulty;
use super::length::Lengths;
use super::{
    Agreement, CheckId, Finding, GraphInfo, details, equivalence::follow_up, run, ties_text,
};
use crate::backends::ExternalIr;
use crate::commands::compare_devices::LabelledPrompt;
use crate::compare::Thresholds;
use crate::metrics::{TensorError, exceeds};
use anyhow::{Context as _, Result};
use candle_core::Tensor;
use npu::devices::CompileOptions;
use npu::engine::DecoderEngine as ExternalBackend;
use reference::backend::{Backend, Generation, continue_greedy, greedy};
use serde::Serialize;
use std::cell::RefCell;

/// The external IR under test as the checks drive it (with the injected fault, if any).
pub type IrDevice = Faulty<ExternalBackend>;

/// What every check of an external IR shares.
pub struct IrContext<'a> {
    /// The IR and the checkpoint the reference runs.
    pub ir: &'a ExternalIr,
    /// The device it is compiled for.
    pub device: &'a str,
    /// How it is compiled.
    pub compile: CompileOptions,
    /// The prompt set.
    pub set: &'a [LabelledPrompt],
    /// A prompt that repeats itself (back-to-back's first sequence).
    pub repeated: &'a LabelledPrompt,
    /// Greedy tokens per prompt.
    pub tokens: usize,
    /// End-of-sequence ids.
    pub eos: &'a [u32],
    /// The thresholds for the precision the IR read back.
    pub thresholds: Thresholds,
    /// The injected fault.
    pub fault: Option<super::fault::Fault>,
    /// Every compilation of the IR so far.
    pub graphs: RefCell<Vec<GraphInfo>>,
}

impl IrContext<'_> {
    /// Compiles the IR on the device, logging it as `purpose`.
    pub fn open(&self, purpose: &str) -> Result<IrDevice> {
        let backend = self
            .ir
            .compile(self.device, &self.compile)
            .with_context(|| format!("compiling the IR ({purpose})"))?;
        self.graphs.borrow_mut().extend(
            backend
                .infos()
                .into_iter()
                .map(|i| GraphInfo::of(purpose, i)),
        );
        Ok(Faulty::new(backend, self.fault))
    }

    /// What the length checks read: the static context is the one the manifest declares, if any.
    pub fn lengths(&self) -> Lengths<'_> {
        Lengths {
            set: self.set,
            eos: self.eos,
            thresholds: &self.thresholds,
            context: self.ir.manifest.context,
            context_source: "the `context` of the IR's manifest.json",
        }
    }
}

/// Why a check does not apply to an external IR (`None`: it does).
pub fn skip_reason(id: CheckId) -> Option<&'static str> {
    match id {
        CheckId::Probe => Some(
            "an external IR is one graph: it has no per-layer graphs to probe, and its hidden states are not exposed",
        ),
        CheckId::Padding => Some(
            "an external IR takes any number of tokens per call, so nothing is padded; the blocks check feeds the \
             prompt in pieces instead",
        ),
        CheckId::PromptLookup => Some(
            "prompt lookup restores the state from before a verify call after a partial match, and the IR keeps its \
             state inside OpenVINO, where it can be neither read nor set",
        ),
        _ => None,
    }
}

/// The finding of a check that does not apply to an external IR ([`skip_reason`]).
pub fn skipped(id: CheckId) -> Finding {
    let why = skip_reason(id).unwrap_or("it does not apply to an external IR");
    Finding {
        skipped: Some(why.to_string()),
        figure: "not applicable to an external IR".into(),
        ..Finding::default()
    }
}

/// What a check asserts on an external IR, where it differs from [`CheckId::title`].
pub fn title(id: CheckId) -> Option<&'static str> {
    match id {
        CheckId::Blocks => Some("the prompt in one call and in pieces gives the same tokens"),
        CheckId::PrefixReuse => Some(
            "a follow-up turn continuing the IR's own state equals the conversation from scratch",
        ),
        CheckId::BackToBack => {
            Some("a sequence after another equals it alone on a freshly compiled IR")
        }
        _ => None,
    }
}

/// Where to look when a check of an external IR fails, where it differs from [`CheckId::next`] (its layers and
/// state are not exposed, so there is no probe to run).
pub fn next(id: CheckId) -> Option<&'static str> {
    match id {
        CheckId::Compare => Some(
            "--weights as the IR holds them (its manifest's reference_weights), the manifest's port roles, then \
             qwen35 compare-devices --ir DIR --report r.md (the appendix below): the first divergent token",
        ),
        CheckId::Blocks | CheckId::PrefixReuse => Some(
            "the IR's handling of a call after others: the manifest's attention_mask (`past+tokens`) and \
             position_ids, the state variables' update (conv window, recurrent state, KV cache)",
        ),
        CheckId::Length => Some(
            "qwen35 compare-devices --ir DIR --token-ids (a prompt of the first failing length): where the tokens \
             part; the export's state variables over long sequences",
        ),
        _ => None,
    }
}

/// One prompt fed in pieces.
#[derive(Debug, Clone, Serialize)]
struct PieceRun {
    /// Tokens per call.
    piece: usize,
    prompt: String,
    /// Calls the prompt took.
    calls: usize,
    tokens: Vec<u32>,
    /// The logits of every prompt position against the prompt's in one call.
    prompt_logits: TensorError,
    /// The greedy tokens against the one call's.
    against_one_call: Agreement,
    /// Tokens identical to the reference's before the first divergence.
    reference_matched: usize,
}

/// Runs `ids` in calls of `piece` tokens from a fresh state (each call continuing the state the IR keeps), then
/// `tokens` greedy tokens: the logits of every prompt position, and the generation.
fn in_pieces(
    device: &mut dyn Backend,
    ids: &[u32],
    piece: usize,
    tokens: usize,
) -> Result<(Tensor, Generation)> {
    device.reset()?;
    let chunks: Vec<&[u32]> = ids.chunks(piece).collect();
    let (last, head) = chunks.split_last().context("the prompt is empty")?;
    let mut rows = Vec::with_capacity(chunks.len());
    for c in head {
        rows.push(device.forward(c, true)?.logits);
    }
    let g = continue_greedy(device, last, tokens, &[], true, |_| Ok(()))?;
    rows.push(g.prompt.logits.clone());
    Ok((Tensor::cat(&rows, 0)?, g))
}

/// Every prompt fed in pieces of each size in `pieces` gives the logits of every prompt position and the greedy
/// tokens of the prompt fed in one call (a piece that holds the whole prompt is that call, and is not run again).
pub fn pieces(
    ctx: &IrContext,
    device: &mut IrDevice,
    pieces: &[usize],
    reference: &[Vec<u32>],
) -> Result<Finding> {
    let max_nmse = ctx.thresholds.max_logits_nmse;
    let mut failures = Vec::new();
    let mut notes = Vec::new();
    let mut runs: Vec<PieceRun> = Vec::new();
    for (prompt, ref_tokens) in ctx.set.iter().zip(reference) {
        let what = format!("one call, `{}`", prompt.label);
        let whole = run(device, &prompt.ids, ctx.tokens, true, &what, &mut failures)?;
        for &piece in pieces {
            if piece >= prompt.ids.len() {
                notes.push(format!(
                    "`{}` ({} tokens) fits one piece of {piece}: the same call as the base run, not run again",
                    prompt.label,
                    prompt.ids.len()
                ));
                continue;
            }
            let (prompt_rows, g) = in_pieces(device, &prompt.ids, piece, ctx.tokens)?;
            let what = format!("pieces of {piece} vs one call");
            if let Some(i) = g.nan_at {
                failures.push(format!(
                    "{what}, `{}`: the logits hold a NaN at generated token {i}",
                    prompt.label
                ));
            }
            let prompt_logits = TensorError::of(&prompt_rows, &whole.prompt.logits)?;
            if exceeds(prompt_logits.nmse, max_nmse) || !prompt_logits.finite() {
                failures.push(format!(
                    "{what}, `{}`: the prompt positions' logits NMSE {:.2e} > {max_nmse:.1e} (--max-nmse)",
                    prompt.label, prompt_logits.nmse
                ));
            }
            let against_one_call = Agreement::of(
                &prompt.label,
                (&whole.tokens, &whole.logits),
                (&g.tokens, &g.logits),
            )?;
            failures.extend(against_one_call.failures(&what, Some(max_nmse)));
            notes.extend(against_one_call.tie_note(&what, max_nmse));
            let reference_matched = ref_tokens
                .iter()
                .zip(&g.tokens)
                .take_while(|(a, b)| a == b)
                .count();
            runs.push(PieceRun {
                piece,
                prompt: prompt.label.clone(),
                calls: prompt.ids.len().div_ceil(piece),
                tokens: g.tokens,
                prompt_logits,
                against_one_call,
                reference_matched,
            });
        }
    }
    let identical = runs
        .iter()
        .filter(|r| r.against_one_call.first_divergence.is_none())
        .count();
    let ties = runs
        .iter()
        .filter(|r| r.against_one_call.near_tie(max_nmse))
        .count();
    let worst = |f: fn(&PieceRun) -> &TensorError| {
        runs.iter()
            .map(f)
            .max_by(|a, b| a.nmse.total_cmp(&b.nmse))
            .map_or("-".into(), |e| format!("{:.1e}", e.nmse))
    };
    let max_abs = runs
        .iter()
        .flat_map(|r| [r.prompt_logits.max_abs, r.against_one_call.logits.max_abs])
        .fold(0.0, f64::max);
    let sizes: Vec<String> = pieces.iter().map(|b| b.to_string()).collect();
    let figure = format!(
        "one call vs pieces of {}: {identical}/{} runs token-identical{}; prompt logits NMSE ≤ {}, generated ≤ {} \
         (max |Δ| {max_abs:.1e})",
        sizes.join("/"),
        runs.len(),
        ties_text(ties),
        worst(|r| &r.prompt_logits),
        worst(|r| &r.against_one_call.logits),
    );
    let ref_matched: usize = runs.iter().map(|r| r.reference_matched).sum();
    notes.push(format!(
        "the state is carried from piece to piece inside the IR; against the reference's greedy tokens: \
         {ref_matched}/{} over every piece size and prompt (free-running; the compare check judges those)",
        runs.len() * ctx.tokens
    ));
    #[derive(Serialize)]
    struct Detail {
        pieces: Vec<usize>,
        tokens: usize,
        runs: Vec<PieceRun>,
    }
    Ok(Finding {
        figure,
        failures,
        notes,
        details: details(&Detail {
            pieces: pieces.to_vec(),
            tokens: ctx.tokens,
            runs,
        }),
        ..Finding::default()
    })
}

/// A follow-up turn run on the state the IR kept after turn 1 (its prompt and greedy answer, the answer's last
/// token fed too) gives the tokens of the whole conversation run from scratch. No snapshot is needed: the
/// follow-up simply continues, and the from-scratch run comes after it.
pub fn prefix_reuse(
    ctx: &IrContext,
    device: &mut IrDevice,
    reference: &mut dyn Backend,
) -> Result<Finding> {
    let t = &ctx.thresholds;
    let turn1 = &ctx.set[0];
    let follow = follow_up(ctx.set);
    let mut failures = Vec::new();
    let answer = run(
        device,
        &turn1.ids,
        ctx.tokens,
        false,
        "turn 1",
        &mut failures,
    )?;
    if let Some(&last) = answer.tokens.last() {
        device.forward(&[last], false)?;
    }
    let kept = device.position()?;
    let expected = turn1.ids.len() + answer.tokens.len();
    if kept != expected {
        failures.push(format!(
            "after turn 1 and its answer ({expected} tokens) the IR is at position {kept}"
        ));
        return Ok(Finding {
            figure: "the IR lost count of turn 1".into(),
            failures,
            ..Finding::default()
        });
    }
    let reused = continue_greedy(device, &follow.ids, ctx.tokens, &[], false, |_| Ok(()))?;
    if let Some(i) = reused.nan_at {
        failures.push(format!(
            "continued: the logits hold a NaN at generated token {i}"
        ));
    }
    let mut conversation = turn1.ids.clone();
    conversation.extend(&answer.tokens);
    conversation.extend(&follow.ids);
    let scratch = run(
        device,
        &conversation,
        ctx.tokens,
        false,
        "from scratch",
        &mut failures,
    )?;
    let agreement = Agreement::of(
        &follow.label,
        (&scratch.tokens, &scratch.logits),
        (&reused.tokens, &reused.logits),
    )?;
    let what = "continued vs from scratch";
    failures.extend(agreement.failures(what, Some(t.max_logits_nmse)));
    let mut notes: Vec<String> = agreement
        .tie_note(what, t.max_logits_nmse)
        .into_iter()
        .collect();
    let ref_tokens = greedy(reference, &conversation, ctx.tokens, &[], false, |_| Ok(()))?.tokens;
    let reference_matched = ref_tokens
        .iter()
        .zip(&reused.tokens)
        .take_while(|(a, b)| a == b)
        .count();
    notes.push(format!(
        "no snapshot: the follow-up continues the state the IR kept after turn 1; the logits only, its state is {}",
        npu::engine::STATE_NOT_EXPOSED
    ));
    notes.push(format!(
        "against the reference on the whole conversation: {reference_matched}/{} tokens",
        ref_tokens.len()
    ));
    let figure = format!(
        "turn 1 {} + answer {} tokens kept in the IR, follow-up {} tokens: {}/{} tokens identical, logits NMSE {:.1e}",
        turn1.ids.len(),
        answer.tokens.len(),
        follow.ids.len(),
        agreement.matched,
        agreement.tokens,
        agreement.logits.nmse,
    );
    #[derive(Serialize)]
    struct Detail {
        turn1: String,
        turn1_tokens: usize,
        answer: Vec<u32>,
        follow_up: String,
        follow_up_tokens: usize,
        agreement: Agreement,
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
            agreement,
            reference_matched,
        }),
        ..Finding::default()
    })
}

/// A sequence run after another (a reset, a fresh infer request, in between) gives exactly what it gives alone on
/// a freshly compiled IR: the same IR on the same inputs, so the tokens and the logits of every prompt position and
/// of every token must be bit-identical (the state cannot be compared: it is not exposed).
pub fn back_to_back(ctx: &IrContext, device: &mut IrDevice) -> Result<Finding> {
    let first = ctx.repeated;
    let second = &ctx.set[0];
    let mut failures = Vec::new();
    let mut fresh = ctx.open("fresh (back-to-back)")?;
    let alone = run(
        &mut fresh,
        &second.ids,
        ctx.tokens,
        true,
        "alone",
        &mut failures,
    )?;
    run(
        device,
        &first.ids,
        ctx.tokens,
        false,
        "the first sequence",
        &mut failures,
    )?;
    let after = run(
        device,
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
    let generated = Agreement::of(
        &second.label,
        (&alone.tokens, &alone.logits),
        (&after.tokens, &after.logits),
    )?;
    failures.extend(generated.failures("after another vs alone", None));
    let figure = format!(
        "`{}` after `{}` vs alone on a freshly compiled IR: {}/{} tokens, max |Δ| logits {:.1e}",
        second.label,
        first.label,
        generated.matched,
        generated.tokens,
        prompt_logits.max_abs.max(generated.logits.max_abs),
    );
    #[derive(Serialize)]
    struct Detail {
        first: String,
        second: String,
        prompt_logits: TensorError,
        generated: Agreement,
    }
    Ok(Finding {
        figure,
        failures,
        notes: vec![format!(
            "the logits only: the state is {}",
            npu::engine::STATE_NOT_EXPOSED
        )],
        details: details(&Detail {
            first: first.label.clone(),
            second: second.label.clone(),
            prompt_logits,
            generated,
        }),
        ..Finding::default()
    })
}
