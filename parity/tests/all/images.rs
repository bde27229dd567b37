//! Prompts with images through the command line, on `tiny-vl` against transformers' goldens
//! (scripts/make_vision_goldens.py): `dump --pixel-values` with the goldens' own pixel values and token ids, on the
//! reference and on OpenVINO's CPU device (the static vision graph, then decoder graphs fed embeddings), must give
//! transformers' greedy tokens, positions, vision taps and logits; `run --image` preprocesses the committed images
//! itself; a prompt whose image tokens do not fit its images is refused, naming the image; compare-devices, export-ir,
//! ranges and probe take images. Videos: `videos.rs`.

use crate::common;

use candle_core::DType;
use common::vl::*;
use common::{expect_error, qwen35, stderr, testdata};
use reference::compare::diff;

#[test]
fn a_dump_with_images_matches_transformers_on_the_reference_and_on_the_cpu_device() {
    let g = golden();
    let dir = tempfile::tempdir().unwrap();
    let pixels = dir.path().join("pixels.safetensors");
    write_pixel_values(&g, &pixels);
    dump_case(&g, dir.path(), &pixels, "images");
}

#[test]
fn run_takes_image_files_and_refuses_prompts_that_do_not_fit_them() {
    let model = testdata().join("models/tiny-vl");
    let (m, wide, small) = (
        model.to_str().unwrap().to_string(),
        testdata().join("images/wide.png"),
        testdata().join("images/small.png"),
    );
    let (wide, small) = (wide.to_str().unwrap(), small.to_str().unwrap());
    let o = qwen35(&[
        "run",
        "--model",
        &m,
        "--prompt",
        "What is in the pictures?",
        "--image",
        wide,
        "--image",
        small,
        "--max-tokens",
        "4",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Two images of 8x10 and 4x4 patches merge 2x2 into 20 and 4 rows: ids with 3 image tokens for the first
    // image are refused, naming it.
    let g = golden();
    let mut ids: Vec<i64> = g["images.token_ids"].to_vec1().unwrap();
    let first = ids.iter().position(|&i| i == 514).unwrap();
    ids.drain(first..first + 17);
    let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
    expect_error(
        &[
            "dump",
            "--model",
            &m,
            "--image",
            wide,
            "--image",
            small,
            "--token-ids",
            &ids.join(","),
            "--out",
            "unused.safetensors",
        ],
        &["image 1", "3 image token", "20"],
    );
    // A text-only checkpoint takes no images; a fixed size must be whole merge blocks (8 pixels here).
    let tiny = testdata().join("models/tiny");
    expect_error(
        &[
            "run",
            "--model",
            tiny.to_str().unwrap(),
            "--prompt",
            "hi",
            "--image",
            wide,
        ],
        &["vision_config"],
    );
    expect_error(
        &[
            "run",
            "--model",
            &m,
            "--prompt",
            "hi",
            "--image",
            wide,
            "--image-size",
            "12x16",
        ],
        &["--image-size 12x16", "multiples of 8"],
    );
    expect_error(
        &[
            "run",
            "--model",
            &m,
            "--prompt",
            "hi",
            "--image",
            wide,
            "--image-size",
            "512",
        ],
        &["WIDTHxHEIGHT"],
    );
}

#[test]
fn compare_devices_with_images_reports_the_image_embeddings_and_passes_on_the_cpu_device() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("compare.json");
    let model = testdata().join("models/tiny-vl");
    let (wide, small) = (
        testdata().join("images/wide.png"),
        testdata().join("images/small.png"),
    );
    let o = qwen35(&[
        "compare-devices",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "What is in the pictures?",
        "--image",
        wide.to_str().unwrap(),
        "--image",
        small.to_str().unwrap(),
        "--devices",
        "CPU",
        "--tokens",
        "6",
        "--json",
        json.to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("image embeddings (vision.merger"),
        "{stdout}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let device = &report["devices"][0];
    assert_eq!(device["greedy_matched"], device["greedy_total"]);
    let vision = device["vision"]
        .as_array()
        .expect("the vision taps' errors");
    let names: Vec<&str> = vision.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names.first(), Some(&"vision.patch_embed"));
    assert_eq!(names.last(), Some(&"vision.merger"));
    let merger = &vision[vision.len() - 1]["error"];
    assert!(merger["nrmse"].as_f64().unwrap() < 1e-5, "{merger}");
    assert!(merger["cosine"].as_f64().unwrap() > 0.99999, "{merger}");
    // The memory estimate made before work counts the vision towers' taps.
    let parts = report["memory"]["peak_phase"]["parts"].as_array().unwrap();
    assert!(
        parts.iter().any(|p| p["what"] == "the vision towers' taps"),
        "{parts:?}"
    );
}

#[test]
fn export_ir_writes_the_vision_graph_that_compiles_back_to_the_reference_tower() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("set");
    let model = testdata().join("models/tiny-vl");
    let o = qwen35(&[
        "export-ir",
        "--model",
        model.to_str().unwrap(),
        "--blocks",
        "4",
        "--image-grid",
        "8x10",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["vision"][0]["xml"], "vision_h8_w10.xml");
    assert_eq!(
        manifest["vision"][0]["grid_thw"],
        serde_json::json!([[1, 8, 10]])
    );
    // The decoder graphs take embeddings (the vision graph's rows for the image tokens), and the set reads back
    // with its vision graph.
    assert!(manifest["decoder"]["inputs"]["embeddings"].is_object());
    let set = npu::graphset::manifest::open(&out).unwrap();
    assert_eq!(set.vision.len(), 1);
    assert_eq!(
        set.vision[0].grids,
        [reference::vision::Grid { t: 1, h: 8, w: 10 }]
    );
    // The written graph, compiled from its files on CPU, against the reference tower on the goldens' first image.
    let g = golden();
    let pixels = g["images.pixel_values"].narrow(0, 0, 80).unwrap();
    let xml = out.join("vision_h8_w10.xml");
    let mut core = npu::runtime::core().unwrap();
    let compiled = npu::devices::compile_ir(
        &mut core,
        &xml,
        &xml.with_extension("bin"),
        "vision",
        "CPU",
        &npu::devices::CompileOptions::default(),
    )
    .unwrap();
    let mut session = npu::infer::Session::new(compiled).unwrap();
    use npu::infer::Executor;
    let got = session
        .run(&[(npu::graphs::vision::PIXELS, &pixels)])
        .unwrap();
    let vc = reference::vision::VisionConfig::from_file(&model.join("config.json"))
        .unwrap()
        .unwrap();
    let store = reference::weights::WeightStore::open(&model, DType::F32).unwrap();
    let tower = reference::vision::VisionTower::load(vc, &store).unwrap();
    let grid = reference::vision::Grid { t: 1, h: 8, w: 10 };
    let expected = tower
        .forward(&pixels, &[grid], &mut reference::taps::Taps::off())
        .unwrap();
    let e = diff(&got["vision.merger"], &expected).unwrap();
    assert!(e.within(0.0, VISION_RTOL), "{e}");
}

#[test]
fn ranges_cover_the_vision_tower_ahead_of_the_decoder() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("ranges.json");
    let model = testdata().join("models/tiny-vl");
    let wide = testdata().join("images/wide.png");
    let o = qwen35(&[
        "ranges",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hi",
        "--image",
        wide.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let names: Vec<&str> = r["activations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    // The tower's taps come first, in the order it computes them, then the decoder's.
    assert_eq!(names[0], "vision.patch_embed");
    let at = |n: &str| {
        names
            .iter()
            .position(|x| *x == n)
            .unwrap_or_else(|| panic!("no {n}"))
    };
    assert!(at("vision.blocks.0.attention_scores") < at("vision.blocks.0.gelu_input"));
    assert!(at("vision.blocks.1.output") < at("vision.merger"));
    assert!(at("vision.merger") < at("embeddings"));
    let scores = &r["activations"][at("vision.blocks.0.attention_scores")]["values"];
    assert!(scores["max_abs"].as_f64().unwrap() > 0.0, "{scores}");
    // A block's output feeds a LayerNorm: its squares are scanned too.
    assert!(r["activations"][at("vision.blocks.0.output")]["squares"].is_object());
}

#[test]
fn probe_takes_the_vision_blocks_as_units_and_the_decoder_layers_on_the_image_rows() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("probe.json");
    let model = testdata().join("models/tiny-vl");
    let wide = testdata().join("images/wide.png");
    let args = |max: &str| {
        vec![
            "probe".to_string(),
            "--model".into(),
            model.to_str().unwrap().into(),
            "--prompt".into(),
            "hi".into(),
            "--image".into(),
            wide.to_str().unwrap().into(),
            "--device".into(),
            "CPU".into(),
            "--max-nrmse".into(),
            max.into(),
            "--json".into(),
            json.to_str().unwrap().into(),
        ]
    };
    let run = |max: &str| {
        let a = args(max);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let o = qwen35(&a);
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        (o, r)
    };
    let (o, r) = run("1e-4");
    assert!(o.status.success(), "{}", stderr(&o));
    // The decoder's layers are probed on the prompt with its image: the image run's tokens, at their MRoPE
    // positions (text positions there would move every attention layer's output far off the reference's).
    assert_eq!(r["inputs"]["prompt"], "with 1 image(s)", "{}", r["inputs"]);
    let tokens = r["inputs"]["prompt_tokens"].as_u64().unwrap();
    assert!(tokens > 16, "{}", r["inputs"]);
    let layers = r["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 4);
    for l in layers {
        let e = l["output"]["nrmse"].as_f64().unwrap();
        println!(
            "decoder layer {} ({}) on the image prompt: NRMSE {e:.2e}",
            l["layer"], l["kind"]
        );
        assert!(e < 1e-5, "{l}");
    }
    let vision = r["vision"].as_array().expect("the vision blocks");
    assert_eq!(vision.len(), 2);
    for v in vision {
        assert!(v["isolated"]["nrmse"].as_f64().unwrap() < 1e-6, "{v}");
        assert!(v["chained"]["nrmse"].as_f64().unwrap() < 1e-6, "{v}");
        assert_eq!(v["over"], false);
    }
    // A threshold no f32 graph meets puts the blocks over it, and the run fails.
    let (o, r) = run("1e-12");
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        r["vision"]
            .as_array()
            .unwrap()
            .iter()
            .all(|v| v["over"] == true)
    );
}
