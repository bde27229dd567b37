//! The machine's own limits, measured beside every benchmark: the f32 matrix-product rate and the memory bandwidth
//! (a copy, and a read alone: what a decode step does to its weights).
//! A run's rates over them ([`shares`]) have the machine's load divided out.

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
    /// The best rate of reading `copy_bytes` once (every thread summing its share), GB/s: the bound of a
    /// matrix-vector product that streams its weights.
    pub read_gb_per_s: f64,
    /// Repeats of each probe (the best is kept; one warm-up run before).
    pub repeats: usize,
}

/// Times an `n×n` by `n×n` f32 product through candle (the reference's own matrix product), a parallel copy of
/// `copy_bytes` bytes between two buffers touched beforehand and a parallel read of the source buffer, `repeats`
/// times each after a warm-up.
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
    let mut best_read = f64::INFINITY;
    for i in 0..=repeats {
        let start = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = src
                .chunks(part)
                .map(|from| s.spawn(move || read_sum(from)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let seconds = start.elapsed().as_secs_f64();
        std::hint::black_box(sums);
        if i > 0 {
            best_read = best_read.min(seconds);
        }
    }
    Ok(Machine {
        threads,
        gemm_size,
        gemm_gflops_per_s: gemm,
        copy_bytes,
        copy_gb_per_s: 2.0 * copy_bytes as f64 / best / 1e9,
        read_gb_per_s: copy_bytes as f64 / best_read / 1e9,
        repeats,
    })
}

/// A wrapping sum of the bytes as 64-bit words in eight independent lanes (so the loads are not serialised by one
/// dependency chain and the compiler vectorises them).
fn read_sum(bytes: &[u8]) -> u64 {
    let mut lanes = [0u64; 8];
    let mut blocks = bytes.chunks_exact(64);
    for block in &mut blocks {
        for (lane, word) in lanes.iter_mut().zip(block.chunks_exact(8)) {
            let word: [u8; 8] = word.try_into().unwrap_or_default();
            *lane = lane.wrapping_add(u64::from_le_bytes(word));
        }
    }
    let tail = blocks
        .remainder()
        .iter()
        .fold(0u64, |a, &b| a.wrapping_add(b as u64));
    lanes.iter().fold(tail, |a, &b| a.wrapping_add(b))
}

/// The prompt's share of the machine's GEMM rate and a decode step's time over the time to read its weights once at
/// the machine's read bandwidth (the same as the ratio of that bandwidth to the rate the step streamed them at).
pub fn shares(
    machine: Option<&Machine>,
    prompt_gflops_per_s: f64,
    decode_weight_gb_per_s: Option<f64>,
) -> (Option<f64>, Option<f64>) {
    let Some(m) = machine else {
        return (None, None);
    };
    (
        Some(prompt_gflops_per_s / m.gemm_gflops_per_s),
        decode_weight_gb_per_s.map(|rate| m.read_gb_per_s / rate),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_read_probe_reads_every_byte() {
        let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        // Byte k of each 8-byte word contributes b · 256^k; the 40-byte tail is summed byte by byte.
        let mut expected = 0u64;
        for (i, &b) in bytes.iter().enumerate() {
            let weight = if i < 960 { 1u64 << (8 * (i % 8)) } else { 1 };
            expected = expected.wrapping_add(b as u64 * weight);
        }
        assert_eq!(read_sum(&bytes), expected);
    }

    #[test]
    fn the_shares_divide_the_machines_own_rates_out() {
        let m = Machine {
            threads: 2,
            gemm_size: 2048,
            gemm_gflops_per_s: 400.0,
            copy_bytes: 1 << 20,
            copy_gb_per_s: 30.0,
            read_gb_per_s: 40.0,
            repeats: 5,
        };
        // 100 GFLOP/s of 400; weights streamed at 20 GB/s where 40 could be read: a step twice the read time.
        assert_eq!(shares(Some(&m), 100.0, Some(20.0)), (Some(0.25), Some(2.0)));
        assert_eq!(shares(Some(&m), 100.0, None), (Some(0.25), None));
        assert_eq!(shares(None, 100.0, Some(20.0)), (None, None));
    }
}
