//! The driver of the prompt's product, written once against [`Isa`]: how a call is cut (chunks of steps, blocks of
//! rows, passes of tokens: [`blocking`]), the inputs laid out per block of tokens, and each thread's block of rows
//! widened into its panel, multiplied a tile at a time and combined (see the parent module's docs for the order).

use super::super::kernel::LANES;
use super::{Isa, MIN_BLOCK_ROWS, Panels, TOKENS_PER_PASS};
use rayon::prelude::*;
use std::ops::Range;

/// The f32 bytes of widened weights a panel holds at most: half this CPU's L2 cache (Linux says its size; 2 MiB is
/// assumed where it does not), between 128 KiB and 2 MiB.
fn panel_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        let read = |index: usize, what: &str| {
            #[allow(clippy::disallowed_methods)] // the kernel's figures, not an input of the run
            std::fs::read_to_string(format!(
                "/sys/devices/system/cpu/cpu0/cache/index{index}/{what}"
            ))
        };
        let l2 = (0..8)
            .find(|&i| read(i, "level").is_ok_and(|l| l.trim() == "2"))
            .and_then(|i| read(i, "size").ok())
            .and_then(|s| cache_bytes(&s))
            .unwrap_or(2 << 20);
        (l2 / 2).clamp(128 << 10, 2 << 20)
    })
}

/// A cache's size as Linux writes it (`512K`, `2M`), in bytes.
pub(super) fn cache_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let n: usize = digits.parse().ok()?;
    match unit {
        "K" => Some(n << 10),
        "M" => Some(n << 20),
        _ => None,
    }
}

/// 16 f32 on a 64-byte boundary: one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// A buffer of f32 on a 64-byte boundary (whole cache lines).
#[derive(Default)]
struct Aligned(Vec<Line>);

impl Aligned {
    /// At least `len` values, zero when new.
    fn zeroed(len: usize) -> Self {
        Aligned(vec![Line([0.0; 16]); len.div_ceil(16)])
    }

    /// Makes room for `len` values; what it held may remain.
    fn grow(&mut self, len: usize) {
        if self.0.len() * 16 < len {
            self.0.resize(len.div_ceil(16), Line([0.0; 16]));
        }
    }

    fn as_slice(&self) -> &[f32] {
        // SAFETY: `Line` is `repr(C)` around 16 f32 and its size is exactly 64 bytes (no padding), so the lines are
        // `16 · len` consecutive, initialised f32.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr() as *const f32, self.0.len() * 16) }
    }

    fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as in `as_slice`, borrowed mutably once.
        unsafe {
            std::slice::from_raw_parts_mut(self.0.as_mut_ptr() as *mut f32, self.0.len() * 16)
        }
    }
}

/// How a call is cut: steps per chunk and rows per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Blocking {
    pub(super) chunk: usize,
    pub(super) block: usize,
}

/// The chunk of steps and the block of rows for a `[rows, steps · 32]` product on `threads` threads within
/// `panel_bytes` of panel: the whole width where [`MIN_BLOCK_ROWS`] rows of it fit, else chunks of as many steps as
/// let them fit; blocks as long as fit, but at least 16 per thread where the matrix allows, a multiple of `rows_tile`.
pub(super) fn blocking(
    rows: usize,
    steps: usize,
    threads: usize,
    panel_bytes: usize,
    rows_tile: usize,
) -> Blocking {
    let step_bytes = LANES * 4;
    let chunk = (panel_bytes / (MIN_BLOCK_ROWS * step_bytes))
        .max(1)
        .min(steps.max(1));
    let fit = panel_bytes / (chunk * step_bytes);
    let block = fit
        .min(rows.div_ceil(16 * threads.max(1)))
        .max(1)
        .next_multiple_of(rows_tile);
    Blocking { chunk, block }
}

/// [`super::product`] on `I`.
///
/// # Safety
/// The CPU runs `I`.
pub(super) unsafe fn product_on<I: Isa>(w: &impl Panels, x: &[f32], t: usize) -> Vec<f32> {
    let (rows, cols) = w.shape();
    assert_eq!(x.len(), t * cols, "product: x must be [t, cols]");
    let mut y = vec![0f32; rows * t];
    if rows == 0 || t == 0 {
        return y;
    }
    let cut = blocking(
        rows,
        cols / LANES,
        rayon::current_num_threads(),
        panel_bytes(),
        I::ROWS,
    );
    // SAFETY: the caller's guarantee.
    unsafe { product_cut::<I>(w, x, t, cut, TOKENS_PER_PASS, &mut y) };
    y
}

