//! The parity harness behind the `qwen35` command: the backends a command runs, the dump format every backend
//! writes, the run options the command line parses, and one module per subcommand.
#![deny(missing_docs)]

pub mod backends;
pub mod bundled;
pub mod commands;
pub mod compare;
pub mod dump;
pub mod metrics;
pub mod options;
pub mod perf;
pub mod plot;
pub mod probe;
pub mod progress;
pub mod ranges;
pub mod report;
pub mod validate;
