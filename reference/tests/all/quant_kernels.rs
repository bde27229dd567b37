//! The packed matrix-vector kernels ([`QuantKernel`]) against the summation order the reference's products promise
//! (`reference::linear`'s module docs), written out as scalar code: every kernel this CPU runs gives the same bits
//! as the scalar statement (fused multiply-adds for the SIMD kernels, separate roundings for the portable one) and as
//! the f32 matvec on the dequantised matrix, on odd shapes, every kind of group (whole blocks, half blocks, groups
//! that split a half block and fall back, one group a row), row counts that leave every remainder of the AVX-512
//! kernel's four or two rows at a time, and every token count of the matvec. Codes and scales are drawn directly:
//! negative, zero, subnormal and large scales, every code.

use crate::common::random_quantized;
use reference::linear::{
    Elem, MATVEC_MAX_TOKENS, MappedMatrix, PackedMatrix, QuantKernel, SharedMap, matvec,
    matvec_packed, matvec_packed_on,
};
use reference::quant::QuantKind;
use reference::synthetic::Rng;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Inputs: normals of mixed magnitude, a few exact zeros and tiny values.
fn inputs(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| match rng.next_u64() % 16 {
            0 => 0.0,
            1 => (1e-30 * rng.normal()) as f32,
            _ => (rng.normal() * 10f64.powf(rng.range(-2.0, 2.0))) as f32,
        })
        .collect()
}

/// One output in the documented order: 32 lane accumulators over the first `32⌊n/32⌋` products, lane `i mod 32`,
/// combined `(l + (l+8)) + ((l+16) + (l+24))` then `(l, l+4)`, `(l, l+2)`, `(l, l+1)`; the rest added in order.
/// `fused`: each multiply-add rounded once (the SIMD kernels), else twice (the portable one).
fn scalar(w: &[f32], x: &[f32], fused: bool) -> f32 {
    let step = |acc: f32, x: f32, w: f32| {
        if fused {
            x.mul_add(w, acc)
        } else {
            acc + x * w
        }
    };
    let main = w.len() / 32 * 32;
    let mut acc = [0f32; 32];
    for i in 0..main {
        acc[i % 32] = step(acc[i % 32], x[i], w[i]);
    }
    let mut s = [0f32; 8];
    for l in 0..8 {
        s[l] = (acc[l] + acc[l + 8]) + (acc[l + 16] + acc[l + 24]);
    }
    for half in [4, 2, 1] {
        for l in 0..half {
            s[l] += s[l + half];
        }
    }
    let mut sum = s[0];
    for i in main..w.len() {
        sum = step(sum, x[i], w[i]);
    }
    sum
}

fn kernels() -> Vec<QuantKernel> {
    [
        QuantKernel::Avx512,
        QuantKernel::Avx2,
        QuantKernel::Portable,
    ]
    .into_iter()
    .filter(|k| k.available())
    .collect()
}

#[test]
fn every_packed_kernel_sums_in_the_documented_order_bit_for_bit() {
    use QuantKind::*;
    let cases = [
        // Groups of whole blocks, with and without a tail.
        (Int4Sym { group: 32 }, 7, 96),
        (Int4Sym { group: 64 }, 3, 128),
        (Int4Sym { group: 128 }, 5, 384),
        (Int4Sym { group: 128 }, 2, 4096),
        // Half blocks: two groups in one block, or a group ending inside one.
        (Int4Sym { group: 16 }, 9, 112),
        (Int4Sym { group: 48 }, 4, 144),
        (Int4Sym { group: 80 }, 3, 160),
        // One group a row, with a tail of odd length.
        (Int4Sym { group: 100 }, 5, 100),
        (Int4Sym { group: 33 }, 3, 33),
        (Int4Sym { group: 7 }, 3, 7),
        // Groups that split a half block: the AVX2 kernel's element-wise widening.
        (Int4Sym { group: 8 }, 6, 40),
        (Int4Sym { group: 24 }, 5, 72),
        (Int4Sym { group: 5 }, 11, 65),
        (Int4Sym { group: 1 }, 2, 9),
        (Int8Sym, 1, 1),
        (Int8Sym, 3, 17),
        (Int8Sym, 5, 32),
        (Int8Sym, 9, 33),
        (Int8Sym, 33, 100),
        (Int8Sym, 13, 257),
        (Int8Sym, 4, 4096),
    ];
    let kernels = kernels();
    for (case, (kind, rows, cols)) in cases.into_iter().enumerate() {
        let q = random_quantized(kind, rows, cols, 1 + case as u64);
        let p = PackedMatrix::from_quantized(&q).unwrap();
        let w = q.dequantize();
        let f32_bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let dense =
            MappedMatrix::new(&SharedMap::from_vec(f32_bytes), 0, rows, cols, Elem::F32).unwrap();
        for t in 1..=MATVEC_MAX_TOKENS {
            let x = inputs(t * cols, 100 + 10 * case as u64 + t as u64);
            for &kernel in &kernels {
                let fused = kernel != QuantKernel::Portable;
                let y = matvec_packed_on(&p, &x, t, kernel);
                let mut expected = vec![0f32; t * rows];
                for j in 0..t {
                    for r in 0..rows {
                        expected[j * rows + r] = scalar(
                            &w[r * cols..(r + 1) * cols],
                            &x[j * cols..(j + 1) * cols],
                            fused,
                        );
                    }
                }
                let what = format!("{kernel:?} {kind:?} [{rows}, {cols}] T={t}");
                assert_eq!(bits(&y), bits(&expected), "{what}");
                if fused && kernel == QuantKernel::detect() {
                    assert_eq!(bits(&y), bits(&matvec(&dense, &x, t)), "{what}: matvec");
                    assert_eq!(bits(&y), bits(&matvec_packed(&p, &x, t)), "{what}");
                }
            }
        }
    }
}

#[test]
fn the_kernel_the_cpu_runs_is_the_fastest_it_has() {
    let k = QuantKernel::detect();
    assert!(k.available());
    assert!(QuantKernel::Portable.available());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        assert_eq!(k, QuantKernel::Avx512);
    }
}
