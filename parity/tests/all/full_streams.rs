//! Writing never panics: every command, run with its standard output or its standard error on a full device
//! (`/dev/full`), ends with the exit code it has when both streams work (0 or 1 when only the report could not be
//! printed, 2 for an error), never a panic (101) or an abort (134). The cases are generated: `--help` and a usage
//! error of every subcommand `qwen35 --help` lists, plus the top level's help, version and usage error, an input
//! error, passing runs and failing runs on the tiny model.

use candle_core::Tensor;
use parity::dump::Dump;
use std::fs::OpenOptions;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use crate::common;
use common::testdata;

/// Where a stream of the run goes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Full {
    /// Both streams captured.
    Neither,
    /// Standard output on `/dev/full`.
    Stdout,
    /// Standard error on `/dev/full`.
    Stderr,
}

fn full() -> Stdio {
    OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full opens")
        .into()
}

fn run(args: &[String], full_stream: Full) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_qwen35"));
    c.args(args)
        .env_remove("QWEN35_DEVICE_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match full_stream {
        Full::Neither => {}
        Full::Stdout => {
            c.stdout(full());
        }
        Full::Stderr => {
            c.stderr(full());
        }
    }
    c.output().expect("the binary runs")
}

/// The subcommands `qwen35 --help` lists (all but `help`).
fn subcommands() -> Vec<String> {
    let o = run(&["--help".into()], Full::Neither);
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let mut names = Vec::new();
    let mut inside = false;
    for line in text.lines() {
        if line.starts_with("Commands:") {
            inside = true;
            continue;
        }
        if inside {
            if !line.starts_with("  ") {
                break;
            }
            // A command's line starts with two spaces and its name; wrapped descriptions are indented further.
            if let Some(name) = line.strip_prefix("  ").filter(|l| !l.starts_with(' ')) {
                let name = name.split_whitespace().next().unwrap_or("");
                if !name.is_empty() && name != "help" {
                    names.push(name.to_string());
                }
            }
        }
    }
    names
}

/// A dump of the tiny model, and a copy whose logits hold NaN (a failed check: exit 1).
fn dumps(dir: &Path) -> (String, String) {
    let clean = dir.join("clean.safetensors");
    let o = run(
        &[
            "dump",
            "--token-ids",
            "11,22,33,44",
            "--generate",
            "2",
            "--out",
            clean.to_str().unwrap(),
        ]
        .map(String::from),
        Full::Neither,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut d = Dump::read(&clean).unwrap();
    let logits = &d.tensors["logits"];
    let mut v = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v.iter_mut().step_by(5).for_each(|x| *x = f32::NAN);
    let nan = Tensor::from_vec(v, logits.dims(), logits.device()).unwrap();
    d.tensors.insert("logits".into(), nan);
    let bad = dir.join("nan.safetensors");
    d.write(&bad).unwrap();
    (
        clean.to_str().unwrap().to_string(),
        bad.to_str().unwrap().to_string(),
    )
}

/// Every case: its arguments and the exit code it must end with.
fn cases(dir: &Path) -> Vec<(Vec<String>, i32)> {
    let s = |a: &[&str]| a.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let mut all = vec![
        (s(&["--help"]), 0),
        (s(&["--version"]), 0),
        (s(&["--no-such-flag"]), 2),
        (s(&[]), 2),
    ];
    let names = subcommands();
    assert!(
        names.len() >= 10,
        "too few subcommands read from --help: {names:?}"
    );
    for name in &names {
        all.push((s(&[name, "--help"]), 0));
        all.push((s(&[name, "--no-such-flag"]), 2));
    }
    let (clean, nan) = dumps(dir);
    let model = testdata().join("models/tiny");
    let model = model.to_str().unwrap();
    let out = dir.join("out.safetensors");
    let out = out.to_str().unwrap();
    let missing = dir.join("missing.safetensors");
    let missing = missing.to_str().unwrap();
    all.extend([
        // An input error.
        (s(&["diff", missing, &clean]), 2),
        (s(&["run", "--model", missing, "--prompt", "hi"]), 2),
        // Passing runs: a report on standard output, a note on standard error, generated text.
        (s(&["diff", &clean, &clean]), 0),
        (
            s(&[
                "run",
                "--model",
                model,
                "--prompt",
                "hi",
                "--max-tokens",
                "3",
            ]),
            0,
        ),
        (s(&["ranges", "--model", model, "--prompt", "hi"]), 0),
        (
            s(&[
                "dump",
                "--model",
                model,
                "--token-ids",
                "1,2,3",
                "--generate",
                "1",
                "--out",
                out,
            ]),
            0,
        ),
        (s(&["devices"]), 0),
        (s(&["devices", "--json"]), 0),
        // A failing run: a finding (exit 1), its report on standard output.
        (s(&["diff", &nan, &clean]), 1),
    ]);
    all
}

#[test]
fn a_full_stdout_or_stderr_is_never_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let cases = cases(dir.path());
    let mut wrong = Vec::new();
    for (args, code) in &cases {
        let normal = run(args, Full::Neither);
        if normal.status.code() != Some(*code) {
            wrong.push(format!(
                "{args:?}: exit {:?} with both streams working, expected {code}: {}",
                normal.status.code(),
                String::from_utf8_lossy(&normal.stderr)
            ));
            continue;
        }
        for stream in [Full::Stdout, Full::Stderr] {
            let o = run(args, stream);
            let err = String::from_utf8_lossy(&o.stderr);
            let mut what = Vec::new();
            if o.status.code() != Some(*code) {
                what.push(format!("exit {:?}, expected {code}", o.status.code()));
            }
            if err.contains("panicked") {
                what.push("panicked".to_string());
            }
            // Standard error works: it says the report could not be printed when there was one.
            if stream == Full::Stdout
                && !normal.stdout.is_empty()
                && !err.contains("could not be printed")
            {
                what.push("no word that the report could not be printed".to_string());
            }
            if !what.is_empty() {
                wrong.push(format!(
                    "{args:?} with {stream:?} full: {} — {}",
                    what.join(", "),
                    err.lines().last().unwrap_or("")
                ));
            }
        }
    }
    println!(
        "{} commands, each with stdout and with stderr full",
        cases.len()
    );
    assert!(
        wrong.is_empty(),
        "{} of {} runs went wrong:\n{}",
        wrong.len(),
        2 * cases.len(),
        wrong.join("\n")
    );
}
