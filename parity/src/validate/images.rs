//! The check of a prompt with images (`validate --image`): the device's own vision tower (its static vision graph)
//! against the reference's, tap by tap and block by block; the device's text with its own image rows against the
//! reference's with the reference's rows; and the rope delta an image leaves in the state: a follow-up turn on the
//! state after the image conversation against the whole conversation from scratch, and a text prompt after the
//! image conversation (the device reset) against the same prompt before it.

use super::{Agreement, Context, Finding, details, greedy_on, ties_text};
use crate::compare::ReferenceRun;
use crate::compare::run::{compare_device_on, vision_rows};
use crate::device::DeviceSettings;
use crate::device::DeviceUnderTest;
use crate::device::target::Target;
use crate::images::{Pixels, PromptInput, reference_images};
use crate::metrics::exceeds;
use crate::probe::vision::probe_vision;
use crate::progress::Progress;
use crate::prompts::LabelledPrompt;
use anyhow::Result;
use reference::backend::{Backend, EmbeddedPrompt, continue_greedy, greedy_embedded};
use reference::model::Model;
use reference::rope::Positions;
use reference::vision::VisionConfig;
use reference::weights::WeightStore;
use serde::Serialize;

/// A prompt with images to validate.
pub struct ValidateImages<'a> {
    /// The checkpoint's vision tower.
    pub vc: &'a VisionConfig,
    /// The images' pixel patches.
    pub pixels: &'a Pixels,
    /// The prompt with them (`with N image(s)`): its ids hold each image's run.
    pub prompt: &'a LabelledPrompt,
    /// What is under test: it makes the device's image rows with the device's own vision graphs.
    pub target: &'a Target,
    /// The device's settings (its vision graph compiles as its decoder graphs do).
    pub settings: &'a DeviceSettings,
}

/// What the check measured, for the JSON report.
#[derive(Debug, Serialize)]
struct ImageDetails {
    /// Every vision tap of the device's graph against the reference tower's.
    vision: Vec<crate::compare::Row>,
    /// Each vision block's own graph, isolated and chained.
    blocks: Vec<crate::probe::vision::VisionBlockProbe>,
    /// A follow-up turn on the state after the image conversation against the conversation from scratch.
    follow_up: Agreement,
    /// A text prompt after the image conversation against the same prompt before it.
    after_images: Agreement,
    /// compare-devices' report of the prompt with images (the device fed its own vision graph's rows).
    compare: crate::compare::DeviceReport,
}

