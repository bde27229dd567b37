//! The driver ([`super::driver::product_cut`]) on an emulated instruction set: scalar leaves of any register width
//! and tile (the AVX-512 kernel's among them), so the way a call is cut (chunks of steps, passes of tokens, partial
//! row groups and token blocks, several row blocks) is checked bit for bit on every CPU, whatever it runs.

use super::super::kernel::{combine, widen};
use super::driver::{Blocking, blocking, cache_bytes, product_cut};
use super::*;
use crate::quant::{QuantKind, QuantizedMatrix};
use crate::synthetic::Rng;
use half::f16;

/// Scalar leaves with `W` lanes a register, a tile of `R` rows × `T` tokens and `S` steps between visits of the
/// accumulators: fused multiply-adds in the order the real tiles run them.
struct Emulated<const W: usize, const R: usize, const T: usize, const S: usize>;

impl<const W: usize, const R: usize, const T: usize, const S: usize> Isa for Emulated<W, R, T, S> {
    const WIDTH: usize = W;
    const ROWS: usize = R;
    const TOKENS: usize = T;
    const STEPS: usize = S;

    unsafe fn tile(panel: &[f32], xs: &[f32], len: usize, acc: &mut [f32], first: bool) {
        assert!(acc.len() >= R * T * W);
        // The alignment a register of W lanes loads with (64 bytes at most), as the real tiles assert it.
        let aligned = |p: *const f32| (p as usize).is_multiple_of((4 * W).min(64));
        assert!(aligned(panel.as_ptr()) && aligned(xs.as_ptr()) && aligned(acc.as_ptr()));
        if first {
            acc[..R * T * W].fill(0.0);
        }
        for s in 0..len {
            for r in 0..R {
                for j in 0..T {
                    for l in 0..W {
                        let a = &mut acc[(r * T + j) * W + l];
                        *a = xs[(s * T + j) * W + l].mul_add(panel[(s * R + r) * W + l], *a);
                    }
                }
            }
        }
    }

    unsafe fn widen_stored(
        row: &[u8],
        elem: Elem,
        steps: Range<usize>,
        dst: &mut [f32],
        stride: usize,
        second: usize,
    ) {
        check_panel(dst, W, steps.len(), stride, second);
        let mut buf = [0f32; LANES];
        for (k, s) in steps.enumerate() {
            widen(&row[s * LANES * elem.size()..], elem, &mut buf);
            for (p, part) in buf.chunks_exact(W).enumerate() {
                dst[p * second + k * stride..][..W].copy_from_slice(part);
            }
        }
    }

    unsafe fn widen_packed(
        row: &PackedRow,
        steps: Range<usize>,
        dst: &mut [f32],
        stride: usize,
        second: usize,
    ) {
        widen_packed_by_steps(row, W, steps, dst, stride, second);
    }

    unsafe fn combine(acc: &[f32], part: usize) -> f32 {
        let mut lanes = [0f32; LANES];
        for (p, l) in lanes.chunks_exact_mut(W).enumerate() {
            l.copy_from_slice(&acc[p * part..][..W]);
        }
        combine(&lanes)
    }

    unsafe fn prefetch(_: &[f32]) {}
}

/// The documented order for one output, fused: 32 lane accumulators, combined, then the tail in order.
fn expected(w: &[f32], x: &[f32]) -> f32 {
    let main = w.len() / LANES * LANES;
    let mut acc = [0f32; LANES];
    for i in 0..main {
        acc[i % LANES] = x[i].mul_add(w[i], acc[i % LANES]);
    }
    let mut sum = combine(&acc);
    for i in main..w.len() {
        sum = x[i].mul_add(w[i], sum);
    }
    sum
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| (rng.normal() * 10f64.powf(rng.range(-2.0, 2.0))) as f32)
        .collect()
}

/// `product_cut` on `I` for every cut in `cuts` (steps per chunk, rows per block, tokens per pass) against the
/// documented order on `weights` (`[rows, cols]`, the values the matrix holds), for a few token counts.
fn check<I: Isa>(what: &str, m: &impl Panels, weights: &[f32], cuts: &[(usize, usize, usize)]) {
    let (rows, cols) = m.shape();
    for t in [1, I::TOKENS + 1, 3 * I::TOKENS + 2] {
        let x = values(t * cols, 7 + t as u64);
        for &(chunk, block, pass) in cuts {
            let mut y = vec![f32::NAN; rows * t];
            let cut = Blocking { chunk, block };
            // SAFETY: the emulated leaves need no instruction set.
            unsafe { product_cut::<I>(m, &x, t, cut, pass, &mut y) };
            for j in 0..t {
                for r in 0..rows {
                    let e = expected(&weights[r * cols..][..cols], &x[j * cols..][..cols]);
                    assert_eq!(
                        y[j * rows + r].to_bits(),
                        e.to_bits(),
                        "{what} [{rows}, {cols}] T={t} chunk {chunk} block {block} pass {pass}: token {j} row {r}"
                    );
                }
            }
        }
    }
}

