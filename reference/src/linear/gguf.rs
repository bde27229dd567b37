//! [`GgufMatrix`]: a weight matrix of a GGUF file kept as its ggml blocks in the mapped file, rows decoded to f32
//! only while a product or a lookup reads them.
//!
//! A row of a GGUF matrix is a whole number of blocks ([`GgmlType::row_bytes`]), so row `r`, or any run of its
//! blocks, decodes on its own ([`crate::gguf::decode::dequantize`], bit for bit as ggml, with the CPU's fastest
//! [`Decoder`]). The converter's layout changes that move whole rows (the value heads' order) are a row order kept
//! beside the bytes, and the one that moves columns (`ssm_out`) a column order applied to each decoded row: the
//! decoded row is the checkpoint's row, exactly the values the expanded f32 image holds. The products then run the
//! f32 kernels on those values in their order:
//!
//! - few tokens ([`super::MATVEC_MAX_TOKENS`]): each task decodes a row [`SEGMENT`] values at a time into a buffer it
//!   reuses (so the decoded values stay in the L1 cache) and sums them with [`super::matvec`]'s SIMD kernel, its lane
//!   accumulators carried from segment to segment (`kernel::dot_segments`), so each output has the bits
//!   [`super::matvec`] gives on the f32 matrix; without that kernel, or with a column order, a whole row is decoded
//!   and summed by [`super::matvec`]'s kernel;
//! - more tokens on a CPU with AVX-512F: the prompt kernel ([`super::PromptKernel::Avx512`]) decodes the blocks of
//!   each panel's steps straight into its panel (through a small per-thread buffer), as it widens a stored f32
//!   matrix's rows, so the sums are those of [`super::matvec`]'s order on the f32 matrix;
//! - more tokens without AVX-512F: blocks of rows are decoded and multiplied by the blocked GEMM with the blocks
//!   [`super::MappedMatrix::forward`] uses on an f32 matrix, so the sums are the same.
//!
//! F32, F16 and BF16 matrices with no column order are not decoded at all: the kernels read them in place as they
//! read a [`super::MappedMatrix`] of that type, widening each value exactly as the decoder does (where the kernel for
//! that type sums as the f32 one does, which it does wherever the CPU has F16C).
//!
//! Memory: the file's bytes (mapped) and, during a call, a segment (or a row) per task (decode), a panel's run of
//! blocks per thread (prompt kernel) or one block of rows (GEMM).

use super::gemm_kernel::{Isa, Panels};
use super::kernel::{GROUP, LANES, dot_rows, dot_segments, simd_available, widen};
use super::{
    BLOCK_ELEMENTS, Elem, MATVEC_MAX_TOKENS, SharedMap, WidenRows, blocked_gemm, check_input,
    gather, rows_f32, to_tensor, widen_rows,
};
use crate::error::{Error, Result};
use crate::gguf::GgmlType;
use crate::gguf::decode::{Decoder, dequantize_on};
use candle_core::{Device, Tensor};
use rayon::prelude::*;
use std::borrow::Cow;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::Arc;

/// Values of a row decoded at a time by the matrix-vector product (8 KiB of f32: the segment stays in the L1 cache
/// with the inputs it meets): a multiple of 32 and of every ggml block (256 values at most).
const SEGMENT: usize = 2048;

/// A `[rows, cols]` weight matrix held as a GGUF tensor's ggml blocks in the mapped file (cheap to clone: shared).
#[derive(Clone)]
pub struct GgufMatrix(Arc<Blocks>);

/// What a [`GgufMatrix`] shares.
struct Blocks {
    map: SharedMap,
    offset: usize,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    /// Row `r` of the matrix is stored row `row_order[r]` (`None`: in order).
    row_order: Option<Vec<usize>>,
    /// Column `c` of the matrix is column `col_order[c]` of the decoded stored row (`None`: in order).
    col_order: Option<Vec<usize>>,
}

impl std::fmt::Debug for GgufMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufMatrix")
            .field("ty", &self.0.ty)
            .field("rows", &self.0.rows)
            .field("cols", &self.0.cols)
            .field("row_order", &self.0.row_order.is_some())
            .field("col_order", &self.0.col_order.is_some())
            .finish()
    }
}

