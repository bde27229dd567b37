//! The `compare-devices` report.
//!
//! # JSON (`schema_version` 2)
//! `schema_version`, `tool` (`qwen35 x.y.z`), `passed` (bool), `machine` {`os`, `cpu`, `cores`, `memory_bytes`},
//! `inputs` {`model`, `weights`, `prompts` ([label, tokens] pairs), `tokens`, `reference` (the reference's
//! [`RunRecord`])}, `quantization` (null, or {`logits`, `distribution`}: the compressed weights' own error against
//! the original ones, on the reference), and `devices`: one object per device with `device`, `record` (what ran:
//! precision read back, every property, …), `thresholds`, `passed`, `failures` (sentences), `greedy_matched`,
//! `greedy_total`, teacher-forced distributions `all`, `prompt_positions`, `generated_positions`, `near_ties`,
//! `confident` ({`positions`, `same_top1`, `top5_overlap`, `kl_mean`, `kl_p99`, `kl_max`, `delta_p_mean`,
//! `delta_p_rms`, `near_tie_flips`, `confident_flips`, `eos_drift_max`, `eos_drift_mean`}; KL is
//! `KL(P_ref ‖ P_device)` in nats), `logits`, `final_norm` (tensor errors: `max_abs`, `nmse`, `nrmse`, `rel_l2`,
//! `cosine`, `nan`, `inf`, `ref_nan`, `ref_inf`, `count`, `undefined` (null, or why the measures are null);
//! `final_norm` is null when not available), `layers` ([{`layer`, `kind`,
//! `output`, `mixer`, `mlp`, `nrmse_by_position`}]), `states` ([{`name`, `layer`, `error`}]), `not_available`
//! (present only when the backend exposes no hidden state nor state, e.g. an external IR: why `layers`, `states` and
//! `final_norm` are empty), `tapped_vs_deployed`, `first_divergence` {`layer`, `position`,
//! `token`, and in `diff` `tensor`: [name, measure], the first tensor in computation order out of tolerance}, `first_non_finite` (null, or {`prompt`, `tensors`, `first`: {`name`, `nan`, `inf`, `count`, `shape`,
//! `first` (the index of the first non-finite element)}}: where the device's NaN or infinity first appears, in the
//! order the decoder computes), `routing` (an MoE model whose chosen experts both sides expose, merged over the
//! prompts; absent otherwise: `top_k`, `pairs`, `same_set`, `same_order`, `set_agreement`, `near_tie_flips`,
//! `confident_flips`, `unclassified_flips`, `downstream_flips`, `router_off_flips`, `stated_router_error`,
//! `first_flip`, `first_confident`, `layers` ([{`layer`, `tokens`, `same_set`, `same_order`, `set_agreement`, the
//! five flip counts, `router_error_max`, `router_error_independent`, `margin_median`, `mlp_nrmse_flipped`,
//! `mlp_nrmse_agreeing`}]) and `flips` ([{`prompt`, `layer`, `token`, `reference`, `device`, `experts_in`,
//! `experts_out`, `reference_margin`, `gap`, `measured_router_error`, `router_error`, `router_error_source`
//! (`measured`|`stated`|`measured_plus_stated`), `repeated`, `class` (`near_tie`|`confident`|`unclassified`),
//! `mlp_nrmse`, `output_nrmse`, `input_nrmse`, `mixer_nrmse`, `upstream` ({`layer`, `token`} or null),
//! `router_off`}]); see [`crate::routing`]; `diff` scores the chosen experts there, not in `tensors`),
//! `prompt_tokens_per_s`, `decode_tokens_per_s` and `prompts` (every prompt's own comparison, with every
//! teacher-forced position, and `non_finite` / `reference_non_finite`: every tensor of either side holding NaN or
//! infinity, in computation order). A measure is undefined unless it is defined ([`crate::metrics::Measure`]): over
//! no value, or over values either side of which holds NaN or infinity, it is `null`, and the text says
//! `undefined (why)`.

pub use super::trace::first_divergence_line;
use super::trace::hidden_sections;
use super::{Machine, paint, routing, short_model, stamped};
use crate::compare::{DeviceReport, Distribution};
use crate::metrics::{Measure, TensorError, nan_max};
use anyhow::Result;
use reference::backend::RunRecord;
use serde::Serialize;
use std::fmt::Write as _;

/// What was compared.
#[derive(Debug, Clone, Serialize)]
pub struct Inputs {
    /// The checkpoint directory.
    pub model: String,
    /// The weight format both sides ran.
    pub weights: String,
    /// Every prompt's label and token count.
    pub prompts: Vec<(String, usize)>,
    /// Greedy tokens per prompt.
    pub tokens: usize,
    /// What the reference ran.
    pub reference: RunRecord,
}

