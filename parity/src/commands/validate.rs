//! `qwen35 validate`: every check a new NPU needs on one device, one report, exit 0 only when every check passes
//! (see [`crate::validate`] for the checks). With `--ir DIR` (module `ir`) the checks that apply to a graph made
//! elsewhere run on it, and the others are reported as skipped.

mod ir;

use crate::backends::{DeviceSettings, check_context, check_device, open_reference};
use crate::commands::Outcome;
use crate::commands::compare_devices::{
    LabelledPrompt, ThresholdArgs, compare_device, eos_ids, prompts, reference_runs,
};
use crate::commands::probe::{ProbeRequest, run_probe};
use crate::compare::DeviceReport;
use crate::options::{FormArgs, GraphArgs, ModelArgs, PromptArgs};
use crate::probe::Mode;
use crate::progress::Progress;
use crate::report::validate::{ValidateInputs, ValidateReport};
use crate::report::{CompareReport, Inputs, Machine, ReportArgs};
use crate::validate::fault::Fault;
use crate::validate::setup::{self, DeviceSection};
use crate::validate::{Check, CheckId, Context, Finding, GraphInfo, equivalence, length, lookup};
use anyhow::{Context as _, Result, bail};
use reference::backend::{Backend, LookupOptions};
use reference::model::RunOptions;
use reference::tokenizer::{ChatTokenizer, Message};
use reference::weights::WeightStore;
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Arguments of `qwen35 validate`.
#[derive(clap::Args)]
pub struct ValidateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The device to validate: an OpenVINO device (NPU, CPU, GPU, …) or FP16SIM[:options]. With --ir, an OpenVINO
    /// device (default CPU).
    #[arg(long, required_unless_present = "ir")]
    device: Option<String>,
    /// Validate an external stateful IR (graphs made elsewhere, e.g. optimum-intel's export) instead of this
    /// project's graphs: DIR holds the IR and a manifest.json of its ports, as `compare-devices --ir`. The checks
    /// that need this project's graphs or the state (probe, padding, prompt lookup; over-long without a static
    /// context in the manifest) are skipped; give --weights as the IR holds them (its manifest's `reference_weights`).
    #[arg(long, value_name = "DIR")]
    ir: Option<PathBuf>,
    #[command(flatten)]
    prompt: PromptArgs,
    /// A prompt set, one JSON object per line (as compare-devices). Default: the set shipped with the project.
    #[arg(long, value_name = "FILE.jsonl", conflicts_with_all = ["token_ids", "prompt"])]
    prompts: Option<PathBuf>,
    /// Greedy tokens per prompt (compare, blocks, padding, prefix reuse, back-to-back).
    #[arg(long, default_value_t = 12, value_name = "N")]
    tokens: usize,
    #[command(flatten)]
    thresholds: ThresholdArgs,
    /// The probe's mode: isolated (each layer fed the reference's input and state, the default) or chained.
    #[arg(long, value_enum)]
    probe_mode: Option<Mode>,
    /// The probe's largest NRMSE of a layer's outputs (default as `probe --max-nrmse`).
    #[arg(long, value_name = "X")]
    probe_max_nrmse: Option<f64>,
    /// The probe's largest NRMSE of a state (default as `probe --max-state-nrmse`).
    #[arg(long, value_name = "X")]
    probe_max_state_nrmse: Option<f64>,
    /// Prompt blocks compared with each other (each must fit --context; default 1,16,64). With --ir: the pieces
    /// the prompt is fed in, each against the prompt in one call (default 1,16).
    #[arg(long, value_delimiter = ',', value_name = "1,16,64")]
    blocks: Option<Vec<usize>>,
    /// Tokens generated per prompt by plain greedy and by prompt-lookup decoding (default 64).
    #[arg(long, value_name = "N")]
    lookup_tokens: Option<usize>,
    /// Prompt lookup: the longest n-gram looked up in the context (default 3).
    #[arg(long, value_name = "N")]
    lookup_ngram: Option<usize>,
    /// Prompt lookup: the most draft tokens verified per call (default 4).
    #[arg(long, value_name = "K")]
    lookup_draft: Option<usize>,
    /// The longest prompt of the length check (default: the static context less the decode step's slot; with an
    /// --ir that declares no static context, 255).
    #[arg(long, value_name = "N")]
    max_length: Option<usize>,
    /// Precisions accepted in place of the one asked, comma separated (e.g. bf16: the CPU asked for f16 computes
    /// bf16 where it has no f16 arithmetic). Without it another precision fails the precision check.
    #[arg(long, value_delimiter = ',', value_name = "bf16")]
    allow_precision: Vec<String>,
    #[command(flatten)]
    report: ReportArgs,
    #[command(flatten)]
    form: FormArgs,
    #[command(flatten)]
    graph: GraphArgs,
    /// Tests only: make the device misbehave (leak-state, ignore-restore, logits-from=POSITION).
    #[arg(long, hide = true, value_name = "FAULT")]
    inject_fault: Option<String>,
}

