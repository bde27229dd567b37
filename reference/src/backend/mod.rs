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

mod lookup;

pub use lookup::{Lookup, LookupOptions, find_draft, prompt_lookup};

/// The arithmetic a backend computed in: f32 (or f64) on the host, or what a device read back from its compiled
/// graphs (`INFERENCE_PRECISION_HINT`), which may not be what was asked (the CPU plugin asked for f16 computes bf16
/// where it has no f16 arithmetic).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Precision {
    /// 64-bit floats (a double-precision reference run).
    F64,
    /// 32-bit floats.
    F32,
    /// 16-bit floats.
    F16,
    /// bfloat16.
    Bf16,
    /// Anything else a device reports (its own word for it, kept as it is: `dynamic`, `undefined`, …).
    Other(String),
}

impl Precision {
    /// Reads a precision as devices, dumps and the command line write it (`f32`, `FP16`, `bf16`, …); another word
    /// is kept as [`Precision::Other`].
    pub fn parse(s: &str) -> Precision {
        match s.trim().to_ascii_lowercase().as_str() {
            "f64" | "fp64" => Precision::F64,
            "f32" | "fp32" => Precision::F32,
            "f16" | "fp16" => Precision::F16,
            "bf16" => Precision::Bf16,
            _ => Precision::Other(s.trim().to_string()),
        }
    }

    /// Whether this is full single (or double) precision, which is judged by the tight thresholds.
    pub fn is_full(&self) -> bool {
        matches!(self, Precision::F32 | Precision::F64)
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F64 => "f64",
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
            Precision::Other(s) => s,
        })
    }
}

impl serde::Serialize for Precision {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

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
    pub precision_requested: Option<Precision>,
    /// The inference precision read back from the compiled graphs.
    pub precision: Option<Precision>,
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

    /// The precision the run is judged by: the one read back, else the one asked, else the host dtype's (a dump
    /// written by another program that says nothing is held to f32).
    pub fn judged_precision(&self) -> Precision {
        self.precision
            .clone()
            .or_else(|| self.precision_requested.clone())
            .unwrap_or_else(|| Precision::parse(&self.dtype))
    }

    /// The precision read back, in words (`not reported` when the backend says nothing).
    pub fn precision_text(&self) -> String {
        self.precision
            .as_ref()
            .map_or_else(|| "not reported".into(), |p| p.to_string())
    }

    /// The record as a dump's metadata (string values; see the dump format). [`RunRecord::from_metadata`] reads it
    /// back.
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
        put("taps", self.taps.to_string());
        if self.backend == "reference" {
            put(
                "prefill_block",
                self.prefill_block
                    .map_or(WHOLE_PROMPT.into(), |b| b.to_string()),
            );
        }
        let optional = [
            ("device", &self.device),
            ("device_name", &self.device_name),
            ("driver", &self.driver),
            ("openvino", &self.runtime),
            ("execution_devices", &self.execution_devices),
            ("cache_dir", &self.cache_dir),
        ];
        for (k, v) in optional {
            if let Some(v) = v {
                put(k, v.clone());
            }
        }
        for (k, v) in [
            ("precision_requested", &self.precision_requested),
            ("precision", &self.precision),
        ] {
            if let Some(v) = v {
                put(k, v.to_string());
            }
        }
        if let Some(b) = self.block {
            put("block", b.to_string());
        }
        if let Some(c) = self.context {
            put("context", c.to_string());
        }
        if let Some(s) = self.compile_seconds {
            put("compile_seconds", s.to_string());
        }
        for (graph, hit) in &self.from_cache {
            put(&format!("from_cache.{graph}"), hit.to_string());
        }
        for (k, v) in &self.properties {
            put(&format!("property.{k}"), v.clone());
        }
        m
    }

    /// The record a dump's metadata holds ([`RunRecord::to_metadata`]'s inverse). Keys another program may not
    /// write have these values when absent: `backend` `unknown`, `dtype` `f32`, `weights`, `deltanet_prefill` and
    /// `deltanet_decode` empty, `output_scale` 1, `taps` true (a dump holds its taps), every optional field none.
    /// A value that does not parse is an error naming its key; keys of the dump format that are not the record's
    /// (`model`, `prompt`, `prompt_seconds`, …) are ignored.
    pub fn from_metadata(m: &BTreeMap<String, String>) -> Result<RunRecord> {
        let get = |k: &str| m.get(k).cloned();
        fn parsed<T: std::str::FromStr>(
            m: &BTreeMap<String, String>,
            k: &str,
        ) -> Result<Option<T>> {
            m.get(k)
                .map(|v| {
                    v.trim().parse::<T>().map_err(|_| {
                        Error::Input(format!("metadata `{k}`: `{v}` is not a valid value"))
                    })
                })
                .transpose()
        }
        let prefill_block = match m.get("prefill_block").map(String::as_str) {
            None | Some(WHOLE_PROMPT) => None,
            Some(_) => parsed::<usize>(m, "prefill_block")?,
        };
        let from_cache = m
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("from_cache.")?, v)))
            .map(|(g, v)| match v.as_str() {
                "true" => Ok((g.to_string(), true)),
                "false" => Ok((g.to_string(), false)),
                other => Err(Error::Input(format!(
                    "metadata `from_cache.{g}`: `{other}` is neither true nor false"
                ))),
            })
            .collect::<Result<_>>()?;
        Ok(RunRecord {
            backend: get("backend").unwrap_or_else(|| "unknown".into()),
            device: get("device"),
            runtime: get("openvino"),
            device_name: get("device_name"),
            driver: get("driver"),
            dtype: get("dtype").unwrap_or_else(|| "f32".into()),
            precision_requested: m.get("precision_requested").map(|p| Precision::parse(p)),
            precision: m.get("precision").map(|p| Precision::parse(p)),
            execution_devices: get("execution_devices"),
            properties: m
                .iter()
                .filter_map(|(k, v)| Some((k.strip_prefix("property.")?.to_string(), v.clone())))
                .collect(),
            weights: get("weights").unwrap_or_default(),
            deltanet_prefill: get("deltanet_prefill").unwrap_or_default(),
            deltanet_decode: get("deltanet_decode").unwrap_or_default(),
            output_scale: parsed(m, "output_scale")?.unwrap_or(1.0),
            prefill_block,
            block: parsed(m, "block")?,
            context: parsed(m, "context")?,
            taps: parsed(m, "taps")?.unwrap_or(true),
            compile_seconds: parsed(m, "compile_seconds")?,
            cache_dir: get("cache_dir"),
            from_cache,
        })
    }
}

/// How the metadata says the reference ran its prompt in one call.
const WHOLE_PROMPT: &str = "whole prompt";

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