/// The compressed weights' own error: the reference on them against the reference on the original weights.
#[derive(Debug, Clone, Serialize)]
pub struct QuantizationError {
    /// Teacher-forced logits, the worst prompt.
    pub logits: TensorError,
    /// Teacher-forced agreement (`KL(P_original ‖ P_compressed)`).
    pub distribution: Distribution,
}

/// A compare-devices (or diff) report.
#[derive(Debug, Clone, Serialize)]
pub struct CompareReport {
    /// The command that made it (`compare-devices`, `diff`).
    pub command: String,
    /// The machine.
    pub machine: Machine,
    /// What was compared.
    pub inputs: Inputs,
    /// The compression's own error, when the weights are compressed.
    pub quantization: Option<QuantizationError>,
    /// Every device.
    pub devices: Vec<DeviceReport>,
    /// The memory estimated before work, beside the peak measured (compare-devices).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<crate::memory::MemoryReport>,
}

impl CompareReport {
    /// Whether every device passed.
    pub fn passed(&self) -> bool {
        self.devices.iter().all(DeviceReport::passed)
    }
}

/// The image (video) embeddings' lines of a prompt with images or videos: each tower run's merger error (the
/// images' `vision.merger`, the videos' `video.vision.merger`), and its vision block that moved most.
fn vision_lines(d: &crate::compare::DeviceReport) -> Vec<String> {
    let mut lines = Vec::new();
    for (what, prefix) in [("image", ""), ("video", "video.")] {
        let merger = format!("{prefix}{}", reference::vision::names::MERGER);
        let Some(row) = d.vision.iter().find(|r| r.name == merger) else {
            continue;
        };
        let blocks = format!("{prefix}vision.blocks.");
        let worst = d
            .vision
            .iter()
            .filter(|r| r.name.starts_with(&blocks))
            .max_by(|a, b| a.error.nrmse.get().total_cmp(&b.error.nrmse.get()));
        let graph = d
            .vision_graph
            .as_deref()
            .unwrap_or("the device's vision graph");
        let mut line = format!(
            "{what} embeddings ({merger}, {graph}): NRMSE {:.2e}, max |diff| {:.2e}, cosine {:.6}",
            row.error.nrmse, row.error.max_abs, row.error.cosine
        );
        if let Some(w) = worst {
            line.push_str(&format!(
                "; worst block {} NRMSE {:.2e}",
                w.name, w.error.nrmse
            ));
        }
        lines.push(line);
    }
    lines
}

