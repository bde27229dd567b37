//! This project's MoE graphs through the binary on tiny-moe: `dump --backend openvino` writes the chosen experts
//! (i64) as transformers chose them; compare-devices on the CPU device and FP16SIM reports routing agreement and
//! classifies FP16SIM's flips; export-ir writes an MoE set that runs back through `--ir`, and ranges reads the
//! model. (The routing report itself is tested in routing.rs.)

use candle_core::DType;
use parity::dump::Dump;
use serde_json::Value;
use std::path::Path;

use crate::common;
use common::{golden_ids, qwen35, stderr, testdata};

fn model() -> String {
    testdata()
        .join("models/tiny-moe")
        .to_str()
        .unwrap()
        .to_string()
}

/// `qwen35 compare-devices … --json` on tiny-moe's shipped prompts: exit code and the JSON.
fn compare(dir: &Path, args: &[&str]) -> (Option<i32>, Value) {
    let json = dir.join("report.json");
    let model = model();
    let mut all = vec![
        "compare-devices",
        "--model",
        &model,
        "--json",
        json.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let o = qwen35(&all);
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
    assert!(!text.contains("panicked"), "{text}");
    let v = serde_json::from_str(&std::fs::read_to_string(&json).unwrap())
        .unwrap_or_else(|e| panic!("{e}: {text}"));
    println!("{text}");
    (o.status.code(), v)
}

/// Every layer of a device's routing report routed every token as the reference, in the same order.
fn routes_as_the_reference(device: &Value) -> usize {
    let r = &device["routing"];
    let layers = r["layers"]
        .as_array()
        .expect("an MoE model has a routing report");
    assert_eq!(layers.len(), 4);
    for l in layers {
        assert_eq!(l["same_order"], l["tokens"], "{l}");
    }
    assert_eq!(r["flips"].as_array().unwrap().len(), 0);
    layers
        .iter()
        .map(|l| l["tokens"].as_u64().unwrap() as usize)
        .sum()
}

#[test]
fn dump_on_the_cpu_device_writes_the_experts_transformers_chose() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ov.safetensors");
    let ids = golden_ids("tiny-moe");
    let model = model();
    let o = qwen35(&[
        "dump",
        "--backend",
        "openvino",
        "--model",
        &model,
        "--token-ids",
        &ids,
        "--generate",
        "4",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ours = Dump::read(&out).unwrap();
    let golden = Dump::read(&testdata().join("goldens/tiny-moe.safetensors")).unwrap();
    for layer in 0..4 {
        let name = format!("layers.{layer}.mlp.experts_chosen");
        let t = &ours.tensors[&name];
        assert_eq!(t.dtype(), DType::I64, "{name}");
        assert_eq!(
            t.to_vec2::<i64>().unwrap(),
            golden.tensors[&name].to_vec2::<i64>().unwrap(),
            "{name}"
        );
        for tap in ["router_logits", "expert_weights", "shared_output"] {
            let name = format!("layers.{layer}.mlp.{tap}");
            let d = reference::compare::diff(&ours.tensors[&name], &golden.tensors[&name]).unwrap();
            assert!(d.within(0.0, 1e-4), "{name}: {d}");
        }
    }
    let generated = ours.tensors["generated"].to_vec1::<i64>().unwrap();
    assert_eq!(
        generated,
        golden.tensors["generated"].to_vec1::<i64>().unwrap()[..4]
    );
}

#[test]
fn compare_devices_reports_routing_on_cpu_and_fp16sim() {
    let dir = tempfile::tempdir().unwrap();
    let (code, v) = compare(dir.path(), &["--devices", "CPU,FP16SIM:norm=fused"]);
    assert_eq!(code, Some(0));
    let devices = v["devices"].as_array().unwrap();
    let pairs = routes_as_the_reference(&devices[0]);
    assert!(pairs > 800, "{pairs} pairs");
    assert_eq!(devices[0]["passed"], true);
    // FP16SIM: fp16 router probabilities may flip near ties, never a confident choice.
    let r = &devices[1]["routing"];
    let flips = r["flips"].as_array().unwrap();
    assert_eq!(r["confident_flips"], 0, "{r}");
    for f in flips {
        assert_eq!(f["class"], "near_tie", "{f}");
    }
    let same: u64 = r["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["same_set"].as_u64().unwrap())
        .sum();
    println!(
        "FP16SIM:norm=fused: {same}/{pairs} pairs the same set, {} flips, all near ties",
        flips.len()
    );
}

#[test]
fn an_exported_moe_set_runs_through_ir_and_ranges_reads_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let set = dir.path().join("set");
    let model = model();
    let o = qwen35(&[
        "export-ir",
        "--model",
        &model,
        "--weights",
        "int4:16",
        "--layers",
        "--out",
        set.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let manifest = std::fs::read_to_string(set.join("manifest.json")).unwrap();
    assert!(manifest.contains("int4:16"), "{manifest}");
    let xml = std::fs::read_to_string(set.join("decoder_t16.xml")).unwrap();
    assert!(xml.contains("type=\"TopK\"") && xml.contains("layers.2.mlp.experts_chosen"));
    // tiny-moe's 8 experts of 3 chosen: `--moe-form auto` masks its prompt blocks (OneHot builds the routing matrix).
    assert!(xml.contains("type=\"OneHot\""));
    let (code, v) = compare(
        dir.path(),
        &[
            "--weights",
            "int4:16",
            "--ir",
            set.to_str().unwrap(),
            "--devices",
            "CPU",
        ],
    );
    assert_eq!(code, Some(0));
    routes_as_the_reference(&v["devices"][0]);
    let o = qwen35(&["ranges", "--model", &model]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `--moe-form` reaches the graphs: gathered prompt blocks have no routing matrix, masked ones do, one token gathers
/// either way; the reference and a set made elsewhere refuse the flag, naming it.
#[test]
fn moe_form_chooses_the_prompt_blocks_form() {
    let dir = tempfile::tempdir().unwrap();
    let model = model();
    for (form, one_hot) in [("gather", false), ("masked", true)] {
        let set = dir.path().join(form);
        let o = qwen35(&[
            "export-ir",
            "--model",
            &model,
            "--moe-form",
            form,
            "--blocks",
            "1,16",
            "--out",
            set.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let xml = |n| std::fs::read_to_string(set.join(format!("decoder_t{n}.xml"))).unwrap();
        assert_eq!(xml(16).contains("type=\"OneHot\""), one_hot, "{form}");
        assert!(
            !xml(1).contains("type=\"OneHot\""),
            "{form}: one token gathers"
        );
    }
    let out = dir.path().join("ref.safetensors");
    let o = qwen35(&[
        "dump",
        "--model",
        &model,
        "--moe-form",
        "gather",
        "--token-ids",
        "1,2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--moe-form"), "{}", stderr(&o));
    let set = dir.path().join("gather");
    let o = qwen35(&[
        "compare-devices",
        "--model",
        &model,
        "--ir",
        set.to_str().unwrap(),
        "--devices",
        "CPU",
        "--moe-form",
        "masked",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--moe-form"), "{}", stderr(&o));
}
