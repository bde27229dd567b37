//! Faults injected into the device under test (`qwen35 validate --inject-fault`, a hidden flag for tests): a device
//! wrong in one known way must make the check that looks for that kind of fault fail, and only that one. The wrapper
//! changes what the backend does, never what the checks compute.
//!
//! Each fault is a device bug only one check's runs reach: the graphs of one block size (blocks), the prompt fed
//! unpadded (padding), a verify block in the middle of a sequence (prompt lookup), the graphs with hidden outputs
//! (compare), one layer's own graph (the probe), positions past a length (length), a call past the static context
//! (over-long). A padded-slot bug of the deployed graphs cannot be one of them: compare and length run the very same
//! padded calls against the exact reference at the same thresholds, so the padding check's own fault is on the other
//! side of its equivalence, the prompt fed without `token_valid`.

use super::layers::LayerDevice;
use anyhow::{Result, bail};
use candle_core::Tensor;
use npu::engine::HostLayerState;
use npu::graphset::layout::CallPositions;
use reference::backend::{Backend, EmbeddedPrompt, Forward, RunRecord, Snapshot};
use reference::config::Config;
use reference::taps::names;
use std::collections::BTreeMap;

/// A fault of the device under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `reset` keeps every DeltaNet recurrent state (a stateful model not reset between sequences): the next
    /// sequence starts from the last one's state.
    LeakState,
    /// `restore` does nothing: a snapshot cannot be gone back to.
    IgnoreRestore,
    /// The logits of every position from this one on are negated (a device that breaks past a length).
    LogitsFrom(usize),
    /// The logits of every position from this one on are NaN (a device whose fp16 values overflow past a length).
    NanFrom(usize),
    /// The graphs compiled for prompt blocks of this many tokens give every logit ×(1 + 1e-3) (a compiler bug at
    /// one static shape; the deployed block's graphs are right).
    BlockGraph(usize),
    /// A prompt fed without padding (its full blocks, then its tail token by token) leaves every DeltaNet
    /// recurrent state ×1.01 (the hand-off from the block graph to the single-token graph rounds it wrongly).
    UnpaddedTail,
    /// A call of several tokens that continues a sequence (a verify block) returns its last row's logits in every
    /// row (the rows before the last are read from the wrong offset unless a call starts the sequence).
    StaleRows,
    /// The graphs with hidden outputs give every hidden output ×1.01 while their logits and states are right (the
    /// extra outputs read back through a wrong scale).
    TapsScaled,
    /// This layer's own graph (the probe's unit) gives an MLP output 5% too large, and the layer's output with it;
    /// in an MoE layer its block fed the reference's routing, the same arithmetic, too.
    LayerGraph(usize),
    /// This MoE layer's own graph outputs, as every token's first chosen expert, the one its router ranks last (a
    /// top-k whose indices come out wrong): a confident routing flip at every token.
    LayerRouting(usize),
    /// A call past the static context is cut to the slots left instead of refused: the tokens that do not fit are
    /// dropped, silently.
    Overflow,
    /// A prompt with images leaves no rope delta in the state: the text after it continues at the count of tokens
    /// so far instead of the image's largest position + 1 (the host that forgets `get_rope_index`'s delta).
    ForgetRopeDelta,
}

impl Fault {
    /// Parses `leak-state`, `ignore-restore`, `logits-from=P`, `nan-from=P`, `block-graph=N`, `unpadded-tail`,
    /// `stale-rows`, `taps-scaled`, `layer-graph=L`, `layer-routing=L`, `overflow` or `forget-rope-delta`.
    pub fn parse(s: &str) -> Result<Self> {
        let n = |prefix: &str| s.strip_prefix(prefix)?.parse::<usize>().ok();
        Ok(match s {
            "leak-state" => Fault::LeakState,
            "ignore-restore" => Fault::IgnoreRestore,
            "unpadded-tail" => Fault::UnpaddedTail,
            "stale-rows" => Fault::StaleRows,
            "taps-scaled" => Fault::TapsScaled,
            "overflow" => Fault::Overflow,
            "forget-rope-delta" => Fault::ForgetRopeDelta,
            _ => match (
                n("logits-from="),
                n("nan-from="),
                n("block-graph="),
                n("layer-graph="),
                n("layer-routing="),
            ) {
                (Some(p), ..) => Fault::LogitsFrom(p),
                (_, Some(p), ..) => Fault::NanFrom(p),
                (_, _, Some(b), ..) => Fault::BlockGraph(b),
                (_, _, _, Some(l), _) => Fault::LayerGraph(l),
                (.., Some(l)) => Fault::LayerRouting(l),
                _ => bail!(
                    "--inject-fault {s}: expected leak-state, ignore-restore, logits-from=POSITION, \
                     nan-from=POSITION, block-graph=TOKENS, unpadded-tail, stale-rows, taps-scaled, layer-graph=LAYER, \
                     layer-routing=LAYER, overflow or forget-rope-delta"
                ),
            },
        })
    }

