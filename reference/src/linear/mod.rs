//! Linear layers whose weights stay as the checkpoint stores them.
//!
//! A [`Linear`] holds a candle tensor (f64 runs), a [`MappedMatrix`]: the memory-mapped bf16, f16 or f32 bytes of a
//! `[out, in]` matrix (or an owned buffer of f16-rounded values), never converted as a whole, or a [`PackedMatrix`]:
//! the INT4/INT8 codes and f16 scales of a quantised matrix. Widening bf16 or f16 to f32 is exact, and so is the
//! dequantised weight `f32(code) · f32(scale)`, so every path computes the same products; only the order of the f32
//! sums differs from candle's.
//!
//! - Few tokens (`T ≤` [`MATVEC_MAX_TOKENS`], decode): [`matvec`], a multi-threaded product that reads each weight
//!   row once for all `T` tokens and widens the stored values in registers (AVX2/FMA/F16C when the CPU has them,
//!   checked at run time; portable code otherwise).
//! - More tokens (prompt), on a CPU with AVX-512F ([`PromptKernel::Avx512`]): a packed product that widens blocks of
//!   rows straight into its own f32 panels and sums in [`matvec`]'s order below, so it gives [`matvec`]'s bits for
//!   every token count (`gemm_kernel`).
//! - More tokens without AVX-512F: the matrix is widened to f32 in blocks of rows ([`BLOCK_ELEMENTS`] values at
//!   most, into one buffer reused across calls) and each block multiplied with the `gemm` crate's product, called as
//!   candle calls it, so at most one block's f32 copy exists at a time.
//!
//! A [`PackedMatrix`] goes the same two ways: [`matvec_packed`] widens each code times its scale in registers and
//! sums in the order below, so it equals [`matvec`] on the dequantised matrix stored as f32 bit for bit; longer
//! calls dequantise blocks of rows and use the GEMM ([`PackedMatrix::prompt_product`] is the prompt kernel on the
//! codes, the same bits as [`matvec_packed`], not yet what `forward` calls).
//!
//! Summation order of [`matvec`] (fixed, independent of the thread count): for one output `y[t, o]`, the products
//! `x[t, i] · w[o, i]` for `i < 32⌊n/32⌋` go to 32 lane accumulators, lane `i mod 32`, in increasing `i`; lanes
//! are combined as `(l + (l+8)) + ((l+16) + (l+24))` for `l < 8`, then the 8 lanes reduced as `(l, l+4)`,
//! `(l, l+2)`, `(l, l+1)`; the remaining `n mod 32` products are then added one by one in increasing `i`. The SIMD path fuses each multiply-add (one
//! rounding), the portable path does not; each path is deterministic.

use crate::error::{Error, Result};
use crate::gguf::arith::InputRounding;
use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use std::sync::Arc;

mod gemm_kernel;
mod gguf;
mod kernel;
mod on_read;
mod packed;
mod quant_kernel;
mod rounded;
mod rows;

pub use gemm_kernel::PromptKernel;
pub use gguf::GgufMatrix;
pub use kernel::matvec;
use kernel::widen;
pub use on_read::QuantizedOnRead;
pub use packed::PackedMatrix;
pub use quant_kernel::{QuantKernel, matvec_packed, matvec_packed_on};
use rows::{WidenRows, blocked_gemm, gather, rows_f32, to_tensor, widen_rows};

/// Calls with at most this many tokens use [`matvec`]; longer ones the blocked GEMM.
pub const MATVEC_MAX_TOKENS: usize = 8;

/// The largest number of weight values widened to f32 at once on the GEMM path (64 MiB of f32).
pub const BLOCK_ELEMENTS: usize = 16 << 20;

/// How a mapped matrix's elements are stored (little endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
}

impl Elem {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elem::Bf16 | Elem::F16 => 2,
            Elem::F32 => 4,
        }
    }
}

/// A row-major `[rows, cols]` matrix read in place from a byte buffer (a memory-mapped checkpoint shard).
#[derive(Clone)]
pub struct MappedMatrix {
    map: SharedMap,
    offset: usize,
    rows: usize,
    cols: usize,
    elem: Elem,
}

impl std::fmt::Debug for MappedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedMatrix")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("elem", &self.elem)
            .finish()
    }
}

struct MmapBytes(Mmap);

