//! `qwen35`: run, dump and compare the Qwen3.5 decoder.
//!
//! Exit codes: 0 success (every check within its threshold), 1 a failed check, 2 an error (bad input, missing file,
//! failed run). A report that could not be printed (a full standard output) leaves the run's own code, said on
//! standard error ([`parity::console`]).
#![deny(clippy::print_stdout, clippy::print_stderr)]

use clap::{Parser, Subcommand};
use parity::commands::{self, Outcome};
use parity::{console, errln};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "qwen35",
    version,
    about = "Reference runs and parity checks of the Qwen3.5 hybrid decoder"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Greedy chat generation on the reference decoder.
    Run(commands::run::RunArgs),
    /// Run a prompt and write every intermediate, the states and a greedy continuation to a safetensors file.
    Dump(commands::dump::DumpArgs),
    /// The OpenVINO runtime and its devices: names, architecture, NPU driver, precisions.
    Devices(commands::devices::DevicesArgs),
    /// Run the same prompts on the reference and on each device; compare tokens, distributions, every layer's hidden
    /// state and the states, against thresholds (exit 1 when one fails).
    CompareDevices(commands::compare_devices::CompareArgs),
    /// Run each layer's own graph on a device against the reference (isolated or chained) and name the layer, the
    /// state and the op where the error starts (exit 1 when a layer is over threshold).
    Probe(commands::probe::ProbeArgs),
    /// Compare two dumps (the second the reference) with the metrics and reports of compare-devices: a dump written
    /// by another program checked offline (exit 1 when a threshold fails).
    Diff(commands::diff::DiffArgs),
    /// What of the reference's numbers an fp16 (or bf16) device cannot hold: overflows, values below the smallest
    /// normal, constants that do not survive the cast, and the first overflow.
    Ranges(commands::ranges::RangesArgs),
    /// Every check a new NPU needs on one device (where it ran, its precision, compare-devices, the probe, the port's
    /// equivalences, length), one report (exit 1 when a check fails).
    Validate(commands::validate::ValidateArgs),
    /// Write the static OpenVINO graphs of a checkpoint (decoder and per-layer) and a manifest of their interfaces.
    ExportIr(commands::export_ir::ExportArgs),
    /// Write a random checkpoint with the real shapes and layout of Qwen3.5-9B or Qwen3.5-35B-A3B (`--arch`; nested
    /// config, sharded bf16 safetensors), seeded and deterministic.
    Synth(commands::synth::SynthArgs),
    /// Time loading, a prompt and greedy decoding on a checkpoint: tokens/s, achieved GFLOP/s, peak memory, beside
    /// the machine's measured f32 matrix-product rate and memory bandwidth.
    Bench(commands::bench::BenchArgs),
}

fn main() -> ExitCode {
    // A closed pipe (`qwen35 devices | head`) ends the process quietly, as it does any Unix tool, instead of a panic
    // in `print!`: Rust ignores SIGPIPE by default.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // A file size limit (`ulimit -f`) reached while writing a dump or a graph kills the process with SIGXFSZ and no
    // word; ignored, the write fails with EFBIG instead and the error names the output (its partial is removed).
    #[cfg(unix)]
    // SAFETY: setting the disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    // This process is one run: no output may overwrite a file any loader of it reads.
    reference::inputs::watch();
    // Ctrl-C and SIGTERM remove the partial files and directories the run is writing before it ends.
    parity::outputs::clean_up_on_signals();
    let code = match Cli::try_parse() {
        Ok(cli) => exec(cli.command),
        Err(e) => console::clap_error(&e),
    };
    if let Some(why) = console::stdout_failure() {
        errln!(
            "warning: the report could not be printed on standard output ({why}); the exit code ({code}) is the \
             run's own"
        );
    }
    ExitCode::from(code)
}

/// Runs the command; its exit code.
fn exec(command: Command) -> u8 {
    let result = match command {
        Command::Run(a) => commands::run::exec(a),
        Command::Dump(a) => commands::dump::exec(a),
        Command::Devices(a) => commands::devices::exec(a),
        Command::CompareDevices(a) => commands::compare_devices::exec(a),
        Command::Probe(a) => commands::probe::exec(a),
        Command::Diff(a) => commands::diff::exec(a),
        Command::Ranges(a) => commands::ranges::exec(a),
        Command::ExportIr(a) => commands::export_ir::exec(a),
        Command::Validate(a) => commands::validate::exec(a),
        Command::Synth(a) => commands::synth::exec(a),
        Command::Bench(a) => commands::bench::exec(a),
    };
    // An ending signal (Ctrl-C, SIGTERM) decides the exit code, not what the command made of it.
    parity::outputs::yield_to_ending_signal();
    match result {
        Ok(Outcome::Pass) => 0,
        Ok(Outcome::Fail) => 1,
        Err(e) => {
            errln!("error: {e:#}");
            2
        }
    }
}
