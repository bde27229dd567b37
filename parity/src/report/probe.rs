//! The `probe` report.
//!
//! # JSON (`schema_version` 2)
//! `schema_version`, `tool`, `passed`, `machine`, `inputs` {`model`, `weights`, `prompt` (label), `prompt_tokens`,
//! `mode` (`isolated` or `chained`), `block`}, `record` (what the device ran, as in compare-devices), `thresholds`
//! {`max_nrmse`, `max_state_nrmse`}, `layers`: one object per probed layer with `layer`, `kind`, `output`, `mixer`,
//! `mlp` (tensor errors: `max_abs`, `nmse`, `nrmse`, `rel_l2`, `cosine`, `nan`, `inf`, `count`), `states`
//! ([{`name`, `error`}] after the prompt), `block_ends` and `state_drift` (the recurrent state's, or the key
//! cache's, NRMSE after each block), `intermediates` ([{`name`, `error`}] in computation order), `magnitudes`
//! ([{`name`, `reference`, `device`}], per head {`rms`, `max_abs`, `below_f16_normal`}), `over`; and `drill_down`
//! (null, or {`layer`, `first_over`, `intermediates`} for the first layer over threshold).
//!
//! An MoE model adds, per layer, `routing` (its row of the routing report: `same_set`, `set_agreement`, the flips by
//! class, …, as compare-devices' `devices[].routing.layers[]`), `fed_routing` (null, or the block fed the
//! reference's routing: `mlp` on the reference's input, `shared` its shared expert's output, `mlp_own_input` on the
//! device's own input (tensor errors), and at the flipped tokens `mlp_nrmse_flipped` and `own_input_nrmse_flipped`)
//! and `blame` (`neither`, `experts`, `input`, `routing`, or null); and at the top `routing` (the routing report of
//! the probed layers, keys as compare-devices') and `fed_routing_note` (why the blocks were not fed the reference's
//! routing, or null). A confident routing flip fails the probe.

use super::{Machine, e2, paint, routing as routing_report, short_model, stamped};
use crate::metrics::nan_max;
use crate::plot::{Panel, Series, draw};
use crate::probe::moe::Blame;
use crate::probe::{DrillDown, LayerProbe, Mode, ProbeThresholds};
use crate::routing::RoutingReport;
use anyhow::Result;
use reference::backend::RunRecord;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

/// What was probed.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeInputs {
    /// The checkpoint directory.
    pub model: String,
    /// The weight format both sides ran.
    pub weights: String,
    /// The prompt's label.
    pub prompt: String,
    /// Its tokens.
    pub prompt_tokens: usize,
    /// Isolated or chained.
    pub mode: Mode,
    /// Tokens per block.
    pub block: usize,
    /// The device under test, as reports name it.
    pub device: String,
    /// What the layers were probed through: per-layer graphs, or a decoder's states and hidden outputs.
    pub via: String,
}

/// The baseline device the thresholds came from.
#[derive(Debug, Clone, Serialize)]
pub struct Baseline {
    /// The baseline (FP16SIM and its options).
    pub device: String,
    /// How many times its error a layer may show.
    pub factor: f64,
    /// Per layer: the baseline's worst output NRMSE and worst state NRMSE.
    pub layers: Vec<(usize, f64, f64)>,
}

/// A probe report.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeReport {
    /// The machine.
    pub machine: Machine,
    /// What was probed.
    pub inputs: ProbeInputs,
    /// What the device ran.
    pub record: RunRecord,
    /// The thresholds applied (without a baseline; with one, each layer states its own).
    pub thresholds: ProbeThresholds,
    /// The baseline device per-layer thresholds came from.
    pub baseline: Option<Baseline>,
    /// Every probed layer.
    pub layers: Vec<LayerProbe>,
    /// With images: every vision block on the device (its own graph), isolated and chained.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub vision: Vec<crate::probe::vision::VisionBlockProbe>,
    /// Where the error starts in the first layer over threshold.
    pub drill_down: Option<DrillDown>,
    /// The memory estimated before work, beside the peak measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<crate::memory::MemoryReport>,
    /// An MoE model's routing over the probed layers against the reference's.
    pub routing: Option<RoutingReport>,
    /// Why an MoE model's blocks were not fed the reference's routing (null: they were, or a dense model).
    pub fed_routing_note: Option<String>,
}

