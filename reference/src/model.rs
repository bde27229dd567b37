//! The whole decoder: embedding, hybrid layers, final norm, LM head; a [`State`] kept apart from the weights.

use crate::attention::{Attention, KvCache};
use crate::config::{Config, LayerKind};
use crate::deltanet::{DEFAULT_CHUNK, Form, Inverse};
use crate::error::{Error, Result};
use crate::linear::Linear;
use crate::linear_attn::{DeltaNetOptions, GatedDeltaNet, LinearState};
use crate::mlp::Mlp;
use crate::moe::SparseMoe;
use crate::ops::rms_norm;
use crate::pages::{InPlace, Pages};
use crate::rope::{Positions, Rope};
use crate::schema::{Param, Schema};
use crate::taps::{Taps, names};
use crate::weights::WeightStore;
use candle_core::{DType, Device, Tensor};
use std::path::Path;

/// A layer's token mixer.
#[derive(Debug, Clone)]
pub enum Mixer {
    /// Gated DeltaNet.
    Linear(GatedDeltaNet),
    /// Gated full attention.
    Attention(Attention),
}

/// A layer's feed-forward block (`mlp.*`).
#[derive(Debug, Clone)]
pub enum FeedForward {
    /// The dense SwiGLU MLP.
    Dense(Mlp),
    /// The sparse MoE block (Qwen3.5-MoE).
    Moe(SparseMoe),
}

/// One decoder block: `h += mixer(input_norm(h)); h += mlp(post_norm(h))`.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    input_layernorm: Tensor,
    post_attention_layernorm: Tensor,
    mixer: Mixer,
    mlp: FeedForward,
}

/// The state of one layer.
#[derive(Debug, Clone)]
pub enum LayerState {
    /// Convolution and recurrent state of a linear-attention layer.
    Linear(LinearState),
    /// KV cache of a full-attention layer.
    Attention(KvCache),
}

/// Everything a run carries from token to token; the weights never change.
#[derive(Debug, Clone)]
pub struct State {
    /// Tokens processed so far (the caches' length).
    pub position: usize,
    /// The next text position minus [`State::position`]: 0 for text, negative after an image or a video (its tokens
    /// span fewer positions than they are), as transformers' `rope_deltas` carry the positions on.
    pub rope_delta: i64,
    /// One entry per layer.
    pub layers: Vec<LayerState>,
}

impl State {
    /// The next token's text position (the same on all three MRoPE rows).
    pub fn next_position(&self) -> usize {
        usize::try_from(self.position as i64 + self.rope_delta).unwrap_or(0)
    }
}

/// The dump names of a layer's two state tensors: `layers.{i}.conv_state` and `layers.{i}.recurrent_state` for a
/// linear-attention layer, `layers.{i}.key_cache` and `layers.{i}.value_cache` for an attention layer.
pub fn state_names(layer: usize, kind: LayerKind) -> [String; 2] {
    match kind {
        LayerKind::Linear => [
            names::layer(layer, names::CONV_STATE),
            names::layer(layer, names::RECURRENT_STATE),
        ],
        LayerKind::Full => [
            names::layer(layer, names::KEY_CACHE),
            names::layer(layer, names::VALUE_CACHE),
        ],
    }
}

impl State {
    /// Every layer's state under the dump's names: `layers.{i}.conv_state` `[C, K]` and
    /// `layers.{i}.recurrent_state` `[Hv, Dk, Dv]`, or `layers.{i}.key_cache` / `value_cache` `[Hkv, P, D]` (attention
    /// layers that have seen no token are left out).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            match layer {
                LayerState::Linear(s) => {
                    let [conv, recurrent] = state_names(i, LayerKind::Linear);
                    out.push((conv, s.conv.clone()));
                    out.push((recurrent, s.recurrent.clone()));
                }
                LayerState::Attention(c) => {
                    if let (Some(k), Some(v)) = (&c.keys, &c.values) {
                        let [keys, values] = state_names(i, LayerKind::Full);
                        out.push((keys, k.clone()));
                        out.push((values, v.clone()));
                    }
                }
            }
        }
        out
    }
}

