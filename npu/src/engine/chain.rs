//! A set's per-layer graphs chained into a decoder, as a [`Backend`]: the host looks up the embeddings, runs every
//! layer's own graph in turn (the hidden state of one the input of the next, each layer's states kept on the host),
//! and applies the final norm and the LM head, both with the reference's code and weights. This is how a port
//! compiled per layer (NPUW on NPU 4000) runs its decoder, so a per-layer set can be compared, probed and
//! validated as a whole.

use super::{HostLayerState, LayerRunner};
use crate::devices::{CompileOptions, ExecInfo};
use crate::error::{Error, Result};
use crate::graphset::layout::CallPositions;
use crate::graphset::{GraphSet, PromptRule};
use candle_core::Tensor;
use reference::backend::{Backend, EmbeddedPrompt, Forward, RunRecord, Snapshot};
use reference::config::Config;
use reference::model::Model;
use reference::taps::names;
use std::collections::BTreeMap;

/// A per-layer set compiled on a device and run as one decoder.
pub struct LayerChain {
    /// Per layer, its graphs by tokens per call.
    runners: Vec<BTreeMap<usize, LayerRunner>>,
    host: Model,
    context: Option<usize>,
    rule: PromptRule,
    states: Vec<HostLayerState>,
    position: usize,
    rope_delta: i64,
    record: RunRecord,
}

impl LayerChain {
    /// Compiles every per-layer graph of `set` for `device`; `host` is the reference model whose embedding, final
    /// norm and LM head the chain runs on the host. Every layer must have a graph of the same block sizes.
    pub fn open(set: &GraphSet, host: Model, device: &str, opts: &CompileOptions) -> Result<Self> {
        let start = std::time::Instant::now();
        let config = host.config().clone();
        let part = set.layers.as_ref().ok_or_else(|| {
            Error::Config(format!(
                "{}: the set has no per-layer graphs (`layers`)",
                set.source
            ))
        })?;
        let blocks = set.layer_blocks();
        for l in 0..config.num_layers() {
            if !blocks.contains_key(&l) {
                return Err(Error::Config(format!(
                    "{}: layer {l} has no graph (`layers.graphs`): a chain needs every layer",
                    set.source
                )));
            }
        }
        let first = &blocks[&0];
        if let Some((l, b)) = blocks.iter().find(|(_, b)| *b != first) {
            return Err(Error::Config(format!(
                "{}: layer {l} has graphs of {b:?} tokens, layer 0 of {first:?}: a chain needs the same block sizes \
                 in every layer",
                set.source
            )));
        }
        let mut runners: Vec<BTreeMap<usize, LayerRunner>> =
            (0..config.num_layers()).map(|_| BTreeMap::new()).collect();
        for g in &part.graphs {
            let (Some(l), Some(t)) = (g.layer, g.tokens) else {
                continue;
            };
            let r = LayerRunner::open(set, g, config.clone(), device, opts)?;
            runners
                .get_mut(l)
                .ok_or_else(|| Error::Config(format!("{}: no layer {l} in the model", set.source)))?
                .insert(t, r);
        }
        let infos: Vec<&ExecInfo> = runners
            .iter()
            .flat_map(|m| m.values().map(|r| r.info()))
            .collect();
        let record = RunRecord {
            backend: "graph-set (per-layer chain)".into(),
            block: first.last().copied(),
            taps: true,
            ..super::record::set_record(set, &infos, device, opts, start.elapsed().as_secs_f64())?
        };
        let states = (0..config.num_layers())
            .map(|l| HostLayerState::zeros(&config, l))
            .collect::<Result<_>>()?;
        Ok(LayerChain {
            runners,
            host,
            rule: part.interface.prompt,
            context: set.context,
            states,
            position: 0,
            rope_delta: 0,
            record,
        })
    }

    /// What every graph was prepared with.
    pub fn infos(&self) -> Vec<&ExecInfo> {
        self.runners
            .iter()
            .flat_map(|m| m.values().map(|r| r.info()))
            .collect()
    }

