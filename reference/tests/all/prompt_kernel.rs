//! The prompt's product ([`PromptKernel::Avx512`], `T >` [`MATVEC_MAX_TOKENS`]) against the summation order of the
//! reference's products (`reference::linear`'s module docs): on a CPU that runs it, the product of a mapped (bf16,
//! f16, f32: through `forward`) or packed (INT4 of every kind of group, INT8: `prompt_product`) weight gives, for
//! every token count from 9 to 70,
//! the same bits as [`matvec`] / [`matvec_packed`] of the same weight and inputs, and as the order written out as
//! scalar code with fused multiply-adds: on odd shapes (tails of every length, widths past one block of steps, row
//! counts that leave a partial row group and several row blocks, odd byte offsets), with inputs and weights of
//! mixed magnitude, zeros and tiny values, on one thread or several. Where the CPU lacks AVX-512F the prompt keeps
//! the blocked GEMM and these tests check nothing here (the kernel's driver, with every way it cuts a call, is
//! checked on any CPU by the unit tests of `gemm_kernel`, on emulated registers).

use crate::common::random_quantized;
use half::f16;
use reference::linear::{
    Elem, MATVEC_MAX_TOKENS, MappedMatrix, PackedMatrix, PromptKernel, SharedMap, matvec,
    matvec_packed,
};
use reference::quant::QuantKind;
use reference::synthetic::Rng;

use candle_core::{Device, Tensor};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Values of mixed magnitude, a few exact zeros and tiny values.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| match rng.next_u64() % 16 {
            0 => 0.0,
            1 => (1e-30 * rng.normal()) as f32,
            _ => (rng.normal() * 10f64.powf(rng.range(-2.0, 2.0))) as f32,
        })
        .collect()
}

/// One output in the documented order, fused: 32 lane accumulators over the first `32⌊n/32⌋` products, lane
/// `i mod 32`, combined `(l + (l+8)) + ((l+16) + (l+24))` then `(l, l+4)`, `(l, l+2)`, `(l, l+1)`; the rest added in
/// order.
fn scalar(w: &[f32], x: &[f32]) -> f32 {
    let main = w.len() / 32 * 32;
    let mut acc = [0f32; 32];
    for i in 0..main {
        acc[i % 32] = x[i].mul_add(w[i], acc[i % 32]);
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
        sum = x[i].mul_add(w[i], sum);
    }
    sum
}

