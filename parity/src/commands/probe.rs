//! `qwen35 probe`: each layer of a device against the reference, isolated or chained, with the drill-down of the
//! first layer over threshold: through this project's per-layer graphs, a set's per-layer graphs, or a
//! whole-decoder set's states (`--ir DIR`).

use super::Outcome;
use super::args::{FormArgs, GraphArgs, ImageArgs, ModeArg, ModelArgs, PromptArgs, ReportArgs};
use super::target;
use crate::device::own::OwnGraphs;
use crate::device::{DeviceUnderTest, check_device};
use crate::images::reference_images;
use crate::memory::{self, Plan};
use crate::outputs::Paths;
use crate::probe::run::{ProbePlan, run};
use crate::prompts::LabelledPrompt;
use crate::report::Report as _;
use anyhow::{Context, Result, bail};
use std::path::PathBuf;

/// Arguments of `qwen35 probe`.
#[derive(clap::Args)]
pub struct ProbeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The device whose layers are probed: an OpenVINO device, or FP16SIM[:options]. Default CPU.
    #[arg(long)]
    device: Option<String>,
    /// Probe a graph set made elsewhere (its per-layer graphs, else its decoder through its states; see
    /// compare-devices --ir).
    #[arg(long, value_name = "DIR")]
    ir: Option<PathBuf>,
    /// Isolated: every block of every layer gets the reference's input and state. Chained: every layer gets the
    /// device's own output of the layer before and carries its own state.
    #[arg(long, value_enum, default_value = "isolated")]
    mode: ModeArg,
    #[command(flatten)]
    prompt: PromptArgs,
    /// A prompt with images: the decoder's layers are probed on it (the reference tower's rows at the image tokens,
    /// the image tokens' MRoPE positions), and the vision tower's blocks too (each block's own graph on the device,
    /// isolated and chained).
    #[command(flatten)]
    images: ImageArgs,
    /// Layers to probe, comma separated (default: all). Chained mode runs every layer up to the last one listed.
    #[arg(long, value_delimiter = ',', value_name = "0,1,2")]
    layers: Vec<usize>,
    /// Largest NRMSE of a layer's outputs and intermediates (default: [`crate::thresholds`]).
    #[arg(long, value_name = "X", help = crate::thresholds::help("Largest NRMSE of a layer's outputs and intermediates", |d| d.layer_nrmse))]
    max_nrmse: Option<f64>,
    /// Largest NRMSE of a state, after the prompt and after every block (default: [`crate::thresholds`]).
    #[arg(long, value_name = "X", help = crate::thresholds::help("Largest NRMSE of a state, after the prompt and after every block", |d| d.state_nrmse))]
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
    /// On an MoE model, skip the fed-routing probe: by default each probed layer's MoE block also runs on the device
    /// fed the reference's routing and residual stream (one more graph per MoE layer, compiled once the layer's own
    /// is released), so that its experts' arithmetic is judged apart from its routing.
    #[arg(long)]
    no_fed_routing: bool,
    #[command(flatten)]
    report: ReportArgs,
    #[command(flatten)]
    form: FormArgs,
    #[command(flatten)]
    graph: GraphArgs,
}

/// What the probe holds at once, phase by phase, with weights in `format`: the reference tracing the prompt, then
/// each device's per-layer graphs of `layers` (all when empty; chained mode runs every layer up to the last), one
/// compiled at a time, or a set's graphs (all compiled at once), beside the trace.
#[allow(clippy::too_many_arguments)]
fn memory_plan(
    dir: &std::path::Path,
    config: &reference::config::Config,
    dtype: candle_core::DType,
    format: reference::quant::WeightFormat,
    devices: &[&str],
    set: Option<&crate::device::set::SetSource>,
    prompt: &crate::prompts::LabelledPrompt,
    layers: &[usize],
    mode: crate::probe::Mode,
    (block, moe): (usize, npu::graphs::MoeGraphForm),
) -> Result<Plan> {
    let trace = (
        "the trace".to_string(),
        memory::run_bytes(config, 1, prompt.ids.len()),
    );
    let n = config.num_layers();
    let compiled: Vec<usize> = match (layers.iter().max(), mode) {
        (None, _) => (0..n).collect(),
        (Some(&last), crate::probe::Mode::Chained) => (0..=last.min(n - 1)).collect(),
        (Some(_), crate::probe::Mode::Isolated) => {
            layers.iter().copied().filter(|&l| l < n).collect()
        }
    };
    let mut plan = Plan::default();
    plan.phase(
        "the reference",
        vec![
            (
                "its weights".into(),
                memory::reference_bytes(dir, config, dtype, format)?,
            ),
            trace.clone(),
        ],
    );
    for &d in devices {
        let graphs = match set {
            Some(s) => (
                "the set's graphs".to_string(),
                memory::set_graph_bytes(&s.set),
            ),
            // Compiled a layer at a time: the largest layer's graph.
            None => (
                format!(
                    "the largest of {} layer graphs (one compiled at a time) of {} weights",
                    compiled.len(),
                    format.name()
                ),
                compiled
                    .iter()
                    .map(|&l| npu::memory::layer_graph_bytes(config, format, l, d, block, moe))
                    .max()
                    .unwrap_or(0),
            ),
        };
        let mut parts = vec![graphs, trace.clone()];
        if !npu::sim::NumericModel::is_sim(d) {
            parts.push(("the runtime".into(), memory::RUNTIME_BYTES));
        }
        plan.phase(format!("{d}: per-layer graphs"), parts);
    }
    Ok(plan)
}

