//! Memory known before work: a command lays out what it will hold at once, phase by phase (the reference's
//! weights, each set of compiled graphs, the runs it keeps), and refuses to start when the largest phase does not
//! fit the memory available, with the figure, what there is, and the options that would fit; never an
//! out-of-memory kill halfway. The estimate goes in the report beside the peak the run measured.

use anyhow::{Context, Result, bail};
use npu::graphs::MoeGraphForm;
use npu::memory::{GIB, MEMORY_ENV, available, decoder_graph_bytes, peak_resident};
use reference::config::Config;
use reference::quant::WeightFormat;
use reference::vision::VisionConfig;
use serde::Serialize;

/// What the OpenVINO runtime, its plugin and a call's activations hold besides the weights (measured: under 0.5 GiB
/// on the CPU device with the tiny models; the static caches and logits of a call are small beside it).
pub const RUNTIME_BYTES: u64 = 1 << 29;

/// One thing held in memory.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Part {
    /// What it is.
    pub what: String,
    /// Its bytes.
    pub bytes: u64,
}

/// Everything held at once during one phase of a command.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Phase {
    /// The phase (`reference`, `CPU deployed graphs`, …).
    pub name: String,
    /// What is held.
    pub parts: Vec<Part>,
}

impl Phase {
    /// The bytes held.
    pub fn total(&self) -> u64 {
        self.parts
            .iter()
            .fold(0u64, |sum, p| sum.saturating_add(p.bytes))
    }
}

/// A command's phases, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    phases: Vec<Phase>,
}

impl Plan {
    /// Adds a phase holding `parts`.
    pub fn phase(&mut self, name: impl Into<String>, parts: Vec<(String, u64)>) -> &mut Self {
        self.phases.push(Phase {
            name: name.into(),
            parts: parts
                .into_iter()
                .map(|(what, bytes)| Part { what, bytes })
                .collect(),
        });
        self
    }

    /// The phase that holds the most.
    pub fn peak(&self) -> Option<&Phase> {
        self.phases.iter().max_by_key(|p| p.total())
    }

    /// The most any phase holds.
    pub fn peak_bytes(&self) -> u64 {
        self.peak().map_or(0, Phase::total)
    }

    /// Adds `part` to every phase so far (something held throughout).
    pub fn hold_throughout(&mut self, what: &str, bytes: u64) -> &mut Self {
        for p in &mut self.phases {
            p.parts.push(Part {
                what: what.to_string(),
                bytes,
            });
        }
        self
    }
}

/// A static vision graph's constants: the tower's weights as f32 values (the patch embedding, the position table,
/// every block's norms, attention and MLP, the merger), counted from the vision config.
pub fn vision_graph_bytes(vc: &VisionConfig) -> u64 {
    let (d, i) = (vc.hidden_size, vc.intermediate_size);
    let patch = d * vc.patch_dim() + d;
    let table = vc.num_position_embeddings * d;
    let block = 4 * d + 3 * d * d + 3 * d + d * d + d + 2 * i * d + i + d;
    let wide = d * vc.merge_unit();
    let merger = 2 * d + wide * wide + wide + vc.out_hidden_size * wide + vc.out_hidden_size;
    4 * (patch + table + vc.depth * block + merger) as u64
}

/// One vision tower's taps over `patches` patches, as a comparison keeps them (f32): the patch embedding and the
/// position table, every block's output and GELU input, the merger's rows.
pub fn vision_taps_bytes(vc: &VisionConfig, patches: usize) -> u64 {
    let (d, i) = (vc.hidden_size, vc.intermediate_size);
    let merged = patches / vc.merge_unit().max(1);
    4 * (patches * (2 * d + vc.depth * (d + i)) + merged * vc.out_hidden_size) as u64
}

