//! Unit tests of the packed products: the layouts, the kernels against the documented order, and `forward`'s paths.

use super::super::kernel::portable_dot as mapped_portable_dot;
use super::super::{MappedMatrix, SharedMap, matvec};
use super::*;
use crate::quant::{QuantKind, QuantizedMatrix, quantize_int4_sym, quantize_int8_sym};
use candle_core::{Device, Tensor};

/// Deterministic values in [-1, 1), each row scaled by its own magnitude; every seventh row zero.
fn weights(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let mut w = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let magnitude = 2f32.powi((r % 5) as i32 - 3);
        for _ in 0..cols {
            let v = next() * magnitude;
            w.push(if r % 7 == 6 { 0.0 } else { v });
        }
    }
    w
}

fn quantized(kind: QuantKind, rows: usize, cols: usize, seed: u64) -> QuantizedMatrix {
    let w = weights(rows, cols, seed);
    match kind {
        QuantKind::Int4Sym { group } => quantize_int4_sym(&w, rows, cols, group).unwrap(),
        QuantKind::Int8Sym => quantize_int8_sym(&w, rows, cols).unwrap(),
    }
}

/// The dequantised matrix as f32 bytes at byte offset `pad` (odd: loads must not assume alignment).
fn dequantized(q: &QuantizedMatrix, pad: usize) -> MappedMatrix {
    let mut bytes = vec![0u8; pad];
    for v in q.dequantize() {
        bytes.extend(v.to_le_bytes());
    }
    MappedMatrix::new(
        &SharedMap::from_vec(bytes),
        pad,
        q.rows(),
        q.cols(),
        Elem::F32,
    )
    .unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `matvec_packed` (SIMD where available) and the portable kernel against `matvec` and its portable kernel on
/// the dequantised f32 matrix: the same bits for every token count.
fn check(kind: QuantKind, rows: usize, cols: usize) {
    let q = quantized(kind, rows, cols, 1 + rows as u64 * 31 + cols as u64);
    let p = PackedMatrix::from_quantized(&q).unwrap();
    let m = dequantized(&q, 3);
    assert_eq!(bits(&p.rows_f32(0, rows)), bits(&q.dequantize()));
    for t in 1..=8 {
        let x = weights(t, cols, 7 + t as u64);
        let a = matvec_packed(&p, &x, t);
        let b = matvec(&m, &x, t);
        assert_eq!(bits(&a), bits(&b), "{kind:?} [{rows}, {cols}] T={t}");
        for r in 0..rows {
            let mut ya = vec![0f32; t];
            let mut yb = vec![0f32; t];
            portable_dot(&p.row(r), &x, cols, &mut ya);
            mapped_portable_dot(m.row_bytes(r), Elem::F32, &x, cols, &mut yb);
            assert_eq!(
                bits(&ya),
                bits(&yb),
                "portable {kind:?} [{rows}, {cols}] T={t} row {r}"
            );
        }
    }
}

#[test]
fn packed_matvec_equals_the_f32_matvec_on_the_dequantised_values_bit_for_bit() {
    use QuantKind::*;
    for (kind, rows, cols) in [
        // Groups that are whole 32-lane blocks, one group a row, and groups that split blocks (odd ones too).
        (Int4Sym { group: 128 }, 9, 256),
        (Int4Sym { group: 32 }, 5, 96),
        (Int4Sym { group: 64 }, 3, 64),
        (Int4Sym { group: 33 }, 7, 33),
        (Int4Sym { group: 8 }, 6, 40),
        (Int4Sym { group: 16 }, 4, 112),
        (Int4Sym { group: 48 }, 3, 144),
        (Int4Sym { group: 3 }, 5, 15),
        (Int4Sym { group: 5 }, 11, 65),
        (Int4Sym { group: 1 }, 2, 7),
        (Int4Sym { group: 31 }, 3, 31),
        (Int8Sym, 1, 1),
        (Int8Sym, 3, 17),
        (Int8Sym, 4, 31),
        (Int8Sym, 6, 32),
        (Int8Sym, 9, 33),
        (Int8Sym, 33, 100),
        (Int8Sym, 13, 257),
    ] {
        check(kind, rows, cols);
    }
}

#[test]
fn packed_matvec_splits_rows_across_threads_without_changing_a_bit() {
    for kind in [QuantKind::Int4Sym { group: 32 }, QuantKind::Int8Sym] {
        let (rows, cols) = (3000, 96);
        let q = quantized(kind, rows, cols, 3);
        let p = PackedMatrix::from_quantized(&q).unwrap();
        let x = weights(3, cols, 5);
        let many = matvec_packed(&p, &x, 3);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let one = pool.install(|| matvec_packed(&p, &x, 3));
        assert_eq!(bits(&many), bits(&one), "{kind:?}");
        assert_eq!(bits(&many), bits(&matvec(&dequantized(&q, 0), &x, 3)));
    }
}

#[test]
fn packing_keeps_every_code_and_scale_and_blocks_pack_as_the_whole() {
    for (kind, rows, cols) in [
        (QuantKind::Int4Sym { group: 5 }, 23, 15),
        (QuantKind::Int4Sym { group: 16 }, 20, 64),
        (QuantKind::Int8Sym, 17, 9),
    ] {
        let w = weights(rows, cols, 9);
        let quant = |r: std::ops::Range<usize>| match kind {
            QuantKind::Int4Sym { group } => {
                quantize_int4_sym(&w[r.start * cols..r.end * cols], r.len(), cols, group)
            }
            QuantKind::Int8Sym => {
                quantize_int8_sym(&w[r.start * cols..r.end * cols], r.len(), cols)
            }
        };
        let whole = quant(0..rows).unwrap();
        let p = PackedMatrix::from_quantized(&whole).unwrap();
        assert_eq!(p.to_quantized().unwrap(), whole);
        if let QuantKind::Int4Sym { .. } = kind {
            // Every code is where `int4_position` puts it.
            let row_bytes = p.row_bytes();
            for (i, &c) in whole.codes().iter().enumerate() {
                let (byte, shift) = int4_position(i % cols, cols);
                assert_eq!(low_code(p.codes[i / cols * row_bytes + byte] >> shift), c);
            }
        }
        for block in [1, 4, rows, rows + 3] {
            let b = PackedMatrix::from_row_blocks(kind, rows, cols, block, quant).unwrap();
            assert_eq!(b.codes, p.codes, "{kind:?} blocks of {block}");
            assert_eq!(b.scales, p.scales, "{kind:?} blocks of {block}");
        }
        // A block of the wrong shape, a failing block, and a group that does not divide the width are errors.
        let wrong = PackedMatrix::from_row_blocks(kind, rows, cols, 4, |_| quant(0..1));
        assert!(wrong.unwrap_err().to_string().contains("expected"));
        let failing = PackedMatrix::from_row_blocks(kind, rows, cols, 4, |r| {
            if r.start >= 8 {
                Err(crate::error::Error::Input("block refused".into()))
            } else {
                quant(r)
            }
        });
        assert!(failing.unwrap_err().to_string().contains("block refused"));
    }
    let e = PackedMatrix::from_row_blocks(QuantKind::Int4Sym { group: 7 }, 2, 16, 1, |_| {
        unreachable!("the group is checked first")
    });
    assert!(e.unwrap_err().to_string().contains("does not divide"));
}

#[test]
fn int4_rows_hold_blocks_of_32_as_low_and_high_nibbles_and_the_tail_in_order() {
    // One row of 34 codes: code k of the block is k % 16 - 8, so byte k holds nibble (k - 8) & 15 = k ^ 8 twice;
    // the tail (-8, -7) is one byte, in order.
    let codes: Vec<i8> = (0..34).map(|k| (k % 16) as i8 - 8).collect();
    let q = QuantizedMatrix::from_parts(
        QuantKind::Int4Sym { group: 34 },
        1,
        34,
        codes,
        vec![f16::ONE],
    )
    .unwrap();
    let p = PackedMatrix::from_quantized(&q).unwrap();
    let mut expected: Vec<u8> = (0..16u8).map(|k| (k ^ 8) * 0x11).collect();
    expected.push(0x98);
    assert_eq!(*p.codes, expected);
    assert_eq!(p.to_quantized().unwrap(), q);
}

#[test]
fn packed_lookup_and_gemm_path_equal_the_dense_dequantised_matrix() {
    let (rows, cols) = (37, 64);
    let q = quantized(QuantKind::Int4Sym { group: 16 }, rows, cols, 11);
    let p = PackedMatrix::from_quantized(&q).unwrap();
    let deq = q.dequantize();
    let dense = Tensor::from_vec(deq.clone(), (rows, cols), &Device::Cpu).unwrap();
    assert_eq!(
        bits(
            &p.to_tensor()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        ),
        bits(&deq)
    );
    let g = p.gather(&[5, 0, 36]).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(bits(&g[0]), bits(&deq[5 * cols..6 * cols]));
    assert_eq!(bits(&g[2]), bits(&deq[36 * cols..37 * cols]));
    assert!(p.gather(&[37]).is_err());
    for t in [MATVEC_T + 1, 11, 40] {
        let xs = weights(t, cols, 2);
        let x = Tensor::from_vec(xs.clone(), (t, cols), &Device::Cpu).unwrap();
        // A prompt: the packed product in the matvec's order where the CPU has AVX-512F, else candle's GEMM.
        let expected: Vec<f32> = match crate::linear::PromptKernel::detect() {
            crate::linear::PromptKernel::Avx512 => matvec_packed(&p, &xs, t),
            crate::linear::PromptKernel::Gemm => crate::ops::linear(&x, &dense)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap(),
        };
        let y: Vec<f32> = p
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(bits(&y), bits(&expected), "T={t}");
        // Several blocks of rows (the last one short): each block's outputs are candle's product of those rows
        // of the dense matrix, in place (candle's GEMM may order its sums differently for another row count).
        for block in [1, 8, 36] {
            let y = p.forward_gemm(&x, block).unwrap().to_vec2::<f32>().unwrap();
            for start in (0..rows).step_by(block) {
                let count = block.min(rows - start);
                let part = crate::ops::linear(&x, &dense.narrow(0, start, count).unwrap())
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap();
                for (yj, pj) in y.iter().zip(&part) {
                    assert_eq!(
                        bits(&yj[start..start + count]),
                        bits(pj),
                        "T={t}, blocks of {block}"
                    );
                }
            }
        }
    }
    // Few tokens: the matvec; wrong inputs are errors.
    let x = Tensor::from_vec(weights(2, cols, 4), (2, cols), &Device::Cpu).unwrap();
    let y = p
        .forward(&x)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(bits(&y), bits(&matvec(&dequantized(&q, 0), &xs, 2)));
    assert!(
        p.forward(&Tensor::zeros((2, cols + 1), candle_core::DType::F32, &Device::Cpu).unwrap())
            .is_err()
    );
    assert!(
        p.forward(&x.to_dtype(candle_core::DType::F64).unwrap())
            .is_err()
    );
}

const MATVEC_T: usize = super::super::MATVEC_MAX_TOKENS;
