//! The options of the checking commands: the thresholds a check is judged by, where the reports go, and how the
//! probe feeds the layers.

use crate::compare::ThresholdOverrides;
use crate::probe::Mode;
use crate::report::Outputs;
use crate::thresholds;
use anyhow::Result;
use clap::ValueEnum;
use std::path::PathBuf;

/// Thresholds: each overrides the default for the precision that ran ([`crate::thresholds`]).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ThresholdArgs {
    /// Largest NMSE of the teacher-forced logits (default: [`thresholds`]).
    #[arg(long, value_name = "X", help = thresholds::help("Largest NMSE of the teacher-forced logits", |d| d.logits_nmse))]
    pub max_nmse: Option<f64>,
    /// Largest mean KL(P_ref ‖ P_device) in nats (default: [`thresholds`]).
    #[arg(long, value_name = "X", help = thresholds::help("Largest mean KL(P_ref ‖ P_device) in nats", |d| d.mean_kl))]
    pub max_kl: Option<f64>,
    /// Smallest share of teacher-forced positions with the same top token (default: [`thresholds`]).
    #[arg(long, value_name = "X", help = thresholds::help("Smallest share of teacher-forced positions with the same top token", |d| d.min_top1))]
    pub min_token_agreement: Option<f64>,
    /// Most teacher-forced disagreements at confident positions (default: [`thresholds`]).
    #[arg(long, value_name = "N", help = thresholds::help("Most teacher-forced disagreements at confident positions", |d| d.confident_flips as f64))]
    pub max_confident_flips: Option<usize>,
    /// Largest NRMSE of a layer's output, over the run and at any position (default: [`thresholds`]).
    #[arg(long, value_name = "X", help = thresholds::help("Largest NRMSE of a layer's output, over the run and at any position", |d| d.layer_nrmse))]
    pub max_layer_nrmse: Option<f64>,
    /// Largest NRMSE of a state after the prompt (default: [`thresholds`]).
    #[arg(long, value_name = "X", help = thresholds::help("Largest NRMSE of a state after the prompt", |d| d.state_nrmse))]
    pub max_state_nrmse: Option<f64>,
    /// MoE: a router probability error the device's router logits do not show (all of it when it outputs none),
    /// added to the measured one to classify routing flips: a near tie when the reference's gap is within twice
    /// the total (default: the measured error alone; without router logits, unclassified).
    #[arg(long, value_name = "P")]
    pub router_tolerance: Option<f64>,
}

impl ThresholdArgs {
    /// The thresholds given, validated.
    pub fn overrides(&self) -> Result<ThresholdOverrides> {
        let o = ThresholdOverrides {
            max_nmse: self.max_nmse,
            max_kl: self.max_kl,
            min_token_agreement: self.min_token_agreement,
            max_confident_flips: self.max_confident_flips,
            max_layer_nrmse: self.max_layer_nrmse,
            max_state_nrmse: self.max_state_nrmse,
            router_tolerance: self.router_tolerance,
        };
        o.validate()?;
        Ok(o)
    }
}

/// Where the reports go.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ReportArgs {
    /// Write the report as JSON (stable keys, `schema_version`).
    #[arg(long, value_name = "FILE.json")]
    pub json: Option<PathBuf>,
    /// Write the report as Markdown (machine, versions, what ran, every table), to paste into a bug report.
    #[arg(long, value_name = "FILE.md")]
    pub report: Option<PathBuf>,
    /// Draw the error per layer and per position as an SVG chart.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

impl ReportArgs {
    /// The outputs asked for (checked at the command's start with its other paths: see
    /// [`crate::outputs::DeclarePaths`]).
    pub fn outputs(&self) -> Result<Outputs> {
        Ok(Outputs {
            json: self.json.clone(),
            report: self.report.clone(),
            plot: self.plot.clone(),
        })
    }
}

/// How the probe feeds the layers (`--mode`, `--probe-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// Each block gets the reference's input and incoming state.
    Isolated,
    /// Each layer gets the device's own output of the layer before and carries its own state.
    Chained,
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Mode {
        match m {
            ModeArg::Isolated => Mode::Isolated,
            ModeArg::Chained => Mode::Chained,
        }
    }
}
