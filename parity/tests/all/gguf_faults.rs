//! The candle port's seven GGUF bugs (issue 33's seed), each planted in the reference's GGUF mapping
//! (`reference::gguf::model::fault`, test-only), run on the tiny model's GGUF and caught: `qwen35 diff` of the faulty
//! run's dump against the checkpoint's names the layer and the tensor where the fault first shows; the KV heads,
//! which shape the attention's tensors, are refused at load, naming the layer's `k_proj`.

use crate::common::{gguf, stderr, testdata};
use reference::gguf::model::fault::Fault;
use std::path::{Path, PathBuf};

/// The reference's dump of `model` (a checkpoint directory or a GGUF file) into `out`: the exit code and stderr.
fn dump(model: &Path, out: &Path) -> (Option<i32>, String) {
    let o = gguf::dump(model, out, &[]);
    (o.status.code(), stderr(&o))
}

/// `diff` of `actual` against `reference` with the default (f32) thresholds: the exit code and the JSON report's
/// device.
fn diff(actual: &Path, reference: &Path) -> (Option<i32>, serde_json::Value) {
    let (code, v) = gguf::diff_report(actual, reference, &actual.with_extension("json"), &[]);
    (code, v["devices"][0].clone())
}

/// The tiny model's GGUF written as a checkpoint directory, `fault` planted, under `dir/name`.
fn faulty(dir: &Path, name: &str, fault: Option<Fault>) -> PathBuf {
    let out = dir.join(name);
    std::fs::create_dir(&out).unwrap();
    let gguf = testdata().join("gguf/models/tiny-f32.gguf");
    reference::gguf::write_checkpoint(&gguf, fault, &out).unwrap();
    out
}

/// Where each fault must first show: the first layer over threshold and the first tensor (in computation order).
/// Layers 0..2 of tiny are linear attention, layer 3 full attention.
fn expected(f: Fault) -> Option<(usize, &'static str)> {
    match f {
        Fault::DecaySign => Some((0, "layers.0.linear_attn.g")),
        Fault::ConvOrientation => Some((0, "layers.0.linear_attn.conv_output")),
        Fault::DroppedGate => Some((3, "layers.3.self_attn.gate")),
        Fault::WholeHeadRope => Some((3, "layers.3.self_attn.query")),
        Fault::KeyNormGrouping => Some((3, "layers.3.self_attn.key")),
        // One epsilon for every norm (as the port had), but the input norm's mean square (~1e-2 here) hides the
        // change below the threshold: it shows in the gated norm, whose input is small, as the port found.
        Fault::NormEps => Some((0, "layers.0.linear_attn.gated_norm_output")),
        Fault::KvHeadsFromLayer0 => None,
    }
}

#[test]
fn each_planted_gguf_bug_is_named_at_its_layer_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("checkpoint.safetensors");
    let (code, err) = dump(&testdata().join("models/tiny"), &reference);
    assert_eq!(code, Some(0), "{err}");

    // No fault: the GGUF run and its mapping written out as a checkpoint both equal the checkpoint's run.
    let plain = faulty(tmp.path(), "plain", None);
    for (label, model) in [
        ("gguf", testdata().join("gguf/models/tiny-f32.gguf")),
        ("plain", plain),
    ] {
        let out = tmp.path().join(format!("{label}.safetensors"));
        let (code, err) = dump(&model, &out);
        assert_eq!(code, Some(0), "{label}: {err}");
        let (code, d) = diff(&out, &reference);
        assert_eq!(code, Some(0), "{label}: {d}");
        assert!(d["first_divergence"]["layer"].is_null(), "{label}: {d}");
        assert!(
            d["first_divergence"].get("tensor").is_none(),
            "{label}: {d}"
        );
        assert_eq!(d["logits"]["nmse"].as_f64(), Some(0.0), "{label}");
    }

    for fault in Fault::ALL {
        let name = fault.name();
        let model = faulty(tmp.path(), name, Some(fault));
        let out = tmp.path().join(format!("{name}.safetensors"));
        let (code, err) = dump(&model, &out);
        let Some((layer, tensor)) = expected(fault) else {
            // The KV heads shape k_proj/v_proj: refused before any token, naming the first full-attention layer's
            // k_proj and the config key its rows come from.
            assert_eq!(code, Some(2), "{name}: {err}");
            for needle in [
                "model.layers.3.self_attn.k_proj.weight",
                "num_key_value_heads",
            ] {
                assert!(err.contains(needle), "{name}: `{needle}` not in: {err}");
            }
            assert!(!out.exists(), "{name}");
            continue;
        };
        assert_eq!(code, Some(0), "{name}: {err}");
        let (code, d) = diff(&out, &reference);
        assert_eq!(code, Some(1), "{name}: the diff passed: {d}");
        let first = &d["first_divergence"];
        assert_eq!(
            first["layer"][0].as_u64(),
            Some(layer as u64),
            "{name}: {first}"
        );
        assert_eq!(first["tensor"][0].as_str(), Some(tensor), "{name}: {first}");
        // Far from rounding: every fault moves its first tensor by over 1e-3 (NRMSE; the threshold is 1e-4).
        let measure = first["tensor"][1].as_f64().unwrap();
        eprintln!(
            "{name}: layer {layer} (output NRMSE {:.2e}), {tensor} (NRMSE {measure:.2e}); logits NMSE {:.2e}, \
             top-1 {}",
            first["layer"][1].as_f64().unwrap(),
            d["logits"]["nmse"].as_f64().unwrap_or(f64::NAN),
            d["all"]["same_top1"],
        );
        assert!(measure > 1e-3, "{name}: {first}");
        // Nothing before the named layer moved at all: the fault is where it is named.
        for l in d["layers"].as_array().unwrap().iter().take(layer) {
            assert_eq!(l["output"]["nrmse"].as_f64(), Some(0.0), "{name}: {l}");
        }
    }
}
