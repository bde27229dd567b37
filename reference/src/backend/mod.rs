//! One interface for everything that computes the decoder: the reference itself, an OpenVINO device's graphs, and
//! the backends to come (a numeric-model pseudo-device, graphs made elsewhere). A backend runs tokens from its
//! current state, hands its state out and takes one back, and records what it ran; [`greedy`] and
//! [`teacher_forced`] are the only generation loops, so every backend is driven the same way.
//!
//! States travel as a [`Snapshot`]: the position and the tensors under the dump's names (`layers.{i}.conv_state`,
//! `recurrent_state`, `key_cache`, `value_cache`), the currency every backend reads and writes, so that a state can
//! be compared across backends or fed from one to another.

use crate::error::{Error, Result};
use crate::model::{LayerState, Model, RunOptions, State, argmax, state_names};
use crate::rope::Positions;
use crate::taps::{SharedTapSink, Taps, names};
use crate::{Config, LayerKind};
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;
use std::time::Instant;

mod lookup;
mod record;

pub use lookup::{Lookup, LookupOptions, find_draft, prompt_lookup};
pub use record::{Precision, RunRecord};

/// A state in the dump's names: the next token's position and every layer's state tensors (attention layers that
/// have seen no token have none).
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Tokens processed so far.
    pub position: usize,
    /// The next text position minus `position` (0 for text; negative after an image, see
    /// [`crate::model::State::rope_delta`]).
    pub rope_delta: i64,
    /// `layers.{i}.conv_state` `[C, K]`, `recurrent_state` `[Hv, Dk, Dv]`, `key_cache`, `value_cache` `[Hkv, P, D]`.
    pub tensors: BTreeMap<String, Tensor>,
}

impl Snapshot {
    /// The tensor called `name`, or an error naming it.
    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .ok_or_else(|| Error::Input(format!("the state has no tensor `{name}`")))
    }
}

/// What one forward call produced.
#[derive(Debug, Clone)]
pub struct Forward {
    /// Logits `[T, V]` of every token of the call when asked for, else `[1, V]` of the last one.
    pub logits: Tensor,
    /// Token-major taps of the call under the dump's names (empty when the backend records none).
    pub taps: BTreeMap<String, Tensor>,
}

/// A prompt whose image or video tokens carry the vision tower's rows: its ids (image and video placeholders
/// included), their embeddings `[T, H]` (the table's rows, but the tower's at the placeholders) and their MRoPE
/// positions from the start of the sequence (transformers' `get_rope_index`).
#[derive(Debug, Clone)]
pub struct EmbeddedPrompt {
    /// The token ids.
    pub ids: Vec<u32>,
    /// One row per token.
    pub embeddings: Tensor,
    /// `[3, T]`.
    pub positions: Positions,
}

impl EmbeddedPrompt {
    /// Fails unless the ids, the embeddings' rows and the positions count the same tokens (at least one) of
    /// `hidden` values each.
    pub fn check(&self, hidden: usize) -> Result<()> {
        let (rows, width) = self.embeddings.dims2()?;
        if self.ids.is_empty()
            || rows != self.ids.len()
            || self.positions.len() != rows
            || width != hidden
        {
            return Err(Error::Input(format!(
                "a prompt of {} ids with embeddings {:?} and {} positions: expected one row of {hidden} and one \
                 position per id",
                self.ids.len(),
                self.embeddings.dims(),
                self.positions.len()
            )));
        }
        Ok(())
    }

    /// Tokens `from..from + len` of the prompt, with their rows and positions (a call's piece of it).
    pub fn slice(&self, from: usize, len: usize) -> Result<EmbeddedPrompt> {
        if from + len > self.ids.len() {
            return Err(Error::Input(format!(
                "tokens {from}..{} of a prompt of {}",
                from + len,
                self.ids.len()
            )));
        }
        Ok(EmbeddedPrompt {
            ids: self.ids[from..from + len].to_vec(),
            embeddings: self.embeddings.narrow(0, from, len)?,
            positions: Positions(
                self.positions
                    .0
                    .each_ref()
                    .map(|r| r[from..from + len].to_vec()),
            ),
        })
    }
}

