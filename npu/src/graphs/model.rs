//! The decoder block and the graphs built from it (`reference::model`): the per-layer graph, the probe's unit, and
//! the whole decoder with every cache an explicit input and output (see the module docs of [`super`]); and an MoE
//! layer's block on a routing given to it, with which the probe judges the experts apart from the router.

use super::Builder;
use super::attention::{Attention, KvCache};
use super::linear_attn::{DeltaNetOptions, GatedDeltaNet, LinearState};
use super::mlp::Mlp;
use super::moe::{Routing, SparseMoe};
use super::ops::rms_norm;
use super::ports::{self, StatePorts};
use super::rope::{self, RotaryTables};
use crate::error::{Error, Result};
use crate::ir::{ElemType, Graph, SharedBin, Value};
use reference::config::LayerKind;
use reference::schema::Param;
use reference::taps::names;

/// A layer's token mixer, its weights in the graph.
enum Mixer {
    Linear(GatedDeltaNet),
    Attention(Attention),
}

/// A layer's feed-forward block (`mlp.*`).
enum FeedForward {
    /// The dense SwiGLU MLP.
    Dense(Mlp),
    /// The sparse MoE block (Qwen3.5-MoE).
    Moe(Box<SparseMoe>),
}

/// One decoder block: `h += mixer(input_norm(h)); h += mlp(post_norm(h))`.
struct DecoderLayer {
    input_layernorm: Value,
    post_attention_layernorm: Value,
    mixer: Mixer,
    mlp: FeedForward,
}

/// What a block reads besides the residual stream: the token mask, and for attention the mask and the rotation.
struct BlockInputs {
    token_valid: Option<Value>,
    attention_mask: Option<Value>,
    rotary: Option<RotaryTables>,
}

impl<'a> Builder<'a> {
    /// Puts layer `layer`'s weights into `graph`.
    fn decoder_layer(&self, graph: &mut Graph, layer: usize) -> Result<DecoderLayer> {
        let s = self.schema();
        let mixer = match self.config.layer_types[layer] {
            LayerKind::Linear => Mixer::Linear(GatedDeltaNet::load(self, graph, layer)?),
            LayerKind::Full => Mixer::Attention(Attention::load(self, graph, layer)?),
        };
        Ok(DecoderLayer {
            input_layernorm: self.norm_weight(graph, &s.layer(layer, Param::InputLayernorm))?,
            post_attention_layernorm: self
                .norm_weight(graph, &s.layer(layer, Param::PostAttentionLayernorm))?,
            mixer,
            mlp: match self.config.moe {
                Some(_) => FeedForward::Moe(Box::new(SparseMoe::load(self, graph, layer)?)),
                None => FeedForward::Dense(Mlp::load(self, graph, layer)?),
            },
        })
    }

    /// One decoder block on `h`, its ports and outputs named under `prefix` (empty in a per-layer graph,
    /// `layers.{i}.` in the decoder graph): the state enters through the layer kind's [`StatePorts`] inputs and leaves
    /// through its outputs; `mixer_output` and `mlp_output` are outputs, as are the mixer's own taps and an MoE block's.
    fn block(
        &self,
        graph: &mut Graph,
        h: Value,
        layer: usize,
        inputs: &BlockInputs,
        prefix: &str,
    ) -> Result<Value> {
        let c = self.config;
        let eps = c.rms_norm_eps as f32;
        let weights = self.decoder_layer(graph, layer)?;
        let kind = c.layer_types[layer];
        let StatePorts {
            inputs: state_in,
            outputs: state_out,
        } = ports::state_ports(kind);
        let port = |name: &str| format!("{prefix}{name}");
        let graph_name = graph.name().to_string();
        let missing = |what: &str| Error::graph(&graph_name, format!("layer {layer} needs {what}"));

        let x = rms_norm(graph, h, weights.input_layernorm, eps)?;
        let mixed = match &weights.mixer {
            Mixer::Linear(m) => {
                let token_valid = inputs
                    .token_valid
                    .ok_or_else(|| missing(ports::TOKEN_VALID))?;
                let state = LinearState {
                    conv: graph.parameter(
                        &port(state_in[0]),
                        ElemType::F32,
                        &[c.linear_conv_dim(), c.linear_conv_kernel_dim],
                    ),
                    recurrent: graph.parameter(
                        &port(state_in[1]),
                        ElemType::F32,
                        &[
                            c.linear_num_value_heads,
                            c.linear_key_head_dim,
                            c.linear_value_head_dim,
                        ],
                    ),
                };
                let opts = DeltaNetOptions {
                    form: self.opts.form,
                    output_scale: self.opts.output_scale,
                };
                let tap = port(names::LINEAR_ATTN);
                let (out, state) =
                    m.forward(graph, x, state, token_valid, &opts, self.taps(), &tap)?;
                graph.result(state.conv, &port(state_out[0]))?;
                graph.result(state.recurrent, &port(state_out[1]))?;
                out
            }
            Mixer::Attention(m) => {
                let mask = inputs
                    .attention_mask
                    .ok_or_else(|| missing(ports::ATTENTION_MASK))?;
                let rotary = inputs.rotary.ok_or_else(|| missing(ports::POSITIONS))?;
                let shape = [c.num_key_value_heads, self.opts.context, c.head_dim];
                let cache = KvCache {
                    keys: graph.parameter(&port(state_in[0]), ElemType::F32, &shape),
                    values: graph.parameter(&port(state_in[1]), ElemType::F32, &shape),
                };
                let tap = port(names::SELF_ATTN);
                let (out, new) = m.forward(graph, x, cache, mask, &rotary, self.taps(), &tap)?;
                graph.result(new.keys, &port(state_out[0]))?;
                graph.result(new.values, &port(state_out[1]))?;
                out
            }
        };
        let taps = self.taps();
        taps.record(graph, || port(names::MIXER_OUTPUT), mixed)?;
        let h = graph.add(h, mixed)?;
        let x = rms_norm(graph, h, weights.post_attention_layernorm, eps)?;
        let m = match &weights.mlp {
            FeedForward::Dense(mlp) => mlp.forward(graph, x)?,
            FeedForward::Moe(moe) => {
                moe.forward(graph, x, self.opts.moe, taps, &port(names::MLP))?
            }
        };
        taps.record(graph, || port(names::MLP_OUTPUT), m)?;
        graph.add(h, m)
    }

