//! Undefined is `null`, everywhere: the real binary's JSON reports, walked generically, hold no number under a
//! measure's name (max, NMSE, NRMSE, cosine, KL, rates, …) where the values it is taken over hold NaN or infinity,
//! and no `identical: true`; the text says `undefined (why)`, never `NMSE 0.0e0` or "differ by up to 0.00e0".
//! Cases are generated: NaN and infinities planted in every kind of tensor of a dump, on either side of `diff`, and
//! a device whose logits turn NaN under `validate` (whose JSON carries the compare-devices and probe reports).

use candle_core::Tensor;
use parity::dump::Dump;
use serde_json::Value;
use std::path::Path;

use crate::common;
use common::{dump, qwen35, small_validate_args, stderr, testdata};

/// Whether `key` names a measure: a number taken over the values of two tensors (or of two distributions).
fn is_measure(key: &str) -> bool {
    matches!(
        key,
        "max_abs"
            | "max"
            | "nmse"
            | "rel_l2"
            | "nrmse"
            | "cosine"
            | "mean_abs"
            | "same_top1"
            | "top5_overlap"
            | "acceptance"
            | "tapped_vs_deployed"
    ) || key.starts_with("kl")
        || key.starts_with("delta_p")
        || key.starts_with("eos_drift")
        || key.contains("rate")
}

/// Whether an object counts NaN or infinite values among those its measures are taken over.
fn counts_non_finite(obj: &serde_json::Map<String, Value>) -> bool {
    [
        "nan",
        "inf",
        "ref_nan",
        "ref_inf",
        "non_finite",
        "ref_non_finite",
    ]
    .iter()
    .any(|k| obj.get(*k).and_then(Value::as_u64).unwrap_or(0) > 0)
}

