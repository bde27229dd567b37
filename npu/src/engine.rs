//! Running the static graphs over a whole sequence: prompts in padded blocks, caches kept on the host and handed
//! between calls, greedy decoding. Produces the reference's dump names, so the two can be compared tensor for
//! tensor.

use crate::devices::{CompileOptions, compile};
use crate::error::{Error, Result};
use crate::graphs::Builder;
use crate::infer::Session;
use candle_core::{DType, Device, Tensor};
use reference::config::{Config, LayerKind};
use reference::model::state_names;
use std::collections::BTreeMap;

/// The state of one layer, kept on the host between graph calls.
#[derive(Debug, Clone)]
pub enum HostLayerState {
    /// Conv `[C, K]` and recurrent `[Hv, Dk, Dv]` states.
    Linear {
        /// Conv state.
        conv: Tensor,
        /// Recurrent state.
        recurrent: Tensor,
    },
    /// A static KV cache `[Hkv, CTX, D]` of which the first `len` slots are filled.
    Attention {
        /// Keys.
        keys: Tensor,
        /// Values.
        values: Tensor,
        /// Filled slots.
        len: usize,
    },
}

impl HostLayerState {
    /// The zero state of `layer`.
    pub fn zeros(config: &Config, layer: usize, context: usize) -> Result<Self> {
        let dev = &Device::Cpu;
        Ok(match config.layer_types[layer] {
            LayerKind::Linear => HostLayerState::Linear {
                conv: Tensor::zeros(
                    (config.linear_conv_dim(), config.linear_conv_kernel_dim),
                    DType::F32,
                    dev,
                )?,
                recurrent: Tensor::zeros(
                    (
                        config.linear_num_value_heads,
                        config.linear_key_head_dim,
                        config.linear_value_head_dim,
                    ),
                    DType::F32,
                    dev,
                )?,
            },
            LayerKind::Full => {
                let shape = (config.num_key_value_heads, context, config.head_dim);
                HostLayerState::Attention {
                    keys: Tensor::zeros(shape, DType::F32, dev)?,
                    values: Tensor::zeros(shape, DType::F32, dev)?,
                    len: 0,
                }
            }
        })
    }

    /// The state under the dump's names: `conv_state`/`recurrent_state` or `key_cache`/`value_cache` (filled part).
    pub fn dump_tensors(&self, layer: usize) -> Result<Vec<(String, Tensor)>> {
        Ok(match self {
            HostLayerState::Linear { conv, recurrent } => {
                let [c, r] = state_names(layer, LayerKind::Linear);
                vec![(c, conv.clone()), (r, recurrent.clone())]
            }
            HostLayerState::Attention { keys, values, len } => {
                let [k, v] = state_names(layer, LayerKind::Full);
                vec![
                    (k, keys.narrow(1, 0, *len)?),
                    (v, values.narrow(1, 0, *len)?),
                ]
            }
        })
    }
}

/// The host-side inputs of one block: `token_valid` `[T]`, `attention_mask` `[T, CTX + T]`, `positions` `[3, T]`.
pub struct BlockInputs {
    /// 1 for real tokens, 0 for padding.
    pub token_valid: Tensor,
    /// 0 where a query may attend, −inf elsewhere.
    pub attention_mask: Tensor,
    /// MRoPE positions (three equal rows for text).
    pub positions: Tensor,
}

/// The inputs of a block of `tokens` slots holding `valid` real tokens at positions `start..`, with `past`
/// cache slots filled, for a static context of `context` slots.
pub fn block_inputs(
    tokens: usize,
    valid: usize,
    start: usize,
    past: usize,
    context: usize,
) -> Result<BlockInputs> {
    if past + valid > context {
        return Err(Error::Config(format!(
            "the sequence needs {} tokens but the static context holds {context} (--context)",
            past + valid
        )));
    }
    let dev = &Device::Cpu;
    let v: Vec<f32> = (0..tokens)
        .map(|i| if i < valid { 1.0 } else { 0.0 })
        .collect();
    let mut mask = Vec::with_capacity(tokens * (context + tokens));
    for row in 0..tokens {
        for col in 0..context {
            mask.push(if col < past { 0.0 } else { f32::NEG_INFINITY });
        }
        for col in 0..tokens {
            mask.push(if col <= row { 0.0 } else { f32::NEG_INFINITY });
        }
    }
    let pos: Vec<i64> = (0..tokens).map(|i| (start + i) as i64).collect();
    let pos3: Vec<i64> = pos.iter().chain(&pos).chain(&pos).copied().collect();
    Ok(BlockInputs {
        token_valid: Tensor::from_vec(v, tokens, dev)?,
        attention_mask: Tensor::from_vec(mask, (tokens, context + tokens), dev)?,
        positions: Tensor::from_vec(pos3, (3, tokens), dev)?,
    })
}

