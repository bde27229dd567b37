//! The fixtures the bad-input cases name: a clean dump of the tiny model and dumps planted with what a broken device
//! writes, broken checkpoints, graph sets with a wrong manifest, and files for options.

use crate::common::{copy_dir, testdata};
use candle_core::Tensor;
use parity::dump::Dump;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The largest count a flag takes.
const U64_MAX: &str = "18446744073709551615";

/// The fixtures every case may name, by placeholder.
pub struct Fixtures {
    _dir: tempfile::TempDir,
    paths: BTreeMap<&'static str, String>,
}

/// A copy of `d` with `edit` applied to its tensors, written to `path`.
fn edited(d: &Dump, path: &Path, edit: impl FnOnce(&mut BTreeMap<String, Tensor>)) {
    let mut tensors = d.tensors.clone();
    edit(&mut tensors);
    Dump {
        tensors,
        metadata: d.metadata.clone(),
    }
    .write(path)
    .unwrap();
}

/// `t` with `f` applied to its f32 values.
fn map_f32(t: &Tensor, f: impl FnOnce(&mut [f32])) -> Tensor {
    let mut v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    f(&mut v);
    Tensor::from_vec(v, t.dims(), t.device()).unwrap()
}

pub fn ids(v: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &candle_core::Device::Cpu).unwrap()
}