impl ValidateArgs {
    /// The device (CPU when only --ir is given).
    fn device(&self) -> &str {
        self.device.as_deref().unwrap_or("CPU")
    }

    /// The probe's mode.
    fn probe_mode(&self) -> Mode {
        self.probe_mode.unwrap_or(Mode::Isolated)
    }

    /// The block sizes compared (the pieces, with --ir).
    fn blocks(&self) -> Vec<usize> {
        match (&self.blocks, &self.ir) {
            (Some(b), _) => b.clone(),
            (None, Some(_)) => vec![1, 16],
            (None, None) => vec![1, 16, 64],
        }
    }

    /// Tokens per prompt-lookup run.
    fn lookup_tokens(&self) -> usize {
        self.lookup_tokens.unwrap_or(64)
    }

    /// Prompt lookup's longest n-gram.
    fn lookup_ngram(&self) -> usize {
        self.lookup_ngram.unwrap_or(3)
    }

    /// Prompt lookup's most draft tokens per call.
    fn lookup_draft(&self) -> usize {
        self.lookup_draft.unwrap_or(4)
    }
}

/// The prompt prompt lookup's drafts hit on: a chat message that repeats itself (token ids repeated when the
/// checkpoint has no tokenizer).
fn repeated_prompt(dir: &Path, set: &[LabelledPrompt]) -> Result<LabelledPrompt> {
    let ids = match ChatTokenizer::load(dir) {
        Ok(tok) => {
            let text = "the cat sat on the mat. ".repeat(4);
            tok.encode_chat(&[Message::new("user", text.trim())], false)?
        }
        Err(_) => {
            let head = &set[0].ids[..set[0].ids.len().min(8)];
            head.repeat(4)
        }
    };
    Ok(LabelledPrompt {
        label: "repeated".into(),
        ids,
    })
}

/// Fails unless every run of every check fits the static context, naming the check and the flag.
fn check_fits(
    args: &ValidateArgs,
    set: &[LabelledPrompt],
    repeated: &LabelledPrompt,
    context: usize,
    max_length: usize,
) -> Result<()> {
    for b in args.blocks() {
        if b == 0 {
            bail!("--blocks: a block must hold at least 1 token");
        }
        if b > context {
            bail!(
                "--blocks: a block of {b} tokens does not fit the static context of {context} (--context)"
            );
        }
    }
    if max_length + 1 > context {
        bail!(
            "--max-length {max_length}: a prompt of {max_length} tokens and one decode step need {} cache slots, but \
             the static context holds {context} (--context)",
            max_length + 1
        );
    }
    for p in set {
        check_context(p.ids.len(), args.tokens, context)
            .with_context(|| format!("prompt `{}` (--tokens)", p.label))?;
    }
    for p in set.iter().chain(std::iter::once(repeated)) {
        check_context(p.ids.len(), args.lookup_tokens(), context)
            .with_context(|| format!("prompt lookup on `{}` (--lookup-tokens)", p.label))?;
    }
    let (turn1, follow) = (&set[0], equivalence::follow_up(set));
    check_context(
        turn1.ids.len() + args.tokens + follow.ids.len(),
        args.tokens,
        context,
    )
    .with_context(|| {
        format!(
            "prefix reuse: `{}`, its answer and `{}` (--tokens)",
            turn1.label, follow.label
        )
    })?;
    Ok(())
}

/// The compare check's finding from the device's compare-devices report.
fn compare_finding(report: &DeviceReport) -> Finding {
    let layers = if report.layers.is_empty() {
        "layers not exposed".to_string()
    } else {
        format!(
            "worst layer NRMSE {:.1e}",
            report
                .layers
                .iter()
                .map(|l| l.output.nrmse)
                .fold(0.0, f64::max)
        )
    };
    Finding {
        figure: format!(
            "greedy {}/{}, top-1 {:.1}%, KL mean {:.1e}, logits NMSE {:.1e}, {layers}",
            report.greedy_matched,
            report.greedy_total,
            100.0 * report.all.same_top1,
            report.all.kl_mean,
            report.logits.nmse,
        ),
        failures: report.failures.clone(),
        notes: vec![crate::report::compare::first_divergence_line(report)],
        details: serde_json::Value::Null,
        ..Finding::default()
    }
}