impl AsRef<[u8]> for MmapBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// A shared memory map (or owned buffer) that matrices can point into.
#[derive(Clone)]
pub struct SharedMap(
    Arc<dyn AsRef<[u8]> + Send + Sync>,
    /// The same bytes when they are a memory map.
    Option<Arc<MmapBytes>>,
);

impl SharedMap {
    /// Shares a memory map.
    pub fn from_mmap(map: Mmap) -> Self {
        let map = Arc::new(MmapBytes(map));
        SharedMap(map.clone(), Some(map))
    }

    /// Shares an owned buffer (f16-rounded weights, tests, benches).
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        SharedMap(Arc::new(bytes), None)
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        (*self.0).as_ref()
    }

    /// Hands back this process's resident pages of the bytes `range` of a read-only file map (Unix `MADV_DONTNEED`,
    /// the pages at its ends included): a later read faults them in again from the file, so the bytes never change.
    /// For bytes read once, e.g. a matrix quantised at load. Nothing for an owned buffer, elsewhere than Unix, or
    /// when the range is outside the map; best effort.
    pub fn release(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        if let Some(map) = &self.1
            && range.start <= range.end
            && range.end <= map.0.len()
        {
            // SAFETY: the map is a read-only file mapping (`Mmap`), never written: dropping its pages only makes the
            // next read fetch the same bytes from the file again.
            let _ = unsafe {
                map.0.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    range.start,
                    range.len(),
                )
            };
        }
        #[cfg(not(unix))]
        let _ = range;
    }

    /// [`SharedMap::release`] over the whole map.
    pub fn release_all(&self) {
        self.release(0..self.bytes().len());
    }

    /// Whether the bytes are a file's map (pages the kernel can take back), not an owned buffer.
    pub fn is_file_map(&self) -> bool {
        self.1.is_some()
    }
}

impl std::fmt::Debug for SharedMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMap")
            .field("bytes", &self.bytes().len())
            .field("mapped", &self.1.is_some())
            .finish()
    }
}

impl MappedMatrix {
    /// A `[rows, cols]` matrix of `elem` values at `offset` in `map`; fails if the bytes do not fit.
    pub fn new(
        map: &SharedMap,
        offset: usize,
        rows: usize,
        cols: usize,
        elem: Elem,
    ) -> Result<Self> {
        let len = rows
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(elem.size()))
            .ok_or_else(|| Error::Input(format!("matrix [{rows}, {cols}] is too large")))?;
        if offset
            .checked_add(len)
            .is_none_or(|end| end > map.bytes().len())
        {
            return Err(Error::Input(format!(
                "matrix [{rows}, {cols}] of {elem:?} at byte {offset} overruns its buffer of {} bytes",
                map.bytes().len()
            )));
        }
        Ok(MappedMatrix {
            map: map.clone(),
            offset,
            rows,
            cols,
            elem,
        })
    }

    /// Output features (rows).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (columns).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The storage type.
    pub fn elem(&self) -> Elem {
        self.elem
    }

    /// Whether its bytes lie in a file's map ([`SharedMap::is_file_map`]).
    pub fn in_file_map(&self) -> bool {
        self.map.is_file_map()
    }

    /// Where its bytes lie in the buffer.
    fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.byte_len()
    }

    /// Its bytes.
    pub fn byte_len(&self) -> usize {
        self.rows * self.cols * self.elem.size()
    }

    fn data(&self) -> &[u8] {
        &self.map.bytes()[self.range()]
    }

    /// Hands back this process's pages of the matrix's bytes ([`SharedMap::release`]): for a matrix read now and
    /// then, such as an MoE block's routed expert.
    pub fn release_pages(&self) {
        self.map.release(self.range());
    }

    fn row_bytes(&self, r: usize) -> &[u8] {
        let n = self.cols * self.elem.size();
        &self.data()[r * n..(r + 1) * n]
    }

    /// Rows `start..start + count` widened to f32 (exact), row-major, converted in parallel.
    pub fn rows_f32(&self, start: usize, count: usize) -> Vec<f32> {
        rows_f32(self, start, count)
    }

    /// The whole matrix as an f32 tensor `[rows, cols]`.
    pub fn to_tensor(&self) -> Result<Tensor> {
        to_tensor(self)
    }

    /// `y = x Wᵀ` (`x` `[t, cols]` row-major, the result `[t, rows]`) by [`PromptKernel::Avx512`], the prompt's
    /// product, for any `t`: the bits of [`matvec`]. `None` when the CPU lacks AVX-512F.
    pub fn prompt_product(&self, x: &[f32], t: usize) -> Option<Vec<f32>> {
        gemm_kernel::product(self, x, t)
    }

    /// The rows `ids` (an embedding lookup) as an f32 tensor `[ids.len(), cols]`.
    pub fn gather(&self, ids: &[u32]) -> Result<Tensor> {
        gather(self, ids)
    }

    /// `x W^T` for `x` `[T, cols]` f32 → `[T, rows]`: [`matvec`] for few tokens, otherwise the packed product of
    /// [`PromptKernel::Avx512`] (the same order, the same bits) where the CPU has it, else the blocked GEMM.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let t = check_input(x, self.rows, self.cols, "a mapped")?;
        let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
        if t <= MATVEC_MAX_TOKENS {
            let y = matvec(self, &xs, t);
            return Ok(Tensor::from_vec(y, (t, self.rows), &Device::Cpu)?);
        }
        if let Some(y) = gemm_kernel::product(self, &xs, t) {
            return Ok(Tensor::from_vec(y, (t, self.rows), &Device::Cpu)?);
        }
        let block = (BLOCK_ELEMENTS / self.cols.max(1)).max(1);
        blocked_gemm(x, self.rows, self.cols, block, |s, out| {
            widen_rows(self, s, out)
        })
    }
}

