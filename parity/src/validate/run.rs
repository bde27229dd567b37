//! `validate`'s run, for any device under test: every check in order, each where the device's capabilities allow
//! it, then the device section and the two setup checks over every graph the checks compiled.

use super::images::ValidateImages;
use super::setup::{self, DeviceSection};
use super::{Check, CheckId, Context, Finding, equivalence, images, length, lookup};
use crate::compare::run::{compare_device, reference_runs};
use crate::compare::{DeviceReport, ThresholdOverrides};
use crate::device::fault::Fault;
use crate::device::{Capabilities, DeviceUnderTest, reference_on};
use crate::metrics::{exceeds, nan_max};
use crate::probe::Mode;
use crate::probe::run::{ProbePlan, how};
use crate::progress::Progress;
use crate::prompts::LabelledPrompt;
use crate::report::validate::{ValidateInputs, ValidateReport};
use crate::report::{CompareReport, Inputs, Machine};
use anyhow::{Context as _, Result, bail};
use reference::backend::{Backend, LookupOptions};
use reference::config::Config;
use reference::model::Model;
use reference::model::RunOptions;
use reference::weights::WeightStore;
use std::path::Path;
use std::time::Instant;

/// A graph set made elsewhere, as the report names it.
#[derive(Debug, Clone)]
pub struct SetInputs {
    /// Its directory.
    pub dir: String,
    /// What its manifest says the reference must run.
    pub reference_weights: Option<String>,
}

/// What to validate, and how.
pub struct ValidatePlan<'a> {
    /// The checkpoint directory.
    pub dir: &'a Path,
    /// Its config.
    pub config: &'a Config,
    /// The weights the reference runs.
    pub store: &'a WeightStore,
    /// The prompt set.
    pub set: &'a [LabelledPrompt],
    /// A prompt that repeats itself.
    pub repeated: &'a LabelledPrompt,
    /// End-of-sequence ids.
    pub eos: &'a [u32],
    /// Greedy tokens per prompt.
    pub tokens: usize,
    /// Thresholds given on the command line.
    pub thresholds: ThresholdOverrides,
    /// The probe's mode.
    pub probe_mode: Mode,
    /// The probe's largest output NRMSE.
    pub probe_max_nrmse: Option<f64>,
    /// The probe's largest state NRMSE.
    pub probe_max_state_nrmse: Option<f64>,
    /// The block sizes the prompt is fed in, each against the deployed graphs.
    pub blocks: Vec<usize>,
    /// Prompt lookup's n-gram and draft sizes.
    pub lookup: LookupOptions,
    /// Tokens per prompt-lookup run.
    pub lookup_tokens: usize,
    /// The longest prompt of the length check.
    pub max_length: usize,
    /// Precisions accepted in place of the one asked.
    pub allow_precision: Vec<String>,
    /// The set made elsewhere, if the device is one.
    pub set_inputs: Option<SetInputs>,
    /// Warnings of the run, for the report.
    pub warnings: Vec<String>,
    /// The injected fault (tests only), as given.
    pub fault: Option<(Fault, String)>,
    /// A prompt with images (`--image`): the images check, and the probe on it.
    pub images: Option<ValidateImages<'a>>,
}

/// Why a check does not apply to a device of `caps`, naming what it would need (`None`: it applies).
pub fn skip_reason(id: CheckId, caps: &Capabilities) -> Option<String> {
    match id {
        CheckId::Probe => how(caps).err(),
        CheckId::Padding if caps.block.is_some() && !caps.token_valid => Some(
            "the graphs take no `token_valid` (a set maps it as `decoder.inputs.token_valid`), so a prompt's last \
             block cannot be padded"
                .into(),
        ),
        CheckId::Padding if caps.block.is_some() && !caps.single_token => Some(
            "the unpadded prompt needs a 1-token graph for its tail, which the set does not have".into(),
        ),
        CheckId::PromptLookup if !caps.states => Some(format!(
            "prompt lookup restores the state from before a verify call after a partial match; the state is {}",
            caps.states_note
        )),
        _ => None,
    }
}