/// Every place in `v` where a measure holds a number over non-finite values: inside an object that counts them,
/// or under one of `tainted` (keys whose values are known to be taken over NaN); and every `identical: true`.
fn offenders(v: &Value, tainted: &[&str]) -> Vec<String> {
    fn walk(v: &Value, path: &str, inherited: bool, tainted: &[&str], out: &mut Vec<String>) {
        match v {
            Value::Object(obj) => {
                let here = inherited || counts_non_finite(obj);
                for (k, x) in obj {
                    let p = format!("{path}.{k}");
                    if k == "identical" && x == &Value::Bool(true) {
                        out.push(format!("{p} = true"));
                    }
                    if here && is_measure(k) && x.is_number() {
                        out.push(format!("{p} = {x}"));
                    }
                    walk(x, &p, here || tainted.contains(&k.as_str()), tainted, out);
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    walk(x, &format!("{path}[{i}]"), inherited, tainted, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, "", false, tainted, &mut out);
    out
}

/// Text that states a fine-looking number for values that hold NaN.
fn fine_looking(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| {
            l.contains("NMSE 0.0e0")
                || l.contains("NMSE ≤ 0.0e0")
                || l.contains("up to 0.00e0")
                || l.contains("max |Δ| NaN")
                || l.contains("acceptance NaN")
                || l.contains("NaN%")
                || l.contains(")%")
        })
        .collect()
}

/// The keys whose values are taken over the logits (or what is chosen from them).
const OVER_LOGITS: [&str; 10] = [
    "logits",
    "agreement",
    "all",
    "prompt_positions",
    "generated_positions",
    "near_ties",
    "confident",
    "prompt_logits",
    "against_deployed",
    "generated",
];

#[test]
fn the_walk_finds_what_it_looks_for() {
    let bad = serde_json::json!({
        "a": {"nan": 3, "max_abs": 0.0, "nrmse": null},
        "logits": {"cosine": 1.0},
        "b": [{"identical": true}],
        "fine": {"nan": 0, "nmse": 1e-9, "same_top1": 1.0},
    });
    assert_eq!(
        offenders(&bad, &["logits"]),
        [
            ".a.max_abs = 0.0",
            ".b[0].identical = true",
            ".logits.cosine = 1.0"
        ]
    );
    assert!(fine_looking("prompt logits NMSE 0.0e0, ok").len() == 1);
    assert!(fine_looking("top-1 undefined (no values compared)%").len() == 1);
}

/// A copy of `d` with `value` planted in tensor `name` at every `stride`-th element from `start`, at `dir/file`.
fn planted(
    dir: &Path,
    d: &Dump,
    file: &str,
    name: &str,
    value: f32,
    start: usize,
    stride: usize,
) -> String {
    let t = &d.tensors[name];
    let dtype = t.dtype();
    let mut v = t
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let n = v.len();
    for x in v.iter_mut().skip(start % n).step_by(stride.max(1)) {
        *x = value;
    }
    let mut tensors = d.tensors.clone();
    tensors.insert(
        name.to_string(),
        Tensor::from_vec(v, t.dims(), t.device())
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
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

#[test]
fn diff_reports_no_number_over_nan() {
    let tmp = tempfile::tempdir().unwrap();
    let clean = dump(
        tmp.path(),
        "clean.safetensors",
        "11,22,33,44,55,66,77,88",
        3,
        &[],
    );
    let reference = tmp.path().join("clean.safetensors");
    let reference = reference.to_str().unwrap();
    let floats: Vec<&String> = clean
        .tensors
        .iter()
        .filter(|(_, t)| t.dtype().is_float())
        .map(|(n, _)| n)
        .collect();
    assert!(floats.len() > 10 && floats.iter().any(|n| *n == "logits"));
    // Generated cases: a tensor of every kind in turn (layer outputs, intermediates, states, the logits), NaN or
    // ±infinity, a single value or every few, in the dump under test or in the reference.
    let values = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
    let mut cases = 0;
    for (i, name) in floats.iter().enumerate().step_by(3).chain(
        floats
            .iter()
            .enumerate()
            .filter(|(_, n)| n.as_str() == "logits"),
    ) {
        let value = values[i % 3];
        let logits = name.as_str() == "logits";
        // The logits get a non-finite value in every row (so every measure over them is undefined); any other
        // tensor one value, or every few, from anywhere.
        let (start, stride) = if logits {
            (i % 5, [1, 7][i % 2])
        } else {
            (i * 13, [1, 7, usize::MAX][i % 3])
        };
        let file = format!("case{i}.safetensors");
        let bad = planted(tmp.path(), &clean, &file, name, value, start, stride);
        let swapped = i % 2 == 1;
        let (actual, expected) = if swapped {
            (reference, bad.as_str())
        } else {
            (bad.as_str(), reference)
        };
        let json = tmp.path().join(format!("case{i}.json"));
        let o = qwen35(&["diff", actual, expected, "--json", json.to_str().unwrap()]);
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
        let what = format!("{value} in `{name}` (stride {stride}, in the reference: {swapped})");
        assert_eq!(o.status.code(), Some(1), "{what}: {text}");
        assert!(!text.contains("panicked"), "{what}: {text}");
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(v["passed"], false, "{what}");
        let tainted: &[&str] = if name.as_str() == "logits" {
            &OVER_LOGITS
        } else {
            &[]
        };
        let bad_fields = offenders(&v, tainted);
        assert!(
            bad_fields.is_empty(),
            "{what}: numbers over NaN:\n{}",
            bad_fields.join("\n")
        );
        assert!(
            fine_looking(&text).is_empty(),
            "{what}: {:?}",
            fine_looking(&text)
        );
        cases += 1;
    }
    assert!(cases >= 5, "{cases} cases");
}

#[test]
fn validate_on_a_nan_device_reports_no_number_over_nan() {
    let tmp = tempfile::tempdir().unwrap();
    let model = testdata().join("models/tiny");
    let json = tmp.path().join("v.json");
    let mut args: Vec<String> = ["validate", "--model", model.to_str().unwrap()]
        .map(String::from)
        .to_vec();
    args.extend(small_validate_args(tmp.path()));
    args.extend(
        [
            "--inject-fault",
            "nan-from=0",
            "--json",
            json.to_str().unwrap(),
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = qwen35(&args);
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
    assert_eq!(o.status.code(), Some(1), "{text}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["passed"], false);
    // The device's logits are NaN from the first position: every measure over them, or over what is chosen from
    // them, is undefined, in the checks' details and in the compare-devices and probe reports alike.
    let bad_fields = offenders(&v, &OVER_LOGITS);
    assert!(
        bad_fields.is_empty(),
        "numbers over NaN:\n{}",
        bad_fields.join("\n")
    );
    assert!(fine_looking(&text).is_empty(), "{:?}", fine_looking(&text));
    assert!(
        v["compare"]["devices"][0]["logits"]["undefined"]
            .as_str()
            .is_some_and(|w| w.contains("NaN on the device side")),
        "{}",
        v["compare"]["devices"][0]["logits"]
    );
    // No check over the NaN logits passes.
    for c in v["checks"].as_array().unwrap() {
        if [
            "blocks",
            "padding",
            "prefix-reuse",
            "prompt-lookup",
            "back-to-back",
            "length",
            "compare",
        ]
        .contains(&c["id"].as_str().unwrap())
        {
            assert_eq!(c["passed"], false, "{c}");
        }
    }
}
