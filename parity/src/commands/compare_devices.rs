//! `qwen35 compare-devices`: the same prompts on the reference and on each device, compared token by token, layer
//! by layer and state by state, with a verdict against thresholds.

use crate::backends::{
    DeviceSettings, ExternalIr, available_devices, check_context, check_device,
    external_compile_options, open_device, open_reference, refuse_graph_flags,
};
use crate::commands::Outcome;
use crate::compare::{
    DeviceReport, Distribution, Position, PositionClass, ReferenceRun, Thresholds, compare_prompt,
    compare_prompt_logits, continuation, rows,
};
use crate::metrics::{TensorError, TokenAgreement};
use crate::options::{ChatPrompt, FormArgs, GraphArgs, ModelArgs, PromptArgs};
use crate::progress::Progress;
use crate::report::{CompareReport, Inputs, Machine, QuantizationError, ReportArgs};
use anyhow::{Context, Result, bail};
use npu::sim::NumericModel;
use reference::backend::{Backend, teacher_forced};
use reference::model::RunOptions;
use reference::quant::WeightFormat;
use reference::tokenizer::ChatTokenizer;
use reference::weights::WeightStore;
use std::path::{Path, PathBuf};

/// The prompt set shipped with the project (JSON lines), used when no prompt is given.
pub const DEFAULT_PROMPTS: &str = include_str!("../../prompts/default.jsonl");

/// Arguments of `qwen35 compare-devices`.
#[derive(clap::Args)]
pub struct CompareArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Devices to compare with the reference, comma separated: OpenVINO devices, or FP16SIM[:options] (an fp16
    /// accelerator's arithmetic applied to the same graphs). Default: every OpenVINO device present.
    #[arg(long, alias = "device", value_name = "CPU,NPU,FP16SIM")]
    devices: Option<String>,
    /// Compare an external stateful IR (graphs made elsewhere, e.g. optimum-intel's export) instead of this
    /// project's graphs: DIR holds the IR and a manifest.json of its ports (optimum-intel's names without one).
    /// Tokens and logits only; its hidden states and states are not exposed. Give --weights as the IR holds them
    /// (its manifest's `reference_weights`, e.g. int4-nncf:32 for NNCF's INT4 export).
    #[arg(long, value_name = "DIR")]
    ir: Option<PathBuf>,
    #[command(flatten)]
    prompt: PromptArgs,
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

/// Thresholds: each overrides the default for the precision that ran (see `Thresholds::for_precision`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ThresholdArgs {
    /// Largest NMSE of the teacher-forced logits (default 1e-8 at f32, 1e-2 at f16/bf16).
    #[arg(long, value_name = "X")]
    pub max_nmse: Option<f64>,
    /// Largest mean KL(P_ref ‖ P_device) in nats (default 1e-6 at f32, 5e-2 at f16/bf16).
    #[arg(long, value_name = "X")]
    pub max_kl: Option<f64>,
    /// Smallest share of teacher-forced positions with the same top token (default 1 at f32, 0.9 at f16/bf16).
    #[arg(long, value_name = "X")]
    pub min_token_agreement: Option<f64>,
    /// Most teacher-forced disagreements at confident positions (default 0).
    #[arg(long, value_name = "N")]
    pub max_confident_flips: Option<usize>,
    /// Largest NRMSE of a layer's output, over the run and at any position (default 1e-4 at f32, 5e-2 at f16/bf16).
    #[arg(long, value_name = "X")]
    pub max_layer_nrmse: Option<f64>,
    /// Largest NRMSE of a state after the prompt (default 1e-4 at f32, 5e-2 at f16/bf16).
    #[arg(long, value_name = "X")]
    pub max_state_nrmse: Option<f64>,
}

impl ThresholdArgs {
    /// The defaults for `precision`, overridden by the flags given.
    pub fn resolve(&self, precision: &str) -> Thresholds {
        let d = Thresholds::for_precision(precision);
        Thresholds {
            max_logits_nmse: self.max_nmse.unwrap_or(d.max_logits_nmse),
            max_mean_kl: self.max_kl.unwrap_or(d.max_mean_kl),
            min_top1: self.min_token_agreement.unwrap_or(d.min_top1),
            max_confident_flips: self.max_confident_flips.unwrap_or(d.max_confident_flips),
            max_layer_nrmse: self.max_layer_nrmse.unwrap_or(d.max_layer_nrmse),
            max_state_nrmse: self.max_state_nrmse.unwrap_or(d.max_state_nrmse),
        }
    }

