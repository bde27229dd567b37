//! Videos through the command line, on `tiny-vl` against transformers' goldens: the goldens' video (its pixel values,
//! and ids holding each frame's run) through `dump` on the reference and on OpenVINO's CPU device must give
//! transformers' greedy tokens, positions, vision taps and logits, alone and beside images; a video whose frames'
//! runs or keys do not fit is refused, naming the file, the key, the video and the frame; run and compare-devices
//! take a video.

use crate::common;

use candle_core::{Device, Tensor};
use common::vl::*;
use common::{expect_error, qwen35, stderr, testdata};
use parity::dump::Dump;
use reference::compare::diff;

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
