//! `qwen35 probe`: each layer's own graph on a device against the reference, isolated or chained, with the
//! drill-down of the first layer over threshold.

use crate::backends::{DeviceSettings, check_device, open_reference};
use crate::commands::Outcome;
use crate::commands::compare_devices::{LabelledPrompt, prompts};
use crate::options::{FormArgs, GraphArgs, ModelArgs, PromptArgs};
use crate::probe::{
    Mode, OpenVinoLayers, ProbeThresholds, ReferenceTrace, drill_down, probe, thresholds_from,
};
use crate::report::probe::{Baseline, ProbeInputs, ProbeReport};
use crate::report::{Machine, ReportArgs};
use anyhow::{Context, Result, bail};
use npu::graphs::{Builder, GraphOptions};
use reference::config::Config;
use reference::model::RunOptions;
use reference::weights::WeightStore;
use std::path::Path;

/// Arguments of `qwen35 probe`.
#[derive(clap::Args)]
pub struct ProbeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The device whose per-layer graphs are probed: an OpenVINO device, or FP16SIM[:options].
    #[arg(long)]
    device: String,
    /// Isolated: every block of every layer gets the reference's input and state. Chained: every layer gets the
    /// device's own output of the layer before and carries its own state.
    #[arg(long, value_enum, default_value = "isolated")]
    mode: Mode,
    #[command(flatten)]
    prompt: PromptArgs,
    /// Layers to probe, comma separated (default: all). Chained mode runs every layer up to the last one listed.
    #[arg(long, value_delimiter = ',', value_name = "0,1,2")]
    layers: Vec<usize>,
    /// Largest NRMSE of a layer's outputs and intermediates (default 1e-4 at f32, 5e-2 at f16/bf16).
    #[arg(long, value_name = "X")]
    max_nrmse: Option<f64>,
    /// Largest NRMSE of a state, after the prompt and after every block (default 1e-4 at f32, 5e-2 at f16/bf16).
    #[arg(long, value_name = "X")]
    max_state_nrmse: Option<f64>,
    /// Take each layer's thresholds from a baseline device instead (FP16SIM: the error an fp16 device is expected to
    /// show there): a layer passes within --factor times the baseline's error on that layer (never tighter than the
    /// f32 thresholds).
    #[arg(long, value_name = "FP16SIM[:options]", conflicts_with_all = ["max_nrmse", "max_state_nrmse"])]
    tolerance_from: Option<String>,
    /// With --tolerance-from: how many times the baseline's error a layer may show.
    #[arg(
        long,
        default_value_t = 3.0,
        value_name = "F",
        requires = "tolerance_from"
    )]
    factor: f64,
    #[command(flatten)]
    report: ReportArgs,
    #[command(flatten)]
    form: FormArgs,
    #[command(flatten)]
    graph: GraphArgs,
}

