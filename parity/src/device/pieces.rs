//! A backend whose every call is fed in pieces of at most `block` tokens: how a set of fixed graphs (or one that takes
//! any number of tokens per call) is driven at another block size without compiling anything.

use candle_core::Tensor;
use reference::backend::{Backend, EmbeddedPrompt, Forward, RunRecord, Snapshot};
use reference::config::Config;
use std::collections::BTreeMap;

/// `inner` with every call cut into pieces of at most `block` tokens.
pub struct Pieces<'a> {
    /// The backend.
    pub inner: &'a mut dyn Backend,
    /// The largest piece.
    pub block: usize,
}

impl Backend for Pieces<'_> {
    fn config(&self) -> &Config {
        self.inner.config()
    }

    fn record(&self) -> &RunRecord {
        self.inner.record()
    }

    fn reset(&mut self) -> reference::Result<()> {
        self.inner.reset()
    }

    fn forward(&mut self, ids: &[u32], all_logits: bool) -> reference::Result<Forward> {
        let inner = &mut *self.inner;
        in_pieces(ids.len(), self.block, all_logits, |from, len| {
            inner.forward(&ids[from..from + len], all_logits)
        })
    }

    fn forward_embedded(
        &mut self,
        prompt: &EmbeddedPrompt,
        all_logits: bool,
    ) -> reference::Result<Forward> {
        let inner = &mut *self.inner;
        in_pieces(prompt.ids.len(), self.block, all_logits, |from, len| {
            let piece = prompt.slice(from, len)?;
            inner.forward_embedded(&piece, all_logits)
        })
    }

    fn state_hidden(&self) -> Option<&'static str> {
        self.inner.state_hidden()
    }

    fn position(&self) -> reference::Result<usize> {
        self.inner.position()
    }

    fn snapshot(&self) -> reference::Result<Snapshot> {
        self.inner.snapshot()
    }

    fn restore(&mut self, snapshot: &Snapshot) -> reference::Result<()> {
        self.inner.restore(snapshot)
    }
}

/// `n` tokens in calls of at most `block` (`call(from, len)`), their logits (every row's when `all_logits`, else
/// the last call's) and taps concatenated.
fn in_pieces(
    n: usize,
    block: usize,
    all_logits: bool,
    mut call: impl FnMut(usize, usize) -> reference::Result<Forward>,
) -> reference::Result<Forward> {
    let block = block.max(1);
    let mut logits = Vec::new();
    let mut taps: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
    for from in (0..n).step_by(block) {
        let len = block.min(n - from);
        let f = call(from, len)?;
        if all_logits || from + len == n {
            logits.push(f.logits);
        }
        for (k, v) in f.taps {
            taps.entry(k).or_default().push(v);
        }
    }
    Ok(Forward {
        logits: Tensor::cat(&logits, 0)?,
        taps: taps
            .into_iter()
            .map(|(k, v)| Ok((k, Tensor::cat(&v, 0)?)))
            .collect::<reference::Result<_>>()?,
    })
}
