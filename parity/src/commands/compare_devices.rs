//! `qwen35 compare-devices`: the same prompts on the reference and on each device, compared token by token, layer
//! by layer and state by state, with a verdict against thresholds.

use super::Outcome;
use super::args::{
    FormArgs, GraphArgs, ImageArgs, ModelArgs, PromptArgs, ReportArgs, ThresholdArgs,
};
use super::target;
use crate::compare::ReferenceRun;
use crate::compare::run::{compare_device_on, quantization_error, reference_runs, vision_rows};
use crate::device::{
    available_devices, check_context, check_device, check_positions, open_reference, split_devices,
    warn_precision,
};
use crate::images::{PromptInput, image_name, reference_images, vision_config};
use crate::memory::{self, Plan};
use crate::outputs::Paths;
use crate::progress::Progress;
use crate::prompts::LabelledPrompt;
use crate::prompts::eos_ids;
use crate::report::{CompareReport, Inputs, Machine, Report as _};
use anyhow::{Context, Result, bail};
use npu::sim::NumericModel;
use reference::backend::Backend;
use reference::model::RunOptions;
use reference::quant::WeightFormat;
use reference::weights::WeightStore;
use std::path::PathBuf;

/// Arguments of `qwen35 compare-devices`.
#[derive(clap::Args)]
pub struct CompareArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Devices to compare with the reference, comma separated: OpenVINO devices, or FP16SIM[:options] (an fp16
    /// accelerator's arithmetic applied to the same graphs). Default: every OpenVINO device present.
    #[arg(long, alias = "device", value_name = "CPU,NPU,FP16SIM")]
    devices: Option<String>,
    /// Compare a graph set made elsewhere instead of this project's graphs: DIR holds its IR files and a
    /// manifest.json of their ports (docs/graph-sets.md); without one, optimum-intel's stateful export and that
    /// export made stateless by OpenVINO's transformation are known by their port names. What the set exposes
    /// (states, hidden outputs) is compared. Give --weights as the graphs hold them (the manifest's
    /// `reference_weights`).
    #[arg(long, value_name = "DIR")]
    ir: Option<PathBuf>,
    #[command(flatten)]
    prompt: PromptArgs,
    #[command(flatten)]
    images: ImageArgs,
    /// A prompt set, one JSON object per line: {"prompt": …, "system"?: …, "think"?: bool, "label"?: …} or
    /// {"token_ids": [...], "label"?: …}. Default (no prompt given): the set shipped with the project.
    #[arg(long, value_name = "FILE.jsonl", conflicts_with_all = ["token_ids", "prompt"])]
    prompts: Option<PathBuf>,
    /// Greedy tokens per prompt.
    #[arg(long, default_value_t = 12, value_name = "N")]
    tokens: usize,
    #[command(flatten)]
    thresholds: ThresholdArgs,
    #[command(flatten)]
    report: ReportArgs,
    #[command(flatten)]
    form: FormArgs,
    #[command(flatten)]
    graph: GraphArgs,
}

/// The devices to compare: the ones asked for (each checked to be present), else every OpenVINO device present.
fn devices(asked: Option<&str>) -> Result<Vec<String>> {
    let Some(list) = asked else {
        return available_devices();
    };
    let list = split_devices(list);
    if list.is_empty() {
        bail!("--devices: no device given");
    }
    for d in &list {
        check_device(d).context("--devices")?;
    }
    Ok(list)
}