/// Runs `qwen35 probe`.
pub fn exec(args: ProbeArgs) -> Result<Outcome> {
    Paths::new()
        .with(&args.model)
        .input("--ir", args.ir.as_ref())
        .with(&args.graph)
        .with(&args.report)
        .check()?;
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
    let device = args.device.clone().unwrap_or_else(|| "CPU".into());
    if let (Some(ir), Some(_)) = (&args.ir, &args.tolerance_from) {
        bail!(
            "--tolerance-from builds this project's graphs under FP16SIM; it does not apply to graphs made elsewhere \
             (--ir {})",
            ir.display()
        );
    }
    let target = target::open(&args.model, args.ir.as_deref(), &args.form, &args.graph)?;
    let settings = args.graph.settings(&device, &args.form)?;
    let graph_shape = (settings.block, settings.graph.moe);
    let baseline_settings = match &args.tolerance_from {
        Some(b) => {
            check_device(b).context("--tolerance-from")?;
            let g = if npu::sim::NumericModel::is_sim(b) {
                args.graph.for_sim()
            } else {
                args.graph.clone()
            };
            Some(g.settings(b, &args.form)?)
        }
        None => None,
    };
    let (dir, config, store) = target.checkpoint();
    let image_source = args.images.source()?;
    // With images, the decoder's layers are probed on the prompt with them: the reference tower's rows at the image
    // tokens and get_rope_index's positions, given to both sides (the tower itself is probed block by block below).
    let images = match &image_source {
        Some(source) => {
            let vc = crate::images::vision_config(dir)?;
            let pixels = source.load(dir, &vc)?;
            // The device's decoder must take the image rows (a set's embeddings input).
            target.check_images(&pixels.grids, &[], |i| {
                crate::images::image_name(source, &pixels, i)
            })?;
            let ids = args.prompt.vision_ids(dir, config, &vc, &pixels)?;
            // The prompt's text rows from the embedding table alone: the probe builds its own reference.
            let table = reference::model::TokenTable::load(config, store)?;
            let prompt = reference_images(&table, store, &vc, ids, &pixels, false)?.prompt;
            Some((vc, pixels, prompt))
        }
        None => None,
    };
    let prompt = match &images {
        Some((_, pixels, p)) => LabelledPrompt {
            label: format!("with {} image(s)", pixels.grids.len()),
            ids: p.ids.clone(),
        },
        None => {
            let set = args.prompt.source(None)?.load(dir, config)?;
            set.into_iter().next().context("no prompt")?
        }
    };
    let outputs = args.report.outputs()?;
    check_device(&device).context("--device")?;
    let mut dut = target.device(settings, None)?;
    let mut baseline = match baseline_settings {
        Some(b) => Some(OwnGraphs::open(config, store, b, None)?),
        None => None,
    };
    let plan = ProbePlan {
        dir,
        config,
        store,
        prompt: &prompt,
        layers: &args.layers,
        mode: args.mode.into(),
        max_nrmse: args.max_nrmse,
        max_state_nrmse: args.max_state_nrmse,
        model: None,
        images: images.as_ref().map(|(_, _, p)| p),
        fed_routing: !args.no_fed_routing,
    };
    let dtype = args.model.dtype.dtype();
    let devices: Vec<&str> = std::iter::once(device.as_str())
        .chain(args.tolerance_from.as_deref())
        .collect();
    let plan_for = |format, layers: &[usize]| {
        memory_plan(
            dir,
            config,
            dtype,
            format,
            &devices,
            target.set(),
            &prompt,
            layers,
            plan.mode,
            graph_shape,
        )
    };
    let mut fewer = Vec::new();
    if args.ir.is_none() && args.layers.len() != 2 {
        // One DeltaNet and one attention layer: the probe's smallest useful unit.
        let kinds = &config.layer_types;
        let first = |k| kinds.iter().position(|&t| t == k);
        if let (Some(d), Some(a)) = (
            first(reference::config::LayerKind::Linear),
            first(reference::config::LayerKind::Full),
        ) {
            let two = [d.min(a), d.max(a)];
            fewer.push((
                format!("--layers {},{}", two[0], two[1]),
                plan_for(store.format(), &two)?,
            ));
        }
    }
    let memory = memory::check_formats(
        "probe",
        store.format(),
        |f| plan_for(f, &args.layers),
        fewer,
    )?;
    let mut report = run(
        &plan,
        dut.as_mut(),
        baseline
            .as_mut()
            .map(|b| (b as &mut dyn DeviceUnderTest, args.factor)),
    )?;
    if let (Some(_), Some(s)) = (&images, target.set()) {
        crate::errln!(
            "note: the vision graphs of {} are whole towers, not a graph per block: their blocks are not probed \
             (compare-devices --ir --image and validate --ir --image compare their taps)",
            s.set.source
        );
    } else if let Some((vc, pixels, _)) = &images {
        let compile = args.graph.compile(&device)?;
        report.vision = crate::probe::vision::probe_vision(
            vc,
            store,
            pixels,
            &device,
            &compile,
            report.thresholds.max_nrmse,
        )?;
    }
    report.memory = Some(memory.measured());
    report.emit(&outputs)?;
    Ok(if report.passed() {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}
