//! One module per `qwen35` subcommand: its arguments, turned into a plan, run, and handed to `report/`; `args`
//! holds the options several share and their conversion into plain settings, `paths` the files they name (every
//! command checks its inputs and outputs first: [`crate::outputs`]). No command imports another, and no clap type
//! leaves this module. `main.rs` only parses and dispatches.

pub mod args;
pub mod bench;
pub mod compare_devices;
pub mod devices;
pub mod diff;
pub mod dump;
pub mod export_ir;
pub mod paths;
pub mod probe;
pub mod ranges;
pub mod run;
pub mod synth;
pub mod target;
pub mod validate;

/// What a command concluded: exit code 0 when every check passed, 1 when one failed (errors are 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Within every threshold (or nothing to check).
    Pass,
    /// A check failed.
    Fail,
}