impl super::Report for CompareReport {
    /// The one-screen summary.
    fn terminal(&self, color: bool) -> String {
        let mut s = String::new();
        let i = &self.inputs;
        let _ = writeln!(
            s,
            "qwen35 {}: {} ({} weights), {} prompt(s), {} greedy tokens each; reference {} ({}){}",
            self.command,
            short_model(&i.model),
            i.weights,
            i.prompts.len(),
            i.tokens,
            i.reference.dtype,
            i.reference.deltanet_prefill,
            arithmetic_note(&i.reference)
        );
        if let Some(q) = &self.quantization {
            let _ = writeln!(
                s,
                "compression alone (reference, {} vs original weights): logits NMSE {:.2e}, same top-1 {:.1}, KL mean {:.2e}",
                i.weights,
                q.logits.nmse,
                q.distribution.same_top1.percent(),
                q.distribution.kl_mean
            );
        }
        let labels: Vec<String> = self
            .devices
            .iter()
            .map(|d| {
                format!(
                    "{} ({})",
                    d.device,
                    d.record
                        .precision
                        .as_ref()
                        .map_or("?".to_string(), |p| p.to_string())
                )
            })
            .collect();
        let w = labels
            .iter()
            .map(|l| l.chars().count())
            .max()
            .unwrap_or(6)
            .max(6);
        let _ = writeln!(
            s,
            "{:<w$} {:>7} {:>8} {:>6} {:>9} {:>9} {:>10} {:>18} {:>9}  verdict",
            "device",
            "greedy",
            "top-1",
            "flips",
            "KL mean",
            "KL p99",
            "logit NMSE",
            "worst layer NRMSE",
            "state"
        );
        for (d, label) in self.devices.iter().zip(&labels) {
            let worst = d
                .layers
                .iter()
                .max_by(|a, b| a.output.nrmse.get().total_cmp(&b.output.nrmse.get()));
            let state = nan_max(d.states.iter().map(|s| s.error.nrmse.get()));
            let verdict = if d.passed() {
                paint("PASS", "32", color)
            } else {
                paint("FAIL", "31", color)
            };
            let _ = writeln!(
                s,
                "{:<w$} {:>7} {:>8.1} {:>6} {:>9.2e} {:>9.2e} {:>10.2e} {:>18} {:>9}  {verdict}",
                label,
                format!("{}/{}", d.greedy_matched, d.greedy_total),
                d.all.same_top1.percent(),
                format!("{}+{}", d.all.confident_flips, d.all.near_tie_flips),
                d.all.kl_mean,
                d.all.kl_p99,
                d.logits.nmse,
                match worst {
                    None => "n/a".into(),
                    Some(l) => format!("{:.2e} (L{})", l.output.nrmse, l.layer),
                },
                if d.states.is_empty() {
                    "n/a".to_string()
                } else {
                    format!("{state:.2e}")
                },
            );
        }
        for d in &self.devices {
            let _ = writeln!(s, "{}: {}", d.device, first_divergence_line(d));
            for line in vision_lines(d) {
                let _ = writeln!(s, "  {line}");
            }
            for line in d.routing.iter().flat_map(routing::terminal_lines) {
                let _ = writeln!(s, "  {line}");
            }
            if let Some(why) = &d.not_available {
                let _ = writeln!(s, "  not compared: {why}");
            }
            for f in &d.failures {
                let _ = writeln!(s, "  {} {f}", paint("✗", "31", color));
            }
            if !d.tensors.is_empty() {
                let mut worst: Vec<&crate::compare::Row> = d.tensors.iter().collect();
                worst.sort_by(|a, b| b.error.nrmse.get().total_cmp(&a.error.nrmse.get()));
                let top: Vec<String> = worst
                    .iter()
                    .take(4)
                    .map(|r| format!("{} {:.2e}", r.name, r.error.nrmse))
                    .collect();
                let _ = writeln!(
                    s,
                    "  {} tensors in common; worst NRMSE: {}",
                    d.tensors.len(),
                    top.join(", ")
                );
            }
            for (side, only) in [
                ("under test", &d.only_in_actual),
                ("reference", &d.only_in_reference),
            ] {
                if !only.is_empty() {
                    let _ = writeln!(
                        s,
                        "  only in the {side} dump ({}): {}",
                        only.len(),
                        only.iter().take(6).cloned().collect::<Vec<_>>().join(", ")
                    );
                }
            }
            if d.tapped_vs_deployed != Measure::Defined(0.0) {
                let _ = writeln!(
                    s,
                    "  note: the graphs with taps moved the logits by up to {:.2e} against the deployed graphs",
                    d.tapped_vs_deployed
                );
            }
        }
        let _ = writeln!(
            s,
            "(greedy: tokens matched before the first divergence, free-running; top-1, flips (confident+near-tie) \
             and KL(P_ref ‖ P_device) teacher-forced on the reference's tokens)"
        );
        s
    }

