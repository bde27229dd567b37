//! The prompt's product (`T >` [`super::MATVEC_MAX_TOKENS`]) on a CPU with AVX-512F: `y = x Wᵀ` for a mapped
//! ([`super::MappedMatrix`]: bf16, f16, f32) or packed ([`super::PackedMatrix`]: INT4/INT8 codes times f16 scales)
//! weight, in the summation order [`super::matvec`] documents, so that it equals [`super::matvec`] (and
//! [`super::matvec_packed`]) bit for bit for every token count.
//!
//! Of an output's 32 lane accumulators (lane `i mod 32`, in increasing `i`), no two lanes meet before the final
//! combination, so the kernel runs them as `32 / W` parts of `W` lanes, one register each ([`Isa::WIDTH`]: 16 on
//! AVX-512): part `p` of step `s` is the `W` inputs `32s + pW..32s + pW + W`. That leaves room for a
//! register tile of [`Isa::ROWS`] rows × [`Isa::TOKENS`] tokens: per part step it loads each row's `W` weights and
//! each token's `W` inputs once, `ROWS + TOKENS` loads for `ROWS · TOKENS` fused multiply-adds.
//!
//! The weights are widened (exactly) straight into f32 panels, a block of rows at a time, in one vectorised pass: per
//! group of `ROWS` rows and per part, step by step, the rows' `W` weights side by side (`[part][step][row][W]`), so
//! the inner loop reads them in order with no conversion. The inputs are laid out once per call the same way, per
//! block of `TOKENS` tokens (`[part][step][token][W]`, padded with zero tokens). Every buffer is 64-byte aligned, so
//! no load straddles two cache lines. Steps are taken [`Isa::STEPS`] at a time: the token block's inputs for those
//! steps stay in the L1 cache while every row group of the block passes over them, the block's panel in L2; between
//! them the accumulators wait in a buffer, which changes no bit.
//!
//! A panel holds at most half the L2 cache ([`driver::panel_bytes`]). Where a block of rows would then be too short
//! to pay for reading every input again (fewer than [`MIN_BLOCK_ROWS`] rows of the whole width), the steps are taken
//! a chunk at a time: the panel holds the block's rows for one chunk of steps, every token passes over it, and the
//! accumulators of every token wait in the buffer for the next chunk (still in order: no bit changes). At the end
//! each output's parts are combined as `matvec` combines its lanes and the `n mod 32` tail added one product at a
//! time.
//!
//! Blocks of rows are split across the rayon threads as [`super::matvec`] splits rows; the split decides only which
//! thread computes an output, never how. Without AVX-512F ([`PromptKernel::detect`]) the caller keeps the blocked
//! GEMM of `rows::blocked_gemm`: on AVX2 the same driver with a 3-row × 4-token tile of 8-lane quarters ran at
//! 0.83-0.87 of candle's GEMM on the f32 matrix where the blocked GEMM ran at 0.92-0.94 (`docs/speed.md`).
//!
//! The driver ([`driver::product_on`]) is written once against [`Isa`], the routines that touch registers; its unit
//! tests run it on emulated registers of several widths and tiles, so every way a call is cut is checked on any CPU.

// Off x86-64 only the tests run the driver.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

#[cfg(target_arch = "x86_64")]
mod avx512;
mod driver;
#[cfg(test)]
mod tests;

use super::kernel::LANES;
use super::quant_kernel::PackedRow;
use super::{Elem, MappedMatrix, PackedMatrix};
use std::ops::Range;

/// Rows a block should hold across the whole width before the steps are split into chunks (see the module docs).
const MIN_BLOCK_ROWS: usize = 32;

/// Tokens laid out and multiplied per pass over the weights: bounds the accumulators' buffer (a chunked block keeps
/// `32` accumulators per row and token) at the cost of widening the weights once more per pass.
const TOKENS_PER_PASS: usize = 512;

/// Which product a prompt call (`T >` [`super::MATVEC_MAX_TOKENS`]) of a mapped or packed weight runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKernel {
    /// This module's packed product on AVX-512F: the summation order of [`super::matvec`], the same bits.
    Avx512,
    /// Blocks of rows widened to f32 and multiplied by the `gemm` crate (candle's order).
    Gemm,
}

impl PromptKernel {
    /// The kernel this CPU runs (checked at run time).
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx2") && has!("fma") && has!("f16c") {
                return PromptKernel::Avx512;
            }
        }
        PromptKernel::Gemm
    }
}

/// `y = x Wᵀ` for `t` tokens (`x` `[t, cols]` row-major, the result `[t, rows]`) on [`PromptKernel::Avx512`], in
/// [`super::matvec`]'s summation order; `None` when the CPU lacks it (the caller then runs the blocked GEMM).
pub(super) fn product(w: &impl Panels, x: &[f32], t: usize) -> Option<Vec<f32>> {
    match PromptKernel::detect() {
        // SAFETY: `detect` found the instruction sets it runs on.
        #[cfg(target_arch = "x86_64")]
        PromptKernel::Avx512 => Some(unsafe { driver::product_on::<avx512::Avx512>(w, x, t) }),
        _ => {
            let _ = (w, x, t);
            None
        }
    }
}

/// A vector instruction set the product runs on: the register tile's shape and the routines that touch registers.
/// The driver ([`driver::product_on`]) is written once against it.
pub(super) trait Isa {
    /// Lanes of a register: an output's 32 lane accumulators run as `32 / WIDTH` parts.
    const WIDTH: usize;
    /// Rows in the register tile.
    const ROWS: usize;
    /// Tokens in the register tile.
    const TOKENS: usize;
    /// Part steps (`WIDTH` inputs) taken between two visits of the accumulators' buffer.
    const STEPS: usize;

