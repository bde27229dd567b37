//! The one walk over a GGUF's tensors onto the checkpoint's ([`split_with`]): each tensor's target (its checkpoint
//! name and layout, the experts of a stacked tensor each under its own name), its ggml type recorded once
//! ([`Split::types`]), and its values either decoded and undone ([`super::checkpoint_tensors`], every tensor) or,
//! for a store that keeps the matrices packed ([`split`]), left in the file as its ggml blocks when the layout moves
//! only whole rows, or only the columns within each row: a [`PackedTensor`] (where its rows are, their type, the row
//! and column orders that undo the converter's reorders). The rest (norms, the convolution, the decay, biases:
//! small) is decoded and undone either way.
//!
//! The orders come from [`layout::undo`] itself, applied to the indices of the rows (or of the columns), so the
//! packed matrix's decoded rows are exactly the expanded tensor's: the inverses stay in one place.

use super::fault::Fault;
use super::layout::{self, Heads};
use super::{CheckpointTensor, Layout, Target, target, tensor_err, values};
use crate::config::Config;
use crate::error::Result;
use crate::gguf::GgmlType;
use crate::gguf::file::GgufFile;

/// A checkpoint matrix held as a GGUF tensor's blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedTensor {
    /// The checkpoint's name (`model.layers.0.linear_attn.in_proj_qkv.weight`, an expert's own name).
    pub name: String,
    /// The GGUF tensor it is read from.
    pub gguf_name: String,
    /// Its blocks' type.
    pub ty: GgmlType,
    /// Where its first row starts in the file.
    pub start: usize,
    /// The checkpoint's `[rows, cols]`.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Row `r` of the checkpoint's matrix is stored row `row_order[r]` (`None`: in order).
    pub row_order: Option<Vec<usize>>,
    /// Column `c` of the checkpoint's row is column `col_order[c]` of the stored row (`None`: in order).
    pub col_order: Option<Vec<usize>>,
}

/// A GGUF's tensors as the weight store serves them in an f32 run.
pub struct Split {
    /// The matrices kept packed.
    pub packed: Vec<PackedTensor>,
    /// The other tensors, decoded, in the checkpoint's names, shapes and layouts.
    pub decoded: Vec<CheckpointTensor>,
    /// Every checkpoint tensor's GGUF type (packed or decoded).
    pub types: Vec<(String, GgmlType)>,
}

/// An order of indices (`None`: as they are).
type Order = Option<Vec<usize>>;

/// Whether `layout` on a `shape` tensor moves whole rows or the columns within rows only (values unchanged): a
/// matrix, or the one row a 1-D `[n]` holds as `[1, n]`.
fn packable(layout: Layout, shape: &[usize]) -> bool {
    if layout == Layout::OneRow {
        return matches!(shape, [_] | [1, _]);
    }
    shape.len() == 2
        && matches!(
            layout,
            Layout::Plain
                | Layout::QkvRows
                | Layout::ValueRows
                | Layout::HeadRows
                | Layout::ValueColumns
        )
}

/// The order [`layout::undo`] puts `n` indices in (along the rows when `rows`, else along one row's columns):
/// `None` when it moves none.
fn order_of(
    layout: Layout,
    n: usize,
    rows: bool,
    heads: Heads,
) -> std::result::Result<Order, String> {
    if n > 1 << 24 {
        return Err(format!(
            "{n} indices are too many to reorder through f32 values"
        ));
    }
    let mut idx: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let shape = if rows { [n, 1] } else { [1, n] };
    layout::undo(layout, &mut idx, &shape, heads)?;
    let order: Vec<usize> = idx.iter().map(|&v| v as usize).collect();
    Ok((!order.iter().enumerate().all(|(i, &o)| i == o)).then_some(order))
}

/// The row order and column order that undo `layout` on a `[rows, cols]` matrix (checked against the config's
/// heads as [`layout::undo`] checks the values).
pub(crate) fn orders(
    layout: Layout,
    rows: usize,
    cols: usize,
    heads: Heads,
) -> std::result::Result<(Order, Order), String> {
    match layout {
        Layout::Plain | Layout::OneRow => Ok((None, None)),
        // `undo` checks the dimension it reorders against the heads, as it does on the values.
        Layout::ValueColumns => Ok((None, order_of(layout, cols, false, heads)?)),
        _ => Ok((order_of(layout, rows, true, heads)?, None)),
    }
}

/// The GGUF's tensors split into the matrices kept packed and the rest decoded (see the module docs), checked
/// against `config`'s dimensions as [`super::checkpoint_tensors`] checks them.
pub fn split(file: &GgufFile, config: &Config) -> Result<Split> {
    split_with(file, config, None, true)
}

