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
        Self::load_params(
            w,
            layer,
            c,
            [Param::GateProj, Param::UpProj, Param::DownProj],
        )
    }

    /// Loads a SwiGLU block of layer `layer` from the given gate, up and down projections (an MoE expert's, the
    /// shared expert's).
    pub fn load_params(
        w: &WeightStore,
        layer: usize,
        c: &Config,
        params: [Param; 3],
    ) -> Result<Self> {
        let s = Schema::new(c);
        let [gate, up, down] = params;
        Ok(Mlp {
            gate_proj: w.linear(&s.layer(layer, gate))?,
            up_proj: w.linear(&s.layer(layer, up))?,
            down_proj: w.linear(&s.layer(layer, down))?,
        })
    }

    /// Hands back the pages of its weights read in place ([`Linear::release_pages`]).
    pub fn release_pages(&self) {
        for l in [&self.gate_proj, &self.up_proj, &self.down_proj] {
            l.release_pages();
        }
    }

    /// `x`: `[T, hidden]` → `[T, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = (silu(&self.gate_proj.forward(x)?)? * self.up_proj.forward(x)?)?;
        self.down_proj.forward(&h)
    }
}
