//! What depends only on the images' grids: the order of the patches, the learned position table resampled to each
//! grid (bilinear, `align_corners = True`: four corner indices and weights per patch), the axial rotary embedding's
//! row and column of each patch, and the spans attention stays within (one per image, one per video frame).
//!
//! Patches come in spatial-merge-block order, as the image processor emits them: for each frame, the blocks of
//! `m × m` patches row by row, and within a block its patches row by row (`m` = `spatial_merge_size`).

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// The patch grid of one image or video (transformers' `grid_thw` row): frames (in temporal patches), rows and
/// columns (in patches).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    /// Temporal patches (1 for an image).
    pub t: usize,
    /// Rows of patches.
    pub h: usize,
    /// Columns of patches.
    pub w: usize,
}

impl Grid {
    /// The patches of the grid (`t · h · w`).
    pub fn patches(&self) -> usize {
        self.t * self.h * self.w
    }

    /// The merged tokens the merger makes of it (`t · h · w / m²`).
    pub fn tokens(&self, merge: usize) -> usize {
        self.patches() / (merge * merge)
    }

    /// Checks that the grid is not empty and that its rows and columns are whole merge blocks.
    pub fn check(&self, merge: usize) -> Result<()> {
        if self.patches() == 0 {
            return Err(Error::Input(format!("an empty image grid {self:?}")));
        }
        if !self.h.is_multiple_of(merge) || !self.w.is_multiple_of(merge) {
            return Err(Error::Input(format!(
                "image grid {} x {} patches is not a whole number of {merge} x {merge} merge blocks",
                self.h, self.w
            )));
        }
        Ok(())
    }
}

/// The (row, column) of every patch of `grids`, in the processor's order (frames repeat their frame's coordinates).
pub fn patch_coords(grids: &[Grid], merge: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for g in grids {
        for _ in 0..g.t {
            for br in 0..g.h / merge {
                for bc in 0..g.w / merge {
                    for ir in 0..merge {
                        for ic in 0..merge {
                            out.push((br * merge + ir, bc * merge + ic));
                        }
                    }
                }
            }
        }
    }
    out
}

/// One axis of the bilinear resampling, in f32 as transformers computes it (`vision_utils`): the two taps into a
/// table of `side` entries and their weights for target `index` of `size`.
fn axis_taps(index: usize, size: usize, side: usize) -> ([usize; 2], [f32; 2]) {
    let src = (index as f32 * (side - 1) as f32) / (size.saturating_sub(1).max(1)) as f32;
    let floor = src.floor();
    let mut taps = [0usize; 2];
    let mut weights = [0f32; 2];
    for o in 0..2 {
        let raw = floor as i64 + o as i64;
        taps[o] = raw.clamp(0, side as i64 - 1) as usize;
        let distance = (src - floor - o as f32).abs();
        weights[o] = (1.0 - distance).max(0.0);
    }
    (taps, weights)
}

/// For every patch of `grids`, the four rows of the `side × side` table it blends and their weights (f32, as
/// transformers computes them in an f64 run too), ordered (top-left, top-right, bottom-left, bottom-right).
pub fn interpolation(grids: &[Grid], side: usize, merge: usize) -> (Vec<[u32; 4]>, Vec<[f32; 4]>) {
    let mut indices = Vec::new();
    let mut weights = Vec::new();
    let mut grid_of = Vec::new();
    for g in grids {
        grid_of.extend(std::iter::repeat_n(*g, g.patches()));
    }
    for ((row, col), g) in patch_coords(grids, merge).into_iter().zip(grid_of) {
        let (ht, hw) = axis_taps(row, g.h, side);
        let (wt, ww) = axis_taps(col, g.w, side);
        let mut idx = [0u32; 4];
        let mut wts = [0f32; 4];
        for a in 0..2 {
            for b in 0..2 {
                idx[a * 2 + b] = (ht[a] * side + wt[b]) as u32;
                wts[a * 2 + b] = hw[a] * ww[b];
            }
        }
        indices.push(idx);
        weights.push(wts);
    }
    (indices, weights)
}

