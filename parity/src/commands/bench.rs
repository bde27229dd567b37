//! `qwen35 bench`: load time, prompt and decode speed, achieved GFLOP/s and peak memory of a backend on a
//! checkpoint, beside the machine's own f32 matrix-product rate and memory bandwidth. See [`crate::perf`] for how
//! each figure is counted and [`BenchReport`] for the JSON.

use super::Outcome;
use super::args::{Backend, DeviceArgs, Dtype, FormArgs, ModelArgs};
use crate::device::own::engine;
use crate::device::{DeviceSettings, check_context, check_positions, reference_on};
use crate::outputs::Paths;
use crate::perf::flops::{self, RunShape};
use crate::perf::machine::{self, shares};
use crate::perf::memory::{self, Sampler};
use crate::perf::weights::{active_parameters, decode_weight_bytes, decode_weight_parameters};
use crate::report::bench::vision_terminal;
pub use crate::report::bench::{BenchReport, PagesReport, terminal};
use anyhow::{Context, Result, bail};
use npu::graphs::DeltaNetGraphForm;
use reference::backend::greedy;
use reference::deltanet::Form;
use reference::model::Model;
use reference::pages::Pages;
use reference::quant::WeightFormat;
use reference::schema::Schema;
use reference::synthetic::Rng;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Arguments of `qwen35 bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length: this many token ids drawn uniformly from the vocabulary with `--seed`.
    #[arg(long, default_value_t = 256, value_name = "N")]
    prompt_tokens: usize,
    /// Single-token decode steps timed after the prompt. The run chooses N + 1 tokens: the first from the prompt's
    /// logits, then one per step (`generated_ids` lists them all).
    #[arg(long, default_value_t = 16, value_name = "N")]
    decode_tokens: usize,
    /// The seed of the prompt's token ids.
    #[arg(long, default_value_t = 0, value_name = "S")]
    seed: u64,
    /// Write every figure as JSON to this file.
    #[arg(long, value_name = "FILE.json")]
    json: Option<PathBuf>,
    /// Skip measuring the machine's matrix-product rate and memory bandwidth.
    #[arg(long)]
    no_machine: bool,
    /// Time the vision tower instead of the decoder: one image of HxW patches (seeded pixels; the NPU port's
    /// 32x32), on the reference or as the static vision graph on --device.
    #[arg(long, value_name = "HxW")]
    image_grid: Option<String>,
    /// Timed runs of the vision tower (the median is reported).
    #[arg(long, default_value_t = 3, value_name = "N", requires = "image_grid")]
    image_runs: usize,
    /// The reference only: what a forward call does with the checkpoint pages of the weights every token reads
    /// (`reference::pages`). release: hands a layer's back after the layer and the LM head's after it (resident
    /// memory bounded by a layer, whatever the model's size; every step faults them in again); keep-always-read:
    /// keeps them mapped; auto: keep-always-read when they take at most half of MemAvailable at load, else
    /// release. A routed expert's pages are handed back after its product under all three.
    #[arg(long, value_enum, default_value_t = PagesArg::Auto)]
    pages: PagesArg,
    #[command(flatten)]
    form: FormArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

/// `--pages`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PagesArg {
    /// The model's rule.
    Auto,
    /// [`Pages::Release`].
    Release,
    /// [`Pages::KeepAlwaysRead`].
    KeepAlwaysRead,
}

/// What a benchmark runs, validated before any work.
enum Plan {
    Reference(reference::model::RunOptions),
    OpenVino(DeviceSettings),
}

/// The prompt: `n` ids drawn uniformly from a vocabulary of `vocab` with `seed`.
pub fn prompt_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// Runs `qwen35 bench`.
pub fn exec(args: BenchArgs) -> Result<Outcome> {
    Paths::new()
        .with(&args.model)
        .with(&args.device)
        .file("--json", args.json.as_ref())
        .check()?;
    if let Some(grid) = &args.image_grid {
        return bench_vision(&args, grid);
    }
    if args.prompt_tokens == 0 {
        bail!("--prompt-tokens must be at least 1");
    }
    if args.decode_tokens == 0 {
        bail!("--decode-tokens must be at least 1");
    }
    let plan = match args.device.backend {
        Backend::Reference => {
            args.device.check_reference()?;
            Plan::Reference(args.form.run_options()?)
        }
        Backend::Openvino => {
            if args.pages != PagesArg::Auto {
                bail!("--pages applies to the reference (--backend reference)");
            }
            if args.model.dtype != Dtype::F32 {
                bail!(
                    "--dtype f64 applies to the reference; OpenVINO graphs compute in f32 or f16 (--precision)"
                );
            }
            let device = args.device.device.as_deref().unwrap_or("CPU");
            let settings = args.device.graph.settings(device, &args.form)?;
            check_context(
                args.prompt_tokens,
                args.decode_tokens.saturating_add(1),
                settings.graph.context,
                "--context",
            )?;
            Plan::OpenVino(settings)
        }
    };
    let sampler = Sampler::start(Duration::from_millis(10));
    let start = Instant::now();
    let (dir, config, mut store) = args.model.open_for(&args.form)?;
    if let Plan::Reference(_) = plan {
        args.form.apply_arithmetic(&mut store)?;
    }
    check_positions(
        args.prompt_tokens,
        args.decode_tokens.saturating_add(1),
        &config,
        "--prompt-tokens and --decode-tokens",
    )?;
    let ids = prompt_ids(args.prompt_tokens, config.vocab_size, args.seed);
    let mut pages = None;
    let (mut backend, shape, decode_weight_bytes_per_token): (
        Box<dyn reference::backend::Backend>,
        RunShape,
        Option<u64>,
    ) = match &plan {
        Plan::Reference(opts) => {
            let mut model = Model::from_weights(config.clone(), &store)?;
            match args.pages {
                PagesArg::Auto => {}
                PagesArg::Release => model.set_pages(Pages::Release),
                PagesArg::KeepAlwaysRead => model.set_pages(Pages::KeepAlwaysRead),
            }
            pages = Some(PagesReport {
                policy: model.pages().name().into(),
                auto: args.pages == PagesArg::Auto,
                always_read_bytes: model.always_read_bytes(),
            });
            let b = reference_on(model, &store, *opts, false)?;
            let shape = RunShape {
                prefill: opts.prefill,
                decode: opts.decode,
                piece: opts.prefill_block,
            };
            (
                Box::new(b),
                shape,
                Some(decode_weight_bytes(&config, &store)?),
            )
        }
        Plan::OpenVino(settings) => {
            let b = engine(&config, &store, settings, false)?;
            let prefill = match settings.graph.form {
                DeltaNetGraphForm::Matrix => Form::Matrix,
                DeltaNetGraphForm::Loop => Form::Sequential,
                DeltaNetGraphForm::Chunked(inverse) => Form::Chunked {
                    block: settings.block,
                    inverse,
                },
            };
            let shape = RunShape {
                prefill,
                decode: Form::Matrix,
                piece: Some(settings.block),
            };
            // An MoE graph reads the chosen experts or all of them, as its form has it: not counted here.
            let bytes = match (args.model.weights, settings.compile.precision.hint()) {
                (WeightFormat::F32, "f32") if config.moe.is_none() => {
                    Some(4 * decode_weight_parameters(&config))
                }
                _ => None,
            };
            (Box::new(b), shape, bytes)
        }
    };
    let load_seconds = start.elapsed().as_secs_f64();
    sampler.sample();
    let generation = greedy(
        backend.as_mut(),
        &ids,
        args.decode_tokens + 1,
        &[],
        false,
        |_| Ok(()),
    )?;
    sampler.sample();
    if let Some(at) = generation.nan_at {
        bail!(
            "the logits held a NaN at decode step {at}: the backend's output is not usable for timing"
        );
    }
    let record = backend.record().clone();
    drop(backend);
    let peak_rss_bytes = memory::status().map_or(0, |s| s.peak_rss);
    let (peak_anon_bytes, _) = sampler.stop();
    drop(store);

    let machine = if args.no_machine {
        None
    } else {
        Some(machine::measure(2048, 512 << 20, 5)?)
    };
    let prompt_flops = flops::prompt(&config, &shape, ids.len());
    let decode_flops = flops::decode(&config, &shape, ids.len(), args.decode_tokens);
    let decode_tokens_per_s = args.decode_tokens as f64 / generation.decode_seconds.max(1e-12);
    let prompt_gflops_per_s = prompt_flops.total() / 1e9 / generation.prompt_seconds.max(1e-12);
    let decode_weight_gb_per_s =
        decode_weight_bytes_per_token.map(|b| b as f64 * decode_tokens_per_s / 1e9);
    let (prompt_share_of_gemm, decode_read_ratio) = shares(
        machine.as_ref(),
        prompt_gflops_per_s,
        decode_weight_gb_per_s,
    );
    let report = BenchReport {
        schema_version: 1,
        model: dir.display().to_string(),
        layers: config.num_layers(),
        parameters: Schema::new(&config)
            .tensors()
            .iter()
            .map(|t| t.shape.iter().product::<usize>() as u64)
            .sum(),
        active_parameters: active_parameters(&config),
        record,
        pages,
        threads: candle_core::utils::get_num_threads(),
        prompt_tokens: ids.len(),
        decode_tokens: args.decode_tokens,
        load_seconds,
        prompt_seconds: generation.prompt_seconds,
        decode_seconds: generation.decode_seconds,
        prompt_tokens_per_s: ids.len() as f64 / generation.prompt_seconds.max(1e-12),
        decode_tokens_per_s,
        prompt_gflops_per_s,
        decode_gflops_per_s: decode_flops.total() / 1e9 / generation.decode_seconds.max(1e-12),
        prompt_flops,
        decode_flops,
        decode_weight_bytes_per_token,
        decode_weight_gb_per_s,
        peak_rss_bytes,
        peak_anon_bytes,
        machine,
        prompt_share_of_gemm,
        decode_read_ratio,
        prompt_ids: ids,
        generated_ids: generation.tokens,
    };
    crate::out!("{}", terminal(&report));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        reference::io::write_atomic(path, (text + "\n").as_bytes())
            .map_err(|e| anyhow::anyhow!("--json {}: {e}", path.display()))?;
    }
    Ok(Outcome::Pass)
}

/// `bench --image-grid HxW`: the vision tower on one image of that grid.
fn bench_vision(args: &BenchArgs, grid: &str) -> Result<Outcome> {
    let (h, w) = super::args::parse_pair("--image-grid", grid, "HxW in patches, e.g. 32x32")?;
    if args.image_runs == 0 {
        bail!("--image-runs must be at least 1");
    }
    let device = match args.device.backend {
        Backend::Reference => {
            args.device.check_reference()?;
            None
        }
        Backend::Openvino => {
            let device = args.device.device.as_deref().unwrap_or("CPU");
            Some(args.device.graph.settings(device, &args.form)?)
        }
    };
    let (dir, _, store) = args.model.open_for(&args.form)?;
    let vc = crate::images::vision_config(&dir)?;
    let g = reference::vision::Grid { t: 1, h, w };
    g.check(vc.spatial_merge_size)
        .with_context(|| format!("--image-grid {grid}"))?;
    crate::memory::need(
        &format!("--image-grid {grid} (the vision tower over its patches)"),
        crate::memory::vision_work_bytes(&vc, (h as u64).saturating_mul(w as u64)),
    )?;
    let r = crate::perf::vision::bench(
        &dir.display().to_string(),
        &vc,
        &store,
        g,
        device.as_ref().map(|s| (s.device.as_str(), &s.compile)),
        args.image_runs,
    )?;
    crate::outln!("{}", vision_terminal(&r));
    if let Some(path) = &args.json {
        crate::outputs::write(path, serde_json::to_string_pretty(&r)?.as_bytes())?;
    }
    Ok(Outcome::Pass)
}