/// Checks that `order` (when given) is a permutation of `0..n`; `what` names it in the error.
fn check_order(order: Option<&[usize]>, n: usize, what: &str) -> Result<()> {
    let Some(order) = order else { return Ok(()) };
    let mut seen = vec![false; n];
    if order.len() != n {
        return Err(Error::Input(format!(
            "a {what} order of {} entries for {n} {what}s",
            order.len()
        )));
    }
    for &i in order {
        if i >= n || std::mem::replace(&mut seen[i], true) {
            return Err(Error::Input(format!(
                "the {what} order is not a permutation of 0..{n} (entry {i})"
            )));
        }
    }
    Ok(())
}

impl GgufMatrix {
    /// The `[rows, cols]` matrix of `ty` blocks at `offset` in `map` (rows stored one after another), its rows and
    /// columns taken in the orders given. Fails when a row is not a whole number of blocks, when `ty` has no f32
    /// decoding (integer types), when the bytes overrun the map, or when an order is not a permutation.
    pub fn new(
        map: &SharedMap,
        offset: usize,
        ty: GgmlType,
        (rows, cols): (usize, usize),
        row_order: Option<Vec<usize>>,
        col_order: Option<Vec<usize>>,
    ) -> Result<Self> {
        if matches!(
            ty,
            GgmlType::I8 | GgmlType::I16 | GgmlType::I32 | GgmlType::I64
        ) {
            return Err(Error::Input(format!(
                "{ty}: an integer tensor type has no f32 decoding, not a weight's"
            )));
        }
        let row_bytes = usize::try_from(ty.row_bytes(cols as u64).map_err(Error::Input)?)
            .map_err(|_| Error::Input(format!("a row of {cols} {ty} values is too large")))?;
        let end = rows
            .checked_mul(row_bytes)
            .and_then(|n| n.checked_add(offset));
        if end.is_none_or(|end| end > map.bytes().len()) {
            return Err(Error::Input(format!(
                "matrix [{rows}, {cols}] of {ty} at byte {offset} overruns its buffer of {} bytes",
                map.bytes().len()
            )));
        }
        check_order(row_order.as_deref(), rows, "row")?;
        check_order(col_order.as_deref(), cols, "column")?;
        Ok(GgufMatrix(Arc::new(Blocks {
            map: map.clone(),
            offset,
            ty,
            rows,
            cols,
            row_bytes,
            row_order,
            col_order,
        })))
    }

    /// Output features (rows).
    pub fn rows(&self) -> usize {
        self.0.rows
    }

    /// Input features (columns).
    pub fn cols(&self) -> usize {
        self.0.cols
    }

    /// The ggml type its blocks are stored as.
    pub fn ggml_type(&self) -> GgmlType {
        self.0.ty
    }

    /// Its bytes in the file.
    pub fn byte_len(&self) -> usize {
        self.0.rows * self.0.row_bytes
    }

    fn range(&self) -> Range<usize> {
        self.0.offset..self.0.offset + self.byte_len()
    }

    /// Hands back this process's pages of the matrix's bytes ([`SharedMap::release`]).
    pub fn release_pages(&self) {
        self.0.map.release(self.range());
    }

    /// The element type the kernels read a row in place as, when the blocks are plain floats (F32, F16, BF16: their
    /// exact widening is the decoder's) and no column order moves them.
    fn stored_elem(&self) -> Option<Elem> {
        match (self.0.ty, &self.0.col_order) {
            (GgmlType::F32, None) => Some(Elem::F32),
            (GgmlType::F16, None) => Some(Elem::F16),
            (GgmlType::BF16, None) => Some(Elem::Bf16),
            _ => None,
        }
    }

    /// Column `c` of the matrix is column `col_order()[c]` of the stored row (`None`: in order).
    pub fn col_order(&self) -> Option<&[usize]> {
        self.0.col_order.as_deref()
    }

    /// Whether the matrix's columns are not in the stored rows' order (a column order undoes the converter's).
    pub fn reorders_columns(&self) -> bool {
        self.0.col_order.is_some()
    }

    /// The stored bytes of row `r`, its ggml blocks (the row order applied; a column order is not).
    pub fn stored_row(&self, r: usize) -> &[u8] {
        let s = self.0.row_order.as_ref().map_or(r, |o| o[r]);
        let start = self.0.offset + s * self.0.row_bytes;
        &self.0.map.bytes()[start..start + self.0.row_bytes]
    }

    /// Row `r` decoded into `dst` (`cols` values) by `decoder`; `scratch` holds the stored row when columns are
    /// reordered.
    fn decode_row(&self, r: usize, dst: &mut [f32], scratch: &mut Vec<f32>, decoder: Decoder) {
        match &self.0.col_order {
            None => self.decode_stored(r, 0..self.0.cols, dst, decoder),
            Some(order) => {
                scratch.resize(self.0.cols, 0.0);
                self.decode_stored(r, 0..self.0.cols, scratch, decoder);
                for (d, &c) in dst.iter_mut().zip(order.iter()) {
                    *d = scratch[c];
                }
            }
        }
    }