    /// The inputs every block of a `tokens`-slot graph may read, created as graph parameters.
    fn block_inputs(
        &self,
        graph: &mut Graph,
        tokens: usize,
        kinds: &[LayerKind],
    ) -> Result<BlockInputs> {
        let token_valid = kinds
            .contains(&LayerKind::Linear)
            .then(|| graph.parameter(ports::TOKEN_VALID, ElemType::F32, &[tokens]));
        let (attention_mask, rotary) = if kinds.contains(&LayerKind::Full) {
            let mask = graph.parameter(
                ports::ATTENTION_MASK,
                ElemType::F32,
                &[tokens, self.opts.context + tokens],
            );
            let positions = graph.parameter(ports::POSITIONS, ElemType::I64, &[3, tokens]);
            (
                Some(mask),
                Some(rope::tables(graph, self.config, positions)?),
            )
        } else {
            (None, None)
        };
        Ok(BlockInputs {
            token_valid,
            attention_mask,
            rotary,
        })
    }

    /// The per-layer graph of `layer` for blocks of `tokens` tokens (see the module docs of [`super`]).
    pub fn layer_graph(&self, layer: usize, tokens: usize) -> Result<Graph> {
        self.layer_graph_on(layer, tokens, None)
    }

    /// [`Builder::layer_graph`] with its constants streamed to `bin` (`None`: kept in memory), which it shares with
    /// every other graph built on it.
    pub fn layer_graph_on(
        &self,
        layer: usize,
        tokens: usize,
        bin: Option<&SharedBin>,
    ) -> Result<Graph> {
        self.check_tokens(tokens)?;
        let c = self.config;
        let kind = *c.layer_types.get(layer).ok_or_else(|| {
            Error::Input(format!(
                "layer {layer} does not exist ({} layers)",
                c.num_layers()
            ))
        })?;
        let name = format!("layer{layer}_{}_t{tokens}", kind.name());
        let mut graph = match bin {
            Some(bin) => Graph::with_shared_bin(&name, bin),
            None => Graph::new(&name),
        };
        let h = graph.parameter(ports::HIDDEN, ElemType::F32, &[tokens, c.hidden_size]);
        let inputs = self.block_inputs(&mut graph, tokens, &[kind])?;
        let out = self.block(&mut graph, h, layer, &inputs, "")?;
        graph.result(out, names::OUTPUT)?; // a per-layer graph's output is its purpose, taps or not
        Ok(graph)
    }

