//! The reference's side of the probe: its run of the prompt in the device's blocks, with the taps of every position
//! and the state before and after every block, and what each block and layer is fed from it.

use crate::images::PromptInput;
use anyhow::{Context, Result};
use candle_core::Tensor;
use npu::graphset::layout::CallPositions;
use reference::backend::{Backend, Forward, Snapshot};
use reference::taps::names;
use std::collections::BTreeMap;

/// The reference's run of a prompt in the device's blocks: the taps of every position and the state before and
/// after every block.
pub struct ReferenceTrace {
    /// The prompt: token ids, or one with images (its image tokens carrying the reference tower's rows, its
    /// positions `get_rope_index`'s).
    pub input: PromptInput,
    /// Token-major taps over the prompt.
    pub taps: BTreeMap<String, Tensor>,
    /// `states[b]` is the state before block `b`; the last one is the state after the prompt.
    pub states: Vec<Snapshot>,
    /// `[start, end)` of every block.
    pub blocks: Vec<(usize, usize)>,
}

impl ReferenceTrace {
    /// Runs `input` in blocks of `block` tokens on the reference (a backend recording taps).
    pub fn new(reference: &mut dyn Backend, input: &PromptInput, block: usize) -> Result<Self> {
        reference.reset()?;
        let n = input.ids().len();
        let blocks: Vec<(usize, usize)> = (0..n)
            .step_by(block.max(1))
            .map(|s| (s, (s + block).min(n)))
            .collect();
        let mut trace = ReferenceTrace {
            input: input.clone(),
            taps: BTreeMap::new(),
            states: vec![reference.snapshot()?],
            blocks,
        };
        let mut pieces: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
        for b in 0..trace.blocks.len() {
            let f = trace.forward_block(reference, b)?;
            for (k, v) in f.taps {
                pieces.entry(k).or_default().push(v);
            }
            trace.states.push(reference.snapshot()?);
        }
        trace.taps = pieces
            .into_iter()
            .map(|(k, v)| Ok((k, Tensor::cat(&v, 0)?)))
            .collect::<Result<_>>()?;
        Ok(trace)
    }

    /// The prompt's token ids.
    pub fn ids(&self) -> &[u32] {
        self.input.ids()
    }

    /// Runs block `b` of the prompt on `backend` (with every logit and tap): its ids, or its piece of the prompt
    /// with images (the reference's rows and positions).
    pub fn forward_block(&self, backend: &mut dyn Backend, b: usize) -> Result<Forward> {
        let (start, end) = self.blocks[b];
        Ok(match &self.input {
            PromptInput::Ids(ids) => backend.forward(&ids[start..end], true)?,
            PromptInput::Images(p) => {
                backend.forward_embedded(&p.slice(start, end - start)?, true)?
            }
        })
    }

    /// The positions of block `b`'s tokens, as a per-layer graph is given them: text following the block's start,
    /// or the prompt's three MRoPE rows there.
    pub fn positions(&self, b: usize) -> CallPositions<'_> {
        let (start, end) = self.blocks[b];
        match &self.input {
            PromptInput::Ids(_) => CallPositions::TEXT,
            PromptInput::Images(p) => {
                CallPositions::Rows(p.positions.0.each_ref().map(|r| &r[start..end]))
            }
        }
    }

    pub(super) fn tap(&self, name: &str) -> Result<&Tensor> {
        self.taps
            .get(name)
            .with_context(|| format!("the reference has no tap `{name}`"))
    }

    /// Layer `layer`'s input over the prompt: the embeddings, or the previous layer's output.
    pub fn input(&self, layer: usize) -> Result<&Tensor> {
        if layer == 0 {
            self.tap(names::EMBEDDINGS)
        } else {
            self.tap(&names::layer(layer - 1, names::OUTPUT))
        }
    }
}