impl WidenRows for MappedMatrix {
    fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    fn widen_row(&self, r: usize, dst: &mut [f32]) {
        widen(self.row_bytes(r), self.elem, dst);
    }
}

/// Checks that `x` is `[T, cols]` f32 for a `[rows, cols]` weight (`what`: "a mapped", "a quantised"); gives `T`.
fn check_input(x: &Tensor, rows: usize, cols: usize, what: &str) -> Result<usize> {
    let (t, n) = x.dims2()?;
    if n != cols {
        return Err(Error::Input(format!(
            "linear: input has {n} features, the weight [{rows}, {cols}] expects {cols}"
        )));
    }
    if x.dtype() != DType::F32 {
        return Err(Error::Input(format!(
            "linear: {what} weight takes f32 inputs, not {:?}",
            x.dtype()
        )));
    }
    Ok(t)
}

/// A linear layer's weight `[out, in]`: mapped as stored, packed codes and scales, a GGUF's ggml blocks, or a tensor
/// of the run's dtype.
#[derive(Debug, Clone)]
pub enum Linear {
    /// Read in place (f32 runs): the checkpoint's bf16, f16 or f32 weights, or an owned buffer of f16-rounded ones.
    Mapped(MappedMatrix),
    /// Quantised codes and f16 scales (f32 runs of INT4/INT8 weights).
    Packed(PackedMatrix),
    /// A tensor held in memory (f64 runs).
    Dense(Tensor),
    /// Read in place and quantised a row at a time when read (the embedding of a compressed f32 run): the packed
    /// matrix's values without its codes held.
    OnRead(QuantizedOnRead),
    /// A GGUF tensor's ggml blocks in the mapped file, rows decoded as they are read (f32 runs of a GGUF): the
    /// products of the decoded matrix stored as f32, bit for bit.
    Gguf(GgufMatrix),
    /// A weight whose input is first rounded as llama.cpp's CPU converts it for this weight's ggml type (its
    /// `vec_dot_type`, [`crate::gguf::arith`]): the inner weight's product with the rounded activations. Lookups
    /// ([`Linear::gather`]) read the inner weight unchanged.
    RoundedInput(InputRounding, Box<Linear>),
}