/// Pads `[n, …]` with zero rows to `[tokens, …]`.
fn pad_rows(x: &Tensor, tokens: usize) -> Result<Tensor> {
    let n = x.dim(0)?;
    Ok(if n == tokens {
        x.clone()
    } else {
        x.pad_with_zeros(0, 0, tokens - n)?
    })
}

/// Appends the first `n` tokens of `new` (`[Hkv, T, D]`) to a static cache at slot `len`.
fn append_cache(cache: &Tensor, new: &Tensor, len: usize, n: usize) -> Result<Tensor> {
    let ctx = cache.dim(1)?;
    let rows = new.narrow(1, 0, n)?;
    let mut parts = vec![];
    if len > 0 {
        parts.push(cache.narrow(1, 0, len)?);
    }
    parts.push(rows);
    if len + n < ctx {
        parts.push(cache.narrow(1, len + n, ctx - len - n)?);
    }
    Ok(Tensor::cat(&parts, 1)?)
}

/// A graph output that must be there.
fn output(outputs: &BTreeMap<String, Tensor>, name: &str) -> Result<Tensor> {
    outputs
        .get(name)
        .cloned()
        .ok_or_else(|| Error::Config(format!("the graph has no output `{name}`")))
}

/// Collects token-major outputs across blocks (valid rows only).
#[derive(Default)]
struct Collector(BTreeMap<String, Vec<Tensor>>);

impl Collector {
    fn push(&mut self, name: &str, t: &Tensor, valid: usize) -> Result<()> {
        self.0
            .entry(name.to_string())
            .or_default()
            .push(t.narrow(0, 0, valid)?);
        Ok(())
    }

    fn finish(self) -> Result<BTreeMap<String, Tensor>> {
        self.0
            .into_iter()
            .map(|(k, v)| Ok((k, Tensor::cat(&v, 0)?)))
            .collect()
    }
}

/// One layer's graph compiled on a device, run over whole sequences (the per-layer probe).
pub struct LayerRunner {
    session: Session,
    layer: usize,
    kind: LayerKind,
    tokens: usize,
    context: usize,
}

impl LayerRunner {
    /// Builds and compiles the graph of `layer` for blocks of `tokens`.
    pub fn new(
        builder: &Builder,
        layer: usize,
        tokens: usize,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        let graph = builder.layer_graph(layer, tokens)?;
        let outputs = graph.outputs().into_iter().map(|(n, _, _)| n).collect();
        let mut core = crate::runtime::core()?;
        let compiled = compile(&mut core, graph, device, opts)?;
        Ok(LayerRunner {
            session: Session::new(compiled, outputs)?,
            layer,
            kind: builder.config().layer_types[layer],
            tokens,
            context: builder.options().context,
        })
    }

