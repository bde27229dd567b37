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
use crate::taps::{Taps, names};
use crate::{Config, LayerKind};
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;
use std::time::Instant;

/// What a backend ran: every setting a parity report or a dump must state.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RunRecord {
    /// `reference` or `openvino` (or another backend's name).
    pub backend: String,
    /// The device (`CPU`, `NPU`, …), for device backends.
    pub device: Option<String>,
    /// The runtime's version (OpenVINO's build number, e.g. `2026.4.1-…`), for device backends.
    pub runtime: Option<String>,
    /// The device's own name (`FULL_DEVICE_NAME`).
    pub device_name: Option<String>,
    /// The device driver's version (`NPU_DRIVER_VERSION`), where reported.
    pub driver: Option<String>,
    /// The dtype of the host tensors (`f32`, or `f64` for a double-precision reference run).
    pub dtype: String,
    /// The inference precision asked of the device.
    pub precision_requested: Option<String>,
    /// The inference precision read back from the compiled graphs.
    pub precision: Option<String>,
    /// `EXECUTION_DEVICES` read back, where reported.
    pub execution_devices: Option<String>,
    /// Every property set on the device, as read back.
    pub properties: BTreeMap<String, String>,
    /// The weight format (`f32`, `f16`, `int4`, `int4:G`).
    pub weights: String,
    /// The delta-rule form of multi-token calls.
    pub deltanet_prefill: String,
    /// The delta-rule form of single-token calls.
    pub deltanet_decode: String,
    /// The DeltaNet output rescaling.
    pub output_scale: f64,
    /// The reference's prompt pieces (`None`: the whole prompt in one call).
    pub prefill_block: Option<usize>,
    /// A device's prompt block (tokens per graph call).
    pub block: Option<usize>,
    /// A device's static KV context.
    pub context: Option<usize>,
    /// Whether the backend records taps.
    pub taps: bool,
    /// Seconds spent building and compiling, for device backends.
    pub compile_seconds: Option<f64>,
    /// The device's on-disk model cache, when one was used.
    pub cache_dir: Option<String>,
    /// Per compiled graph (by name), whether it was loaded from the model cache (graphs whose device does not say
    /// are absent).
    pub from_cache: BTreeMap<String, bool>,
}

impl RunRecord {
    /// The model cache in words: `off`, or the directory and how many graphs came from it.
    pub fn cache_summary(&self) -> String {
        match &self.cache_dir {
            None => "off".into(),
            Some(dir) => {
                let hits = self.from_cache.values().filter(|&&h| h).count();
                format!(
                    "{dir}: {hits} of {} graphs loaded from the cache{}",
                    self.from_cache.len(),
                    if hits == 0 && !self.from_cache.is_empty() {
                        " (compiled and stored)"
                    } else {
                        ""
                    }
                )
            }
        }
    }

    /// The record as a dump's metadata (string values; see the dump format).
    pub fn to_metadata(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        let mut put = |k: &str, v: String| {
            m.insert(k.to_string(), v);
        };
        put("backend", self.backend.clone());
        put("dtype", self.dtype.clone());
        put("weights", self.weights.clone());
        put("deltanet_prefill", self.deltanet_prefill.clone());
        put("deltanet_decode", self.deltanet_decode.clone());
        put("output_scale", self.output_scale.to_string());
        if self.backend == "reference" {
            put(
                "prefill_block",
                self.prefill_block
                    .map_or("whole prompt".into(), |b| b.to_string()),
            );
        }
        let optional = [
            ("device", &self.device),
            ("device_name", &self.device_name),
            ("driver", &self.driver),
            ("openvino", &self.runtime),
            ("precision_requested", &self.precision_requested),
            ("precision", &self.precision),
            ("execution_devices", &self.execution_devices),
        ];
        for (k, v) in optional {
            if let Some(v) = v {
                put(k, v.clone());
            }
        }
        if let Some(b) = self.block {
            put("block", b.to_string());
        }
        if let Some(c) = self.context {
            put("context", c.to_string());
        }
        if let Some(s) = self.compile_seconds {
            put("compile_seconds", format!("{s:.3}"));
        }
        if let Some(d) = &self.cache_dir {
            put("cache_dir", d.clone());
        }
        for (graph, hit) in &self.from_cache {
            put(&format!("from_cache.{graph}"), hit.to_string());
        }
        for (k, v) in &self.properties {
            put(&format!("property.{k}"), v.clone());
        }
        m
    }
}