/// Where to look when a check of a set made elsewhere fails, where it differs from [`CheckId::next`].
fn set_next(id: CheckId) -> Option<&'static str> {
    match id {
        CheckId::Compare => Some(
            "--weights as the graphs hold them (the manifest's reference_weights), the manifest's port roles and \
             layouts, then qwen35 compare-devices --ir DIR --report r.md (the appendix below): the first state over \
             threshold",
        ),
        CheckId::Blocks | CheckId::PrefixReuse => Some(
            "the set's handling of a call after others: the manifest's attention_mask and positions, each state's \
             layout and cache update (`past` → `past+tokens`, `context`, `tokens`)",
        ),
        CheckId::Padding => Some(
            "token_valid masking in the set's graphs, and the attention mask of the padded slots",
        ),
        CheckId::Length => Some(
            "qwen35 probe --ir DIR --mode chained on a prompt of the first failing length: the state drift per block",
        ),
        CheckId::Probe => Some(
            "qwen35 probe --ir DIR --mode isolated: the layer, and the state or op where the error starts",
        ),
        _ => None,
    }
}

/// A skipped check's finding.
fn skipped(why: String) -> Finding {
    Finding {
        figure: format!("skipped: {why}"),
        skipped: Some(why),
        ..Finding::default()
    }
}

/// The compare check's finding from the device's compare-devices report.
fn compare_finding(report: &DeviceReport) -> Finding {
    let layers = if report.layers.is_empty() {
        "layers not exposed".to_string()
    } else {
        format!(
            "worst layer NRMSE {:.1e}",
            nan_max(report.layers.iter().map(|l| l.output.nrmse.get()))
        )
    };
    let states = match report
        .states
        .iter()
        .max_by(|a, b| a.error.nrmse.get().total_cmp(&b.error.nrmse.get()))
    {
        Some(s) => format!(", worst state NRMSE {:.1e} ({})", s.error.nrmse, s.name),
        None => String::new(),
    };
    Finding {
        figure: format!(
            "greedy {}/{}, top-1 {:.1}, KL mean {:.1e}, logits NMSE {:.1e}, {layers}{states}",
            report.greedy_matched,
            report.greedy_total,
            report.all.same_top1.percent(),
            report.all.kl_mean,
            report.logits.nmse,
        ),
        failures: report.failures.clone(),
        // An MoE model's routing in one line beside the verdict (its whole report is in the compare JSON).
        notes: std::iter::once(crate::report::compare::first_divergence_line(report))
            .chain(
                report
                    .routing
                    .iter()
                    .map(crate::report::routing::summary_line),
            )
            .collect(),
        details: serde_json::Value::Null,
        ..Finding::default()
    }
}

/// Fails unless every run of every check fits the model's positions and the static context of `caps` (when it has
/// one), naming the check and the flag.
pub fn check_fits(plan: &ValidatePlan, caps: &Capabilities) -> Result<()> {
    for p in plan.set.iter().chain(std::iter::once(plan.repeated)) {
        crate::device::check_positions(p.ids.len(), plan.tokens, plan.config, "--tokens")
            .with_context(|| format!("prompt `{}`", p.label))?;
    }
    let Some(context) = caps.context else {
        return Ok(());
    };
    let source = &caps.context_source;
    let fits = |what: String, prompt: usize, generate: usize| -> Result<()> {
        crate::device::check_context(prompt, generate, context, source).map_err(|e| e.context(what))
    };
    for &b in &plan.blocks {
        if b > context {
            bail!(
                "--blocks: a block of {b} tokens does not fit the static context of {context} ({source})"
            );
        }
    }
    if plan.max_length + 1 > context {
        bail!(
            "--max-length {}: a prompt of {} tokens and one decode step need {} cache slots, but the static context \
             holds {context} ({source})",
            plan.max_length,
            plan.max_length,
            plan.max_length + 1
        );
    }
    for p in plan.set.iter().chain(std::iter::once(plan.repeated)) {
        fits(
            format!("prompt `{}` (--tokens)", p.label),
            p.ids.len(),
            plan.tokens,
        )?;
        if caps.states {
            fits(
                format!("prompt lookup on `{}` (--lookup-tokens)", p.label),
                p.ids.len(),
                plan.lookup_tokens,
            )?;
        }
    }
    if let Some(images) = &plan.images {
        let p = images.prompt;
        crate::device::check_positions(p.ids.len(), plan.tokens, plan.config, "--tokens")
            .with_context(|| format!("prompt `{}`", p.label))?;
        fits(
            format!("prompt `{}` (--tokens)", p.label),
            p.ids.len(),
            plan.tokens,
        )?;
        let follow = equivalence::follow_up(plan.set);
        fits(
            format!(
                "a follow-up after `{}`: `{}` (--tokens)",
                p.label, follow.label
            ),
            p.ids.len() + plan.tokens + follow.ids.len(),
            plan.tokens,
        )?;
    }
    let (turn1, follow) = (&plan.set[0], equivalence::follow_up(plan.set));
    fits(
        format!(
            "prefix reuse: `{}`, its answer and `{}` (--tokens)",
            turn1.label, follow.label
        ),
        turn1.ids.len() + plan.tokens + follow.ids.len(),
        plan.tokens,
    )
}