impl ProbeReport {
    /// The MoE part, as [`super::probe_moe`] renders it.
    fn moe_parts(&self) -> super::probe_moe::MoeParts<'_> {
        super::probe_moe::MoeParts {
            layers: &self.layers,
            routing: self.routing.as_ref(),
            fed_routing_note: self.fed_routing_note.as_deref(),
        }
    }

    /// Whether every layer held and no routing flip was confident.
    pub fn passed(&self) -> bool {
        self.layers.iter().all(|l| !l.over)
            && self.vision.iter().all(|v| !v.over)
            && self.routing_failure().is_none()
    }

    /// A confident routing flip fails the probe, as it fails compare-devices: the sentence, or `None`.
    pub fn routing_failure(&self) -> Option<String> {
        let r = self.routing.as_ref()?;
        let first = r.first_confident.as_ref()?;
        Some(format!(
            "{} confident routing flip(s), the first at layer {} token {}: the device chose experts its router error \
             cannot explain",
            r.confident_flips, first.layer, first.token
        ))
    }

    fn title(&self) -> String {
        let i = &self.inputs;
        format!(
            "qwen35 probe: {} on {} ({} read back), {} mode through {}, prompt `{}` ({} tokens) in blocks of {}, {} \
             weights",
            short_model(&i.model),
            i.device,
            self.record.precision_text(),
            i.mode.name(),
            i.via,
            i.prompt,
            i.prompt_tokens,
            i.block,
            i.weights
        )
    }

    fn verdict_line(&self) -> String {
        let t = &self.thresholds;
        let within = match &self.baseline {
            Some(b) => format!(
                "within {}× {}'s error on each layer (at least the f32 thresholds)",
                b.factor, b.device
            ),
            None => format!(
                "within NRMSE {:.1e} (states {:.1e})",
                t.max_nrmse, t.max_state_nrmse
            ),
        };
        let vision_over: Vec<String> = self
            .vision
            .iter()
            .filter(|v| v.over)
            .map(|v| v.block.to_string())
            .collect();
        if !vision_over.is_empty() {
            return format!(
                "vision blocks over threshold (isolated, {within}): {}",
                vision_over.join(", ")
            );
        }
        let mut routing = self
            .routing
            .as_ref()
            .and_then(routing_report::first_flip_clause)
            .map_or(String::new(), |c| format!("; {c}"));
        if let Some(f) = self.routing_failure() {
            routing.push_str(&format!("; {f}"));
        }
        match &self.drill_down {
            None => format!("every layer {within}{routing}"),
            Some(d) => {
                let over: Vec<String> = self
                    .layers
                    .iter()
                    .filter(|l| l.over)
                    .map(|l| l.layer.to_string())
                    .collect();
                let fed_over = self
                    .layers
                    .iter()
                    .find(|l| l.layer == d.layer)
                    .is_some_and(|l| l.blame == Some(Blame::Experts));
                let starts = match d.first_over.as_deref() {
                    Some(op) => op.to_string(),
                    None if fed_over => {
                        "its MoE block (over threshold fed the reference's routing)".into()
                    }
                    None => "the states (every intermediate holds)".into(),
                };
                format!(
                    "layers over threshold ({within}): {}; in layer {} the error starts at {starts}{routing}",
                    over.join(", "),
                    d.layer,
                )
            }
        }
    }

    /// The chart: output, mixer and MLP NRMSE per layer; the state drift along the positions.
    pub fn chart(&self, path: &Path) -> Result<()> {
        let per_layer = |name: &str, f: &dyn Fn(&LayerProbe) -> Option<f64>| Series {
            name: name.into(),
            points: self
                .layers
                .iter()
                .filter_map(|l| Some((l.layer as f64, f(l)?)))
                .collect(),
        };
        let panels = [
            Panel {
                title: format!(
                    "{} ({}): error per layer",
                    self.record.device.as_deref().unwrap_or("?"),
                    self.inputs.mode.name()
                ),
                x_label: "layer".into(),
                y_label: "NRMSE".into(),
                series: vec![
                    per_layer("output", &|l| l.output.map(|e| e.nrmse.get())),
                    per_layer("mixer", &|l| l.mixer.map(|e| e.nrmse.get())),
                    per_layer("MLP", &|l| l.mlp.map(|e| e.nrmse.get())),
                    per_layer("MLP fed the reference's routing", &|l| {
                        l.fed_routing.as_ref().map(|f| f.mlp.nrmse.get())
                    }),
                ],
                threshold: Some(self.thresholds.max_nrmse),
                marker: None,
            },
            Panel {
                title: "State drift after each block".into(),
                x_label: "position".into(),
                y_label: "state NRMSE".into(),
                series: self
                    .layers
                    .iter()
                    .map(|l| Series {
                        name: format!("layer {}", l.layer),
                        points: l
                            .block_ends
                            .iter()
                            .zip(&l.state_drift)
                            .map(|(&p, &e)| (p as f64, e))
                            .collect(),
                    })
                    .collect(),
                threshold: Some(self.thresholds.max_state_nrmse),
                marker: None,
            },
        ];
        draw(path, &panels)
    }
}