    /// Whether it acts on the device's state (which a stateful IR keeps inside OpenVINO).
    pub fn acts_on_state(self) -> bool {
        matches!(
            self,
            Fault::LeakState | Fault::IgnoreRestore | Fault::UnpaddedTail | Fault::ForgetRopeDelta
        )
    }

    /// Whether only this project's graphs can carry it (graphs compiled per block size, per-layer graphs built
    /// from the checkpoint, a context known to the wrapper).
    pub fn own_graphs_only(self) -> bool {
        matches!(
            self,
            Fault::BlockGraph(_) | Fault::LayerGraph(_) | Fault::LayerRouting(_) | Fault::Overflow
        )
    }

    /// The fault as the graphs compiled for prompt blocks of `block` carry it: a block-size fault only on its
    /// block's graphs.
    pub fn for_block(fault: Option<Fault>, block: usize) -> Option<Fault> {
        fault.filter(|f| !matches!(f, Fault::BlockGraph(b) if *b != block))
    }
}

/// `t` × `factor`.
fn scaled(t: &Tensor, factor: f64) -> candle_core::Result<Tensor> {
    t.affine(factor, 0.0)
}

/// A backend with an optional fault: without one it is the backend itself.
pub struct Faulty<B> {
    inner: B,
    fault: Option<Fault>,
    position: usize,
    padded: bool,
    context: Option<usize>,
}

impl<B: Backend> Faulty<B> {
    /// `inner`, misbehaving as `fault` says.
    pub fn new(inner: B, fault: Option<Fault>) -> Self {
        Faulty {
            inner,
            fault,
            position: 0,
            padded: true,
            context: None,
        }
    }

    /// The static context of `inner`, which [`Fault::Overflow`] cuts calls to.
    pub fn with_context(mut self, context: Option<usize>) -> Self {
        self.context = context;
        self
    }

    /// Records whether prompts are padded (`token_valid`) or fed unpadded, as the device was just told.
    pub fn set_padded(&mut self, padded: bool) {
        self.padded = padded;
    }

    /// The backend underneath.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// The backend underneath, to change how it runs (not what the fault does).
    pub fn inner_mut(&mut self) -> &mut B {
        &mut self.inner
    }

    /// Every DeltaNet recurrent state ×`factor`.
    fn scale_recurrent(&mut self, factor: f64) -> reference::Result<()> {
        let mut s = self.inner.snapshot()?;
        for (name, t) in s.tensors.iter_mut() {
            if name.ends_with(names::RECURRENT_STATE) {
                *t = scaled(t, factor)?;
            }
        }
        self.inner.restore(&s)
    }
}

impl<B: Backend> Backend for Faulty<B> {
    fn config(&self) -> &Config {
        self.inner.config()
    }

    fn record(&self) -> &RunRecord {
        self.inner.record()
    }

    fn reset(&mut self) -> reference::Result<()> {
        self.position = 0;
        if self.fault != Some(Fault::LeakState) {
            return self.inner.reset();
        }
        let old = self.inner.snapshot()?;
        self.inner.reset()?;
        let mut fresh = self.inner.snapshot()?;
        for (name, t) in old.tensors {
            if name.ends_with(names::RECURRENT_STATE) {
                fresh.tensors.insert(name, t);
            }
        }
        self.inner.restore(&fresh)
    }

    /// A prompt with images goes through untouched but for [`Fault::ForgetRopeDelta`]: the other faults act on
    /// calls of token ids.
    fn forward_embedded(
        &mut self,
        prompt: &EmbeddedPrompt,
        all_logits: bool,
    ) -> reference::Result<Forward> {
        let out = self.inner.forward_embedded(prompt, all_logits)?;
        self.position += prompt.ids.len();
        if self.fault == Some(Fault::ForgetRopeDelta) {
            let mut s = self.inner.snapshot()?;
            s.rope_delta = 0;
            self.inner.restore(&s)?;
        }
        Ok(out)
    }