/// Runs every check on `dut`.
pub fn run(
    plan: &ValidatePlan,
    dut: &mut dyn DeviceUnderTest,
    start: Instant,
) -> Result<ValidateReport> {
    let caps = dut.capabilities().clone();
    if let Some((fault, name)) = &plan.fault {
        if fault.acts_on_state() && !caps.states {
            bail!(
                "--inject-fault {name}: this fault acts on the device's state, which {} does not expose; \
                 logits-from=POSITION applies",
                dut.label()
            );
        }
        if fault.own_graphs_only() && !caps.any_block {
            bail!(
                "--inject-fault {name}: this fault needs this project's graphs (built per block size and per \
                 layer), not {}",
                dut.label()
            );
        }
    }
    check_fits(plan, &caps)?;
    let record = dut.record()?;
    let thresholds = plan.thresholds.resolve(&record.judged_precision());
    let ctx = Context {
        config: plan.config,
        set: plan.set,
        repeated: plan.repeated,
        tokens: plan.tokens,
        eos: plan.eos,
        thresholds,
    };
    let progress = Progress::new(CheckId::ALL.len() + 2 * plan.set.len());
    let mut checks = Vec::new();
    // One model for both reference backends (with taps, and plain): one copy of its weights.
    let model = Model::from_weights(plan.config.clone(), plan.store)?;
    let mut reference = reference_on(model.clone(), plan.store, RunOptions::default(), true)?;
    let mut compare = None;
    let mut reference_tokens: Vec<Vec<u32>> = Vec::new();
    checks.push(Check::run(CheckId::Compare, &progress, || {
        let runs = reference_runs(&mut reference, plan.set, plan.tokens, &progress)?;
        reference_tokens = runs.iter().map(|r| r.tokens.clone()).collect();
        let report = compare_device(dut, &runs, plan.eos, &plan.thresholds, &progress)?;
        let finding = compare_finding(&report);
        compare = Some(CompareReport {
            command: "compare-devices".into(),
            machine: Machine::detect(),
            inputs: Inputs {
                model: plan.dir.display().to_string(),
                weights: plan.store.format().name(),
                prompts: plan
                    .set
                    .iter()
                    .map(|p| (p.label.clone(), p.ids.len()))
                    .collect(),
                tokens: plan.tokens,
                reference: reference.record().clone(),
            },
            quantization: None,
            devices: vec![report],
            memory: None,
        });
        Ok(finding)
    }));
    checks.push(match &plan.images {
        None => {
            let why = if crate::images::vision_config(plan.dir).is_ok() {
                "no --image given: the checkpoint's vision tower (the device's vision graph, the decoder on image \
                 rows) was not checked"
            } else {
                "the checkpoint has no vision tower (no vision_config in its config.json)"
            };
            Check::of(CheckId::Images, skipped(why.into()), 0.0)
        }
        Some(images) => Check::run(CheckId::Images, &progress, || {
            images::images(
                &ctx,
                dut,
                &model,
                &mut reference,
                plan.store,
                &plan.thresholds,
                images,
                equivalence::follow_up(plan.set),
                &plan.set[0],
                &progress,
            )
        }),
    });
    if reference_tokens.len() != plan.set.len() {
        reference_tokens = vec![Vec::new(); plan.set.len()];
    }
    let mut probe = None;
    checks.push(match skip_reason(CheckId::Probe, &caps) {
        Some(why) => Check::of(CheckId::Probe, skipped(why), 0.0),
        None => Check::run(CheckId::Probe, &progress, || {
            // With images, the layers are probed on the prompt with them (the reference tower's rows, the image
            // tokens' MRoPE positions).
            let embedded = match &plan.images {
                Some(i) => Some(
                    crate::images::reference_images(
                        &model.token_table(),
                        plan.store,
                        i.vc,
                        i.prompt.ids.clone(),
                        i.pixels,
                        false,
                    )?
                    .prompt,
                ),
                None => None,
            };
            let prompt = plan.images.as_ref().map_or(&plan.set[0], |i| i.prompt);
            let report = crate::probe::run::run(
                &ProbePlan {
                    dir: plan.dir,
                    config: plan.config,
                    store: plan.store,
                    prompt,
                    layers: &[],
                    mode: plan.probe_mode,
                    max_nrmse: plan.probe_max_nrmse,
                    max_state_nrmse: plan.probe_max_state_nrmse,
                    model: Some(&model),
                    images: embedded.as_ref(),
                    fed_routing: true,
                },
                dut,
                None,
            )?;
            let finding = probe_finding(&report, plan, &prompt.label);
            probe = Some(report);
            Ok(finding)
        }),
    });
    let mut plain_reference = reference_on(model, plan.store, RunOptions::default(), false)?;
    checks.push(Check::run(CheckId::Blocks, &progress, || {
        equivalence::blocks(&ctx, dut, &plan.blocks, &reference_tokens)
    }));
    checks.push(match skip_reason(CheckId::Padding, &caps) {
        Some(why) => Check::of(CheckId::Padding, skipped(why), 0.0),
        None => Check::run(CheckId::Padding, &progress, || {
            equivalence::padding(&ctx, dut)
        }),
    });
    checks.push(Check::run(CheckId::PrefixReuse, &progress, || {
        equivalence::prefix_reuse(&ctx, dut, &mut plain_reference)
    }));
    checks.push(match skip_reason(CheckId::PromptLookup, &caps) {
        Some(why) => Check::of(CheckId::PromptLookup, skipped(why), 0.0),
        None => Check::run(CheckId::PromptLookup, &progress, || {
            lookup::lookup(&ctx, dut, plan.lookup, plan.lookup_tokens)
        }),
    });
    checks.push(Check::run(CheckId::BackToBack, &progress, || {
        equivalence::back_to_back(&ctx, dut)
    }));
    checks.push(Check::run(CheckId::Length, &progress, || {
        length::length(
            &ctx.lengths(&caps),
            dut.deployed()?,
            &mut plain_reference,
            plan.max_length,
        )
    }));
    checks.push(Check::run(CheckId::OverLong, &progress, || {
        length::over_long(&ctx.lengths(&caps), dut.deployed()?)
    }));
    progress.finish();
    if plan.set_inputs.is_some() {
        for c in &mut checks {
            c.next = set_next(c.id).unwrap_or(c.next);
        }
    }
    let section = DeviceSection::new(dut.device(), &record, dut.graphs(), &plan.allow_precision);
    checks.splice(0..0, setup::checks(&section));
    Ok(ValidateReport {
        machine: Machine::detect(),
        inputs: ValidateInputs {
            model: plan.dir.display().to_string(),
            weights: plan.store.format().name(),
            device: dut.label().to_string(),
            ir: plan.set_inputs.as_ref().map(|s| s.dir.clone()),
            ir_reference_weights: plan
                .set_inputs
                .as_ref()
                .and_then(|s| s.reference_weights.clone()),
            warnings: plan.warnings.clone(),
            capabilities: caps.clone(),
            prompts: plan
                .set
                .iter()
                .chain(plan.images.as_ref().map(|i| i.prompt))
                .map(|p| (p.label.clone(), p.ids.len()))
                .collect(),
            tokens: plan.tokens,
            block: caps.block,
            context: caps.context,
            blocks: plan.blocks.clone(),
            lookup_tokens: caps.states.then_some(plan.lookup_tokens),
            lookup_max_ngram: caps.states.then_some(plan.lookup.max_ngram),
            lookup_max_draft: caps.states.then_some(plan.lookup.max_draft),
            max_length: plan.max_length,
            probe_mode: how(&caps).is_ok().then(|| plan.probe_mode.name().into()),
            fault: plan.fault.as_ref().map(|(_, n)| n.clone()),
        },
        thresholds,
        device: section,
        checks,
        seconds: start.elapsed().as_secs_f64(),
        compare,
        probe,
        memory: None,
    })
}

