//! What the GGUF and llama.cpp tests share: the fixtures' 8 tokens, a reference dump of them, and a `diff` read back
//! as its JSON report.

use super::{qwen35, stderr};
use std::path::Path;
use std::process::Output;

/// The first 8 token ids of the models' golden prompt, as `testdata/gguf/llamacpp/fixtures.json` records them.
pub const TOKENS: &str = "508,82,88,282,68,76,198,56";

/// `qwen35 dump` of [`TOKENS`] and one generated token on `model` (a checkpoint directory or a GGUF file) into
/// `out`, with `extra` flags.
pub fn dump(model: &Path, out: &Path, extra: &[&str]) -> Output {
    let (model, out) = (model.to_str().unwrap(), out.to_str().unwrap());
    let mut args = vec![
        "dump",
        "--model",
        model,
        "--token-ids",
        TOKENS,
        "--generate",
        "1",
    ];
    args.extend(extra);
    args.extend(["--out", out]);
    qwen35(&args)
}

/// `qwen35 diff actual reference` with `extra` flags, its JSON report written to `json` (asserted to be): the exit
/// code and the report.
pub fn diff_report(
    actual: &Path,
    reference: &Path,
    json: &Path,
    extra: &[&str],
) -> (Option<i32>, serde_json::Value) {
    let (a, r, j) = (
        actual.to_str().unwrap(),
        reference.to_str().unwrap(),
        json.to_str().unwrap(),
    );
    let mut args = vec!["diff", a, r];
    args.extend(extra);
    args.extend(["--json", j]);
    let o = qwen35(&args);
    assert!(json.exists(), "{a}: no report; {}", stderr(&o));
    let v = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    (o.status.code(), v)
}
