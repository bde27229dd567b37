//! Running a graph set over a whole sequence, through its interface ([`crate::graphset`]): this project's graphs
//! and graphs made elsewhere alike. Prompts in blocks by the set's host rule, explicit caches kept on the host in the
//! dump's layout and handed between calls. Produces the reference's dump names, so the two can be compared tensor
//! for tensor.

mod chain;
mod decoder;
mod layer;
mod state;

pub use chain::LayerChain;
pub use decoder::{DecoderEngine, SET_BACKEND, STATE_NOT_EXPOSED, record_of};
pub use layer::LayerRunner;
pub use state::HostLayerState;

use crate::error::Result;
use candle_core::Tensor;
use std::collections::BTreeMap;

/// Tokens per prompt block of the decoder graphs unless asked otherwise (the NPU port's smaller block).
pub const DEFAULT_BLOCK: usize = 16;

/// Pads `[n, …]` to `[tokens, …]` by repeating the last row. The padded rows never reach a valid one (masked out
/// of attention, `token_valid` zeroing their decay and write strength), but they are computed: rows of zeros would
/// make the RMSNorms divide 0 by 0 wherever the norm's epsilon does not survive the device's arithmetic (1e-6 is
/// flushed to zero in fp16), and the NaN would reach valid rows through products with zero weights. A real token's
/// row (as the decoder graphs get from padding with token 0) is what a deployed graph sees.
pub fn pad_rows(x: &Tensor, tokens: usize) -> Result<Tensor> {
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
