//! The inverses of the converter's changes, one function a change (see the table of [`super`]).

use super::Layout;

/// The linear attention's head counts and dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    /// Key heads.
    pub hk: usize,
    /// Value heads (a multiple of `hk`).
    pub hv: usize,
    /// Key head dimension.
    pub dk: usize,
    /// Value head dimension.
    pub dv: usize,
}

/// Undoes `layout` on `values` of GGUF (PyTorch-order) shape `shape`; returns the checkpoint's shape.
pub fn undo(
    layout: Layout,
    values: &mut [f32],
    shape: &[usize],
    heads: Heads,
) -> std::result::Result<Vec<usize>, String> {
    let row_len = |rows: usize| -> std::result::Result<usize, String> {
        match shape {
            [r, c] if *r == rows => Ok(*c),
            [r] if *r == rows => Ok(1),
            _ => Err(format!(
                "shape {shape:?} does not have the {rows} rows the config implies"
            )),
        }
    };
    match layout {
        Layout::Plain => {}
        Layout::OneRow => {
            return match *shape {
                [n] | [1, n] => Ok(vec![1, n]),
                _ => Err(format!("shape {shape:?} is not one row")),
            };
        }
        Layout::PlusOne => minus_one(values),
        Layout::QkvRows => {
            let qk = 2 * heads.hk * heads.dk;
            let cols = row_len(qk + heads.hv * heads.dv)?;
            ungroup_rows(&mut values[qk * cols..], cols, heads, heads.dv);
        }
        Layout::ValueRows => {
            let cols = row_len(heads.hv * heads.dv)?;
            ungroup_rows(values, cols, heads, heads.dv);
        }
        Layout::HeadRows => {
            let cols = row_len(heads.hv)?;
            ungroup_rows(values, cols, heads, 1);
        }
        Layout::Decay => {
            row_len(heads.hv)?;
            ungroup_rows(values, 1, heads, 1);
            a_log(values)?;
        }
        Layout::Conv => {
            let qk = 2 * heads.hk * heads.dk;
            let k = row_len(qk + heads.hv * heads.dv)?;
            ungroup_rows(&mut values[qk * k..], k, heads, heads.dv);
            return Ok(vec![shape[0], 1, k]);
        }
        Layout::ValueColumns => {
            let [rows, cols] = *shape else {
                return Err(format!("shape {shape:?} is not a matrix"));
            };
            if cols != heads.hv * heads.dv {
                return Err(format!(
                    "shape {shape:?} does not have the {} columns the config implies",
                    heads.hv * heads.dv
                ));
            }
            for row in values.chunks_exact_mut(cols).take(rows) {
                ungroup_rows(row, 1, heads, heads.dv);
            }
        }
    }
    Ok(shape.to_vec())
}

/// `w = g - 1` for the GGUF's `g = 1 + w` (exact: see the module's notes).
pub fn minus_one(values: &mut [f32]) {
    for v in values {
        *v -= 1.0;
    }
}

/// Puts value heads back in the checkpoint's order, grouped by key head (`[k0: v0..v{r-1}, k1: ...]`), from
/// llama.cpp's tiled order (`[v0: k0..k{Hk-1}, v1: ...]`), `rows_per_head` rows of `cols` values a head: the
/// checkpoint's head `k·r + j` is the GGUF's `j·Hk + k`. Nothing moves when `Hk = Hv` (the converter changes
/// nothing then).
pub fn ungroup_rows(values: &mut [f32], cols: usize, heads: Heads, rows_per_head: usize) {
    if heads.hk == heads.hv || heads.hk == 0 {
        return;
    }
    let r = heads.hv / heads.hk;
    let head = rows_per_head * cols;
    let tiled = values[..heads.hv * head].to_vec();
    for k in 0..heads.hk {
        for j in 0..r {
            let to = (k * r + j) * head;
            let from = (j * heads.hk + k) * head;
            values[to..to + head].copy_from_slice(&tiled[from..from + head]);
        }
    }
}

/// `A_log` from `ssm_a = -exp(A_log)`: the f32 whose `-exp` in f32 is `ssm_a` exactly where one exists (the
/// neighbours of `ln(-ssm_a)` are tried), else `ln(-ssm_a)` rounded. A non-negative or non-finite `ssm_a` has
/// no `A_log`: an error.
pub fn a_log(values: &mut [f32]) -> std::result::Result<(), String> {
    for v in values {
        let a = *v;
        if !(a < 0.0 && a.is_finite()) {
            return Err(format!(
                "holds {a}, but ssm_a = -exp(A_log) is negative and finite"
            ));
        }
        let guess = (-(a as f64)).ln() as f32;
        let mut best = guess;
        let mut x = guess;
        for _ in 0..4 {
            x = next_down(x);
        }
        for _ in 0..9 {
            if -x.exp() == a {
                best = x;
                break;
            }
            x = next_up(x);
        }
        *v = best;
    }
    Ok(())
}

fn next_up(x: f32) -> f32 {
    if x == 0.0 {
        return f32::from_bits(1);
    }
    let bits = x.to_bits();
    f32::from_bits(if x > 0.0 { bits + 1 } else { bits - 1 })
}

fn next_down(x: f32) -> f32 {
    -next_up(-x)
}
