//! The bad-input suite: one case per way a user (or a device) can hand the tool something wrong, each run against
//! the built binary and held to its exit code (2 an error, 1 a finding) and a word the message must hold, never a
//! panic. The fixtures (broken checkpoints, dumps, graph sets) are made once in a temporary folder; `{name}` in a
//! case's arguments stands for a fixture's path.

use candle_core::{DType, Tensor};
use parity::dump::Dump;
use std::collections::BTreeMap;
use std::process::Command;

mod cases;
mod fixtures;
use cases::cases;
use fixtures::{fill, fixtures, ids};

/// Runs the binary.
fn qwen35(args: &[String], env: &[(String, String)]) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_qwen35"));
    c.args(args)
        .env_remove("QWEN35_DEVICE_CONFIG")
        .env_remove("OPENVINO_LIB");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("the binary runs")
}

#[test]
fn every_bad_input_is_refused_or_reported_as_the_table_says() {
    let f = fixtures();
    let mut failed = Vec::new();
    let table = cases();
    for case in &table {
        let args: Vec<String> = fill(case.args, &f).split(' ').map(str::to_string).collect();
        let env: Vec<(String, String)> = case
            .env
            .iter()
            .map(|(k, v)| (k.to_string(), fill(v, &f)))
            .collect();
        let o = qwen35(&args, &env);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        let mut wrong = Vec::new();
        if o.status.code() != Some(case.code) {
            wrong.push(format!(
                "exit {:?}, expected {}",
                o.status.code(),
                case.code
            ));
        }
        if text.contains("panicked") {
            wrong.push("panicked".into());
        }
        for n in case.needles {
            if !text.contains(n) {
                wrong.push(format!("no `{n}` in the message"));
            }
        }
        if !wrong.is_empty() {
            let tail: String = text.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
            failed.push(format!("{}: {} — {tail}", case.what, wrong.join(", ")));
        }
    }
    println!("{} bad-input cases", table.len());
    assert!(
        failed.is_empty(),
        "{} of {} cases went wrong:\n{}",
        failed.len(),
        table.len(),
        failed.join("\n")
    );
}

/// A closed pipe on the standard output ends the command quietly (as any Unix tool), not with a panic.
#[test]
fn a_closed_pipe_is_not_a_panic() {
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "'{}' compare-devices --help | head -c 1 >/dev/null",
            env!("CARGO_BIN_EXE_qwen35")
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn an_injected_type_error_is_not_a_panic() {
    // Integer logits in a dump: named, not a panic in the comparison.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("int.safetensors");
    let mut t = BTreeMap::new();
    t.insert("token_ids".to_string(), ids(&[1, 2], &[2]));
    t.insert(
        "logits".to_string(),
        Tensor::zeros((2, 4), DType::I64, &candle_core::Device::Cpu).unwrap(),
    );
    Dump {
        tensors: t,
        metadata: BTreeMap::new(),
    }
    .write(&f)
    .unwrap();
    let path = f.to_str().unwrap().to_string();
    let o = qwen35(&["diff".into(), path.clone(), path], &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("`logits`") && !err.contains("panicked"),
        "{err}"
    );
}
