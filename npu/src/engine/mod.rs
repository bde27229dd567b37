//! Running the static graphs over a whole sequence: prompts in padded blocks, caches kept on the host and handed
//! between calls, greedy decoding. Produces the reference's dump names, so the two can be compared tensor for
//! tensor.

mod decoder;
mod layer;
mod state;

pub use decoder::{DecoderEngine, record_of};
pub use layer::LayerRunner;
pub use state::HostLayerState;

use crate::error::{Error, Result};
use crate::graphs::ports;
use candle_core::{Device, Tensor};
use reference::masks;
use std::collections::BTreeMap;

/// Tokens per prompt block of the decoder graphs unless asked otherwise (the NPU port's smaller block).
pub const DEFAULT_BLOCK: usize = 16;

/// The host-side inputs of one block: `token_valid` `[T]`, `attention_mask` `[T, CTX + T]`, `positions` `[3, T]`.
pub struct BlockInputs {
    /// 1 for real tokens, 0 for padding.
    pub token_valid: Tensor,
    /// 0 where a query may attend, −inf elsewhere.
    pub attention_mask: Tensor,
    /// MRoPE positions (three equal rows for text).
    pub positions: Tensor,
}

impl BlockInputs {
    /// The inputs of a block of `tokens` slots holding `valid` real tokens at text positions `start..`, with `past`
    /// cache slots filled, for a static context of `context` slots.
    pub fn new(
        tokens: usize,
        valid: usize,
        start: usize,
        past: usize,
        context: usize,
    ) -> Result<BlockInputs> {
        if past + valid > context {
            return Err(Error::Input(format!(
                "the sequence needs {} tokens but the static context holds {context} (--context)",
                past + valid
            )));
        }
        let dev = &Device::Cpu;
        let v: Vec<f32> = (0..tokens)
            .map(|i| if i < valid { 1.0 } else { 0.0 })
            .collect();
        let mask: Vec<f32> = masks::attention_bias(tokens, past, context)
            .into_iter()
            .map(|x| x as f32)
            .collect();
        let pos: Vec<i64> = (0..tokens).map(|i| (start + i) as i64).collect();
        let pos3: Vec<i64> = pos.iter().chain(&pos).chain(&pos).copied().collect();
        Ok(BlockInputs {
            token_valid: Tensor::from_vec(v, tokens, dev)?,
            attention_mask: Tensor::from_vec(mask, (tokens, context + tokens), dev)?,
            positions: Tensor::from_vec(pos3, (3, tokens), dev)?,
        })
    }

    /// The three inputs under their port names.
    pub(crate) fn named(self) -> [(String, Tensor); 3] {
        [
            (ports::TOKEN_VALID.into(), self.token_valid),
            (ports::ATTENTION_MASK.into(), self.attention_mask),
            (ports::POSITIONS.into(), self.positions),
        ]
    }
}

/// Pads `[n, …]` to `[tokens, …]` by repeating the last row. The padded rows never reach a valid one (masked out
/// of attention, `token_valid` zeroing their decay and write strength), but they are computed: rows of zeros would
/// make the RMSNorms divide 0 by 0 wherever the norm's epsilon does not survive the device's arithmetic (1e-6 is
/// flushed to zero in fp16), and the NaN would reach valid rows through products with zero weights. A real token's
/// row (as the decoder graphs get from padding with token 0) is what a deployed graph sees.
pub(crate) fn pad_rows(x: &Tensor, tokens: usize) -> Result<Tensor> {
    let n = x.dim(0)?;
    if n == tokens {
        return Ok(x.clone());
    }
    let last = x.narrow(0, n - 1, 1)?;
    let mut rows = vec![x.clone()];
    rows.extend(std::iter::repeat_n(last, tokens - n));
    Ok(Tensor::cat(&rows, 0)?)
}

/// Collects token-major outputs across blocks (valid rows only).
#[derive(Default)]
pub(crate) struct Collector(BTreeMap<String, Vec<Tensor>>);

impl Collector {
    pub(crate) fn push(&mut self, name: &str, t: &Tensor, valid: usize) -> Result<()> {
        self.0
            .entry(name.to_string())
            .or_default()
            .push(t.narrow(0, 0, valid)?);
        Ok(())
    }

    pub(crate) fn finish(self) -> Result<BTreeMap<String, Tensor>> {
        self.0
            .into_iter()
            .map(|(k, v)| Ok((k, Tensor::cat(&v, 0)?)))
            .collect()
    }
}