/// Runs the check: `model` and `reference` (a backend recording taps on the same model) are the reference's,
/// `overrides` the thresholds given, `follow` the follow-up turn and `text` the text prompt run before and after the
/// images.
#[allow(clippy::too_many_arguments)]
pub fn images(
    ctx: &Context,
    dut: &mut dyn DeviceUnderTest,
    model: &Model,
    reference: &mut dyn Backend,
    store: &WeightStore,
    overrides: &crate::compare::ThresholdOverrides,
    images: &ValidateImages,
    follow: &LabelledPrompt,
    text: &LabelledPrompt,
    progress: &Progress,
) -> Result<Finding> {
    let t = &ctx.thresholds;
    let (vc, pixels, label) = (images.vc, images.pixels, images.prompt.label.as_str());
    let ids = images.prompt.ids.clone();
    let mut failures = Vec::new();

    // The tower: the reference's rows and taps, the device's graph's rows and taps.
    let table = model.token_table();
    let own = reference_images(&table, store, vc, ids.clone(), pixels, false)?;
    let run = ReferenceRun::of_input(
        reference,
        label,
        PromptInput::Images(own.prompt.clone()),
        ctx.tokens,
    )?;
    progress.message(&format!("{}: the vision graph", dut.label()));
    let (theirs, _) = images
        .target
        .images(&table, vc, ids, pixels, images.settings)?;
    let vision = vision_rows(&theirs.taps, &own.taps)?;
    for row in &vision {
        if exceeds(row.error.nrmse.get(), t.max_layer_nrmse) || !row.error.finite() {
            failures.push(format!(
                "{}: NRMSE {:.2e} > {:.1e} (--max-layer-nrmse)",
                row.name, row.error.nrmse, t.max_layer_nrmse
            ));
        }
    }
    // Each block's own graph: this project's, built from the checkpoint; a set's vision graph is one whole tower.
    let blocks = match images.target.set() {
        Some(_) => Vec::new(),
        None => {
            progress.message(&format!("{}: the vision blocks", dut.label()));
            probe_vision(
                vc,
                store,
                pixels,
                dut.device(),
                &images.settings.compile,
                t.max_layer_nrmse,
            )?
        }
    };
    for b in blocks.iter().filter(|b| b.over) {
        failures.push(format!(
            "vision block {} (its own graph, fed the reference's input): NRMSE {:.2e} > {:.1e} (--max-layer-nrmse)",
            b.block, b.isolated.nrmse, t.max_layer_nrmse
        ));
    }

    // The decoder with the device's own rows against the reference with its own.
    let device_prompt = theirs.prompt.clone();
    let mut report = compare_device_on(
        dut,
        std::slice::from_ref(&run),
        Some(&[PromptInput::Images(device_prompt.clone())]),
        ctx.eos,
        overrides,
        progress,
    )?;
    report.vision = vision.clone();
    failures.extend(
        report
            .failures
            .iter()
            .map(|f| format!("`{label}` on the device's own rows: {f}")),
    );

    // The rope delta: the text after an image continues at the image's largest position + 1.
    let device = dut.deployed()?;
    let before = greedy_on(
        device,
        &text.ids,
        ctx.tokens,
        false,
        "text before the images",
        &mut failures,
    )?;
    let answer = greedy_embedded(device, &device_prompt, ctx.tokens, &[], false, |_| Ok(()))?;
    if let Some(&last) = answer.tokens.last() {
        device.forward(&[last], false)?;
    }
    let reused = continue_greedy(device, &follow.ids, ctx.tokens, &[], false, |_| Ok(()))?;
    let mut then = answer.tokens.clone();
    then.extend(&follow.ids);
    let whole = followed_by(model, &device_prompt, &then)?;
    let scratch = greedy_embedded(device, &whole, ctx.tokens, &[], false, |_| Ok(()))?;
    let follow_up = Agreement::of(
        &follow.label,
        (&scratch.tokens, &scratch.logits),
        (&reused.tokens, &reused.logits),
    )?;
    let what = "a follow-up turn after the images, reused vs from scratch";
    failures.extend(follow_up.failures(what, Some(t.max_logits_nmse)));
    let mut notes: Vec<String> = follow_up
        .tie_note(what, t.max_logits_nmse)
        .into_iter()
        .collect();
    // The device reset after the image conversation: nothing of the image may remain (its rope delta above all).
    let after = greedy_on(
        device,
        &text.ids,
        ctx.tokens,
        false,
        "text after the images",
        &mut failures,
    )?;
    let after_images = Agreement::of(
        &text.label,
        (&before.tokens, &before.logits),
        (&after.tokens, &after.logits),
    )?;
    failures.extend(after_images.failures("a text prompt after the images vs before them", None));

    let merger = vision
        .iter()
        .find(|r| r.name == reference::vision::names::MERGER)
        .map_or("-".into(), |r| format!("{:.1e}", r.error.nrmse));
    let worst_block = match images.target.set() {
        Some(_) => "not probed (the set's vision graph is the whole tower)".to_string(),
        None => blocks
            .iter()
            .max_by(|a, b| a.isolated.nrmse.get().total_cmp(&b.isolated.nrmse.get()))
            .map_or("-".into(), |b| {
                format!("{:.1e} (block {})", b.isolated.nrmse, b.block)
            }),
    };
    let ties =
        usize::from(follow_up.near_tie(t.max_logits_nmse) && follow_up.first_divergence.is_some());
    notes.push(crate::report::compare::first_divergence_line(&report));
    let figure = format!(
        "`{label}`: image embeddings NRMSE {merger}, worst vision block {worst_block}; greedy {}/{} with the \
         device's own rows; follow-up after the images {}/{}{}; text after them {}/{}",
        report.greedy_matched,
        report.greedy_total,
        follow_up.matched,
        follow_up.tokens,
        ties_text(ties),
        after_images.matched,
        after_images.tokens,
    );
    Ok(Finding {
        figure,
        failures,
        notes,
        details: details(&ImageDetails {
            vision,
            blocks,
            follow_up,
            after_images,
            compare: report,
        }),
        ..Finding::default()
    })
}

/// `prompt` followed by the text `ids`: their rows from the embedding table, their positions continuing as
/// `get_rope_index` continues text, from the largest position of the prompt + 1 on every row.
fn followed_by(model: &Model, prompt: &EmbeddedPrompt, ids: &[u32]) -> Result<EmbeddedPrompt> {
    let start = usize::try_from(prompt.positions.next_text())?;
    let text = Positions::text(start, ids.len());
    let mut rows = prompt.positions.0.clone();
    for (row, more) in rows.iter_mut().zip(text.0) {
        row.extend(more);
    }
    let embeddings = candle_core::Tensor::cat(&[&prompt.embeddings, &model.embed(ids)?], 0)?;
    Ok(EmbeddedPrompt {
        ids: prompt.ids.iter().chain(ids).copied().collect(),
        embeddings,
        positions: Positions(rows),
    })
}
