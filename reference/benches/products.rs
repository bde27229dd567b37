//! The matrix-vector (T = 1, a decode step) and matrix-matrix (a prompt of T tokens) products at Qwen3.5-9B's real
//! projection shapes, through the reference's own `linear` (`x Wᵀ`, weights `[out, in]` in f32 as the reference holds
//! them).
//!
//! Names are `linear/{weight}_{out}x{in}/T{T}`. The LM head (`[248320, 4096]`, 4 GB in f32) is timed at T = 1 only:
//! a prompt computes the logits of its last position alone. Throughput is given in FLOPs (`2·T·out·in`), which
//! criterion prints as elements per second.
//!
//! The group `mapped` times the same products on bf16 weights read in place ([`reference::linear::MappedMatrix`]:
//! the widening matvec for T ≤ 8, blocked widening and GEMM above), names `mapped/{weight}_{out}x{in}/T{T}`.
//!
//! The group `quant` times the decode products (T = 1 and 4) on INT4 (group 128) and INT8 (per row) weights at the
//! same shapes, names `quant/{kernel}/{out}x{in}_T{T}`: `matvec_int4_g128` and `matvec_int8` read the packed codes
//! and scales ([`reference::linear::PackedMatrix`]) with the kernel the CPU runs best, `matvec_int4_g128_avx2` and
//! `matvec_int8_avx2` with the AVX2 kernel (when the best is AVX-512), `dense_int4_g128` is the path these weights
//! took before (the dequantised f32 matrix through candle's `matmul`), and `matvec_bf16` the bf16 widening matvec on
//! the same shape. At the projections' shapes it also times a prompt of 439 tokens: `prompt_int4_g128` and
//! `prompt_bf16`, the prompt product on the packed codes and on bf16 (`reference/src/linear/gemm_kernel.rs` where the
//! CPU has AVX-512F, the blocked GEMM elsewhere), beside `prompt_dense_int4_g128`, candle's GEMM on the dequantised
//! f32 matrix.
//!
//! `cargo bench -p reference --bench products [-- FILTER]`.
#![allow(clippy::disallowed_methods)] // tests read their fixtures with std::fs; inputs::open is the library's rule

use candle_core::{Device, Tensor};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use reference::linear::{
    Elem, MappedMatrix, PackedMatrix, QuantKernel, SharedMap, matvec_packed_on,
};
use reference::ops::linear;
use reference::quant::{quantize_int4_sym, quantize_int8_sym};
use std::time::Duration;

/// The prompt length of the `quant` group's prompt products (the 4-layer slice's `bench` prompt).
const PROMPT_TOKENS: usize = 439;

/// (name, out, in) of every distinct projection shape of a layer.
const SHAPES: [(&str, usize, usize); 7] = [
    ("in_proj_qkv", 8192, 4096),
    ("in_proj_z", 4096, 4096),
    ("in_proj_a", 32, 4096),
    ("k_proj", 1024, 4096),
    ("gate_proj", 12288, 4096),
    ("down_proj", 4096, 12288),
    ("q_proj", 8192, 4096),
];

fn products(c: &mut Criterion) {
    let mut group = c.benchmark_group("linear");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let dev = Device::Cpu;
    for (name, out, inp) in SHAPES {
        let w = Tensor::randn(0f32, 1.0 / (inp as f32).sqrt(), (out, inp), &dev).unwrap();
        for t in [1, 16, 128, 512, 2048] {
            let x = Tensor::randn(0f32, 1.0, (t, inp), &dev).unwrap();
            group.throughput(Throughput::Elements((2 * t * out * inp) as u64));
            group.bench_with_input(
                BenchmarkId::new(format!("{name}_{out}x{inp}"), format!("T{t}")),
                &t,
                |b, _| b.iter(|| linear(&x, &w).unwrap()),
            );
        }
    }
    let (vocab, hidden) = (248320, 4096);
    let w = Tensor::randn(0f32, 1.0 / (hidden as f32).sqrt(), (vocab, hidden), &dev).unwrap();
    let x = Tensor::randn(0f32, 1.0, (1, hidden), &dev).unwrap();
    group.throughput(Throughput::Elements((2 * vocab * hidden) as u64));
    group.bench_with_input(
        BenchmarkId::new(format!("lm_head_{vocab}x{hidden}"), "T1"),
        &1,
        |b, _| b.iter(|| linear(&x, &w).unwrap()),
    );
    group.finish();
}

