//! The vision tower and a multimodal prompt against transformers' `Qwen3_5ForConditionalGeneration` on `tiny-vl`
//! (scripts/make_vision_goldens.py): two images of sizes the learned table must be resampled to, and a two-frame
//! video; the processor's pixel values in, every vision tap, the positions, the decoder's layers, the logits and
//! the greedy tokens out, in f32 and in f64.

use crate::common::testdata;
use crate::goldens::{ids_of, load_golden};
use candle_core::{DType, Tensor};
use reference::compare::diff;
use reference::model::{Model, RunOptions, argmax};
use reference::rope::Positions;
use reference::taps::Taps;
use reference::vision::prompt::{TowerRows, check_video_runs, embedded_prompt};
use reference::vision::{Grid, VisionConfig, VisionTower, names};
use reference::weights::WeightStore;

/// The vision taps against transformers' at f32: within 1e-5 of each tensor's largest magnitude (the issue's
/// target), and at f64 within 1e-12.
const VISION_RTOL_F32: f64 = 1e-5;
const VISION_RTOL_F64: f64 = 1e-12;
/// The decoder's taps with an image, as the text-only goldens hold them (goldens.rs): 1e-4 of the max, logits 1e-3
/// absolute at f32; 1e-12 at f64.
const LAYER_RTOL_F32: f64 = 1e-4;
const LOGITS_ATOL_F32: f64 = 1e-3;
const F64_TOL: f64 = 1e-12;

fn grids(t: &Tensor) -> Vec<Grid> {
    let rows: Vec<Vec<i64>> = t.to_vec2().unwrap();
    rows.iter()
        .map(|r| Grid {
            t: r[0] as usize,
            h: r[1] as usize,
            w: r[2] as usize,
        })
        .collect()
}

struct Case {
    name: &'static str,
    pixels: &'static str,
    grid: &'static str,
}

const CASES: [Case; 2] = [
    Case {
        name: "images",
        pixels: "pixel_values",
        grid: "image_grid_thw",
    },
    Case {
        name: "video",
        pixels: "pixel_values_videos",
        grid: "video_grid_thw",
    },
];

fn check(dtype: DType) {
    let dir = testdata().join("models/tiny-vl");
    let (suffix, vision_rtol, layer_rtol, logits_atol) = match dtype {
        DType::F64 => (".f64", VISION_RTOL_F64, F64_TOL, F64_TOL),
        _ => ("", VISION_RTOL_F32, LAYER_RTOL_F32, LOGITS_ATOL_F32),
    };
    let g = load_golden(&testdata().join(format!("goldens/tiny-vl{suffix}.safetensors")));
    let vc = VisionConfig::from_file(&dir.join("config.json"))
        .unwrap()
        .expect("tiny-vl has a vision tower");
    let store = WeightStore::open(&dir, dtype).unwrap();
    let tower = VisionTower::load(vc.clone(), &store).unwrap();
    let model = Model::load(&dir, dtype).unwrap();
    for case in CASES {
        let t = |n: &str| {
            g.tensors
                .get(&format!("{}.{n}", case.name))
                .unwrap_or_else(|| panic!("{}: no {n} in the golden", case.name))
                .clone()
        };
        let grid = grids(&t(case.grid));
        let mut taps = Taps::on();
        let merged = tower.forward(&t(case.pixels), &grid, &mut taps).unwrap();
        let mut vision_taps = vec![names::PATCH_EMBED.to_string(), names::POS_EMBED.to_string()];
        vision_taps.extend((0..vc.depth).map(names::block));
        vision_taps.push(names::MERGER.to_string());
        for tap in &vision_taps {
            let d = diff(taps.get(tap).unwrap(), &t(tap)).unwrap();
            println!("{} {dtype:?} {tap}: {d}", case.name);
            assert!(d.within(0.0, vision_rtol), "{} {tap}: {d}", case.name);
        }

        // The prompt as the decoder takes it: positions from get_rope_index's layout, the tower's rows at the image
        // (video) tokens.
        let ids = ids_of(&t("token_ids"));
        let rows = Some(TowerRows {
            grids: &grid,
            rows: &merged,
        });
        let (images, videos) = if case.name == "video" {
            (None, rows)
        } else {
            (rows, None)
        };
        let prompt = embedded_prompt(&model, &vc, ids, images, videos).unwrap();
        let positions = prompt.positions.clone();
        let expected: Vec<Vec<i64>> = t("positions").to_vec2().unwrap();
        assert_eq!(
            positions,
            Positions([
                expected[0].clone(),
                expected[1].clone(),
                expected[2].clone()
            ]),
            "{}: positions differ from get_rope_index",
            case.name
        );

        let embeddings = prompt.embeddings;
        let mut state = model.new_state().unwrap();
        let opts = RunOptions::default();
        let mut taps = Taps::on();
        let mut logits = model
            .forward_embedded(embeddings, &positions, &mut state, &opts, &mut taps)
            .unwrap();
        let mut decoder_taps = vec!["embeddings".to_string(), "final_norm".to_string()];
        decoder_taps.extend((0..model.config().num_layers()).map(|i| format!("layers.{i}.output")));
        for tap in &decoder_taps {
            let d = diff(taps.get(tap).unwrap(), &t(tap)).unwrap();
            assert!(
                d.within(0.0, layer_rtol),
                "{} {dtype:?} {tap}: {d}",
                case.name
            );
        }
        let d = diff(taps.get("logits").unwrap(), &t("logits")).unwrap();
        println!("{} {dtype:?} logits: {d}", case.name);
        assert!(d.within(logits_atol, 0.0), "{} logits: {d}", case.name);

        let Some(expected) = g.tensors.get(&format!("{}.generated", case.name)) else {
            continue;
        };
        let expected = ids_of(expected);
        let steps = t("step_logits");
        let mut generated = Vec::new();
        for step in 0..expected.len() {
            let d = diff(&logits, &steps.get(step).unwrap()).unwrap();
            assert!(d.within(logits_atol, 0.0), "{} step {step}: {d}", case.name);
            let next = argmax(&logits).unwrap();
            generated.push(next);
            logits = model
                .forward(&[next], &mut state, &opts, &mut Taps::off())
                .unwrap();
        }
        assert_eq!(generated, expected, "{}: greedy tokens differ", case.name);
        println!("{}: {} greedy tokens identical", case.name, expected.len());
    }
}