/// A backend: runs tokens from its state, and hands its state out and back.
pub trait Backend {
    /// The model's configuration.
    fn config(&self) -> &Config;

    /// What this backend runs.
    fn record(&self) -> &RunRecord;

    /// Forgets every state: the next call starts a sequence at position 0.
    fn reset(&mut self) -> Result<()>;

    /// Runs `ids` (at the positions following the state's) and updates the state. `all_logits` asks for the logits
    /// of every token, not only the last one's.
    fn forward(&mut self, ids: &[u32], all_logits: bool) -> Result<Forward>;

    /// Runs a prompt given as embeddings and positions ([`EmbeddedPrompt`]: one with images) from the current
    /// state, like [`Backend::forward`]; the following calls continue from the positions it ends at. A backend whose
    /// graphs take token ids only refuses it (the default).
    fn forward_embedded(&mut self, prompt: &EmbeddedPrompt, all_logits: bool) -> Result<Forward> {
        let _ = (prompt, all_logits);
        Err(Error::Input(format!(
            "the {} backend takes token ids only: it cannot run a prompt with images (its graphs need an \
             `embeddings` input and three rows of positions)",
            self.record().backend
        )))
    }

    /// Whether [`Backend::snapshot`] and [`Backend::restore`] reach the backend's state. A stateful graph made
    /// elsewhere keeps its caches inside the runtime: it says `false`, its `snapshot` fails, and [`greedy`] and
    /// [`teacher_forced`] hand out an `after_prompt` with no tensors (comparisons then report the states as not
    /// exposed rather than compare nothing).
    fn exposes_state(&self) -> bool {
        self.state_hidden().is_none()
    }

    /// Why the state is not exposed, as reports say it (`not exposed: …`, naming where the backend keeps it and
    /// what would expose it); `None` (the default) when [`Backend::snapshot`] and [`Backend::restore`] reach it.
    fn state_hidden(&self) -> Option<&'static str> {
        None
    }

    /// Tokens processed since the last reset (the next token's position). By default the snapshot's; a backend
    /// that does not expose its state says it directly.
    fn position(&self) -> Result<usize> {
        Ok(self.snapshot()?.position)
    }

    /// The current state.
    fn snapshot(&self) -> Result<Snapshot>;

    /// Replaces the state (e.g. a snapshot taken earlier, or another backend's).
    fn restore(&mut self, snapshot: &Snapshot) -> Result<()>;

    /// Sends the taps of the following forward calls, and the logits of every row they compute (as `logits`), to
    /// `sink` as they are computed, instead of returning them in [`Forward`] (whose logits are then the last row's
    /// only); `None` returns them again. Whether taps now go to the sink: a backend that records none, or cannot
    /// stream them (the default), goes on returning them.
    fn stream_taps(&mut self, sink: Option<SharedTapSink>) -> bool {
        let _ = sink;
        false
    }
}

/// Greedy generation from a fresh state: the prompt, then tokens chosen by argmax.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The prompt's forward call (its logits of every position when asked for, and its taps).
    pub prompt: Forward,
    /// The state right after the prompt (no tensors when the backend does not expose its state).
    pub after_prompt: Snapshot,
    /// The chosen tokens.
    pub tokens: Vec<u32>,
    /// The logits `[V]` each token was chosen from (the first from the prompt's last position).
    pub logits: Vec<Tensor>,
    /// Seconds spent on the prompt.
    pub prompt_seconds: f64,
    /// Seconds spent on the single-token calls.
    pub decode_seconds: f64,
    /// The index of the token the backend could not choose because its logits held a NaN (generation stopped
    /// there): a device fault, reported rather than turned into an error.
    pub nan_at: Option<usize>,
}

/// Runs `prompt` from a fresh state, then up to `max_new` greedy tokens, feeding each back as a single-token call;
/// stops after a token in `stop`, or when the logits hold a NaN (see [`Generation::nan_at`]). `all_logits` keeps
/// the logits of every prompt position. `on_token` sees every token as it is chosen.
pub fn greedy(
    backend: &mut dyn Backend,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    all_logits: bool,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(Error::Input("the prompt is empty".into()));
    }
    backend.config().check_token_ids(prompt)?;
    backend.reset()?;
    continue_greedy(backend, prompt, max_new, stop, all_logits, on_token)
}

