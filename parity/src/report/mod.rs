//! The reports of the comparison commands, for people and for CI: a one-screen terminal table (coloured only on a
//! terminal), `--json` with a schema version, `--report` Markdown to paste into a bug report, `--plot` an SVG chart.
//! [`compare`] renders `compare-devices`, [`probe`] renders `probe`, [`bench`] renders `bench`; the JSON keys are
//! documented there.

pub mod bench;
pub mod compare;
pub mod probe;
mod probe_moe;
pub mod routing;
mod trace;
pub mod validate;

pub use compare::{CompareReport, Inputs, QuantizationError};

use anyhow::{Context, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// The version of the JSON layout; raised whenever a key changes meaning or disappears (2: a layer's `mixer` and
/// `mlp` errors, and a probed layer's `output`, are null where the device exposes none; precisions are strings
/// always; probe layers carry `state_heads`; validate's `inputs` carry the device's `capabilities`).
pub const SCHEMA_VERSION: u32 = 2;

/// A report as JSON, stamped with `schema_version`, `tool` (`qwen35 x.y.z`) and `passed`.
pub fn stamped<T: Serialize>(report: &T, passed: bool) -> Result<serde_json::Value> {
    let mut v = serde_json::to_value(report)?;
    let obj = v.as_object_mut().context("a report is an object")?;
    obj.insert("schema_version".into(), SCHEMA_VERSION.into());
    obj.insert(
        "tool".into(),
        format!("qwen35 {}", env!("CARGO_PKG_VERSION")).into(),
    );
    obj.insert("passed".into(), passed.into());
    Ok(v)
}

/// Where the reports go (`--json`, `--report`, `--plot`), checked before any run with the command's other paths
/// ([`crate::outputs::Paths`]).
#[derive(Debug, Clone, Default)]
pub struct Outputs {
    /// The report as JSON (stable keys, `schema_version`).
    pub json: Option<PathBuf>,
    /// The report as Markdown.
    pub report: Option<PathBuf>,
    /// The SVG chart.
    pub plot: Option<PathBuf>,
}

/// An NRMSE in the tables' notation, `-` where the device exposes none.
pub(crate) fn e2(e: Option<crate::metrics::TensorError>) -> String {
    e.map_or_else(|| "-".into(), |e| format!("{:.2e}", e.nrmse))
}

/// A check's report (compare-devices and diff, validate, probe): one summary for the terminal, one Markdown document,
/// one JSON document and one SVG chart, emitted the same way for every check.
pub trait Report {
    /// The one-screen summary (coloured when `color`).
    fn terminal(&self, color: bool) -> String;
    /// The Markdown document, to paste into a bug report.
    fn markdown(&self) -> String;
    /// The JSON document (stable keys, `schema_version`).
    fn json(&self) -> Result<serde_json::Value>;
    /// Draws the report's chart into `path`.
    fn chart(&self, path: &Path) -> Result<()>;

    /// Prints the terminal summary and writes the files asked for.
    fn emit(&self, outputs: &Outputs) -> Result<()> {
        crate::out!(
            "{}",
            self.terminal(crate::console::Stream::Out.is_terminal())
        );
        if let Some(p) = &outputs.json {
            write(p, &serde_json::to_string_pretty(&self.json()?)?)?;
        }
        if let Some(p) = &outputs.report {
            write(p, &self.markdown())?;
        }
        if let Some(p) = &outputs.plot {
            self.chart(p)?;
        }
        Ok(())
    }
}

/// The machine a report was made on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// `linux x86_64`, …
    pub os: String,
    /// The CPU's model name.
    pub cpu: String,
    /// Logical cores available.
    pub cores: usize,
    /// Physical memory, bytes.
    pub memory_bytes: Option<u64>,
}

impl Machine {
    /// What this machine is.
    pub fn detect() -> Self {
        #[allow(clippy::disallowed_methods)] // the kernel's figures, not an input of the run
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split(':').nth(1))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        #[allow(clippy::disallowed_methods)] // the kernel's figures, not an input of the run
        let memory_bytes = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|l| l.split_whitespace().next())
                    .and_then(|kb| kb.parse::<u64>().ok())
            })
            .map(|kb| kb * 1024);
        Machine {
            os: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
            cpu,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_bytes,
        }
    }
}

/// The last component of a model path.
pub fn short_model(path: &str) -> &str {
    Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or(path)
}
/// ANSI colour when `on`.
pub fn paint(text: &str, code: &str, on: bool) -> String {
    if on {
        format!("\x1b[{code}m{text}\x1b[0m")
    } else {
        text.to_string()
    }
}

/// Writes a report file whole or not at all (see [`crate::outputs::write`]), naming it on failure.
pub fn write(path: &Path, text: &str) -> Result<()> {
    crate::outputs::write(path, text.as_bytes())
}

/// A byte count in decimal units (`5.80 GB`, `12.3 MB`, `1.2 kB`).
pub fn size(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else {
        format!("{:.1} kB", b / 1e3)
    }
}

/// A parameter count (`2.90 B`, `1.2 M`, `640`).
pub fn count(n: u64) -> String {
    let x = n as f64;
    if x >= 1e9 {
        format!("{:.2} B", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.1} M", x / 1e6)
    } else {
        n.to_string()
    }
}
