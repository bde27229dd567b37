//! Running the static graphs over a whole sequence: prompts in padded blocks, caches kept on the host and handed
//! between calls, greedy decoding. Produces the reference's dump names, so the two can be compared tensor for
//! tensor.

use crate::devices::CompileOptions;
use crate::error::{Error, Result};
use crate::graphs::Builder;
use crate::graphs::ports;
use crate::infer::{Executor, prepare};
use candle_core::{DType, Device, Tensor};
use reference::backend::{Backend, Forward, RunRecord, Snapshot};
use reference::config::{Config, LayerKind};
use reference::masks;
use reference::model::state_names;
use reference::taps::names;
use std::collections::BTreeMap;

/// Tokens per prompt block of the decoder graphs unless asked otherwise (the NPU port's smaller block).
pub const DEFAULT_BLOCK: usize = 16;

/// The state of one layer, kept on the host between graph calls and handed to the graphs through the layer kind's
/// [`ports::StatePorts`].
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
            HostLayerState::Attention { len: 0, .. } => vec![],
            HostLayerState::Attention { keys, values, len } => {
                let [k, v] = state_names(layer, LayerKind::Full);
                vec![
                    (k, keys.narrow(1, 0, *len)?),
                    (v, values.narrow(1, 0, *len)?),
                ]
            }
        })
    }

    /// Layer `layer`'s state from a snapshot in the dump's names (the inverse of [`HostLayerState::dump_tensors`]):
    /// a KV cache of `P` positions fills the first `P` of `context` slots. Shapes are checked against the config.
    pub fn from_snapshot(
        config: &Config,
        layer: usize,
        context: usize,
        snapshot: &Snapshot,
    ) -> Result<Self> {
        let mut state = HostLayerState::zeros(config, layer, context)?;
        let [a, b] = state_names(layer, state.kind());
        let get = |name: &str| snapshot.tensors.get(name).map(|t| t.to_dtype(DType::F32));
        let shape_err = |name: &str, got: &[usize], want: &[usize]| {
            Error::Input(format!(
                "state `{name}` has shape {got:?}, the graphs take {want:?}"
            ))
        };
        match &mut state {
            HostLayerState::Linear { conv, recurrent } => {
                for (name, slot) in [(&a, conv), (&b, recurrent)] {
                    let t = get(name)
                        .ok_or_else(|| Error::Input(format!("the state has no `{name}`")))??;
                    if t.dims() != slot.dims() {
                        return Err(shape_err(name, t.dims(), slot.dims()));
                    }
                    *slot = t;
                }
            }
            HostLayerState::Attention { keys, values, len } => {
                let (Some(k), Some(v)) = (get(&a), get(&b)) else {
                    return Ok(state); // no token seen yet
                };
                let (k, v) = (k?, v?);
                let p = k.dim(1)?;
                let want = [config.num_key_value_heads, p, config.head_dim];
                for (name, t) in [(&a, &k), (&b, &v)] {
                    if t.dims() != want {
                        return Err(shape_err(name, t.dims(), &want));
                    }
                }
                if p > context {
                    return Err(Error::Input(format!(
                        "the state holds {p} positions but the static context holds {context} (--context)"
                    )));
                }
                if p != snapshot.position {
                    return Err(Error::Input(format!(
                        "layer {layer}: {p} cached positions at text position {}: the graphs take text positions only",
                        snapshot.position
                    )));
                }
                *keys = append_cache(keys, &k, 0, p)?;
                *values = append_cache(values, &v, 0, p)?;
                *len = p;
            }
        }
        Ok(state)
    }

    /// The layer kind this state belongs to.
    pub fn kind(&self) -> LayerKind {
        match self {
            HostLayerState::Linear { .. } => LayerKind::Linear,
            HostLayerState::Attention { .. } => LayerKind::Full,
        }
    }

    /// The graph inputs carrying this state, named under `prefix` (see [`ports::StatePorts`]).
    pub fn feed(&self, prefix: &str) -> [(String, Tensor); 2] {
        let [a, b] = ports::state_ports(self.kind()).inputs;
        let (x, y) = match self {
            HostLayerState::Linear { conv, recurrent } => (conv, recurrent),
            HostLayerState::Attention { keys, values, .. } => (keys, values),
        };
        [
            (format!("{prefix}{a}"), x.clone()),
            (format!("{prefix}{b}"), y.clone()),
        ]
    }

    /// Takes this layer's new state out of a call's outputs (named under `prefix`, see [`ports::StatePorts`]): the new conv
    /// and recurrent states, or the block's keys and values, of which the first `valid` are appended to the cache.
    pub fn take_from(
        &mut self,
        outputs: &mut BTreeMap<String, Tensor>,
        prefix: &str,
        valid: usize,
    ) -> Result<()> {
        let [a, b] = ports::state_ports(self.kind()).outputs;
        let mut take = |name: &str| {
            let port = format!("{prefix}{name}");
            outputs
                .remove(&port)
                .ok_or_else(|| Error::Interface(format!("the graph has no output `{port}`")))
        };
        let (x, y) = (take(a)?, take(b)?);
        match self {
            HostLayerState::Linear { conv, recurrent } => {
                *conv = x;
                *recurrent = y;
            }
            HostLayerState::Attention { keys, values, len } => {
                *keys = append_cache(keys, &x, *len, valid)?;
                *values = append_cache(values, &y, *len, valid)?;
                *len += valid;
            }
        }
        Ok(())
    }

    /// Filled cache slots (0 for a linear layer, whose state has no length).
    fn cached(&self) -> usize {
        match self {
            HostLayerState::Attention { len, .. } => *len,
            HostLayerState::Linear { .. } => 0,
        }
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

impl BlockInputs {
    /// The inputs of a block of `tokens` slots holding `valid` real tokens at text positions `start..`, with `past`
    /// cache slots filled, for a static context of `context` slots.
    pub fn new(
        tokens: usize,
        valid: usize,
        start: usize,
        past: usize,
        context: usize,
    ) -> Result<BlockInputs> {
        if past + valid > context {
            return Err(Error::Input(format!(
                "the sequence needs {} tokens but the static context holds {context} (--context)",
                past + valid
            )));
        }
        let dev = &Device::Cpu;
        let v: Vec<f32> = (0..tokens)
            .map(|i| if i < valid { 1.0 } else { 0.0 })
            .collect();
        let mask: Vec<f32> = masks::attention_bias(tokens, past, context)
            .into_iter()
            .map(|x| x as f32)
            .collect();
        let pos: Vec<i64> = (0..tokens).map(|i| (start + i) as i64).collect();
        let pos3: Vec<i64> = pos.iter().chain(&pos).chain(&pos).copied().collect();
        Ok(BlockInputs {
            token_valid: Tensor::from_vec(v, tokens, dev)?,
            attention_mask: Tensor::from_vec(mask, (tokens, context + tokens), dev)?,
            positions: Tensor::from_vec(pos3, (3, tokens), dev)?,
        })
    }

    /// The three inputs under their port names.
    fn named(self) -> [(String, Tensor); 3] {
        [
            (ports::TOKEN_VALID.into(), self.token_valid),
            (ports::ATTENTION_MASK.into(), self.attention_mask),
            (ports::POSITIONS.into(), self.positions),
        ]
    }
}

/// Pads `[n, …]` to `[tokens, …]` by repeating the last row. The padded rows never reach a valid one (masked out
/// of attention, `token_valid` zeroing their decay and write strength), but they are computed: rows of zeros would
/// make the RMSNorms divide 0 by 0 wherever the norm's epsilon does not survive the device's arithmetic (1e-6 is
/// flushed to zero in fp16), and the NaN would reach valid rows through products with zero weights. A real token's
/// row (as the decoder graphs get from padding with token 0) is what a deployed graph sees.
fn pad_rows(x: &Tensor, tokens: usize) -> Result<Tensor> {
    let n = x.dim(0)?;
    if n == tokens {
        return Ok(x.clone());
    }
    let last = x.narrow(0, n - 1, 1)?;
    let mut rows = vec![x.clone()];
    rows.extend(std::iter::repeat_n(last, tokens - n));
    Ok(Tensor::cat(&rows, 0)?)
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
    session: Box<dyn Executor>,
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
        Ok(LayerRunner {
            session: prepare(graph, device, opts)?,
            layer,
            kind: builder.config().layer_types[layer],
            tokens,
            context: builder.options().context,
        })
    }

    /// What the graph was prepared with (device, precision, compile time).
    pub fn info(&self) -> &crate::devices::ExecInfo {
        self.session.info()
    }

    /// Runs `hidden` `[S, H]` (positions `start..`) through the layer in blocks, updating `state`; returns every
    /// token-major output over the `S` tokens, named as in the dump without the `layers.{i}.` prefix.
    pub fn run(
        &mut self,
        hidden: &Tensor,
        start: usize,
        state: &mut HostLayerState,
    ) -> Result<BTreeMap<String, Tensor>> {
        if state.kind() != self.kind {
            return Err(Error::Interface(format!(
                "layer {}: a {} state for a {} layer",
                self.layer,
                state.kind().name(),
                self.kind.name()
            )));
        }
        let s = hidden.dim(0)?;
        let mut out = Collector::default();
        let mut done = 0;
        while done < s {
            let valid = self.tokens.min(s - done);
            let x = pad_rows(&hidden.narrow(0, done, valid)?, self.tokens)?;
            let b = BlockInputs::new(
                self.tokens,
                valid,
                start + done,
                state.cached(),
                self.context,
            )?;
            let mut inputs = vec![(ports::HIDDEN.to_string(), x)];
            inputs.extend(b.named());
            inputs.extend(state.feed(""));
            let mut results = self.session.run_declared(&inputs)?;
            state.take_from(&mut results, "", valid)?;
            for (name, t) in &results {
                out.push(name, t, valid)?;
            }
            done += valid;
        }
        out.finish()
    }
}