/// [`greedy`] from the backend's current state instead of a fresh one: `ids` run at the positions following the
/// state's (a follow-up turn on a conversation's state, the prefix reused), then up to `max_new` greedy tokens.
pub fn continue_greedy(
    backend: &mut dyn Backend,
    ids: &[u32],
    max_new: usize,
    stop: &[u32],
    all_logits: bool,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    if ids.is_empty() {
        return Err(Error::Input("no tokens to run".into()));
    }
    backend.config().check_token_ids(ids)?;
    generate(
        backend,
        |b| b.forward(ids, all_logits),
        max_new,
        stop,
        on_token,
    )
}

/// [`greedy`] from a prompt with images: from a fresh state, `prompt` in one call, then up to `max_new` greedy
/// tokens at the text positions following the prompt's.
pub fn greedy_embedded(
    backend: &mut dyn Backend,
    prompt: &EmbeddedPrompt,
    max_new: usize,
    stop: &[u32],
    all_logits: bool,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    prompt.check(backend.config().hidden_size)?;
    backend.config().check_token_ids(&prompt.ids)?;
    backend.reset()?;
    generate(
        backend,
        |b| b.forward_embedded(prompt, all_logits),
        max_new,
        stop,
        on_token,
    )
}

/// The generation loop: `first` runs the prompt, then greedy single-token calls.
fn generate(
    backend: &mut dyn Backend,
    first: impl FnOnce(&mut dyn Backend) -> Result<Forward>,
    max_new: usize,
    stop: &[u32],
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    let start = Instant::now();
    let first = first(backend)?;
    let prompt_seconds = start.elapsed().as_secs_f64();
    let after_prompt = state_after(backend)?;
    let rows = first.logits.dim(0)?;
    let mut logits = first.logits.get(rows - 1)?;
    // Reserved for what a run of this size holds, not for any count asked (a huge count must not allocate).
    let reserve = max_new.min(4096);
    let mut tokens = Vec::with_capacity(reserve);
    let mut chosen_from = Vec::with_capacity(reserve);
    let start = Instant::now();
    let mut nan_at = None;
    for n in 0..max_new {
        if has_nan(&logits)? {
            nan_at = Some(n);
            break;
        }
        let next = argmax(&logits)?;
        tokens.push(next);
        chosen_from.push(logits.clone());
        on_token(next)?;
        if stop.contains(&next) || n + 1 == max_new {
            break;
        }
        logits = backend.forward(&[next], false)?.logits.get(0)?;
    }
    Ok(Generation {
        prompt: first,
        after_prompt,
        tokens,
        logits: chosen_from,
        prompt_seconds,
        decode_seconds: start.elapsed().as_secs_f64(),
        nan_at,
    })
}

/// The backend's state: its snapshot, or no tensors when it does not expose its state.
fn state_after(backend: &dyn Backend) -> Result<Snapshot> {
    if backend.exposes_state() {
        backend.snapshot()
    } else {
        Ok(Snapshot {
            position: backend.position()?,
            rope_delta: 0,
            tensors: BTreeMap::new(),
        })
    }
}

/// Whether `logits` hold a NaN (a device fault: generation stops there).
pub(crate) fn has_nan(logits: &Tensor) -> Result<bool> {
    Ok(logits
        .to_dtype(DType::F64)?
        .to_vec1::<f64>()?
        .iter()
        .any(|x| x.is_nan()))
}

/// A teacher-forced run: the logits and taps of every position, and the state after the prompt.
#[derive(Debug, Clone)]
pub struct Forced {
    /// Logits `[T + N, V]` (row `i` predicts token `i + 1` of `prompt ++ continuation`) and the taps of every
    /// position, concatenated along the token axis.
    pub run: Forward,
    /// The state right after the prompt.
    pub after_prompt: Snapshot,
}

