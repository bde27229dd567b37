//! `qwen35 ranges`: what of the reference's numbers an fp16 (or bf16) device cannot hold, before any device runs.

use super::Outcome;
use super::args::{ImageArgs, ModelArgs, PromptArgs};
use crate::device::check_positions;
use crate::device::open_reference;
use crate::outputs::Paths;
use crate::ranges::RangeScan;
use anyhow::{Context, Result, bail};
use npu::sim::numeric::Storage;
use reference::backend::Backend;
use reference::linear_attn::{PORT_OUTPUT_SCALE, check_output_scale};
use reference::model::RunOptions;
use std::path::PathBuf;

/// Prompt tokens per forward call: the attention scores of a call are `[heads, BLOCK, tokens so far]`, not the
/// square of the prompt.
const BLOCK: usize = 256;

/// Arguments of `qwen35 ranges`.
#[derive(clap::Args)]
pub struct RangesArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    prompt: PromptArgs,
    #[command(flatten)]
    images: ImageArgs,
    /// The format the device stores values in: f16 (an NPU) or bf16.
    #[arg(long, default_value = "f16", value_name = "f16|bf16")]
    store: String,
    /// The DeltaNet output rescaling the graphs apply (1 = off; the NPU port's is 1024).
    #[arg(long, default_value_t = PORT_OUTPUT_SCALE, value_name = "S")]
    output_scale: f64,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE.json")]
    json: Option<PathBuf>,
}

/// Runs `qwen35 ranges`.
pub fn exec(args: RangesArgs) -> Result<Outcome> {
    Paths::new()
        .with(&args.model)
        .file("--json", args.json.as_ref())
        .check()?;
    let storage = match args.store.as_str() {
        "f16" | "fp16" => Storage::F16,
        "bf16" => Storage::Bf16,
        other => bail!("--store {other}: expected f16 or bf16"),
    };
    check_output_scale(args.output_scale).context("--output-scale")?;
    let (dir, config, store) = args.model.open()?;
    // With images: the tower's taps first, then the decoder on the prompt with its rows (in one call: the image's
    // positions come with it).
    if let Some(source) = args.images.source()? {
        let vc = crate::images::vision_config(&dir)?;
        let pixels = source.load(&dir, &vc)?;
        let ids = args.prompt.vision_ids(&dir, &config, &vc, &pixels)?;
        check_positions(ids.len(), 0, &config, "the prompt")?;
        let mut reference = open_reference(&config, &store, RunOptions::default(), true)?;
        let images = crate::images::reference_images(
            &reference.model().token_table(),
            &store,
            &vc,
            ids,
            &pixels,
            true,
        )?;
        let mut scan = RangeScan::new(&config, storage, args.output_scale).with_vision(vc.depth);
        scan.add_taps(&images.taps, 0)?;
        reference.reset()?;
        let run = reference.forward_embedded(&images.prompt, true)?;
        let mut taps = run.taps;
        taps.insert(reference::taps::names::LOGITS.into(), run.logits);
        scan.add_taps(&taps, 0)?;
        scan.add_states(&reference.snapshot()?.tensors)?;
        return finish(scan, &config, &store, &args, &pixels.source);
    }
    let prompt = args
        .prompt
        .source(None)?
        .load(&dir, &config)?
        .into_iter()
        .next()
        .context("no prompt")?;
    check_positions(prompt.ids.len(), 0, &config, "the prompt")?;
    let mut reference = open_reference(&config, &store, RunOptions::default(), true)?;
    reference.reset()?;
    // Block by block, each block's taps reduced and dropped: the memory stays that of one block (and the caches),
    // whatever the prompt's length.
    let mut scan = RangeScan::new(&config, storage, args.output_scale);
    for (i, piece) in prompt.ids.chunks(BLOCK).enumerate() {
        let run = reference.forward(piece, true)?;
        let mut taps = run.taps;
        taps.insert(reference::taps::names::LOGITS.into(), run.logits);
        scan.add_taps(&taps, i * BLOCK)?;
    }
    scan.add_states(&reference.snapshot()?.tensors)?;
    finish(scan, &config, &store, &args, &prompt.label)
}

/// Prints the report, writes its JSON, and says whether a value was not finite.
fn finish(
    scan: RangeScan,
    config: &reference::config::Config,
    store: &reference::weights::WeightStore,
    args: &RangesArgs,
    label: &str,
) -> Result<Outcome> {
    let report = scan.finish(config, store)?;
    crate::out!("{}", report.terminal());
    if let Some(p) = &args.json {
        let mut v = serde_json::to_value(&report)?;
        if let Some(o) = v.as_object_mut() {
            o.insert(
                "schema_version".into(),
                crate::report::SCHEMA_VERSION.into(),
            );
            o.insert("prompt".into(), label.into());
        }
        crate::report::write(p, &serde_json::to_string_pretty(&v)?)?;
    }
    Ok(if report.non_finite() {
        Outcome::Fail
    } else {
        Outcome::Pass
    })
}