/// The learned table `[side², Hv]` resampled to every patch of `grids`: `[N, Hv]` in the table's dtype.
pub fn resample_table(table: &Tensor, grids: &[Grid], side: usize, merge: usize) -> Result<Tensor> {
    let (indices, weights) = interpolation(grids, side, merge);
    let n = indices.len();
    let flat: Vec<u32> = indices.iter().flatten().copied().collect();
    let idx = Tensor::from_vec(flat, n * 4, table.device())?;
    let rows = table
        .index_select(&idx, 0)?
        .reshape((n, 4, table.dim(1)?))?;
    let w: Vec<f32> = weights.iter().flatten().copied().collect();
    let w = Tensor::from_vec(w, (n, 4, 1), table.device())?.to_dtype(table.dtype())?;
    Ok(rows.broadcast_mul(&w)?.sum(1)?)
}

/// The axial rotary embedding's `cos` and `sin` `[N, head_dim]` for every patch of `grids`: frequency `k` of
/// `head_dim / 4` is `θ^(-4k / head_dim)` (rounded to f32, as transformers' buffer), the row's angles then the
/// column's, that pair repeated (rotate-half pairs `j` and `j + head_dim / 2`). The angle is a product in f32 for
/// an f32 run and in f64 for an f64 one.
pub fn rotary(
    grids: &[Grid],
    merge: usize,
    head_dim: usize,
    theta: f64,
    dtype: DType,
) -> Result<(Tensor, Tensor)> {
    let spatial = head_dim / 2;
    let inv_freq: Vec<f32> = (0..spatial / 2)
        .map(|k| {
            let exponent = (2 * k) as f32 / spatial as f32;
            1.0f32 / (theta.powf(exponent as f64) as f32)
        })
        .collect();
    let coords = patch_coords(grids, merge);
    let n = coords.len();
    let mut cos = Vec::with_capacity(n * head_dim);
    let mut sin = Vec::with_capacity(n * head_dim);
    for (row, col) in coords {
        let mut angles = Vec::with_capacity(spatial);
        for pos in [row, col] {
            for &f in &inv_freq {
                angles.push(match dtype {
                    DType::F64 => pos as f64 * f as f64,
                    _ => (pos as f32 * f) as f64,
                });
            }
        }
        for _ in 0..2 {
            for &a in &angles {
                match dtype {
                    DType::F64 => {
                        cos.push(a.cos());
                        sin.push(a.sin());
                    }
                    _ => {
                        cos.push((a as f32).cos() as f64);
                        sin.push((a as f32).sin() as f64);
                    }
                }
            }
        }
    }
    let dev = Device::Cpu;
    let cos = Tensor::from_vec(cos, (n, head_dim), &dev)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (n, head_dim), &dev)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

/// The spans `(start, length)` of patches that attend to each other: each image, and each frame of a video.
pub fn attention_spans(grids: &[Grid]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    for g in grids {
        for _ in 0..g.t {
            out.push((start, g.h * g.w));
            start += g.h * g.w;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coords_are_in_merge_block_order() {
        let c = patch_coords(&[Grid { t: 1, h: 2, w: 4 }], 2);
        assert_eq!(
            c,
            vec![
                (0, 0),
                (0, 1),
                (1, 0),
                (1, 1),
                (0, 2),
                (0, 3),
                (1, 2),
                (1, 3)
            ]
        );
    }

    #[test]
    fn a_grid_the_size_of_the_table_reads_it_unblended() {
        let (idx, w) = interpolation(&[Grid { t: 1, h: 4, w: 4 }], 4, 1);
        for (p, (i, w)) in idx.iter().zip(&w).enumerate() {
            let (r, c) = (p / 4, p % 4);
            assert_eq!(i[0] as usize, r * 4 + c);
            assert_eq!(w[0], 1.0, "patch {p}");
            assert_eq!(w[1] + w[2] + w[3], 0.0, "patch {p}");
        }
    }

    #[test]
    fn corners_map_to_corners_and_weights_sum_to_one() {
        let (idx, w) = interpolation(&[Grid { t: 1, h: 6, w: 10 }], 4, 2);
        for w in &w {
            assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        }
        // The last patch (row 5, column 9) is the table's last entry.
        let last = idx.len() - 1;
        assert_eq!(idx[last][0], 15);
        assert_eq!(w[last][0], 1.0);
    }

    #[test]
    fn frames_attend_apart() {
        assert_eq!(
            attention_spans(&[Grid { t: 1, h: 2, w: 2 }, Grid { t: 2, h: 2, w: 4 }]),
            vec![(0, 4), (4, 8), (12, 8)]
        );
    }
}