/// The compare-devices report of the compare check (the appendix of the validate report).
fn compare_report(
    dir: &Path,
    store: &WeightStore,
    set: &[LabelledPrompt],
    tokens: usize,
    reference: &dyn Backend,
    device: DeviceReport,
) -> CompareReport {
    CompareReport {
        command: "compare-devices".into(),
        machine: Machine::detect(),
        inputs: Inputs {
            model: dir.display().to_string(),
            weights: store.format().name(),
            prompts: set.iter().map(|p| (p.label.clone(), p.ids.len())).collect(),
            tokens,
            reference: reference.record().clone(),
        },
        quantization: None,
        devices: vec![device],
    }
}

/// Runs `qwen35 validate`.
pub fn exec(args: ValidateArgs) -> Result<Outcome> {
    let start = Instant::now();
    args.thresholds.validate()?;
    for (flag, v) in [
        ("--probe-max-nrmse", args.probe_max_nrmse),
        ("--probe-max-state-nrmse", args.probe_max_state_nrmse),
    ] {
        if let Some(v) = v
            && !(v >= 0.0 && v.is_finite())
        {
            bail!("{flag} {v}: must be a finite number ≥ 0");
        }
    }
    for (flag, v) in [
        ("--tokens", args.tokens),
        ("--lookup-tokens", args.lookup_tokens()),
        ("--lookup-ngram", args.lookup_ngram()),
        ("--lookup-draft", args.lookup_draft()),
    ] {
        if v == 0 {
            bail!("{flag} must be at least 1");
        }
    }
    if args.blocks().is_empty() {
        bail!("--blocks: no block given");
    }
    if args.max_length == Some(0) {
        bail!("--max-length must be at least 1");
    }
    let fault = args.inject_fault.as_deref().map(Fault::parse).transpose()?;
    if let Some(dir) = args.ir.clone() {
        return ir::exec(args, &dir, fault, start);
    }
    let device = args.device().to_string();
    let settings = DeviceSettings::resolve(&device, &args.graph, &args.form)?;
    check_device(&device).context("--device")?;
    let context = settings.graph.context;
    let max_length = args.max_length.unwrap_or(context.saturating_sub(1));
    let (dir, config, store) = args.model.open()?;
    let set = prompts(&args.prompt, args.prompts.as_deref(), &dir, &config)?;
    let repeated = repeated_prompt(&dir, &set)?;
    check_fits(&args, &set, &repeated, context, max_length)?;
    args.report.check()?;
    let eos = eos_ids(&dir, &config);

    let progress = Progress::new(CheckId::ALL.len() + 1 + 2 * set.len());
    progress.step(&format!("{device}: compiling"));
    let ctx = Context {
        config: &config,
        store: &store,
        settings: &settings,
        set: &set,
        repeated: &repeated,
        tokens: args.tokens,
        eos: &eos,
        // Replaced below, once the deployed graphs say which precision ran.
        thresholds: args.thresholds.resolve("f32"),
        fault,
        graphs: RefCell::new(Vec::new()),
    };
    let mut deployed = ctx.open(settings.block, "deployed")?;
    let record = deployed.record().clone();
    let precision = record.precision.clone().unwrap_or_else(|| "f32".into());
    let ctx = Context {
        thresholds: args.thresholds.resolve(&precision),
        ..ctx
    };

    let mut checks = Vec::new();
    let mut reference = open_reference(&config, &store, RunOptions::default(), true)?;
    let mut compare = None;
    let mut reference_tokens: Vec<Vec<u32>> = Vec::new();
    checks.push(Check::run(CheckId::Compare, &progress, || {
        let runs = reference_runs(&mut reference, &set, args.tokens, &progress)?;
        reference_tokens = runs.iter().map(|r| r.tokens.clone()).collect();
        let mut tapped = ctx.open_tapped()?;
        let report = compare_device(
            &device,
            &runs,
            &mut deployed,
            &mut tapped,
            &eos,
            &args.thresholds,
            &progress,
        )?;
        let finding = compare_finding(&report);
        compare = Some(compare_report(
            &dir,
            &store,
            &set,
            args.tokens,
            &reference,
            report,
        ));
        Ok(finding)
    }));
    let mut probe = None;
    checks.push(Check::run(CheckId::Probe, &progress, || {
        let report = run_probe(ProbeRequest {
            dir: &dir,
            config: &config,
            store: &store,
            settings: &settings,
            prompt: &set[0],
            layers: &[],
            mode: args.probe_mode(),
            max_nrmse: args.probe_max_nrmse,
            max_state_nrmse: args.probe_max_state_nrmse,
            baseline: None,
        })?;
        ctx.graphs.borrow_mut().push(GraphInfo {
            purpose: "probe layers".into(),
            graph: "per-layer graphs".into(),
            precision: report.record.precision.clone().unwrap_or_default(),
            execution_devices: report.record.execution_devices.clone(),
            compile_seconds: report.record.compile_seconds.unwrap_or(0.0),
            loaded_from_cache: {
                let hits: Vec<bool> = report.record.from_cache.values().copied().collect();
                match hits.first() {
                    Some(&first) if hits.iter().all(|&h| h == first) => Some(first),
                    _ => None,
                }
            },
        });
        let worst = report
            .layers
            .iter()
            .max_by(|a, b| a.output.nrmse.total_cmp(&b.output.nrmse));
        let state = report
            .layers
            .iter()
            .flat_map(|l| l.states.iter().map(|s| s.error.nrmse))
            .fold(0.0, f64::max);
        let finding = Finding {
            figure: format!(
                "{} mode, `{}`: worst layer output NRMSE {}, state {state:.1e} (≤ {:.1e} / {:.1e})",
                args.probe_mode().name(),
                set[0].label,
                worst.map_or("-".into(), |l| format!(
                    "{:.1e} (L{})",
                    l.output.nrmse, l.layer
                )),
                report.thresholds.max_nrmse,
                report.thresholds.max_state_nrmse
            ),
            failures: report
                .layers
                .iter()
                .filter(|l| l.over)
                .map(|l| {
                    format!(
                        "layer {} ({}): output NRMSE {:.2e}",
                        l.layer, l.kind, l.output.nrmse
                    )
                })
                .chain(report.drill_down.iter().filter_map(|d| {
                    d.first_over
                        .as_ref()
                        .map(|op| format!("the error starts at layer {}'s {op}", d.layer))
                }))
                .collect(),
            ..Finding::default()
        };
        probe = Some(report);
        Ok(finding)
    }));
    if reference_tokens.len() != set.len() {
        reference_tokens = vec![Vec::new(); set.len()];
    }
    let mut plain_reference = open_reference(&config, &store, RunOptions::default(), false)?;
    checks.push(Check::run(CheckId::Blocks, &progress, || {
        equivalence::blocks(&ctx, &mut deployed, &args.blocks(), &reference_tokens)
    }));
    checks.push(Check::run(CheckId::Padding, &progress, || {
        equivalence::padding(&ctx, &mut deployed)
    }));
    checks.push(Check::run(CheckId::PrefixReuse, &progress, || {
        equivalence::prefix_reuse(&ctx, &mut deployed, &mut plain_reference)
    }));
    let lookup_opts = LookupOptions {
        max_ngram: args.lookup_ngram(),
        max_draft: args.lookup_draft(),
    };
    checks.push(Check::run(CheckId::PromptLookup, &progress, || {
        lookup::lookup(&ctx, &mut deployed, lookup_opts, args.lookup_tokens())
    }));
    checks.push(Check::run(CheckId::BackToBack, &progress, || {
        equivalence::back_to_back(&ctx, &mut deployed)
    }));
    checks.push(Check::run(CheckId::Length, &progress, || {
        length::length(
            &ctx.lengths(),
            &mut deployed,
            &mut plain_reference,
            max_length,
        )
    }));
    checks.push(Check::run(CheckId::OverLong, &progress, || {
        length::over_long(&ctx.lengths(), &mut deployed)
    }));
    progress.finish();

    // What ran where, over every graph compiled by the checks above.
    let section = DeviceSection::new(&device, &record, ctx.graphs.take(), &args.allow_precision);
    checks.splice(0..0, setup::checks(&section));

    let report = ValidateReport {
        machine: Machine::detect(),
        inputs: ValidateInputs {
            model: dir.display().to_string(),
            weights: store.format().name(),
            device: device.clone(),
            ir: None,
            ir_reference_weights: None,
            warnings: Vec::new(),
            prompts: set.iter().map(|p| (p.label.clone(), p.ids.len())).collect(),
            tokens: args.tokens,
            block: Some(settings.block),
            context: Some(context),
            blocks: args.blocks(),
            lookup_tokens: Some(args.lookup_tokens()),
            lookup_max_ngram: Some(args.lookup_ngram()),
            lookup_max_draft: Some(args.lookup_draft()),
            max_length,
            probe_mode: Some(args.probe_mode().name().into()),
            fault: args.inject_fault.clone(),
        },
        thresholds: ctx.thresholds,
        device: section,
        checks,
        seconds: start.elapsed().as_secs_f64(),
        compare,
        probe,
    };
    report.emit(&args.report)?;
    Ok(if report.passed() {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}