    fn forward(&mut self, ids: &[u32], all_logits: bool) -> reference::Result<Forward> {
        let start = self.position;
        let ids = match (self.fault, self.context) {
            (Some(Fault::Overflow), Some(c)) if start + ids.len() > c && start < c => {
                &ids[..c - start]
            }
            _ => ids,
        };
        let mut out = self.inner.forward(ids, all_logits)?;
        self.position += ids.len();
        let rows = out.logits.dim(0)?;
        let (from, nan) = match self.fault {
            Some(Fault::LogitsFrom(from)) => (from, false),
            Some(Fault::NanFrom(from)) => (from, true),
            Some(Fault::BlockGraph(_)) => {
                out.logits = scaled(&out.logits, 1.0 + 1e-3)?;
                return Ok(out);
            }
            Some(Fault::UnpaddedTail) if !self.padded && ids.len() > 1 => {
                self.scale_recurrent(1.01)?;
                return Ok(out);
            }
            Some(Fault::StaleRows) if start > 0 && rows > 1 => {
                let last = out.logits.narrow(0, rows - 1, 1)?;
                out.logits = last.repeat((rows, 1))?;
                return Ok(out);
            }
            Some(Fault::TapsScaled) => {
                for t in out.taps.values_mut() {
                    *t = scaled(t, 1.01)?;
                }
                return Ok(out);
            }
            _ => return Ok(out),
        };
        // Row r holds the position `first + r`.
        let first = self.position - rows;
        let changed = (0..rows)
            .map(|r| {
                let row = out.logits.narrow(0, r, 1)?;
                match (first + r >= from, nan) {
                    (false, _) => Ok(row),
                    (true, false) => row.neg(),
                    (true, true) => row.affine(0.0, f64::NAN),
                }
            })
            .collect::<candle_core::Result<Vec<Tensor>>>()?;
        out.logits = Tensor::cat(&changed, 0)?;
        Ok(out)
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
        if self.fault == Some(Fault::IgnoreRestore) {
            return Ok(());
        }
        self.position = snapshot.position;
        self.inner.restore(snapshot)
    }
}

/// Per-layer graphs with [`Fault::LayerGraph`] (the faulty layer's MLP output 5% too large, its output with it, and
/// its MoE block's fed a routing) or [`Fault::LayerRouting`] (the faulty layer's first chosen expert, as output, its
/// router's last).
pub struct FaultyLayers<'a> {
    /// The graphs.
    pub inner: Box<dyn LayerDevice + 'a>,
    /// The fault: [`Fault::LayerGraph`] or [`Fault::LayerRouting`].
    pub fault: Fault,
}

/// `chosen` `[T, k]` (i64) with every token's first expert replaced by the one `logits` `[T, E]` rank last.
fn last_first(chosen: &Tensor, logits: &Tensor) -> Result<Tensor> {
    let mut rows = chosen.to_dtype(candle_core::DType::I64)?.to_vec2::<i64>()?;
    let logits = logits.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
    for (row, l) in rows.iter_mut().zip(&logits) {
        let last = (0..l.len())
            .min_by(|&a, &b| l[a].total_cmp(&l[b]))
            .unwrap_or(0);
        row[0] = last as i64;
    }
    Ok(Tensor::new(rows, chosen.device())?)
}

impl LayerDevice for FaultyLayers<'_> {
    fn run(
        &mut self,
        layer: usize,
        hidden: &Tensor,
        start: usize,
        positions: CallPositions,
        state: &mut HostLayerState,
    ) -> Result<BTreeMap<String, Tensor>> {
        let mut out = self.inner.run(layer, hidden, start, positions, state)?;
        let chosen = names::mixer(names::MLP, names::EXPERTS_CHOSEN);
        let logits = names::mixer(names::MLP, names::ROUTER_LOGITS);
        if self.fault == Fault::LayerRouting(layer)
            && let (Some(c), Some(l)) = (out.get(&chosen), out.get(&logits))
        {
            let wrong = last_first(c, l)?;
            out.insert(chosen, wrong);
        }
        if self.fault == Fault::LayerGraph(layer)
            && let Some(mlp) = out.get(names::MLP_OUTPUT).cloned()
        {
            let extra = scaled(&mlp, 0.05)?;
            out.insert(names::MLP_OUTPUT.into(), (&mlp + &extra)?);
            if let Some(o) = out.get(names::OUTPUT) {
                let o = (o + &extra)?;
                out.insert(names::OUTPUT.into(), o);
            }
        }
        Ok(out)
    }

    fn moe_block(
        &mut self,
        layer: usize,
        hidden: &Tensor,
        experts: &Tensor,
        weights: &Tensor,
    ) -> Result<Option<BTreeMap<String, Tensor>>> {
        let out = self.inner.moe_block(layer, hidden, experts, weights)?;
        Ok(match out {
            Some(mut out) if self.fault == Fault::LayerGraph(layer) => {
                if let Some(mlp) = out.get(names::MLP_OUTPUT) {
                    let wrong = scaled(mlp, 1.05)?;
                    out.insert(names::MLP_OUTPUT.into(), wrong);
                }
                Some(out)
            }
            out => out,
        })
    }

    fn block(&self) -> usize {
        self.inner.block()
    }

    fn context(&self) -> Option<usize> {
        self.inner.context()
    }

    fn record(&self) -> RunRecord {
        self.inner.record()
    }
}
