//! compare-devices' runs, written once for every device under test: the reference's side of each prompt, a device
//! against it, and the compression's own error.

use super::{
    DeviceReport, Distribution, Position, ReferenceRun, Row, ThresholdOverrides, compare_prompt,
    continuation, deployed_run, rows, tapped_run,
};
use crate::device::{DeviceUnderTest, open_reference};
use crate::images::PromptInput;
use crate::metrics::TensorError;
use crate::progress::Progress;
use crate::prompts::LabelledPrompt;
use crate::report::QuantizationError;
use anyhow::{Context, Result};
use candle_core::Tensor;
use reference::backend::{Backend, teacher_forced};
use reference::config::Config;
use reference::config::LayerKind;
use reference::model::RunOptions;
use reference::weights::WeightStore;
use std::collections::BTreeMap;

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

/// One device under test against the reference's runs: every prompt compared, then aggregated and judged by the
/// thresholds for the precision the deployed graphs read back.
pub fn compare_device(
    dut: &mut dyn DeviceUnderTest,
    runs: &[ReferenceRun],
    eos: &[u32],
    thresholds: &ThresholdOverrides,
    progress: &Progress,
) -> Result<DeviceReport> {
    compare_device_on(dut, runs, None, eos, thresholds, progress)
}

/// [`compare_device`] with the device's own inputs, one per run (a prompt with images: the rows of the device's
/// vision graph); `None` feeds the device what the reference ran.
pub fn compare_device_on(
    dut: &mut dyn DeviceUnderTest,
    runs: &[ReferenceRun],
    inputs: Option<&[PromptInput]>,
    eos: &[u32],
    thresholds: &ThresholdOverrides,
    progress: &Progress,
) -> Result<DeviceReport> {
    let input = |i: usize| inputs.map_or(&runs[i].input, |x| &x[i]);
    // The deployed graphs on every prompt, then (released) the tapped ones: one set compiled at a time.
    let mut deployed = Vec::with_capacity(runs.len());
    for (i, run) in runs.iter().enumerate() {
        progress.step(&format!("{}: {}", dut.label(), run.label));
        deployed.push(deployed_run(run, input(i), dut)?);
    }
    let record = dut.record()?;
    let kinds: Vec<Option<LayerKind>> = dut
        .deployed()?
        .config()
        .layer_types
        .iter()
        .map(|&k| Some(k))
        .collect();
    dut.release();
    let mut tapped = Vec::with_capacity(runs.len());
    for (i, run) in runs.iter().enumerate() {
        progress.message(&format!("{}: {} (hidden states)", dut.label(), run.label));
        tapped.push(tapped_run(run, input(i), dut)?);
    }
    dut.release();
    let caps = dut.capabilities().clone();
    let mut compared = Vec::with_capacity(runs.len());
    for ((run, d), t) in runs.iter().zip(&deployed).zip(&tapped) {
        compared.push(compare_prompt(run, &caps, &kinds, d, t.as_ref(), eos)?);
    }
    let thresholds = thresholds.resolve(&record.judged_precision());
    Ok(DeviceReport::new(dut.label(), record, thresholds, compared))
}

/// How far the compression itself moves the reference: the reference on the original weights (`original`) against
/// the reference on the compressed ones (the runs), teacher-forced on the latter's tokens.
pub fn quantization_error(
    config: &Config,
    original: &WeightStore,
    runs: &[ReferenceRun],
    eos: &[u32],
) -> Result<QuantizationError> {
    let mut backend = open_reference(config, original, RunOptions::default(), false)?;
    let mut positions = Vec::new();
    let mut logits_errors = Vec::new();
    for run in runs {
        let forced = teacher_forced(&mut backend, &run.prompt, continuation(&run.tokens))?;
        // The original weights are the truth here: the compressed run is the one under test.
        let quantized = &run.forced.run.logits;
        logits_errors.push(TensorError::of(quantized, &forced.run.logits)?);
        let (q_rows, o_rows) = (rows(quantized)?, rows(&forced.run.logits)?);
        for (i, (q, o)) in q_rows.iter().zip(&o_rows).enumerate() {
            positions.push(Position::of(i, run.prompt.len(), o, q, eos));
        }
    }
    let worst = logits_errors
        .into_iter()
        .reduce(|a, b| if b.nmse.get() > a.nmse.get() { b } else { a })
        .context("no prompts")?;
    Ok(QuantizationError {
        logits: worst,
        distribution: Distribution::of(&positions),
    })
}

/// The device's vision taps against the reference's, in the tower's order (`vision.merger` last).
pub fn vision_rows(
    device: &BTreeMap<String, Tensor>,
    reference: &BTreeMap<String, Tensor>,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (name, t) in device {
        let Some(expected) = reference.get(name) else {
            continue;
        };
        rows.push(Row {
            name: name.clone(),
            layer: None,
            error: TensorError::of(t, expected)?,
        });
    }
    // The tower's order, the images' run before the videos' (`video.vision.*`).
    let order = |n: &str| -> (bool, usize) {
        let (video, n) = match n.strip_prefix("video.") {
            Some(rest) => (true, rest),
            None => (false, n),
        };
        let step = match n {
            reference::vision::names::PATCH_EMBED => 0,
            reference::vision::names::POS_EMBED => 1,
            reference::vision::names::MERGER => usize::MAX,
            other => other
                .strip_prefix("vision.blocks.")
                .and_then(|r| r.split('.').next())
                .and_then(|i| i.parse::<usize>().ok())
                .map_or(usize::MAX - 1, |i| i + 2),
        };
        (video, step)
    };
    rows.sort_by_key(|r| order(&r.name));
    Ok(rows)
}
