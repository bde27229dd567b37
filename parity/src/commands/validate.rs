//! `qwen35 validate`: every check a new NPU needs on one device, one report, exit 0 only when every check that ran
//! passes (see [`crate::validate`] for the checks). With `--ir DIR` the device is a graph set made elsewhere, and
//! each check runs where its capabilities allow (the others are reported as skipped, naming what they would need).

use super::Outcome;
use super::args::{
    FormArgs, GraphArgs, ImageArgs, ModeArg, ModelArgs, PromptArgs, ReportArgs, ThresholdArgs,
};
use super::target;
use crate::device::check_device;
use crate::device::fault::Fault;
use crate::memory::{self, Plan};
use crate::outputs::Paths;
use crate::prompts::{eos_ids, repeated_prompt};
use crate::report::Report as _;
use crate::validate::CheckId;
use crate::validate::images::ValidateImages;
use crate::validate::run::{SetInputs, ValidatePlan, run, skip_reason};
use anyhow::{Context as _, Result, bail};
use npu::sim::NumericModel;
use reference::backend::LookupOptions;
use std::path::PathBuf;
use std::time::Instant;

/// The longest prompt of the length check on a device without a static context (`--max-length`): long enough to
/// cross several chunks of an export's DeltaNet scan, short enough for CI.
pub const DEFAULT_MAX_LENGTH: usize = 255;

/// The text of the prompt with images when neither --prompt nor --token-ids gives it.
pub const DEFAULT_IMAGE_PROMPT: &str = "Describe the image.";

/// Arguments of `qwen35 validate`.
#[derive(clap::Args)]
pub struct ValidateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The device to validate: an OpenVINO device (NPU, CPU, GPU, …) or FP16SIM[:options]. With --ir, an OpenVINO
    /// device (default CPU).
    #[arg(long, required_unless_present = "ir")]
    device: Option<String>,
    /// Validate a graph set made elsewhere instead of this project's graphs (see compare-devices --ir): each check
    /// runs where the set's ports allow it; give --weights as the graphs hold them.
    #[arg(long, value_name = "DIR")]
    ir: Option<PathBuf>,
    #[command(flatten)]
    prompt: PromptArgs,
    /// A prompt with images, checked beside the prompt set (the images check): the device's own vision graph, its
    /// text with its own image rows, and the text after the images; the probe then runs on it. --prompt or
    /// --token-ids give its text (default: "Describe the image."), and the prompt set is --prompts or the shipped one.
    #[command(flatten)]
    images: ImageArgs,
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
    probe_mode: Option<ModeArg>,
    /// The probe's largest NRMSE of a layer's outputs (default as `probe --max-nrmse`).
    #[arg(long, value_name = "X")]
    probe_max_nrmse: Option<f64>,
    /// The probe's largest NRMSE of a state (default as `probe --max-state-nrmse`).
    #[arg(long, value_name = "X")]
    probe_max_state_nrmse: Option<f64>,
    /// Prompt blocks the prompts are fed in, each against the deployed graphs (each must fit the context; default
    /// 1,16,64 for this project's graphs, a set's own block sizes and 1, or 1,16 for a set that takes any number of
    /// tokens per call).
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
    /// The longest prompt of the length check (default: the static context less the decode step's slot; without a
    /// static context, 255).
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

