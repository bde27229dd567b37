//! `qwen35 bench`: load time, prompt and decode speed, achieved GFLOP/s and peak memory of a backend on a
//! checkpoint, beside the machine's own f32 matrix-product rate and memory bandwidth. See [`crate::perf`] for how
//! each figure is counted and [`BenchReport`] for the JSON.

use super::Outcome;
use super::args::{Backend, DeviceArgs, Dtype, FormArgs, ModelArgs};
use crate::device::own::engine;
use crate::device::{DeviceSettings, check_context, check_positions, reference_on};
use crate::outputs::Paths;
use crate::perf::flops::{self, Flops, RunShape};
use crate::perf::machine::{self, Machine};
use crate::perf::memory::{self, Sampler};
use anyhow::{Context, Result, bail};
use npu::graphs::DeltaNetGraphForm;
use reference::backend::{RunRecord, greedy};
use reference::config::Config;
use reference::deltanet::Form;
use reference::model::Model;
use reference::pages::Pages;
use reference::quant::WeightFormat;
use reference::schema::{Param, Role, Schema, TensorSpec};
use reference::synthetic::Rng;
use reference::weights::WeightStore;
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

/// Everything `qwen35 bench` measured (`schema_version` 1). Rates are per second of wall time; FLOPs follow
/// [`crate::perf::flops`]; memory follows [`crate::perf::memory`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    /// The JSON layout's version.
    pub schema_version: u32,
    /// The checkpoint directory.
    pub model: String,
    /// Decoder layers.
    pub layers: usize,
    /// Decoder parameters (embedding, layers, final norm, LM head).
    pub parameters: u64,
    /// The decoder parameters one token runs through: all of them in a dense decoder; in an MoE one, `k` of each
    /// layer's `E` routed experts.
    pub active_parameters: u64,
    /// What ran (backend, device, forms, precision).
    pub record: RunRecord,
    /// The reference's pages policy (`release` or `keep-always-read`, [`Pages::name`]) and the bytes of the
    /// always-read weights it reads in place (what `keep-always-read` keeps resident); absent on OpenVINO.
    pub pages: Option<PagesReport>,
    /// Threads (candle's count for the reference: `RAYON_NUM_THREADS`, else every core).
    pub threads: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Decode steps (single-token forward calls).
    pub decode_tokens: usize,
    /// Seconds to read the config, open the weights and build the model (or the graphs, compiled).
    pub load_seconds: f64,
    /// Seconds of the prompt's forward call(s).
    pub prompt_seconds: f64,
    /// Seconds of the decode steps, greedy choice included.
    pub decode_seconds: f64,
    /// Prompt tokens per second.
    pub prompt_tokens_per_s: f64,
    /// Decode tokens per second.
    pub decode_tokens_per_s: f64,
    /// FLOPs of the prompt by kind.
    pub prompt_flops: Flops,
    /// FLOPs of all decode steps by kind.
    pub decode_flops: Flops,
    /// Achieved prompt GFLOP/s.
    pub prompt_gflops_per_s: f64,
    /// Achieved decode GFLOP/s.
    pub decode_gflops_per_s: f64,
    /// Bytes of weights a decode step reads (projections and LM head at the precision they are held in), if known.
    pub decode_weight_bytes_per_token: Option<u64>,
    /// Those bytes times decode tokens per second, GB/s.
    pub decode_weight_gb_per_s: Option<f64>,
    /// The process's peak resident set (`VmHWM`: anonymous memory and resident pages of the mapped checkpoint).
    pub peak_rss_bytes: u64,
    /// The largest anonymous resident memory (`RssAnon`) sampled every 10 ms over load and run.
    pub peak_anon_bytes: u64,
    /// The machine's own limits, measured after the run (absent with `--no-machine`).
    pub machine: Option<Machine>,
    /// The prompt's achieved GFLOP/s over the machine's f32 GEMM rate (`machine.gemm_gflops_per_s`), whatever the
    /// weight format: a slower prompt shows here as a smaller share, the machine's load divided out (absent with
    /// `--no-machine`).
    pub prompt_share_of_gemm: Option<f64>,
    /// A decode step's time over the time to read the weights it streams once at the machine's read bandwidth
    /// (`decode_weight_bytes_per_token / machine.read_gb_per_s`), whatever the weight format: 1.0 is a step bound
    /// by memory, and a kernel that computes slower than memory delivers shows above it (absent with
    /// `--no-machine`, or when the bytes a step reads are not known).
    pub decode_read_ratio: Option<f64>,
    /// The prompt's token ids.
    pub prompt_ids: Vec<u32>,
    /// The greedy tokens chosen: `decode_tokens + 1`, the first from the prompt's logits, then one per decode step.
    pub generated_ids: Vec<u32>,
}

