//! `qwen35 validate --ir DIR`: the checks that apply to an external stateful IR (see
//! [`crate::validate::external`]), the others reported as skipped with the reason.

use super::{ValidateArgs, compare_finding, compare_report, repeated_prompt};
use crate::backends::{
    ExternalIr, check_device, external_compile_options, open_reference, refuse_graph_flags,
};
use crate::commands::Outcome;
use crate::commands::compare_devices::{
    LabelledPrompt, compare_external, eos_ids, prompts, reference_runs,
};
use crate::progress::Progress;
use crate::report::Machine;
use crate::report::validate::{ValidateInputs, ValidateReport};
use crate::validate::external::{self, IrContext};
use crate::validate::fault::Fault;
use crate::validate::setup::{self, DeviceSection};
use crate::validate::{Check, CheckId, equivalence, length};
use anyhow::{Context as _, Result, bail};
use npu::sim::NumericModel;
use reference::backend::Backend;
use reference::model::RunOptions;
use std::cell::RefCell;
use std::path::Path;
use std::time::Instant;

/// The longest prompt of the length check on an IR that declares no static context (`--max-length`): long enough
/// to cross several chunks of the export's DeltaNet scan, short enough for CI.
pub const DEFAULT_MAX_LENGTH: usize = 255;

/// Fails on a flag of a check that does not apply to an external IR, or a fault it cannot have, naming it.
fn refuse_flags(args: &ValidateArgs, dir: &Path, fault: Option<Fault>) -> Result<()> {
    refuse_graph_flags(&args.form, &args.graph, dir)?;
    let not_here = [
        ("--probe-mode", args.probe_mode.is_some(), CheckId::Probe),
        (
            "--probe-max-nrmse",
            args.probe_max_nrmse.is_some(),
            CheckId::Probe,
        ),
        (
            "--probe-max-state-nrmse",
            args.probe_max_state_nrmse.is_some(),
            CheckId::Probe,
        ),
        (
            "--lookup-tokens",
            args.lookup_tokens.is_some(),
            CheckId::PromptLookup,
        ),
        (
            "--lookup-ngram",
            args.lookup_ngram.is_some(),
            CheckId::PromptLookup,
        ),
        (
            "--lookup-draft",
            args.lookup_draft.is_some(),
            CheckId::PromptLookup,
        ),
    ];
    if let Some((flag, _, id)) = not_here.iter().find(|(_, given, _)| *given) {
        bail!(
            "{flag} configures the {} check, which does not apply to an external IR (--ir {}): {}",
            id.name(),
            dir.display(),
            external::skip_reason(*id).unwrap_or_default()
        );
    }
    if let Some(f) = fault
        && !matches!(f, Fault::LogitsFrom(_))
    {
        bail!(
            "--inject-fault {}: this fault acts on the device's state, which an external IR keeps inside OpenVINO \
             (--ir {}); logits-from=POSITION applies",
            args.inject_fault.as_deref().unwrap_or_default(),
            dir.display()
        );
    }
    Ok(())
}

/// Fails unless every run of every check fits the static context the manifest declares, naming the check and the
/// flag.
fn check_fits(
    args: &ValidateArgs,
    ir: &ExternalIr,
    set: &[LabelledPrompt],
    repeated: &LabelledPrompt,
    max_length: usize,
) -> Result<()> {
    let Some(context) = ir.manifest.context else {
        return Ok(());
    };
    let fits = |what: String, prompt: usize, generate: usize| -> Result<()> {
        let needed = prompt + generate.saturating_sub(1);
        if needed > context {
            bail!(
                "{what}: {prompt} prompt tokens and {generate} generated need {needed} cache slots, but {} declares \
                 a static context of {context}",
                ir.manifest.source
            );
        }
        Ok(())
    };
    if max_length + 1 > context {
        bail!(
            "--max-length {max_length}: a prompt of {max_length} tokens and one decode step need {} cache slots, but \
             {} declares a static context of {context}",
            max_length + 1,
            ir.manifest.source
        );
    }
    for p in set.iter().chain(std::iter::once(repeated)) {
        fits(
            format!("prompt `{}` (--tokens)", p.label),
            p.ids.len(),
            args.tokens,
        )?;
    }
    let (turn1, follow) = (&set[0], equivalence::follow_up(set));
    fits(
        format!(
            "prefix reuse: `{}`, its answer and `{}` (--tokens)",
            turn1.label, follow.label
        ),
        turn1.ids.len() + args.tokens + follow.ids.len(),
        args.tokens,
    )
}

