//! The prompt's product (`T >` [`super::MATVEC_MAX_TOKENS`]) on a CPU with AVX-512F: `y = x Wᵀ` for a mapped
//! ([`super::MappedMatrix`]: bf16, f16, f32) or packed ([`super::PackedMatrix`]: INT4/INT8 codes times f16 scales)
//! weight, in the summation order [`super::matvec`] documents, so that it equals [`super::matvec`] (and
//! [`super::matvec_packed`]) bit for bit for every token count.
//!
//! Of an output's 32 lane accumulators (lane `i mod 32`, in increasing `i`), lanes 0..16 and 16..32 never meet before
//! the final combination, so the kernel runs them as two halves: half `h` of step `s` is the 16 inputs
//! `32s + 16h..32s + 16h + 16`, and one 512-bit register holds an output's 16 lanes of one half. That leaves room for
//! a register tile of [`ROWS`] rows × [`TOKENS`] tokens (24 accumulators): per half step it loads each row's 16
//! weights and each token's 16 inputs once, `ROWS + TOKENS` loads for `ROWS · TOKENS` fused multiply-adds.
//!
//! The weights are widened (exactly) straight into f32 panels, a block of rows at a time, in one vectorised pass: per
//! group of [`ROWS`] rows and per half, step by step, the rows' 16 weights side by side (`[half][step][row][16]`), so
//! the inner loop reads them in order with no conversion. The inputs are laid out once per call the same way, per
//! block of [`TOKENS`] tokens (`[half][step][token][16]`, padded with zero tokens). Every buffer is 64-byte aligned,
//! so no load straddles two cache lines. Steps are taken [`STEPS`] at a time: the token block's inputs for those steps
//! stay in the L1 cache while every row group of the block passes over them, the block's panel in L2; between them
//! the accumulators wait in a small buffer, which changes no bit. At the end each output's two halves are combined
//! as `matvec` combines its lanes and the `n mod 32` tail added one product at a time.
//!
//! Blocks of rows are split across the rayon threads as [`super::matvec`] splits rows; the split decides only which
//! thread computes an output, never how. Without AVX-512F ([`PromptKernel::detect`]) the caller keeps the blocked
//! GEMM of `rows::blocked_gemm`.

#[cfg(target_arch = "x86_64")]
mod avx512;

use super::{MappedMatrix, PackedMatrix};

/// Rows in the register tile.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const ROWS: usize = 4;

/// Tokens in the register tile.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const TOKENS: usize = 6;

/// Half steps (16 inputs) taken between two visits of the accumulators' buffer.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const STEPS: usize = 48;

/// The f32 bytes of widened weights a block of rows holds at most (in the L2 cache beside the inputs).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const PANEL_BYTES: usize = 1 << 20;

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
    #[cfg(target_arch = "x86_64")]
    if PromptKernel::detect() == PromptKernel::Avx512 {
        return Some(x86::product(w, x, t));
    }
    let _ = (w, x, t);
    None
}

/// A weight matrix whose rows can be widened into the panels.
pub(super) trait Panels: Sync {
    /// `(rows, cols)`.
    fn shape(&self) -> (usize, usize);

    /// Row `r`'s first `32⌊cols/32⌋` weights into `dst`: the 16 of half `h` of step `s` at
    /// `dst[h · second + s · stride..][..16]`; its last `cols mod 32` into `tail`.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2, FMA and F16C ([`PromptKernel::Avx512`]).
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen(
        &self,
        r: usize,
        dst: &mut [f32],
        stride: usize,
        second: usize,
        tail: &mut [f32],
    );
}

