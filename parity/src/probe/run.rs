//! The probe of any device under test, as `probe` and `validate` run it: the reference's trace of the prompt in the
//! device's blocks, then each layer through the device's per-layer graphs where it has them, else through its
//! states (a whole-decoder set whose states are ports); each layer judged by the thresholds or by a baseline
//! device's error times a factor, and the drill-down of the first layer over threshold. On an MoE model, the
//! routing of the probed layers and each MoE block fed the reference's routing ([`super::moe`]).

use super::decoder::probe_decoder;
use super::{
    FED_ROUTING_NOT_AVAILABLE, Mode, ProbeOptions, ProbeThresholds, Probed, ReferenceTrace,
    drill_down, probe_with, thresholds_from,
};
use crate::device::{Capabilities, DeviceUnderTest, reference_on};
use crate::images::PromptInput;
use crate::prompts::LabelledPrompt;
use crate::report::Machine;
use crate::report::probe::{Baseline, ProbeInputs, ProbeReport};
use anyhow::{Context, Result, bail};
use reference::backend::{EmbeddedPrompt, Precision, RunRecord};
use reference::config::Config;
use reference::model::Model;
use reference::model::RunOptions;
use reference::weights::WeightStore;
use std::path::Path;

/// What to probe.
pub struct ProbePlan<'a> {
    /// The checkpoint directory.
    pub dir: &'a Path,
    /// Its config.
    pub config: &'a Config,
    /// Its weights, in the format both sides run.
    pub store: &'a WeightStore,
    /// The prompt.
    pub prompt: &'a LabelledPrompt,
    /// The layers to probe (empty: all).
    pub layers: &'a [usize],
    /// Isolated or chained.
    pub mode: Mode,
    /// The largest NRMSE of an output (default: for the precision read back).
    pub max_nrmse: Option<f64>,
    /// The largest NRMSE of a state (default: for the precision read back).
    pub max_state_nrmse: Option<f64>,
    /// The reference model when the caller holds one already (built from `store`): its weights are shared, not
    /// built a second time.
    pub model: Option<&'a Model>,
    /// The prompt with images (the reference tower's rows at its image tokens, `get_rope_index`'s positions), whose
    /// ids are `prompt`'s: the decoder's layers are probed on it, both sides given the reference's rows.
    pub images: Option<&'a EmbeddedPrompt>,
    /// On an MoE model, whether each probed layer's block is also run fed the reference's routing (where the device
    /// can: this project's graphs).
    pub fed_routing: bool,
}

impl ProbePlan<'_> {
    /// What the layers are probed on: the prompt's ids, or the prompt with images.
    pub fn input(&self) -> PromptInput {
        match self.images {
            Some(p) => PromptInput::Images(p.clone()),
            None => PromptInput::Ids(self.prompt.ids.clone()),
        }
    }
}

/// How a device can be probed, or why it cannot (naming what it would need).
pub fn how(caps: &Capabilities) -> std::result::Result<&'static str, String> {
    if caps.layer_graphs {
        Ok("per-layer graphs")
    } else if caps.states && caps.hidden {
        Ok("the decoder's states after every block and its hidden outputs")
    } else if caps.states {
        Ok("the decoder's states after every block")
    } else if caps.kind == "llama.cpp" {
        Err(
            "llama.cpp has no per-layer graphs and keeps its caches and states inside its context: compare-devices \
             compares its every layer's output instead"
                .into(),
        )
    } else {
        Err(
            "the device exposes neither per-layer graphs (`layers` in a set's manifest) nor its states (state ports, \
             `decoder.states`): a stateful IR keeps them inside OpenVINO"
                .into(),
        )
    }
}

/// The layers of `plan`, sorted and checked.
fn layers_of(plan: &ProbePlan) -> Result<Vec<usize>> {
    let n = plan.config.num_layers();
    let mut layers = if plan.layers.is_empty() {
        (0..n).collect()
    } else {
        plan.layers.to_vec()
    };
    layers.sort_unstable();
    layers.dedup();
    if let Some(&bad) = layers.iter().find(|&&l| l >= n) {
        bail!(
            "--layers: layer {bad} does not exist (the model has {n} layers, 0..{})",
            n - 1
        );
    }
    Ok(layers)
}

/// The block a device is probed in: its deployed block, else (a graph of any tokens per call) the engine's default.
fn block_of(caps: &Capabilities) -> usize {
    caps.block.unwrap_or(npu::engine::DEFAULT_BLOCK)
}

