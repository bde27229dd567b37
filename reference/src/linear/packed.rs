//! [`PackedMatrix`]: a quantised matrix held as its compact codes and f16 scales, read by [`matvec_packed`] without
//! ever being widened as a whole.

use super::kernel::LANES;
use super::quant_kernel::{PackedRow, matvec_packed};
use super::{
    MATVEC_MAX_TOKENS, WidenRows, blocked_gemm, check_input, gather, rows_f32, to_tensor,
    widen_rows,
};
use crate::error::{Error, Result};
use crate::quant::{QuantKind, QuantizedMatrix};
use candle_core::{Device, Tensor};
use half::f16;
use rayon::prelude::*;
use std::ops::Range;
use std::sync::Arc;

/// The most weights dequantised at once on the GEMM path: 16 MiB of f32, small enough that the allocator reuses the
/// buffer from one block to the next instead of mapping (and faulting in) fresh pages each time.
const PACKED_BLOCK_ELEMENTS: usize = 4 << 20;

/// A quantised `[rows, cols]` matrix (INT4 or INT8 symmetric, see [`crate::quant`]) as compact codes and f16
/// scales; its weights are `f32(code) · f32(scale)`, exactly the values of [`QuantizedMatrix::dequantize`].
///
/// Layout: each row's codes start on a byte boundary. INT4 rows take `⌈cols / 2⌉` bytes, two two's complement codes
/// per byte, laid out for the kernel (repacked from [`QuantizedMatrix`]'s codes as they are packed): the first
/// `32⌊cols/32⌋` codes in blocks of 32, each in 16 bytes, code `k` of the block in the low nibble of its byte `k`
/// and code `16 + k` in the high nibble of byte `k` (so a block's low nibbles are the kernel's accumulator lanes
/// 0..16 and its high nibbles lanes 16..32); the last `cols mod 32` codes two a byte in order, as
/// [`crate::quant::pack_i4`] packs them (an odd width leaves the last high nibble zero). INT8 rows take `cols` bytes,
/// one two's complement code each. Scales are `[rows, cols / group]` row-major (`group = cols` for INT8).
#[derive(Clone)]
pub struct PackedMatrix {
    kind: QuantKind,
    rows: usize,
    cols: usize,
    pub(super) codes: Arc<Vec<u8>>,
    pub(super) scales: Arc<Vec<f16>>,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix")
            .field("kind", &self.kind)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

/// Bytes of one packed row.
fn row_bytes_of(kind: QuantKind, cols: usize) -> usize {
    match kind {
        QuantKind::Int4Sym { .. } => cols.div_ceil(2),
        QuantKind::Int8Sym => cols,
    }
}

/// Inputs sharing one scale, checked against the width.
fn group_of(kind: QuantKind, cols: usize) -> Result<usize> {
    match kind {
        QuantKind::Int4Sym { group } if group > 0 && cols.is_multiple_of(group) => Ok(group),
        QuantKind::Int4Sym { group } => Err(Error::Input(format!(
            "int4 group size {group} does not divide the input width {cols}"
        ))),
        QuantKind::Int8Sym if cols > 0 => Ok(cols),
        QuantKind::Int8Sym => Err(Error::Input(
            "an int8 matrix needs at least one input".into(),
        )),
    }
}

/// Packs the codes of `q` (row after row) into `dst` and copies its scales into `scales`.
fn pack_into(q: &QuantizedMatrix, dst: &mut [u8], scales: &mut [f16]) {
    let cols = q.cols();
    let row_bytes = row_bytes_of(q.kind(), cols);
    scales.copy_from_slice(q.scales());
    if cols == 0 {
        return;
    }
    for (codes, out) in q
        .codes()
        .chunks_exact(cols)
        .zip(dst.chunks_exact_mut(row_bytes))
    {
        match q.kind() {
            QuantKind::Int4Sym { .. } => {
                let nibble = |c: i8| c as u8 & 0x0F;
                let main = cols / LANES * LANES;
                for (block, bytes) in codes[..main]
                    .chunks_exact(LANES)
                    .zip(out.chunks_exact_mut(LANES / 2))
                {
                    let (low, high) = block.split_at(LANES / 2);
                    for ((byte, &l), &h) in bytes.iter_mut().zip(low).zip(high) {
                        *byte = nibble(l) | (nibble(h) << 4);
                    }
                }
                for (pair, byte) in codes[main..].chunks(2).zip(&mut out[main / 2..]) {
                    *byte = nibble(pair[0]) | (pair.get(1).map_or(0, |&c| nibble(c)) << 4);
                }
            }
            QuantKind::Int8Sym => {
                for (c, byte) in codes.iter().zip(out.iter_mut()) {
                    *byte = *c as u8;
                }
            }
        }
    }
}

impl PackedMatrix {
    /// The packed form of a quantised matrix (the same codes and scales).
    pub fn from_quantized(q: &QuantizedMatrix) -> Result<Self> {
        let (rows, cols) = (q.rows(), q.cols());
        group_of(q.kind(), cols)?;
        let mut codes = vec![0u8; rows * row_bytes_of(q.kind(), cols)];
        let mut scales = vec![f16::ZERO; q.scales().len()];
        pack_into(q, &mut codes, &mut scales);
        Ok(PackedMatrix {
            kind: q.kind(),
            rows,
            cols,
            codes: Arc::new(codes),
            scales: Arc::new(scales),
        })
    }

