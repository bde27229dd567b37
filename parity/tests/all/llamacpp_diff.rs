//! `qwen35 diff` of a dump llama.cpp's CPU back end wrote through its evaluation callback (`testdata/gguf/llamacpp/`,
//! `scripts/llama_dump.cpp`) against the reference's dump of the same 8 tokens on the same model: llama.cpp's names
//! are mapped on read (`parity/src/dump/llamacpp.rs`), layer by layer.

use crate::common::{qwen35, stderr, testdata};
use std::path::Path;

/// The first 8 token ids of tiny-tied's golden prompt, as `fixtures.json` records them.
const TOKENS: &str = "508,82,88,282,68,76,198,56";

/// `diff` of llama.cpp's `file` against `reference`: the exit code and the JSON report.
fn diff(dir: &Path, file: &str, reference: &Path) -> (Option<i32>, serde_json::Value) {
    let json = dir.join(format!("{file}.json"));
    let actual = testdata().join("gguf/llamacpp").join(file);
    let o = qwen35(&[
        "diff",
        actual.to_str().unwrap(),
        reference.to_str().unwrap(),
        // llama.cpp's context keeps K and V in f16 (its default): the logits carry that rounding (measured NMSE
        // 3.2e-7, mean KL 3.6e-6), above the f32 defaults made for two f32 runs. The layers keep the f32 default.
        "--max-nmse",
        "1e-6",
        "--max-kl",
        "1e-5",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(json.exists(), "{file}: no report; {}", stderr(&o));
    let v = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (o.status.code(), v)
}

/// The output NRMSE of every layer of a report.
fn layers(v: &serde_json::Value) -> Vec<f64> {
    v["devices"][0]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["output"]["nrmse"].as_f64().unwrap())
        .collect()
}

#[test]
fn llamacpp_dumps_diff_layer_by_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("ref.safetensors");
    // The reference on llama.cpp's own f32 GGUF (`--model FILE.gguf`): the same weights llama.cpp ran.
    let model = testdata().join("gguf/llamacpp/tiny-tied.f32.gguf");
    let o = qwen35(&[
        "dump",
        "--model",
        model.to_str().unwrap(),
        "--token-ids",
        TOKENS,
        "--generate",
        "1",
        "--out",
        reference.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));

    // f32 weights: every layer within the f32 layer tolerance (1e-4); layer 0 (linear attention, no KV cache) at
    // f32 rounding, the later ones carry the f16 KV cache of full-attention layer 1 (measured 5.5e-5 to 8.9e-5).
    let (code, v) = diff(tmp.path(), "tiny-tied.f32.dump.safetensors", &reference);
    let f32_layers = layers(&v);
    assert_eq!(f32_layers.len(), 4, "{v}");
    assert!(f32_layers[0] < 1e-6, "{f32_layers:?}");
    assert!(f32_layers.iter().all(|&e| e < 1e-4), "{f32_layers:?}");
    assert!(v["devices"][0]["logits"]["nmse"].as_f64().unwrap() < 1e-6);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["passed"], true);

    // Q8_0 weights: the error per layer shows (measured 5.0e-3 .. 1.7e-2), above the f32 tolerance: a failed check.
    let (code, v) = diff(tmp.path(), "tiny-tied.q8_0.dump.safetensors", &reference);
    let q8 = layers(&v);
    assert_eq!(q8.len(), 4, "{v}");
    assert!(q8.iter().all(|&e| (1e-3..1e-1).contains(&e)), "{q8:?}");
    assert!(q8.iter().zip(&f32_layers).all(|(q, f)| q > f), "{q8:?}");
    assert_eq!(code, Some(1), "{v}");
}