/// A state in the dump's names: the next token's position and every layer's state tensors (attention layers that
/// have seen no token have none).
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Tokens processed so far.
    pub position: usize,
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

    /// Whether [`Backend::snapshot`] and [`Backend::restore`] reach the backend's state. A stateful graph made
    /// elsewhere keeps its caches inside the runtime: it says `false`, its `snapshot` fails, and [`greedy`] and
    /// [`teacher_forced`] hand out an `after_prompt` with no tensors (comparisons then report the states as not
    /// exposed rather than compare nothing).
    fn exposes_state(&self) -> bool {
        true
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
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    if ids.is_empty() {
        return Err(Error::Input("no tokens to run".into()));
    }
    backend.config().check_token_ids(ids)?;
    let start = Instant::now();
    let first = backend.forward(ids, all_logits)?;
    let prompt_seconds = start.elapsed().as_secs_f64();
    let after_prompt = state_after(backend)?;
    let rows = first.logits.dim(0)?;
    let mut logits = first.logits.get(rows - 1)?;
    let mut tokens = Vec::with_capacity(max_new);
    let mut chosen_from = Vec::with_capacity(max_new);
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
            tensors: BTreeMap::new(),
        })
    }
}

fn has_nan(logits: &Tensor) -> Result<bool> {
    Ok(logits
        .to_dtype(DType::F64)?
        .to_vec1::<f64>()?
        .iter()
        .any(|x| x.is_nan()))
}

/// How prompt-lookup decoding drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupOptions {
    /// The longest n-gram looked up: the last `max_ngram` tokens of the context first, down to the last one.
    pub max_ngram: usize,
    /// The most draft tokens proposed per verify call.
    pub max_draft: usize,
}

impl Default for LookupOptions {
    fn default() -> Self {
        LookupOptions {
            max_ngram: 3,
            max_draft: 4,
        }
    }
}

/// What prompt-lookup decoding produced, and how often its drafts hit.
#[derive(Debug, Clone)]
pub struct Lookup {
    /// The chosen tokens (plain greedy's, when the backend computes a block as it computes single tokens).
    pub tokens: Vec<u32>,
    /// The logits `[V]` each token was chosen from.
    pub logits: Vec<Tensor>,
    /// Draft tokens proposed.
    pub proposed: usize,
    /// Draft tokens accepted (equal to the argmax chain of their verify call).
    pub accepted: usize,
    /// Forward calls, the prompt's included.
    pub forward_calls: usize,
    /// Forward calls that verified a draft.
    pub verify_calls: usize,
    /// Partial matches: the state restored from before the verify call and the accepted tokens fed again.
    pub refeeds: usize,
    /// Seconds spent on the prompt.
    pub prompt_seconds: f64,
    /// Seconds spent after the prompt.
    pub decode_seconds: f64,
    /// The index of the token the backend could not choose because its logits held a NaN (generation stopped).
    pub nan_at: Option<usize>,
}

impl Lookup {
    /// Accepted over proposed draft tokens (0 when nothing was proposed).
    pub fn acceptance(&self) -> f64 {
        if self.proposed == 0 {
            0.0
        } else {
            self.accepted as f64 / self.proposed as f64
        }
    }
}

/// The draft for the next tokens: the most recent earlier occurrence of the context's last `n` tokens (`n` from
/// `max_ngram` down to 1) that is followed by `max_draft` tokens, else the one followed by the most, and the tokens
/// that followed it there (at most `max_draft`). Empty when no n-gram recurs.
pub fn find_draft(context: &[u32], max_ngram: usize, max_draft: usize) -> Vec<u32> {
    let len = context.len();
    if max_draft == 0 {
        return Vec::new();
    }
    for n in (1..=max_ngram.min(len.saturating_sub(1))).rev() {
        let pattern = &context[len - n..];
        let mut best: Option<(usize, usize)> = None;
        // Occurrences starting before the pattern itself, the most recent first.
        for i in (0..len - n).rev() {
            if &context[i..i + n] != pattern {
                continue;
            }
            let follow = (len - (i + n)).min(max_draft);
            if best.is_none_or(|(_, f)| follow > f) {
                best = Some((i + n, follow));
            }
            if follow == max_draft {
                break;
            }
        }
        if let Some((from, follow)) = best {
            return context[from..from + follow].to_vec();
        }
    }
    Vec::new()
}

