//! Partial rotary position embedding with interleaved MRoPE sections, as graph ops (`reference::rope`): the angle
//! tables are computed in the graph from the `positions` input, so one graph serves text and multimodal positions.

use crate::error::Result;
use crate::ir::{ElemType, Graph, Unary, Value};
use reference::config::Config;
use reference::rope::Rope;

/// The cos/sin tables of one block's tokens, `[T, rotary_dim]` each (each frequency twice, rotate-half layout).
#[derive(Debug, Clone, Copy)]
pub struct RotaryTables {
    rotary_dim: usize,
    cos: Value,
    sin: Value,
}

/// The tables of `positions` `[3, T]` (i64 MRoPE rows): `angle[t, i] = position[row(i)][t] · inv_freq[i]`, as one
/// product of the positions with a `[3, rd/2]` matrix holding `inv_freq[i]` in the row frequency `i` reads.
pub fn tables(graph: &mut Graph, config: &Config, positions: Value) -> Result<RotaryTables> {
    let rope = Rope::new(config);
    let rd = rope.rotary_dim();
    let half = rd / 2;
    let mut select = vec![0f32; 3 * half];
    for i in 0..half {
        select[rope.row_of(i) * half + i] = rope.inv_freq(i) as f32;
    }
    let select = graph.const_f32(&select, &[3, half])?;
    let pos = graph.convert(positions, ElemType::F32)?;
    let angles = graph.matmul(pos, select, true, false)?; // [T, rd/2]
    let angles = graph.concat(&[angles, angles], 1)?; // [T, rd]
    Ok(RotaryTables {
        rotary_dim: rd,
        cos: graph.unary(Unary::Cos, angles)?,
        sin: graph.unary(Unary::Sin, angles)?,
    })
}

impl RotaryTables {
    /// Rotates the first `rotary_dim` dimensions of `x` `[T, heads, D]`; the rest pass through unchanged.
    pub fn apply(&self, graph: &mut Graph, x: Value) -> Result<Value> {
        let (t, d) = (graph.shape(x)[0], graph.shape(x)[2]);
        let rd = self.rotary_dim;
        let x_rot = graph.slice(x, 2, 0, rd)?;
        let x1 = graph.slice(x_rot, 2, 0, rd / 2)?;
        let x2 = graph.slice(x_rot, 2, rd / 2, rd / 2)?;
        let neg_x2 = graph.unary(Unary::Negative, x2)?;
        let rotated_half = graph.concat(&[neg_x2, x1], 2)?;
        let cos = graph.reshape(self.cos, &[t, 1, rd])?;
        let sin = graph.reshape(self.sin, &[t, 1, rd])?;
        let a = graph.mul(x_rot, cos)?;
        let b = graph.mul(rotated_half, sin)?;
        let out = graph.add(a, b)?;
        if rd == d {
            return Ok(out);
        }
        let pass = graph.slice(x, 2, rd, d - rd)?;
        graph.concat(&[out, pass], 2)
    }
}