impl Panels for MappedMatrix {
    fn shape(&self) -> (usize, usize) {
        (self.rows(), self.cols())
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn widen(
        &self,
        r: usize,
        dst: &mut [f32],
        stride: usize,
        second: usize,
        tail: &mut [f32],
    ) {
        let row = self.row_bytes(r);
        // SAFETY: the features are the caller's guarantee.
        unsafe { avx512::widen_stored(row, self.elem(), self.cols(), dst, stride, second) };
        let main = self.cols() / 32 * 32;
        super::kernel::widen(&row[main * self.elem().size()..], self.elem(), tail);
    }
}

impl Panels for PackedMatrix {
    fn shape(&self) -> (usize, usize) {
        (self.rows(), self.cols())
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn widen(
        &self,
        r: usize,
        dst: &mut [f32],
        stride: usize,
        second: usize,
        tail: &mut [f32],
    ) {
        let row = self.row(r);
        // SAFETY: the features are the caller's guarantee.
        unsafe { avx512::widen_packed(&row, dst, stride, second) };
        row.widen(self.cols() / 32 * 32, tail);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::kernel::LANES;
    use super::{Panels, ROWS, STEPS, TOKENS, avx512};
    use rayon::prelude::*;

    /// Inputs in half a step: the lanes of one 512-bit register.
    const HALF: usize = LANES / 2;

    /// 16 f32 on a 64-byte boundary: one cache line, one register.
    #[derive(Clone, Copy)]
    #[repr(C, align(64))]
    struct Line([f32; HALF]);

    /// A buffer of f32 on a 64-byte boundary (whole cache lines).
    #[derive(Default)]
    struct Aligned(Vec<Line>);

    impl Aligned {
        /// At least `len` values (a multiple of 16), zero when new.
        fn zeroed(len: usize) -> Self {
            Aligned(vec![Line([0.0; HALF]); len.div_ceil(HALF)])
        }

        /// Makes room for `len` values (a multiple of 16); what it held may remain.
        fn grow(&mut self, len: usize) {
            if self.0.len() * HALF < len {
                self.0.resize(len.div_ceil(HALF), Line([0.0; HALF]));
            }
        }

        fn as_slice(&self) -> &[f32] {
            // SAFETY: `Line` is `repr(C)` around 16 f32 and its size is exactly 64 bytes (no padding), so the lines
            // are `16 · len` consecutive, initialised f32.
            unsafe {
                std::slice::from_raw_parts(self.0.as_ptr() as *const f32, self.0.len() * HALF)
            }
        }

        fn as_mut_slice(&mut self) -> &mut [f32] {
            // SAFETY: as in `as_slice`, borrowed mutably once.
            unsafe {
                std::slice::from_raw_parts_mut(self.0.as_mut_ptr() as *mut f32, self.0.len() * HALF)
            }
        }
    }

    /// [`super::product`] on a CPU with AVX-512F, AVX2, FMA and F16C (the caller checked).
    pub(super) fn product(w: &impl Panels, x: &[f32], t: usize) -> Vec<f32> {
        let (rows, cols) = w.shape();
        assert_eq!(x.len(), t * cols, "product: x must be [t, cols]");
        if rows == 0 || t == 0 {
            return vec![0f32; rows * t];
        }
        let steps = cols / LANES;
        let xs = token_blocks(x, t, cols);
        // Rows per block: the panel within PANEL_BYTES, at least 16 blocks per thread where the matrix allows, a
        // multiple of the tile's rows.
        let threads = rayon::current_num_threads().max(1);
        let fit = super::PANEL_BYTES / (steps * LANES * 4).max(1);
        let block = fit
            .min(rows.div_ceil(16 * threads))
            .max(1)
            .next_multiple_of(ROWS);
        let mut y = vec![0f32; rows * t];
        let out = Output(y.as_mut_ptr());
        (0..rows.div_ceil(block)).into_par_iter().for_each(|b| {
            let first = b * block;
            let count = block.min(rows - first);
            BUFFERS.with(|bufs| {
                let mut bufs = bufs.borrow_mut();
                // SAFETY: the caller checked that the CPU has AVX-512F, AVX2, FMA and F16C; `y` holds `[t, rows]`,
                // rows `first..first + count` are this task's alone, and `y` outlives the tasks.
                unsafe { row_block(w, first, count, xs.as_slice(), x, t, out, &mut bufs) };
            })
        });
        y
    }

    /// The output `[t, rows]`, written by the tasks at once, each in its own rows' columns.
    #[derive(Clone, Copy)]
    struct Output(*mut f32);

    // SAFETY: the tasks write disjoint elements (their own rows) and nothing reads them until all are done.
    unsafe impl Send for Output {}
    // SAFETY: as above.
    unsafe impl Sync for Output {}

    /// The inputs' first `32⌊cols/32⌋` columns per block of [`TOKENS`] tokens, `[block][half][step][token][16]`,
    /// the last block padded with zero tokens.
    fn token_blocks(x: &[f32], t: usize, cols: usize) -> Aligned {
        let steps = cols / LANES;
        let block_len = 2 * steps * TOKENS * HALF;
        let mut xs = Aligned::zeroed(t.div_ceil(TOKENS) * block_len);
        if steps == 0 {
            return xs;
        }
        xs.as_mut_slice()
            .par_chunks_mut(block_len)
            .enumerate()
            .for_each(|(b, dst)| {
                for j in 0..TOKENS.min(t - b * TOKENS) {
                    let src = &x[(b * TOKENS + j) * cols..][..steps * LANES];
                    for (k, v) in src.chunks_exact(HALF).enumerate() {
                        let (s, h) = (k / 2, k % 2);
                        dst[((h * steps + s) * TOKENS + j) * HALF..][..HALF].copy_from_slice(v);
                    }
                }
            });
        xs
    }

    /// A thread's buffers, kept between calls: the panel, the tails and the waiting accumulators.
    #[derive(Default)]
    struct Buffers {
        panel: Aligned,
        tail: Vec<f32>,
        acc: Aligned,
    }

    thread_local! {
        static BUFFERS: std::cell::RefCell<Buffers> = std::cell::RefCell::new(Buffers::default());
    }

    /// The outputs of rows `first..first + count` into `out`, `[t, rows]` (element `j · rows + r` for token `j` and row
    /// `r`):
    /// their panel widened, then for each block of tokens ([`TOKENS`]) and each half, [`STEPS`] steps at a time,
    /// every row group.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2, FMA and F16C; `out` points to `t · rows` values of which no other thread touches
    /// these rows'.
    #[allow(clippy::too_many_arguments)]
    unsafe fn row_block(
        w: &impl Panels,
        first: usize,
        count: usize,
        xs: &[f32],
        x: &[f32],
        t: usize,
        out: Output,
        bufs: &mut Buffers,
    ) {
        let (rows, cols) = w.shape();
        assert!(first + count <= rows && x.len() >= t * cols);
        let steps = cols / LANES;
        let main = steps * LANES;
        let tail_len = cols - main;
        let groups = count.div_ceil(ROWS);
        // A group's panel: per half, `steps` runs of ROWS · 16 weights.
        let half_len = steps * ROWS * HALF;
        let group_len = 2 * half_len;
        // A group's accumulators: [half][row][token][16].
        let acc_half = ROWS * TOKENS * HALF;
        let acc_len = 2 * acc_half;
        bufs.panel.grow(groups * group_len);
        bufs.acc.grow(groups * acc_len);
        if bufs.tail.len() < count * tail_len {
            bufs.tail.resize(count * tail_len, 0.0);
        }
        let panel = bufs.panel.as_mut_slice();
        for k in 0..count {
            let (g, r) = (k / ROWS, k % ROWS);
            // (Empty when the row is shorter than a step.)
            let start = (g * group_len + r * HALF).min((g + 1) * group_len);
            let dst = &mut panel[start..(g + 1) * group_len];
            let tail = &mut bufs.tail[k * tail_len..(k + 1) * tail_len];
            // SAFETY: the caller's guarantee; `dst` holds, per half, `steps` runs of 16 values ROWS · 16 apart.
            unsafe { w.widen(first + k, dst, ROWS * HALF, half_len, tail) };
        }
        // Rows of the last group past the matrix keep whatever the panel held: their outputs are never read.
        let panel = bufs.panel.as_slice();
        let acc = bufs.acc.as_mut_slice();
        let token_half = steps * TOKENS * HALF;
        for b in 0..t.div_ceil(TOKENS) {
            for h in 0..2 {
                let xb = &xs[(2 * b + h) * token_half..][..token_half];
                let mut s = 0;
                loop {
                    let len = STEPS.min(steps - s);
                    // The inputs the next pass over the row groups reads (the next steps, half or token block: the
                    // next values of `xs`), asked for a group's share at a time.
                    let next = &xs[((2 * b + h) * steps + s + len) * TOKENS * HALF..];
                    let next = &next[..next.len().min(STEPS * TOKENS * HALF)];
                    let share = next.len().div_ceil(groups * HALF) * HALF;
                    for g in 0..groups {
                        // SAFETY: the caller's guarantee.
                        unsafe {
                            avx512::prefetch(next.chunks(share.max(HALF)).nth(g).unwrap_or(&[]))
                        };
                        let p = &panel[g * group_len + h * half_len + s * ROWS * HALF..]
                            [..len * ROWS * HALF];
                        let a = &mut acc[g * acc_len + h * acc_half..][..acc_half];
                        // SAFETY: the caller's guarantee; the slices hold `len` half steps of the group and of the
                        // token block.
                        unsafe { avx512::tile(p, &xb[s * TOKENS * HALF..], len, a, s == 0) };
                    }
                    s += len;
                    if s >= steps {
                        break;
                    }
                }
            }
            for k in 0..count {
                let (g, r) = (k / ROWS, k % ROWS);
                let tail = &bufs.tail[k * tail_len..(k + 1) * tail_len];
                for j in 0..TOKENS.min(t - b * TOKENS) {
                    let token = b * TOKENS + j;
                    let lanes = |h: usize| {
                        &acc[g * acc_len + h * acc_half + (r * TOKENS + j) * HALF..][..HALF]
                    };
                    // SAFETY: the caller's guarantee.
                    let mut sum = unsafe { avx512::combine(lanes(0), lanes(1)) };
                    for (i, wv) in tail.iter().enumerate() {
                        sum = x[token * cols + main + i].mul_add(*wv, sum);
                    }
                    // SAFETY: `token < t` and `first + k < rows`: inside `out`, this task's row (the caller's
                    // guarantee).
                    unsafe { *out.0.add(token * rows + first + k) = sum };
                }
            }
        }
    }
}