/// Runs `qwen35 probe`.
pub fn exec(args: ProbeArgs) -> Result<Outcome> {
    for (flag, v) in [
        ("--max-nrmse", args.max_nrmse),
        ("--max-state-nrmse", args.max_state_nrmse),
    ] {
        if let Some(v) = v
            && !(v >= 0.0 && v.is_finite())
        {
            bail!("{flag} {v}: must be a finite number ≥ 0");
        }
    }
    if !(args.factor >= 1.0 && args.factor.is_finite()) {
        bail!("--factor {}: must be a finite number ≥ 1", args.factor);
    }
    let settings = DeviceSettings::resolve(&args.device, &args.graph, &args.form)?;
    let baseline_settings = match &args.tolerance_from {
        Some(b) => {
            check_device(b).context("--tolerance-from")?;
            let graph = GraphArgs {
                precision: None,
                ..args.graph.clone()
            };
            let g = if npu::sim::NumericModel::is_sim(b) {
                &graph
            } else {
                &args.graph
            };
            Some(DeviceSettings::resolve(b, g, &args.form)?)
        }
        None => None,
    };
    let (dir, config, store) = args.model.open()?;
    let set = prompts(&args.prompt, None, &dir, &config)?;
    let prompt = set.into_iter().next().context("no prompt")?;
    args.report.check()?;
    check_device(&args.device).context("--device")?;
    let report = run_probe(ProbeRequest {
        dir: &dir,
        config: &config,
        store: &store,
        settings: &settings,
        prompt: &prompt,
        layers: &args.layers,
        mode: args.mode,
        max_nrmse: args.max_nrmse,
        max_state_nrmse: args.max_state_nrmse,
        baseline: baseline_settings.as_ref().map(|b| (b, args.factor)),
    })?;
    report.emit(&args.report)?;
    Ok(if report.passed() {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}

/// One probe of a device, as `qwen35 probe` runs it.
pub struct ProbeRequest<'a> {
    /// The checkpoint directory.
    pub dir: &'a Path,
    /// Its config.
    pub config: &'a Config,
    /// Its weights, in the format both sides run.
    pub store: &'a WeightStore,
    /// The device and its graph and compile settings.
    pub settings: &'a DeviceSettings,
    /// The prompt.
    pub prompt: &'a LabelledPrompt,
    /// The layers to probe (empty: all).
    pub layers: &'a [usize],
    /// Isolated or chained.
    pub mode: Mode,
    /// `--max-nrmse` (default: for the precision read back).
    pub max_nrmse: Option<f64>,
    /// `--max-state-nrmse` (default: for the precision read back).
    pub max_state_nrmse: Option<f64>,
    /// A baseline device per-layer thresholds come from, and the factor over its error.
    pub baseline: Option<(&'a DeviceSettings, f64)>,
}

/// Runs the probe of a device: the reference's trace of the prompt in the device's blocks, the per-layer graphs
/// compiled and fed, each layer judged (by the thresholds, or by the baseline's error times the factor), and the
/// drill-down of the first layer over threshold.
pub fn run_probe(req: ProbeRequest) -> Result<ProbeReport> {
    let (config, store, settings, prompt) = (req.config, req.store, req.settings, req.prompt);
    let n = config.num_layers();
    let mut layers = if req.layers.is_empty() {
        (0..n).collect()
    } else {
        req.layers.to_vec()
    };
    layers.sort_unstable();
    layers.dedup();
    if let Some(&bad) = layers.iter().find(|&&l| l >= n) {
        bail!(
            "--layers: layer {bad} does not exist (the model has {n} layers, 0..{})",
            n - 1
        );
    }
    if prompt.ids.len() > settings.graph.context {
        bail!(
            "the prompt has {} tokens but the static context holds {} (--context)",
            prompt.ids.len(),
            settings.graph.context
        );
    }
    let mut reference = open_reference(config, store, RunOptions::default(), true)?;
    let trace = ReferenceTrace::new(&mut reference, &prompt.ids, settings.block)?;
    let builder = Builder::new(
        config,
        store,
        GraphOptions {
            taps: true,
            ..settings.graph
        },
    )?;
    let compiled: Vec<usize> = match req.mode {
        Mode::Isolated => layers.clone(),
        Mode::Chained => (0..=*layers.last().context("no layer")?).collect(),
    };
    let mut device = OpenVinoLayers::new(
        &builder,
        &compiled,
        settings.block,
        &settings.device,
        &settings.compile,
    )?;
    let record = crate::probe::LayerDevice::record(&device);
    let precision = record.precision.clone().unwrap_or_else(|| "f32".into());
    let defaults = ProbeThresholds::for_precision(&precision);
    let thresholds = ProbeThresholds {
        max_nrmse: req.max_nrmse.unwrap_or(defaults.max_nrmse),
        max_state_nrmse: req.max_state_nrmse.unwrap_or(defaults.max_state_nrmse),
    };
    let mut probed = probe(config, &trace, &mut device, &layers, req.mode, thresholds)?;
    let baseline = match req.baseline {
        Some((b, factor)) => {
            let mut base_device =
                OpenVinoLayers::new(&builder, &compiled, b.block, &b.device, &b.compile)?;
            let base = probe(
                config,
                &trace,
                &mut base_device,
                &layers,
                req.mode,
                thresholds,
            )?;
            let floor = ProbeThresholds::for_precision("f32");
            let per_layer = thresholds_from(&base, factor, floor);
            for l in &mut probed {
                l.judge(per_layer[&l.layer]);
            }
            Some(Baseline {
                device: b.device.clone(),
                factor,
                layers: base
                    .iter()
                    .map(|l| {
                        let (outputs, states) = l.worst();
                        (l.layer, outputs, states)
                    })
                    .collect(),
            })
        }
        None => None,
    };
    Ok(ProbeReport {
        machine: Machine::detect(),
        inputs: ProbeInputs {
            model: req.dir.display().to_string(),
            weights: store.format().name(),
            prompt: prompt.label.clone(),
            prompt_tokens: prompt.ids.len(),
            mode: req.mode,
            block: settings.block,
        },
        record,
        thresholds,
        baseline,
        drill_down: drill_down(&probed),
        layers: probed,
    })
}
