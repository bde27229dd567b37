//! What [`super::Arithmetic::LlamaCpp`] needs of each GGUF weight: its `vec_dot_type`, the order of its stored
//! columns (llama.cpp quantizes the activations in blocks of the file's column order, which the converter changed
//! for `out_proj`), and for Q4_1/Q5_1 weights the minimum of every block (their dot with Q8_1 activations adds
//! `m · s` per block: [`super::q8_1_residuals`]), under the checkpoint's names and in the checkpoint's row order.

use super::VecDotType;
use crate::config::Config;
use crate::error::Result;
use crate::gguf::GgmlType;
use crate::gguf::file::{GgufFile, TensorInfo};
use crate::gguf::model::layout::{Heads, undo};
use crate::gguf::model::packed::orders;
use crate::gguf::model::{Layout, Target, target};
use half::f16;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// How llama.cpp's CPU converts the input of one weight's matrix products.
#[derive(Debug, Clone)]
pub struct InputRounding {
    /// The type the activations are rounded through.
    pub ty: VecDotType,
    /// Q4_1/Q5_1 weights: the minimum `m` of every 32-value block, `[out, in / 32]` row-major in the checkpoint's row
    /// order and the file's block order; `None` for the other types.
    pub mins: Option<Arc<[f32]>>,
    /// Column `c` of the checkpoint's weight is column `col_order[c]` of the file's (`None`: the same order). The
    /// converter reorders `linear_attn.out_proj`'s columns by value head (`ssm_out`); llama.cpp's activations are in
    /// the file's order, so its blocks of 32 (or 256) group other values than the checkpoint's order would whenever
    /// a value head is narrower than a block (`Dv = 16`: one block holds two heads).
    pub col_order: Option<Arc<[usize]>>,
}

/// The [`InputRounding`] of every weight of the GGUF file at `path` (a model of `config`), under the checkpoint's
/// names (`model.layers.0.mlp.gate_proj.weight`; every expert of a stacked tensor). A weight with no CPU product is
/// recorded as an error, reported if the run uses it as a matrix.
pub fn input_roundings(
    path: &Path,
    config: &Config,
) -> Result<HashMap<String, std::result::Result<InputRounding, String>>> {
    let file = GgufFile::open(path)?;
    let heads = Heads {
        hk: config.linear_num_key_heads,
        hv: config.linear_num_value_heads,
        dk: config.linear_key_head_dim,
        dv: config.linear_value_head_dim,
    };
    let mut out = HashMap::new();
    for info in &file.tensors {
        let named = |e: String| format!("{}: {e}", info.name);
        match target(&info.name, config.num_layers()) {
            Ok(Target::One(name, layout)) => {
                let r = rounding(&file, info, Some(layout), heads).map_err(named);
                out.insert(name, r.map(|mut v| v.remove(0)));
            }
            Ok(Target::Experts { layer, proj }) => match rounding(&file, info, None, heads) {
                Ok(per_expert) => {
                    for (e, r) in per_expert.into_iter().enumerate() {
                        out.insert(
                            format!("model.layers.{layer}.mlp.experts.{e}.{proj}.weight"),
                            Ok(r),
                        );
                    }
                }
                Err(e) => {
                    let experts = info.dims.get(2).copied().unwrap_or(0);
                    for x in 0..experts {
                        out.insert(
                            format!("model.layers.{layer}.mlp.experts.{x}.{proj}.weight"),
                            Err(named(e.clone())),
                        );
                    }
                }
            },
            Ok(Target::Skip) | Err(_) => {}
        }
    }
    Ok(out)
}

/// One tensor's rounding; a stacked one (`layout` `None`, `ne = [in, out, E]`) gives one per expert.
fn rounding(
    file: &GgufFile,
    info: &TensorInfo,
    layout: Option<Layout>,
    heads: Heads,
) -> std::result::Result<Vec<InputRounding>, String> {
    let ty = VecDotType::of(info.ty)?;
    let experts = match layout {
        Some(_) => 1,
        None => info.dims.get(2).copied().unwrap_or(1) as usize,
    };
    let (minimums, block_bytes) = match info.ty {
        GgmlType::Q4_1 => (true, 20),
        GgmlType::Q5_1 => (true, 24),
        _ => (false, 0),
    };
    let cols = info.dims.first().copied().unwrap_or(0) as usize;
    let rows = info.dims.get(1).copied().unwrap_or(1) as usize;
    // The converter moves whole rows, or leaves a tensor's order, but for `out_proj`, whose columns it reorders:
    // the order in which llama.cpp's activations reach that weight.
    let col_order = match layout {
        Some(l @ Layout::ValueColumns) => orders(l, rows, cols, heads)?.1.map(Arc::from),
        _ => None,
    };
    if !minimums {
        return Ok(vec![
            InputRounding {
                ty,
                mins: None,
                col_order
            };
            experts
        ]);
    }
    let blocks = cols / 32;
    // Each block starts with its f16 scale `d` and minimum `m`.
    let bytes = file.bytes(info);
    let mut all: Vec<f32> = bytes
        .chunks_exact(block_bytes)
        .map(|b| f16::from_le_bytes([b[2], b[3]]).to_f32())
        .collect();
    if all.len() != experts * rows * blocks {
        return Err(format!(
            "{} bytes do not hold {experts}×{rows}×{blocks} {:?} blocks",
            bytes.len(),
            info.ty
        ));
    }
    if let Some(layout) = layout {
        match layout {
            Layout::Plain
            | Layout::OneRow
            | Layout::QkvRows
            | Layout::ValueRows
            | Layout::HeadRows => {
                undo(layout, &mut all, &[rows, blocks], heads)?;
            }
            // The rows stay; the blocks stay the file's, as the activations are rounded in the file's order.
            Layout::ValueColumns => {}
            other => {
                return Err(format!(
                    "a {:?} weight whose converter change is {other:?} is not a matrix",
                    info.ty
                ));
            }
        }
    }
    Ok(all
        .chunks_exact(rows * blocks)
        .map(|m| InputRounding {
            ty,
            mins: Some(m.into()),
            col_order: col_order.clone(),
        })
        .collect())
}
