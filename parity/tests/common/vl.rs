//! tiny-vl's transformers goldens (scripts/make_vision_goldens.py) and the dumps checked against them, shared by the
//! image and video tests.

use super::{qwen35, stderr, testdata};
use candle_core::{DType, Device, Tensor};
use parity::dump::Dump;
use reference::compare::diff;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The decoder's logits with images against transformers' at f32 (the tolerance of the text goldens).
pub const LOGITS_ATOL: f64 = 1e-3;
/// Vision taps, relative to each tensor's largest magnitude (the target).
pub const VISION_RTOL: f64 = 1e-5;

pub fn golden() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(testdata().join("goldens/tiny-vl.safetensors"), &Device::Cpu)
        .unwrap()
}

/// The goldens' `images` case as transformers' processor returns it: `pixel_values` and `image_grid_thw`.
pub fn write_pixel_values(g: &HashMap<String, Tensor>, path: &Path) {
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

pub fn ids_text(t: &Tensor) -> String {
    let ids: Vec<i64> = t.to_dtype(DType::I64).unwrap().to_vec1().unwrap();
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
}

/// A dump of the goldens' `case` (`images` or `video`) against transformers': greedy tokens, positions, the vision
/// taps (the video's tower run under `video.`, as the goldens name them) and the logits.
pub fn check_dump(path: &Path, g: &HashMap<String, Tensor>, case: &str, label: &str) {
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
pub fn dump_case(
    g: &HashMap<String, Tensor>,
    dir: &Path,
    pixels: &Path,
    case: &str,
) -> Vec<PathBuf> {
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

/// `tensors` under their keys in a safetensors file (a processor's output, or a malformed one).
pub fn write_tensors(path: &Path, tensors: &[(&str, Tensor)]) {
    let t: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(k, t)| (k.to_string(), t.clone()))
        .collect();
    candle_core::safetensors::save(&t, path).unwrap();
}

/// The goldens' video as transformers' video processor returns it: `pixel_values_videos` and `video_grid_thw`.
pub fn video_keys(g: &HashMap<String, Tensor>) -> [(&'static str, Tensor); 2] {
    [
        (
            "pixel_values_videos",
            g["video.pixel_values_videos"].clone(),
        ),
        ("video_grid_thw", g["video.video_grid_thw"].clone()),
    ]
}