/// A random bf16 matrix `[out, inp]` in an owned buffer, as a mapped checkpoint would hold it.
fn bf16_matrix(out: usize, inp: usize) -> MappedMatrix {
    let w = Tensor::randn(0f32, 1.0 / (inp as f32).sqrt(), (out, inp), &Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let bytes: Vec<u8> = w
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect();
    MappedMatrix::new(&SharedMap::from_vec(bytes), 0, out, inp, Elem::Bf16).unwrap()
}

fn mapped(c: &mut Criterion) {
    let mut group = c.benchmark_group("mapped");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let dev = Device::Cpu;
    for (name, out, inp) in SHAPES {
        let w = bf16_matrix(out, inp);
        for t in [1, 4, 128, 512] {
            let x = Tensor::randn(0f32, 1.0, (t, inp), &dev).unwrap();
            group.throughput(Throughput::Elements((2 * t * out * inp) as u64));
            group.bench_with_input(
                BenchmarkId::new(format!("{name}_{out}x{inp}"), format!("T{t}")),
                &t,
                |b, _| b.iter(|| w.forward(&x).unwrap()),
            );
        }
    }
    let (vocab, hidden) = (248320, 4096);
    let w = bf16_matrix(vocab, hidden);
    let x = Tensor::randn(0f32, 1.0, (1, hidden), &dev).unwrap();
    group.throughput(Throughput::Elements((2 * vocab * hidden) as u64));
    group.bench_with_input(
        BenchmarkId::new(format!("lm_head_{vocab}x{hidden}"), "T1"),
        &1,
        |b, _| b.iter(|| w.forward(&x).unwrap()),
    );
    group.finish();
}

/// Random `[out, inp]` f32 weights as the synthetic checkpoints scale them.
fn random_f32(out: usize, inp: usize) -> Vec<f32> {
    Tensor::randn(0f32, 1.0 / (inp as f32).sqrt(), (out, inp), &Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

fn quant(c: &mut Criterion) {
    let mut group = c.benchmark_group("quant");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let dev = Device::Cpu;
    let shapes = [
        ("in_proj_qkv", 8192, 4096),
        ("gate_proj", 12288, 4096),
        ("down_proj", 4096, 12288),
        ("lm_head", 248320, 4096),
    ];
    for (name, out, inp) in shapes {
        let w = random_f32(out, inp);
        let bf16 = {
            let bytes: Vec<u8> = w
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect();
            MappedMatrix::new(&SharedMap::from_vec(bytes), 0, out, inp, Elem::Bf16).unwrap()
        };
        let lm_head = name == "lm_head";
        // The LM head is INT8 in the exports; the projections INT4 (the int8 variant is timed on them too).
        let int4 = (!lm_head).then(|| {
            PackedMatrix::from_quantized(&quantize_int4_sym(&w, out, inp, 128).unwrap()).unwrap()
        });
        let int8 = PackedMatrix::from_quantized(&quantize_int8_sym(&w, out, inp).unwrap()).unwrap();
        drop(w);
        for t in [1, 4] {
            if lm_head && t > 1 {
                continue;
            }
            let x = Tensor::randn(0f32, 1.0, (t, inp), &dev).unwrap();
            let shape = format!("{out}x{inp}_T{t}");
            group.throughput(Throughput::Elements((2 * t * out * inp) as u64));
            // The AVX2 kernel beside the AVX-512 one, when the CPU runs both.
            let avx2 = (QuantKernel::detect() == QuantKernel::Avx512).then(|| {
                let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
                move |w: &PackedMatrix| matvec_packed_on(w, &xs, t, QuantKernel::Avx2)
            });
            if let Some(int4) = &int4 {
                group.bench_with_input(BenchmarkId::new("matvec_int4_g128", &shape), &t, |b, _| {
                    b.iter(|| int4.forward(&x).unwrap())
                });
                if let Some(avx2) = &avx2 {
                    group.bench_with_input(
                        BenchmarkId::new("matvec_int4_g128_avx2", &shape),
                        &t,
                        |b, _| b.iter(|| avx2(int4)),
                    );
                }
                if out * inp <= 12288 * 4096 {
                    let dense = int4.to_tensor().unwrap();
                    group.bench_with_input(
                        BenchmarkId::new("dense_int4_g128", &shape),
                        &t,
                        |b, _| b.iter(|| linear(&x, &dense).unwrap()),
                    );
                }
            }
            group.bench_with_input(BenchmarkId::new("matvec_int8", &shape), &t, |b, _| {
                b.iter(|| int8.forward(&x).unwrap())
            });
            if let Some(avx2) = &avx2 {
                group.bench_with_input(BenchmarkId::new("matvec_int8_avx2", &shape), &t, |b, _| {
                    b.iter(|| avx2(&int8))
                });
            }
            group.bench_with_input(BenchmarkId::new("matvec_bf16", &shape), &t, |b, _| {
                b.iter(|| bf16.forward(&x).unwrap())
            });
        }
        // A prompt (the slice's 439 tokens) on the same weights: the prompt product on INT4 codes and on bf16
        // (matvec's order), beside candle's GEMM on the dequantised matrix.
        if let Some(int4) = &int4 {
            let t = PROMPT_TOKENS;
            let x = Tensor::randn(0f32, 1.0, (t, inp), &dev).unwrap();
            let shape = format!("{out}x{inp}_T{t}");
            group.throughput(Throughput::Elements((2 * t * out * inp) as u64));
            group.bench_with_input(BenchmarkId::new("prompt_int4_g128", &shape), &t, |b, _| {
                b.iter(|| int4.forward(&x).unwrap())
            });
            group.bench_with_input(BenchmarkId::new("prompt_bf16", &shape), &t, |b, _| {
                b.iter(|| bf16.forward(&x).unwrap())
            });
            let dense = int4.to_tensor().unwrap();
            group.bench_with_input(
                BenchmarkId::new("prompt_dense_int4_g128", &shape),
                &t,
                |b, _| b.iter(|| linear(&x, &dense).unwrap()),
            );
        }
    }
    group.finish();
}

criterion_group!(benches, products, mapped, quant);
criterion_main!(benches);
