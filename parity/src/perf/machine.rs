//! The machine's own limits, measured beside every benchmark: the f32 matrix-product rate and the memory bandwidth.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use std::time::Instant;

/// What the machine achieved.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Machine {
    /// Threads both probes ran on (candle's thread count: `RAYON_NUM_THREADS`, else every core).
    pub threads: usize,
    /// The side of the square f32 matrix product timed.
    pub gemm_size: usize,
    /// The best rate over the repeats, GFLOP/s (`2·n³` FLOPs).
    pub gemm_gflops_per_s: f64,
    /// Bytes copied per repeat.
    pub copy_bytes: usize,
    /// The best rate over the repeats, GB/s (10⁹ bytes), bytes read plus bytes written.
    pub copy_gb_per_s: f64,
    /// Repeats of each probe (the best is kept; one warm-up run before).
    pub repeats: usize,
}

/// Times an `n×n` by `n×n` f32 product through candle (the reference's own matrix product) and a parallel copy of
/// `copy_bytes` bytes between two buffers touched beforehand, `repeats` times each after a warm-up.
pub fn measure(gemm_size: usize, copy_bytes: usize, repeats: usize) -> Result<Machine> {
    let threads = candle_core::utils::get_num_threads().max(1);
    let repeats = repeats.max(1);
    let dev = Device::Cpu;
    let a = Tensor::randn(0f32, 1.0, (gemm_size, gemm_size), &dev)?;
    let b = Tensor::randn(0f32, 1.0, (gemm_size, gemm_size), &dev)?;
    let mut best = f64::INFINITY;
    for i in 0..=repeats {
        let start = Instant::now();
        let c = a.matmul(&b)?;
        let seconds = start.elapsed().as_secs_f64();
        std::hint::black_box(c.dtype() == DType::F32);
        if i > 0 {
            best = best.min(seconds);
        }
    }
    let gemm = 2.0 * (gemm_size as f64).powi(3) / best / 1e9;
    drop((a, b));

    let src = vec![1u8; copy_bytes];
    let mut dst = vec![0u8; copy_bytes];
    let part = copy_bytes.div_ceil(threads).max(1);
    let mut best = f64::INFINITY;
    for i in 0..=repeats {
        let start = Instant::now();
        std::thread::scope(|s| {
            for (d, from) in dst.chunks_mut(part).zip(src.chunks(part)) {
                s.spawn(move || d.copy_from_slice(from));
            }
        });
        let seconds = start.elapsed().as_secs_f64();
        std::hint::black_box(&dst);
        if i > 0 {
            best = best.min(seconds);
        }
    }
    Ok(Machine {
        threads,
        gemm_size,
        gemm_gflops_per_s: gemm,
        copy_bytes,
        copy_gb_per_s: 2.0 * copy_bytes as f64 / best / 1e9,
        repeats,
    })
}
