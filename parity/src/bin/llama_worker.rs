//! `qwen35-llama-worker`: llama.cpp in a process of its own, driven by the harness through pipes (the protocol is
//! [`parity::worker`]'s). Started by `qwen35 … --devices llama.cpp`, not by hand. Exit 0 when its input ends, 2 on a
//! bad argument or a failed write.

use std::process::ExitCode;

fn main() -> ExitCode {
    let run =
        parity::worker::WorkerArgs::parse(std::env::args().skip(1)).and_then(parity::worker::serve);
    match run {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            parity::errln!("qwen35-llama-worker: {e:#}");
            ExitCode::from(2)
        }
    }
}