    /// The compiled session (device, precision, compile time).
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Runs `hidden` `[S, H]` (positions `start..`) through the layer in blocks, updating `state`; returns every
    /// token-major output over the `S` tokens, named as in the dump without the `layers.{i}.` prefix.
    pub fn run(
        &mut self,
        hidden: &Tensor,
        start: usize,
        state: &mut HostLayerState,
    ) -> Result<BTreeMap<String, Tensor>> {
        let s = hidden.dim(0)?;
        let mut out = Collector::default();
        let mut done = 0;
        while done < s {
            let valid = self.tokens.min(s - done);
            let x = pad_rows(&hidden.narrow(0, done, valid)?, self.tokens)?;
            let past = match state {
                HostLayerState::Attention { len, .. } => *len,
                HostLayerState::Linear { .. } => 0,
            };
            let b = block_inputs(self.tokens, valid, start + done, past, self.context)?;
            let results = match (self.kind, &mut *state) {
                (LayerKind::Linear, HostLayerState::Linear { conv, recurrent }) => {
                    let r = self.session.run(&[
                        ("hidden", &x),
                        ("token_valid", &b.token_valid),
                        ("conv_state", conv),
                        ("recurrent_state", recurrent),
                    ])?;
                    *conv = output(&r, "conv_state_out")?;
                    *recurrent = output(&r, "recurrent_state_out")?;
                    r
                }
                (LayerKind::Full, HostLayerState::Attention { keys, values, len }) => {
                    let r = self.session.run(&[
                        ("hidden", &x),
                        ("attention_mask", &b.attention_mask),
                        ("positions", &b.positions),
                        ("past_keys", keys),
                        ("past_values", values),
                    ])?;
                    *keys = append_cache(keys, &output(&r, "new_keys")?, *len, valid)?;
                    *values = append_cache(values, &output(&r, "new_values")?, *len, valid)?;
                    *len += valid;
                    r
                }
                _ => {
                    return Err(Error::Config(format!(
                        "layer {}: the state is of the other kind",
                        self.layer
                    )));
                }
            };
            for (name, t) in &results {
                if !name.ends_with("_out") && !name.starts_with("new_") {
                    out.push(name, t, valid)?;
                }
            }
            done += valid;
        }
        out.finish()
    }
}

/// The whole-decoder graphs compiled on a device: one for prompt blocks of `block` tokens and one for single-token
/// decode, with every cache kept on the host and handed between calls.
pub struct DecoderEngine {
    prefill: Option<Session>,
    decode: Session,
    block: usize,
    context: usize,
    config: Config,
    /// Per-layer states after the last call.
    pub states: Vec<HostLayerState>,
    position: usize,
}

/// What a device run produced, under the dump's names.
pub struct DeviceRun {
    /// Token-major taps over the prompt (`embeddings`, `layers.{i}.…`, `final_norm`, `logits`).
    pub taps: BTreeMap<String, Tensor>,
    /// States after the prompt (`layers.{i}.conv_state`, …, `key_cache`, `value_cache`).
    pub states: BTreeMap<String, Tensor>,
    /// Greedy continuation.
    pub generated: Vec<u32>,
}

impl DecoderEngine {
    /// Builds and compiles the decoder graphs (prompt blocks of `block` tokens, and 1 token) for `device`.
    pub fn new(
        builder: &Builder,
        block: usize,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        if block == 0 {
            return Err(Error::Config("--block must be at least 1".into()));
        }
        let mut core = crate::runtime::core()?;
        let mut session = |tokens: usize| -> Result<Session> {
            let graph = builder.decoder_graph(tokens)?;
            let outputs = graph.outputs().into_iter().map(|(n, _, _)| n).collect();
            let compiled = compile(&mut core, graph, device, opts)?;
            Session::new(compiled, outputs)
        };
        let decode = session(1)?;
        let prefill = if block > 1 {
            Some(session(block)?)
        } else {
            None
        };
        let config = builder.config().clone();
        let context = builder.options().context;
        let states = (0..config.num_layers())
            .map(|l| HostLayerState::zeros(&config, l, context))
            .collect::<Result<_>>()?;
        Ok(DecoderEngine {
            prefill,
            decode,
            block,
            context,
            config,
            states,
            position: 0,
        })
    }

    /// The sessions (prompt, decode) for reports.
    pub fn sessions(&self) -> Vec<&Session> {
        self.prefill
            .iter()
            .chain(std::iter::once(&self.decode))
            .collect()
    }

    /// Forgets every state.
    pub fn reset(&mut self) -> Result<()> {
        self.states = (0..self.config.num_layers())
            .map(|l| HostLayerState::zeros(&self.config, l, self.context))
            .collect::<Result<_>>()?;
        self.position = 0;
        Ok(())
    }

