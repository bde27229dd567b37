//! The SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`.

use crate::error::Result;
use crate::ops::{linear, silu};
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
    /// Loads `{prefix}.gate_proj/up_proj/down_proj.weight`.
    pub fn load(w: &WeightStore, prefix: &str, hidden: usize, inner: usize) -> Result<Self> {
        Ok(Mlp {
            gate_proj: w.decoder(&format!("{prefix}.gate_proj.weight"), &[inner, hidden])?,
            up_proj: w.decoder(&format!("{prefix}.up_proj.weight"), &[inner, hidden])?,
            down_proj: w.decoder(&format!("{prefix}.down_proj.weight"), &[hidden, inner])?,
        })
    }

    /// `x`: `[T, hidden]` → `[T, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = (silu(&linear(x, &self.gate_proj)?)? * linear(x, &self.up_proj)?)?;
        linear(&h, &self.down_proj)
    }
}
