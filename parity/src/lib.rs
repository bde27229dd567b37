//! The parity harness behind the `qwen35` command: the device under test (whoever built its graphs), the
//! comparisons, the probe and the validate checks written once against it, the dump format every backend writes,
//! the reports, and one module per subcommand (`commands/`, the only place the command line is parsed).
#![deny(missing_docs)]
// Unit tests read their own fixtures with std::fs; the library itself opens inputs only through reference::inputs.
#![cfg_attr(test, allow(clippy::disallowed_methods))]
// Every print goes through `console` (a failed write is an error, never a panic).
#![deny(clippy::print_stdout, clippy::print_stderr)]

pub mod bundled;
pub mod commands;
pub mod compare;
pub mod console;
pub mod device;
pub mod dump;
pub mod images;
pub mod memory;
pub mod metrics;
pub mod non_finite;
pub mod outputs;
pub mod perf;
pub mod plot;
pub mod probe;
pub mod progress;
pub mod prompts;
pub mod ranges;
pub mod report;
pub mod routing;
pub mod thresholds;
pub mod validate;
pub mod worker;