    /// A `[rows, cols]` matrix of `kind` quantised a block of rows at a time, the blocks in parallel: `quantize(r)`
    /// returns the codes and scales of rows `r` (of at most `block_rows` rows). Only the blocks being quantised exist
    /// in another form at any time. Fails with the first error `quantize` returns, or when a block does not have the
    /// asked kind and shape.
    pub fn from_row_blocks(
        kind: QuantKind,
        rows: usize,
        cols: usize,
        block_rows: usize,
        quantize: impl Fn(Range<usize>) -> Result<QuantizedMatrix> + Sync,
    ) -> Result<Self> {
        let group = group_of(kind, cols)?;
        let row_bytes = row_bytes_of(kind, cols);
        let per_row = cols / group;
        let block_rows = block_rows.max(1);
        let mut codes = vec![0u8; rows * row_bytes];
        let mut scales = vec![f16::ZERO; rows * per_row];
        codes
            .par_chunks_mut((block_rows * row_bytes).max(1))
            .zip(scales.par_chunks_mut((block_rows * per_row).max(1)))
            .enumerate()
            .try_for_each(|(b, (dst, sc))| {
                let start = b * block_rows;
                let end = (start + block_rows).min(rows);
                let q = quantize(start..end)?;
                if q.kind() != kind || q.shape() != [end - start, cols] {
                    return Err(Error::Input(format!(
                        "rows {start}..{end}: quantised as {:?} {:?}, expected {kind:?} [{}, {cols}]",
                        q.kind(),
                        q.shape(),
                        end - start
                    )));
                }
                pack_into(&q, dst, sc);
                Ok(())
            })?;
        Ok(PackedMatrix {
            kind,
            rows,
            cols,
            codes: Arc::new(codes),
            scales: Arc::new(scales),
        })
    }

    /// INT4 (with its group) or INT8.
    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    /// Output features (rows).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (columns).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The bytes held: codes and scales.
    pub fn held_bytes(&self) -> usize {
        self.codes.len() + 2 * self.scales.len()
    }

    /// Bytes of codes per row.
    pub(super) fn row_bytes(&self) -> usize {
        row_bytes_of(self.kind, self.cols)
    }

    fn group(&self) -> usize {
        match self.kind {
            QuantKind::Int4Sym { group } => group,
            QuantKind::Int8Sym => self.cols,
        }
    }

    /// Row `r`'s codes and scales.
    pub(super) fn row(&self, r: usize) -> PackedRow<'_> {
        let n = self.row_bytes();
        let group = self.group().max(1);
        let per_row = self.cols / group;
        PackedRow {
            codes: &self.codes[r * n..(r + 1) * n],
            scales: &self.scales[r * per_row..(r + 1) * per_row],
            cols: self.cols,
            int4: matches!(self.kind, QuantKind::Int4Sym { .. }),
            group,
        }
    }

    /// The codes and scales again, as a [`QuantizedMatrix`].
    pub fn to_quantized(&self) -> Result<QuantizedMatrix> {
        let mut codes = Vec::with_capacity(self.rows * self.cols);
        for r in 0..self.rows {
            let row = self.row(r);
            codes.extend((0..self.cols).map(|i| row.code(i)));
        }
        QuantizedMatrix::from_parts(self.kind, self.rows, self.cols, codes, self.scales.to_vec())
    }

    /// Rows `start..start + count` dequantised to f32 (exact), row-major, in parallel.
    pub fn rows_f32(&self, start: usize, count: usize) -> Vec<f32> {
        rows_f32(self, start, count)
    }

    /// `y = x Wᵀ` (`x` `[t, cols]` row-major, the result `[t, rows]`) by [`super::PromptKernel::Avx512`], the prompt's
    /// product of mapped weights, for any `t`: the bits of [`matvec_packed`]. `None` when the CPU lacks AVX-512F.
    pub fn prompt_product(&self, x: &[f32], t: usize) -> Option<Vec<f32>> {
        super::gemm_kernel::product(self, x, t)
    }

    /// The whole matrix dequantised, an f32 tensor `[rows, cols]` (a full copy: 4 bytes per weight).
    pub fn to_tensor(&self) -> Result<Tensor> {
        to_tensor(self)
    }

    /// The rows `ids` (an embedding lookup) dequantised, an f32 tensor `[ids.len(), cols]`.
    pub fn gather(&self, ids: &[u32]) -> Result<Tensor> {
        gather(self, ids)
    }

    /// `x W^T` for `x` `[T, cols]` f32 → `[T, rows]`: [`matvec_packed`] for few tokens, otherwise the packed
    /// product of [`super::PromptKernel::Avx512`] (the same order, the same bits) where the CPU has it, else blocks
    /// of rows dequantised to f32 (`PACKED_BLOCK_ELEMENTS` values at most) and multiplied with the GEMM.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let t = check_input(x, self.rows, self.cols, "a quantised")?;
        let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
        if t <= MATVEC_MAX_TOKENS {
            let y = matvec_packed(self, &xs, t);
            return Ok(Tensor::from_vec(y, (t, self.rows), &Device::Cpu)?);
        }
        if let Some(y) = super::gemm_kernel::product(self, &xs, t) {
            return Ok(Tensor::from_vec(y, (t, self.rows), &Device::Cpu)?);
        }
        let block = (PACKED_BLOCK_ELEMENTS / self.cols.max(1)).max(1);
        blocked_gemm(x, self.rows, self.cols, block, |s, out| {
            widen_rows(self, s, out)
        })
    }

    /// [`PackedMatrix::forward`]'s GEMM path with blocks of `block` rows (tests: several blocks on a small matrix).
    #[cfg(test)]
    pub(super) fn forward_gemm(&self, x: &Tensor, block: usize) -> Result<Tensor> {
        check_input(x, self.rows, self.cols, "a quantised")?;
        blocked_gemm(x, self.rows, self.cols, block, |s, out| {
            widen_rows(self, s, out)
        })
    }
}

impl WidenRows for PackedMatrix {
    fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    fn widen_row(&self, r: usize, dst: &mut [f32]) {
        self.row(r).widen(0, dst);
    }
}