/// Teacher forcing: from a fresh state, the prompt in one call and then each token of `continuation` in a
/// single-token call, whatever the backend would have chosen.
pub fn teacher_forced(
    backend: &mut dyn Backend,
    prompt: &[u32],
    continuation: &[u32],
) -> Result<Forced> {
    if prompt.is_empty() {
        return Err(Error::Input("the prompt is empty".into()));
    }
    backend.config().check_token_ids(prompt)?;
    forced_from(backend, |b| b.forward(prompt, true), continuation)
}

/// [`teacher_forced`] from a prompt with images: from a fresh state, `prompt` in one call, then each token of
/// `continuation` in a single-token call.
pub fn teacher_forced_embedded(
    backend: &mut dyn Backend,
    prompt: &EmbeddedPrompt,
    continuation: &[u32],
) -> Result<Forced> {
    prompt.check(backend.config().hidden_size)?;
    backend.config().check_token_ids(&prompt.ids)?;
    forced_from(backend, |b| b.forward_embedded(prompt, true), continuation)
}

/// The teacher-forcing loop from a fresh state: `first` runs the prompt with every row's logits.
fn forced_from(
    backend: &mut dyn Backend,
    first: impl FnOnce(&mut dyn Backend) -> Result<Forward>,
    continuation: &[u32],
) -> Result<Forced> {
    backend.config().check_token_ids(continuation)?;
    backend.reset()?;
    let first = first(backend)?;
    let after_prompt = state_after(backend)?;
    let mut logits = vec![first.logits];
    let mut taps: BTreeMap<String, Vec<Tensor>> =
        first.taps.into_iter().map(|(k, v)| (k, vec![v])).collect();
    for &id in continuation {
        let step = backend.forward(&[id], false)?;
        logits.push(step.logits);
        for (name, t) in step.taps {
            taps.entry(name).or_default().push(t);
        }
    }
    let taps = taps
        .into_iter()
        .map(|(k, v)| Ok((k, Tensor::cat(&v, 0)?)))
        .collect::<Result<_>>()?;
    Ok(Forced {
        run: Forward {
            logits: Tensor::cat(&logits, 0)?,
            taps,
        },
        after_prompt,
    })
}

/// The reference decoder as a backend.
pub struct ReferenceBackend {
    model: Model,
    opts: RunOptions,
    state: State,
    taps: bool,
    sink: Option<SharedTapSink>,
    record: RunRecord,
}

impl ReferenceBackend {
    /// The reference on `model`, computing as `opts` say, recording taps when `taps` is set; `weights` names the
    /// weight format the model was loaded with.
    pub fn new(model: Model, opts: RunOptions, taps: bool, weights: &str) -> Result<Self> {
        let record = RunRecord {
            backend: "reference".into(),
            dtype: match model.dtype() {
                DType::F64 => "f64".into(),
                _ => "f32".into(),
            },
            weights: weights.to_string(),
            deltanet_prefill: opts.prefill.describe(),
            deltanet_decode: opts.decode.describe(),
            output_scale: opts.output_scale,
            prefill_block: opts.prefill_block,
            taps,
            ..RunRecord::default()
        };
        let state = model.new_state()?;
        Ok(ReferenceBackend {
            model,
            opts,
            state,
            taps,
            sink: None,
            record,
        })
    }

    /// The backend with `key` recorded as `value` in its run record's properties (how the weights compute, say).
    pub fn with_property(mut self, key: &str, value: &str) -> Self {
        self.record
            .properties
            .insert(key.to_string(), value.to_string());
        self
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The taps of the next call: streamed to the sink, recorded, or off.
    fn taps_for(&self, all_logits: bool) -> Taps {
        match &self.sink {
            Some(sink) => Taps::stream(sink.clone(), self.state.position),
            None if self.taps || all_logits => Taps::on(),
            None => Taps::off(),
        }
    }

    /// A call's [`Forward`] from its taps and last row of logits.
    fn finish(&self, mut taps: Taps, last: Tensor, all_logits: bool) -> Result<Forward> {
        let mut taps = taps.take();
        let logits = match taps.remove(names::LOGITS) {
            Some(all) if all_logits => all,
            _ => last.unsqueeze(0)?,
        };
        if !self.taps {
            taps.clear();
        }
        Ok(Forward { logits, taps })
    }
}

impl Backend for ReferenceBackend {
    fn config(&self) -> &Config {
        self.model.config()
    }