fn bf16_matrix(rows: usize, cols: usize, seed: u64) -> (MappedMatrix, Vec<f32>) {
    let vals: Vec<half::bf16> = values(rows * cols, seed)
        .into_iter()
        .map(half::bf16::from_f32)
        .collect();
    let bytes = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let map = super::super::SharedMap::from_vec(bytes);
    let m = MappedMatrix::new(&map, 0, rows, cols, Elem::Bf16).unwrap();
    (m, vals.iter().map(|v| v.to_f32()).collect())
}

/// A packed matrix of random codes and positive scales, and the values it holds.
fn packed_matrix(kind: QuantKind, rows: usize, cols: usize, seed: u64) -> (PackedMatrix, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let (lo, hi) = kind.code_range();
    let span = (hi as i64 - lo as i64 + 1) as u64;
    let codes = (0..rows * cols)
        .map(|_| (lo as i64 + (rng.next_u64() % span) as i64) as i8)
        .collect();
    let per_row = match kind {
        QuantKind::Int4Sym { group } => cols / group,
        QuantKind::Int8Sym => 1,
    };
    let scales = (0..rows * per_row)
        .map(|_| f16::from_f64(rng.range(0.01, 2.0)))
        .collect();
    let q = QuantizedMatrix::from_parts(kind, rows, cols, codes, scales).unwrap();
    (PackedMatrix::from_quantized(&q).unwrap(), q.dequantize())
}

/// Chunks of one, two and every step; blocks of one tile, of a few and of every row; passes of one token block and
/// of more tokens than there are.
fn cuts(rows_tile: usize, tokens_tile: usize) -> Vec<(usize, usize, usize)> {
    vec![
        (1, rows_tile, tokens_tile),
        (2, 2 * rows_tile, 2 * tokens_tile),
        (3, rows_tile, 1),
        (usize::MAX, 3 * rows_tile, 1000),
        (usize::MAX, 64 * rows_tile, tokens_tile),
    ]
}

#[test]
fn every_cut_of_a_mapped_product_gives_the_documented_order_bit_for_bit() {
    for (k, (rows, cols)) in [(1, 1), (7, 31), (5, 96), (11, 161), (13, 200)]
        .into_iter()
        .enumerate()
    {
        let (m, w) = bf16_matrix(rows, cols, k as u64);
        let what = format!("bf16 {k}");
        check::<Emulated<16, 4, 6, 2>>(&what, &m, &w, &cuts(4, 6));
        check::<Emulated<8, 3, 4, 3>>(&what, &m, &w, &cuts(3, 4));
        check::<Emulated<32, 1, 2, 1>>(&what, &m, &w, &cuts(1, 2));
    }
}

#[test]
fn every_cut_of_a_packed_product_gives_the_documented_order_bit_for_bit() {
    for (k, (kind, rows, cols)) in [
        (QuantKind::Int4Sym { group: 32 }, 5, 128),
        (QuantKind::Int4Sym { group: 8 }, 7, 72),
        (QuantKind::Int8Sym, 9, 100),
    ]
    .into_iter()
    .enumerate()
    {
        let (p, w) = packed_matrix(kind, rows, cols, 40 + k as u64);
        let what = format!("{kind:?}");
        check::<Emulated<16, 4, 6, 2>>(&what, &p, &w, &cuts(4, 6));
        check::<Emulated<8, 3, 4, 3>>(&what, &p, &w, &cuts(3, 4));
    }
}

/// A GGUF matrix of random blocks of `ty` (finite values) with a row order (reversed) and, when `columns`, a column
/// order (rotated by one), and the values it holds: the scalar decoder's, rows and columns in those orders.
fn gguf_matrix(
    ty: crate::gguf::GgmlType,
    rows: usize,
    cols: usize,
    columns: bool,
    seed: u64,
) -> (super::super::GgufMatrix, Vec<f32>) {
    use crate::gguf::decode::{Decoder, dequantize_on, random_blocks};
    let blocks = rows * cols / ty.block_elems();
    let bytes = random_blocks(ty, blocks, seed).unwrap();
    let mut stored = vec![0f32; rows * cols];
    dequantize_on(ty, &bytes, &mut stored, Decoder::Scalar).unwrap();
    let row_order: Vec<usize> = (0..rows).rev().collect();
    let col_order: Vec<usize> = (0..cols).map(|c| (c + 1) % cols).collect();
    let mut values = Vec::with_capacity(rows * cols);
    for &s in &row_order {
        let row = &stored[s * cols..(s + 1) * cols];
        match columns {
            true => values.extend(col_order.iter().map(|&c| row[c])),
            false => values.extend_from_slice(row),
        }
    }
    // One byte before the blocks: the rows' bytes are not aligned for candle's block types.
    let mut buf = vec![0u8; 1];
    buf.extend_from_slice(&bytes);
    let map = super::super::SharedMap::from_vec(buf);
    let m = super::super::GgufMatrix::new(
        &map,
        1,
        ty,
        (rows, cols),
        Some(row_order),
        columns.then_some(col_order),
    )
    .unwrap();
    (m, values)
}

