//! What graphs will hold in memory, known before any is built: the weights of one compiled copy of this project's
//! decoder graph (or of one layer's graph) on an OpenVINO device or on FP16SIM, for a weight format; the memory
//! available; and the peak a run reached, to report beside the estimate.
//!
//! An OpenVINO plugin copies a graph's constants into its own layout once per compiled graph, whatever file they
//! came from: on the CPU plugin, the 32-layer 9B-shaped checkpoint with INT4 weights measured 10.2 GiB resident for
//! its two decoder graphs, against 2 × 5.2 GiB of constants in the IR. FP16SIM's tiled kernels read each matrix
//! where the graphs' one mapped `.bin` stores it, a tile of rows decoded at a time, and hand its pages back after
//! it; its plain evaluator (`kernels=plain`) decodes every constant of a graph, integer codes to i64.

use crate::error::{Error, Result};
use crate::graphs::MoeGraphForm;
use reference::config::Config;
use reference::quant::{Storage, WeightFormat};
use reference::schema::{Param, Schema, TensorSpec};

/// Bytes in a GiB.
pub const GIB: f64 = (1u64 << 30) as f64;

/// The environment variable that sets the memory a run may use, in GiB, instead of what the kernel says is
/// available (`MemAvailable`): to plan for another machine, or to test a refusal.
pub const MEMORY_ENV: &str = "QWEN35_MEMORY_GIB";

/// The constants of `specs` as a graph stores them in `format` (f32 where the format keeps a tensor as it is).
fn stored(specs: &[TensorSpec], format: WeightFormat) -> u64 {
    specs
        .iter()
        .map(|s| format.storage(s.role(), &s.shape).bytes(&s.shape, 4))
        .sum()
}

/// Whether `spec` is one of an MoE block's routed experts (stacked into one constant per projection in a graph).
fn is_routed_expert(spec: &TensorSpec) -> bool {
    matches!(
        spec.param,
        Param::ExpertGateProj(_) | Param::ExpertUpProj(_) | Param::ExpertDownProj(_)
    )
}

/// What a plugin holds of the routed experts `specs` in a gathered graph: integer codes at a byte each beside f32
/// scales, float stacks as f32 values.
fn gathered_expert_bytes(specs: &[TensorSpec], format: WeightFormat) -> u64 {
    specs
        .iter()
        .map(|s| {
            let n: u64 = s.shape.iter().map(|&d| d as u64).product();
            let cols = s.shape.last().map_or(1, |&c| c as u64).max(1);
            match format.storage(s.role(), &s.shape) {
                Storage::Int4Sym { group } => {
                    n + 4 * (n / cols) * cols.div_ceil(group.max(1) as u64)
                }
                Storage::Int8Sym => n + 4 * (n / cols),
                Storage::Float | Storage::F16 => 4 * n,
            }
        })
        .sum()
}

/// Values of `specs`.
fn values(specs: &[TensorSpec]) -> u64 {
    specs
        .iter()
        .map(|s| s.shape.iter().map(|&d| d as u64).product::<u64>())
        .sum()
}

/// The largest matrix of `specs`, in values.
fn largest(specs: &[TensorSpec]) -> u64 {
    specs
        .iter()
        .map(|s| s.shape.iter().map(|&d| d as u64).product::<u64>())
        .max()
        .unwrap_or(0)
}

/// Values of `specs` that `format` stores as integer codes.
fn coded(specs: &[TensorSpec], format: WeightFormat) -> u64 {
    specs
        .iter()
        .filter(|s| {
            matches!(
                format.storage(s.role(), &s.shape),
                Storage::Int4Sym { .. } | Storage::Int8Sym
            )
        })
        .map(|s| s.shape.iter().map(|&d| d as u64).product::<u64>())
        .sum()
}

