//! The routing report end to end: `qwen35 diff` on dumps of the MoE model `tiny-moe` (its transformers golden's
//! 71-token prompt) scores the chosen experts as routing agreement, never by NRMSE, and classifies each flip. The
//! reference at f64 routes as at f32; on f16-rounded weights one near tie flips; an expert swapped in a dump by
//! hand is a confident flip; without the device's router logits a flip is classified only against a stated bound.
//! validate on the CPU device carries the report (compare-devices on CPU and FP16SIM: `moe_devices.rs`).

use candle_core::{DType, Tensor};
use parity::dump::Dump;
use serde_json::Value;
use std::path::{Path, PathBuf};

use crate::common;
use common::{golden_ids, qwen35, stderr, testdata};

/// `qwen35 dump` of tiny-moe on its golden prompt with `args`, at `dir/file`.
fn dump(dir: &Path, file: &str, args: &[&str]) -> PathBuf {
    let out = dir.join(file);
    let model = testdata().join("models/tiny-moe");
    let ids = golden_ids("tiny-moe");
    let mut all = vec![
        "dump",
        "--model",
        model.to_str().unwrap(),
        "--token-ids",
        &ids,
        "--generate",
        "2",
        "--out",
        out.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let o = qwen35(&all);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    out
}

/// `qwen35 diff actual reference [extra] --json`: exit code, the terminal text and the JSON's device.
fn diff(actual: &Path, reference: &Path, extra: &[&str]) -> (Option<i32>, String, Value) {
    let json = actual.with_extension(format!("{}.json", extra.len()));
    let mut args = vec![
        "diff",
        actual.to_str().unwrap(),
        reference.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = qwen35(&args);
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
    assert!(!text.contains("panicked"), "{text}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (o.status.code(), text, v["devices"][0].clone())
}

/// A copy of `d` with `edit` applied to its tensors, written to `dir/file`.
fn edited(dir: &Path, d: &Dump, file: &str, edit: impl FnOnce(&mut Dump)) -> PathBuf {
    let mut copy = Dump {
        tensors: d.tensors.clone(),
        metadata: d.metadata.clone(),
    };
    edit(&mut copy);
    let out = dir.join(file);
    copy.write(&out).unwrap();
    out
}

fn chosen(d: &Dump, layer: usize) -> Vec<Vec<i64>> {
    d.tensors[&format!("layers.{layer}.mlp.experts_chosen")]
        .to_vec2()
        .unwrap()
}

fn set_chosen(d: &mut Dump, layer: usize, rows: Vec<Vec<i64>>) {
    let (t, k) = (rows.len(), rows[0].len());
    let flat: Vec<i64> = rows.into_iter().flatten().collect();
    d.tensors.insert(
        format!("layers.{layer}.mlp.experts_chosen"),
        Tensor::from_vec(flat, (t, k), &candle_core::Device::Cpu).unwrap(),
    );
}

/// No row of `tensors` is a chosen-experts tap: they are scored under `routing` only.
fn no_index_scored_by_nrmse(device: &Value) {
    for row in device["tensors"].as_array().unwrap() {
        let name = row["name"].as_str().unwrap();
        assert!(!name.ends_with("experts_chosen"), "{name} scored by NRMSE");
    }
}

#[test]
fn diff_scores_routing_agreement_and_classifies_flips() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let f32 = dump(dir, "f32.safetensors", &[]);
    let f64 = dump(dir, "f64.safetensors", &["--dtype", "f64"]);
    let f16w = dump(dir, "f16w.safetensors", &["--weights", "f16"]);

    // f32 against f64: the same experts in the same order at all 4 layers × 71 tokens (measured router error at most
    // 3.0e-6, far below the prompt's smallest k-th/(k+1)-th margin of 2.6e-5).
    let (code, text, d) = diff(&f32, &f64, &[]);
    assert_eq!(code, Some(0), "{text}");
    let r = &d["routing"];
    assert_eq!(r["top_k"], 3);
    assert_eq!(r["pairs"], 284);
    assert_eq!(r["same_set"], 284);
    assert_eq!(r["same_order"], 284);
    assert_eq!(r["set_agreement"], 1.0);
    assert_eq!(r["flips"].as_array().unwrap().len(), 0);
    assert_eq!(r["first_flip"], Value::Null);
    for l in r["layers"].as_array().unwrap() {
        assert_eq!(l["same_set"], 71, "{l}");
        assert!(l["router_error_max"].as_f64().unwrap() < 1e-5, "{l}");
    }
    no_index_scored_by_nrmse(&d);
    assert!(
        text.contains("every token chose the reference's 3 experts"),
        "{text}"
    );

    // The reference on f16-rounded weights against f32: one flip, at layer 2 token 49, whose experts 7 (the
    // reference's 3rd) and 6 (its 4th) are 3.2e-5 apart while the router probabilities moved by 5.2e-4 there: a
    // near tie, with nothing upstream. (The built-in near tie at layer 2 token 20, 3.0e-5, holds.) It fails the f32
    // thresholds on its logits, not on its routing.
    let (code, text, d) = diff(&f16w, &f32, &[]);
    assert_eq!(code, Some(1), "{text}");
    let r = &d["routing"];
    assert_eq!(r["same_set"], 283, "{r}");
    assert_eq!(r["near_tie_flips"], 1);
    assert_eq!(r["confident_flips"], 0);
    assert_eq!(r["downstream_flips"], 0);
    let f = &r["first_flip"];
    assert_eq!((&f["layer"], &f["token"]), (&2.into(), &49.into()), "{f}");
    assert_eq!(f["class"], "near_tie");
    assert_eq!(f["experts_in"], serde_json::json!([6]));
    assert_eq!(f["experts_out"], serde_json::json!([7]));
    assert_eq!(f["router_error_source"], "measured");
    let (gap, margin, err) = (
        f["gap"].as_f64().unwrap(),
        f["reference_margin"].as_f64().unwrap(),
        f["router_error"].as_f64().unwrap(),
    );
    assert_eq!(
        gap, margin,
        "a swap of the 3rd and 4th overturns the margin"
    );
    assert!(gap > 0.0 && gap < 1e-4 && gap <= 2.0 * err, "{f}");
    assert_eq!(f["upstream"], Value::Null);
    // The router error there is far below the layer's median margin (1.5e-2): not a router that is off.
    assert_eq!(f["router_off"], false);
    assert_eq!(r["router_off_flips"], 0);
    assert!(f["mlp_nrmse"].as_f64().unwrap() > 0.0);
    let failures = d["failures"].to_string();
    assert!(!failures.contains("routing"), "{failures}");
    assert!(
        text.contains("first routing flip: layer 2 token 49 (near tie)"),
        "{text}"
    );
    no_index_scored_by_nrmse(&d);

    // A stated router error adds to the measured one.
    let (_, _, d) = diff(&f16w, &f32, &["--router-tolerance", "1e-3"]);
    let g = &d["routing"]["first_flip"];
    assert_eq!(g["router_error_source"], "measured_plus_stated");
    let sum = g["router_error"].as_f64().unwrap();
    assert!((sum - (err + 1e-3)).abs() < 1e-12, "{g}");

    // Without the device's router logits the flip is unclassified, unless a router error is stated: within twice
    // 1e-3 it is a near tie, beyond twice 1e-6 a confident flip, which fails the diff by itself.
    let f16_dump = Dump::read(&f16w).unwrap();
    let blind = edited(dir, &f16_dump, "blind.safetensors", |d| {
        d.tensors.retain(|k, _| !k.ends_with(".mlp.router_logits"));
    });
    let class = |extra: &[&str]| {
        let (_, text, d) = diff(&blind, &f32, extra);
        let r = &d["routing"];
        (
            r["first_flip"]["class"].as_str().unwrap().to_string(),
            d["failures"].to_string(),
            text,
        )
    };
    let (c, failures, text) = class(&[]);
    assert_eq!(c, "unclassified");
    assert!(!failures.contains("routing"), "{failures}");
    assert!(text.contains("--router-tolerance"), "{text}");
    let (c, failures, _) = class(&["--router-tolerance", "1e-3"]);
    assert_eq!(c, "near_tie");
    assert!(!failures.contains("routing"), "{failures}");
    let (c, failures, _) = class(&["--router-tolerance", "1e-6"]);
    assert_eq!(c, "confident");
    assert!(failures.contains("confident routing flip"), "{failures}");

    // An expert swapped by hand: at layer 1 token 10 the reference's first expert replaced by its least likely
    // one, the router logits left as they are. The router error there is 0, so the flip is confident, and the
    // only failure. The same row in another order is no flip at all.
    let clean = Dump::read(&f32).unwrap();
    let logits: Vec<f64> = clean.tensors["layers.1.mlp.router_logits"]
        .get(10)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap();
    let least = (0..logits.len())
        .min_by(|&a, &b| logits[a].total_cmp(&logits[b]))
        .unwrap() as i64;
    let swapped = edited(dir, &clean, "swapped.safetensors", |d| {
        let mut rows = chosen(d, 1);
        assert!(!rows[10].contains(&least));
        rows[10][0] = least;
        set_chosen(d, 1, rows);
    });
    let (code, text, d) = diff(&swapped, &f32, &[]);
    assert_eq!(code, Some(1), "{text}");
    let r = &d["routing"];
    assert_eq!(r["flips"].as_array().unwrap().len(), 1, "{r}");
    let f = &r["first_confident"];
    assert_eq!((&f["layer"], &f["token"]), (&1.into(), &10.into()), "{f}");
    assert_eq!(f["router_error"], 0.0);
    assert_eq!(f["experts_in"], serde_json::json!([least]));
    assert!(f["gap"].as_f64().unwrap() > 0.1, "{f}");
    let failures = d["failures"].as_array().unwrap();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(
        failures[0].as_str().unwrap().contains("layer 1 token 10"),
        "{failures:?}"
    );
    assert!(
        text.contains("first routing flip: layer 1 token 10 (confident)"),
        "{text}"
    );

    let reordered = edited(dir, &clean, "reordered.safetensors", |d| {
        let mut rows = chosen(d, 1);
        rows[10].reverse();
        set_chosen(d, 1, rows);
    });
    let (code, text, d) = diff(&reordered, &f32, &[]);
    assert_eq!(code, Some(0), "{text}");
    let r = &d["routing"];
    assert_eq!(r["same_set"], 284);
    assert_eq!(r["same_order"], 283);
    assert_eq!(r["flips"].as_array().unwrap().len(), 0);
}

/// validate on the CPU device carries the routing: its compare check names it beside the verdict, and the compare
/// report in its JSON holds the whole routing report (every token routed as the reference at f32).
#[test]
fn validate_reports_routing_on_the_cpu_device() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("v.json");
    let model = testdata().join("models/tiny-moe");
    let mut args = vec![
        "validate".to_string(),
        "--model".into(),
        model.to_str().unwrap().into(),
        "--json".into(),
        json.to_str().unwrap().into(),
    ];
    args.extend(common::small_validate_args(tmp.path()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = qwen35(&args);
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
    assert_eq!(o.status.code(), Some(0), "{text}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let compare = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "compare")
        .unwrap();
    let notes = compare["notes"].to_string();
    assert!(
        notes.contains("routing: every token chose the reference's 3 experts"),
        "{notes}"
    );
    let r = &v["compare"]["devices"][0]["routing"];
    assert_eq!(r["set_agreement"], 1.0, "{r}");
    assert_eq!(r["layers"].as_array().unwrap().len(), 4);
    assert!(r["pairs"].as_u64().unwrap() > 4 * 20, "{r}");
}