/// What compare-devices holds at once, phase by phase, with weights in `format`: the reference and its runs; the
/// reference on the original weights (compressed formats); then for each device its deployed graphs, then (released)
/// its graphs with taps, beside both sides' runs.
#[allow(clippy::too_many_arguments)]
fn memory_plan(
    dir: &std::path::Path,
    config: &reference::config::Config,
    dtype: candle_core::DType,
    format: WeightFormat,
    devices: &[crate::device::DeviceSettings],
    set: Option<&crate::device::set::SetSource>,
    prompts: usize,
    positions: usize,
) -> Result<Plan> {
    let runs = memory::run_bytes(config, prompts, positions);
    let held = |format| memory::reference_bytes(dir, config, dtype, format);
    let mut plan = Plan::default();
    plan.phase(
        "the reference",
        vec![
            ("its weights".into(), held(format)?),
            ("its runs".into(), runs),
        ],
    );
    if format != WeightFormat::F32 {
        plan.phase(
            "the reference on the original weights",
            vec![
                ("its weights".into(), held(WeightFormat::F32)?),
                ("the runs".into(), runs),
            ],
        );
    }
    for d in devices {
        let both = ("both sides' runs".to_string(), 2 * runs);
        if crate::device::llamacpp::is_llamacpp(&d.device) {
            let mut parts = memory::llamacpp_parts(dir, config, d.graph.context)?;
            parts.push(both);
            plan.phase(format!("{}: llama.cpp's worker", d.device), parts);
            continue;
        }
        match set {
            Some(s) => {
                plan.phase(
                    format!("{}: the set's graphs", d.device),
                    vec![
                        ("its graphs".into(), memory::set_graph_bytes(&s.set)),
                        ("the runtime".into(), memory::RUNTIME_BYTES),
                        both,
                    ],
                );
            }
            None => {
                let graphs: &[usize] = if d.block > 1 { &[d.block, 1] } else { &[1] };
                let moe = d.graph.moe;
                let mut deployed =
                    memory::graph_parts(config, format, &d.device, graphs, moe, d.graph.context);
                deployed.push(both.clone());
                plan.phase(format!("{}: deployed graphs", d.device), deployed);
                // The graphs with taps: the prompt-block graph alone on an OpenVINO device, both on FP16SIM.
                let sim = npu::sim::NumericModel::is_sim(&d.device);
                let tapped_graphs = if sim { graphs } else { &graphs[..1] };
                let mut tapped = memory::graph_parts(
                    config,
                    format,
                    &d.device,
                    tapped_graphs,
                    moe,
                    d.graph.context,
                );
                tapped.push(both);
                plan.phase(format!("{}: graphs with taps", d.device), tapped);
            }
        }
    }
    Ok(plan)
}

