//! The small dense products of the DeltaNet kernels: `c += a b` on row-major slices in [`ROWS`] × [`COLS`] register
//! tiles, each output one chain of multiply-adds in increasing order, fused when `FMA` (the AVX2 build) and rounded
//! twice otherwise.

/// Rows of one register tile of [`gemm()`].
pub(super) const ROWS: usize = 4;
/// Columns of one register tile of [`gemm()`] (two AVX2 vectors).
pub(super) const COLS: usize = 16;

/// `a·b + c`, fused (one rounding) when `FMA`.
#[inline(always)]
pub(super) fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// Which part of a [`gemm()`] is known zero or not wanted.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Tri {
    /// Everything.
    Full,
    /// `a` is lower triangular (`a[i, p] = 0` for `p > i`): sums stop at the tile's last row.
    LowerA,
    /// Only `c[i, j]` with `j ≤ i` is wanted: tiles wholly above the diagonal are skipped (entries above the
    /// diagonal of the tiles computed hold partial garbage the caller ignores).
    LowerC,
}

/// `c += a b` for dense row-major `a` `[m, k]`, `b` `[k, n]`, `c` `[m, n]`. Each output is one chain of
/// multiply-adds over `p` in increasing order (so a tile and an edge give the same numbers), computed [`ROWS`] ×
/// [`COLS`] at a time in registers.
#[inline(always)]
pub(super) fn gemm<const FMA: bool>(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    (m, k, n): (usize, usize, usize),
    tri: Tri,
) {
    let mut i0 = 0;
    while i0 < m {
        let rows = ROWS.min(m - i0);
        // The inner length for these rows: a lower triangular `a` is zero past the last row's diagonal.
        let kend = if tri == Tri::LowerA {
            k.min(i0 + rows)
        } else {
            k
        };
        let mut j0 = 0;
        while j0 < n {
            if tri == Tri::LowerC && j0 >= i0 + rows {
                break;
            }
            let cols = COLS.min(n - j0);
            if rows == ROWS && cols == COLS {
                tile::<FMA>(kend, &a[i0 * k..], k, &b[j0..], n, &mut c[i0 * n + j0..], n);
            } else {
                for i in 0..rows {
                    let arow = &a[(i0 + i) * k..(i0 + i) * k + kend];
                    let crow = &mut c[(i0 + i) * n + j0..(i0 + i) * n + j0 + cols];
                    for (jj, cv) in crow.iter_mut().enumerate() {
                        let mut acc = *cv;
                        for (p, &av) in arow.iter().enumerate() {
                            acc = madd::<FMA>(av, b[p * n + j0 + jj], acc);
                        }
                        *cv = acc;
                    }
                }
            }
            j0 += cols;
        }
        i0 += rows;
    }
}

/// One full [`ROWS`] × [`COLS`] tile of [`gemm()`]: `c[r, :COLS] += Σ_{p<k} a[r, p] b[p, :COLS]`.
#[inline(always)]
fn tile<const FMA: bool>(
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    let mut acc = [[0f32; COLS]; ROWS];
    let arows: [&[f32]; ROWS] = std::array::from_fn(|r| &a[r * lda..r * lda + k]);
    for (r, accr) in acc.iter_mut().enumerate() {
        accr.copy_from_slice(&c[r * ldc..r * ldc + COLS]);
    }
    for p in 0..k {
        let bp: &[f32; COLS] = b[p * ldb..p * ldb + COLS].try_into().unwrap();
        for (accr, arow) in acc.iter_mut().zip(&arows) {
            let av = arow[p];
            for (x, &bv) in accr.iter_mut().zip(bp) {
                *x = madd::<FMA>(av, bv, *x);
            }
        }
    }
    for (r, accr) in acc.iter().enumerate() {
        c[r * ldc..r * ldc + COLS].copy_from_slice(accr);
    }
}