    /// The Markdown report.
    fn markdown(&self) -> String {
        let mut s = String::new();
        let i = &self.inputs;
        let _ = writeln!(s, "# qwen35 {} report\n", self.command);
        let verdict = if self.passed() {
            "**PASS**"
        } else {
            "**FAIL**"
        };
        let _ = writeln!(
            s,
            "{verdict}: {} device(s) against the reference, {} prompt(s), {} greedy tokens each.\n",
            self.devices.len(),
            i.prompts.len(),
            i.tokens
        );
        let m = &self.machine;
        let _ = writeln!(s, "## Setup\n");
        let _ = writeln!(s, "| | |\n|---|---|");
        let _ = writeln!(s, "| tool | qwen35 {} |", env!("CARGO_PKG_VERSION"));
        let _ = writeln!(
            s,
            "| machine | {}, {} ({} cores{}) |",
            m.os,
            m.cpu,
            m.cores,
            m.memory_bytes.map_or(String::new(), |b| format!(
                ", {:.1} GiB",
                b as f64 / (1u64 << 30) as f64
            ))
        );
        let _ = writeln!(s, "| model | `{}` |", i.model);
        let _ = writeln!(
            s,
            "| weights | {} (the reference runs the same weights, dequantized exactly) |",
            i.weights
        );
        let r = &i.reference;
        let _ = writeln!(
            s,
            "| reference | {} ({}; decode {}; output scale {}){} |",
            r.dtype,
            r.deltanet_prefill,
            r.deltanet_decode,
            r.output_scale,
            arithmetic_note(r)
        );
        let prompts: Vec<String> = i
            .prompts
            .iter()
            .map(|(l, n)| format!("{l} ({n} tokens)"))
            .collect();
        let _ = writeln!(s, "| prompts | {} |", prompts.join(", "));
        if let Some(q) = &self.quantization {
            let _ = writeln!(
                s,
                "| compression alone | logits NMSE {:.2e}, same top-1 {:.1}, KL mean {:.2e} (reference on {} vs original weights) |",
                q.logits.nmse,
                q.distribution.same_top1.percent(),
                q.distribution.kl_mean,
                i.weights
            );
        }
        for d in &self.devices {
            let rec = &d.record;
            let _ = writeln!(
                s,
                "\n## {} — {}\n",
                d.device,
                if d.passed() { "PASS" } else { "FAIL" }
            );
            let _ = writeln!(s, "{}\n", first_divergence_line(d));
            for line in vision_lines(d) {
                let _ = writeln!(s, "{line}\n");
            }
            for f in &d.failures {
                let _ = writeln!(s, "- ✗ {f}");
            }
            if !d.failures.is_empty() {
                s.push('\n');
            }
            let _ = writeln!(s, "| what ran | |\n|---|---|");
            let _ = writeln!(
                s,
                "| OpenVINO | {} |",
                rec.runtime.as_deref().unwrap_or("-")
            );
            if let Some(name) = &rec.device_name {
                let _ = writeln!(s, "| device | {name} |");
            }
            if let Some(driver) = &rec.driver {
                let _ = writeln!(s, "| driver | {driver} |");
            }
            let _ = writeln!(
                s,
                "| precision | {} requested, {} read back |",
                rec.precision_requested
                    .as_ref()
                    .map_or("-".to_string(), |p| p.to_string()),
                rec.precision
                    .as_ref()
                    .map_or("-".to_string(), |p| p.to_string())
            );
            if let Some(e) = &rec.execution_devices {
                let _ = writeln!(s, "| execution devices | {e} |");
            }
            if rec.block.is_some() {
                let _ = writeln!(
                    s,
                    "| graphs | {}; decode {}; block {}; context {}; output scale {} |",
                    rec.deltanet_prefill,
                    rec.deltanet_decode,
                    rec.block.unwrap_or(0),
                    rec.context.unwrap_or(0),
                    rec.output_scale
                );
            } else {
                let _ = writeln!(
                    s,
                    "| graphs | {} ({}; weights {}) |",
                    rec.backend, rec.deltanet_prefill, rec.weights
                );
            }
            for (k, v) in &rec.properties {
                let _ = writeln!(s, "| property `{k}` | {v} |");
            }
            let _ = writeln!(s, "| model cache | {} |", rec.cache_summary());
            let _ = writeln!(
                s,
                "| times | compile {:.2} s; prompt {:.1} tok/s; decode {:.1} tok/s (deployed graphs) |",
                rec.compile_seconds.unwrap_or(0.0),
                d.prompt_tokens_per_s,
                d.decode_tokens_per_s
            );
            if d.record.backend != npu::engine::SET_BACKEND && !d.layers.is_empty() {
                let _ = writeln!(
                    s,
                    "| taps | hidden states from a second set of graphs with every tap as an output; their logits differ from the deployed graphs' by {:.2e} |",
                    d.tapped_vs_deployed
                );
            }
            let _ = writeln!(s, "\n### Tokens and distributions\n");
            let _ = writeln!(
                s,
                "Free-running greedy: {}/{} tokens matched before the first divergence.\n",
                d.greedy_matched, d.greedy_total
            );
            let _ = writeln!(
                s,
                "Teacher-forced on the reference's tokens; KL is KL(P_ref ‖ P_device) in nats; a near tie is a position \
                 where the reference's top-two margin is within twice the device's logit error there.\n"
            );
            let _ = writeln!(
                s,
                "| positions | n | same top-1 | top-5 overlap | KL mean | KL p99 | KL max | Δp mean | flips (confident / near tie) | EOS drift max |"
            );
            let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
            for (name, dist) in [
                ("all", &d.all),
                ("prompt", &d.prompt_positions),
                ("generated", &d.generated_positions),
                ("near ties", &d.near_ties),
                ("confident", &d.confident),
            ] {
                if dist.positions == 0 {
                    let _ = writeln!(s, "| {name} | 0 | | | | | | | | |");
                    continue;
                }
                let _ = writeln!(
                    s,
                    "| {name} | {} | {:.1} | {:.3} | {:.2e} | {:.2e} | {:.2e} | {:+.2e} | {} / {} | {:.2e} |",
                    dist.positions,
                    dist.same_top1.percent(),
                    dist.top5_overlap,
                    dist.kl_mean,
                    dist.kl_p99,
                    dist.kl_max,
                    dist.delta_p_mean,
                    dist.confident_flips,
                    dist.near_tie_flips,
                    dist.eos_drift_max
                );
            }
            let _ = writeln!(
                s,
                "\nLogits: max abs {:.2e}, NMSE {:.2e} ({:.1} dB), cosine {:.8}.",
                d.logits.max_abs,
                d.logits.nmse,
                d.logits.nmse_db(),
                d.logits.cosine
            );
            if d.layers.is_empty() && d.states.is_empty() {
                let _ = writeln!(
                    s,
                    "\n### Layers and states\n\nNot compared: {}. Only tokens and logits are compared.",
                    d.not_available
                        .as_deref()
                        .unwrap_or("neither side has them")
                );
            } else {
                if let Some(why) = &d.not_available {
                    let _ = writeln!(s, "\nNot compared: {why}.");
                }
                hidden_sections(&mut s, d);
            }
            if let Some(r) = &d.routing {
                routing::markdown(&mut s, r);
            }
            let _ = writeln!(s, "\n### Prompts\n");
            let _ = writeln!(
                s,
                "| prompt | tokens | greedy | first divergence (reference margin) |"
            );
            let _ = writeln!(s, "|---|---|---|---|");
            for p in &d.prompts {
                let div = match (p.greedy.first_divergence, p.greedy.ref_margin_at_divergence) {
                    (Some(i), Some(m)) => format!("token {i} ({m:.3})"),
                    _ => "none".into(),
                };
                let _ = writeln!(
                    s,
                    "| {} | {} | {}/{} | {div} |",
                    p.label, p.prompt_tokens, p.greedy.matched, p.greedy.total
                );
            }
            if !d.tensors.is_empty() {
                let _ = writeln!(s, "\n### Every tensor both dumps hold\n");
                let _ = writeln!(s, "| tensor | NRMSE | NMSE | max abs | cosine | NaN/Inf |");
                let _ = writeln!(s, "|---|---|---|---|---|---|");
                for r in &d.tensors {
                    let _ = writeln!(
                        s,
                        "| `{}` | {:.2e} | {:.2e} | {:.2e} | {:.8} | {}/{} |",
                        r.name,
                        r.error.nrmse,
                        r.error.nmse,
                        r.error.max_abs,
                        r.error.cosine,
                        r.error.nan,
                        r.error.inf
                    );
                }
                for (side, only) in [
                    ("under test", &d.only_in_actual),
                    ("reference", &d.only_in_reference),
                ] {
                    if !only.is_empty() {
                        let _ = writeln!(s, "\nOnly in the {side} dump: {}.", only.join(", "));
                    }
                }
            }
            let _ = writeln!(
                s,
                "\nThresholds (for {} as read back; flags override): logits NMSE ≤ {:.1e}, mean KL ≤ {:.1e}, same top-1 ≥ {:.1}%, confident flips ≤ {}, layer NRMSE ≤ {:.1e}, state NRMSE ≤ {:.1e}.",
                rec.precision
                    .as_ref()
                    .map_or("?".to_string(), |p| p.to_string()),
                d.thresholds.max_logits_nmse,
                d.thresholds.max_mean_kl,
                100.0 * d.thresholds.min_top1,
                d.thresholds.max_confident_flips,
                d.thresholds.max_layer_nrmse,
                d.thresholds.max_state_nrmse
            );
        }
        let _ = writeln!(
            s,
            "\nMeasures: NMSE = Σ(a−b)²/Σb² (llama.cpp test-backend-ops); NRMSE = RMSE / max(0.001, range) (OpenVINO \
             NPUW); KL(P_ref ‖ P_device) and same top-1 as llama-perplexity --kl-divergence; b is the reference."
        );
        s
    }

    /// The JSON document (see the module docs).
    fn json(&self) -> Result<serde_json::Value> {
        let mut v = stamped(self, self.passed())?;
        if let Some(devices) = v.get_mut("devices").and_then(|d| d.as_array_mut()) {
            for (d, r) in devices.iter_mut().zip(&self.devices) {
                if let Some(o) = d.as_object_mut() {
                    o.insert("passed".into(), r.passed().into());
                }
            }
        }
        Ok(v)
    }

    fn chart(&self, path: &std::path::Path) -> Result<()> {
        crate::plot::compare_chart(self, path)
    }
}

/// `, --arithmetic llama-cpp` when the reference modelled another runtime's arithmetic.
fn arithmetic_note(r: &RunRecord) -> String {
    r.properties
        .get(crate::device::ARITHMETIC)
        .map_or_else(String::new, |a| format!(", --arithmetic {a}"))
}