impl super::Report for ProbeReport {
    /// The one-screen summary.
    fn terminal(&self, color: bool) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{}", self.title());
        let _ = writeln!(
            s,
            "{:>5} {:<6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>10}",
            "layer",
            "kind",
            "output",
            "mixer",
            "MLP",
            "state",
            "max drift",
            "min head RMS",
            "<f16 min"
        );
        for l in &self.layers {
            let state = nan_max(l.states.iter().map(|n| n.error.nrmse.get()));
            let drift = nan_max(l.state_drift.iter().copied());
            let (rms, small) = l.magnitudes.first().map_or(("-".into(), "-".into()), |m| {
                (
                    format!(
                        "{:.2e}",
                        m.device.iter().map(|h| h.rms).fold(f64::INFINITY, f64::min)
                    ),
                    format!(
                        "{:.1}%",
                        100.0
                            * m.device
                                .iter()
                                .map(|h| h.below_f16_normal)
                                .fold(0.0, f64::max)
                    ),
                )
            });
            let mark = if l.over {
                paint("✗", "31", color)
            } else {
                paint("✓", "32", color)
            };
            let nan = l.output.map_or(0, |o| o.nan + o.inf);
            let _ = writeln!(
                s,
                "{:>5} {:<6} {:>10} {:>10} {:>10} {:>10.2e} {:>10.2e} {:>12} {:>10} {:>9.1e} {mark}{}",
                l.layer,
                if l.kind == "linear_attention" {
                    "delta"
                } else {
                    "attn"
                },
                e2(l.output),
                e2(l.mixer),
                e2(l.mlp),
                state,
                drift,
                rms,
                small,
                l.thresholds.max_nrmse,
                if nan > 0 {
                    format!(" {nan} NaN/Inf")
                } else {
                    String::new()
                }
            );
        }
        if !self.vision.is_empty() {
            let _ = writeln!(
                s,
                "{:>12} {:>10} {:>10} {:>10}   (the vision tower: each block's own graph)",
                "vision block", "isolated", "chained", "max |diff|"
            );
            for v in &self.vision {
                let mark = if v.over {
                    paint("✗", "31", color)
                } else {
                    paint("✓", "32", color)
                };
                let _ = writeln!(
                    s,
                    "{:>12} {:>10.2e} {:>10.2e} {:>10.2e} {mark}",
                    v.block, v.isolated.nrmse, v.chained.nrmse, v.isolated.max_abs
                );
            }
        }
        for line in super::probe_moe::terminal_lines(&self.moe_parts()) {
            let _ = writeln!(s, "{line}");
        }
        let _ = writeln!(s, "{}", self.verdict_line());
        let _ = writeln!(
            s,
            "(NRMSE as OpenVINO NPUW; state: after the prompt, max drift: after any block; head RMS and the share \
             below fp16's smallest normal: the device's DeltaNet core output or attention scores)"
        );
        s
    }

    /// The Markdown report.
    fn markdown(&self) -> String {
        let mut s = String::new();
        let r = &self.record;
        let _ = writeln!(s, "# qwen35 probe report\n");
        let _ = writeln!(
            s,
            "**{}**: {}\n",
            if self.passed() { "PASS" } else { "FAIL" },
            self.verdict_line()
        );
        let m = &self.machine;
        let _ = writeln!(s, "| | |\n|---|---|");
        let _ = writeln!(s, "| setup | {} |", self.title());
        let _ = writeln!(s, "| machine | {}, {} ({} cores) |", m.os, m.cpu, m.cores);
        let _ = writeln!(s, "| OpenVINO | {} |", r.runtime.as_deref().unwrap_or("-"));
        let _ = writeln!(
            s,
            "| precision | {} requested, {} read back |",
            r.precision_requested
                .as_ref()
                .map_or("-".to_string(), |p| p.to_string()),
            r.precision
                .as_ref()
                .map_or("-".to_string(), |p| p.to_string())
        );
        let _ = writeln!(
            s,
            "| graphs | {}; output scale {}; context {} |",
            r.deltanet_prefill,
            r.output_scale,
            r.context.unwrap_or(0)
        );
        for (k, v) in &r.properties {
            let _ = writeln!(s, "| property `{k}` | {v} |");
        }
        let _ = writeln!(s, "| model cache | {} |", r.cache_summary());
        let _ = writeln!(s, "\n## Layers\n");
        let _ = writeln!(
            s,
            "| layer | kind | output NRMSE | cosine | mixer NRMSE | MLP NRMSE | states (NRMSE) | max drift | NaN/Inf |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
        for l in &self.layers {
            let states: Vec<String> = l
                .states
                .iter()
                .map(|n| {
                    format!(
                        "{} {:.2e}",
                        n.name.rsplit('.').next().unwrap_or(&n.name),
                        n.error.nrmse
                    )
                })
                .collect();
            let _ = writeln!(
                s,
                "| {}{} | {} | {} | {} | {} | {} | {} | {:.2e} | {} |",
                l.layer,
                if l.over { " ✗" } else { "" },
                l.kind,
                e2(l.output),
                l.output.map_or("-".into(), |o| format!("{:.8}", o.cosine)),
                e2(l.mixer),
                e2(l.mlp),
                states.join(", "),
                nan_max(l.state_drift.iter().copied()),
                l.output.map_or(0, |o| o.nan + o.inf)
            );
        }
        super::probe_moe::markdown(&mut s, &self.moe_parts());
        let _ = writeln!(s, "\n## State error per head\n");
        let _ = writeln!(
            s,
            "Per head, the NRMSE of the layer's main state after the prompt (the DeltaNet recurrent state per value \
             head, the key cache per KV head): which head drifts.\n"
        );
        for l in &self.layers {
            if l.state_heads.is_empty() {
                continue;
            }
            let heads: Vec<String> = l
                .state_heads
                .iter()
                .map(|h| format!("h{} {:.2e}", h.head, h.nrmse))
                .collect();
            let _ = writeln!(s, "- layer {}: {}", l.layer, heads.join(", "));
        }
        let _ = writeln!(s, "\n## Magnitudes per head (device / reference)\n");
        let _ = writeln!(
            s,
            "The RMS of each head, and the share of its values below fp16's smallest normal (6.1e-5), where an fp16 \
             device that flushes subnormals loses them.\n"
        );
        for l in &self.layers {
            for mag in &l.magnitudes {
                let heads: Vec<String> = mag
                    .device
                    .iter()
                    .zip(&mag.reference)
                    .map(|(d, r)| {
                        format!(
                            "{:.1e}/{:.1e} ({:.0}%)",
                            d.rms,
                            r.rms,
                            100.0 * d.below_f16_normal
                        )
                    })
                    .collect();
                let _ = writeln!(
                    s,
                    "- layer {} `{}`: {}",
                    l.layer,
                    mag.name,
                    heads.join(", ")
                );
            }
        }
        let _ = writeln!(s, "\n## State drift (NRMSE after each block)\n");
        for l in &self.layers {
            let drift: Vec<String> = l
                .block_ends
                .iter()
                .zip(&l.state_drift)
                .map(|(p, e)| format!("{p}: {e:.1e}"))
                .collect();
            let _ = writeln!(s, "- layer {}: {}", l.layer, drift.join(", "));
        }
        if let Some(d) = &self.drill_down {
            let _ = writeln!(
                s,
                "\n## Drill-down: layer {} (intermediates in the order the layer computes them)\n",
                d.layer
            );
            let _ = writeln!(s, "| intermediate | NRMSE | NMSE | max abs | cosine |");
            let _ = writeln!(s, "|---|---|---|---|---|");
            for n in &d.intermediates {
                let mark = if d.first_over.as_deref() == Some(n.name.as_str()) {
                    " ← starts here"
                } else {
                    ""
                };
                let _ = writeln!(
                    s,
                    "| `{}`{mark} | {:.2e} | {:.2e} | {:.2e} | {:.8} |",
                    n.name, n.error.nrmse, n.error.nmse, n.error.max_abs, n.error.cosine
                );
            }
        }
        let t = &self.thresholds;
        let _ = writeln!(
            s,
            "\nThresholds (for {} as read back; flags override): NRMSE ≤ {:.1e} for outputs and intermediates, ≤ {:.1e} \
             for states. NRMSE = RMSE / max(0.001, range) as OpenVINO NPUW computes it.",
            r.precision
                .as_ref()
                .map_or("?".to_string(), |p| p.to_string()),
            t.max_nrmse,
            t.max_state_nrmse
        );
        s
    }

    /// The JSON document (see the module docs).
    fn json(&self) -> Result<serde_json::Value> {
        stamped(self, self.passed())
    }

    fn chart(&self, path: &std::path::Path) -> Result<()> {
        ProbeReport::chart(self, path)
    }
}