/// How a run computes; none of these change the result in exact arithmetic.
#[derive(Debug, Clone, Copy)]
pub struct RunOptions {
    /// The delta-rule form for forward calls of more than one token.
    pub prefill: Form,
    /// The delta-rule form for single-token calls.
    pub decode: Form,
    /// Feed the prompt in forward calls of at most this many tokens (`None`: all at once).
    pub prefill_block: Option<usize>,
    /// The DeltaNet output rescaling (1 = off; the NPU port uses 1024).
    pub output_scale: f64,
}

impl Default for RunOptions {
    /// Chunks of 64 with forward substitution (transformers' algorithm) for prompts, the matrix form for decode.
    fn default() -> Self {
        RunOptions {
            prefill: Form::Chunked {
                block: DEFAULT_CHUNK,
                inverse: Inverse::Substitution,
            },
            decode: Form::Matrix,
            prefill_block: None,
            output_scale: 1.0,
        }
    }
}

/// The token embedding table alone, as a host that runs the layers elsewhere looks a prompt's rows up in it (a device's
/// decoder graphs taking embeddings, a prompt with images): read as the model reads it (in place, or quantized on read
/// as the rows are gathered), without the layers' weights.
#[derive(Debug, Clone)]
pub struct TokenTable {
    config: Config,
    table: Linear,
    dtype: DType,
}

impl TokenTable {
    /// The table of the checkpoint `w` holds.
    pub fn load(config: &Config, w: &WeightStore) -> Result<Self> {
        let spec = Schema::new(config).global(Param::EmbedTokens);
        // Looked up a few rows at a time: quantised on read unless it is also the LM head.
        let table = if config.tie_word_embeddings {
            w.linear(&spec)?
        } else {
            w.embedding(&spec)?
        };
        Ok(TokenTable {
            config: config.clone(),
            table,
            dtype: w.dtype(),
        })
    }

    /// The dtype its rows come in (the model's).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The rows `[T, H]` of `ids` (checked against the vocabulary).
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        self.config.check_token_ids(ids)?;
        self.table.gather(ids)
    }
}

/// The Qwen3.5 text decoder with its weights in one dtype (F32 or F64).
#[derive(Debug, Clone)]
pub struct Model {
    config: Config,
    embed_tokens: Linear,
    layers: Vec<DecoderLayer>,
    norm: Tensor,
    lm_head: Linear,
    rope: Rope,
    dtype: DType,
    /// The always-read weights read in place from the checkpoint's map, whose pages a forward call hands back as
    /// [`Model::pages`] says: handed back, they stay in the page cache, not in this process's resident memory (the
    /// 9B's bf16 is 18 GB).
    in_place: std::sync::Arc<InPlace>,
    /// Which pages a forward call hands back.
    pages: Pages,
}

impl Model {
    /// Loads `config.json` and the safetensors weights of a checkpoint directory (or a GGUF file, or a directory
    /// holding one: see [`crate::gguf`]), converting them to `dtype`.
    pub fn load(dir: &Path, dtype: DType) -> Result<Self> {
        let config = crate::gguf::model_config(dir)?;
        let weights = WeightStore::open(dir, dtype)?;
        Self::from_weights(config, &weights)
    }

