//! An MoE layer's block on a device, run on a routing given to it over whole sequences in blocks: the per-layer
//! probe's fed-routing graph ([`crate::graphs::Builder::moe_block_graph`]), with which the experts' arithmetic is
//! judged apart from the router's choice.

use super::Collector;
use crate::devices::{CompileOptions, ExecInfo};
use crate::error::{Error, Result};
use crate::graphs::{Builder, ports};
use crate::infer::{Executor, prepare};
use candle_core::{DType, Tensor};
use reference::taps::names;
use std::collections::BTreeMap;

/// One MoE layer's block compiled on a device, fed its routing.
pub struct MoeBlockRunner {
    session: Box<dyn Executor>,
    layer: usize,
    tokens: usize,
}

impl MoeBlockRunner {
    /// Builds and compiles layer `layer`'s MoE block graph for blocks of `tokens` (this project's graphs: it is built
    /// from the checkpoint).
    pub fn new(
        builder: &Builder,
        layer: usize,
        tokens: usize,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        let graph = builder.moe_block_graph(layer, tokens)?;
        Ok(MoeBlockRunner {
            session: prepare(graph, device, opts)?,
            layer,
            tokens,
        })
    }

    /// What the graph was prepared with (device, precision, compile time).
    pub fn info(&self) -> &ExecInfo {
        self.session.info()
    }

    /// Runs the block over `S` tokens in blocks (the last one padded by repeating its last row): `hidden` `[S, H]`
    /// the residual stream after the mixer, `experts` `[S, k]` the chosen experts (any integer dtype), `weights`
    /// `[S, k]` their weights. Returns `mlp_output` and every tap over the `S` tokens, named as in the dump without
    /// the `layers.{i}.` prefix.
    pub fn run(
        &mut self,
        hidden: &Tensor,
        experts: &Tensor,
        weights: &Tensor,
    ) -> Result<BTreeMap<String, Tensor>> {
        let s = hidden.dim(0)?;
        if experts.dim(0)? != s || weights.dims() != experts.dims() {
            return Err(Error::Input(format!(
                "layer {}: an MoE block fed {s} tokens of hidden state, experts {:?} and weights {:?}",
                self.layer,
                experts.dims(),
                weights.dims()
            )));
        }
        let experts = experts.to_dtype(DType::I64)?;
        let weights = weights.to_dtype(DType::F32)?;
        let hidden = hidden.to_dtype(DType::F32)?;
        let mut out = Collector::default();
        let mut done = 0;
        while done < s {
            let valid = self.tokens.min(s - done);
            let block = |t: &Tensor| -> Result<Tensor> {
                super::pad_rows(&t.narrow(0, done, valid)?, self.tokens)
            };
            let (h, e, w) = (block(&hidden)?, block(&experts)?, block(&weights)?);
            let results = self.session.run(&[
                (ports::HIDDEN, &h),
                (ports::EXPERTS_CHOSEN, &e),
                (ports::EXPERT_WEIGHTS, &w),
            ])?;
            if !results.contains_key(names::MLP_OUTPUT) {
                return Err(Error::Interface(format!(
                    "{}: no output `{}`",
                    self.session.info().graph,
                    names::MLP_OUTPUT
                )));
            }
            for (name, t) in &results {
                out.push(name, t, valid)?;
            }
            done += valid;
        }
        out.finish()
    }
}
