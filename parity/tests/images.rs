//! Prompts with images through the command line, on `tiny-vl` against transformers' goldens
//! (scripts/make_vision_goldens.py): `dump --pixel-values` with the goldens' own pixel values and token ids, on the
//! reference and on OpenVINO's CPU device (the static vision graph, then decoder graphs fed embeddings), must give
//! transformers' greedy tokens, positions, vision taps and logits, and so must the goldens' video (its pixel values,
//! and ids holding each frame's run); `run --image` preprocesses the committed images itself; and a prompt whose
//! image (video) tokens do not fit its images (video frames) is refused, naming the image (the video and frame), as
//! is a pixel-values file whose keys do not fit.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{expect_error, qwen35, stderr, testdata};
use parity::dump::Dump;
use reference::compare::diff;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The decoder's logits with images against transformers' at f32 (the tolerance of the text goldens).
const LOGITS_ATOL: f64 = 1e-3;
/// Vision taps, relative to each tensor's largest magnitude (the target).
const VISION_RTOL: f64 = 1e-5;

fn golden() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(testdata().join("goldens/tiny-vl.safetensors"), &Device::Cpu)
        .unwrap()
}

/// The goldens' `images` case as transformers' processor returns it: `pixel_values` and `image_grid_thw`.
fn write_pixel_values(g: &HashMap<String, Tensor>, path: &Path) {
    let t: HashMap<String, Tensor> = [
        ("pixel_values".to_string(), g["images.pixel_values"].clone()),
        (
            "image_grid_thw".to_string(),
            g["images.image_grid_thw"].clone(),
        ),
    ]
    .into();
    candle_core::safetensors::save(&t, path).unwrap();
}

fn ids_text(t: &Tensor) -> String {
    let ids: Vec<i64> = t.to_dtype(DType::I64).unwrap().to_vec1().unwrap();
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
}

/// A dump of the goldens' `case` (`images` or `video`) against transformers': greedy tokens, positions, the vision
/// taps (the video's tower run under `video.`, as the goldens name them) and the logits.
fn check_dump(path: &Path, g: &HashMap<String, Tensor>, case: &str, label: &str) {
    let d = Dump::read(path).unwrap();
    let ids = |t: &Tensor| -> Vec<i64> { t.to_dtype(DType::I64).unwrap().to_vec1().unwrap() };
    assert_eq!(
        ids(d.get("generated").unwrap()),
        ids(&g[&format!("{case}.generated")]),
        "{label}: greedy tokens with {case} differ from transformers'"
    );
    let positions: Vec<Vec<i64>> = d.get("positions").unwrap().to_vec2().unwrap();
    let expected: Vec<Vec<i64>> = g[&format!("{case}.positions")].to_vec2().unwrap();
    assert_eq!(positions, expected, "{label} {case}: positions");
    let prefix = if case == "video" { "video." } else { "" };
    for tap in [
        "vision.patch_embed",
        "vision.blocks.1.output",
        "vision.merger",
    ] {
        let name = format!("{prefix}{tap}");
        let e = diff(d.get(&name).unwrap(), &g[&format!("{case}.{tap}")]).unwrap();
        println!("{label} {name}: {e}");
        assert!(e.within(0.0, VISION_RTOL), "{label} {name}: {e}");
    }
    let e = diff(d.get("logits").unwrap(), &g[&format!("{case}.logits")]).unwrap();
    println!("{label} {case} logits: {e}");
    assert!(e.within(LOGITS_ATOL, 0.0), "{label} {case} logits: {e}");
    assert!(d.metadata["images"].contains("--pixel-values"));
    // The attention scores (the square of the patches) are for the range report only; the GELU inputs are dumped.
    if label == "reference" {
        assert!(
            d.get(&format!("{prefix}vision.blocks.0.attention_scores"))
                .is_err()
        );
        assert!(
            d.get(&format!("{prefix}vision.blocks.0.gelu_input"))
                .is_ok()
        );
    }
}