/// [`product_on`] cut as `cut` says, `pass` tokens (rounded up to whole token blocks) at a time, into `y`
/// (`[t, rows]`).
///
/// # Safety
/// The CPU runs `I`.
pub(super) unsafe fn product_cut<I: Isa>(
    w: &impl Panels,
    x: &[f32],
    t: usize,
    cut: Blocking,
    pass: usize,
    y: &mut [f32],
) {
    let (rows, cols) = w.shape();
    assert!(y.len() == rows * t && x.len() == t * cols && cut.block > 0);
    let out = Output(y.as_mut_ptr());
    let pass = pass.max(1).next_multiple_of(I::TOKENS);
    for first_token in (0..t).step_by(pass) {
        let count = pass.min(t - first_token);
        let xp = &x[first_token * cols..(first_token + count) * cols];
        let xs = token_blocks::<I>(xp, count, cols);
        (0..rows.div_ceil(cut.block)).into_par_iter().for_each(|b| {
            let first = b * cut.block;
            let rows_here = cut.block.min(rows - first);
            BUFFERS.with(|bufs| {
                let mut bufs = bufs.borrow_mut();
                let pass = Pass {
                    xs: xs.as_slice(),
                    x: xp,
                    tokens: count,
                    first_token,
                    chunk: cut.chunk.clamp(1, (cols / LANES).max(1)),
                };
                // SAFETY: the caller's guarantee; `y` holds `[t, rows]`, rows `first..first + rows_here` are
                // this task's alone, and `y` outlives the tasks.
                unsafe { row_block::<I>(w, first, rows_here, &pass, t, out, &mut bufs) };
            })
        });
    }
}

/// The output `[t, rows]`, written by the tasks at once, each in its own rows' columns.
#[derive(Clone, Copy)]
struct Output(*mut f32);

// SAFETY: the tasks write disjoint elements (their own rows) and nothing reads them until all are done.
unsafe impl Send for Output {}
// SAFETY: as above.
unsafe impl Sync for Output {}