    /// Runs `ids` through the graph of `tokens` slots (`ids.len() <= tokens`), updating the states; returns the
    /// outputs of the valid rows.
    fn step(&mut self, ids: &[u32], tokens: usize) -> Result<BTreeMap<String, Tensor>> {
        let valid = ids.len();
        let past = self.position;
        let b = block_inputs(tokens, valid, self.position, past, self.context)?;
        let mut padded: Vec<i64> = ids.iter().map(|&x| x as i64).collect();
        padded.resize(tokens, 0);
        let ids_t = Tensor::from_vec(padded, tokens, &Device::Cpu)?;
        let mut inputs: Vec<(String, Tensor)> = vec![
            ("input_ids".into(), ids_t),
            ("token_valid".into(), b.token_valid),
            ("attention_mask".into(), b.attention_mask),
            ("positions".into(), b.positions),
        ];
        for (i, s) in self.states.iter().enumerate() {
            match s {
                HostLayerState::Linear { conv, recurrent } => {
                    inputs.push((format!("layers.{i}.conv_state"), conv.clone()));
                    inputs.push((format!("layers.{i}.recurrent_state"), recurrent.clone()));
                }
                HostLayerState::Attention { keys, values, .. } => {
                    inputs.push((format!("layers.{i}.past_keys"), keys.clone()));
                    inputs.push((format!("layers.{i}.past_values"), values.clone()));
                }
            }
        }
        let refs: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let session = if tokens == 1 {
            &mut self.decode
        } else {
            self.prefill
                .as_mut()
                .ok_or_else(|| Error::Config("no prompt-block graph".into()))?
        };
        let mut r = session.run(&refs)?;
        for (i, s) in self.states.iter_mut().enumerate() {
            match s {
                HostLayerState::Linear { conv, recurrent } => {
                    let missing = || {
                        Error::Config(format!(
                            "the decoder graph has no state outputs for layer {i}"
                        ))
                    };
                    *conv = r
                        .remove(&format!("layers.{i}.conv_state_out"))
                        .ok_or_else(missing)?;
                    *recurrent = r
                        .remove(&format!("layers.{i}.recurrent_state_out"))
                        .ok_or_else(missing)?;
                }
                HostLayerState::Attention { keys, values, len } => {
                    let nk = r.remove(&format!("layers.{i}.new_keys"));
                    let nv = r.remove(&format!("layers.{i}.new_values"));
                    let (nk, nv) = nk
                        .zip(nv)
                        .ok_or_else(|| Error::Config(format!("layer {i}: no new keys")))?;
                    *keys = append_cache(keys, &nk, *len, valid)?;
                    *values = append_cache(values, &nv, *len, valid)?;
                    *len += valid;
                }
            }
        }
        self.position += valid;
        r.into_iter()
            .map(|(k, v)| Ok((k, v.narrow(0, 0, valid)?)))
            .collect()
    }

    /// Runs a prompt in padded blocks, then `generate` greedy tokens with single-token decode.
    pub fn run(&mut self, ids: &[u32], generate: usize) -> Result<DeviceRun> {
        if ids.is_empty() {
            return Err(Error::Config("the prompt is empty".into()));
        }
        self.config.check_token_ids(ids)?;
        if ids.len() + generate.saturating_sub(1) > self.context {
            return Err(Error::Config(format!(
                "{} prompt tokens and {generate} generated need {} cache slots, but the static context holds {} \
                 (--context)",
                ids.len(),
                ids.len() + generate.saturating_sub(1),
                self.context
            )));
        }
        self.reset()?;
        let mut taps = Collector::default();
        let mut last = None;
        for piece in ids.chunks(self.block) {
            let r = self.step(piece, self.block)?;
            for (name, t) in &r {
                taps.push(name, t, piece.len())?;
            }
            last = Some(output(&r, "logits")?.get(piece.len() - 1)?);
        }
        let mut states = BTreeMap::new();
        for (i, s) in self.states.iter().enumerate() {
            states.extend(s.dump_tensors(i)?);
        }
        let mut generated = Vec::with_capacity(generate);
        let mut logits = last.ok_or_else(|| Error::Config("the prompt is empty".into()))?;
        for n in 0..generate {
            let next = reference::model::argmax(&logits)?;
            generated.push(next);
            if n + 1 < generate {
                logits = output(&self.step(&[next], 1)?, "logits")?.get(0)?;
            }
        }
        Ok(DeviceRun {
            taps: taps.finish()?,
            states,
            generated,
        })
    }
}
