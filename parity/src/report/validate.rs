//! The `validate` report: one verdict per check, the device section, and the compare-devices and probe reports the
//! checks made.
//!
//! # JSON (`schema_version` 2)
//! `schema_version`, `tool`, `passed` (every check that ran passed), `seconds` (the whole run, wall-clock),
//! `machine`, `inputs` {`model`, `weights`, `device`, `ir` (the external IR directory of `--ir`, else null),
//! `ir_reference_weights` (its manifest's `reference_weights`), `warnings`, `prompts` ([label, tokens] pairs),
//! `tokens`, `block`, `context` (null for an IR without a static context), `blocks` (with `--ir`: the pieces the
//! prompt is fed in), `lookup_tokens`, `lookup_max_ngram`, `lookup_max_draft`, `max_length`, `probe_mode` (null
//! where the check does not apply), `fault`},
//! `thresholds` (as compare-devices', for the precision read back), `device` {`device`, `runtime`, `device_name`,
//! `driver`, `available`, `precision_requested`, `precision`, `allowed_precisions`, `properties`, `graphs`
//! ([{`purpose`, `graph`, `precision`, `execution_devices`, `compile_seconds`, `loaded_from_cache`}]),
//! `cache_dir`}, `checks`: one object per check in a fixed order with `id` (`execution-devices`, `precision`,
//! `compare`, `probe`, `blocks`, `padding`, `prefix-reuse`, `prompt-lookup`, `back-to-back`, `length`,
//! `over-long`), `title`, `passed` (true, false, or null when the check did not apply: a skipped check neither
//! passes nor fails), `skipped` (null, or why it did not apply), `figure`, `failures`, `notes`,
//! `next`, `seconds` and `details` (the check's measures: token agreements {`label`, `tokens`, `matched`,
//! `first_divergence`, `logits` (a tensor error)}, state differences {`worst`, `nrmse`, `max_abs`, `finite`},
//! prompt lookup's `proposed`, `accepted`, `acceptance`, `speedup` and per prompt its calls and seconds, the length
//! check's `points` [{`length`, `bisection`, `passed`, `logits`, `flips`, `confident_flips`, `state` (null when
//! the backend does not expose its state)}],
//! `first_failing` and `bisection_between`; null for `compare` and `probe`, whose whole reports follow); `compare`
//! (the compare-devices report, as its own JSON documents it, or null when the check could not run) and `probe`
//! (the probe report, or null).

use super::probe::ProbeReport;
use super::{CompareReport, Machine, paint, short_model, stamped};
use crate::compare::Thresholds;
use crate::validate::setup::DeviceSection;
use crate::validate::{Check, CheckId};
use anyhow::Result;
use serde::Serialize;
use std::fmt::Write as _;

/// What was validated, and how.
#[derive(Debug, Clone, Serialize)]
pub struct ValidateInputs {
    /// The checkpoint directory.
    pub model: String,
    /// The weight format both sides ran.
    pub weights: String,
    /// The device.
    pub device: String,
    /// The external IR directory validated instead of this project's graphs (`--ir`), if any.
    pub ir: Option<String>,
    /// What the IR's manifest says the reference must run (`reference_weights`), if it says.
    pub ir_reference_weights: Option<String>,
    /// Warnings of the run (`--weights` other than the IR's manifest says).
    pub warnings: Vec<String>,
    /// What the device exposes (which checks can run on it).
    pub capabilities: crate::device::Capabilities,
    /// Every prompt's label and token count.
    pub prompts: Vec<(String, usize)>,
    /// Greedy tokens per prompt.
    pub tokens: usize,
    /// The deployed prompt block (none for an external IR, which takes any number of tokens per call).
    pub block: Option<usize>,
    /// The static context (none for an external IR that declares none).
    pub context: Option<usize>,
    /// The block sizes compared (with an external IR: the pieces the prompt is fed in, each against one call).
    pub blocks: Vec<usize>,
    /// Tokens per prompt-lookup run (none where the check does not apply).
    pub lookup_tokens: Option<usize>,
    /// The longest n-gram looked up.
    pub lookup_max_ngram: Option<usize>,
    /// The most draft tokens per verify call.
    pub lookup_max_draft: Option<usize>,
    /// The longest prompt of the length check.
    pub max_length: usize,
    /// The probe's mode (none where the probe does not apply).
    pub probe_mode: Option<String>,
    /// An injected fault (tests only).
    pub fault: Option<String>,
}