/// `dump` of the goldens' `case` (its pixel values in `pixels`, its token ids, as many greedy tokens as transformers
/// made) on the reference and on the CPU device, each checked against the goldens; the two dumps' paths.
fn dump_case(g: &HashMap<String, Tensor>, dir: &Path, pixels: &Path, case: &str) -> Vec<PathBuf> {
    let model = testdata().join("models/tiny-vl");
    let ids = ids_text(&g[&format!("{case}.token_ids")]);
    let generate = g[&format!("{case}.generated")].dim(0).unwrap().to_string();
    let mut outs = Vec::new();
    for (label, backend) in [("reference", "reference"), ("CPU", "openvino")] {
        let out = dir.join(format!("{case}-{label}.safetensors"));
        let o = qwen35(&[
            "dump",
            "--model",
            model.to_str().unwrap(),
            "--pixel-values",
            pixels.to_str().unwrap(),
            "--token-ids",
            &ids,
            "--generate",
            &generate,
            "--backend",
            backend,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{label}: {}", stderr(&o));
        check_dump(&out, g, case, label);
        outs.push(out);
    }
    outs
}

#[test]
fn a_dump_with_images_matches_transformers_on_the_reference_and_on_the_cpu_device() {
    let g = golden();
    let dir = tempfile::tempdir().unwrap();
    let pixels = dir.path().join("pixels.safetensors");
    write_pixel_values(&g, &pixels);
    dump_case(&g, dir.path(), &pixels, "images");
}

/// `tensors` under their keys in a safetensors file (a processor's output, or a malformed one).
fn write_tensors(path: &Path, tensors: &[(&str, Tensor)]) {
    let t: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(k, t)| (k.to_string(), t.clone()))
        .collect();
    candle_core::safetensors::save(&t, path).unwrap();
}

/// The goldens' video as transformers' video processor returns it: `pixel_values_videos` and `video_grid_thw`.
fn video_keys(g: &HashMap<String, Tensor>) -> [(&'static str, Tensor); 2] {
    [
        (
            "pixel_values_videos",
            g["video.pixel_values_videos"].clone(),
        ),
        ("video_grid_thw", g["video.video_grid_thw"].clone()),
    ]
}

#[test]
fn a_dump_with_a_video_matches_transformers_on_the_reference_and_on_the_cpu_device() {
    let g = golden();
    let dir = tempfile::tempdir().unwrap();
    let pixels = dir.path().join("video.safetensors");
    write_tensors(&pixels, &video_keys(&g));
    // The ids as the processor wrote them: each frame's timestamp, vision_start, its 6 video tokens, vision_end.
    for out in dump_case(&g, dir.path(), &pixels, "video") {
        let d = Dump::read(&out).unwrap();
        assert_eq!(d.metadata["videos"], "2x4x6");
        // Only the videos' tower ran.
        assert!(d.get("vision.merger").is_err());
    }
}

/// Images and a video in one file, one prompt (the images' case, then the video's): the tower runs on each apart,
/// as transformers does, so each run's taps are the goldens'; the video's positions continue past the images'
/// prompt, and the images' part of the logits is the images' case's (the decoder is causal).
#[test]
fn a_dump_with_images_and_a_video_runs_the_tower_on_each() {
    let g = golden();
    let dir = tempfile::tempdir().unwrap();
    let pixels = dir.path().join("both.safetensors");
    let [v, vg] = video_keys(&g);
    write_tensors(
        &pixels,
        &[
            ("pixel_values", g["images.pixel_values"].clone()),
            ("image_grid_thw", g["images.image_grid_thw"].clone()),
            v,
            vg,
        ],
    );
    let ids = format!(
        "{},{}",
        ids_text(&g["images.token_ids"]),
        ids_text(&g["video.token_ids"])
    );
    let out = dir.path().join("both-dump.safetensors");
    let model = testdata().join("models/tiny-vl");
    let o = qwen35(&[
        "dump",
        "--model",
        model.to_str().unwrap(),
        "--pixel-values",
        pixels.to_str().unwrap(),
        "--token-ids",
        &ids,
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let d = Dump::read(&out).unwrap();
    for (case, prefix) in [("images", ""), ("video", "video.")] {
        let name = format!("{prefix}vision.merger");
        let e = diff(d.get(&name).unwrap(), &g[&format!("{case}.vision.merger")]).unwrap();
        println!("images and video {name}: {e}");
        assert!(e.within(0.0, VISION_RTOL), "{name}: {e}");
    }
    let images: Vec<Vec<i64>> = g["images.positions"].to_vec2().unwrap();
    let video: Vec<Vec<i64>> = g["video.positions"].to_vec2().unwrap();
    let next = images.iter().flatten().max().unwrap() + 1;
    let expected: Vec<Vec<i64>> = images
        .iter()
        .zip(&video)
        .map(|(i, v)| {
            i.iter()
                .copied()
                .chain(v.iter().map(|p| p + next))
                .collect()
        })
        .collect();
    let positions: Vec<Vec<i64>> = d.get("positions").unwrap().to_vec2().unwrap();
    assert_eq!(positions, expected);
    let rows = g["images.logits"].dim(0).unwrap();
    let logits = d.get("logits").unwrap().narrow(0, 0, rows).unwrap();
    let e = diff(&logits, &g["images.logits"]).unwrap();
    println!("images and video: the images' logits {e}");
    assert!(e.within(LOGITS_ATOL, 0.0), "{e}");
}

#[test]
fn video_input_that_does_not_fit_is_refused_naming_the_file_key_video_and_frame() {
    let g = golden();
    let dir = tempfile::tempdir().unwrap();
    let m = testdata().join("models/tiny-vl");
    let m = m.to_str().unwrap();
    let ids = ids_text(&g["video.token_ids"]);
    let file = |name: &str, tensors: &[(&str, Tensor)]| {
        let p = dir.path().join(name);
        write_tensors(&p, tensors);
        p.to_str().unwrap().to_string()
    };
    let dump = |pixels: &str, ids: &str, needles: &[&str]| {
        expect_error(
            &[
                "dump",
                "--model",
                m,
                "--pixel-values",
                pixels,
                "--token-ids",
                ids,
                "--out",
                "unused.safetensors",
            ],
            needles,
        )
    };
    let [v, vg] = video_keys(&g);
    let good = file("video.safetensors", &[v.clone(), vg.clone()]);
    // Frame 2 one video token short (5 for a 4x6-patch frame's 6), named by video and frame.
    let mut short: Vec<i64> = g["video.token_ids"].to_vec1().unwrap();
    let last = short.iter().rposition(|&i| i == 515).unwrap();
    short.remove(last);
    let short: Vec<String> = short.iter().map(i64::to_string).collect();
    dump(
        &good,
        &short.join(","),
        &[
            "--token-ids",
            "video 1, frame 2",
            "5 video token(s)",
            "merges into 6",
        ],
    );
    // A file with neither pair; one pair without its grid; rows the grid does not make; a grid row that is not
    // whole merge blocks.
    let other = file("other.safetensors", &[("pixels", v.1.clone())]);
    dump(
        &other,
        &ids,
        &[&other, "pixel_values_videos", "video_grid_thw"],
    );
    let alone = file("alone.safetensors", std::slice::from_ref(&v));
    dump(
        &alone,
        &ids,
        &[&alone, "`pixel_values_videos` without `video_grid_thw`"],
    );
    let rows = file(
        "rows.safetensors",
        &[
            ("pixel_values_videos", v.1.narrow(0, 0, 40).unwrap()),
            vg.clone(),
        ],
    );
    dump(
        &rows,
        &ids,
        &[&rows, "`pixel_values_videos` is [40, 96]", "48 patches"],
    );
    let grid = Tensor::new(&[[2i64, 5, 6]], &Device::Cpu).unwrap();
    let odd = file("odd.safetensors", &[v.clone(), ("video_grid_thw", grid)]);
    dump(
        &odd,
        &ids,
        &[&odd, "`video_grid_thw` row 0 [2, 5, 6]", "merge blocks"],
    );
    // A chat message with a video: the frames' timestamps come from the video's metadata, so the ids are asked for.
    expect_error(
        &[
            "run",
            "--model",
            m,
            "--prompt",
            "What happens?",
            "--pixel-values",
            &good,
        ],
        &["--prompt with videos", "--token-ids"],
    );
    // A command that takes images only says so.
    expect_error(
        &[
            "ranges",
            "--model",
            m,
            "--token-ids",
            &ids,
            "--pixel-values",
            &good,
        ],
        &[&good, "takes images only"],
    );
}

#[test]
fn run_and_compare_devices_take_a_video() {
    let g = golden();
    let dir = tempfile::tempdir().unwrap();
    let pixels = dir.path().join("video.safetensors");
    write_tensors(&pixels, &video_keys(&g));
    let model = testdata().join("models/tiny-vl");
    let (m, p) = (model.to_str().unwrap(), pixels.to_str().unwrap());
    let ids = ids_text(&g["video.token_ids"]);
    let o = qwen35(&[
        "run",
        "--model",
        m,
        "--token-ids",
        &ids,
        "--pixel-values",
        p,
        "--max-tokens",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let json = dir.path().join("compare.json");
    let o = qwen35(&[
        "compare-devices",
        "--model",
        m,
        "--token-ids",
        &ids,
        "--pixel-values",
        p,
        "--devices",
        "CPU",
        "--tokens",
        "4",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("video embeddings (video.vision.merger"),
        "{stdout}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let device = &report["devices"][0];
    assert_eq!(device["greedy_matched"], device["greedy_total"]);
    let vision = device["vision"].as_array().unwrap();
    let last = &vision[vision.len() - 1];
    assert_eq!(last["name"], "video.vision.merger");
    assert!(last["error"]["nrmse"].as_f64().unwrap() < 1e-5, "{last}");
    assert_eq!(
        report["inputs"]["prompts"][0][0],
        "with 1 video(s) of 2 frame(s)"
    );
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
