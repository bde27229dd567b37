//! The sparse MoE block of Qwen3.5-MoE (transformers' `Qwen3_5MoeSparseMoeBlock`), in place of the dense MLP:
//!
//! - router: `logits = x W_rᵀ` (`mlp.gate.weight` `[E, H]`), `p = softmax(logits)` in the run's dtype (f32, as
//!   transformers' `softmax(dtype=float)`; f64 in an f64 run), the `k` largest `p` in descending order, their
//!   weights `p / Σ p` over the chosen (always renormalised);
//! - each chosen expert `e`: `down_e(silu(gate_e(x)) · up_e(x))`, weighted and summed over the chosen experts in
//!   ascending expert order (as transformers' `index_add_` over the experts hit);
//! - the shared expert, an MLP of its own width, times `sigmoid(shared_expert_gate · x)` (`[1, H]`), added.
//!
//! Only the experts some token of the call chose are read, each once per call for all its tokens: a decode step
//! touches `k` of the `E` experts' weights. Each expert is a [`Mlp`] of [`Linear`]s, so the checkpoint's bf16 is
//! read in place and INT4/INT8 weights stay packed, as in the dense MLP.
//!
//! Exact ties of two probabilities take the lower expert index first; `torch.topk` on CPU orders exact ties by its
//! selection algorithm, not by index (top-2 of `[0.1, 0.3, 0.3, 0.3, 0.2]` gives experts 1 and 3), so exact ties
//! have no order to follow. Distinct probabilities, however close, are ordered by value as torch orders them.

use crate::config::{Config, MoeConfig};
use crate::error::{Error, Result};
use crate::linear::Linear;
use crate::mlp::Mlp;
use crate::ops::{sigmoid, softmax_last_dim};
use crate::schema::{Param, Schema};
use crate::taps::{Taps, names};
use crate::weights::WeightStore;
use candle_core::{DType, Device, Tensor};

/// The weights of `mlp.*` in an MoE layer, after their checkpoint keys.
#[derive(Debug, Clone)]
pub struct SparseMoe {
    /// `mlp.gate.weight`: the router `[E, H]`.
    gate: Linear,
    /// `mlp.experts.{e}.{gate_proj, up_proj, down_proj}`.
    experts: Vec<Mlp>,
    /// `mlp.shared_expert.{gate_proj, up_proj, down_proj}`.
    shared_expert: Mlp,
    /// `mlp.shared_expert_gate.weight` `[1, H]`.
    shared_expert_gate: Linear,
    /// Experts per token.
    top_k: usize,
}

/// The routing of a call's tokens: per token, the chosen experts in descending probability and their
/// renormalised weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// `[T][k]` expert indices.
    pub experts: Vec<Vec<usize>>,
    /// `[T][k]` weights, summing to 1 per token (in the run's dtype, widened).
    pub weights: Vec<Vec<f64>>,
    /// `[T][E]` router probabilities (in the run's dtype, widened).
    pub probabilities: Vec<Vec<f64>>,
}

impl SparseMoe {
    /// Loads layer `layer`'s MoE block (`c.moe` must be set). An expert's matrices are read from its own tensors or
    /// from the layer's fused `mlp.experts.gate_up_proj` / `down_proj`.
    pub fn load(w: &WeightStore, layer: usize, c: &Config) -> Result<Self> {
        let moe: &MoeConfig = c.moe.as_ref().ok_or_else(|| {
            Error::Input(format!(
                "layer {layer}: the config has no MoE block (not a qwen3_5_moe decoder)"
            ))
        })?;
        w.check_fused_experts(layer, moe, c.hidden_size)?;
        let s = Schema::new(c);
        let experts = (0..moe.num_experts)
            .map(|e| {
                Mlp::load_params(
                    w,
                    layer,
                    c,
                    [
                        Param::ExpertGateProj(e),
                        Param::ExpertUpProj(e),
                        Param::ExpertDownProj(e),
                    ],
                )
            })
            .collect::<Result<_>>()?;
        Ok(SparseMoe {
            gate: w.linear(&s.layer(layer, Param::RouterGate))?,
            experts,
            shared_expert: Mlp::load_params(
                w,
                layer,
                c,
                [
                    Param::SharedGateProj,
                    Param::SharedUpProj,
                    Param::SharedDownProj,
                ],
            )?,
            shared_expert_gate: w.linear(&s.layer(layer, Param::SharedExpertGate))?,
            top_k: moe.num_experts_per_tok,
        })
    }