    /// Builds the model from a parsed config and an open weight store.
    pub fn from_weights(config: Config, w: &WeightStore) -> Result<Self> {
        let s = Schema::new(&config);
        let embed_tokens = TokenTable::load(&config, w)?.table;
        let mut layers = Vec::with_capacity(config.num_layers());
        for (i, kind) in config.layer_types.iter().enumerate() {
            let mixer = match kind {
                LayerKind::Linear => Mixer::Linear(GatedDeltaNet::load(w, i, &config)?),
                LayerKind::Full => Mixer::Attention(Attention::load(w, i, &config)?),
            };
            layers.push(DecoderLayer {
                input_layernorm: w.load(&s.layer(i, Param::InputLayernorm))?,
                post_attention_layernorm: w.load(&s.layer(i, Param::PostAttentionLayernorm))?,
                mixer,
                mlp: match config.moe {
                    Some(_) => FeedForward::Moe(SparseMoe::load(w, i, &config)?),
                    None => FeedForward::Dense(Mlp::load(w, i, &config)?),
                },
            });
        }
        let norm = w.load(&s.global(Param::Norm))?;
        let lm_head = if config.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            w.linear(&s.global(Param::LmHead))?
        };
        let in_place = std::sync::Arc::new(InPlace::of(&config, w)?);
        // What loading read (norms and other tensors converted into memory) is not read in place again.
        for m in w.maps() {
            m.release_all();
        }
        Ok(Model {
            rope: Rope::new(&config),
            pages: Pages::auto(in_place.bytes(), crate::pages::mem_available()),
            in_place,
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            dtype: w.dtype(),
        })
    }

    /// Which checkpoint pages a forward call hands back: chosen at load by [`Pages::auto`] from
    /// [`Model::always_read_bytes`] and the memory available then, unless [`Model::set_pages`] set it.
    pub fn pages(&self) -> Pages {
        self.pages
    }

    /// Sets the pages policy (the values computed never change with it).
    pub fn set_pages(&mut self, pages: Pages) {
        self.pages = pages;
    }

    /// The bytes of the weights every token reads that the model reads in place: what [`Pages::KeepAlwaysRead`]
    /// keeps resident.
    pub fn always_read_bytes(&self) -> u64 {
        self.in_place.bytes()
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The dtype every tensor of a run has.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// A fresh state: zero conv and recurrent states, empty KV caches, position 0.
    pub fn new_state(&self) -> Result<State> {
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Linear(m) => Ok(LayerState::Linear(m.zero_state(self.dtype)?)),
                Mixer::Attention(_) => Ok(LayerState::Attention(KvCache::default())),
            })
            .collect::<Result<_>>()?;
        Ok(State {
            position: 0,
            rope_delta: 0,
            layers,
        })
    }

    /// Checks that every id is inside the vocabulary.
    pub fn check_ids(&self, ids: &[u32]) -> Result<()> {
        self.config.check_token_ids(ids)
    }

    /// Runs `ids` (text positions continuing from the state's, [`State::next_position`]) and returns the last token's logits `[V]`.
    ///
    /// When `taps` is on it records `embeddings`, per layer `layers.{i}.{output, mixer_output, mlp_output}`, the
    /// mixers' own taps (`layers.{i}.linear_attn.*`, `layers.{i}.self_attn.*`) and an MoE block's
    /// (`layers.{i}.mlp.*`), `final_norm` and `logits` `[T, V]`.
    pub fn forward(
        &self,
        ids: &[u32],
        state: &mut State,
        opts: &RunOptions,
        taps: &mut Taps,
    ) -> Result<Tensor> {
        let positions = Positions::text(state.next_position(), ids.len());
        self.forward_at(ids, &positions, state, opts, taps)
    }

    /// [`Model::forward`] with explicit (possibly multimodal) positions.
    pub fn forward_at(
        &self,
        ids: &[u32],
        positions: &Positions,
        state: &mut State,
        opts: &RunOptions,
        taps: &mut Taps,
    ) -> Result<Tensor> {
        if ids.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        self.check_ids(ids)?;
        let h = self.embed_tokens.gather(ids)?;
        if !self.config.tie_word_embeddings {
            // A table read a row per token (a tied one is the LM head, handed back as the policy says).
            self.embed_tokens.release_pages();
        }
        self.forward_embedded(h, positions, state, opts, taps)
    }

    /// [`Model::forward_at`] from the embeddings `[T, H]` instead of token ids: a multimodal prompt's, whose image
    /// tokens carry the vision tower's rows ([`crate::vision::positions::scatter_rows`]).
    pub fn forward_embedded(
        &self,
        embeddings: Tensor,
        positions: &Positions,
        state: &mut State,
        opts: &RunOptions,
        taps: &mut Taps,
    ) -> Result<Tensor> {
        let (t, width) = embeddings.dims2()?;
        if t == 0 || width != self.config.hidden_size {
            return Err(Error::Input(format!(
                "embeddings of shape {:?}: expected [T >= 1, {}]",
                embeddings.dims(),
                self.config.hidden_size
            )));
        }
        if positions.len() != t {
            return Err(Error::Input(format!(
                "{} positions for {t} tokens",
                positions.len()
            )));
        }
        if state.layers.len() != self.layers.len() {
            return Err(Error::Input(
                "the state belongs to a different model".into(),
            ));
        }
        let dev = Device::Cpu;
        let mut h = embeddings.to_dtype(self.dtype)?;
        taps.record(|| names::EMBEDDINGS.into(), &h)?;

        let rotary = self.rope.tables(positions, self.dtype, &dev)?;
        let deltanet = DeltaNetOptions {
            form: if t == 1 { opts.decode } else { opts.prefill },
            output_scale: opts.output_scale,
        };
        let eps = self.config.rms_norm_eps;
        for (i, (layer, layer_state)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate()
        {
            let x = rms_norm(&h, &layer.input_layernorm, eps)?;
            let mixed = match (&layer.mixer, layer_state) {
                (Mixer::Linear(m), LayerState::Linear(s)) => {
                    m.forward(&x, s, &deltanet, taps, &names::layer(i, names::LINEAR_ATTN))?
                }
                (Mixer::Attention(m), LayerState::Attention(c)) => {
                    m.forward(&x, c, &rotary, taps, &names::layer(i, names::SELF_ATTN))?
                }
                _ => {
                    return Err(Error::Input(format!(
                        "layer {i}: the state is of the other layer kind"
                    )));
                }
            };
            taps.record(|| names::layer(i, names::MIXER_OUTPUT), &mixed)?;
            h = (h + mixed)?;
            let x = rms_norm(&h, &layer.post_attention_layernorm, eps)?;
            let m = match &layer.mlp {
                FeedForward::Dense(mlp) => mlp.forward(&x)?,
                FeedForward::Moe(moe) => moe.forward(&x, taps, &names::layer(i, names::MLP))?,
            };
            taps.record(|| names::layer(i, names::MLP_OUTPUT), &m)?;
            h = (h + m)?;
            taps.record(|| names::layer(i, names::OUTPUT), &h)?;
            if self.pages == Pages::Release {
                self.in_place.release_layer(i);
            }
        }
        let normed = rms_norm(&h, &self.norm, eps)?;
        taps.record(|| names::FINAL_NORM.into(), &normed)?;
        // The next text position follows the largest position used (for text: position + T; after an image, the
        // row maximum + 1, as transformers' rope deltas continue).
        state.position += t;
        state.rope_delta = positions.next_text() - state.position as i64;
        let logits = if taps.enabled() {
            let logits = self.lm_head.forward(&normed)?;
            taps.record(|| names::LOGITS.into(), &logits)?;
            logits.get(t - 1)?
        } else {
            self.lm_head
                .forward(&normed.narrow(0, t - 1, 1)?)?
                .squeeze(0)?
        };
        if self.pages == Pages::Release {
            self.in_place.release_head();
        }
        Ok(logits)
    }

    /// The embeddings `[T, H]` of `ids` (the first step of [`Model::forward`]), for a host that runs the layers
    /// elsewhere.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        self.check_ids(ids)?;
        self.embed_tokens.gather(ids)
    }

    /// The model's embedding table alone (sharing its storage).
    pub fn token_table(&self) -> TokenTable {
        TokenTable {
            config: self.config.clone(),
            table: self.embed_tokens.clone(),
            dtype: self.dtype,
        }
    }

    /// The final norm `[T, H]` and the logits `[T, V]` of every row of the last layer's output `h` (the last step
    /// of [`Model::forward`]), for a host that runs the layers elsewhere.
    pub fn head(&self, h: &Tensor) -> Result<(Tensor, Tensor)> {
        let normed = rms_norm(h, &self.norm, self.config.rms_norm_eps)?;
        let logits = self.lm_head.forward(&normed)?;
        Ok((normed, logits))
    }

    /// Runs a prompt, in forward calls of `opts.prefill_block` tokens if set; returns the last token's logits.
    pub fn prefill(
        &self,
        ids: &[u32],
        state: &mut State,
        opts: &RunOptions,
        taps: &mut Taps,
    ) -> Result<Tensor> {
        let block = opts.prefill_block.unwrap_or(ids.len().max(1));
        if block == 0 {
            return Err(Error::Input(
                "prefill block must be at least 1 token".into(),
            ));
        }
        let mut logits = None;
        for piece in ids.chunks(block) {
            logits = Some(self.forward(piece, state, opts, taps)?);
        }
        logits.ok_or_else(|| Error::Input("empty prompt".into()))
    }
}

/// The index of the largest logit (the first one on ties).
pub fn argmax(logits: &Tensor) -> Result<u32> {
    let v: Vec<f64> = logits.to_dtype(DType::F64)?.to_vec1()?;
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if x.is_nan() {
            return Err(Error::Input(format!("logit {i} is NaN")));
        }
        if *x > v[best] {
            best = i;
        }
    }
    Ok(best as u32)
}