/// The whole-decoder graphs compiled on a device: one for prompt blocks of `block` tokens and one for single-token
/// decode, with every cache kept on the host and handed between calls.
pub struct DecoderEngine {
    prefill: Option<Box<dyn Executor>>,
    decode: Box<dyn Executor>,
    block: usize,
    context: usize,
    config: Config,
    states: Vec<HostLayerState>,
    position: usize,
    record: RunRecord,
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
            return Err(Error::Input(
                "a prompt block must hold at least 1 token".into(),
            ));
        }
        let start = std::time::Instant::now();
        let session = |tokens: usize| -> Result<Box<dyn Executor>> {
            prepare(builder.decoder_graph(tokens)?, device, opts)
        };
        let decode = session(1)?;
        let prefill = if block > 1 {
            Some(session(block)?)
        } else {
            None
        };
        let config = builder.config().clone();
        let graph = *builder.options();
        let context = graph.context;
        let states = (0..config.num_layers())
            .map(|l| HostLayerState::zeros(&config, l, context))
            .collect::<Result<_>>()?;
        let record = RunRecord {
            compile_seconds: Some(start.elapsed().as_secs_f64()),
            ..record_of(decode.info(), builder, block, opts)?
        };
        Ok(DecoderEngine {
            prefill,
            decode,
            block,
            context,
            config,
            states,
            position: 0,
            record,
        })
    }

    /// What the graphs (prompt, decode) were prepared with.
    pub fn infos(&self) -> Vec<&crate::devices::ExecInfo> {
        self.prefill
            .iter()
            .chain(std::iter::once(&self.decode))
            .map(|e| e.info())
            .collect()
    }

    /// The static KV context.
    pub fn context(&self) -> usize {
        self.context
    }

    /// The per-layer states after the last call.
    pub fn states(&self) -> &[HostLayerState] {
        &self.states
    }

    /// Runs `ids` through the graph of `tokens` slots (`ids.len() <= tokens`), updating the states; returns the
    /// outputs of the valid rows.
    fn run_block(&mut self, ids: &[u32], tokens: usize) -> Result<BTreeMap<String, Tensor>> {
        let valid = ids.len();
        let b = BlockInputs::new(tokens, valid, self.position, self.position, self.context)?;
        let mut padded: Vec<i64> = ids.iter().map(|&x| x as i64).collect();
        padded.resize(tokens, 0);
        let mut inputs = vec![(
            ports::INPUT_IDS.to_string(),
            Tensor::from_vec(padded, tokens, &Device::Cpu)?,
        )];
        inputs.extend(b.named());
        for (i, s) in self.states.iter().enumerate() {
            inputs.extend(s.feed(&ports::layer_prefix(i)));
        }
        let session = if tokens == 1 {
            &mut self.decode
        } else {
            self.prefill
                .as_mut()
                .ok_or_else(|| Error::Interface("no prompt-block graph".into()))?
        };
        let mut r = session.run_declared(&inputs)?;
        for (i, s) in self.states.iter_mut().enumerate() {
            s.take_from(&mut r, &ports::layer_prefix(i), valid)?;
        }
        self.position += valid;
        r.into_iter()
            .map(|(k, v)| Ok((k, v.narrow(0, 0, valid)?)))
            .collect()
    }

    /// [`Backend::forward`]: the graph calls over `ids` and their outputs, token-major.
    fn forward_blocks(&mut self, ids: &[u32], all_logits: bool) -> Result<Forward> {
        if ids.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        self.config.check_token_ids(ids)?;
        let tokens = if ids.len() == 1 { 1 } else { self.block };
        let mut collected = Collector::default();
        for piece in ids.chunks(tokens) {
            let r = self.run_block(piece, tokens)?;
            for (name, t) in &r {
                collected.push(name, t, piece.len())?;
            }
        }
        let mut taps = collected.finish()?;
        let logits = taps.remove(names::LOGITS).ok_or_else(|| {
            Error::Interface(format!("the graph has no output `{}`", names::LOGITS))
        })?;
        let logits = if all_logits {
            logits
        } else {
            logits.narrow(0, logits.dim(0)? - 1, 1)?
        };
        Ok(Forward { logits, taps })
    }
}

