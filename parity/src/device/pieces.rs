//! A backend whose every call is fed in pieces of at most `block` tokens: how a set of fixed graphs (or one that takes
//! any number of tokens per call) is driven at another block size without compiling anything.

use candle_core::Tensor;
use reference::backend::{Backend, EmbeddedPrompt, Forward, RunRecord, Snapshot};
use reference::config::Config;
use reference::rope::Positions;
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
        let pieces: Vec<&[u32]> = ids.chunks(self.block.max(1)).collect();
        let mut logits = Vec::with_capacity(pieces.len());
        let mut taps: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
        for (i, piece) in pieces.iter().enumerate() {
            let last = i + 1 == pieces.len();
            let f = self.inner.forward(piece, all_logits)?;
            if all_logits || last {
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

    fn forward_embedded(
        &mut self,
        prompt: &EmbeddedPrompt,
        all_logits: bool,
    ) -> reference::Result<Forward> {
        let (n, block) = (prompt.ids.len(), self.block.max(1));
        let mut logits = Vec::new();
        let mut taps: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
        for from in (0..n).step_by(block) {
            let len = block.min(n - from);
            let piece = EmbeddedPrompt {
                ids: prompt.ids[from..from + len].to_vec(),
                embeddings: prompt.embeddings.narrow(0, from, len)?,
                positions: Positions(
                    prompt
                        .positions
                        .0
                        .each_ref()
                        .map(|r| r[from..from + len].to_vec()),
                ),
            };
            let f = self.inner.forward_embedded(&piece, all_logits)?;
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

    fn exposes_state(&self) -> bool {
        self.inner.exposes_state()
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