/// What validate holds at once, phase by phase, with weights in `format`: the reference model throughout (its
/// backends share it) and the runs, beside one set of graphs at a time: the deployed ones, the ones with taps, the
/// probe's per-layer graphs, another block size's, the fresh copy (each released before the next is compiled).
#[allow(clippy::too_many_arguments)]
fn memory_plan(
    dir: &std::path::Path,
    config: &reference::config::Config,
    dtype: candle_core::DType,
    format: reference::quant::WeightFormat,
    settings: &crate::device::DeviceSettings,
    set: Option<&crate::device::set::SetSource>,
    prompts: usize,
    positions: usize,
) -> Result<Plan> {
    let reference = memory::reference_bytes(dir, config, dtype, format)?;
    let runs = 2 * memory::run_bytes(config, prompts, positions);
    let base = |mut parts: Vec<(String, u64)>| {
        parts.push(("the reference's weights".into(), reference));
        parts.push(("the runs".into(), runs));
        parts
    };
    let d = settings.device.as_str();
    let mut plan = Plan::default();
    if crate::device::llamacpp::is_llamacpp(d) {
        let parts = memory::llamacpp_parts(dir, config, settings.graph.context)?;
        plan.phase(format!("{d}: llama.cpp's worker"), base(parts));
        return Ok(plan);
    }
    match set {
        Some(s) => {
            plan.phase(
                format!("{d}: the set's graphs"),
                base(vec![
                    ("its graphs".into(), memory::set_graph_bytes(&s.set)),
                    ("the runtime".into(), memory::RUNTIME_BYTES),
                ]),
            );
        }
        None => {
            let block = settings.block;
            let graphs: &[usize] = if block > 1 { &[block, 1] } else { &[1] };
            let moe = settings.graph.moe;
            plan.phase(
                format!("{d}: deployed graphs (and each other block size, the fresh copy)"),
                base(memory::graph_parts(
                    config,
                    format,
                    d,
                    graphs,
                    moe,
                    settings.graph.context,
                )),
            );
            plan.phase(
                format!("{d}: graphs with taps"),
                base(memory::graph_parts(
                    config,
                    format,
                    d,
                    &[block],
                    moe,
                    settings.graph.context,
                )),
            );
            let layer = (0..config.num_layers())
                .map(|l| npu::memory::layer_graph_bytes(config, format, l, d, block, moe))
                .max()
                .unwrap_or(0);
            plan.phase(
                format!("{d}: the probe's per-layer graphs"),
                base(vec![
                    (
                        "the largest layer graph (one compiled at a time)".into(),
                        layer,
                    ),
                    ("the runtime".into(), memory::RUNTIME_BYTES),
                ]),
            );
        }
    }
    Ok(plan)
}

