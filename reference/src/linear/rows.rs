//! What mapped and packed matrices share: widening whole rows to f32 (a block, a lookup, a full copy), and the
//! prompt path's blocked product, which widens a block of rows at a time into one reused buffer and multiplies it
//! with the `gemm` crate straight into the output.

use crate::error::{Error, Result};
use candle_core::{Device, Tensor};
use rayon::prelude::*;

/// A matrix whose rows can be widened to f32 one at a time, exactly: stored bf16/f16/f32 values, or INT4/INT8
/// codes times their scales. The whole-row helpers below serve both kinds.
pub(super) trait WidenRows: Sync {
    /// `(rows, cols)`.
    fn shape(&self) -> (usize, usize);

    /// Row `r` into `dst` (`cols` values).
    fn widen_row(&self, r: usize, dst: &mut [f32]);
}

/// Widens rows `start..` of `m` into `out` (`out.len() / cols` of them), in parallel.
pub(super) fn widen_rows(m: &impl WidenRows, start: usize, out: &mut [f32]) {
    let cols = m.shape().1.max(1);
    let rows_per_task = (1 << 16) / cols + 1;
    out.par_chunks_mut(rows_per_task * cols)
        .enumerate()
        .for_each(|(task, chunk)| {
            for (k, dst) in chunk.chunks_mut(cols).enumerate() {
                m.widen_row(start + task * rows_per_task + k, dst);
            }
        });
}

/// Rows `start..start + count` of `m` widened to f32, row-major.
pub(super) fn rows_f32(m: &impl WidenRows, start: usize, count: usize) -> Vec<f32> {
    let mut out = vec![0f32; count * m.shape().1];
    widen_rows(m, start, &mut out);
    out
}

/// The whole of `m` widened, an f32 tensor `[rows, cols]` (a full copy: 4 bytes per weight).
pub(super) fn to_tensor(m: &impl WidenRows) -> Result<Tensor> {
    let (rows, cols) = m.shape();
    Ok(Tensor::from_vec(
        rows_f32(m, 0, rows),
        (rows, cols),
        &Device::Cpu,
    )?)
}

/// The rows `ids` of `m` (an embedding lookup) widened, an f32 tensor `[ids.len(), cols]`; an id outside the
/// matrix is an error.
pub(super) fn gather(m: &impl WidenRows, ids: &[u32]) -> Result<Tensor> {
    let (rows, cols) = m.shape();
    let mut out = vec![0f32; ids.len() * cols];
    for (dst, &id) in out.chunks_mut(cols.max(1)).zip(ids) {
        let r = id as usize;
        if r >= rows {
            return Err(Error::Input(format!(
                "row {r} is outside a matrix of {rows} rows"
            )));
        }
        m.widen_row(r, dst);
    }
    Ok(Tensor::from_vec(out, (ids.len(), cols), &Device::Cpu)?)
}

/// `x W^T` with `W` `[rows, cols]` widened to f32 `block` rows at a time by `fill(start, out)` (rows `start..` into
/// `out`, `out.len() / cols` of them) into one buffer reused across calls, each block multiplied by [`gemm_into`]
/// straight into its columns of the output.
pub(super) fn blocked_gemm(
    x: &Tensor,
    rows: usize,
    cols: usize,
    block: usize,
    fill: impl Fn(usize, &mut [f32]),
) -> Result<Tensor> {
    let (t, _) = x.dims2()?;
    let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let mut y = vec![0f32; t * rows];
    let block = block.max(1);
    WIDENED.with(|buf| {
        let mut buf = buf.borrow_mut();
        let mut start = 0;
        while start < rows {
            let count = block.min(rows - start);
            let len = count * cols;
            if buf.len() < len {
                buf.resize(len, 0.0);
            }
            let w = &mut buf[..len];
            fill(start, w);
            gemm_into(&xs, t, cols, w, count, &mut y[start..], rows);
            start += count;
        }
    });
    Ok(Tensor::from_vec(y, (t, rows), &Device::Cpu)?)
}

thread_local! {
    /// The f32 block of weight rows the GEMM path multiplies, kept between calls: a fresh buffer per block would
    /// fault in and zero its pages every time.
    static WIDENED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `y[:, ..count] = x wᵀ` for `x` `[t, k]` and `w` `[count, k]` (both row-major), written into the first `count`
/// columns of `y`, a row-major matrix with rows `y_stride` apart: the `gemm` crate's product, called as candle
/// calls it for `x.matmul(w.t())`, so the sums are candle's.
fn gemm_into(
    x: &[f32],
    t: usize,
    k: usize,
    w: &[f32],
    count: usize,
    y: &mut [f32],
    y_stride: usize,
) {
    assert!(x.len() >= t * k && w.len() >= count * k && count <= y_stride);
    assert!(t == 0 || y.len() >= (t - 1) * y_stride + count);
    let threads = candle_core::utils::get_num_threads();
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the asserts keep every element the strides address inside the three slices: `x` is `t × k` with
    // rows `k` apart, `wᵀ` is `k × count` read with row stride 1 and column stride `k` from `w`, and `y` holds
    // `t` rows of `count` values `y_stride` apart.
    unsafe {
        gemm::gemm(
            t,
            count,
            k,
            y.as_mut_ptr(),
            1,
            y_stride as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}
