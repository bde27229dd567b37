//! The SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`.

use crate::config::Config;
use crate::error::Result;
use crate::ops::{linear, silu};
use crate::schema::{Param, Schema};
use crate::weights::WeightStore;
use candle_core::Tensor;

/// Weights of `mlp.{gate_proj, up_proj, down_proj}`.
#[derive(Debug, Clone)]
pub struct Mlp {
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
}

impl Mlp {
    /// Loads layer `layer`'s `mlp.*` tensors.
    pub fn load(w: &WeightStore, layer: usize, c: &Config) -> Result<Self> {
        let s = Schema::new(c);
        Ok(Mlp {
            gate_proj: w.load(&s.layer(layer, Param::GateProj))?,
            up_proj: w.load(&s.layer(layer, Param::UpProj))?,
            down_proj: w.load(&s.layer(layer, Param::DownProj))?,
        })
    }

    /// `x`: `[T, hidden]` → `[T, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = (silu(&linear(x, &self.gate_proj)?)? * linear(x, &self.up_proj)?)?;
        linear(&h, &self.down_proj)
    }
}
