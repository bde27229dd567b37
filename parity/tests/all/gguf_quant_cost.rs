//! What quantization costs per layer: the reference run on llama.cpp's quantized GGUFs (`testdata/gguf/llamacpp/`)
//! against the reference run on the checkpoint they were converted from, compared by `qwen35 diff` (layer output
//! NRMSE, logits NMSE, KL, same top-1; docs/llamacpp.md holds the figures).

use crate::common::{gguf, stderr, testdata};
use std::path::{Path, PathBuf};

fn dump(model: &Path, out: &Path) {
    let o = gguf::dump(model, out, &[]);
    assert!(o.status.success(), "{}: {}", model.display(), stderr(&o));
}

/// The reference on `testdata/gguf/llamacpp/{file}.gguf` diffed against `checkpoint`'s dump: the exit code and the
/// report's device.
fn cost(dir: &Path, file: &str, checkpoint: &Path) -> (Option<i32>, serde_json::Value) {
    let out = dir.join(format!("{file}.safetensors"));
    dump(&testdata().join(format!("gguf/llamacpp/{file}.gguf")), &out);
    let (code, v) = gguf::diff_report(&out, checkpoint, &dir.join(format!("{file}.json")), &[]);
    (code, v["devices"][0].clone())
}

fn layers(d: &serde_json::Value) -> Vec<f64> {
    d["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["output"]["nrmse"].as_f64().unwrap())
        .collect()
}

fn checkpoint(dir: &Path, model: &str) -> PathBuf {
    let out = dir.join(format!("{model}.checkpoint.safetensors"));
    dump(&testdata().join("models").join(model), &out);
    out
}

#[test]
fn quantization_costs_are_reported_per_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let tied = checkpoint(tmp.path(), "tiny-tied");
    // The f32 GGUF is the checkpoint, bit for bit.
    let (code, d) = cost(tmp.path(), "tiny-tied.f32", &tied);
    assert_eq!(code, Some(0), "{d}");
    assert!(layers(&d).iter().all(|&e| e == 0.0), "{d}");

    // Q8_0 (measured 4.2e-3 .. 1.0e-2, growing with depth; logits KL 1.9e-2, 8/8 top-1): over the f32 tolerance,
    // so the diff fails, and the first tensor out of tolerance is the quantized embedding table's rows.
    let (code, d) = cost(tmp.path(), "tiny-tied.q8_0", &tied);
    assert_eq!(code, Some(1), "{d}");
    let q8 = layers(&d);
    assert_eq!(q8.len(), 4);
    assert!(q8.iter().all(|e| (1e-3..3e-2).contains(e)), "{q8:?}");
    assert!(q8.windows(2).all(|w| w[0] < w[1]), "{q8:?}");
    assert_eq!(d["first_divergence"]["tensor"][0], "embeddings", "{d}");
    assert_eq!(d["all"]["same_top1"].as_f64(), Some(1.0), "{d}");

    // Q4_0 costs more at every layer, and the top-1 choices (measured 1/8).
    let (_, d) = cost(tmp.path(), "tiny-tied.q4_0", &tied);
    let q4 = layers(&d);
    assert!(q4.iter().zip(&q8).all(|(a, b)| a > &(2.0 * b)), "{q4:?}");
    assert!(d["all"]["same_top1"].as_f64().unwrap() < 0.5, "{d}");

    // tiny-h128 (rows of 256: real Q4_K and Q6_K blocks): Q8_0 < Q6_K < Q4_K_M at every layer.
    let h128 = checkpoint(tmp.path(), "tiny-h128");
    let by_type: Vec<Vec<f64>> = ["q8_0", "q6_k", "q4_k_m"]
        .iter()
        .map(|t| layers(&cost(tmp.path(), &format!("tiny-h128.{t}"), &h128).1))
        .collect();
    for w in by_type.windows(2) {
        assert!(w[0].iter().zip(&w[1]).all(|(a, b)| a < b), "{by_type:?}");
    }
}