/// What a prompt's images (`patches` patches in all) add to `plan`: the taps of `towers` vision towers (the
/// reference's, a device's) held throughout, and for each of `devices` a phase compiling its static vision graph
/// beside them.
pub fn add_images(
    plan: &mut Plan,
    vc: &VisionConfig,
    patches: usize,
    towers: u64,
    devices: &[&str],
) {
    let taps = towers * vision_taps_bytes(vc, patches);
    plan.hold_throughout("the vision towers' taps", taps);
    for d in devices {
        let mut parts = vec![
            ("its constants (f32)".to_string(), vision_graph_bytes(vc)),
            ("the vision towers' taps".to_string(), taps),
        ];
        if !npu::sim::NumericModel::is_sim(d) {
            parts.push(("the runtime".into(), RUNTIME_BYTES));
        }
        plan.phase(format!("{d}: the vision graph"), parts);
    }
}

/// The estimate a report carries, beside what the run measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryReport {
    /// The largest phase's bytes, estimated before work.
    pub estimate_bytes: u64,
    /// That phase, and what it holds.
    pub peak_phase: Option<Phase>,
    /// The memory the run could use (`MemAvailable`, or the `QWEN35_MEMORY_GIB` figure), when known.
    pub available_bytes: Option<u64>,
    /// The peak resident memory the run reached (`VmHWM`), filled in when it ends.
    pub measured_peak_bytes: Option<u64>,
}

impl MemoryReport {
    /// The report with the peak resident memory measured so far.
    pub fn measured(mut self) -> Self {
        self.measured_peak_bytes = peak_resident();
        self
    }
}