/// Every tensor of the file onto the checkpoint's (see the module docs): the matrices kept packed when `pack`, else
/// every tensor decoded; `fault` planted in the layouts.
pub(crate) fn split_with(
    file: &GgufFile,
    config: &Config,
    fault: Option<Fault>,
    pack: bool,
) -> Result<Split> {
    let heads = Heads {
        hk: config.linear_num_key_heads,
        hv: config.linear_num_value_heads,
        dk: config.linear_key_head_dim,
        dv: config.linear_value_head_dim,
    };
    let mut out = Split {
        packed: Vec::new(),
        decoded: Vec::new(),
        types: Vec::new(),
    };
    for info in &file.tensors {
        let target =
            target(&info.name, config.num_layers()).map_err(|e| tensor_err(file, &info.name, e))?;
        let shape = info.torch_shape();
        let err = |message: String| tensor_err(file, &info.name, message);
        let row_bytes = |cols: usize| -> Result<usize> {
            info.ty
                .row_bytes(cols as u64)
                .map(|b| b as usize)
                .map_err(err)
        };
        match target {
            Target::Skip => {}
            Target::One(name, layout) => {
                let layout = fault.map_or(layout, |f| f.layout(layout));
                out.types.push((name.clone(), info.ty));
                if pack && packable(layout, &shape) {
                    let (rows, cols) = match *shape.as_slice() {
                        [rows, cols] => (rows, cols),
                        // llama-quantize writes the shared-expert gate `[H]` where the converter wrote `[1, H]`.
                        [cols] => (1, cols),
                        _ => return Err(err(format!("shape {shape:?} is not a matrix"))),
                    };
                    let (row_order, col_order) = orders(layout, rows, cols, heads).map_err(err)?;
                    row_bytes(cols)?;
                    out.packed.push(PackedTensor {
                        name,
                        gguf_name: info.name.clone(),
                        ty: info.ty,
                        start: info.start as usize,
                        rows,
                        cols,
                        row_order,
                        col_order,
                    });
                } else {
                    let mut values = values(file, info)?;
                    let shape = layout::undo(layout, &mut values, &shape, heads).map_err(err)?;
                    out.decoded.push(CheckpointTensor {
                        name,
                        shape,
                        values,
                    });
                }
            }
            Target::Experts { layer, proj } => {
                let &[experts, rows, cols] = shape.as_slice() else {
                    return Err(err(format!(
                        "stacked experts are [E, out, in], not {shape:?}"
                    )));
                };
                let expert_bytes = rows * row_bytes(cols)?;
                let values = if pack {
                    Vec::new()
                } else {
                    values(file, info)?
                };
                for e in 0..experts {
                    let name = format!("model.layers.{layer}.mlp.experts.{e}.{proj}.weight");
                    out.types.push((name.clone(), info.ty));
                    if pack {
                        out.packed.push(PackedTensor {
                            name,
                            gguf_name: info.name.clone(),
                            ty: info.ty,
                            start: info.start as usize + e * expert_bytes,
                            rows,
                            cols,
                            row_order: None,
                            col_order: None,
                        });
                    } else {
                        out.decoded.push(CheckpointTensor {
                            name,
                            shape: vec![rows, cols],
                            values: values[e * rows * cols..(e + 1) * rows * cols].to_vec(),
                        });
                    }
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADS: Heads = Heads {
        hk: 2,
        hv: 6,
        dk: 3,
        dv: 2,
    };

    /// Each order, applied to a matrix's rows (or each row's columns), gives what `undo` gives on its values.
    #[test]
    fn the_orders_are_undo_on_the_values() {
        let qk = 2 * HEADS.hk * HEADS.dk;
        let cases = [
            (Layout::QkvRows, qk + HEADS.hv * HEADS.dv, 3),
            (Layout::ValueRows, HEADS.hv * HEADS.dv, 5),
            (Layout::HeadRows, HEADS.hv, 4),
            (Layout::ValueColumns, 3, HEADS.hv * HEADS.dv),
        ];
        for (layout, rows, cols) in cases {
            let stored: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let mut expected = stored.clone();
            layout::undo(layout, &mut expected, &[rows, cols], HEADS).unwrap();
            assert_ne!(expected, stored, "{layout:?} moves something");
            let (row_order, col_order) = orders(layout, rows, cols, HEADS).unwrap();
            let mut got = Vec::new();
            for r in 0..row_order.as_ref().map_or(rows, |o| o.len()) {
                let s = row_order.as_ref().map_or(r, |o| o[r]);
                let row = &stored[s * cols..(s + 1) * cols];
                match &col_order {
                    Some(o) => got.extend(o.iter().map(|&c| row[c])),
                    None => got.extend_from_slice(row),
                }
            }
            assert_eq!(got, expected, "{layout:?}");
        }
        assert_eq!(orders(Layout::Plain, 7, 3, HEADS).unwrap(), (None, None));
        // As many key as value heads: nothing moves, no order kept.
        let same = Heads { hv: 2, ..HEADS };
        assert_eq!(
            orders(Layout::ValueRows, 2 * HEADS.dv, 3, same).unwrap(),
            (None, None)
        );
    }

    #[test]
    fn a_shape_the_heads_do_not_fit_is_an_error() {
        assert!(orders(Layout::ValueRows, 5, 3, HEADS).is_err());
        assert!(orders(Layout::ValueColumns, 3, 5, HEADS).is_err());
    }
}