    /// The block sizes of the layers' graphs.
    pub fn blocks(&self) -> Vec<usize> {
        self.runners
            .first()
            .map(|m| m.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Changes the host rule for prompts: the last block padded, or full blocks then single tokens.
    pub fn set_prompt_rule(&mut self, rule: PromptRule) -> Result<()> {
        if rule == PromptRule::Blocks && !self.blocks().contains(&1) {
            return Err(Error::Config(
                "unpadded prompts need 1-token graphs, which the set does not have".into(),
            ));
        }
        self.rule = rule;
        Ok(())
    }

    /// The pieces a call of `n` tokens runs in, with the block size of each: one token through the 1-token
    /// graphs; more through the largest blocks, the last one padded (or, unpadded, the tail token by token).
    fn plan(&self, n: usize) -> Result<Vec<(usize, usize)>> {
        let blocks = self.blocks();
        let largest = blocks
            .iter()
            .copied()
            .filter(|&b| b > 1)
            .max()
            .or(blocks.last().copied())
            .ok_or_else(|| Error::Config("no per-layer graph".into()))?;
        if n == 1 && blocks.contains(&1) {
            return Ok(vec![(1, 1)]);
        }
        if self.rule == PromptRule::Padded {
            return Ok(vec![(n, largest)]);
        }
        let full = n / largest * largest;
        let mut plan = Vec::new();
        if full > 0 {
            plan.push((full, largest));
        }
        plan.extend(std::iter::repeat_n((1, 1), n - full));
        Ok(plan)
    }

    /// The layers over `ids` (with `given`, the embeddings and positions of a prompt with images).
    fn run(
        &mut self,
        ids: &[u32],
        given: Option<&EmbeddedPrompt>,
        all_logits: bool,
    ) -> Result<Forward> {
        if ids.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        let config = self.host.config().clone();
        config.check_token_ids(ids)?;
        if let Some(context) = self.context
            && self.position + ids.len() > context
        {
            return Err(Error::Input(format!(
                "{} tokens after {} need {} cache slots, but the static context holds {context}",
                ids.len(),
                self.position,
                self.position + ids.len()
            )));
        }
        let mut taps: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
        let mut logits = Vec::new();
        let mut done = 0;
        let rows = given.map(|p| p.positions.0.each_ref().map(|r| r.as_slice()));
        for (n, tokens) in self.plan(ids.len())? {
            let piece = &ids[done..done + n];
            let (mut h, positions) = match (given, rows) {
                (Some(p), Some(rows)) => (
                    p.embeddings.narrow(0, done, n)?,
                    CallPositions::Rows(rows).slice(done, n),
                ),
                _ => (
                    self.host.embed(piece)?,
                    CallPositions::Text {
                        delta: self.rope_delta,
                    },
                ),
            };
            taps.entry(names::EMBEDDINGS.to_string())
                .or_default()
                .push(h.clone());
            for (layer, state) in self.states.iter_mut().enumerate() {
                let runner = self.runners[layer].get_mut(&tokens).ok_or_else(|| {
                    Error::Config(format!("layer {layer} has no graph of {tokens} tokens"))
                })?;
                let out = runner.run(&h, self.position, positions, state)?;
                for (k, v) in &out {
                    taps.entry(names::layer(layer, k))
                        .or_default()
                        .push(v.clone());
                }
                h = out
                    .get(names::OUTPUT)
                    .ok_or_else(|| Error::Interface(format!("layer {layer} gave no output")))?
                    .clone();
            }
            let (normed, l) = self.host.head(&h)?;
            taps.entry(names::FINAL_NORM.to_string())
                .or_default()
                .push(normed);
            logits.push(l);
            self.position += n;
            done += n;
        }
        let logits = Tensor::cat(&logits, 0)?;
        let logits = if all_logits {
            logits
        } else {
            logits.narrow(0, ids.len() - 1, 1)?
        };
        let taps = taps
            .into_iter()
            .map(|(k, v)| Ok((k, Tensor::cat(&v, 0)?)))
            .collect::<Result<_>>()?;
        if let Some(p) = given {
            self.rope_delta = p.positions.next_text() - self.position as i64;
        }
        Ok(Forward { logits, taps })
    }

    fn config_of(&self) -> &Config {
        self.host.config()
    }
}

impl Backend for LayerChain {
    fn config(&self) -> &Config {
        self.config_of()
    }

    fn record(&self) -> &RunRecord {
        &self.record
    }

    fn reset(&mut self) -> reference::Result<()> {
        let config = self.host.config().clone();
        self.states = (0..config.num_layers())
            .map(|l| HostLayerState::zeros(&config, l))
            .collect::<Result<_>>()
            .map_err(super::decoder::into_reference)?;
        self.position = 0;
        self.rope_delta = 0;
        Ok(())
    }

    fn forward(&mut self, ids: &[u32], all_logits: bool) -> reference::Result<Forward> {
        self.run(ids, None, all_logits)
            .map_err(super::decoder::into_reference)
    }

    fn forward_embedded(
        &mut self,
        prompt: &EmbeddedPrompt,
        all_logits: bool,
    ) -> reference::Result<Forward> {
        prompt.check(self.host.config().hidden_size)?;
        self.run(&prompt.ids, Some(prompt), all_logits)
            .map_err(super::decoder::into_reference)
    }

    fn position(&self) -> reference::Result<usize> {
        Ok(self.position)
    }

    fn snapshot(&self) -> reference::Result<Snapshot> {
        let mut tensors = BTreeMap::new();
        for (i, s) in self.states.iter().enumerate() {
            tensors.extend(s.dump_tensors(i).map_err(super::decoder::into_reference)?);
        }
        Ok(Snapshot {
            position: self.position,
            rope_delta: self.rope_delta,
            tensors,
        })
    }

    fn restore(&mut self, snapshot: &Snapshot) -> reference::Result<()> {
        let config = self.host.config().clone();
        self.states = (0..config.num_layers())
            .map(|i| HostLayerState::from_snapshot(&config, i, self.context, snapshot))
            .collect::<Result<Vec<_>>>()
            .map_err(super::decoder::into_reference)?;
        self.position = snapshot.position;
        self.rope_delta = snapshot.rope_delta;
        Ok(())
    }
}
