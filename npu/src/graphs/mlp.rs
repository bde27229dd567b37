//! The SwiGLU feed-forward block as graph ops (`reference::mlp`): `down(silu(gate(x)) * up(x))`.

use super::Builder;
use super::ops::{linear, silu};
use crate::error::Result;
use crate::ir::{Graph, Value};
use reference::schema::Param;

/// The weights of `mlp.{gate_proj, up_proj, down_proj}` as graph constants.
pub struct Mlp {
    gate_proj: Value,
    up_proj: Value,
    down_proj: Value,
}

impl Mlp {
    /// Puts layer `layer`'s `mlp.*` tensors into `graph`.
    pub fn load(builder: &Builder, graph: &mut Graph, layer: usize) -> Result<Self> {
        Self::load_params(
            builder,
            graph,
            layer,
            [Param::GateProj, Param::UpProj, Param::DownProj],
        )
    }

    /// Puts a SwiGLU block of layer `layer` into `graph` from the given gate, up and down projections (the MoE
    /// block's shared expert's).
    pub fn load_params(
        builder: &Builder,
        graph: &mut Graph,
        layer: usize,
        params: [Param; 3],
    ) -> Result<Self> {
        let [gate, up, down] = params;
        Ok(Mlp {
            gate_proj: builder.layer_matrix(graph, layer, gate)?,
            up_proj: builder.layer_matrix(graph, layer, up)?,
            down_proj: builder.layer_matrix(graph, layer, down)?,
        })
    }

    /// `x`: `[T, hidden]` → `[T, hidden]`.
    pub fn forward(&self, graph: &mut Graph, x: Value) -> Result<Value> {
        let gate = linear(graph, x, self.gate_proj)?;
        let gate = silu(graph, gate)?;
        let up = linear(graph, x, self.up_proj)?;
        let h = graph.mul(gate, up)?;
        linear(graph, h, self.down_proj)
    }
}
