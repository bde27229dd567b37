//! The report of `qwen35 bench`: everything it measured ([`BenchReport`], its JSON), and the terminal's table of it;
//! `bench --image-grid`'s line for the vision tower.

use super::{count, size};
use crate::perf::flops::Flops;
use crate::perf::machine::Machine;
use crate::perf::vision::VisionBench;
use reference::backend::RunRecord;

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
    /// The reference's pages policy (`release` or `keep-always-read`,
    /// [`Pages::name`](reference::pages::Pages::name)) and the bytes of the always-read weights it reads in place
    /// (what `keep-always-read` keeps resident); absent on OpenVINO.
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
    /// [`Pages::name`](reference::pages::Pages::name) of the policy that ran.
    pub policy: String,
    /// Whether `--pages auto` chose it.
    pub auto: bool,
    /// [`Model::always_read_bytes`](reference::model::Model::always_read_bytes).
    pub always_read_bytes: u64,
}

/// The report as a table for the terminal.
pub fn terminal(r: &BenchReport) -> String {
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
        format!(", {} active per token", count(r.active_parameters))
    } else {
        String::new()
    };
    out += &format!(
        "qwen35 bench: {} ({} layers, {} parameters{active}), {what}, weights {}, {} threads\n",
        r.model,
        r.layers,
        count(r.parameters),
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

/// `bench --image-grid HxW`'s line: the vision tower's median run on one image of that grid.
pub fn vision_terminal(r: &VisionBench) -> String {
    let [_, h, w] = r.grid;
    format!(
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
    )
}
