//! The SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`.

use crate::config::Config;
use crate::error::Result;
use crate::linear::Linear;
use crate::ops::silu;
use crate::schema::{Param, Schema};
use crate::weights::WeightStore;
use candle_core::Tensor;

/// Weights of `mlp.{gate_proj, up_proj, down_proj}`.
#[derive(Debug, Clone)]
pub struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    /// Loads layer `layer`'s `mlp.*` tensors.
    pub fn load(w: &WeightStore, layer: usize, c: &Config) -> Result<Self> {
        let s = Schema::new(c);
        Ok(Mlp {
            gate_proj: w.linear(&s.layer(layer, Param::GateProj))?,
            up_proj: w.linear(&s.layer(layer, Param::UpProj))?,
            down_proj: w.linear(&s.layer(layer, Param::DownProj))?,
        })
    }

    /// `x`: `[T, hidden]` → `[T, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = (silu(&self.gate_proj.forward(x)?)? * self.up_proj.forward(x)?)?;
        self.down_proj.forward(&h)
    }
}