/// Prompt-lookup decoding from a fresh state: greedy generation whose next tokens are drafted from an earlier
/// n-gram of the context ([`find_draft`]) and verified in one forward call of [last token, drafts] with the logits
/// of every row; the longest prefix of the draft that matches the argmax chain is accepted, and the row after it
/// gives one more token. A recurrent state cannot be rolled back past rejected drafts, so on a partial match the
/// state taken before the verify call is restored and the accepted tokens are fed again. Stops as [`greedy`] does
/// (after `max_new` tokens, a token in `stop`, or logits holding a NaN) and needs no more cache slots than it.
pub fn prompt_lookup(
    backend: &mut dyn Backend,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    opts: LookupOptions,
) -> Result<Lookup> {
    if prompt.is_empty() {
        return Err(Error::Input("the prompt is empty".into()));
    }
    backend.config().check_token_ids(prompt)?;
    backend.reset()?;
    let start = Instant::now();
    let first = backend.forward(prompt, false)?;
    let prompt_seconds = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut out = Lookup {
        tokens: Vec::with_capacity(max_new),
        logits: Vec::with_capacity(max_new),
        proposed: 0,
        accepted: 0,
        forward_calls: 1,
        verify_calls: 0,
        refeeds: 0,
        prompt_seconds,
        decode_seconds: 0.0,
        nan_at: None,
    };
    let mut context = prompt.to_vec();
    let mut logits = first.logits.get(first.logits.dim(0)? - 1)?;
    'generate: while out.tokens.len() < max_new {
        if has_nan(&logits)? {
            out.nan_at = Some(out.tokens.len());
            break;
        }
        // `next` is chosen but not yet fed.
        let next = argmax(&logits)?;
        out.tokens.push(next);
        out.logits.push(logits.clone());
        context.push(next);
        if stop.contains(&next) || out.tokens.len() == max_new {
            break;
        }
        // Every accepted draft token and the one chosen after them must fit in `max_new`.
        let room = max_new - out.tokens.len() - 1;
        let draft = find_draft(&context, opts.max_ngram, opts.max_draft.min(room));
        if draft.is_empty() {
            logits = backend.forward(&[next], false)?.logits.get(0)?;
            out.forward_calls += 1;
            continue;
        }
        let before = backend.snapshot()?;
        let mut ids = Vec::with_capacity(draft.len() + 1);
        ids.push(next);
        ids.extend_from_slice(&draft);
        let rows = backend.forward(&ids, true)?.logits;
        out.forward_calls += 1;
        out.verify_calls += 1;
        out.proposed += draft.len();
        // Row j predicts the token after ids[j]: draft[j] is accepted when it is that row's argmax.
        let mut matched = 0;
        for (j, &d) in draft.iter().enumerate() {
            let row = rows.get(j)?;
            if has_nan(&row)? || argmax(&row)? != d {
                break;
            }
            out.tokens.push(d);
            out.logits.push(row);
            context.push(d);
            matched += 1;
            if stop.contains(&d) {
                out.accepted += matched;
                break 'generate;
            }
        }
        out.accepted += matched;
        logits = rows.get(matched)?;
        if matched < draft.len() {
            backend.restore(&before)?;
            backend.forward(&ids[..matched + 1], false)?;
            out.forward_calls += 1;
            out.refeeds += 1;
        }
    }
    out.decode_seconds = start.elapsed().as_secs_f64();
    Ok(out)
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
    backend.config().check_token_ids(continuation)?;
    backend.reset()?;
    let first = backend.forward(prompt, true)?;
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
            record,
        })
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
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
        let mut taps = if self.taps || all_logits {
            Taps::on()
        } else {
            Taps::off()
        };
        let last = self
            .model
            .prefill(ids, &mut self.state, &self.opts, &mut taps)?;
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

    fn snapshot(&self) -> Result<Snapshot> {
        Ok(Snapshot {
            position: self.state.position,
            tensors: self.state.named_tensors().into_iter().collect(),
        })
    }

    fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        self.state = state_from_snapshot(&self.model, snapshot)?;
        Ok(())
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
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::small_config_json;
    use candle_core::Device;

    #[test]
    fn drafts_come_from_the_most_recent_earlier_ngram() {
        // The last 3 tokens (7, 8, 9) occur at 1..4, followed by 4, 5.
        assert_eq!(
            find_draft(&[1, 7, 8, 9, 4, 5, 7, 8, 9], 3, 4),
            vec![4, 5, 7, 8]
        );
        assert_eq!(find_draft(&[1, 7, 8, 9, 4, 5, 7, 8, 9], 3, 2), vec![4, 5]);
        // No 3- or 2-gram recurs; the last token (9) does.
        assert_eq!(find_draft(&[9, 1, 2, 3, 9], 3, 4), vec![1, 2, 3, 9]);
        // Of two occurrences the most recent one with a full draft wins.
        assert_eq!(find_draft(&[5, 1, 5, 2, 3, 4, 6, 5], 1, 3), vec![2, 3, 4]);
        // The most recent one is followed by fewer tokens than asked: the earlier full one is taken.
        assert_eq!(find_draft(&[5, 1, 2, 3, 5, 6, 5], 1, 3), vec![1, 2, 3]);
        // A loop of period 1: the draft overlaps the pattern.
        assert_eq!(find_draft(&[4, 4, 4], 2, 4), vec![4]);
        assert!(find_draft(&[1, 2, 3], 3, 4).is_empty());
        assert!(find_draft(&[1], 3, 4).is_empty());
        assert!(find_draft(&[1, 1, 1], 3, 0).is_empty());
    }

    /// A backend whose next token is a function of everything it has been fed (3·Σ ids + ⌊len/5⌋ mod 7, one-hot
    /// logits), so a rejected draft left in its state would change every later token. `restores` counts restores;
    /// `forgetful` ignores them (the fault prompt lookup must not have).
    struct Counting {
        config: Config,
        record: RunRecord,
        fed: Vec<u32>,
        restores: usize,
        forgetful: bool,
    }

    impl Counting {
        fn new(forgetful: bool) -> Self {
            let json = small_config_json().to_string();
            Counting {
                config: Config::from_json_str(&json, "test").unwrap(),
                record: RunRecord::default(),
                fed: Vec::new(),
                restores: 0,
                forgetful,
            }
        }

        fn next(fed: &[u32]) -> usize {
            let sum: u32 = fed.iter().sum();
            ((3 * sum as usize) + fed.len() / 5) % 7
        }
    }

    impl Backend for Counting {
        fn config(&self) -> &Config {
            &self.config
        }
        fn record(&self) -> &RunRecord {
            &self.record
        }
        fn reset(&mut self) -> Result<()> {
            self.fed.clear();
            Ok(())
        }
        fn forward(&mut self, ids: &[u32], all_logits: bool) -> Result<Forward> {
            let v = self.config.vocab_size;
            let mut rows = Vec::new();
            for &id in ids {
                self.fed.push(id);
                let mut row = vec![0f32; v];
                row[Self::next(&self.fed)] = 1.0;
                rows.push(row);
            }
            if !all_logits {
                rows.drain(..rows.len() - 1);
            }
            let n = rows.len();
            let flat: Vec<f32> = rows.concat();
            Ok(Forward {
                logits: Tensor::from_vec(flat, (n, v), &Device::Cpu)?,
                taps: BTreeMap::new(),
            })
        }
        fn snapshot(&self) -> Result<Snapshot> {
            let fed = Tensor::from_vec(self.fed.clone(), self.fed.len(), &Device::Cpu)?;
            Ok(Snapshot {
                position: self.fed.len(),
                tensors: [("fed".to_string(), fed)].into(),
            })
        }
        fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
            self.restores += 1;
            if !self.forgetful {
                self.fed = snapshot.get("fed")?.to_vec1()?;
            }
            Ok(())
        }
    }

    #[test]
    fn prompt_lookup_gives_greedys_tokens_restoring_after_partial_matches() {
        let prompt = [1, 2, 3, 1, 2, 3];
        let mut b = Counting::new(false);
        let plain = greedy(&mut b, &prompt, 30, &[], false, |_| Ok(())).unwrap();
        let l = prompt_lookup(&mut b, &prompt, 30, &[], LookupOptions::default()).unwrap();
        assert_eq!(l.tokens, plain.tokens);
        assert_eq!(l.tokens.len(), 30);
        assert_eq!(l.logits.len(), 30);
        // Drafts were proposed, some accepted and some rejected (each rejection a restore and a re-feed).
        assert!(l.accepted > 0 && l.accepted < l.proposed, "{l:?}");
        assert!(l.refeeds > 0);
        assert_eq!(b.restores, l.refeeds);
        // Every call accounted for: the prompt, single-token steps, verify calls and re-feeds.
        let singles = l.forward_calls - 1 - l.verify_calls - l.refeeds;
        assert_eq!(singles + l.verify_calls + l.accepted, l.tokens.len() - 1);
        // The state holds exactly the tokens fed, never a rejected draft: prompt and every token but the last.
        assert_eq!(b.fed.len(), prompt.len() + 29);

        // Without the restore the rejected drafts stay in the state and the tokens change.
        let mut forgetful = Counting::new(true);
        let l = prompt_lookup(&mut forgetful, &prompt, 30, &[], LookupOptions::default()).unwrap();
        assert_ne!(l.tokens, plain.tokens);
    }

    #[test]
    fn prompt_lookup_stops_like_greedy() {
        let prompt = [1, 2, 3, 1, 2, 3];
        let mut b = Counting::new(false);
        let plain = greedy(&mut b, &prompt, 30, &[], false, |_| Ok(())).unwrap();
        // Stop at the first 5 greedy chooses, wherever it lands (a draft or a chosen token).
        let stop = [5];
        let until = plain.tokens.iter().position(|&t| t == 5).unwrap() + 1;
        for k in 1..=5 {
            let opts = LookupOptions {
                max_ngram: 3,
                max_draft: k,
            };
            let l = prompt_lookup(&mut b, &prompt, 30, &stop, opts).unwrap();
            assert_eq!(l.tokens, plain.tokens[..until], "max_draft {k}");
            // And never past max_new.
            for n in [1, 2, 7] {
                let l = prompt_lookup(&mut b, &prompt, n, &[], opts).unwrap();
                assert_eq!(l.tokens, plain.tokens[..n], "max_draft {k}, {n} tokens");
            }
        }
    }

    /// On the reference (the bundled tiny model), a chat prompt that repeats itself: drafts are proposed, some hit,
    /// and the tokens are greedy's.
    #[test]
    fn prompt_lookup_on_the_reference_gives_greedys_tokens() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny");
        let model = Model::load(&dir, DType::F32).unwrap();
        let tok = crate::tokenizer::ChatTokenizer::load(&dir).unwrap();
        let text = "the cat sat on the mat. ".repeat(4);
        let message = crate::tokenizer::Message::new("user", text.trim());
        let prompt = tok.encode_chat(&[message], false).unwrap();
        let mut b = ReferenceBackend::new(model, RunOptions::default(), false, "f32").unwrap();
        let plain = greedy(&mut b, &prompt, 64, &[], false, |_| Ok(())).unwrap();
        let l = prompt_lookup(&mut b, &prompt, 64, &[], LookupOptions::default()).unwrap();
        assert_eq!(l.tokens, plain.tokens);
        // A verify row and a single-token call compute the same logits up to f32 rounding (chunked vs matrix form).
        for (a, g) in l.logits.iter().zip(&plain.logits) {
            let d = (a - g).unwrap().abs().unwrap().max_all().unwrap();
            assert!(d.to_scalar::<f32>().unwrap() < 1e-4);
        }
        println!(
            "tiny: {} tokens, {} of {} drafts accepted, {} forward calls ({} verify, {} re-feeds)",
            l.tokens.len(),
            l.accepted,
            l.proposed,
            l.forward_calls,
            l.verify_calls,
            l.refeeds
        );
        assert!(l.accepted > 0 && l.refeeds > 0, "{l:?}");
    }
}