/// A copy of the tiny graph set whose manifest `edit` changes (its model made absolute, so the copy finds it).
fn edited_set(dst: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    copy_dir(&testdata().join("sets/tiny-decoder"), dst);
    let path = dst.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    m["model"] = testdata()
        .join("models/tiny")
        .canonicalize()
        .unwrap()
        .to_str()
        .unwrap()
        .into();
    edit(&mut m);
    std::fs::write(&path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
}

/// A change to a checkpoint's tensors.
type TensorEdit = Box<dyn FnOnce(&mut std::collections::HashMap<String, Tensor>)>;

/// A copy of the tiny model with `edit` applied to its config and (when given) its tensors.
fn edited_model(
    dst: &Path,
    config: impl FnOnce(&mut serde_json::Value),
    tensors: Option<TensorEdit>,
) {
    copy_dir(&testdata().join("models/tiny"), dst);
    let path = dst.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config(&mut c);
    std::fs::write(&path, c.to_string()).unwrap();
    if let Some(edit) = tensors {
        let file = dst.join("model.safetensors");
        let mut t = candle_core::safetensors::load(&file, &candle_core::Device::Cpu).unwrap();
        edit(&mut t);
        candle_core::safetensors::save(&t, &file).unwrap();
    }
}

pub fn fixtures() -> Fixtures {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let p = |name: &str| root.join(name);
    let mut paths: BTreeMap<&'static str, String> = BTreeMap::new();
    let mut put = |key: &'static str, path: PathBuf| {
        paths.insert(key, path.to_str().unwrap().to_string());
    };

    // A clean dump of the tiny model, and dumps planted with what a broken device (or program) writes.
    let clean = p("clean.safetensors");
    let o = Command::new(env!("CARGO_BIN_EXE_qwen35"))
        .args([
            "dump",
            "--token-ids",
            "11,22,33,44,55,66,77,88",
            "--generate",
            "3",
        ])
        .arg("--out")
        .arg(&clean)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let d = Dump::read(&clean).unwrap();
    put("clean", clean);
    let logits = |f: fn(&mut [f32])| {
        let t = map_f32(&d.tensors["logits"], f);
        move |m: &mut BTreeMap<String, Tensor>| {
            m.insert("logits".into(), t);
        }
    };
    edited(
        &d,
        &p("nan_logits.safetensors"),
        logits(|v| v.iter_mut().step_by(7).for_each(|x| *x = f32::NAN)),
    );
    put("nan_logits", p("nan_logits.safetensors"));
    edited(&d, &p("all_nan.safetensors"), logits(|v| v.fill(f32::NAN)));
    put("all_nan", p("all_nan.safetensors"));
    let core = "layers.0.linear_attn.core_output";
    edited(&d, &p("nan_core.safetensors"), |m| {
        let t = map_f32(&m[core], |v| v[v.len() / 2] = f32::NAN);
        m.insert(core.into(), t);
    });
    put("nan_core", p("nan_core.safetensors"));
    let state = "layers.0.recurrent_state";
    edited(&d, &p("inf_state.safetensors"), |m| {
        let t = map_f32(&m[state], |v| v[0] = f32::INFINITY);
        m.insert(state.into(), t);
    });
    put("inf_state", p("inf_state.safetensors"));
    edited(&d, &p("big_id.safetensors"), |m| {
        m.insert("generated".into(), ids(&[5, 1 << 40, 7], &[3]));
    });
    put("big_id", p("big_id.safetensors"));
    edited(&d, &p("big_prompt_id.safetensors"), |m| {
        m.insert(
            "token_ids".into(),
            ids(&[11, 22, 33, 44, 55, 66, 77, -1], &[8]),
        );
    });
    put("big_prompt_id", p("big_prompt_id.safetensors"));
    edited(&d, &p("gen_2d.safetensors"), |m| {
        m.insert("generated".into(), ids(&[5, 6, 7, 8], &[2, 2]));
    });
    put("gen_2d", p("gen_2d.safetensors"));
    edited(&d, &p("logits_1d.safetensors"), |m| {
        let t = m["logits"].flatten_all().unwrap();
        m.insert("logits".into(), t);
    });
    put("logits_1d", p("logits_1d.safetensors"));
    edited(&d, &p("other_prompt.safetensors"), |m| {
        m.insert(
            "token_ids".into(),
            ids(&[11, 22, 33, 44, 55, 66, 77, 89], &[8]),
        );
    });
    put("other_prompt", p("other_prompt.safetensors"));

    // Checkpoints.
    edited_model(
        &p("nan_model"),
        |_| {},
        Some(Box::new(|t| {
            let name = "model.layers.1.input_layernorm.weight";
            let w = map_f32(&t[name], |v| v[3] = f32::NAN);
            t.insert(name.into(), w);
        })),
    );
    put("nan_model", p("nan_model"));
    edited_model(
        &p("no_positions"),
        |c| {
            c.as_object_mut().unwrap().remove("max_position_embeddings");
        },
        None,
    );
    put("no_positions", p("no_positions"));
    for (key, map) in [
        (
            "traversal",
            serde_json::json!({"model.embed_tokens.weight": "../../../etc/passwd"}),
        ),
        ("no_weight_map", serde_json::json!(["model.safetensors"])),
    ] {
        let dst = root.join(key);
        copy_dir(&testdata().join("models/tiny"), &dst);
        std::fs::remove_file(dst.join("model.safetensors")).unwrap();
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(dst.join("model.safetensors.index.json"), index.to_string()).unwrap();
        put(key, dst);
    }
    put("config_file", testdata().join("models/tiny/config.json"));
    copy_dir(&testdata().join("models/tiny"), &p("model_copy"));
    put("model_copy", p("model_copy"));

    // Graph sets with a wrong manifest.
    edited_set(&p("version99"), |m| m["version"] = 99.into());
    put("version99", p("version99"));
    edited_set(&p("v1_version99"), |m| {
        m["format"] = "qwen35-external-ir".into();
        m["version"] = 99.into();
    });
    put("v1_version99", p("v1_version99"));
    edited_set(&p("int9"), |m| m["reference_weights"] = "int9".into());
    put("int9", p("int9"));
    edited_set(&p("no_model"), |m| m["model"] = "no/such/model".into());
    put("no_model", p("no_model"));

    // Files for options.
    std::fs::write(p("f16.json"), r#"{"INFERENCE_PRECISION_HINT": "f16"}"#).unwrap();
    put("f16_config", p("f16.json"));
    std::fs::write(
        p("prompts.jsonl"),
        "{\"label\": \"a\", \"token_ids\": [1, 2, 3]}\n",
    )
    .unwrap();
    put("prompts", p("prompts.jsonl"));
    let lib = npu::runtime::locate().unwrap();
    let cpp = std::fs::read_dir(lib.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libopenvino.so"))
        })
        .expect("the C++ library beside libopenvino_c");
    put("cpp_lib", cpp);
    put("tmp", root.to_path_buf());
    let long: Vec<String> = (0..3000).map(|i| (i % 90 + 1).to_string()).collect();
    paths.insert("long", long.join(","));
    paths.insert("u64max", U64_MAX.to_string());
    Fixtures { _dir: dir, paths }
}

/// `text` with every `{name}` replaced by its fixture.
pub fn fill(text: &str, f: &Fixtures) -> String {
    let mut out = text.to_string();
    for (k, v) in &f.paths {
        out = out.replace(&format!("{{{k}}}"), v);
    }
    out
}