impl Backend for DecoderEngine {
    fn config(&self) -> &Config {
        &self.config
    }

    fn record(&self) -> &RunRecord {
        &self.record
    }

    fn reset(&mut self) -> reference::Result<()> {
        self.states = (0..self.config.num_layers())
            .map(|l| HostLayerState::zeros(&self.config, l, self.context))
            .collect::<Result<_>>()
            .map_err(into_reference)?;
        self.position = 0;
        Ok(())
    }

    /// One token runs through the single-token graph; more run in padded blocks of the prompt graph (or token by
    /// token when the prompt block is 1).
    fn forward(&mut self, ids: &[u32], all_logits: bool) -> reference::Result<Forward> {
        self.forward_blocks(ids, all_logits).map_err(into_reference)
    }

    fn snapshot(&self) -> reference::Result<Snapshot> {
        let mut tensors = BTreeMap::new();
        for (i, s) in self.states.iter().enumerate() {
            tensors.extend(s.dump_tensors(i).map_err(into_reference)?);
        }
        Ok(Snapshot {
            position: self.position,
            tensors,
        })
    }

    fn restore(&mut self, snapshot: &Snapshot) -> reference::Result<()> {
        let states = (0..self.config.num_layers())
            .map(|i| HostLayerState::from_snapshot(&self.config, i, self.context, snapshot))
            .collect::<Result<Vec<_>>>()
            .map_err(into_reference)?;
        self.states = states;
        self.position = snapshot.position;
        Ok(())
    }
}