    fn record(&self) -> &RunRecord {
        &self.record
    }

    fn reset(&mut self) -> Result<()> {
        self.state = self.model.new_state()?;
        Ok(())
    }

    fn forward(&mut self, ids: &[u32], all_logits: bool) -> Result<Forward> {
        let mut taps = self.taps_for(all_logits);
        let last = self
            .model
            .prefill(ids, &mut self.state, &self.opts, &mut taps)?;
        self.finish(taps, last, all_logits)
    }

    fn forward_embedded(&mut self, prompt: &EmbeddedPrompt, all_logits: bool) -> Result<Forward> {
        prompt.check(self.model.config().hidden_size)?;
        self.model.check_ids(&prompt.ids)?;
        let mut taps = self.taps_for(all_logits);
        let last = self.model.forward_embedded(
            prompt.embeddings.clone(),
            &prompt.positions,
            &mut self.state,
            &self.opts,
            &mut taps,
        )?;
        self.finish(taps, last, all_logits)
    }

    fn snapshot(&self) -> Result<Snapshot> {
        Ok(Snapshot {
            position: self.state.position,
            rope_delta: self.state.rope_delta,
            tensors: self.state.named_tensors().into_iter().collect(),
        })
    }

    fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        self.state = state_from_snapshot(&self.model, snapshot)?;
        Ok(())
    }

    /// Streams when the backend records taps: every layer's go to the sink as soon as they are computed.
    fn stream_taps(&mut self, sink: Option<SharedTapSink>) -> bool {
        self.sink = sink.filter(|_| self.taps);
        self.sink.is_some()
    }
}

/// The reference's [`State`] holding a snapshot's tensors (converted to the model's dtype), checked against the
/// shapes of a fresh state.
pub fn state_from_snapshot(model: &Model, snapshot: &Snapshot) -> Result<State> {
    let fresh = model.new_state()?;
    let mut layers = Vec::with_capacity(fresh.layers.len());
    for (i, layer) in fresh.layers.into_iter().enumerate() {
        let kind = match layer {
            LayerState::Linear(_) => LayerKind::Linear,
            LayerState::Attention(_) => LayerKind::Full,
        };
        let [a, b] = state_names(i, kind);
        let take = |name: &str| -> Result<Option<Tensor>> {
            snapshot
                .tensors
                .get(name)
                .map(|t| t.to_dtype(model.dtype()).map_err(Error::from))
                .transpose()
        };
        layers.push(match layer {
            LayerState::Linear(zero) => {
                let (conv, recurrent) = (
                    take(&a)?.ok_or_else(|| Error::Input(format!("the state has no `{a}`")))?,
                    take(&b)?.ok_or_else(|| Error::Input(format!("the state has no `{b}`")))?,
                );
                for (name, t, z) in [(&a, &conv, &zero.conv), (&b, &recurrent, &zero.recurrent)] {
                    if t.dims() != z.dims() {
                        return Err(Error::Input(format!(
                            "`{name}` has shape {:?}, the model's is {:?}",
                            t.dims(),
                            z.dims()
                        )));
                    }
                }
                LayerState::Linear(crate::linear_attn::LinearState { conv, recurrent })
            }
            LayerState::Attention(_) => {
                let (keys, values) = (take(&a)?, take(&b)?);
                if keys.is_some() != values.is_some() {
                    return Err(Error::Input(format!(
                        "layer {i}: the state has one of `{a}` and `{b}` but not the other"
                    )));
                }
                let expected = model.config().num_key_value_heads;
                if let (Some(k), Some(v)) = (&keys, &values)
                    && (k.dims() != v.dims()
                        || k.rank() != 3
                        || k.dim(0)? != expected
                        || k.dim(2)? != model.config().head_dim)
                {
                    return Err(Error::Input(format!(
                        "layer {i}: keys {:?} and values {:?} are not [{expected}, P, {}]",
                        k.dims(),
                        v.dims(),
                        model.config().head_dim
                    )));
                }
                LayerState::Attention(crate::attention::KvCache { keys, values })
            }
        });
    }
    Ok(State {
        position: snapshot.position,
        rope_delta: snapshot.rope_delta,
        layers,
    })
}
