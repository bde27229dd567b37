//! The evaluator's matrix products: the plain one (every term in a triple loop, the specification), the tiled one
//! ([`super::kernel`], the same sums to the last bit), and the products and gathers that read a checkpoint matrix
//! where it lies ([`super::weights`]).

use super::Kernels;
use super::eval::Evaluator;
use super::kernel::{Dense, Rows, products};
use super::numeric::Accumulation;
use super::ops::transpose;
use super::value::{V, Val, broadcast, broadcast_index};
use super::weights::{Form, Offset, Packed, Weight};
use crate::error::{Error, Result};
use std::borrow::Cow;

/// `v` with its last two dims swapped.
fn swap_last(v: &V) -> Result<V> {
    let r = v.shape.len();
    let mut perm: Vec<usize> = (0..r).collect();
    perm.swap(r - 2, r - 1);
    transpose(v, &perm)
}

/// The sizes of a batched product `a` `[.., m, k]` times `b` (`[.., n, k]` when `b_by_rows`, else `[.., k, n]`),
/// its broadcast batch dims and, per batch entry, the entry of `a` and of `b` it reads.
struct Batched {
    m: usize,
    k: usize,
    n: usize,
    batch: Vec<usize>,
    ia: Vec<usize>,
    ib: Vec<usize>,
}

fn batched(a: &V, b: &V, b_by_rows: bool) -> Result<Batched> {
    let (ra, rb) = (a.shape.len(), b.shape.len());
    let (m, k) = (a.shape[ra - 2], a.shape[ra - 1]);
    let (mut k2, mut n) = (b.shape[rb - 2], b.shape[rb - 1]);
    if b_by_rows {
        std::mem::swap(&mut k2, &mut n);
    }
    if k != k2 {
        return Err(Error::Interface(format!(
            "MatMul {:?} x {:?}",
            a.shape, b.shape
        )));
    }
    let batch = broadcast(&a.shape[..ra - 2], &b.shape[..rb - 2])?;
    let ia = broadcast_index(&a.shape[..ra - 2], &batch);
    let ib = broadcast_index(&b.shape[..rb - 2], &batch);
    Ok(Batched {
        m,
        k,
        n,
        batch,
        ia,
        ib,
    })
}

impl Evaluator {
    /// `a @ b` with optional transposes of the last two dims and broadcast batch dims: each term rounded to the
    /// storage format before it is summed (the accumulation as the model says), the result rounded by the caller.
    pub(super) fn matmul(&self, a: &V, b: &V, ta: bool, tb: bool) -> Result<V> {
        if a.shape.len() < 2 || b.shape.len() < 2 {
            return Err(Error::Interface(format!(
                "MatMul {:?} x {:?}: both operands need two dims",
                a.shape, b.shape
            )));
        }
        if self.kernels == Kernels::Plain {
            return self.matmul_plain(a, b, ta, tb);
        }
        // The tiled product reads the right operand by rows of the result's columns: `[.., n, k]`.
        let a = if ta { swap_last(a)? } else { a.clone() };
        let b = if tb { b.clone() } else { swap_last(b)? };
        let Batched {
            m,
            k,
            n,
            batch,
            ia,
            ib,
        } = batched(&a, &b, true)?;
        let (av, bv) = (a.floats()?, b.floats()?);
        let mut out = Vec::with_capacity(ia.len() * m * n);
        for (&pa, &pb) in ia.iter().zip(&ib) {
            let a0 = &av[pa * m * k..(pa + 1) * m * k];
            let b0 = &bv[pb * n * k..(pb + 1) * n * k];
            out.extend(products(&self.model, a0, m, k, n, &Dense(b0, k))?);
        }
        let mut shape = batch;
        shape.extend([m, n]);
        Ok(Val::f(shape, out))
    }