#[test]
fn the_vision_tower_and_a_prompt_with_images_match_transformers_f32() {
    check(DType::F32);
}

#[test]
fn the_vision_tower_and_a_prompt_with_images_match_transformers_f64() {
    check(DType::F64);
}

/// The video's ids hold each frame's run (after its timestamp, between vision_start and vision_end): a frame one
/// token short, or a frame missing, is refused naming the video and the frame, or the frames' count.
#[test]
fn a_video_frames_runs_are_held_to_its_grid() {
    let dir = testdata().join("models/tiny-vl");
    let g = load_golden(&testdata().join("goldens/tiny-vl.safetensors"));
    let vc = VisionConfig::from_file(&dir.join("config.json"))
        .unwrap()
        .unwrap();
    let grid = grids(&g.tensors["video.video_grid_thw"]);
    let ids = ids_of(&g.tensors["video.token_ids"]);
    check_video_runs(&ids, &vc, &grid).unwrap();
    // Frame 2 of 4x6 patches merges into 6 tokens; drop one of them.
    let last = ids.iter().rposition(|&i| i == vc.tokens.video).unwrap();
    let mut short = ids.clone();
    short.remove(last);
    let e = check_video_runs(&short, &vc, &grid)
        .unwrap_err()
        .to_string();
    assert!(e.contains("video 1, frame 2: 5 video token(s)"), "{e}");
    assert!(e.contains("merges into 6"), "{e}");
    // A grid of three frames for ids of two.
    let three = [Grid { t: 3, ..grid[0] }];
    let e = check_video_runs(&ids, &vc, &three).unwrap_err().to_string();
    assert!(e.contains("2 run(s) of video tokens"), "{e}");
    assert!(e.contains("1 video(s) of 3 frame(s)"), "{e}");
}

#[test]
fn the_vision_tensors_are_the_checkpoints() {
    use reference::schema::vision::VisionSchema;
    let dir = testdata().join("models/tiny-vl");
    let vc = VisionConfig::from_file(&dir.join("config.json"))
        .unwrap()
        .unwrap();
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let mut in_file: Vec<String> = index["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.starts_with("model.visual."))
        .cloned()
        .collect();
    in_file.sort();
    let mut listed: Vec<String> = VisionSchema::new(&vc)
        .tensors()
        .iter()
        .map(|t| t.full_name())
        .collect();
    listed.sort();
    assert_eq!(listed, in_file);
    // The text-only models have no vision tower.
    assert_eq!(
        VisionConfig::from_file(&testdata().join("models/tiny/config.json")).unwrap(),
        None
    );
}

/// The two committed images through our preprocessing against transformers' image processor (PIL backend): the
/// same grids, and pixel values within one 8-bit level (1/255 after rescaling, 2/255 after normalising with
/// std 0.5).
#[test]
fn the_preprocessed_images_match_transformers_processor() {
    use reference::vision::preprocess::{Preprocessor, RgbImage};
    let dir = testdata().join("models/tiny-vl");
    let g = load_golden(&testdata().join("goldens/tiny-vl.safetensors"));
    let p = Preprocessor::from_dir(&dir).unwrap();
    let images: Vec<RgbImage> = ["wide", "small"]
        .iter()
        .map(|n| RgbImage::open(&testdata().join(format!("images/{n}.png"))).unwrap())
        .collect();
    let (pixels, grid) = p.pixel_values(&images, None).unwrap();
    assert_eq!(grid, grids(&g.tensors["images.image_grid_thw"]));
    let expected = &g.tensors["images.pixel_values"];
    let (_, std) = p.normalize.unwrap();
    let level = p.rescale.unwrap() / std[0] as f64;
    let d = diff(&pixels, expected).unwrap();
    let levels = d.max_abs / level;
    let a: Vec<f32> = pixels.flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = expected.flatten_all().unwrap().to_vec1().unwrap();
    let differ = a
        .iter()
        .zip(&b)
        .filter(|(x, y)| (*x - *y).abs() as f64 > level / 2.0)
        .count();
    println!(
        "pixel values: max {levels:.3} levels ({d}); {differ} of {} values differ by a level",
        a.len()
    );
    assert!(
        levels <= 1.0 + 1e-3,
        "pixel values differ by {levels} levels: {d}"
    );
}