/// The reference's pages policy in a [`BenchReport`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct PagesReport {
    /// [`Pages::name`] of the policy that ran.
    pub policy: String,
    /// Whether `--pages auto` chose it.
    pub auto: bool,
    /// [`Model::always_read_bytes`].
    pub always_read_bytes: u64,
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

/// Parameters a decode step reads from memory: every projection (of an MoE layer's routed experts, the `k` a token
/// runs) and the LM head (one row of the embedding aside).
fn decode_weight_parameters(c: &Config) -> u64 {
    let (mut all, mut experts) = (0, 0);
    for t in decode_matrices(c) {
        let n = t.shape.iter().product::<usize>() as u64;
        if flops::token_share(c, t.param) == 1.0 {
            all += n;
        } else {
            experts += n;
        }
    }
    all + routed_share(c, experts)
}

/// The part of the routed experts' `total` (parameters or bytes, summed over every expert) that a token reads: `k`
/// of the `E` experts of each layer, all of one size.
fn routed_share(c: &Config, total: u64) -> u64 {
    c.moe.as_ref().map_or(0, |m| {
        total * m.num_experts_per_tok as u64 / m.num_experts as u64
    })
}

/// The decoder parameters one token runs through (`k` of the `E` routed experts of an MoE layer).
fn active_parameters(c: &Config) -> u64 {
    let (mut all, mut experts) = (0, 0);
    for t in Schema::new(c).tensors() {
        let n = t.shape.iter().product::<usize>() as u64;
        if flops::token_share(c, t.param) == 1.0 {
            all += n;
        } else {
            experts += n;
        }
    }
    all + routed_share(c, experts)
}

/// The matrices a decode step multiplies: every projection of every layer (every routed expert's: a step reads `k`
/// of them, [`routed_share`]), then the LM head (the embedding when they are tied).
fn decode_matrices(c: &Config) -> Vec<TensorSpec> {
    let s = Schema::new(c);
    let mut specs: Vec<TensorSpec> = (0..c.num_layers())
        .flat_map(|i| s.layer_tensors(i))
        .filter(|t| t.role() == Role::Projection)
        .collect();
    specs.push(s.global(if c.tie_word_embeddings {
        Param::EmbedTokens
    } else {
        Param::LmHead
    }));
    specs
}

/// The bytes of weights a reference decode step reads, as the store holds them (stored bf16, packed INT4/INT8
/// codes and scales, f16, or the run's dtype): of an MoE layer's routed experts, the `k` it runs.
fn decode_weight_bytes(c: &Config, store: &WeightStore) -> Result<u64> {
    let (mut all, mut experts) = (0, 0);
    for spec in decode_matrices(c) {
        let bytes = store.linear_bytes(&spec)?;
        if flops::token_share(c, spec.param) == 1.0 {
            all += bytes;
        } else {
            experts += bytes;
        }
    }
    Ok(all + routed_share(c, experts))
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
    let (dir, config, store) = args.model.open()?;
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
    print!("{}", terminal(&report));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        reference::io::write_atomic(path, (text + "\n").as_bytes())
            .map_err(|e| anyhow::anyhow!("--json {}: {e}", path.display()))?;
    }
    Ok(Outcome::Pass)
}