    /// Fails on a threshold outside its range, naming the flag.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("--max-nmse", self.max_nmse),
            ("--max-kl", self.max_kl),
            ("--max-layer-nrmse", self.max_layer_nrmse),
            ("--max-state-nrmse", self.max_state_nrmse),
        ];
        for (flag, v) in positive {
            if let Some(v) = v
                && !(v >= 0.0 && v.is_finite())
            {
                bail!("{flag} {v}: must be a finite number ≥ 0");
            }
        }
        if let Some(v) = self.min_token_agreement
            && !(0.0..=1.0).contains(&v)
        {
            bail!("--min-token-agreement {v}: must be between 0 and 1");
        }
        Ok(())
    }
}

/// One prompt of the set.
pub struct LabelledPrompt {
    /// Its label in reports.
    pub label: String,
    /// Its tokens.
    pub ids: Vec<u32>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptLine {
    label: Option<String>,
    prompt: Option<String>,
    system: Option<String>,
    #[serde(default)]
    think: bool,
    token_ids: Option<Vec<u32>>,
}

/// Reads a prompt set (JSON lines); `source` names it in errors.
pub fn read_prompt_set(text: &str, source: &str, model: &Path) -> Result<Vec<LabelledPrompt>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = || format!("{source}:{}", i + 1);
        let p: PromptLine = serde_json::from_str(line).with_context(at)?;
        let label = p
            .label
            .clone()
            .unwrap_or_else(|| format!("#{}", out.len() + 1));
        let ids = match (p.prompt, p.token_ids) {
            (Some(prompt), None) => ChatPrompt {
                prompt,
                system: p.system,
                think: p.think,
            }
            .encode(model)
            .with_context(at)?,
            (None, Some(ids)) if p.system.is_none() && !p.think => ids,
            _ => bail!(
                "{}: give either \"prompt\" (with optional \"system\", \"think\") or \"token_ids\"",
                at()
            ),
        };
        if ids.is_empty() {
            bail!("{}: the prompt has no tokens", at());
        }
        out.push(LabelledPrompt { label, ids });
    }
    if out.is_empty() {
        bail!("{source}: no prompts");
    }
    Ok(out)
}

/// The prompts of a run: `--prompt`/`--token-ids`, else `--prompts FILE`, else the shipped set.
pub fn prompts(
    prompt: &PromptArgs,
    file: Option<&Path>,
    dir: &Path,
    config: &reference::Config,
) -> Result<Vec<LabelledPrompt>> {
    let set = if prompt.given() {
        let (ids, text) = prompt.ids(dir, config)?;
        vec![LabelledPrompt {
            label: text.map_or("token ids".into(), |t| truncate(&t, 32)),
            ids,
        }]
    } else if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--prompts {}", path.display()))?;
        read_prompt_set(&text, &path.display().to_string(), dir)?
    } else {
        read_prompt_set(DEFAULT_PROMPTS, "the default prompt set", dir)?
    };
    for p in &set {
        config
            .check_token_ids(&p.ids)
            .with_context(|| format!("prompt `{}`", p.label))?;
    }
    Ok(set)
}

