//! `qwen35 synth`: a random checkpoint with the real shapes of Qwen3.5-9B or Qwen3.5-35B-A3B, in the real layout
//! (see `reference::synth`), written tensor by tensor.

use super::Outcome;
use crate::outputs::{Kind, Paths, StagedDir, free_bytes};
use crate::perf::memory;
use crate::report::{count, size};
use anyhow::{Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use reference::synth::{Arch, DEFAULT_SHARD_BYTES, SynthOptions, planned_bytes, write_checkpoint};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `qwen35 synth`.
#[derive(clap::Args)]
pub struct SynthArgs {
    /// The directory to write (created; it must not exist yet or be empty). It appears whole or not at all: the
    /// files go into a hidden sibling renamed onto it at the end (Ctrl-C removes them and exits with 130).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Decoder layers, in the real pattern (three linear-attention layers, then a full-attention one, repeated; the
    /// real 9B has 32, the real 35B-A3B 40).
    #[arg(long, value_name = "N")]
    layers: usize,
    /// The seed of every value (the same seed gives byte-identical files).
    #[arg(long, default_value_t = 0, value_name = "S")]
    seed: u64,
    /// The architecture, with its real dimensions and layout: qwen3.5-9b (dense) or 35b-a3b (Qwen3.5-35B-A3B: 256
    /// experts per layer, 8 per token, and a shared expert). tiny and tiny-moe are the same at toy sizes, for tests.
    #[arg(long, default_value = "qwen3.5-9b", value_name = "ARCH")]
    arch: String,
    /// The largest shard in bytes (default 5 GB).
    #[arg(long, value_name = "BYTES", hide = true)]
    shard_bytes: Option<u64>,
}

/// Runs `qwen35 synth`.
pub fn exec(args: SynthArgs) -> Result<Outcome> {
    Paths::new()
        .output("--out", Some(&args.out), Kind::NewDir)
        .check()?;
    if args.layers == 0 {
        bail!("--layers must be at least 1");
    }
    let arch = Arch::parse(&args.arch).map_err(|e| anyhow::anyhow!("--arch: {e}"))?;
    let shard_bytes = args.shard_bytes.unwrap_or(DEFAULT_SHARD_BYTES);
    if shard_bytes == 0 {
        bail!("--shard-bytes must be positive");
    }
    let opts = SynthOptions {
        arch,
        layers: args.layers,
        seed: args.seed,
        shard_bytes,
    };
    // Written into a sibling and moved into place whole: an error leaves nothing behind, nor does Ctrl-C (caught
    // below); a run that was killed leaves a sibling that the next one removes.
    let staged = StagedDir::create("--out", &args.out)?;
    let need = planned_bytes(&opts)?;
    let free = free_bytes(staged.path()).map_err(|e| {
        anyhow::anyhow!("--out {}: reading the free space: {e}", args.out.display())
    })?;
    if need > free {
        bail!(
            "--out {}: the checkpoint takes {} ({} layers) but its file system has {} free",
            args.out.display(),
            size(need),
            args.layers,
            size(free)
        );
    }
    let bar = ProgressBar::with_draw_target(Some(0), crate::console::progress_target());
    if let Ok(style) = ProgressStyle::with_template(
        "{elapsed:>4} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    let start = Instant::now();
    // Ctrl-C or SIGTERM: the staged directory is registered, the signal's thread removes it (main.rs).
    let summary = write_checkpoint(staged.path(), &opts, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    staged.commit()?;
    let seconds = start.elapsed().as_secs_f64();
    crate::outln!(
        "wrote {}: {} ({} layers), seed {}, {} tensors, {} parameters ({} in the decoder), bf16",
        args.out.display(),
        arch.name(),
        args.layers,
        args.seed,
        summary.tensors,
        count(summary.parameters),
        count(summary.decoder_parameters)
    );
    for (file, bytes) in &summary.files {
        crate::outln!("  {file:<40} {:>10}", size(*bytes));
    }
    let peak = memory::status().map_or("unknown".to_string(), |s| size(s.peak_rss));
    crate::outln!(
        "  {} in {seconds:.1} s ({}/s); peak resident memory {peak}",
        size(summary.bytes()),
        size((summary.bytes() as f64 / seconds.max(1e-9)) as u64)
    );
    crate::outln!(
        "  no tokenizer (the real vocabulary has no small tokenizer to go with it): give prompts as --token-ids"
    );
    Ok(Outcome::Pass)
}