/// `bytes` as messages give it: in GiB, or in MiB below one.
pub fn gib(bytes: u64) -> String {
    let g = bytes as f64 / GIB;
    if g >= 1.0 {
        format!("{g:.1} GiB")
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// Fails unless `plan` fits the memory available; `command` names the command and `alternatives` are other option
/// sets (as flags) with their plans, of which those that fit are offered. Without a known figure (no
/// `MemAvailable`, no `QWEN35_MEMORY_GIB`) nothing is checked.
pub fn check(command: &str, plan: &Plan, alternatives: &[(String, Plan)]) -> Result<MemoryReport> {
    let available = available()?;
    let report = MemoryReport {
        estimate_bytes: plan.peak_bytes(),
        peak_phase: plan.peak().cloned(),
        available_bytes: available,
        measured_peak_bytes: None,
    };
    let (Some(avail), Some(peak)) = (available, plan.peak()) else {
        return Ok(report);
    };
    if peak.total() <= avail {
        return Ok(report);
    }
    let parts: Vec<String> = peak
        .parts
        .iter()
        .filter(|p| p.bytes > 0)
        .map(|p| format!("{} {}", p.what, gib(p.bytes)))
        .collect();
    let source = if std::env::var(MEMORY_ENV).is_ok() {
        MEMORY_ENV.to_string()
    } else {
        "MemAvailable".to_string()
    };
    let fits: Vec<String> = alternatives
        .iter()
        .filter(|(_, p)| p.peak_bytes() <= avail)
        .map(|(flags, p)| format!("{flags} (about {})", gib(p.peak_bytes())))
        .collect();
    let offer = if fits.is_empty() {
        "no smaller set of options here would fit".to_string()
    } else {
        format!("these would fit: {}", fits.join("; "))
    };
    bail!(
        "{command} would hold about {} at its peak ({}: {}), and {} is available ({source}); {offer}. Refused before \
         any work (set {MEMORY_ENV} to plan for another figure)",
        gib(peak.total()),
        peak.name,
        parts.join(" + "),
        gib(avail),
    )
}

/// Fails unless `bytes`, what `what` (a flag, a file and its key) would make a run hold, fit the memory available:
/// an error naming it, the bytes needed and those available, before anything of that size is allocated. Without a
/// known figure (no `MemAvailable`, no `QWEN35_MEMORY_GIB`) nothing is checked.
pub fn need(what: &str, bytes: u64) -> Result<()> {
    let Some(avail) = available()? else {
        return Ok(());
    };
    if bytes <= avail {
        return Ok(());
    }
    let source = if std::env::var(MEMORY_ENV).is_ok() {
        MEMORY_ENV
    } else {
        "MemAvailable"
    };
    bail!(
        "{what} would need about {} ({bytes} bytes), and {} is available ({source}). Refused before any work (set \
         {MEMORY_ENV} to plan for another figure)",
        gib(bytes),
        gib(avail),
    )
}

/// What the vision tower holds at once over `patches` patches: their pixel values and one tower's taps (f32), and a
/// block's attention scores with their softmax (f32, every head over every pair of patches). Saturating: a grid
/// too large to count is too large to hold.
pub fn vision_work_bytes(vc: &VisionConfig, patches: u64) -> u64 {
    let (d, i) = (vc.hidden_size as u64, vc.intermediate_size as u64);
    let per_patch = (vc.patch_dim() as u64)
        .saturating_add(2 * d)
        .saturating_add((vc.depth as u64).saturating_mul(d + i))
        .saturating_add(vc.out_hidden_size as u64);
    let rows = patches.saturating_mul(per_patch);
    let scores = (2 * vc.num_heads as u64).saturating_mul(patches.saturating_mul(patches));
    4u64.saturating_mul(rows.saturating_add(scores))
}

/// [`check`] of the plan for `format`, offering each smaller weight format ([`smaller_formats`]) and `extra` plans
/// that would fit.
pub fn check_formats(
    command: &str,
    format: WeightFormat,
    plan_for: impl Fn(WeightFormat) -> Result<Plan>,
    extra: Vec<(String, Plan)>,
) -> Result<MemoryReport> {
    let mut alternatives = smaller_formats(format)
        .into_iter()
        .map(|(flag, f)| Ok((flag, plan_for(f)?)))
        .collect::<Result<Vec<_>>>()?;
    alternatives.extend(extra);
    check(command, &plan_for(format)?, &alternatives)
}

/// The compiled copies of this project's decoder graph an engine holds on `device`, one graph per entry of `tokens`
/// (its tokens per call), with weights in `format` and an MoE block's experts in `moe`'s form, and the runtime
/// beside them: a plan's parts.
pub fn graph_parts(
    config: &Config,
    format: WeightFormat,
    device: &str,
    tokens: &[usize],
    moe: MoeGraphForm,
    context: usize,
) -> Vec<(String, u64)> {
    let graphs = tokens.len();
    let block = tokens.iter().copied().max().unwrap_or(1);
    let caches = (
        format!("the KV caches and attention of --context {context}"),
        (tokens.len() as u64).saturating_mul(npu::memory::context_bytes(config, context, block)),
    );
    if npu::sim::NumericModel::is_sim(device) {
        return vec![
            (
                format!(
                    "{graphs} graph(s) reading one mapped .bin of {} weights a matrix at a time",
                    format.name()
                ),
                npu::memory::decoder_graphs_bytes(config, format, device, tokens, moe),
            ),
            caches,
        ];
    }
    let mut parts: Vec<(String, u64)> = tokens
        .iter()
        .map(|&t| {
            let form = match &config.moe {
                Some(m) => format!(
                    ", experts {}",
                    moe.resolve(t, m.num_experts, m.num_experts_per_tok).name()
                ),
                None => String::new(),
            };
            let bytes = decoder_graph_bytes(config, format, device, t, moe);
            (
                format!(
                    "the graph of {t} token(s): {} of {} weights{form}",
                    gib(bytes),
                    format.name()
                ),
                bytes,
            )
        })
        .collect();
    parts.push(caches);
    parts.push(("the runtime".into(), RUNTIME_BYTES));
    parts
}

/// What llama.cpp's worker holds running the GGUF file of `model` (the file, or the directory holding it) with a
/// context of `context` tokens: the file (mapped; an upper bound of what it owns, as its CPU back end repacks some
/// types into memory of its own), its caches and the runtime: a plan's parts.
pub fn llamacpp_parts(
    model: &std::path::Path,
    config: &Config,
    context: usize,
) -> Result<Vec<(String, u64)>> {
    let gguf = crate::device::llamacpp::gguf_of(model)?;
    let file = std::fs::metadata(&gguf)
        .with_context(|| format!("{}", gguf.display()))?
        .len();
    Ok(vec![
        (
            format!("llama.cpp's weights: {} ({})", gguf.display(), gib(file)),
            file,
        ),
        (
            format!("its caches and compute of --context {context}"),
            npu::memory::context_bytes(config, context, context),
        ),
        ("the runtime".into(), RUNTIME_BYTES),
    ])
}

/// What a run keeps of `prompts` prompts of `tokens` positions each with every layer's taps, per side compared: the
/// logits of every position and about sixteen hidden-size vectors per layer and position.
pub fn run_bytes(config: &Config, prompts: usize, tokens: usize) -> u64 {
    let per_position =
        config.vocab_size as u64 + 16 * (config.num_layers() * config.hidden_size) as u64;
    4 * (prompts * tokens) as u64 * per_position
}

/// The weight formats smaller than `format` a run could take instead, with the flag that asks for each.
pub fn smaller_formats(format: WeightFormat) -> Vec<(String, WeightFormat)> {
    let int4 = (
        "--weights int4".to_string(),
        WeightFormat::Int4Sym { group: 128 },
    );
    match format {
        WeightFormat::F32 => vec![("--weights f16".into(), WeightFormat::F16), int4],
        WeightFormat::F16 => vec![int4],
        _ => Vec::new(),
    }
}

/// The reference model's own memory (its packed or converted weights; pages it reads in place are the kernel's to
/// take back) on the checkpoint in `dir`, with weights in `format`.
pub fn reference_bytes(
    dir: &std::path::Path,
    config: &Config,
    dtype: candle_core::DType,
    format: WeightFormat,
) -> Result<u64> {
    Ok(
        reference::weights::WeightStore::open_with_format(dir, dtype, format)?
            .model_held(config)?
            .owned,
    )
}

/// One compiled copy of every graph of a set read from files: each graph's `.bin` (a plugin copies what a graph uses
/// into its own layout; a `.bin` shared by several graphs is counted for each, an upper bound).
pub fn set_graph_bytes(set: &npu::graphset::GraphSet) -> u64 {
    set.decoder
        .iter()
        .chain(set.layers.iter())
        .flat_map(|part| &part.graphs)
        .map(|g| std::fs::metadata(&g.bin).map_or(0, |m| m.len()))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_is_the_largest_phase() {
        let mut plan = Plan::default();
        plan.phase("a", vec![("x".into(), 3), ("y".into(), 4)])
            .phase("b", vec![("z".into(), 9)]);
        assert_eq!(plan.peak_bytes(), 9);
        assert_eq!(plan.peak().map(|p| p.name.as_str()), Some("b"));
        assert_eq!(Plan::default().peak_bytes(), 0);
    }

    #[test]
    fn images_add_their_taps_to_every_phase_and_a_vision_graph_phase_per_device() {
        let vc = VisionConfig::from_json_str(
            r#"{"vision_config": {"depth": 2, "hidden_size": 8, "intermediate_size": 16, "num_heads": 2,
                "in_channels": 3, "patch_size": 2, "temporal_patch_size": 2, "spatial_merge_size": 2,
                "out_hidden_size": 12, "num_position_embeddings": 16},
                "image_token_id": 1, "video_token_id": 2, "vision_start_token_id": 3, "vision_end_token_id": 4}"#,
            "test",
        )
        .unwrap()
        .unwrap();
        // 16 patches: 2 × 8 (embedding, table) + 2 blocks × (8 + 16), and 4 merged rows of 12; f32.
        assert_eq!(vision_taps_bytes(&vc, 16), 4 * (16 * (16 + 48) + 4 * 12));
        let mut plan = Plan::default();
        plan.phase("a", vec![("x".into(), 100)]);
        add_images(&mut plan, &vc, 16, 2, &["CPU"]);
        let taps = 2 * vision_taps_bytes(&vc, 16);
        assert_eq!(plan.phases[0].total(), 100 + taps);
        assert_eq!(plan.phases[1].name, "CPU: the vision graph");
        assert_eq!(
            plan.phases[1].total(),
            vision_graph_bytes(&vc) + taps + RUNTIME_BYTES
        );
    }
}