    /// The router's logits `[T, E]` of `x` `[T, H]`.
    pub fn router_logits(&self, x: &Tensor) -> Result<Tensor> {
        self.gate.forward(x)
    }

    /// The routing of router logits `[T, E]`: softmax in the logits' dtype, the top `k` in descending probability
    /// (lower index first on exact ties), renormalised in that dtype.
    pub fn route(&self, logits: &Tensor) -> Result<Routing> {
        let dtype = logits.dtype();
        let probs = softmax_last_dim(logits)?;
        let probabilities: Vec<Vec<f64>> = probs.to_dtype(DType::F64)?.to_vec2()?;
        let mut experts = Vec::with_capacity(probabilities.len());
        let mut top = Vec::with_capacity(probabilities.len() * self.top_k);
        for row in &probabilities {
            // A NaN probability (a NaN router weight, or a NaN hidden state reaching the router) is not an input
            // error: it chooses experts like any value (NaN orders above every number) and carries on into the
            // block's output, so the run fails on its NaN logits and names the first tensor and the weights holding
            // it, as a dense model's NaN does.
            let mut order: Vec<usize> = (0..row.len()).collect();
            // Stable: equal probabilities keep ascending expert order.
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            order.truncate(self.top_k);
            top.extend(order.iter().map(|&e| row[e]));
            experts.push(order);
        }
        let t = experts.len();
        // The chosen probabilities are values of `dtype` (widened exactly); renormalise them in `dtype`.
        let chosen = Tensor::from_vec(top, (t, self.top_k), &Device::Cpu)?.to_dtype(dtype)?;
        let weights = chosen.broadcast_div(&chosen.sum_keepdim(1)?)?;
        Ok(Routing {
            experts,
            weights: weights.to_dtype(DType::F64)?.to_vec2()?,
            probabilities,
        })
    }

    /// `x` `[T, H]` → `[T, H]`, recording `{scope}.router_logits`, `experts_chosen` (i64), `expert_weights` and
    /// `shared_output` (scope: `layers.{i}.mlp`). Each routed expert's pages read in place are handed back after its
    /// product (a token runs `k` of the `E`; see [`crate::pages`]).
    pub fn forward(&self, x: &Tensor, taps: &mut Taps, scope: &str) -> Result<Tensor> {
        let (t, _) = x.dims2()?;
        let dtype = x.dtype();
        let logits = self.router_logits(x)?;
        taps.record(|| names::mixer(scope, names::ROUTER_LOGITS), &logits)?;
        let routing = self.route(&logits)?;
        if taps.enabled() {
            let chosen: Vec<i64> = routing
                .experts
                .iter()
                .flatten()
                .map(|&e| e as i64)
                .collect();
            let chosen = Tensor::from_vec(chosen, (t, self.top_k), &Device::Cpu)?;
            taps.record(|| names::mixer(scope, names::EXPERTS_CHOSEN), &chosen)?;
            let w: Vec<f64> = routing.weights.iter().flatten().copied().collect();
            let w = Tensor::from_vec(w, (t, self.top_k), &Device::Cpu)?.to_dtype(dtype)?;
            taps.record(|| names::mixer(scope, names::EXPERT_WEIGHTS), &w)?;
        }
        let mut out = x.zeros_like()?;
        for (e, expert) in self.experts.iter().enumerate() {
            // The tokens that chose expert `e`, and its weight for each.
            let (rows, weights): (Vec<u32>, Vec<f64>) = routing
                .experts
                .iter()
                .zip(&routing.weights)
                .enumerate()
                .filter_map(|(tok, (chosen, w))| {
                    let rank = chosen.iter().position(|&c| c == e)?;
                    Some((tok as u32, w[rank]))
                })
                .unzip();
            if rows.is_empty() {
                continue;
            }
            let n = rows.len();
            let index = Tensor::from_vec(rows, n, &Device::Cpu)?;
            let y = expert.forward(&x.index_select(&index, 0)?)?;
            expert.release_pages();
            let w = Tensor::from_vec(weights, (n, 1), &Device::Cpu)?.to_dtype(dtype)?;
            out = out.index_add(&index, &y.broadcast_mul(&w)?, 0)?;
        }
        let gate = sigmoid(&self.shared_expert_gate.forward(x)?)?;
        let shared = self.shared_expert.forward(x)?.broadcast_mul(&gate)?;
        taps.record(|| names::mixer(scope, names::SHARED_OUTPUT), &shared)?;
        Ok((out + shared)?)
    }

    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Routed experts.
    pub fn num_experts(&self) -> usize {
        self.experts.len()
    }
}