/// The prompt's share of the machine's GEMM rate and a decode step's time over the time to read its weights once at
/// the machine's read bandwidth (the same as the ratio of that bandwidth to the rate the step streamed them at).
fn shares(
    machine: Option<&Machine>,
    prompt_gflops_per_s: f64,
    decode_weight_gb_per_s: Option<f64>,
) -> (Option<f64>, Option<f64>) {
    let Some(m) = machine else {
        return (None, None);
    };
    (
        Some(prompt_gflops_per_s / m.gemm_gflops_per_s),
        decode_weight_gb_per_s.map(|rate| m.read_gb_per_s / rate),
    )
}

/// The report as a table for the terminal.
pub fn terminal(r: &BenchReport) -> String {
    use crate::report::size;
    let mut out = String::new();
    let what = match &r.record.device {
        Some(d) => format!(
            "{} on {d} ({})",
            r.record.backend,
            r.record.precision_text()
        ),
        None => format!("{} {}", r.record.backend, r.record.dtype),
    };
    let active = if r.active_parameters < r.parameters {
        format!(
            ", {} active per token",
            crate::report::count(r.active_parameters)
        )
    } else {
        String::new()
    };
    out += &format!(
        "qwen35 bench: {} ({} layers, {} parameters{active}), {what}, weights {}, {} threads\n",
        r.model,
        r.layers,
        crate::report::count(r.parameters),
        r.record.weights,
        r.threads
    );
    out += &format!(
        "  DeltaNet: prompt {}, decode {}\n",
        r.record.deltanet_prefill, r.record.deltanet_decode
    );
    if let Some(p) = &r.pages {
        out += &format!(
            "  pages    {}{} (the weights every token reads: {} read in place)\n",
            p.policy,
            if p.auto {
                ", by the rule"
            } else {
                ", as asked"
            },
            size(p.always_read_bytes)
        );
    }
    out += &format!("  load     {:>9.2} s\n", r.load_seconds);
    let gflop = |f: &Flops, n: usize| f.total() / 1e9 / n as f64;
    out += &format!(
        "  prompt   {:>9.2} s  {:>5} tokens  {:>9.2} tok/s  {:>8.1} GFLOP/s  ({:.2} GFLOP/token)\n",
        r.prompt_seconds,
        r.prompt_tokens,
        r.prompt_tokens_per_s,
        r.prompt_gflops_per_s,
        gflop(&r.prompt_flops, r.prompt_tokens)
    );
    out += &format!(
        "  decode   {:>9.2} s  {:>5} steps   {:>9.2} tok/s  {:>8.1} GFLOP/s  ({:.2} GFLOP/token; {} tokens chosen, \
         the first from the prompt)\n",
        r.decode_seconds,
        r.decode_tokens,
        r.decode_tokens_per_s,
        r.decode_gflops_per_s,
        gflop(&r.decode_flops, r.decode_tokens),
        r.generated_ids.len()
    );
    if let (Some(b), Some(rate)) = (r.decode_weight_bytes_per_token, r.decode_weight_gb_per_s) {
        out += &format!(
            "  decode reads {} of weights per token: {rate:.2} GB/s\n",
            size(b)
        );
    }
    out += &format!(
        "  memory   peak resident {} (VmHWM), peak anonymous {} (RssAnon sampled every 10 ms)\n",
        size(r.peak_rss_bytes),
        size(r.peak_anon_bytes)
    );
    if let Some(m) = &r.machine {
        out += &format!(
            "  machine  f32 GEMM {:.1} GFLOP/s ({n}x{n}x{n}, candle), read {:.1} GB/s, copy {:.1} GB/s (read + write, {}), best of {}, {} threads\n",
            m.gemm_gflops_per_s,
            m.read_gb_per_s,
            m.copy_gb_per_s,
            size(m.copy_bytes as u64),
            m.repeats,
            m.threads,
            n = m.gemm_size
        );
        if let Some(share) = r.prompt_share_of_gemm {
            out += &format!(
                "  share    prompt at {:.0}% of the GEMM rate",
                100.0 * share
            );
        }
        if let Some(ratio) = r.decode_read_ratio {
            out += &format!(
                "; a decode step takes {ratio:.2}x the time to read its weights once at the read bandwidth"
            );
        }
        out += "\n";
    }
    out
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
    let (dir, _config, store) = args.model.open()?;
    let vc = crate::images::vision_config(&dir)?;
    let g = reference::vision::Grid { t: 1, h, w };
    g.check(vc.spatial_merge_size)
        .with_context(|| format!("--image-grid {grid}"))?;
    let r = crate::perf::vision::bench(
        &dir.display().to_string(),
        &vc,
        &store,
        g,
        device.as_ref().map(|s| (s.device.as_str(), &s.compile)),
        args.image_runs,
    )?;
    println!(
        "vision tower on {}: one image of {h}x{w} patches ({} patches -> {} rows) in {:.3} s (median of {}; {:.1} \
         GFLOP/s), loaded in {:.2} s, peak anonymous memory {:.2} GiB",
        r.backend,
        r.patches,
        r.rows,
        r.median_seconds,
        r.run_seconds.len(),
        r.gflops_per_s,
        r.load_seconds,
        r.peak_anon_bytes as f64 / (1u64 << 30) as f64
    );
    if let Some(path) = &args.json {
        crate::outputs::write(path, serde_json::to_string_pretty(&r)?.as_bytes())?;
    }
    Ok(Outcome::Pass)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;
    use std::path::Path;

    fn tiny_moe() -> (Config, WeightStore) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny-moe");
        let c = Config::from_file(&dir.join("config.json")).unwrap();
        (c, WeightStore::open(&dir, DType::F32).unwrap())
    }

    #[test]
    fn the_shares_divide_the_machines_own_rates_out() {
        let m = Machine {
            threads: 2,
            gemm_size: 2048,
            gemm_gflops_per_s: 400.0,
            copy_bytes: 1 << 20,
            copy_gb_per_s: 30.0,
            read_gb_per_s: 40.0,
            repeats: 5,
        };
        // 100 GFLOP/s of 400; weights streamed at 20 GB/s where 40 could be read: a step twice the read time.
        assert_eq!(shares(Some(&m), 100.0, Some(20.0)), (Some(0.25), Some(2.0)));
        assert_eq!(shares(Some(&m), 100.0, None), (Some(0.25), None));
        assert_eq!(shares(None, 100.0, Some(20.0)), (None, None));
    }

    #[test]
    fn an_moe_decode_step_reads_k_of_the_e_experts() {
        let (c, store) = tiny_moe();
        // tiny-moe (f32, hidden 32, vocabulary 512): per layer the router 8 · 32, the shared expert 3 · 24 · 32 and
        // its gate 32, and 3 of its 8 experts of 3 · 16 · 32 (the mixers as in flops' test), then the LM head.
        let linear = (96 + 32 + 4 + 4 + 32) * 32;
        let attention = (128 + 32 + 32 + 64) * 32;
        let moe = 8 * 32 + 3 * 24 * 32 + 32 + 3 * 3 * 16 * 32;
        let expected = 3 * linear + attention + 4 * moe + 512 * 32;
        assert_eq!(decode_weight_parameters(&c), expected as u64);
        assert_eq!(
            decode_weight_bytes(&c, &store).unwrap(),
            4 * expected as u64
        );
        assert_eq!(
            2 * (decode_weight_parameters(&c) - 512 * 32),
            flops::projections_per_token(&c) as u64
        );
        // Every parameter but 5 of each layer's 8 experts (and the embedding, read a row at a time, counted whole).
        let all: u64 = Schema::new(&c)
            .tensors()
            .iter()
            .map(|t| t.shape.iter().product::<usize>() as u64)
            .sum();
        assert_eq!(active_parameters(&c), all - 4 * 5 * 3 * 16 * 32);
    }
}