impl Linear {
    /// `x W^T`: `x` `[T, in]` → `[T, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Mapped(m) => m.forward(x),
            Linear::Packed(m) => m.forward(x),
            Linear::Dense(w) => crate::ops::linear(x, w),
            Linear::OnRead(m) => m.packed()?.forward(x),
            Linear::Gguf(m) => m.forward(x),
            Linear::RoundedInput(r, inner) => rounded::forward(r, inner, x),
        }
    }

    /// The weight itself, under any input rounding ([`Linear::RoundedInput`]).
    pub fn weight(&self) -> &Linear {
        match self {
            Linear::RoundedInput(_, inner) => inner.weight(),
            other => other,
        }
    }

    /// The rows `ids` of the matrix (an embedding lookup) `[ids.len(), in]`.
    pub fn gather(&self, ids: &[u32]) -> Result<Tensor> {
        match self {
            Linear::Mapped(m) => m.gather(ids),
            Linear::Packed(m) => m.gather(ids),
            Linear::Dense(w) => {
                let ids = Tensor::from_vec(ids.to_vec(), ids.len(), w.device())?;
                Ok(w.index_select(&ids, 0)?)
            }
            Linear::OnRead(m) => m.gather(ids),
            Linear::Gguf(m) => m.gather(ids),
            Linear::RoundedInput(_, inner) => inner.gather(ids),
        }
    }

    /// Hands back the pages of a weight read in place from a file map ([`MappedMatrix::release_pages`]), quantised
    /// on read included; nothing for the other kinds, which hold their own memory.
    pub fn release_pages(&self) {
        match self {
            Linear::Mapped(m) => m.release_pages(),
            Linear::OnRead(m) => m.release_pages(),
            Linear::Gguf(m) => m.release_pages(),
            Linear::RoundedInput(_, inner) => inner.release_pages(),
            Linear::Packed(_) | Linear::Dense(_) => {}
        }
    }

    /// The weight as a tensor (f32 for a mapped or packed weight: a full copy, dequantised for a packed one).
    pub fn to_tensor(&self) -> Result<Tensor> {
        match self {
            Linear::Mapped(m) => m.to_tensor(),
            Linear::Packed(m) => m.to_tensor(),
            Linear::Dense(w) => Ok(w.clone()),
            Linear::OnRead(m) => m.packed()?.to_tensor(),
            Linear::Gguf(m) => m.to_tensor(),
            Linear::RoundedInput(_, inner) => inner.to_tensor(),
        }
    }

    /// The ggml type the weight is stored as when it is a GGUF tensor kept packed ([`Linear::Gguf`]); `None` for
    /// every other kind (a checkpoint's weights, and a GGUF's in an f64 or compressed run, decoded at load).
    pub fn ggml_type(&self) -> Option<crate::gguf::GgmlType> {
        match self {
            Linear::Gguf(m) => Some(m.ggml_type()),
            Linear::RoundedInput(_, inner) => inner.ggml_type(),
            Linear::Mapped(_) | Linear::Packed(_) | Linear::Dense(_) | Linear::OnRead(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::kernel::portable_dot;
    use super::*;

    fn store(values: &[f32], elem: Elem, pad: usize) -> SharedMap {
        let mut bytes = vec![0u8; pad];
        for &v in values {
            match elem {
                Elem::Bf16 => bytes.extend(half::bf16::from_f32(v).to_le_bytes()),
                Elem::F16 => bytes.extend(half::f16::from_f32(v).to_le_bytes()),
                Elem::F32 => bytes.extend(v.to_le_bytes()),
            }
        }
        SharedMap::from_vec(bytes)
    }

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The plain reference: f64 sums of the widened stored values, and the row norms `Σ |x_i w_i|`.
    fn reference(w: &MappedMatrix, x: &[f32], t: usize) -> (Vec<f64>, Vec<f64>) {
        let full = w.rows_f32(0, w.rows());
        let n = w.cols();
        let mut y = vec![0f64; t * w.rows()];
        let mut norm = vec![0f64; t * w.rows()];
        for j in 0..t {
            for r in 0..w.rows() {
                for i in 0..n {
                    let p = x[j * n + i] as f64 * full[r * n + i] as f64;
                    y[j * w.rows() + r] += p;
                    norm[j * w.rows() + r] += p.abs();
                }
            }
        }
        (y, norm)
    }

    fn check(rows: usize, cols: usize, t: usize, elem: Elem, pad: usize) {
        let wv = values(rows * cols, 1 + rows as u64 * 31 + cols as u64);
        let map = store(&wv, elem, pad);
        let m = MappedMatrix::new(&map, pad, rows, cols, elem).unwrap();
        let x = values(t * cols, 7 + t as u64);
        let y = matvec(&m, &x, t);
        let (expected, norm) = reference(&m, &x, t);
        // Each f32 sum of n products is within ~n·2^-24 of the row's absolute sum.
        let tol = (cols as f64 + 2.0) * f32::EPSILON as f64;
        for k in 0..y.len() {
            let err = (y[k] as f64 - expected[k]).abs();
            assert!(
                err <= tol * norm[k] + 1e-30,
                "{elem:?} [{rows}, {cols}] t={t} output {k}: {} vs {} (|.| sum {})",
                y[k],
                expected[k],
                norm[k]
            );
        }
        // The portable path agrees with the SIMD one within the same bound, and the candle GEMM too.
        let xt = Tensor::from_vec(x.clone(), (t, cols), &Device::Cpu).unwrap();
        let dense = crate::ops::linear(&xt, &m.to_tensor().unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for k in 0..y.len() {
            assert!((y[k] as f64 - dense[k] as f64).abs() <= 2.0 * tol * norm[k] + 1e-30);
        }
        for r in 0..rows {
            let mut ys = vec![0f32; t];
            for (g, chunk) in ys.chunks_mut(4).enumerate() {
                portable_dot(
                    m.row_bytes(r),
                    elem,
                    &x[g * 4 * cols..(g * 4 + chunk.len()) * cols],
                    cols,
                    chunk,
                );
            }
            for (j, yj) in ys.iter().enumerate() {
                let k = j * rows + r;
                assert!((*yj as f64 - expected[k]).abs() <= tol * norm[k] + 1e-30);
            }
        }
    }

    #[test]
    fn matvec_matches_a_plain_f64_sum_for_odd_sizes_and_every_storage() {
        for elem in [Elem::Bf16, Elem::F16, Elem::F32] {
            for (rows, cols) in [
                (1, 1),
                (3, 15),
                (5, 16),
                (7, 17),
                (4, 31),
                (6, 32),
                (9, 33),
                (33, 100),
                (130, 257),
            ] {
                for t in [1, 2, 3, 4, 5, 8] {
                    // An odd byte offset: the kernel's loads must not assume alignment.
                    check(rows, cols, t, elem, 1);
                }
            }
        }
    }

    #[test]
    fn matvec_splits_rows_across_threads_without_changing_a_bit() {
        // Many small rows: several tasks, each on whichever thread; the result must equal a one-thread run.
        let (rows, cols) = (3000, 40);
        let map = store(&values(rows * cols, 3), Elem::Bf16, 0);
        let m = MappedMatrix::new(&map, 0, rows, cols, Elem::Bf16).unwrap();
        let x = values(2 * cols, 5);
        let many = matvec(&m, &x, 2);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let one = pool.install(|| matvec(&m, &x, 2));
        assert_eq!(
            many.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            one.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        check(rows, cols, 2, Elem::Bf16, 0);
    }

    #[test]
    fn the_gemm_path_and_the_lookup_read_the_stored_values_exactly() {
        let (rows, cols) = (37, 24);
        let wv = values(rows * cols, 11);
        let map = store(&wv, Elem::Bf16, 3);
        let m = MappedMatrix::new(&map, 3, rows, cols, Elem::Bf16).unwrap();
        let widened: Vec<f32> = wv
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        assert_eq!(m.rows_f32(0, rows), widened);
        let g = m.gather(&[5, 0, 36]).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(g[0], widened[5 * cols..6 * cols]);
        assert_eq!(g[2], widened[36 * cols..37 * cols]);
        assert!(m.gather(&[37]).is_err());
        // T above the matvec limit: the blocked GEMM equals candle's product of the widened matrix, and the
        // prompt kernel, where the CPU runs it, the matvec.
        let t = MATVEC_MAX_TOKENS + 3;
        let xs = values(t * cols, 2);
        let x = Tensor::from_vec(xs.clone(), (t, cols), &Device::Cpu).unwrap();
        let dense = Tensor::from_vec(widened, (rows, cols), &Device::Cpu).unwrap();
        let a = m
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let block = (BLOCK_ELEMENTS / cols).max(1);
        let gemm = blocked_gemm(&x, rows, cols, block, |s, out| widen_rows(&m, s, out)).unwrap();
        let candle = crate::ops::linear(&x, &dense).unwrap();
        assert_eq!(
            gemm.to_vec2::<f32>().unwrap(),
            candle.to_vec2::<f32>().unwrap()
        );
        let expected = match PromptKernel::detect() {
            PromptKernel::Avx512 => matvec(&m, &xs, t),
            PromptKernel::Gemm => candle.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&expected));
        assert!(MappedMatrix::new(&map, 4, rows, cols, Elem::Bf16).is_err());
    }
}
