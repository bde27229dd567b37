//! Every form of the gated delta rule at the real head dims of Qwen3.5-9B's linear-attention layers: Dk = Dv = 128
//! and the 32 value heads of one layer (the kernels take the key heads already repeated to the value heads).
//!
//! Names are `deltanet/{form}/Hv32_T{T}`: `sequential` (the oracle, token by token), `matrix` (the single-token
//! matrix form stepped over T tokens; `T1` is one decode step), `chunked_{inverse}_C{C}` (chunks of C tokens with
//! forward substitution, block doubling or the series inverse), `tri_inverse_{inverse}` (one chunk's triangular
//! inverse alone, `C{C}`). Token-by-token forms stop at T = 1024, the chunked ones go to 4096.
//!
//! The inputs are f32, so `matrix` and `chunked_substitution_*` run the plain-memory f32 kernels (the fast paths of
//! `deltanet::run`, `step` and `chunked`); `matrix_candle` (T = 1) and `chunked_substitution_candle_C64` (T ≤ 1024)
//! time the same forms written with tensor ops (`step_candle`, `chunked_candle`), which is what the doubling and
//! series forms and `sequential` always run.
//!
//! Inputs are random with the model's statistics: q and k l2-normalised (q also scaled by Dk^-0.5), v ~ N(0, 1),
//! per-token decays exp(g) in about [0.37, 1), beta in (0, 1); the state starts from N(0, 0.1²).
//!
//! `cargo bench -p reference --bench deltanet [-- FILTER]`.
#![allow(clippy::disallowed_methods)] // tests read their fixtures with std::fs; inputs::open is the library's rule

use candle_core::{D, DType, Device, Tensor};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use reference::deltanet::{self, Form, Inputs, Inverse};
use reference::synthetic::Rng;
use std::time::Duration;

const HEADS: usize = 32;
const DK: usize = 128;
const DV: usize = 128;

fn inputs(t: usize, seed: u64) -> (Inputs, Tensor) {
    let mut rng = Rng::new(seed);
    let f = DType::F32;
    let l2 = |x: Tensor| -> Tensor {
        let norm = x
            .sqr()
            .unwrap()
            .sum_keepdim(D::Minus1)
            .unwrap()
            .sqrt()
            .unwrap();
        x.broadcast_div(&norm).unwrap()
    };
    let q =
        (l2(rng.normal_tensor(&[HEADS, t, DK], 1.0, f).unwrap()) * (DK as f64).powf(-0.5)).unwrap();
    let k = l2(rng.normal_tensor(&[HEADS, t, DK], 1.0, f).unwrap());
    let v = rng.normal_tensor(&[HEADS, t, DV], 1.0, f).unwrap();
    let g = rng.uniform_tensor(&[HEADS, t], -1.0, -1e-3, f).unwrap();
    let beta = rng.uniform_tensor(&[HEADS, t], 0.05, 0.95, f).unwrap();
    let state = rng.normal_tensor(&[HEADS, DK, DV], 0.1, f).unwrap();
    (Inputs { q, k, v, g, beta }, state)
}

fn id(t: usize) -> String {
    format!("Hv{HEADS}_T{t}")
}

fn forms(c: &mut Criterion) {
    let mut group = c.benchmark_group("deltanet");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for t in [16, 64, 256, 1024, 4096] {
        let (x, s) = inputs(t, t as u64);
        if t <= 1024 {
            group.bench_with_input(BenchmarkId::new("sequential", id(t)), &t, |b, _| {
                b.iter(|| deltanet::run(Form::Sequential, &x, &s).unwrap())
            });
            group.bench_with_input(BenchmarkId::new("matrix", id(t)), &t, |b, _| {
                b.iter(|| deltanet::run(Form::Matrix, &x, &s).unwrap())
            });
        }
        for inverse in Inverse::ALL {
            let form = Form::Chunked { block: 64, inverse };
            let name = format!("chunked_{}_C64", inverse.name());
            group.bench_with_input(BenchmarkId::new(name, id(t)), &t, |b, _| {
                b.iter(|| deltanet::run(form, &x, &s).unwrap())
            });
        }
        if t <= 1024 {
            let name = "chunked_substitution_candle_C64";
            group.bench_with_input(BenchmarkId::new(name, id(t)), &t, |b, _| {
                b.iter(|| deltanet::chunked_candle(&x, &s, 64, Inverse::Substitution).unwrap())
            });
        }
    }
    // One decode step.
    let (x, s) = inputs(1, 1);
    group.bench_with_input(BenchmarkId::new("matrix", id(1)), &1, |b, _| {
        b.iter(|| deltanet::step(&x, &s).unwrap())
    });
    group.bench_with_input(BenchmarkId::new("matrix_candle", id(1)), &1, |b, _| {
        b.iter(|| deltanet::step_candle(&x, &s).unwrap())
    });
    group.bench_with_input(BenchmarkId::new("sequential", id(1)), &1, |b, _| {
        b.iter(|| deltanet::sequential(&x, &s).unwrap())
    });
    group.finish();
}

fn chunk_sizes(c: &mut Criterion) {
    let mut group = c.benchmark_group("deltanet");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    let t = 1024;
    let (x, s) = inputs(t, 7);
    for block in [16, 32, 128, 256] {
        for inverse in Inverse::ALL {
            let form = Form::Chunked { block, inverse };
            let name = format!("chunked_{}_C{block}", inverse.name());
            group.bench_with_input(BenchmarkId::new(name, id(t)), &t, |b, _| {
                b.iter(|| deltanet::run(form, &x, &s).unwrap())
            });
        }
    }
    // The triangular inverse of one chunk alone, on a realistic N (the strictly lower part of K Kᵀ, decayed).
    for size in [16, 64, 256] {
        let (x, _) = inputs(size, 11);
        let kkt = x.k.matmul(&x.k.transpose(1, 2).unwrap()).unwrap();
        let mask: Vec<f32> = (0..size * size)
            .map(|i| if i % size < i / size { 0.5 } else { 0.0 })
            .collect();
        let mask = Tensor::from_vec(mask, (size, size), &Device::Cpu).unwrap();
        let n = kkt.broadcast_mul(&mask).unwrap();
        for inverse in Inverse::ALL {
            let name = format!("tri_inverse_{}", inverse.name());
            group.bench_with_input(
                BenchmarkId::new(name, format!("Hv{HEADS}_C{size}")),
                &size,
                |b, _| b.iter(|| deltanet::tri_inverse(&n, inverse).unwrap()),
            );
        }
    }
    group.finish();
}

criterion_group!(benches, forms, chunk_sizes);
criterion_main!(benches);