/// GGUF matrices of the vectorised types and a few others, blocks of 256 values (8 steps) and of 32 or 1, under
/// cuts whose chunks start and end inside blocks: the decoded runs of blocks laid into the panels.
fn gguf_cases() -> Vec<(crate::gguf::GgmlType, usize, usize, bool)> {
    use crate::gguf::GgmlType::*;
    vec![
        (Q4_K, 7, 512, false),
        (Q6_K, 5, 768, true),
        (Q5_K, 6, 256, false),
        (Q8_0, 9, 96, true),
        (Q4_0, 3, 160, false),
        (F16, 5, 77, true),
        (BF16, 7, 45, false),
        (IQ4_XS, 4, 256, false),
        (Q3_K, 3, 512, true),
    ]
}

#[test]
fn every_cut_of_a_gguf_product_gives_the_documented_order_bit_for_bit() {
    for (k, (ty, rows, cols, columns)) in gguf_cases().into_iter().enumerate() {
        let (m, w) = gguf_matrix(ty, rows, cols, columns, 80 + k as u64);
        let what = format!("{ty}");
        check::<Emulated<16, 4, 6, 2>>(&what, &m, &w, &cuts(4, 6));
        check::<Emulated<8, 3, 4, 3>>(&what, &m, &w, &cuts(3, 4));
    }
}

#[test]
fn a_block_fits_the_panel_and_the_steps_split_only_when_too_few_rows_would() {
    // 4096 inputs (128 steps) in 256 KiB: 32 rows need 512 KiB, so chunks of 64 steps with 33 rows (11 tiles).
    let c = blocking(4096, 128, 2, 256 << 10, 3);
    assert_eq!(
        c,
        Blocking {
            chunk: 64,
            block: 33
        }
    );
    // 1 MiB: the whole width, 64 rows.
    let c = blocking(4096, 128, 2, 1 << 20, 4);
    assert_eq!(
        c,
        Blocking {
            chunk: 128,
            block: 64
        }
    );
    // A short matrix: blocks of at least a tile, about 16 per thread.
    let c = blocking(40, 128, 2, 1 << 20, 4);
    assert_eq!(
        c,
        Blocking {
            chunk: 128,
            block: 4
        }
    );
    // No whole step: one empty chunk.
    let c = blocking(10, 0, 1, 1 << 20, 4);
    assert_eq!(c.chunk, 1);
}

#[test]
fn cache_sizes_read_as_linux_writes_them() {
    assert_eq!(cache_bytes("512K\n"), Some(512 << 10));
    assert_eq!(cache_bytes("2M"), Some(2 << 20));
    assert_eq!(cache_bytes("2048"), None);
    assert_eq!(cache_bytes("1 MiB"), None);
    assert_eq!(cache_bytes(""), None);
}

#[test]
fn every_cut_on_the_avx512_routines_gives_the_documented_order_bit_for_bit() {
    // The real leaves under the same cuts (chunks that start mid-row, accumulators carried across chunks, several
    // passes), where the CPU runs them; the integration tests' shapes fit one chunk.
    #[cfg(target_arch = "x86_64")]
    if PromptKernel::detect() == PromptKernel::Avx512 {
        use super::avx512::Avx512;
        let (m, w) = bf16_matrix(13, 200, 3);
        check::<Avx512>("bf16 on AVX-512", &m, &w, &cuts(4, 6));
        for (k, kind) in [
            QuantKind::Int4Sym { group: 32 },
            QuantKind::Int4Sym { group: 128 },
            QuantKind::Int8Sym,
        ]
        .into_iter()
        .enumerate()
        {
            let (p, w) = packed_matrix(kind, 9, 256, 60 + k as u64);
            check::<Avx512>(&format!("{kind:?} on AVX-512"), &p, &w, &cuts(4, 6));
        }
        for (k, (ty, rows, cols, columns)) in gguf_cases().into_iter().enumerate() {
            let (m, w) = gguf_matrix(ty, rows, cols, columns, 90 + k as u64);
            check::<Avx512>(&format!("{ty} on AVX-512"), &m, &w, &cuts(4, 6));
        }
        return;
    }
    eprintln!("no AVX-512F here: the real routines are not run");
}
