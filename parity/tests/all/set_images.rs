//! A graph set that brings its own static vision graphs (`--ir DIR`, its manifest's `vision`), on `tiny-vl`:
//! `export-ir --image-grid` (one graph per grid, decoder graphs taking embeddings) writes a set that runs prompts with
//! images end to end, each image through the set's graph of its grid; `dump --ir` gives transformers' greedy tokens,
//! positions and vision taps, and `compare-devices --ir` passes with the image embeddings' line. A set without a
//! graph of the image's grid, without `vision`, or whose decoder takes token ids is refused naming its manifest; a
//! vision graph whose weights are changed fails the comparison (the set's graph is what runs).

use crate::common;

use candle_core::{DType, Tensor};
use common::vl::{LOGITS_ATOL, VISION_RTOL, golden};
use common::{expect_error, qwen35, stderr, testdata};
use parity::dump::Dump;
use reference::compare::diff;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn model() -> PathBuf {
    testdata().join("models/tiny-vl")
}

fn image(name: &str) -> String {
    testdata()
        .join("images")
        .join(name)
        .to_str()
        .unwrap()
        .to_string()
}

/// `export-ir` of tiny-vl into `out` with `extra` flags.
fn export(out: &Path, extra: &[&str]) {
    let m = model();
    let mut args = vec![
        "export-ir",
        "--model",
        m.to_str().unwrap(),
        "--blocks",
        "4",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = qwen35(&args);
    assert!(o.status.success(), "{}", stderr(&o));
}

fn compare_args<'a>(set: &'a str, json: &'a str, images: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "compare-devices",
        "--ir",
        set,
        "--devices",
        "CPU",
        "--prompt",
        "What is in the pictures?",
        "--tokens",
        "6",
        "--json",
        json,
    ];
    for i in images {
        args.extend(["--image", i]);
    }
    args
}

fn manifest(set: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(set.join("manifest.json")).unwrap()).unwrap()
}

fn write_manifest(set: &Path, m: &serde_json::Value) {
    std::fs::write(
        set.join("manifest.json"),
        serde_json::to_string_pretty(m).unwrap(),
    )
    .unwrap();
}