    /// Layer `layer`'s MoE block for blocks of `tokens` tokens on the routing given to it, the probe's fed-routing
    /// graph: the layer's `post_attention_layernorm`, then its routed experts on that routing and its gated shared
    /// expert, as the layer's own graph computes them from the norm on, less the router.
    ///
    /// # Shapes
    /// Inputs `hidden` `[T, H]`, the residual stream after the mixer (the layer's input plus its mixer output),
    /// `experts_chosen` `[T, k]` (i64, each token's experts) and `expert_weights` `[T, k]` (their weights).
    /// Outputs `mlp_output` `[T, H]` and, with taps, `mlp.shared_output` `[T, H]`.
    pub fn moe_block_graph(&self, layer: usize, tokens: usize) -> Result<Graph> {
        self.check_tokens(tokens)?;
        let c = self.config;
        let moe = c.moe.as_ref().ok_or_else(|| {
            Error::Config(format!(
                "layer {layer}: the config has no MoE block (not a qwen3_5_moe decoder)"
            ))
        })?;
        if layer >= c.num_layers() {
            return Err(Error::Input(format!(
                "layer {layer} does not exist ({} layers)",
                c.num_layers()
            )));
        }
        let k = moe.num_experts_per_tok;
        let mut graph = Graph::new(&format!("layer{layer}_moe_block_t{tokens}"));
        let h = graph.parameter(ports::HIDDEN, ElemType::F32, &[tokens, c.hidden_size]);
        let routing = Routing {
            experts: graph.parameter(ports::EXPERTS_CHOSEN, ElemType::I64, &[tokens, k]),
            weights: graph.parameter(ports::EXPERT_WEIGHTS, ElemType::F32, &[tokens, k]),
        };
        let norm = self.norm_weight(
            &mut graph,
            &self.schema().layer(layer, Param::PostAttentionLayernorm),
        )?;
        let block = SparseMoe::load(self, &mut graph, layer)?;
        let x = rms_norm(&mut graph, h, norm, c.rms_norm_eps as f32)?;
        let m = block.forward_routed(
            &mut graph,
            x,
            &routing,
            self.opts.moe,
            self.taps(),
            names::MLP,
        )?;
        graph.result(m, names::MLP_OUTPUT)?; // the graph's purpose, taps or not
        Ok(graph)
    }

    /// The whole decoder for blocks of `tokens` tokens, every cache an explicit input and output.
    pub fn decoder_graph(&self, tokens: usize) -> Result<Graph> {
        self.decoder_graph_on(tokens, None)
    }

    /// [`Builder::decoder_graph`] with its constants streamed to `bin` as they are made (`None`: kept in memory).
    /// Graphs built on one [`SharedBin`] share every checkpoint tensor in it: the weights are compressed and written
    /// once, by the first graph that needs them.
    pub fn decoder_graph_on(&self, tokens: usize, bin: Option<&SharedBin>) -> Result<Graph> {
        self.check_tokens(tokens)?;
        let c = self.config;
        let s = self.schema();
        let name = format!("decoder_t{tokens}");
        let mut graph = match bin {
            Some(bin) => Graph::with_shared_bin(&name, bin),
            None => Graph::new(&name),
        };
        let embeddings = self
            .opts
            .embeddings_input
            .then(|| graph.parameter(ports::EMBEDDINGS, ElemType::F32, &[tokens, c.hidden_size]));
        let ids = embeddings
            .is_none()
            .then(|| graph.parameter(ports::INPUT_IDS, ElemType::I64, &[tokens]));
        let inputs = self.block_inputs(&mut graph, tokens, &c.layer_types)?;
        // The table is in the graph when it gathers the rows, or when it is the tied LM head.
        let embed_tokens = match (ids, c.tie_word_embeddings) {
            (None, false) => None,
            _ => Some(self.matrix(&mut graph, &s.global(Param::EmbedTokens))?),
        };
        let taps = self.taps();
        let mut h = match (ids, embed_tokens, embeddings) {
            (Some(ids), Some(table), _) => graph.gather(table, ids, 0)?,
            (_, _, Some(rows)) => rows,
            _ => unreachable!("a decoder graph takes token ids or embeddings"),
        };
        taps.record(&mut graph, || names::EMBEDDINGS.into(), h)?;
        for layer in 0..c.num_layers() {
            let prefix = ports::layer_prefix(layer);
            h = self.block(&mut graph, h, layer, &inputs, &prefix)?;
            taps.record(&mut graph, || names::layer(layer, names::OUTPUT), h)?;
        }
        let norm = self.norm_weight(&mut graph, &s.global(Param::Norm))?;
        let normed = rms_norm(&mut graph, h, norm, c.rms_norm_eps as f32)?;
        taps.record(&mut graph, || names::FINAL_NORM.into(), normed)?;
        let lm_head = if let (true, Some(table)) = (c.tie_word_embeddings, embed_tokens) {
            table
        } else {
            self.matrix(&mut graph, &s.global(Param::LmHead))?
        };
        let logits = graph.matmul(normed, lm_head, false, true)?;
        graph.result(logits, names::LOGITS)?;
        Ok(graph)
    }

    fn check_tokens(&self, tokens: usize) -> Result<()> {
        if tokens == 0 {
            return Err(Error::Input("a graph needs at least one token".into()));
        }
        Ok(())
    }
}