/// The inputs' first `32⌊cols/32⌋` columns per block of `TOKENS` tokens, `[block][part][step][token][W]`, the last
/// block padded with zero tokens.
fn token_blocks<I: Isa>(x: &[f32], t: usize, cols: usize) -> Aligned {
    let (w, parts) = (I::WIDTH, LANES / I::WIDTH);
    let steps = cols / LANES;
    let block_len = parts * steps * I::TOKENS * w;
    let mut xs = Aligned::zeroed(t.div_ceil(I::TOKENS) * block_len);
    if steps == 0 {
        return xs;
    }
    xs.as_mut_slice()
        .par_chunks_mut(block_len)
        .enumerate()
        .for_each(|(b, dst)| {
            for j in 0..I::TOKENS.min(t - b * I::TOKENS) {
                let src = &x[(b * I::TOKENS + j) * cols..][..steps * LANES];
                for (k, v) in src.chunks_exact(w).enumerate() {
                    let (s, p) = (k / parts, k % parts);
                    dst[((p * steps + s) * I::TOKENS + j) * w..][..w].copy_from_slice(v);
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

/// One pass's tokens: `tokens` of them from `first_token` on, laid out ([`token_blocks`]) and as given.
struct Pass<'a> {
    xs: &'a [f32],
    x: &'a [f32],
    tokens: usize,
    first_token: usize,
    chunk: usize,
}

/// The outputs of rows `first..first + count` for the pass's tokens into `out`, `[t, rows]` (element `j · rows + r`
/// for token `j` and row `r`): per chunk of steps, their panel widened, then for each block of tokens and each part,
/// `STEPS` steps at a time, every row group; after the last chunk the outputs combined.
///
/// # Safety
/// The CPU runs `I`; `out` points to `t · rows` values of which no other thread touches these rows'.
unsafe fn row_block<I: Isa>(
    w: &impl Panels,
    first: usize,
    count: usize,
    pass: &Pass,
    t: usize,
    out: Output,
    bufs: &mut Buffers,
) {
    let (rows, cols) = w.shape();
    let (wd, parts) = (I::WIDTH, LANES / I::WIDTH);
    let (tokens, x) = (pass.tokens, pass.x);
    assert!(first + count <= rows && x.len() >= tokens * cols);
    assert!(pass.first_token + tokens <= t);
    let steps = cols / LANES;
    let main = steps * LANES;
    let tail_len = cols - main;
    let groups = count.div_ceil(I::ROWS);
    let blocks = tokens.div_ceil(I::TOKENS);
    let chunk = pass.chunk.max(1);
    let chunks = steps.div_ceil(chunk).max(1);
    // A group's panel: per part, up to `chunk` runs of ROWS · W weights.
    let part_len = chunk * I::ROWS * wd;
    let group_len = parts * part_len;
    // The accumulators of a group and a token block: [part][row][token][W].
    let acc_part = I::ROWS * I::TOKENS * wd;
    let acc_len = parts * acc_part;
    // Where every token block waits for the next chunk; with one chunk, a block's are combined before the next.
    let acc_blocks = if chunks > 1 { blocks } else { 1 };
    bufs.panel.grow(groups * group_len);
    bufs.acc.grow(acc_blocks * groups * acc_len);
    if bufs.tail.len() < count * tail_len {
        bufs.tail.resize(count * tail_len, 0.0);
    }
    for k in 0..count {
        w.tail(first + k, &mut bufs.tail[k * tail_len..(k + 1) * tail_len]);
    }
    let token_part = steps * I::TOKENS * wd;
    let xs = pass.xs;
    for c in 0..chunks {
        let range = c * chunk..((c + 1) * chunk).min(steps);
        let panel = bufs.panel.as_mut_slice();
        for k in 0..count {
            let (g, r) = (k / I::ROWS, k % I::ROWS);
            let start = g * group_len + r * wd;
            let dst = &mut panel[start..(g + 1) * group_len];
            // SAFETY: the caller's guarantee; `dst` holds, per part, `range.len()` runs of W values ROWS · W apart.
            unsafe { w.widen::<I>(first + k, range.clone(), dst, I::ROWS * wd, part_len) };
        }
        // Rows of the last group past the matrix keep whatever the panel held: their outputs are never read.
        let panel = bufs.panel.as_slice();
        let acc = bufs.acc.as_mut_slice();
        for b in 0..blocks {
            let acc_b = &mut acc[(b % acc_blocks) * groups * acc_len..][..groups * acc_len];
            for p in 0..parts {
                let xb = &xs[(parts * b + p) * token_part..][..token_part];
                let mut s = range.start;
                loop {
                    let len = I::STEPS.min(range.end - s);
                    let next = next_inputs::<I>(xs, steps, blocks, &range, b, p, s + len);
                    let share = next.len().div_ceil(groups * wd) * wd;
                    for g in 0..groups {
                        // SAFETY: the caller's guarantee.
                        unsafe { I::prefetch(next.chunks(share.max(wd)).nth(g).unwrap_or(&[])) };
                        let pg = &panel
                            [g * group_len + p * part_len + (s - range.start) * I::ROWS * wd..]
                            [..len * I::ROWS * wd];
                        let a = &mut acc_b[g * acc_len + p * acc_part..][..acc_part];
                        // SAFETY: the caller's guarantee; the slices hold `len` part steps of the group and of the
                        // token block.
                        unsafe { I::tile(pg, &xb[s * I::TOKENS * wd..], len, a, s == 0) };
                    }
                    s += len;
                    if s >= range.end {
                        break;
                    }
                }
            }
            if c + 1 < chunks {
                continue;
            }
            for k in 0..count {
                let (g, r) = (k / I::ROWS, k % I::ROWS);
                let tail = &bufs.tail[k * tail_len..(k + 1) * tail_len];
                for j in 0..I::TOKENS.min(tokens - b * I::TOKENS) {
                    let token = b * I::TOKENS + j;
                    let lanes = &acc_b[g * acc_len + (r * I::TOKENS + j) * wd..];
                    // SAFETY: the caller's guarantee; the parts are `acc_part` apart inside the group's.
                    let mut sum = unsafe { I::combine(lanes, acc_part) };
                    for (i, wv) in tail.iter().enumerate() {
                        sum = x[token * cols + main + i].mul_add(*wv, sum);
                    }
                    // SAFETY: `pass.first_token + token < t` and `first + k < rows`: inside `out`, this task's row
                    // (the caller's guarantee).
                    unsafe { *out.0.add((pass.first_token + token) * rows + first + k) = sum };
                }
            }
        }
    }
}

/// The inputs the next pass over a block's row groups reads, after steps `..s` of part `p` of token block `b` in
/// the chunk `range`: the next steps of the part, else the next part's or block's first steps of the chunk; at most
/// `STEPS` steps of them.
fn next_inputs<'a, I: Isa>(
    xs: &'a [f32],
    steps: usize,
    blocks: usize,
    range: &Range<usize>,
    b: usize,
    p: usize,
    s: usize,
) -> &'a [f32] {
    let parts = LANES / I::WIDTH;
    let (b, p, s) = if s < range.end {
        (b, p, s)
    } else if p + 1 < parts {
        (b, p + 1, range.start)
    } else if b + 1 < blocks {
        (b + 1, 0, range.start)
    } else {
        return &[];
    };
    let len = I::STEPS.min(range.end - s) * I::TOKENS * I::WIDTH;
    let start = ((parts * b + p) * steps + s) * I::TOKENS * I::WIDTH;
    &xs[start.min(xs.len())..(start + len).min(xs.len())]
}