fn truncate(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// The end-of-sequence ids: the config's and the tokenizer's stop tokens (when the checkpoint has a tokenizer).
pub fn eos_ids(dir: &Path, config: &reference::Config) -> Vec<u32> {
    let mut eos = config.eos_token_ids.clone();
    if let Ok(tok) = ChatTokenizer::load(dir) {
        eos.extend(tok.stop_ids());
    }
    eos.sort_unstable();
    eos.dedup();
    eos
}

/// The devices to compare: the ones asked for (each checked to be present), else every OpenVINO device present.
pub fn devices(asked: Option<&str>) -> Result<Vec<String>> {
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

/// Splits `CPU,FP16SIM:store=f32,ftz=off,NPU` at the commas between devices (an item `key=value` continues the
/// options of the FP16SIM before it).
pub fn split_devices(list: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match out.last_mut() {
            Some(prev) if item.contains('=') && !item.contains(':') && prev.contains(':') => {
                prev.push(',');
                prev.push_str(item);
            }
            _ => out.push(item.to_string()),
        }
    }
    out
}

/// Runs `qwen35 compare-devices`.
pub fn exec(args: CompareArgs) -> Result<Outcome> {
    args.thresholds.validate()?;
    if args.tokens == 0 {
        bail!("--tokens must be at least 1");
    }
    if let Some(ir) = args.ir.clone() {
        return exec_external(args, &ir);
    }
    let (dir, config, store) = args.model.open()?;
    let devices = devices(args.devices.as_deref())?;
    // --precision is asked of the OpenVINO devices; FP16SIM's arithmetic comes from its options.
    let sim_graph = GraphArgs {
        precision: None,
        ..args.graph.clone()
    };
    let settings = devices
        .iter()
        .map(|d| {
            let graph = if NumericModel::is_sim(d) {
                &sim_graph
            } else {
                &args.graph
            };
            DeviceSettings::resolve(d, graph, &args.form)
        })
        .collect::<Result<Vec<_>>>()?;
    let context = settings[0].graph.context;
    let set = prompts(&args.prompt, args.prompts.as_deref(), &dir, &config)?;
    for p in &set {
        check_context(p.ids.len(), args.tokens, context)
            .with_context(|| format!("prompt `{}`", p.label))?;
    }
    args.report.check()?;
    let eos = eos_ids(&dir, &config);

    let progress = Progress::new(set.len() * (1 + devices.len()));
    let mut reference = open_reference(&config, &store, RunOptions::default(), true)?;
    let runs = reference_runs(&mut reference, &set, args.tokens, &progress)?;
    let quantization = if store.format() == WeightFormat::F32 {
        None
    } else {
        Some(quantization_error(&dir, &config, &runs, &eos, &args.model)?)
    };

    let mut reports = Vec::with_capacity(devices.len());
    for (device, settings) in devices.iter().zip(&settings) {
        progress.message(&format!("{device}: compiling"));
        let mut deployed = open_device(&config, &store, settings, false)?;
        let mut tapped = open_device(&config, &store, settings, true)?;
        reports.push(compare_device(
            device,
            &runs,
            &mut deployed,
            &mut tapped,
            &eos,
            &args.thresholds,
            &progress,
        )?);
    }
    progress.finish();
    let inputs = inputs(dir.as_path(), &store, &set, args.tokens, &reference);
    emit(inputs, quantization, reports, &args.report)
}

/// `compare-devices --ir DIR`: the external IR on each device against the reference, tokens and logits only.
fn exec_external(args: CompareArgs, ir: &Path) -> Result<Outcome> {
    refuse_graph_flags(&args.form, &args.graph, ir)?;
    let external = ExternalIr::open(ir, &args.model)?;
    if let Some(w) = &external.weights_warning {
        eprintln!("warning: {w}");
    }
    let (dir, config, store) = (&external.checkpoint, &external.config, &external.store);
    let devices = match args.devices.as_deref() {
        Some(list) => split_devices(list),
        None => available_devices()?,
    };
    if devices.is_empty() {
        bail!("--devices: no device given");
    }
    let set = prompts(&args.prompt, args.prompts.as_deref(), dir, config)?;
    args.report.check()?;
    let eos = eos_ids(dir, config);
    let progress = Progress::new(set.len() * (1 + devices.len()));
    let mut reference = open_reference(config, store, RunOptions::default(), false)?;
    let runs = reference_runs(&mut reference, &set, args.tokens, &progress)?;
    let quantization = if store.format() == WeightFormat::F32 {
        None
    } else {
        Some(quantization_error(
            dir,
            config,
            &runs,
            &eos,
            &external.model,
        )?)
    };
    let mut reports = Vec::with_capacity(devices.len());
    for device in &devices {
        progress.message(&format!("{device}: compiling {}", external.name()));
        let compile = external_compile_options(device, &args.graph)?;
        let mut backend = external.open_on(device, &compile)?;
        let label = format!("{device} IR {}", external.name());
        reports.push(compare_external(
            &label,
            &runs,
            &mut backend,
            &eos,
            &args.thresholds,
            &progress,
        )?);
    }
    progress.finish();
    let inputs = inputs(dir, store, &set, args.tokens, &reference);
    emit(inputs, quantization, reports, &args.report)
}

/// What a compare-devices run compared: the checkpoint, its weights, the prompts and the reference's record.
fn inputs(
    dir: &Path,
    store: &WeightStore,
    set: &[LabelledPrompt],
    tokens: usize,
    reference: &dyn Backend,
) -> Inputs {
    Inputs {
        model: dir.display().to_string(),
        weights: store.format().name(),
        prompts: set.iter().map(|p| (p.label.clone(), p.ids.len())).collect(),
        tokens,
        reference: reference.record().clone(),
    }
}

/// Writes the report of a compare-devices run where asked and concludes from it.
fn emit(
    inputs: Inputs,
    quantization: Option<QuantizationError>,
    devices: Vec<DeviceReport>,
    args: &ReportArgs,
) -> Result<Outcome> {
    let report = CompareReport {
        command: "compare-devices".into(),
        machine: Machine::detect(),
        inputs,
        quantization,
        devices,
    };
    report.emit(args)?;
    Ok(if report.passed() {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}

/// An external IR (a backend at the logits and token level, its state not exposed) against the reference's runs,
/// labelled `label`: free-running greedy and teacher-forced logits per prompt, judged by the thresholds for the
/// precision it read back.
pub fn compare_external(
    label: &str,
    runs: &[ReferenceRun],
    backend: &mut dyn Backend,
    eos: &[u32],
    thresholds: &ThresholdArgs,
    progress: &Progress,
) -> Result<DeviceReport> {
    let why = npu::engine::STATE_NOT_EXPOSED;
    let mut compared = Vec::with_capacity(runs.len());
    for run in runs {
        progress.step(&format!("{label}: {}", run.label));
        compared.push(compare_prompt_logits(run, backend, eos, why)?);
    }
    let record = backend.record().clone();
    let precision = record.precision.clone().unwrap_or_else(|| "f32".into());
    Ok(DeviceReport::new(
        label,
        record,
        thresholds.resolve(&precision),
        compared,
    ))
}

/// The reference's side of every prompt of `set` (a backend recording taps): its greedy tokens, then
/// teacher-forced on them with every tap.
pub fn reference_runs(
    reference: &mut dyn Backend,
    set: &[LabelledPrompt],
    tokens: usize,
    progress: &Progress,
) -> Result<Vec<ReferenceRun>> {
    let mut runs = Vec::with_capacity(set.len());
    for p in set {
        progress.step(&format!("reference: {}", p.label));
        runs.push(ReferenceRun::new(reference, &p.label, &p.ids, tokens)?);
    }
    Ok(runs)
}

/// One device against the reference's runs: every prompt compared on the graphs as deployed and with taps, then
/// aggregated and judged by the thresholds for the precision the deployed graphs read back.
pub fn compare_device(
    device: &str,
    runs: &[ReferenceRun],
    deployed: &mut dyn Backend,
    tapped: &mut dyn Backend,
    eos: &[u32],
    thresholds: &ThresholdArgs,
    progress: &Progress,
) -> Result<DeviceReport> {
    let mut compared = Vec::with_capacity(runs.len());
    for run in runs {
        progress.step(&format!("{device}: {}", run.label));
        compared.push(compare_prompt(run, deployed, tapped, eos)?);
    }
    let record = deployed.record().clone();
    let precision = record.precision.clone().unwrap_or_else(|| "f32".into());
    Ok(DeviceReport::new(
        device,
        record,
        thresholds.resolve(&precision),
        compared,
    ))
}

/// How far the compression itself moves the reference: the reference on the original weights against the
/// reference on the compressed ones, teacher-forced on the latter's tokens.
fn quantization_error(
    dir: &Path,
    config: &reference::Config,
    runs: &[ReferenceRun],
    eos: &[u32],
    model: &ModelArgs,
) -> Result<QuantizationError> {
    let original = WeightStore::open(dir, model.dtype.dtype())?;
    let mut backend = open_reference(config, &original, RunOptions::default(), false)?;
    let mut positions = Vec::new();
    let mut logits_errors = Vec::new();
    for run in runs {
        let forced = teacher_forced(&mut backend, &run.prompt, continuation(&run.tokens))?;
        // The original weights are the truth here: the compressed run is the one under test.
        let quantized = &run.forced.run.logits;
        logits_errors.push(TensorError::of(quantized, &forced.run.logits)?);
        let (q_rows, o_rows) = (rows(quantized)?, rows(&forced.run.logits)?);
        for (i, (q, o)) in q_rows.iter().zip(&o_rows).enumerate() {
            let agreement = TokenAgreement::of(q, o, eos);
            let logits_max_abs = q.iter().zip(o).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
            positions.push(Position {
                index: i,
                class: if i + 1 < run.prompt.len() {
                    PositionClass::Prompt
                } else {
                    PositionClass::Generated
                },
                agreement,
                logits_max_abs,
                near_tie: agreement.ref_margin <= 2.0 * logits_max_abs,
            });
        }
    }
    let worst = logits_errors
        .into_iter()
        .reduce(|a, b| if b.nmse > a.nmse { b } else { a })
        .context("no prompts")?;
    Ok(QuantizationError {
        logits: worst,
        distribution: Distribution::of(&positions),
    })
}