    /// Values `values` of stored row `r` (before any column order; whole blocks) decoded into `dst`.
    fn decode_stored(&self, r: usize, values: Range<usize>, dst: &mut [f32], decoder: Decoder) {
        let (elems, bytes) = (self.0.ty.block_elems(), self.0.ty.block_bytes());
        let blocks = values.start / elems..values.end / elems;
        let row = self.stored_row(r);
        // The type, the row's length in whole blocks, the decoder and `dst`'s length were checked when the matrix
        // was made and by the callers.
        dequantize_on(
            self.0.ty,
            &row[blocks.start * bytes..blocks.end * bytes],
            dst,
            decoder,
        )
        .expect("blocks of a row checked when the matrix was made");
    }

    /// Values `values` of row `r` (after the column order), decoded into this thread's buffer and handed to `f`:
    /// the whole blocks that hold them are decoded (the whole stored row when columns are reordered).
    fn with_values<R>(&self, r: usize, values: Range<usize>, f: impl FnOnce(&[f32]) -> R) -> R {
        DECODED.with(|cell| {
            let mut buffers = cell.borrow_mut();
            let (buf, scratch) = &mut *buffers;
            let decoder = Decoder::detect();
            match &self.0.col_order {
                None => {
                    let elems = self.0.ty.block_elems();
                    let first = values.start / elems * elems;
                    let end = values.end.div_ceil(elems) * elems;
                    buf.resize(end - first, 0.0);
                    self.decode_stored(r, first..end, buf, decoder);
                    f(&buf[values.start - first..values.end - first])
                }
                Some(order) => {
                    scratch.resize(self.0.cols, 0.0);
                    self.decode_stored(r, 0..self.0.cols, scratch, decoder);
                    buf.clear();
                    buf.extend(order[values].iter().map(|&c| scratch[c]));
                    f(buf)
                }
            }
        })
    }

    /// Rows `start..start + count` decoded to f32, row-major.
    pub fn rows_f32(&self, start: usize, count: usize) -> Vec<f32> {
        rows_f32(self, start, count)
    }

    /// The whole matrix decoded, an f32 tensor `[rows, cols]` (a full copy: 4 bytes per weight).
    pub fn to_tensor(&self) -> Result<Tensor> {
        to_tensor(self)
    }

    /// The rows `ids` (an embedding lookup), decoded, as an f32 tensor `[ids.len(), cols]`.
    pub fn gather(&self, ids: &[u32]) -> Result<Tensor> {
        gather(self, ids)
    }

    /// `x Wᵀ` for `x` `[T, cols]` f32 → `[T, rows]`: the bits of [`super::MappedMatrix::forward`] on the decoded
    /// matrix stored as f32 (see the module docs).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let t = check_input(x, self.0.rows, self.0.cols, "a GGUF")?;
        let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
        if t <= MATVEC_MAX_TOKENS {
            let y = self.matvec(&xs, t);
            return Ok(Tensor::from_vec(y, (t, self.0.rows), &Device::Cpu)?);
        }
        if let Some(y) = super::gemm_kernel::product(self, &xs, t) {
            return Ok(Tensor::from_vec(y, (t, self.0.rows), &Device::Cpu)?);
        }
        let block = (BLOCK_ELEMENTS / self.0.cols.max(1)).max(1);
        blocked_gemm(x, self.0.rows, self.0.cols, block, |s, out| {
            widen_rows(self, s, out)
        })
    }

    /// `y = x Wᵀ` for `t` tokens, each row decoded then summed by [`super::matvec`]'s kernel on f32 (its bits).
    pub fn matvec(&self, x: &[f32], t: usize) -> Vec<f32> {
        assert_eq!(x.len(), t * self.0.cols, "matvec: x must be [t, cols]");
        let (rows, cols) = (self.0.rows, self.0.cols);
        if rows == 0 || t == 0 {
            return vec![0f32; rows * t];
        }
        let simd = simd_available(Elem::F32);
        let decoder = Decoder::detect();
        // Plain floats are read in place where the kernel widening them sums as the f32 one does.
        let stored = self.stored_elem().filter(|&e| simd_available(e) == simd);
        // As `matvec` splits rows (which thread computes a row, never how): ~16 tasks a thread, 256 KiB of f32 each.
        let threads = rayon::current_num_threads().max(1);
        let rows_per_task = rows
            .div_ceil(16 * threads)
            .max((256 << 10) / (4 * cols).max(1))
            .max(1);
        let mut yt = vec![0f32; rows * t];
        yt.par_chunks_mut(rows_per_task * t)
            .enumerate()
            .for_each(|(task, out)| {
                let mut row = Vec::new();
                let mut segment = vec![0f32; SEGMENT.min(cols.next_multiple_of(LANES))];
                let mut scratch = Vec::new();
                for (k, y) in out.chunks_mut(t).enumerate() {
                    let r = task * rows_per_task + k;
                    if let Some(elem) = stored {
                        dot_tokens(self.stored_row(r), elem, x, cols, y, simd);
                        continue;
                    }
                    if self.0.col_order.is_none() {
                        let mut fill = |values: Range<usize>, dst: &mut [f32]| {
                            self.decode_stored(r, values, dst, decoder)
                        };
                        if dot_segments(cols, x, y, &mut segment, &mut fill).is_some() {
                            continue;
                        }
                    }
                    row.resize(cols, 0.0);
                    self.decode_row(r, &mut row, &mut scratch, decoder);
                    dot_tokens(&f32_bytes(&row), Elem::F32, x, cols, y, simd);
                }
            });
        super::kernel::token_major(yt, rows, t)
    }
}