/// The resident bytes of compiled graphs of the constants of `specs` on `device`, one per entry of `tokens` (the
/// graph's tokens per call), an MoE block's experts in `moe`'s form; `in_memory`: an FP16SIM graph built in memory
/// (a per-layer graph) rather than on a mapped `.bin` (the decoder graphs).
fn graph_bytes(
    config: &Config,
    specs: &[TensorSpec],
    format: WeightFormat,
    device: &str,
    tokens: &[usize],
    moe: MoeGraphForm,
    in_memory: bool,
) -> u64 {
    let graphs = tokens.len() as u64;
    let ir = stored(specs, format);
    if !crate::sim::NumericModel::is_sim(device) {
        // An MoE block's stacked experts, on the CPU plugin: masked, the dequantized stack is folded into f32 values
        // and repacked (twice the f32 values: the 35B-A3B's layer 0 with INT4 weights, 0.4 GB of codes in the `.bin`,
        // added 6.2 GB); gathered, integer codes and their scales are gathered before they are dequantized and the
        // codes stay integers (counted at a byte a code and f32 scales), float stacks stay f32 values.
        let (experts, rest): (Vec<TensorSpec>, Vec<TensorSpec>) =
            specs.iter().cloned().partition(is_routed_expert);
        let (e, k) = config
            .moe
            .as_ref()
            .map_or((0, 0), |m| (m.num_experts, m.num_experts_per_tok));
        return tokens
            .iter()
            .map(|&t| {
                let held = match moe.resolve(t, e, k) {
                    MoeGraphForm::Masked => 2 * 4 * values(&experts),
                    _ => gathered_expert_bytes(&experts, format),
                };
                stored(&rest, format) + held
            })
            .sum();
    }
    let kernels =
        crate::sim::parse_device(device, &[]).map_or(crate::sim::Kernels::Tiled, |(_, k)| k);
    if kernels == crate::sim::Kernels::Plain {
        // Every graph: the IR's bytes; every constant decoded, floats to f32 and integer codes to i64; and while a
        // product over a quantized matrix runs, its codes and its dequantized values in f32.
        let codes = coded(specs, format);
        return graphs * (ir + 4 * (values(specs) - codes) + 8 * codes + 8 * largest(specs));
    }
    // The tiled kernels read each matrix where the `.bin` stores it, one at a time (its pages handed back after
    // it), so the graphs on one mapped `.bin` hold the largest matrix as stored, and each its other constants
    // decoded to f32 (norm weights, convolutions, biases: small); a graph built in memory holds its IR too.
    let (matrices, rest): (Vec<TensorSpec>, Vec<TensorSpec>) =
        specs.iter().cloned().partition(|s| s.shape.len() == 2);
    let largest_stored = matrices
        .iter()
        .map(|m| stored(std::slice::from_ref(m), format))
        .max()
        .unwrap_or(0);
    let own = 4 * values(&rest) + if in_memory { ir } else { 0 };
    graphs * own + largest_stored
}

/// One compiled decoder graph of `tokens` tokens per call (embedding, every layer, final norm, LM head) on `device`
/// (an OpenVINO device, or FP16SIM) with weights in `format` and an MoE block's experts in `moe`'s form.
pub fn decoder_graph_bytes(
    config: &Config,
    format: WeightFormat,
    device: &str,
    tokens: usize,
    moe: MoeGraphForm,
) -> u64 {
    decoder_graphs_bytes(config, format, device, &[tokens], moe)
}

/// An engine's compiled decoder graphs, one per entry of `tokens` (its prompt-block and 1-token graphs), on
/// `device`: on an OpenVINO device each its own copy of the weights, on FP16SIM one mapped `.bin` for all.
pub fn decoder_graphs_bytes(
    config: &Config,
    format: WeightFormat,
    device: &str,
    tokens: &[usize],
    moe: MoeGraphForm,
) -> u64 {
    graph_bytes(
        config,
        &Schema::new(config).tensors(),
        format,
        device,
        tokens,
        moe,
        false,
    )
}

/// One compiled copy of layer `layer`'s graph of `tokens` tokens per call on `device` with weights in `format`.
pub fn layer_graph_bytes(
    config: &Config,
    format: WeightFormat,
    layer: usize,
    device: &str,
    tokens: usize,
    moe: MoeGraphForm,
) -> u64 {
    graph_bytes(
        config,
        &Schema::new(config).layer_tensors(layer),
        format,
        device,
        &[tokens],
        moe,
        true,
    )
}

/// What a static context of `context` positions adds to a decoder graph of `block` tokens per call: every
/// full-attention layer's key and value caches and a call's attention scores with their softmax and mask, all f32.
/// Saturating: a context too large to count is too large to hold.
pub fn context_bytes(config: &Config, context: usize, block: usize) -> u64 {
    let full = config
        .layer_types
        .iter()
        .filter(|k| **k == reference::config::LayerKind::Full)
        .count() as u64;
    let ctx = context as u64;
    let caches =
        (2 * full * (config.num_key_value_heads * config.head_dim) as u64).saturating_mul(ctx);
    let scores = ((2 * config.num_attention_heads as u64 + 1) * block as u64).saturating_mul(ctx);
    4u64.saturating_mul(caches.saturating_add(scores))
}

/// The memory a run may use: [`MEMORY_ENV`] when set, else the kernel's `MemAvailable` (`None` where neither is
/// known: no limit is then checked).
pub fn available() -> Result<Option<u64>> {
    if let Ok(v) = std::env::var(MEMORY_ENV) {
        let gib: f64 = v
            .trim()
            .parse()
            .map_err(|_| Error::Config(format!("{MEMORY_ENV}={v}: not a number of GiB")))?;
        if !gib.is_finite() || gib < 0.0 {
            return Err(Error::Config(format!(
                "{MEMORY_ENV}={v}: not a number of GiB"
            )));
        }
        return Ok(Some((gib * GIB) as u64));
    }
    Ok(meminfo("MemAvailable:"))
}

/// The peak resident memory of this process so far (`VmHWM`), where the kernel reports it.
pub fn peak_resident() -> Option<u64> {
    status_kib("/proc/self/status", "VmHWM:").map(|k| k * 1024)
}