/// Runs `qwen35 validate`.
pub fn exec(args: ValidateArgs) -> Result<Outcome> {
    Paths::new()
        .with(&args.model)
        .input("--ir", args.ir.as_ref())
        .input("--prompts", args.prompts.as_ref())
        .with(&args.graph)
        .with(&args.report)
        .check()?;
    let start = Instant::now();
    let thresholds = args.thresholds.overrides()?;
    for p in &args.allow_precision {
        if let reference::backend::Precision::Other(_) = reference::backend::Precision::parse(p) {
            bail!("--allow-precision {p}: expected f32, f16 or bf16 (comma separated)");
        }
    }
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
    let lookup = LookupOptions {
        max_ngram: args.lookup_ngram.unwrap_or(3),
        max_draft: args.lookup_draft.unwrap_or(4),
    };
    let lookup_tokens = args.lookup_tokens.unwrap_or(64);
    for (flag, v) in [
        ("--tokens", args.tokens),
        ("--lookup-tokens", lookup_tokens),
        ("--lookup-ngram", lookup.max_ngram),
        ("--lookup-draft", lookup.max_draft),
    ] {
        if v == 0 {
            bail!("{flag} must be at least 1");
        }
    }
    if let Some(b) = &args.blocks {
        if b.is_empty() {
            bail!("--blocks: no block given");
        }
        if b.contains(&0) {
            bail!("--blocks: a block must hold at least 1 token");
        }
    }
    if args.max_length == Some(0) {
        bail!("--max-length must be at least 1");
    }
    let fault = match &args.inject_fault {
        Some(f) => Some((Fault::parse(f)?, f.clone())),
        None => None,
    };
    let device = args.device.clone().unwrap_or_else(|| "CPU".into());
    if let Some(ir) = &args.ir
        && NumericModel::is_sim(&device)
    {
        bail!(
            "--device {device}: FP16SIM evaluates this project's own graphs; a set made elsewhere runs on an \
             OpenVINO device (--ir {})",
            ir.display()
        );
    }
    let image_source = args.images.source()?;
    let target = target::open(&args.model, args.ir.as_deref(), &args.form, &args.graph)?;
    let mut settings = args.graph.settings(&device, &args.form)?;
    // With images the decoder graphs take embeddings (the port's form): the vision graph's rows, the host's text rows.
    settings.graph.embeddings_input = image_source.is_some();
    check_device(&device).context("--device")?;
    let (dir, config, store) = target.checkpoint();
    let context = target.context(&settings).0;
    let max_length = args
        .max_length
        .unwrap_or_else(|| context.map_or(DEFAULT_MAX_LENGTH, |c| c.saturating_sub(1)));
    if max_length == 0 {
        bail!("the static context of 1 holds no prompt and decode step");
    }
    // With images, --prompt or --token-ids are the prompt with them, and the text checks run the shipped set.
    let images = match &image_source {
        Some(source) => {
            let vc = crate::images::vision_config(dir)?;
            let pixels = source.load_with_videos(dir, &vc)?;
            // Refused before any work when the device cannot make the image rows.
            target.check_images(&pixels.grids, pixels.video_grids(), |i| {
                crate::images::image_name(source, &pixels, i)
            })?;
            let ids = if args.prompt.given() {
                args.prompt.vision_ids(dir, config, &vc, &pixels)?
            } else {
                let chat = crate::prompts::ChatPrompt {
                    prompt: DEFAULT_IMAGE_PROMPT.into(),
                    system: None,
                    think: false,
                };
                let (images, videos) = (&pixels.grids, pixels.video_grids());
                crate::images::image_ids(None, Some(&chat), dir, config, &vc, images, videos)?
            };
            let prompt = crate::prompts::LabelledPrompt {
                label: format!("with {} image(s)", pixels.grids.len()),
                ids,
            };
            Some((vc, pixels, prompt))
        }
        None => None,
    };
    let set = match (&images, &args.prompts) {
        (Some(_), Some(file)) => crate::prompts::PromptSource::File(file.clone()),
        (Some(_), None) => crate::prompts::PromptSource::Default,
        (None, _) => args.prompt.source(args.prompts.as_deref())?,
    }
    .load(dir, config)?;
    let repeated = repeated_prompt(dir, &set)?;
    let outputs = args.report.outputs()?;
    let eos = eos_ids(dir, config);
    let fault_kind = fault.as_ref().map(|(f, _)| *f);
    let positions = set
        .iter()
        .chain(images.as_ref().map(|(_, _, p)| p))
        .map(|p| p.ids.len())
        .max()
        .unwrap_or(0)
        + args.tokens;
    let dtype = args.model.dtype.dtype();
    let plan_for = |format| {
        let mut plan = memory_plan(
            dir,
            config,
            dtype,
            format,
            &settings,
            target.set(),
            set.len(),
            positions,
        )?;
        if let Some((vc, pixels, _)) = &images {
            memory::add_images(&mut plan, vc, pixels.patches(), 2, &[&settings.device]);
        }
        Ok(plan)
    };
    let memory = memory::check_formats("validate", store.format(), plan_for, Vec::new())?;
    // The image check's vision graph compiles as the decoder's graphs do.
    let image_settings = settings.clone();
    let mut dut = target.device(settings, fault_kind)?;
    // A flag that configures a check which cannot run on this device is refused, not ignored.
    let caps = dut.capabilities().clone();
    // The block sizes compared: this project's graphs compile 1, 16 and 64; a set is fed in pieces of its own
    // block sizes (and single tokens), or of 1 and 16 when it takes any number of tokens per call.
    let blocks = args.blocks.clone().unwrap_or_else(|| {
        if caps.any_block {
            vec![1, 16, 64]
        } else if caps.blocks.is_empty() {
            vec![1, 16]
        } else {
            let mut b = caps.blocks.clone();
            b.insert(0, 1);
            b.dedup();
            b
        }
    });
    for (flag, given, id) in [
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
    ] {
        if given && let Some(why) = skip_reason(id, &caps) {
            bail!(
                "{flag} configures the {} check, which does not apply to {}: {why}",
                id.name(),
                dut.label()
            );
        }
    }
    let plan = ValidatePlan {
        dir,
        config,
        store,
        set: &set,
        repeated: &repeated,
        eos: &eos,
        tokens: args.tokens,
        thresholds,
        probe_mode: args.probe_mode.unwrap_or(ModeArg::Isolated).into(),
        probe_max_nrmse: args.probe_max_nrmse,
        probe_max_state_nrmse: args.probe_max_state_nrmse,
        blocks,
        lookup,
        lookup_tokens,
        max_length,
        allow_precision: args.allow_precision.clone(),
        set_inputs: target.set().map(|s| SetInputs {
            dir: s.dir.display().to_string(),
            reference_weights: s.set.reference_weights.clone(),
        }),
        warnings: target
            .set()
            .and_then(|s| s.weights_warning.clone())
            .into_iter()
            .collect(),
        fault,
        images: images.as_ref().map(|(vc, pixels, prompt)| ValidateImages {
            vc,
            pixels,
            prompt,
            target: &target,
            settings: &image_settings,
        }),
    };
    let mut report = run(&plan, dut.as_mut(), start)?;
    report.memory = Some(memory.measured());
    report.emit(&outputs)?;
    Ok(if report.passed() {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}