#[test]
fn a_set_with_a_vision_graph_per_grid_runs_images_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let set = dir.path().join("set");
    // The goldens' two images: 8x10 and 4x4 patches, one graph each, as a port ships one per fixed grid.
    export(&set, &["--image-grid", "8x10", "--image-grid", "4x4"]);
    let m = manifest(&set);
    assert_eq!(m["vision"][0]["xml"], "vision_h8_w10.xml");
    assert_eq!(m["vision"][1]["grid_thw"], serde_json::json!([[1, 4, 4]]));
    assert!(m["decoder"]["inputs"]["embeddings"].is_object(), "{m}");

    // dump --ir with transformers' own pixel values and ids: its greedy tokens, positions and vision taps.
    let g = golden();
    let pixels = dir.path().join("pixels.safetensors");
    let t: HashMap<String, Tensor> = [
        ("pixel_values".to_string(), g["images.pixel_values"].clone()),
        (
            "image_grid_thw".to_string(),
            g["images.image_grid_thw"].clone(),
        ),
    ]
    .into();
    candle_core::safetensors::save(&t, &pixels).unwrap();
    let ids: Vec<i64> = g["images.token_ids"].to_vec1().unwrap();
    let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
    let out = dir.path().join("dump.safetensors");
    let o = qwen35(&[
        "dump",
        "--backend",
        "openvino",
        "--ir",
        set.to_str().unwrap(),
        "--pixel-values",
        pixels.to_str().unwrap(),
        "--token-ids",
        &ids.join(","),
        "--generate",
        &g["images.generated"].dim(0).unwrap().to_string(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let d = Dump::read(&out).unwrap();
    let as_ids = |t: &Tensor| -> Vec<i64> { t.to_dtype(DType::I64).unwrap().to_vec1().unwrap() };
    assert_eq!(
        as_ids(d.get("generated").unwrap()),
        as_ids(&g["images.generated"]),
        "greedy tokens through the set's vision and decoder graphs differ from transformers'"
    );
    let positions: Vec<Vec<i64>> = d.get("positions").unwrap().to_vec2().unwrap();
    let expected: Vec<Vec<i64>> = g["images.positions"].to_vec2().unwrap();
    assert_eq!(positions, expected);
    // Each image through its own graph, the rows concatenated in image order: the reference's taps.
    for tap in [
        "vision.patch_embed",
        "vision.blocks.1.output",
        "vision.merger",
    ] {
        let e = diff(d.get(tap).unwrap(), &g[&format!("images.{tap}")]).unwrap();
        println!("set {tap}: {e}");
        assert!(e.within(0.0, VISION_RTOL), "{tap}: {e}");
    }
    let e = diff(d.get("logits").unwrap(), &g["images.logits"]).unwrap();
    println!("set logits: {e}");
    assert!(e.within(LOGITS_ATOL, 0.0), "logits: {e}");
    assert_eq!(d.metadata["vision_graph"], "vision_h8_w10, vision_h4_w4");

    // compare-devices --ir with the image files: the image embeddings' line, the set's graphs named.
    let json = dir.path().join("compare.json");
    let (s, j) = (set.to_str().unwrap(), json.to_str().unwrap());
    let (wide, small) = (image("wide.png"), image("small.png"));
    let o = qwen35(&compare_args(s, j, &[&wide, &small]));
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains(
            "image embeddings (vision.merger, the set's vision graph vision_h8_w10, vision_h4_w4)"
        ),
        "{stdout}"
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let device = &r["devices"][0];
    assert_eq!(
        device["vision_graph"],
        "the set's vision graph vision_h8_w10, vision_h4_w4"
    );
    assert_eq!(device["greedy_matched"], device["greedy_total"]);
    let vision = device["vision"]
        .as_array()
        .expect("the vision taps' errors");
    let merger = &vision[vision.len() - 1];
    assert_eq!(merger["name"], "vision.merger");
    println!("compare-devices --ir merger: {}", merger["error"]);
    assert!(
        merger["error"]["nrmse"].as_f64().unwrap() < 1e-5,
        "{merger}"
    );
}

#[test]
fn a_set_that_cannot_make_the_image_rows_is_refused_naming_its_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let (json, small, wide) = (
        dir.path().join("c.json"),
        image("small.png"),
        image("wide.png"),
    );
    let j = json.to_str().unwrap();
    // A graph of 8x10 patches only: the 4x4 image has none; the message says which grids the set has and how to
    // resize to one.
    let set = dir.path().join("grid");
    export(&set, &["--image-grid", "8x10"]);
    let s = set.to_str().unwrap();
    expect_error(
        &compare_args(s, j, &[&small]),
        &[
            "manifest.json",
            "small.png",
            "4x4 patches",
            "8x10",
            "--image-size",
        ],
    );
    expect_error(
        &[
            "dump",
            "--backend",
            "openvino",
            "--ir",
            s,
            "--prompt",
            "hi",
            "--image",
            &small,
            "--out",
            dir.path().join("d.safetensors").to_str().unwrap(),
        ],
        &["manifest.json", "small.png", "4x4 patches", "--image-size"],
    );
    // No `vision`: the set cannot make image rows.
    let text = dir.path().join("text");
    export(&text, &[]);
    let t = text.to_str().unwrap();
    expect_error(
        &compare_args(t, j, &[&wide]),
        &["manifest.json", "no `vision` graph"],
    );
    // A vision graph beside decoder graphs that take token ids: the rows have nowhere to go.
    for f in ["vision_h8_w10.xml", "vision_h8_w10.bin"] {
        std::fs::copy(set.join(f), text.join(f)).unwrap();
    }
    let mut m = manifest(&text);
    m["vision"] = manifest(&set)["vision"].clone();
    write_manifest(&text, &m);
    expect_error(
        &compare_args(t, j, &[&wide]),
        &["manifest.json", "takes `input_ids`, not `embeddings`"],
    );
    // A description that does not match the graph's ports: the key and the file named.
    let mut m = manifest(&set);
    m["vision"][0]["output"]["name"] = serde_json::json!("rows");
    write_manifest(&set, &m);
    expect_error(
        &compare_args(s, j, &[&wide]),
        &[
            "manifest.json",
            "`vision[0].output`",
            "vision_h8_w10.xml",
            "`rows`",
        ],
    );
    // The manifest's grid is not the graph's: the image resized to it (8x8 patches of 4 pixels) is refused by the
    // port check, naming the dim.
    m["vision"][0]["output"]["name"] = serde_json::json!("vision.merger");
    m["vision"][0]["grid_thw"] = serde_json::json!([[1, 8, 8]]);
    write_manifest(&set, &m);
    expect_error(
        &compare_args(s, j, &[&wide]),
        &[
            "manifest.json",
            "8x10 patches",
            "the grid 8x8",
            "--image-size 32x32",
        ],
    );
    let mut args = compare_args(s, j, &[&wide]);
    args.extend(["--image-size", "32x32"]);
    expect_error(
        &args,
        &[
            "manifest.json",
            "`vision[0].input`",
            "`pixel_values` dim 0 is 80 in the graph, but `patches` is 64",
        ],
    );
    m["vision"][0]["grid_thw"] = serde_json::json!([[1, 8, 10]]);
    m["vision"][0]["input"]["shape"] = serde_json::json!(["patch_dim", "patches"]);
    write_manifest(&set, &m);
    expect_error(
        &compare_args(s, j, &[&wide]),
        &["manifest.json", "`vision[0].input.shape`"],
    );
}

/// Scales the largest f32 constant of an IR's `.bin` by 1.5.
fn scale_largest_constant(xml: &Path) {
    let text = std::fs::read_to_string(xml).unwrap();
    let attr = |line: &str, key: &str| -> Option<usize> {
        let at = line.find(&format!(" {key}=\""))? + key.len() + 3;
        line[at..].split('"').next()?.parse().ok()
    };
    let (offset, size) = text
        .lines()
        .filter(|l| l.contains("<data element_type=\"f32\"") && l.contains("offset="))
        .filter_map(|l| Some((attr(l, "offset")?, attr(l, "size")?)))
        .max_by_key(|&(_, size)| size)
        .expect("an f32 constant");
    let bin = xml.with_extension("bin");
    let mut bytes = std::fs::read(&bin).unwrap();
    for c in bytes[offset..offset + size].chunks_exact_mut(4) {
        let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * 1.5;
        c.copy_from_slice(&x.to_le_bytes());
    }
    std::fs::write(&bin, bytes).unwrap();
}

#[test]
fn the_sets_vision_graph_is_what_makes_the_image_rows() {
    let dir = tempfile::tempdir().unwrap();
    let set = dir.path().join("set");
    export(&set, &["--image-grid", "8x10"]);
    scale_largest_constant(&set.join("vision_h8_w10.xml"));
    let json = dir.path().join("c.json");
    let wide = image("wide.png");
    let o = qwen35(&compare_args(
        set.to_str().unwrap(),
        json.to_str().unwrap(),
        &[&wide],
    ));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let vision = r["devices"][0]["vision"].as_array().unwrap();
    let merger = &vision[vision.len() - 1];
    println!("changed vision graph, merger: {}", merger["error"]);
    assert!(
        merger["error"]["nrmse"].as_f64().unwrap() > 1e-3,
        "{merger}"
    );
}

/// `validate --ir --image` and `probe --ir --image` on the set: the images check runs the set's own vision graph
/// (its taps against the reference tower, the decoder on its rows, the text after the image) and passes; the probe
/// reaches the decoder's layers through its states, on the prompt with the image, each layer within 1e-5. The
/// set's tower is one graph, so its blocks are not probed, and the reports say so.
#[test]
fn validate_and_probe_of_a_set_run_its_vision_graph_and_its_decoder_on_the_image_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let set = tmp.path().join("set");
    export(&set, &["--image-grid", "8x10"]);
    let (m, s) = (model(), set.to_str().unwrap().to_string());
    let prompts = common::two_prompts(tmp.path());
    let json = tmp.path().join("v.json");
    let wide = image("wide.png");
    let o = qwen35(&[
        "validate",
        "--ir",
        &s,
        "--model",
        m.to_str().unwrap(),
        "--device",
        "CPU",
        "--tokens",
        "4",
        "--lookup-tokens",
        "8",
        "--max-length",
        "40",
        "--prompts",
        prompts.to_str().unwrap(),
        "--image",
        &wide,
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let images = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "images")
        .unwrap();
    assert_eq!(images["passed"], true, "{images}");
    assert!(
        images["figure"].as_str().unwrap().contains("not probed"),
        "{images}"
    );
    let merger = images["details"]["vision"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "vision.merger")
        .unwrap()
        .clone();
    assert!(
        merger["error"]["nrmse"].as_f64().unwrap() < 1e-6,
        "{merger}"
    );
    assert!(images["details"]["follow_up"]["first_divergence"].is_null());
    assert_eq!(v["probe"]["inputs"]["prompt"], "with 1 image(s)");

    let pjson = tmp.path().join("p.json");
    let o = qwen35(&[
        "probe",
        "--ir",
        &s,
        "--model",
        m.to_str().unwrap(),
        "--device",
        "CPU",
        "--prompt",
        "hi",
        "--image",
        &wide,
        "--json",
        pjson.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("not probed"), "{}", stderr(&o));
    let p: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&pjson).unwrap()).unwrap();
    assert_eq!(p["inputs"]["prompt"], "with 1 image(s)");
    for l in p["layers"].as_array().unwrap() {
        assert!(l["output"]["nrmse"].as_f64().unwrap() < 1e-5, "{l}");
    }
}