    /// The register tile: for `ROWS` rows and `TOKENS` tokens, `len` steps of one part added to the `WIDTH` lane
    /// accumulators of that part of each output: lane `l` of step `s` adds `x[32s + pW + l] · w[32s + pW + l]`
    /// (fused), steps in order. `panel` is the rows' `[step][row][W]` weights of the part, `xs` the tokens'
    /// `[step][token][W]` inputs; `acc` holds the accumulators between calls, `[row][token][W]`, and is read unless
    /// `first` (then they start at zero, as [`super::matvec`]'s do). All three are aligned to `4 · WIDTH` bytes (64
    /// at most).
    ///
    /// # Safety
    /// The CPU runs the instruction set.
    unsafe fn tile(panel: &[f32], xs: &[f32], len: usize, acc: &mut [f32], first: bool);

    /// Steps `steps` of a stored row (`elem`) widened into `dst`: part `p` of step `s` at
    /// `dst[p · second + (s - steps.start) · stride..][..W]`.
    ///
    /// # Safety
    /// The CPU runs the instruction set.
    unsafe fn widen_stored(
        row: &[u8],
        elem: Elem,
        steps: Range<usize>,
        dst: &mut [f32],
        stride: usize,
        second: usize,
    );

    /// Steps `steps` of a packed row's weights `f32(code) · f32(scale)` into `dst`, laid out as
    /// [`Isa::widen_stored`] lays them.
    ///
    /// # Safety
    /// The CPU runs the instruction set.
    unsafe fn widen_packed(
        row: &PackedRow,
        steps: Range<usize>,
        dst: &mut [f32],
        stride: usize,
        second: usize,
    );

    /// One output's 32 lane accumulators (part `p` at `acc[p · part..][..W]`) combined in [`super::matvec`]'s
    /// order: lanes `(l + (l+8)) + ((l+16) + (l+24))` for `l < 8`, then reduced as `(l, l+4)`, `(l, l+2)`,
    /// `(l, l+1)`.
    ///
    /// # Safety
    /// The CPU runs the instruction set.
    unsafe fn combine(acc: &[f32], part: usize) -> f32;

    /// Asks for the cache lines of `values` in the L2 cache (a hint: nothing is read).
    ///
    /// # Safety
    /// The CPU runs the instruction set.
    unsafe fn prefetch(values: &[f32]);
}

/// Asserts that `dst` holds `32 / width` parts `second` apart, each `steps` runs of `width` values `stride` apart.
fn check_panel(dst: &[f32], width: usize, steps: usize, stride: usize, second: usize) {
    assert!(stride >= width && second >= steps * stride);
    assert!(steps == 0 || dst.len() >= (LANES / width - 1) * second + (steps - 1) * stride + width);
}

/// Steps `steps` of a packed row widened a step at a time by [`PackedRow::widen`] and laid out as
/// [`Isa::widen_stored`] lays them (rows whose groups split a part, and the instruction sets without a faster way).
fn widen_packed_by_steps(
    row: &PackedRow,
    width: usize,
    steps: Range<usize>,
    dst: &mut [f32],
    stride: usize,
    second: usize,
) {
    check_panel(dst, width, steps.len(), stride, second);
    let mut buf = [0f32; LANES];
    for (k, s) in steps.enumerate() {
        row.widen(s * LANES, &mut buf);
        for (p, part) in buf.chunks_exact(width).enumerate() {
            dst[p * second + k * stride..][..width].copy_from_slice(part);
        }
    }
}

/// A weight matrix whose rows can be widened into the panels.
pub(super) trait Panels: Sync {
    /// `(rows, cols)`.
    fn shape(&self) -> (usize, usize);

    /// Steps `steps` of row `r` (`32` weights each) into `dst`, laid out as [`Isa::widen_stored`] lays them.
    ///
    /// # Safety
    /// The CPU runs `I`.
    unsafe fn widen<I: Isa>(
        &self,
        r: usize,
        steps: Range<usize>,
        dst: &mut [f32],
        stride: usize,
        second: usize,
    );

    /// Row `r`'s last `cols mod 32` weights into `tail`.
    fn tail(&self, r: usize, tail: &mut [f32]);
}

impl Panels for MappedMatrix {
    fn shape(&self) -> (usize, usize) {
        (self.rows(), self.cols())
    }

    unsafe fn widen<I: Isa>(
        &self,
        r: usize,
        steps: Range<usize>,
        dst: &mut [f32],
        stride: usize,
        second: usize,
    ) {
        // SAFETY: the caller's guarantee.
        unsafe { I::widen_stored(self.row_bytes(r), self.elem(), steps, dst, stride, second) };
    }

    fn tail(&self, r: usize, tail: &mut [f32]) {
        let main = self.cols() / LANES * LANES;
        super::kernel::widen(
            &self.row_bytes(r)[main * self.elem().size()..],
            self.elem(),
            tail,
        );
    }
}

impl Panels for PackedMatrix {
    fn shape(&self) -> (usize, usize) {
        (self.rows(), self.cols())
    }

    unsafe fn widen<I: Isa>(
        &self,
        r: usize,
        steps: Range<usize>,
        dst: &mut [f32],
        stride: usize,
        second: usize,
    ) {
        // SAFETY: the caller's guarantee.
        unsafe { I::widen_packed(&self.row(r), steps, dst, stride, second) };
    }

    fn tail(&self, r: usize, tail: &mut [f32]) {
        self.row(r).widen(self.cols() / LANES * LANES, tail);
    }
}
