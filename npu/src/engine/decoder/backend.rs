//! [`DecoderEngine`] as a [`Backend`]: the calls, the state handed out and back, the taps streamed.

use super::{DecoderEngine, STATE_NOT_EXPOSED};
use crate::engine::HostLayerState;
use crate::error::{Error, Result};
use reference::backend::{Backend, EmbeddedPrompt, Forward, RunRecord, Snapshot};
use reference::config::Config;
use reference::taps::SharedTapSink;
use std::collections::BTreeMap;

impl Backend for DecoderEngine {
    fn config(&self) -> &Config {
        &self.config
    }

    fn record(&self) -> &RunRecord {
        &self.record
    }

    fn reset(&mut self) -> reference::Result<()> {
        if !self.interface.stateful {
            self.states = (0..self.config.num_layers())
                .map(|l| HostLayerState::zeros(&self.config, l))
                .collect::<Result<_>>()
                .map_err(into_reference)?;
        }
        for g in &mut self.graphs {
            g.exec.reset().map_err(into_reference)?;
        }
        self.position = 0;
        self.rope_delta = 0;
        Ok(())
    }

    /// One token runs through the single-token graph; more by the set's host rule (padded blocks, or full blocks
    /// then single tokens; a dynamic graph takes the whole call).
    fn forward(&mut self, ids: &[u32], all_logits: bool) -> reference::Result<Forward> {
        self.forward_calls(ids, None, all_logits)
            .map_err(into_reference)
    }

    /// Through graphs with an `embeddings` input (and positions of three rows, for the images' tokens).
    fn forward_embedded(
        &mut self,
        prompt: &EmbeddedPrompt,
        all_logits: bool,
    ) -> reference::Result<Forward> {
        prompt.check(self.config.hidden_size)?;
        self.forward_calls(&prompt.ids, Some(prompt), all_logits)
            .map_err(into_reference)
    }

    fn state_hidden(&self) -> Option<&'static str> {
        self.interface.stateful.then_some(STATE_NOT_EXPOSED)
    }

    fn position(&self) -> reference::Result<usize> {
        Ok(self.position)
    }

    fn snapshot(&self) -> reference::Result<Snapshot> {
        if self.interface.stateful {
            return Err(reference::Error::Backend(format!(
                "the state of {} is {STATE_NOT_EXPOSED}",
                self.record.device.clone().unwrap_or_default()
            )));
        }
        let mut tensors = BTreeMap::new();
        for (i, s) in self.states.iter().enumerate() {
            tensors.extend(s.dump_tensors(i).map_err(into_reference)?);
        }
        Ok(Snapshot {
            position: self.position,
            rope_delta: self.rope_delta,
            tensors,
        })
    }

    fn restore(&mut self, snapshot: &Snapshot) -> reference::Result<()> {
        if self.interface.stateful {
            return Err(reference::Error::Backend(format!(
                "cannot set the state: it is {STATE_NOT_EXPOSED}"
            )));
        }
        let states = (0..self.config.num_layers())
            .map(|i| HostLayerState::from_snapshot(&self.config, i, self.context, snapshot))
            .collect::<Result<Vec<_>>>()
            .map_err(into_reference)?;
        self.states = states;
        self.position = snapshot.position;
        self.rope_delta = snapshot.rope_delta;
        Ok(())
    }

    /// Streams when the graphs have taps: those of each graph call (every layer's, a block of tokens) go to the
    /// sink as the call returns.
    fn stream_taps(&mut self, sink: Option<SharedTapSink>) -> bool {
        self.sink = sink.filter(|_| self.has_taps());
        self.sink.is_some()
    }
}

/// An error of this crate as the backend interface's error (which is the reference's).
pub(crate) fn into_reference(e: Error) -> reference::Error {
    match e {
        Error::Reference(e) => e,
        Error::Input(m) => reference::Error::Input(m),
        other => reference::Error::Backend(other.to_string()),
    }
}
