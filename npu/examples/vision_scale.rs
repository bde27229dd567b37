//! The vision tower at a checkpoint's own dimensions (e.g. `qwen35 synth`'s 9B layout): the reference tower and the
//! static vision graph on an OpenVINO device for one image of `H x W` patches (the NPU port's 32 x 32), timed, their
//! outputs compared, and the peak resident memory; with `--sim-grid HxW`, FP16SIM's fp16 view of a smaller grid
//! against the reference (the largest magnitude per tap, which tap first leaves fp16's range, the error).
//!
//! `cargo run --release -p npu --example vision_scale -- CHECKPOINT [--grid 32x32] [--device CPU] [--sim-grid 8x8]`
#![allow(clippy::disallowed_methods)] // an example reads its files with std::fs; inputs::open is the library's rule

use candle_core::{DType, Device, Tensor};
use npu::devices::CompileOptions;
use npu::graphs::vision::{PIXELS, vision_graph};
use npu::infer::prepare;
use reference::compare::diff;
use reference::taps::Taps;
use reference::vision::{Grid, VisionConfig, VisionTower};
use reference::weights::WeightStore;
use std::path::PathBuf;
use std::time::Instant;

/// fp16's largest finite value.
const F16_MAX: f64 = 65504.0;

fn peak_gib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0 / 1024.0)
}

fn grid(s: &str) -> Grid {
    let (h, w) = s.split_once('x').expect("a grid is HxW patches");
    Grid {
        t: 1,
        h: h.parse().expect("a number of patches"),
        w: w.parse().expect("a number of patches"),
    }
}

fn pixels(vc: &VisionConfig, g: &Grid) -> Tensor {
    let dim = vc.patch_dim();
    // Normalised pixels lie in about [-1.8, 2.1]; a seeded uniform draw over [-1, 1] stands in for an image.
    Tensor::rand(-1f32, 1f32, (g.patches(), dim), &Device::Cpu).unwrap()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = PathBuf::from(args.first().expect("give the checkpoint directory"));
    let opt = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let g = grid(&opt("--grid").unwrap_or_else(|| "32x32".into()));
    let device = opt("--device").unwrap_or_else(|| "CPU".into());
    let vc = VisionConfig::from_file(&dir.join("config.json"))
        .unwrap()
        .expect("the checkpoint has a vision tower");
    println!(
        "vision tower: {} blocks of {}, {} heads, MLP {}, table {}, out {}; one image of {}x{} patches",
        vc.depth,
        vc.hidden_size,
        vc.num_heads,
        vc.intermediate_size,
        vc.num_position_embeddings,
        vc.out_hidden_size,
        g.h,
        g.w
    );
    let store = WeightStore::open(&dir, DType::F32).unwrap();
    let x = pixels(&vc, &g);

    let start = Instant::now();
    let tower = VisionTower::load(vc.clone(), &store).unwrap();
    let load = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut taps = Taps::on();
    let expected = tower
        .forward(&x, std::slice::from_ref(&g), &mut taps)
        .unwrap();
    let reference_s = start.elapsed().as_secs_f64();
    println!(
        "reference: load {load:.2} s, forward {reference_s:.2} s -> {:?}; peak resident {:.2} GiB",
        expected.dims(),
        peak_gib()
    );

    let start = Instant::now();
    let graph = vision_graph(&vc, &store, std::slice::from_ref(&g), false).unwrap();
    let build = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut exec = prepare(graph, &device, &CompileOptions::default()).unwrap();
    let compile = start.elapsed().as_secs_f64();
    let mut runs = Vec::new();
    let mut out = None;
    for _ in 0..3 {
        let start = Instant::now();
        out = Some(exec.run(&[(PIXELS, &x)]).unwrap());
        runs.push(start.elapsed().as_secs_f64());
    }
    runs.sort_by(f64::total_cmp);
    let out = out.unwrap();
    let merged = &out[reference::vision::names::MERGER];
    println!(
        "static graph on {device}: build {build:.2} s, compile {compile:.2} s, run {:.3} s (median of 3); \
         against the reference: {}; peak resident {:.2} GiB",
        runs[1],
        diff(merged, &expected).unwrap(),
        peak_gib()
    );
    drop(exec);

    let Some(sim) = opt("--sim-grid") else {
        return;
    };
    let g = grid(&sim);
    let x = pixels(&vc, &g);
    let mut taps = Taps::on();
    tower
        .forward(&x, std::slice::from_ref(&g), &mut taps)
        .unwrap();
    let graph = vision_graph(&vc, &store, std::slice::from_ref(&g), true).unwrap();
    let start = Instant::now();
    let mut exec = prepare(graph, "FP16SIM", &CompileOptions::default()).unwrap();
    let out = exec.run(&[(PIXELS, &x)]).unwrap();
    println!(
        "FP16SIM (fp16) of {}x{} patches in {:.1} s:",
        g.h,
        g.w,
        start.elapsed().as_secs_f64()
    );
    let mut names: Vec<&String> = out.keys().collect();
    names.sort_by_key(|n| {
        n.strip_prefix("vision.blocks.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok())
            .map_or(if n.ends_with("merger") { 10_000 } else { 0 }, |i| i + 1)
    });
    for name in names {
        let reference = taps.get(name).unwrap();
        let largest = reference
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64;
        let flag = if largest > F16_MAX {
            "  <- beyond fp16's range"
        } else {
            ""
        };
        println!(
            "  {name}: max |x| {largest:.3e}; {}{flag}",
            diff(&out[name], reference).unwrap()
        );
    }
}
