//! A device's NaN or infinity is a finding: the comparison names the first tensor (in computation order) and
//! position where it appears, fails (exit 1), and its JSON holds `null` or the count, never a number that looks
//! fine. Faults are planted in a reference dump of the tiny model, which `diff` then compares with the clean one.

use candle_core::{DType, Tensor};
use parity::dump::Dump;
use std::path::Path;

use crate::common;
use common::{dump, qwen35, stderr};

/// A copy of `d` with `edit` applied to the tensor `name`, written to `dir/file`.
fn planted(dir: &Path, d: &Dump, file: &str, name: &str, edit: impl Fn(&mut [f32])) -> String {
    let t = &d.tensors[name];
    let mut v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    edit(&mut v);
    let mut tensors = d.tensors.clone();
    tensors.insert(
        name.to_string(),
        Tensor::from_vec(v, t.dims(), t.device()).unwrap(),
    );
    let out = dir.join(file);
    Dump {
        tensors,
        metadata: d.metadata.clone(),
    }
    .write(&out)
    .unwrap();
    out.to_str().unwrap().to_string()
}

/// `qwen35 diff actual reference --json`: exit code, standard output and error, and the JSON.
fn diff(dir: &Path, actual: &str, reference: &str) -> (Option<i32>, String, serde_json::Value) {
    let json = dir.join(format!(
        "{}.json",
        Path::new(actual).file_stem().unwrap().to_str().unwrap()
    ));
    let o = qwen35(&["diff", actual, reference, "--json", json.to_str().unwrap()]);
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
    assert!(!text.contains("panicked"), "diff panicked:\n{text}");
    let v = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (o.status.code(), text, v)
}

#[test]
fn planted_nan_and_infinity_fail_the_diff_and_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = "11,22,33,44,55,66,77,88";
    let clean = dump(tmp.path(), "clean.safetensors", ids, 3, &[]);
    let reference = tmp.path().join("clean.safetensors");
    let reference = reference.to_str().unwrap();
    assert_eq!(clean.tensors["logits"].dtype(), DType::F32);
    // Every tensor of a dump has its place in the computation order (none falls back to the end).
    for name in clean.tensors.keys() {
        let (stage, _, step) = reference::taps::names::computation_order(name);
        let known = stage < 4 && step < 200;
        assert!(
            known || name == "token_ids" || name == "generated",
            "{name}"
        );
    }

    // One NaN in one intermediate of layer 0: nothing else holds one, and the diff still fails, naming it and its
    // position.
    let core = "layers.0.linear_attn.core_output";
    let one = planted(tmp.path(), &clean, "one.safetensors", core, |v| {
        let i = v.len() / 2;
        v[i] = f32::NAN;
    });
    let (code, text, json) = diff(tmp.path(), &one, reference);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains(core), "{text}");
    let first = &json["devices"][0]["first_non_finite"]["first"];
    assert_eq!(first["name"], core);
    assert_eq!(first["nan"], 1);
    let t = clean.tensors[core].dim(0).unwrap();
    assert_eq!(first["first"][0], t / 2, "the position of the planted NaN");
    assert_eq!(json["passed"], false);

    // Scattered NaN in the logits (which once made the top-k sort panic): exit 1, the logits named.
    let scattered = planted(tmp.path(), &clean, "scattered.safetensors", "logits", |v| {
        for x in v.iter_mut().step_by(7) {
            *x = f32::NAN;
        }
    });
    let (code, text, json) = diff(tmp.path(), &scattered, reference);
    assert_eq!(code, Some(1), "{text}");
    assert_eq!(
        json["devices"][0]["first_non_finite"]["first"]["name"],
        "logits"
    );
    // No rate is defined over rows holding NaN: `null`, not a share of agreeing rows.
    assert!(
        json["devices"][0]["all"]["same_top1"].is_null(),
        "{}",
        json["devices"][0]["all"]
    );

    // All-NaN logits: the KL and the end-of-sequence drift are undefined, `null` in the JSON, not 0.0.
    let all_nan = planted(tmp.path(), &clean, "all_nan.safetensors", "logits", |v| {
        v.fill(f32::NAN)
    });
    let (code, _, json) = diff(tmp.path(), &all_nan, reference);
    assert_eq!(code, Some(1));
    let all = &json["devices"][0]["all"];
    for key in ["kl_max", "kl_mean", "kl_p99", "eos_drift_max"] {
        assert!(
            all[key].is_null(),
            "{key} is {} for all-NaN logits",
            all[key]
        );
    }
    assert!(json["devices"][0]["logits"]["nmse"].is_null());

    // An infinity in a state: counted as infinite, named.
    let state = "layers.0.recurrent_state";
    let inf = planted(tmp.path(), &clean, "inf.safetensors", state, |v| {
        v[0] = f32::NEG_INFINITY
    });
    let (code, text, json) = diff(tmp.path(), &inf, reference);
    assert_eq!(code, Some(1), "{text}");
    let first = &json["devices"][0]["first_non_finite"]["first"];
    assert_eq!(
        (first["name"].as_str(), first["inf"].as_u64()),
        (Some(state), Some(1))
    );

    // The reference dump holding a NaN is a finding too (the dump under test is clean).
    let (code, text, _) = diff(tmp.path(), reference, &one);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("reference's side"), "{text}");

    // Clean against clean still passes.
    let (code, text, json) = diff(tmp.path(), reference, reference);
    assert_eq!(code, Some(0), "{text}");
    assert!(json["devices"][0]["first_non_finite"].is_null());
}

/// A copy of the tiny model whose layer-1 input norm weight holds one NaN.
fn nan_checkpoint(dir: &Path) -> String {
    common::copy_dir(&common::testdata().join("models/tiny"), dir);
    let file = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&file, &candle_core::Device::Cpu).unwrap();
    let name = "model.layers.1.input_layernorm.weight";
    let t = &tensors[name];
    let mut v = t.to_vec1::<f32>().unwrap();
    v[3] = f32::NAN;
    let broken = Tensor::from_vec(v, t.dims(), t.device()).unwrap();
    tensors.insert(name.to_string(), broken);
    candle_core::safetensors::save(&tensors, &file).unwrap();
    dir.to_str().unwrap().to_string()
}

#[test]
fn a_run_that_produces_nan_says_where_and_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let model = nan_checkpoint(tmp.path());
    let o = qwen35(&[
        "run",
        "--model",
        &model,
        "--prompt",
        "hi",
        "--max-tokens",
        "4",
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    for needle in [
        "NaN",
        "generated token 0",
        "`layers.1.",
        "model.layers.1.input_layernorm.weight",
    ] {
        assert!(
            err.contains(needle),
            "`run` does not say `{needle}`:\n{err}"
        );
    }

    let json = tmp.path().join("ranges.json");
    let o = qwen35(&[
        "ranges",
        "--model",
        &model,
        "--prompt",
        "hi",
        "--json",
        json.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}{}", stderr(&o));
    assert!(out.contains("first non-finite value: `layers.1."), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(
        v["weights_non_finite"][0]["name"],
        "model.layers.1.input_layernorm.weight"
    );
    assert!(
        v["first_non_finite"]["name"]
            .as_str()
            .unwrap()
            .starts_with("layers.1.")
    );
}