/// `x Wᵀ` through `forward` (a tensor in, a tensor out) for `x` `[t, cols]`.
fn forward(f: impl Fn(&Tensor) -> reference::Result<Tensor>, x: &[f32], t: usize) -> Vec<f32> {
    let cols = x.len() / t;
    let xt = Tensor::from_vec(x.to_vec(), (t, cols), &Device::Cpu).unwrap();
    f(&xt).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// Token counts: every one from the first past the matvec's to 70 on small matrices, a spread on larger ones.
fn token_counts(rows: usize, cols: usize) -> Vec<usize> {
    let first = MATVEC_MAX_TOKENS + 1;
    if rows * cols <= 20_000 {
        (first..=70).collect()
    } else {
        vec![first, 10, 12, 13, 17, 31, 64, 67]
    }
}

/// Whether this CPU runs the kernel; says so when it does not.
fn runs() -> bool {
    let avx512 = PromptKernel::detect() == PromptKernel::Avx512;
    if !avx512 {
        eprintln!(
            "prompt_kernel: no AVX-512F here, the prompt runs the blocked GEMM; nothing to check"
        );
    }
    avx512
}

/// The prompt product on `weights` (row-major `[rows, cols]`, exactly as the kernel reads them) against the matvec
/// and the scalar order, for each token count.
fn check(
    what: &str,
    weights: &[f32],
    rows: usize,
    cols: usize,
    product: impl Fn(&[f32], usize) -> Vec<f32>,
    mv: impl Fn(&[f32], usize) -> Vec<f32>,
) {
    for t in token_counts(rows, cols) {
        let x = values(t * cols, 100 + t as u64 + cols as u64);
        let y = product(&x, t);
        assert_eq!(
            bits(&y),
            bits(&mv(&x, t)),
            "{what} [{rows}, {cols}] T={t}: matvec"
        );
        for j in 0..t {
            for r in 0..rows {
                let expected = scalar(
                    &weights[r * cols..(r + 1) * cols],
                    &x[j * cols..(j + 1) * cols],
                );
                assert_eq!(
                    y[j * rows + r].to_bits(),
                    expected.to_bits(),
                    "{what} [{rows}, {cols}] T={t} token {j} row {r}: scalar order"
                );
            }
        }
    }
}

/// Shapes: tails of 0, 1, 31 and odd lengths, no main part at all, widths past one block of steps (24 · 32), row
/// counts odd and past several row blocks.
const SHAPES: [(usize, usize); 10] = [
    (1, 1),
    (3, 31),
    (5, 32),
    (7, 33),
    (4, 63),
    (13, 64),
    (37, 100),
    (130, 257),
    (9, 800),
    (21, 1601),
];

fn stored(values: &[f32], elem: Elem, pad: usize) -> (SharedMap, Vec<f32>) {
    let mut bytes = vec![0u8; pad];
    let mut exact = Vec::with_capacity(values.len());
    for &v in values {
        match elem {
            Elem::Bf16 => {
                let h = half::bf16::from_f32(v);
                bytes.extend(h.to_le_bytes());
                exact.push(h.to_f32());
            }
            Elem::F16 => {
                let h = f16::from_f32(v);
                bytes.extend(h.to_le_bytes());
                exact.push(h.to_f32());
            }
            Elem::F32 => {
                bytes.extend(v.to_le_bytes());
                exact.push(v);
            }
        }
    }
    (SharedMap::from_vec(bytes), exact)
}

#[test]
fn the_prompt_product_of_a_mapped_weight_equals_the_matvec_bit_for_bit() {
    if !runs() {
        return;
    }
    for elem in [Elem::Bf16, Elem::F16, Elem::F32] {
        for (k, (rows, cols)) in SHAPES.into_iter().enumerate() {
            let (map, exact) = stored(&values(rows * cols, 1 + k as u64), elem, 3);
            let m = MappedMatrix::new(&map, 3, rows, cols, elem).unwrap();
            check(
                &format!("{elem:?}"),
                &exact,
                rows,
                cols,
                |x, t| {
                    let y = forward(|x| m.forward(x), x, t);
                    assert_eq!(bits(&y), bits(&m.prompt_product(x, t).unwrap()));
                    y
                },
                |x, t| matvec(&m, x, t),
            );
        }
    }
}

#[test]
fn the_prompt_product_of_a_packed_weight_equals_the_matvec_bit_for_bit() {
    if !runs() {
        return;
    }
    use QuantKind::*;
    let cases = [
        // Groups of whole blocks (the released models' 128), with and without a tail, past a block of steps.
        (Int4Sym { group: 128 }, 9, 256),
        (Int4Sym { group: 128 }, 5, 896),
        (Int4Sym { group: 32 }, 7, 96),
        (Int4Sym { group: 64 }, 37, 64),
        // Half blocks: two groups in one block, or a group ending inside one.
        (Int4Sym { group: 16 }, 9, 112),
        (Int4Sym { group: 48 }, 4, 144),
        // One group a row, with a tail.
        (Int4Sym { group: 100 }, 5, 100),
        (Int4Sym { group: 33 }, 3, 33),
        // Groups that split a half block (widened element by element).
        (Int4Sym { group: 8 }, 6, 40),
        (Int4Sym { group: 5 }, 11, 65),
        (Int4Sym { group: 1 }, 2, 9),
        (Int8Sym, 1, 1),
        (Int8Sym, 9, 33),
        (Int8Sym, 33, 100),
        (Int8Sym, 13, 257),
        (Int8Sym, 21, 800),
    ];
    for (case, (kind, rows, cols)) in cases.into_iter().enumerate() {
        let q = random_quantized(kind, rows, cols, 1 + case as u64);
        let p = PackedMatrix::from_quantized(&q).unwrap();
        check(
            &format!("{kind:?}"),
            &q.dequantize(),
            rows,
            cols,
            |x, t| p.prompt_product(x, t).expect("the CPU runs the kernel"),
            |x, t| matvec_packed(&p, x, t),
        );
    }
}

#[test]
fn the_prompt_product_splits_rows_across_threads_without_changing_a_bit() {
    if !runs() {
        return;
    }
    let (rows, cols, t) = (3000, 96, 23);
    let (map, _) = stored(&values(rows * cols, 5), Elem::Bf16, 0);
    let m = MappedMatrix::new(&map, 0, rows, cols, Elem::Bf16).unwrap();
    let x = values(t * cols, 6);
    let many = forward(|x| m.forward(x), &x, t);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let one = pool.install(|| forward(|x| m.forward(x), &x, t));
    assert_eq!(bits(&many), bits(&one));
    assert_eq!(bits(&many), bits(&matvec(&m, &x, t)));
}
