//! Helpers shared by the binary's test files.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs `qwen35 args` with extra environment variables.
pub fn qwen35_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_qwen35"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("the binary runs")
}

/// Runs `qwen35 args`.
pub fn qwen35(args: &[&str]) -> Output {
    qwen35_env(args, &[])
}

/// The bundled test data.
pub fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

/// The command's standard error as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs `args` expecting exit code 2 and an error mentioning every `needle`, never a panic.
pub fn expect_error_env(args: &[&str], env: &[(&str, &str)], needles: &[&str]) {
    let o = qwen35_env(args, env);
    let err = stderr(&o);
    assert_eq!(
        o.status.code(),
        Some(2),
        "{args:?} should fail with exit code 2; stderr: {err}"
    );
    for n in needles {
        assert!(
            err.contains(n),
            "{args:?}: the error does not mention `{n}`:\n{err}"
        );
    }
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
}

/// [`expect_error_env`] without extra environment.
pub fn expect_error(args: &[&str], needles: &[&str]) {
    expect_error_env(args, &[], needles)
}

/// `--token-ids` text for an i64 id tensor.
pub fn ids_arg(t: &candle_core::Tensor) -> String {
    t.to_vec1::<i64>()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}