impl WidenRows for GgufMatrix {
    fn shape(&self) -> (usize, usize) {
        (self.0.rows, self.0.cols)
    }

    fn widen_row(&self, r: usize, dst: &mut [f32]) {
        let mut scratch = Vec::new();
        self.decode_row(r, dst, &mut scratch, Decoder::detect());
    }
}

/// `ys[j] = Σ_i xs[j, i] · row[i]` for every token of `xs` (`ys.len()` of them), [`GROUP`] at a time: [`super::matvec`]'s
/// sums of one row.
fn dot_tokens(row: &[u8], elem: Elem, xs: &[f32], n: usize, ys: &mut [f32], simd: bool) {
    for (g, y) in ys.chunks_mut(GROUP).enumerate() {
        dot_rows(
            row,
            elem,
            &xs[g * GROUP * n..(g * GROUP + y.len()) * n],
            n,
            y,
            simd,
        );
    }
}

/// f32 values as their little-endian bytes (what [`Elem::F32`] reads): a view on a little-endian CPU.
pub(super) fn f32_bytes(values: &[f32]) -> Cow<'_, [u8]> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: any initialised f32 is 4 initialised bytes; u8 has no alignment requirement; the length covers
        // exactly the slice's bytes, borrowed for the slice's lifetime.
        Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
        })
    }
    #[cfg(not(target_endian = "little"))]
    {
        Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

thread_local! {
    /// A thread's decoded values for the prompt kernel's panels, and a whole stored row when columns are reordered:
    /// kept between calls (no allocation per row).
    static DECODED: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The prompt kernel reads a GGUF matrix as it reads a stored f32 one: the steps asked for decoded (their blocks),
/// then laid out by the instruction set's widening of f32 values.
impl Panels for GgufMatrix {
    fn shape(&self) -> (usize, usize) {
        (self.0.rows, self.0.cols)
    }

    unsafe fn widen<I: Isa>(
        &self,
        r: usize,
        steps: Range<usize>,
        dst: &mut [f32],
        stride: usize,
        second: usize,
    ) {
        if let Some(elem) = self.stored_elem() {
            // SAFETY: the caller's guarantee (the prompt kernel's instruction sets widen every element type).
            unsafe { I::widen_stored(self.stored_row(r), elem, steps, dst, stride, second) };
            return;
        }
        let len = steps.len();
        self.with_values(r, steps.start * LANES..steps.end * LANES, |values| {
            // SAFETY: the caller's guarantee; `values` holds the `len` steps, read from step 0.
            unsafe { I::widen_stored(&f32_bytes(values), Elem::F32, 0..len, dst, stride, second) }
        });
    }

    fn tail(&self, r: usize, tail: &mut [f32]) {
        let main = self.0.cols / LANES * LANES;
        if let Some(elem) = self.stored_elem() {
            widen(&self.stored_row(r)[main * elem.size()..], elem, tail);
        } else if main < self.0.cols {
            self.with_values(r, main..self.0.cols, |values| tail.copy_from_slice(values));
        }
    }
}