/// A `/proc/meminfo` line's figure, in bytes.
fn meminfo(key: &str) -> Option<u64> {
    status_kib("/proc/meminfo", key).map(|k| k * 1024)
}

/// The kB figure of the line starting with `key` in a `/proc` status file.
fn status_kib(file: &str, key: &str) -> Option<u64> {
    #[allow(clippy::disallowed_methods)] // the kernel's figures, not an input of the run
    let text = std::fs::read_to_string(file).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int4_graph_is_smaller_than_f16_smaller_than_f32() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny");
        let config = Config::from_file(&dir.join("config.json")).unwrap();
        let f32 = decoder_graph_bytes(&config, WeightFormat::F32, "CPU", 16, MoeGraphForm::Auto);
        let f16 = decoder_graph_bytes(&config, WeightFormat::F16, "CPU", 16, MoeGraphForm::Auto);
        let int4 = decoder_graph_bytes(
            &config,
            WeightFormat::Int4Sym { group: 32 },
            "CPU",
            16,
            MoeGraphForm::Auto,
        );
        assert_eq!(f32, 2 * f16, "f16 halves every constant");
        assert!(int4 < f16, "{int4} {f16}");
        let plain = decoder_graph_bytes(
            &config,
            WeightFormat::F32,
            "FP16SIM:kernels=plain",
            16,
            MoeGraphForm::Auto,
        );
        assert!(
            plain > 2 * f32,
            "the plain evaluator decodes its constants: {plain} {f32}"
        );
        let tiled = decoder_graph_bytes(
            &config,
            WeightFormat::F32,
            "FP16SIM",
            16,
            MoeGraphForm::Auto,
        );
        assert!(
            tiled < f32,
            "the tiled kernels read matrices in place: {tiled} {f32}"
        );
        let two = decoder_graphs_bytes(
            &config,
            WeightFormat::F32,
            "FP16SIM",
            &[16, 1],
            MoeGraphForm::Auto,
        );
        assert!(
            tiled < two && two < 2 * tiled,
            "two graphs share one .bin: {two} {tiled}"
        );
        let two_cpu = decoder_graphs_bytes(
            &config,
            WeightFormat::F32,
            "CPU",
            &[16, 1],
            MoeGraphForm::Auto,
        );
        assert_eq!(two_cpu, 2 * f32, "a plugin copies the weights per graph");
        let layers: u64 = (0..config.num_layers())
            .map(|l| {
                layer_graph_bytes(&config, WeightFormat::F32, l, "CPU", 16, MoeGraphForm::Auto)
            })
            .sum();
        assert!(layers < f32, "the layers hold less than the whole decoder");
    }

    #[test]
    fn a_plugin_holds_routed_experts_as_codes_gathered_and_at_twice_f32_masked() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny-moe");
        let config = Config::from_file(&dir.join("config.json")).unwrap();
        let specs = Schema::new(&config).tensors();
        let expert_values: u64 = specs
            .iter()
            .filter(|s| is_routed_expert(s))
            .map(|s| s.shape.iter().map(|&d| d as u64).product::<u64>())
            .sum();
        let moe = config.moe.as_ref().unwrap();
        let per_layer = 3 * moe.num_experts * moe.moe_intermediate_size * config.hidden_size;
        assert_eq!(expert_values, (config.num_layers() * per_layer) as u64);
        let rest: Vec<TensorSpec> = specs
            .iter()
            .filter(|s| !is_routed_expert(s))
            .cloned()
            .collect();
        let int4 = WeightFormat::Int4Sym { group: 16 };
        for format in [WeightFormat::F32, int4] {
            let rest = stored(&rest, format);
            // Gathered: f32 values, or a byte a code and an f32 scale per group of 16 (every tiny-moe expert
            // matrix is INT4 at group 16).
            let gathered = match format {
                WeightFormat::F32 => 4 * expert_values,
                _ => expert_values + 4 * expert_values / 16,
            };
            let cpu = |tokens, form| decoder_graph_bytes(&config, format, "CPU", tokens, form);
            assert_eq!(cpu(16, MoeGraphForm::Masked), rest + 8 * expert_values);
            assert_eq!(cpu(16, MoeGraphForm::Gather), rest + gathered);
            // One token gathers whatever the option; tiny-moe's 8 experts of 3 chosen are masked under auto.
            assert_eq!(cpu(1, MoeGraphForm::Masked), rest + gathered);
            assert_eq!(cpu(16, MoeGraphForm::Auto), rest + 8 * expert_values);
            assert_eq!(
                decoder_graphs_bytes(&config, format, "CPU", &[16, 1], MoeGraphForm::Masked),
                2 * rest + 8 * expert_values + gathered
            );
        }
        // FP16SIM reads the stacks where the `.bin` stores them: not counted at f32.
        let sim = decoder_graph_bytes(&config, int4, "FP16SIM", 16, MoeGraphForm::Masked);
        assert!(sim < 4 * expert_values);
    }
}