/// A validate report.
#[derive(Debug, Clone, Serialize)]
pub struct ValidateReport {
    /// The machine.
    pub machine: Machine,
    /// What was validated.
    pub inputs: ValidateInputs,
    /// The thresholds against the reference.
    pub thresholds: Thresholds,
    /// What ran where.
    pub device: DeviceSection,
    /// Every check.
    pub checks: Vec<Check>,
    /// Wall-clock seconds of the whole run.
    pub seconds: f64,
    /// The compare check's report.
    pub compare: Option<CompareReport>,
    /// The probe check's report.
    pub probe: Option<ProbeReport>,
    /// The memory estimated before work, beside the peak measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<crate::memory::MemoryReport>,
}

impl ValidateReport {
    /// Whether every check that ran passed (a skipped check neither passes nor fails).
    pub fn passed(&self) -> bool {
        !self.checks.iter().any(Check::failed)
    }

    /// The check `id`.
    pub fn check(&self, id: CheckId) -> Option<&Check> {
        self.checks.iter().find(|c| c.id == id)
    }

    fn title(&self) -> String {
        let i = &self.inputs;
        let d = &self.device;
        let what = match &i.ir {
            Some(ir) => format!(
                "IR {} (manifest: {} weights) against {} ({} weights)",
                short_model(ir),
                i.ir_reference_weights.as_deref().unwrap_or("unstated"),
                short_model(&i.model),
                i.weights
            ),
            None => format!("{} ({} weights)", short_model(&i.model), i.weights),
        };
        format!(
            "qwen35 validate: {what} on {} ({} asked, {} read back), {}, {} prompt(s) × {} tokens",
            i.device,
            d.precision_requested,
            d.precision
                .as_ref()
                .map_or("?".to_string(), |p| p.to_string()),
            graph_shape(i),
            i.prompts.len(),
            i.tokens
        ) + &i
            .fault
            .as_ref()
            .map_or(String::new(), |f| format!("; injected fault {f}"))
    }

    fn verdict_line(&self) -> String {
        let failed = self.checks.iter().filter(|c| c.failed()).count();
        let skipped = self.checks.iter().filter(|c| c.passed.is_none()).count();
        let ran = self.checks.len() - skipped;
        let skipped_text = match skipped {
            0 => String::new(),
            n => format!("; {n} skipped, neither passed nor failed"),
        };
        match (failed, skipped) {
            (0, 0) => format!(
                "every check passed ({} checks, {:.1} s)",
                self.checks.len(),
                self.seconds
            ),
            (0, _) => format!(
                "every check that ran passed ({ran} of {} checks ran{skipped_text}; {:.1} s)",
                self.checks.len(),
                self.seconds
            ),
            _ => format!(
                "{failed} of {ran} checks that ran failed ({} checks{skipped_text}; {:.1} s)",
                self.checks.len(),
                self.seconds
            ),
        }
    }

    fn device_lines(&self) -> Vec<String> {
        let d = &self.device;
        let mut lines = vec![format!(
            "device: {}{}; {}; driver {}",
            d.device,
            d.device_name
                .as_ref()
                .map_or(String::new(), |n| format!(" ({n})")),
            d.runtime.as_deref().unwrap_or("runtime not reported"),
            d.driver.as_deref().unwrap_or("not reported")
        )];
        let mut precisions: Vec<&str> = d.graphs.iter().map(|g| g.precision.as_str()).collect();
        precisions.dedup();
        let mut execution: Vec<&str> = d
            .graphs
            .iter()
            .map(|g| g.execution_devices.as_deref().unwrap_or("not reported"))
            .collect();
        execution.sort_unstable();
        execution.dedup();
        lines.push(format!(
            "precision: {} asked, {} read back on {} graph(s); execution devices: {}",
            d.precision_requested,
            precisions.join("/"),
            d.graphs.len(),
            execution.join(" / ")
        ));
        lines
    }

    fn device_markdown(&self, s: &mut String) {
        let d = &self.device;
        let _ = writeln!(s, "\n## Device\n");
        let _ = writeln!(s, "| | |\n|---|---|");
        let _ = writeln!(
            s,
            "| device | {} ({}) |",
            d.device,
            d.device_name.as_deref().unwrap_or("-")
        );
        let _ = writeln!(s, "| runtime | {} |", d.runtime.as_deref().unwrap_or("-"));
        let _ = writeln!(
            s,
            "| driver | {} |",
            d.driver.as_deref().unwrap_or("not reported")
        );
        let _ = writeln!(
            s,
            "| devices present | {} |",
            if d.available.is_empty() {
                "-".into()
            } else {
                d.available.join(", ")
            }
        );
        let _ = writeln!(
            s,
            "| precision | {} asked, {} read back{} |",
            d.precision_requested,
            d.precision
                .as_ref()
                .map_or("-".to_string(), |p| p.to_string()),
            if d.allowed_precisions.is_empty() {
                String::new()
            } else {
                format!("; allowed instead: {}", d.allowed_precisions.join(", "))
            }
        );
        for (k, v) in &d.properties {
            let _ = writeln!(s, "| property `{k}` | {v} |");
        }
        let _ = writeln!(
            s,
            "| model cache | {} |",
            d.cache_dir
                .as_deref()
                .unwrap_or("not used (graphs compiled on every run)")
        );
        let _ = writeln!(
            s,
            "\n| graph | compiled for | precision | execution devices | compile s | from cache |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|");
        for g in &d.graphs {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {:.2} | {} |",
                g.graph,
                g.purpose,
                g.precision,
                g.execution_devices.as_deref().unwrap_or("not reported"),
                g.compile_seconds,
                g.loaded_from_cache
                    .map_or("-", |c| if c { "yes" } else { "no" })
            );
        }
    }
}