/// What a device ran, from what its graphs were prepared with: the device's own name and driver (OpenVINO
/// devices), the precision that took effect, every property, the graph options and the weight format.
pub fn record_of(
    info: &crate::devices::ExecInfo,
    builder: &Builder,
    block: usize,
    opts: &CompileOptions,
) -> Result<RunRecord> {
    let sim = crate::sim::NumericModel::is_sim(&info.device);
    let (runtime, device_name, driver) = if sim {
        (
            Some(format!("FP16SIM (qwen35 {})", env!("CARGO_PKG_VERSION"))),
            info.execution_devices.clone(),
            None,
        )
    } else {
        let d = crate::devices::describe(&crate::runtime::core()?, &info.device);
        (
            Some(crate::runtime::load()?.version.clone()),
            Some(d.full_name),
            d.driver_version,
        )
    };
    let graph = builder.options();
    Ok(RunRecord {
        backend: if sim { "fp16sim" } else { "openvino" }.into(),
        device: Some(info.device.clone()),
        runtime,
        device_name,
        driver,
        dtype: "f32".into(),
        precision_requested: Some(if sim {
            info.precision.clone()
        } else {
            opts.precision.hint().into()
        }),
        precision: Some(info.precision.clone()),
        execution_devices: info.execution_devices.clone(),
        properties: info.properties.clone(),
        weights: builder.weight_format().name(),
        deltanet_prefill: graph.form.describe_block(block),
        deltanet_decode: "matrix".into(),
        output_scale: graph.output_scale as f64,
        prefill_block: None,
        block: Some(block),
        context: Some(graph.context),
        taps: graph.taps,
        compile_seconds: Some(info.compile_seconds),
    })
}

/// An error of this crate as the backend interface's error (which is the reference's).
fn into_reference(e: Error) -> reference::Error {
    match e {
        Error::Reference(e) => e,
        Error::Input(m) => reference::Error::Input(m),
        other => reference::Error::Backend(other.to_string()),
    }
}
