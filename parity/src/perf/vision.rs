//! The vision tower's benchmark (`qwen35 bench --image-grid HxW`): one image of `H × W` patches (seeded pixels in
//! the normalised range) through the reference tower, or through the static vision graph on a device, timed over
//! several runs, with the FLOPs the tower computes and the peak memory.

use super::memory::Sampler;
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use reference::taps::Taps;
use reference::vision::{Grid, VisionConfig, VisionTower};
use reference::weights::WeightStore;
use std::time::Instant;

/// What a vision benchmark measured (`schema_version` 1).
#[derive(Debug, Clone, serde::Serialize)]
pub struct VisionBench {
    /// The JSON layout's version.
    pub schema_version: u32,
    /// The checkpoint directory.
    pub model: String,
    /// `reference`, or the OpenVINO device (FP16SIM included) the static graph ran on.
    pub backend: String,
    /// The image's grid `[t, h, w]` in patches.
    pub grid: [usize; 3],
    /// Patches in (the tower's tokens).
    pub patches: usize,
    /// Rows out (merged tokens of the decoder's width).
    pub rows: usize,
    /// Seconds to load the tower (the reference), or to build and compile the graph (a device).
    pub load_seconds: f64,
    /// Seconds of each timed run.
    pub run_seconds: Vec<f64>,
    /// Their median.
    pub median_seconds: f64,
    /// FLOPs of one image (products and attention; the norms and activations aside).
    pub flops: u64,
    /// `flops / median_seconds`, in GFLOP/s.
    pub gflops_per_s: f64,
    /// The largest anonymous resident memory sampled over load and runs.
    pub peak_anon_bytes: u64,
}

/// FLOPs of the tower on one image of `grid`: the patch embedding, each block's projections, attention and MLP,
/// the merger.
pub fn tower_flops(vc: &VisionConfig, grid: &Grid) -> u64 {
    let n = grid.patches() as u64;
    let (h, i) = (vc.hidden_size as u64, vc.intermediate_size as u64);
    let dim = vc.patch_dim() as u64;
    let m = vc.merge_unit() as u64;
    let frame = (grid.h * grid.w) as u64;
    let block = 2 * n * h * 3 * h + 2 * n * h * h + 2 * 2 * n * h * i + 2 * 2 * n * frame * h;
    let merger =
        2 * (n / m) * (m * h) * (m * h) + 2 * (n / m) * (m * h) * vc.out_hidden_size as u64;
    2 * n * dim * h + vc.depth as u64 * block + merger
}

/// Seeded pixels for `grid`, uniform in [−1, 1] (normalised pixels lie in about [−1.8, 2.1]).
pub fn pixels(vc: &VisionConfig, grid: &Grid) -> Result<Tensor> {
    let dim = vc.patch_dim();
    let mut rng = reference::synthetic::Rng::new(0);
    let values: Vec<f32> = (0..grid.patches() * dim)
        .map(|_| (rng.next_u64() as f64 / u64::MAX as f64 * 2.0 - 1.0) as f32)
        .collect();
    Ok(Tensor::from_vec(
        values,
        (grid.patches(), dim),
        &Device::Cpu,
    )?)
}

/// Times `runs` runs of the tower on one image of `grid`: the reference's (`device` `None`) or the static graph's
/// on `device`.
pub fn bench(
    model: &str,
    vc: &VisionConfig,
    store: &WeightStore,
    grid: Grid,
    device: Option<(&str, &npu::devices::CompileOptions)>,
    runs: usize,
) -> Result<VisionBench> {
    let sampler = Sampler::start(std::time::Duration::from_millis(10));
    let x = pixels(vc, &grid)?;
    let grids = std::slice::from_ref(&grid);
    let start = Instant::now();
    let mut run: Box<dyn FnMut() -> Result<Tensor>> = match device {
        None => {
            let tower = VisionTower::load(vc.clone(), store)?;
            let x = x.to_dtype(DType::F32)?;
            let grids = grids.to_vec();
            Box::new(move || Ok(tower.forward(&x, &grids, &mut Taps::off())?))
        }
        Some((device, compile)) => {
            let graph = npu::graphs::vision::vision_graph(vc, store, grids, false)?;
            let mut exec = npu::infer::prepare(graph, device, compile)?;
            Box::new(move || {
                let mut out = exec.run(&[(npu::graphs::vision::PIXELS, &x)])?;
                out.remove(reference::vision::names::MERGER)
                    .ok_or_else(|| anyhow::anyhow!("the vision graph gave no merger output"))
            })
        }
    };
    let load_seconds = start.elapsed().as_secs_f64();
    let mut run_seconds = Vec::with_capacity(runs);
    let mut rows = 0;
    for _ in 0..runs.max(1) {
        let start = Instant::now();
        rows = run()?.dim(0)?;
        run_seconds.push(start.elapsed().as_secs_f64());
    }
    let mut sorted = run_seconds.clone();
    sorted.sort_by(f64::total_cmp);
    let median_seconds = sorted[sorted.len() / 2];
    let flops = tower_flops(vc, &grid);
    let (peak_anon_bytes, _) = sampler.stop();
    Ok(VisionBench {
        schema_version: 1,
        model: model.to_string(),
        backend: device.map_or("reference".to_string(), |(d, _)| d.to_string()),
        grid: [grid.t, grid.h, grid.w],
        patches: grid.patches(),
        rows,
        load_seconds,
        run_seconds,
        median_seconds,
        flops,
        gflops_per_s: flops as f64 / median_seconds / 1e9,
        peak_anon_bytes,
    })
}