/// The graphs' shape in a few words: the block and context of this project's graphs, or an IR's context.
fn graph_shape(i: &ValidateInputs) -> String {
    match (i.block, i.context) {
        (Some(b), Some(c)) => format!("block {b}, context {c}"),
        (Some(b), None) => format!("block {b}"),
        (None, Some(c)) => format!(
            "any tokens per call, context {c} ({})",
            i.capabilities.context_source
        ),
        (None, None) => "any tokens per call, no static context".into(),
    }
}

/// Text for a Markdown table cell (a `|` would end the cell).
fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}

/// A Markdown document's headings two levels deeper (to sit under a second-level heading of the report that
/// includes it).
fn demote(markdown: &str) -> String {
    let mut out = String::with_capacity(markdown.len() + 64);
    for line in markdown.lines() {
        if line.starts_with('#') {
            out.push_str("##");
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

impl super::Report for ValidateReport {
    /// The one-screen summary: the table of checks, the failures with where to look next, the device.
    fn terminal(&self, color: bool) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{}", self.title());
        let w = self
            .checks
            .iter()
            .map(|c| c.id.name().len())
            .max()
            .unwrap_or(5);
        let _ = writeln!(s, "{:<w$}  {:<7}  figure", "check", "verdict");
        for c in &self.checks {
            let verdict = match c.passed {
                None => paint("SKIP", "33", color),
                Some(true) => paint("PASS", "32", color),
                Some(false) => paint("FAIL", "31", color),
            };
            // The verdict is 4 characters; pad after the colour codes.
            let _ = writeln!(s, "{:<w$}  {verdict}     {}", c.id.name(), c.figure);
            // At most three reasons per check on the terminal; the Markdown and JSON have every one.
            for f in c.failures.iter().take(3) {
                let _ = writeln!(s, "{:<w$}    {} {f}", "", paint("✗", "31", color));
            }
            if c.failures.len() > 3 {
                let _ = writeln!(
                    s,
                    "{:<w$}    … and {} more (--report, --json)",
                    "",
                    c.failures.len() - 3
                );
            }
            if c.failed() {
                let _ = writeln!(s, "{:<w$}    next: {}", "", c.next);
            }
        }
        for line in self.device_lines() {
            let _ = writeln!(s, "{line}");
        }
        let _ = writeln!(
            s,
            "{}: {}",
            if self.passed() {
                paint("PASS", "32", color)
            } else {
                paint("FAIL", "31", color)
            },
            self.verdict_line()
        );
        s
    }

    /// The Markdown report.
    fn markdown(&self) -> String {
        let mut s = String::new();
        let i = &self.inputs;
        let _ = writeln!(s, "# qwen35 validate report\n");
        let _ = writeln!(
            s,
            "**{}** on {}: {}.\n",
            if self.passed() { "PASS" } else { "FAIL" },
            i.device,
            self.verdict_line()
        );
        let m = &self.machine;
        let _ = writeln!(s, "| | |\n|---|---|");
        let _ = writeln!(s, "| tool | qwen35 {} |", env!("CARGO_PKG_VERSION"));
        let _ = writeln!(s, "| machine | {}, {} ({} cores) |", m.os, m.cpu, m.cores);
        if let Some(ir) = &i.ir {
            let c = &i.capabilities;
            let exposes: Vec<&str> = [
                (c.states, "states"),
                (c.hidden, "hidden outputs"),
                (c.token_valid, "token_valid"),
                (c.layer_graphs, "per-layer graphs"),
            ]
            .iter()
            .filter_map(|(has, what)| has.then_some(*what))
            .collect();
            let _ = writeln!(
                s,
                "| graphs | `{ir}`: {} made elsewhere; exposes {}; its manifest's reference weights: {} |",
                c.kind,
                if exposes.is_empty() {
                    "tokens and logits only".to_string()
                } else {
                    exposes.join(", ")
                },
                i.ir_reference_weights.as_deref().unwrap_or("not stated")
            );
        }
        let _ = writeln!(
            s,
            "| model | `{}` ({} weights) |",
            short_model(&i.model),
            i.weights
        );
        for w in &i.warnings {
            let _ = writeln!(s, "| **warning** | {} |", cell(w));
        }
        let prompts: Vec<String> = i
            .prompts
            .iter()
            .map(|(l, n)| format!("{l} ({n})"))
            .collect();
        let _ = writeln!(
            s,
            "| prompts | {}; {} greedy tokens each |",
            prompts.join(", "),
            i.tokens
        );
        let mut graphs = vec![graph_shape(i)];
        graphs.push(match i.ir {
            Some(_) => format!("the prompt in one call vs pieces of {:?}", i.blocks),
            None => format!("blocks compared {:?}", i.blocks),
        });
        if let (Some(t), Some(n), Some(d)) =
            (i.lookup_tokens, i.lookup_max_ngram, i.lookup_max_draft)
        {
            graphs.push(format!(
                "prompt lookup {t} tokens, n-grams ≤ {n}, drafts ≤ {d}"
            ));
        }
        graphs.push(format!("lengths ≤ {}", i.max_length));
        if let Some(m) = &i.probe_mode {
            graphs.push(format!("probe {m}"));
        }
        let _ = writeln!(s, "| graphs | {} |", graphs.join("; "));
        let t = &self.thresholds;
        let _ = writeln!(
            s,
            "| thresholds | logits NMSE ≤ {:.1e}, mean KL ≤ {:.1e}, same top-1 ≥ {:.0}%, layer NRMSE ≤ {:.1e}, state \
             NRMSE ≤ {:.1e} |",
            t.max_logits_nmse,
            t.max_mean_kl,
            100.0 * t.min_top1,
            t.max_layer_nrmse,
            t.max_state_nrmse
        );
        if let Some(f) = &i.fault {
            let _ = writeln!(
                s,
                "| injected fault | {f} (a test of the checks themselves) |"
            );
        }
        let _ = writeln!(s, "\n## Checks\n");
        let _ = writeln!(s, "| check | verdict | key figure | on failure, look at |");
        let _ = writeln!(s, "|---|---|---|---|");
        for c in &self.checks {
            let verdict = if c.failed() { "**FAIL**" } else { c.verdict() };
            let _ = writeln!(
                s,
                "| {} | {verdict} | {} | {} |",
                c.id.name(),
                cell(&c.figure),
                if c.failed() { c.next } else { "" }
            );
        }
        if self.checks.iter().any(|c| c.passed.is_none()) {
            let _ = writeln!(
                s,
                "\nA skipped check (SKIP) did not apply here, for the reason its section gives: it neither passed nor \
                 failed, and the verdict is over the checks that ran."
            );
        }
        self.device_markdown(&mut s);
        let _ = writeln!(s, "\n## What each check found\n");
        for c in &self.checks {
            let _ = writeln!(s, "### {} — {}\n", c.id.name(), c.verdict());
            let _ = writeln!(s, "{} ({:.2} s): {}.\n", c.title, c.seconds, c.figure);
            if let Some(why) = &c.skipped {
                let _ = writeln!(s, "Not applicable: {why}.\n");
            }
            for f in &c.failures {
                let _ = writeln!(s, "- ✗ {f}");
            }
            for n in &c.notes {
                let _ = writeln!(s, "- {n}");
            }
            if !c.failures.is_empty() || !c.notes.is_empty() {
                s.push('\n');
            }
            if c.failed() {
                let _ = writeln!(s, "Next: {}.\n", c.next);
            }
        }
        if let Some(c) = &self.compare {
            let _ = writeln!(s, "## Appendix: the compare-devices report\n");
            s.push_str(&demote(&c.markdown()));
        }
        if let Some(p) = &self.probe {
            let _ = writeln!(s, "\n## Appendix: the probe report\n");
            s.push_str(&demote(&p.markdown()));
        }
        s
    }

    /// The JSON document (see the module docs).
    fn json(&self) -> Result<serde_json::Value> {
        let mut v = stamped(self, self.passed())?;
        if let (Some(c), Some(obj)) = (&self.compare, v.as_object_mut()) {
            obj.insert("compare".into(), c.json()?);
        }
        Ok(v)
    }

    fn chart(&self, path: &std::path::Path) -> Result<()> {
        match &self.compare {
            Some(c) => crate::plot::compare_chart(c, path),
            None => anyhow::bail!("--plot {}: the compare check did not run", path.display()),
        }
    }
}