    /// The plain product: the specification the tiled one is held to.
    fn matmul_plain(&self, a: &V, b: &V, ta: bool, tb: bool) -> Result<V> {
        let (a, b) = (
            if ta { swap_last(a)? } else { a.clone() },
            if tb { swap_last(b)? } else { b.clone() },
        );
        let Batched {
            m,
            k,
            n,
            batch,
            ia,
            ib,
        } = batched(&a, &b, false)?;
        let (av, bv) = (a.floats()?, b.floats()?);
        let exact = self.model.is_exact_f32();
        let acc_storage = self.model.accumulation == Accumulation::Storage;
        let mut out = Vec::with_capacity(ia.len() * m * n);
        for (&pa, &pb) in ia.iter().zip(&ib) {
            let a0 = &av[pa * m * k..(pa + 1) * m * k];
            let b0 = &bv[pb * k * n..(pb + 1) * k * n];
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0f32;
                    for kk in 0..k {
                        let p = a0[i * k + kk] * b0[kk * n + j];
                        if exact {
                            acc += p;
                        } else {
                            acc += self.model.round(p);
                            if acc_storage {
                                acc = self.model.round(acc);
                            }
                        }
                    }
                    out.push(acc);
                }
            }
        }
        let mut shape = batch;
        shape.extend([m, n]);
        Ok(Val::f(shape, out))
    }

    /// The bytes at `(offset, size)` of the graph's `.bin`: borrowed from its mapping or from the graph.
    fn bytes(&self, (offset, size): (usize, usize)) -> Result<Cow<'_, [u8]>> {
        match &self.map {
            Some(map) => map
                .get(offset..offset + size)
                .map(Cow::Borrowed)
                .ok_or_else(|| {
                    Error::Interface(format!(
                        "{size} bytes at offset {offset} lie outside the mapped .bin ({} bytes)",
                        map.len()
                    ))
                }),
            None => self.graph.bin_bytes(offset, size),
        }
    }

    /// Runs `f` on the matrix `w` over its bytes, then hands the mapped pages it read back to the page cache (a
    /// process holds one matrix of a graph resident at a time, not the whole `.bin`).
    fn with_weight<T>(&self, w: &Weight, f: impl FnOnce(&Packed<'_>) -> Result<T>) -> Result<T> {
        let scales_at = match w.form {
            Form::Codes { scales, .. } => scales,
            Form::F32 | Form::F16 => (0, 0),
        };
        let (data, scales) = (self.bytes(w.data)?, self.bytes(scales_at)?);
        let packed = Packed {
            weight: w,
            data: &data,
            scales: &scales,
        };
        packed.check()?;
        let out = f(&packed);
        if let Some(map) = &self.map {
            for (offset, size) in [w.data, scales_at] {
                // SAFETY: a read-only shared mapping of a file: dropped pages are read again from the file.
                let _ = unsafe {
                    map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, size)
                };
            }
        }
        out
    }

    /// `x @ wᵀ` for a checkpoint matrix `w` `[n, k]` read where it lies: `[.., k]` → `[.., n]`. For a stack of
    /// matrices `[E, n, k]` (an MoE block's experts), the batched product with `x`'s batch dims broadcast against
    /// `[E]`: `[.., m, k]` → `[.., E (broadcast), m, n]`, each expert's matrix read as rows of the stack.
    pub(super) fn weight_product(&self, x: &V, w: &Weight) -> Result<V> {
        let r = x.shape.len();
        if r < 2 || x.shape[r - 1] != w.cols {
            return Err(Error::Interface(format!(
                "MatMul {:?} x [{}, {}, {}]ᵀ",
                x.shape, w.experts, w.rows, w.cols
            )));
        }
        let xs = x.floats()?;
        if w.experts == 1 {
            let m = xs.len() / w.cols.max(1);
            let out = self.with_weight(w, |p| products(&self.model, xs, m, w.cols, w.rows, p))?;
            let mut shape = x.shape[..r - 1].to_vec();
            shape.push(w.rows);
            return Ok(Val::f(shape, out));
        }
        let (m, k, n) = (x.shape[r - 2], w.cols, w.rows);
        let batch = broadcast(&x.shape[..r - 2], &[w.experts])?;
        let ia = broadcast_index(&x.shape[..r - 2], &batch);
        let ie = broadcast_index(&[w.experts], &batch);
        let out = self.with_weight(w, |p| {
            let mut out = Vec::with_capacity(ia.len() * m * n);
            for (&a, &e) in ia.iter().zip(&ie) {
                let a0 = &xs[a * m * k..(a + 1) * m * k];
                out.extend(products(&self.model, a0, m, k, n, &Offset(p, e * n))?);
            }
            Ok(out)
        })?;
        let mut shape = batch;
        shape.extend([m, n]);
        Ok(Val::f(shape, out))
    }

    /// The rows `indices` of a checkpoint matrix `w` (a `Gather` on axis 0): `indices.shape + [cols]`; of a stack
    /// `[E, rows, cols]`, whole matrices: `indices.shape + [rows, cols]`.
    pub(super) fn weight_gather(&self, w: &Weight, indices: &V) -> Result<V> {
        let idx = indices.ints()?;
        let (dim, per) = match w.experts {
            1 => (w.rows, 1),
            e => (e, w.rows),
        };
        let size = per * w.cols;
        let mut out = vec![0f32; idx.len() * size];
        self.with_weight(w, |p| {
            for (&i, o) in idx.iter().zip(out.chunks_exact_mut(size.max(1))) {
                let i = if i < 0 { i + dim as i64 } else { i };
                if !(0..dim as i64).contains(&i) {
                    return Err(Error::Interface(format!(
                        "Gather index {i} outside 0..{dim}"
                    )));
                }
                let i = i as usize;
                self.model_rows(p, i * per, (i + 1) * per, o)?;
            }
            Ok(())
        })?;
        let mut shape = indices.shape.clone();
        if w.experts > 1 {
            shape.push(w.rows);
        }
        shape.push(w.cols);
        Ok(Val::f(shape, out))
    }

    /// `x @ wᵀ` for the matrices of the stack `w` `[E, n, k]` chosen by `indices` (`batch`, `[T, k]` in an MoE
    /// block), as `MatMul(x, Reshape(Gather(w, indices)), transpose_b)` computes it: `x` `[.., m, k]` with its batch
    /// dims broadcast against `batch` → `[.., m, n]`. Each chosen expert's matrix is decoded once, for all the rows
    /// that chose it; every row's products are the ones the gathered matrices give (the kernels' sums do not depend
    /// on the rows computed beside them).
    pub(super) fn gathered_product(
        &self,
        x: &V,
        w: &Weight,
        indices: &V,
        batch: &[usize],
    ) -> Result<V> {
        let r = x.shape.len();
        if r < 2 || x.shape[r - 1] != w.cols {
            return Err(Error::Interface(format!(
                "MatMul {:?} x gathered [{}, {}]ᵀ",
                x.shape, w.rows, w.cols
            )));
        }
        let idx = indices.ints()?;
        if idx.len() != batch.iter().product::<usize>() {
            return Err(Error::Interface(format!(
                "{} expert indices for gathered matrices {batch:?}",
                idx.len()
            )));
        }
        let (m, k, n) = (x.shape[r - 2], w.cols, w.rows);
        let out_batch = broadcast(&x.shape[..r - 2], batch)?;
        let ia = broadcast_index(&x.shape[..r - 2], &out_batch);
        let ie = broadcast_index(batch, &out_batch);
        let mut by_expert: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for (b, &i) in ie.iter().enumerate() {
            let e = idx[i];
            let e = if e < 0 { e + w.experts as i64 } else { e };
            if !(0..w.experts as i64).contains(&e) {
                return Err(Error::Interface(format!(
                    "Gather index {} outside 0..{}",
                    idx[i], w.experts
                )));
            }
            by_expert.entry(e as usize).or_default().push(b);
        }
        let xs = x.floats()?;
        let mut out = vec![0f32; ia.len() * m * n];
        self.with_weight(w, |p| {
            for (&e, entries) in &by_expert {
                let mut a = Vec::with_capacity(entries.len() * m * k);
                for &b in entries {
                    a.extend_from_slice(&xs[ia[b] * m * k..(ia[b] + 1) * m * k]);
                }
                let y = products(&self.model, &a, entries.len() * m, k, n, &Offset(p, e * n))?;
                for (j, &b) in entries.iter().enumerate() {
                    out[b * m * n..(b + 1) * m * n].copy_from_slice(&y[j * m * n..(j + 1) * m * n]);
                }
            }
            Ok(())
        })?;
        let mut shape = out_batch;
        shape.extend([m, n]);
        Ok(Val::f(shape, out))
    }

    /// Rows `r0..r1` of `p` as the model stores them.
    fn model_rows(&self, p: &Packed<'_>, r0: usize, r1: usize, out: &mut [f32]) -> Result<()> {
        use super::kernel::{BF16, F16, F32};
        use super::numeric::Storage;
        match (self.model.storage, self.model.flush_subnormals) {
            (Storage::F16, true) => p.rows::<F16, true>(r0, r1, out),
            (Storage::F16, false) => p.rows::<F16, false>(r0, r1, out),
            (Storage::Bf16, true) => p.rows::<BF16, true>(r0, r1, out),
            (Storage::Bf16, false) => p.rows::<BF16, false>(r0, r1, out),
            (Storage::F32, true) => p.rows::<F32, true>(r0, r1, out),
            (Storage::F32, false) => p.rows::<F32, false>(r0, r1, out),
        }
    }
}
