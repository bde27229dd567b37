//! A model and what is asked of it that do not belong together are refused before any work, naming both sides:
//! `--moe-form` with a dense model, on every command that takes it; a graph set whose manifest names another model
//! than `--model`, two graphs for one call of a layer, or a layer the model does not have.

use crate::common;
use common::{expect_error, testdata};
use serde_json::Value;

/// Every command that takes `--moe-form` on this project's graphs, with what it needs to reach the check.
fn moe_form_commands(out: &std::path::Path) -> Vec<Vec<String>> {
    let dump = out.join("dump.bin").display().to_string();
    let ir = out.join("ir").display().to_string();
    [
        vec![
            "dump",
            "--backend",
            "openvino",
            "--prompt",
            "hi",
            "--out",
            &dump,
        ],
        vec!["validate", "--device", "CPU"],
        vec!["compare-devices", "--devices", "CPU"],
        vec!["probe", "--device", "CPU"],
        vec!["bench", "--backend", "openvino"],
        vec!["export-ir", "--out", &ir],
    ]
    .into_iter()
    .map(|c| c.into_iter().map(String::from).collect())
    .collect()
}

#[test]
fn moe_form_with_a_dense_model_is_refused_by_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let model = testdata().join("models/tiny");
    let model_arg = model.display().to_string();
    let mut cases = 0;
    for command in moe_form_commands(tmp.path()) {
        for form in ["auto", "gather", "masked"] {
            let mut args: Vec<&str> = command.iter().map(String::as_str).collect();
            args.extend(["--model", &model_arg, "--moe-form", form]);
            expect_error(&args, &["--moe-form", &model_arg, "dense"]);
            cases += 1;
        }
    }
    assert_eq!(cases, 18);
    // Nothing written: the refusal comes before any work.
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

/// The sets in `testdata/sets/` (each names `models/tiny` as its model).
fn sets() -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(testdata().join("sets"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("manifest.json").is_file())
        .collect();
    v.sort();
    v
}

/// Refusals come before any work: `validate` on the CPU device, the set under `--ir`.
fn validate_set(ir: &std::path::Path, model: &std::path::Path) -> Vec<String> {
    [
        "validate",
        "--device",
        "CPU",
        "--ir",
        ir.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

#[test]
fn a_set_made_for_another_model_is_refused() {
    let other = testdata().join("models/tiny-h128");
    let sets = sets();
    assert!(sets.len() >= 5);
    for set in sets {
        let args = validate_set(&set, &other);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        expect_error(
            &args,
            &[
                "manifest.json",
                "models/tiny",
                "another model than --model",
                other.to_str().unwrap(),
            ],
        );
    }
}

/// The manifest of `set` rewritten by `edit` into a folder of its own (files and model named by absolute path).
fn edited(
    set: &std::path::Path,
    into: &std::path::Path,
    edit: impl FnOnce(&mut Value),
) -> std::path::PathBuf {
    let mut m: Value =
        serde_json::from_str(&std::fs::read_to_string(set.join("manifest.json")).unwrap()).unwrap();
    m["model"] = Value::String(testdata().join("models/tiny").display().to_string());
    for g in m["layers"]["graphs"].as_array_mut().unwrap() {
        for key in ["xml", "bin"] {
            let f = set.join(g[key].as_str().unwrap());
            g[key] = Value::String(f.display().to_string());
        }
    }
    edit(&mut m);
    std::fs::create_dir_all(into).unwrap();
    std::fs::write(into.join("manifest.json"), m.to_string()).unwrap();
    into.to_path_buf()
}

#[test]
fn a_manifest_with_two_graphs_for_one_layer_or_a_layer_beyond_the_model_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let set = testdata().join("sets/tiny-layers");
    let model = testdata().join("models/tiny");
    let layers = common::config("tiny").num_layers();
    let m: Value =
        serde_json::from_str(&std::fs::read_to_string(set.join("manifest.json")).unwrap()).unwrap();
    let graphs = m["layers"]["graphs"].as_array().unwrap().clone();
    assert!(graphs.len() >= 8);
    let mut cases = 0;
    for (i, g) in graphs.iter().enumerate() {
        let layer = g["layer"].as_u64().unwrap();
        // The same call given another file: the next entry's graph.
        let other = graphs[(i + 1) % graphs.len()]["xml"].clone();
        let dir = edited(&set, &tmp.path().join(format!("dup{i}")), |m| {
            let list = m["layers"]["graphs"].as_array_mut().unwrap();
            let mut twin = list[i].clone();
            twin["xml"] = Value::String(set.join(other.as_str().unwrap()).display().to_string());
            list.push(twin);
        });
        let args = validate_set(&dir, &model);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        expect_error(
            &args,
            &["manifest.json", &format!("second graph of layer {layer} ")],
        );
        cases += 1;
        // The layer moved beyond the model's last.
        for beyond in [layers, layers + 1, 1000] {
            let dir = edited(&set, &tmp.path().join(format!("beyond{i}-{beyond}")), |m| {
                m["layers"]["graphs"][i]["layer"] = Value::from(beyond);
            });
            let args = validate_set(&dir, &model);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            expect_error(
                &args,
                &[
                    "manifest.json",
                    &format!("names layer {beyond}, but the model has {layers} layers"),
                ],
            );
            cases += 1;
        }
    }
    assert_eq!(cases, graphs.len() * 4);
    // A state's port names given per layer, one of them for a layer beyond the model's last.
    let states = m["layers"]["states"].as_object().unwrap().clone();
    assert!(states.len() >= 4);
    for (state, spec) in &states {
        for side in ["input", "output"] {
            let name = spec[side].clone();
            let mut per_layer: serde_json::Map<String, Value> = (0..=layers)
                .map(|l| (l.to_string(), name.clone()))
                .collect();
            per_layer.insert("1000".into(), name.clone());
            let dir = edited(&set, &tmp.path().join(format!("{state}-{side}")), |m| {
                m["layers"]["states"][state][side] = Value::Object(per_layer);
            });
            let args = validate_set(&dir, &model);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            expect_error(
                &args,
                &[
                    "manifest.json",
                    &format!("state {side}"),
                    &format!("names layer {layers}, but the model has {layers} layers"),
                ],
            );
        }
    }
}