/// The probe check's finding from the probe report.
fn probe_finding(
    report: &crate::report::probe::ProbeReport,
    plan: &ValidatePlan,
    label: &str,
) -> Finding {
    let worst = report
        .layers
        .iter()
        .filter_map(|l| l.output.map(|o| (l.layer, o.nrmse.get())))
        .max_by(|a, b| a.1.total_cmp(&b.1));
    let state = report
        .layers
        .iter()
        .flat_map(|l| {
            l.states
                .iter()
                .map(|s| (s.error.nrmse.get(), s.name.clone()))
        })
        .max_by(|a, b| a.0.total_cmp(&b.0));
    Finding {
        figure: format!(
            "{} mode through {}, `{}`: worst layer output NRMSE {}, state {} (≤ {:.1e} / {:.1e})",
            plan.probe_mode.name(),
            report.inputs.via,
            label,
            worst.map_or("not exposed".into(), |(l, e)| format!("{e:.1e} (L{l})")),
            state.map_or("-".into(), |(e, n)| format!("{e:.1e} ({n})")),
            report.thresholds.max_nrmse,
            report.thresholds.max_state_nrmse
        ),
        failures: report
            .layers
            .iter()
            .filter(|l| l.over)
            .map(|l| {
                let what = match (l.output, l.worst_state()) {
                    (Some(o), Some(s)) => format!(
                        "output NRMSE {:.2e}, worst state {} NRMSE {:.2e}",
                        o.nrmse, s.name, s.error.nrmse
                    ),
                    (Some(o), None) => format!("output NRMSE {:.2e}", o.nrmse),
                    (None, Some(s)) => {
                        format!("worst state {} NRMSE {:.2e}", s.name, s.error.nrmse)
                    }
                    (None, None) => "over threshold".into(),
                };
                // Which of the validate flags the layer exceeds (none named when only a NaN put it over).
                let (output, state) = l.worst();
                let t = l.thresholds;
                let over: Vec<String> = [
                    ("outputs", output, t.max_nrmse, "--probe-max-nrmse"),
                    (
                        "states",
                        state,
                        t.max_state_nrmse,
                        "--probe-max-state-nrmse",
                    ),
                ]
                .into_iter()
                .filter(|&(_, e, max, _)| exceeds(e, max))
                .map(|(what, e, max, flag)| format!("{what} {e:.2e} > {max:.1e} ({flag})"))
                .collect();
                let over = if over.is_empty() {
                    String::new()
                } else {
                    format!("; {}", over.join(", "))
                };
                format!("layer {} ({}): {what}{over}", l.layer, l.kind)
            })
            .chain(report.drill_down.iter().filter_map(|d| {
                d.first_over
                    .as_ref()
                    .map(|op| format!("the error starts at layer {}'s {op}", d.layer))
            }))
            .chain(report.routing_failure())
            .collect(),
        ..Finding::default()
    }
}