/// Runs `qwen35 compare-devices`.
pub fn exec(args: CompareArgs) -> Result<Outcome> {
    Paths::new()
        .with(&args.model)
        .input("--ir", args.ir.as_ref())
        .input("--prompts", args.prompts.as_ref())
        .with(&args.graph)
        .with(&args.report)
        .check()?;
    let thresholds = args.thresholds.overrides()?;
    if args.tokens == 0 {
        bail!("--tokens must be at least 1");
    }
    let target = target::open(&args.model, args.ir.as_deref(), &args.form, &args.graph)?;
    let (dir, config, store) = target.checkpoint();
    let devices = devices(args.devices.as_deref())?;
    let image_source = args.images.source()?;
    if image_source.is_some() && args.prompts.is_some() {
        bail!(
            "--image applies to one prompt (--prompt or --token-ids), not to a prompt set (--prompts)"
        );
    }
    let settings = devices
        .iter()
        .map(|d| {
            let graph = if NumericModel::is_sim(d) {
                args.graph.for_sim()
            } else {
                args.graph.clone()
            };
            let mut s = graph.settings(d, &args.form)?;
            // The image rows come from the device's vision graph: its decoder graphs take embeddings.
            s.graph.embeddings_input = image_source.is_some();
            Ok(s)
        })
        .collect::<Result<Vec<_>>>()?;
    let images = match &image_source {
        Some(source) => {
            let vc = vision_config(dir)?;
            let pixels = source.load_with_videos(dir, &vc)?;
            let ids = args.prompt.vision_ids(dir, config, &vc, &pixels)?;
            // Refused here, before any work, when the device cannot make the image rows.
            target.check_images(&pixels.grids, pixels.video_grids(), |i| {
                image_name(source, &pixels, i)
            })?;
            Some((vc, pixels, ids))
        }
        None => None,
    };
    let set = match &images {
        Some((_, pixels, ids)) => vec![LabelledPrompt {
            label: pixels.label(),
            ids: ids.clone(),
        }],
        None => args
            .prompt
            .source(args.prompts.as_deref())?
            .load(dir, config)?,
    };
    for p in &set {
        check_positions(p.ids.len(), args.tokens, config, "--tokens")
            .with_context(|| format!("prompt `{}`", p.label))?;
    }
    let (context, context_source) = target.context(&settings[0]);
    if let Some(context) = context {
        for p in &set {
            check_context(p.ids.len(), args.tokens, context, &context_source)
                .with_context(|| format!("prompt `{}`", p.label))?;
        }
    }
    let outputs = args.report.outputs()?;
    let eos = eos_ids(dir, config);
    let positions = set.iter().map(|p| p.ids.len()).max().unwrap_or(0) + args.tokens;
    let dtype = args.model.dtype.dtype();
    let plan_with = |format: WeightFormat, settings: &[crate::device::DeviceSettings]| {
        let mut plan = memory_plan(
            dir,
            config,
            dtype,
            format,
            settings,
            target.set(),
            set.len(),
            positions,
        )?;
        if let Some((vc, pixels, _)) = &images {
            let devices: Vec<&str> = settings.iter().map(|s| s.device.as_str()).collect();
            memory::add_images(&mut plan, vc, pixels.patches(), 2, &devices);
        }
        Ok(plan)
    };
    // Besides smaller weights, this project's graphs can be made smaller: one graph of one token instead of a
    // prompt-block graph beside it, or an MoE model's experts gathered instead of masked.
    let mut smaller = Vec::new();
    if target.set().is_none() {
        let with = |change: &dyn Fn(&mut crate::device::DeviceSettings)| {
            let mut s = settings.clone();
            s.iter_mut().for_each(change);
            s
        };
        if settings.iter().any(|s| s.block > 1) {
            smaller.push(("--block 1", with(&|s| s.block = 1)));
        }
        if let Some(m) = &config.moe {
            let masked = |s: &crate::device::DeviceSettings| {
                s.graph
                    .moe
                    .resolve(s.block, m.num_experts, m.num_experts_per_tok)
                    == npu::graphs::MoeGraphForm::Masked
            };
            if settings.iter().any(masked) {
                let gather = npu::graphs::MoeGraphForm::Gather;
                smaller.push(("--moe-form gather", with(&|s| s.graph.moe = gather)));
            }
        }
    }
    let format = store.format();
    let extra = smaller
        .iter()
        .map(|(flag, s)| Ok((flag.to_string(), plan_with(format, s)?)))
        .collect::<Result<Vec<_>>>()?;
    let plan_for = |format: WeightFormat| plan_with(format, &settings);
    let memory = memory::check_formats("compare-devices", format, plan_for, extra)?;

    let progress = Progress::new(set.len() * (1 + devices.len()));
    let mut reference = open_reference(config, store, RunOptions::default(), true)?;
    // With images: the reference's tower makes its image rows; each device's vision graph makes its own below.
    let (runs, reference_vision, host) = match &images {
        Some((vc, pixels, ids)) => {
            // The text rows of the devices' prompts come from the table alone: the reference's layers go below.
            let host = reference.model().token_table();
            let r = reference_images(&host, store, vc, ids.clone(), pixels, false)?;
            progress.step(&format!("reference: {}", set[0].label));
            let run = ReferenceRun::of_input(
                &mut reference,
                &set[0].label,
                PromptInput::Images(r.prompt),
                args.tokens,
            )?;
            (vec![run], r.taps, Some(host))
        }
        None => (
            reference_runs(&mut reference, &set, args.tokens, &progress)?,
            Default::default(),
            None,
        ),
    };
    // Its runs are all the comparisons need: its weights are handed back before any graph is built.
    let reference_record = reference.record().clone();
    drop(reference);
    let quantization = if store.format() == WeightFormat::F32 {
        None
    } else {
        let original = WeightStore::open(dir, args.model.dtype.dtype())?;
        Some(quantization_error(config, &original, &runs, &eos)?)
    };

    let mut reports = Vec::with_capacity(devices.len());
    for (device, settings) in devices.iter().zip(settings) {
        progress.message(&format!("{device}: compiling"));
        let vision = match (&images, &host) {
            (Some((vc, pixels, ids)), Some(host)) => {
                progress.message(&format!("{device}: the vision graph"));
                Some(target.images(host, vc, ids.clone(), pixels, &settings)?)
            }
            _ => None,
        };
        let mut dut = target.device(settings, None)?;
        warn_precision(dut.as_mut())?;
        let inputs = vision
            .as_ref()
            .map(|(v, _)| vec![PromptInput::Images(v.prompt.clone())]);
        let mut report = compare_device_on(
            dut.as_mut(),
            &runs,
            inputs.as_deref(),
            &eos,
            &thresholds,
            &progress,
        )?;
        if let Some((v, graph)) = vision {
            report.vision = vision_rows(&v.taps, &reference_vision)?;
            report.vision_graph = Some(graph);
        }
        reports.push(report);
    }
    progress.finish();
    let report = CompareReport {
        command: "compare-devices".into(),
        machine: Machine::detect(),
        inputs: Inputs {
            model: dir.display().to_string(),
            weights: store.format().name(),
            prompts: set.iter().map(|p| (p.label.clone(), p.ids.len())).collect(),
            tokens: args.tokens,
            reference: reference_record,
        },
        quantization,
        devices: reports,
        memory: Some(memory.measured()),
    };
    report.emit(&outputs)?;
    Ok(if report.passed() {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}