/// Runs `qwen35 validate --ir DIR` (the arguments common to both forms already checked).
pub(super) fn exec(
    args: ValidateArgs,
    dir: &Path,
    fault: Option<Fault>,
    start: Instant,
) -> Result<Outcome> {
    refuse_flags(&args, dir, fault)?;
    let device = args.device().to_string();
    if NumericModel::is_sim(&device) {
        bail!(
            "--device {device}: FP16SIM evaluates this project's own graphs; an external IR runs on an OpenVINO \
             device (--ir {})",
            dir.display()
        );
    }
    check_device(&device).context("--device")?;
    let pieces = args.blocks();
    if pieces.contains(&0) {
        bail!("--blocks: a piece must hold at least 1 token");
    }
    let ir = ExternalIr::open(dir, &args.model)?;
    let mut warnings = Vec::new();
    if let Some(w) = &ir.weights_warning {
        eprintln!("warning: {w}");
        warnings.push(w.clone());
    }
    let (model, config, store) = (&ir.checkpoint, &ir.config, &ir.store);
    let context = ir.manifest.context;
    let max_length = args
        .max_length
        .unwrap_or_else(|| context.map_or(DEFAULT_MAX_LENGTH, |c| c.saturating_sub(1)));
    if max_length == 0 {
        bail!(
            "{} declares a static context of 1: no prompt and decode step fit",
            ir.manifest.source
        );
    }
    let set = prompts(&args.prompt, args.prompts.as_deref(), model, config)?;
    let repeated = repeated_prompt(model, &set)?;
    check_fits(&args, &ir, &set, &repeated, max_length)?;
    args.report.check()?;
    let eos = eos_ids(model, config);

    let progress = Progress::new(CheckId::ALL.len() + 1 + 2 * set.len());
    progress.step(&format!("{device}: compiling {}", ir.name()));
    let ctx = IrContext {
        ir: &ir,
        device: &device,
        compile: external_compile_options(&device, &args.graph)?,
        set: &set,
        repeated: &repeated,
        tokens: args.tokens,
        eos: &eos,
        // Replaced below, once the deployed IR says which precision ran.
        thresholds: args.thresholds.resolve("f32"),
        fault,
        graphs: RefCell::new(Vec::new()),
    };
    let mut deployed = ctx.open("deployed")?;
    let record = deployed.record().clone();
    let precision = record.precision.clone().unwrap_or_else(|| "f32".into());
    let ctx = IrContext {
        thresholds: args.thresholds.resolve(&precision),
        ..ctx
    };

    let mut checks = Vec::new();
    let mut reference = open_reference(config, store, RunOptions::default(), false)?;
    let mut compare = None;
    let mut reference_tokens: Vec<Vec<u32>> = Vec::new();
    checks.push(Check::run(CheckId::Compare, &progress, || {
        let runs = reference_runs(&mut reference, &set, args.tokens, &progress)?;
        reference_tokens = runs.iter().map(|r| r.tokens.clone()).collect();
        let label = format!("{device} IR {}", ir.name());
        let report = compare_external(
            &label,
            &runs,
            &mut deployed,
            &eos,
            &args.thresholds,
            &progress,
        )?;
        let finding = compare_finding(&report);
        compare = Some(compare_report(
            model,
            store,
            &set,
            args.tokens,
            &reference,
            report,
        ));
        Ok(finding)
    }));
    if reference_tokens.len() != set.len() {
        reference_tokens = vec![Vec::new(); set.len()];
    }
    checks.push(Check::of(
        CheckId::Probe,
        external::skipped(CheckId::Probe),
        0.0,
    ));
    checks.push(Check::run(CheckId::Blocks, &progress, || {
        external::pieces(&ctx, &mut deployed, &pieces, &reference_tokens)
    }));
    checks.push(Check::of(
        CheckId::Padding,
        external::skipped(CheckId::Padding),
        0.0,
    ));
    checks.push(Check::run(CheckId::PrefixReuse, &progress, || {
        external::prefix_reuse(&ctx, &mut deployed, &mut reference)
    }));
    checks.push(Check::of(
        CheckId::PromptLookup,
        external::skipped(CheckId::PromptLookup),
        0.0,
    ));
    checks.push(Check::run(CheckId::BackToBack, &progress, || {
        external::back_to_back(&ctx, &mut deployed)
    }));
    checks.push(Check::run(CheckId::Length, &progress, || {
        length::length(&ctx.lengths(), &mut deployed, &mut reference, max_length)
    }));
    checks.push(Check::run(CheckId::OverLong, &progress, || {
        length::over_long(&ctx.lengths(), &mut deployed)
    }));
    progress.finish();
    for c in &mut checks {
        c.title = external::title(c.id).unwrap_or(c.title);
        c.next = external::next(c.id).unwrap_or(c.next);
    }

    let section = DeviceSection::new(&device, &record, ctx.graphs.take(), &args.allow_precision);
    checks.splice(0..0, setup::checks(&section));

    let report = ValidateReport {
        machine: Machine::detect(),
        inputs: ValidateInputs {
            model: model.display().to_string(),
            weights: store.format().name(),
            device: device.clone(),
            ir: Some(dir.display().to_string()),
            ir_reference_weights: ir.manifest.reference_weights.clone(),
            warnings,
            prompts: set.iter().map(|p| (p.label.clone(), p.ids.len())).collect(),
            tokens: args.tokens,
            block: None,
            context,
            blocks: pieces,
            lookup_tokens: None,
            lookup_max_ngram: None,
            lookup_max_draft: None,
            max_length,
            probe_mode: None,
            fault: args.inject_fault.clone(),
        },
        thresholds: ctx.thresholds,
        device: section,
        checks,
        seconds: start.elapsed().as_secs_f64(),
        compare,
        probe: None,
    };
    report.emit(&args.report)?;
    Ok(if report.passed() {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}