/// Every probed layer of `dut` and what ran.
fn probe_device(
    plan: &ProbePlan,
    dut: &mut dyn DeviceUnderTest,
    trace: &ReferenceTrace,
    layers: &[usize],
    thresholds: ProbeThresholds,
) -> Result<(Probed, RunRecord)> {
    let caps = dut.capabilities().clone();
    how(&caps).map_err(|why| anyhow::anyhow!("{}: cannot probe: {why}", dut.label()))?;
    let opts = ProbeOptions {
        mode: plan.mode,
        thresholds,
        // Graphs made elsewhere cannot build the block alone: not asked of them, and the report says so.
        fed_routing: plan.fed_routing && caps.fed_routing,
        prompt: plan.prompt.label.clone(),
    };
    let note = |mut p: Probed| {
        if plan.fed_routing && !caps.fed_routing && plan.config.moe.is_some() {
            p.fed_routing_note = Some(FED_ROUTING_NOT_AVAILABLE.to_string());
        }
        p
    };
    if caps.layer_graphs {
        let compiled: Vec<usize> = match plan.mode {
            Mode::Isolated => layers.to_vec(),
            Mode::Chained => (0..=*layers.last().context("no layer")?).collect(),
        };
        let mut device = dut
            .layers(&compiled, block_of(&caps))?
            .context("the device has no per-layer graphs")?;
        let probed = probe_with(plan.config, trace, device.as_mut(), layers, &opts)?;
        Ok((note(probed), device.record()))
    } else {
        let probed = probe_decoder(plan.config, trace, dut.deployed()?, layers, &opts)?;
        Ok((note(probed), dut.record()?))
    }
}

/// Probes `dut`; with a `baseline` device (FP16SIM) and factor, each layer's thresholds come from the baseline's
/// error on that layer.
pub fn run(
    plan: &ProbePlan,
    dut: &mut dyn DeviceUnderTest,
    baseline: Option<(&mut dyn DeviceUnderTest, f64)>,
) -> Result<ProbeReport> {
    let layers = layers_of(plan)?;
    let caps = dut.capabilities().clone();
    if let Some(context) = caps.context
        && plan.prompt.ids.len() > context
    {
        bail!(
            "the prompt has {} tokens but the static context holds {context} ({})",
            plan.prompt.ids.len(),
            caps.context_source
        );
    }
    let block = block_of(&caps);
    let model = match plan.model {
        Some(m) => m.clone(),
        None => Model::from_weights(plan.config.clone(), plan.store)?,
    };
    let mut reference = reference_on(model, plan.store, RunOptions::default(), true)?;
    let trace = ReferenceTrace::new(&mut reference, &plan.input(), block)?;
    // The trace is all the probe needs of it: its weights are handed back before any graph is built.
    drop(reference);
    let via = how(&caps).unwrap_or_default();
    // Judged by the thresholds for the precision the probed graphs read back (set once they are compiled).
    let f32 = ProbeThresholds::for_precision(&Precision::F32);
    let (
        Probed {
            layers: mut probed,
            routing,
            fed_routing_note,
        },
        record,
    ) = probe_device(plan, dut, &trace, &layers, f32)?;
    let defaults = ProbeThresholds::for_precision(&record.judged_precision());
    let thresholds = ProbeThresholds {
        max_nrmse: plan.max_nrmse.unwrap_or(defaults.max_nrmse),
        max_state_nrmse: plan.max_state_nrmse.unwrap_or(defaults.max_state_nrmse),
    };
    for l in &mut probed {
        l.judge(thresholds);
    }
    let baseline = match baseline {
        Some((base, factor)) => {
            let (base_probed, _) = probe_device(plan, base, &trace, &layers, thresholds)?;
            let base_layers = base_probed.layers;
            let per_layer = thresholds_from(
                &base_layers,
                factor,
                ProbeThresholds::for_precision(&Precision::F32),
            );
            for l in &mut probed {
                l.judge(per_layer[&l.layer]);
            }
            Some(Baseline {
                device: base.label().to_string(),
                factor,
                layers: base_layers
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
            model: plan.dir.display().to_string(),
            weights: plan.store.format().name(),
            device: dut.label().to_string(),
            prompt: plan.prompt.label.clone(),
            prompt_tokens: plan.prompt.ids.len(),
            mode: plan.mode,
            block,
            via: via.to_string(),
        },
        vision: Vec::new(),
        record,
        thresholds,
        baseline,
        drill_down: drill_down(&probed),
        memory: None,
        layers: probed,
        routing,
        fed_routing_note,
    })
}
