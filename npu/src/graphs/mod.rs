//! The static NPU-style graphs of the decoder, built from the same weights the reference loads.
//!
//! The files mirror the reference's, block for block and with the same function and variable names, so the two can
//! be read side by side: [`ops`] (`reference::ops`: linear, the norms, the head repeat), [`deltanet`]
//! (`reference::deltanet`: the delta rule's forms), [`linear_attn`], [`attention`], [`rope`], [`mlp`], [`moe`] (the
//! sparse MoE block in place of the MLP, [`MoeGraphForm`]) and [`model`] (the block, the per-layer graph and the
//! decoder graph). Masks and bands come from `reference::masks`, weights
//! through `reference::schema`, port names from [`ports`].
//!
//! Every graph has static shapes and keeps its state explicit: the caller passes each layer's incoming conv state,
//! recurrent state or KV cache and receives the new ones, so every state can be compared with the reference.
//! Attention reads a static KV context of `context` slots plus the block's own keys, selected by an additive mask.
//!
//! # Per-layer graph (the probe's unit), `T` tokens
//! Inputs: `hidden` `[T, H]`; linear layers `conv_state` `[C, K]`, `recurrent_state` `[Hv, Dk, Dv]`,
//! `token_valid` `[T]` (1 real token, 0 padding); attention layers `past_keys`, `past_values` `[Hkv, CTX, D]`,
//! `attention_mask` `[T, CTX + T]` (0 or −inf), `positions` `[3, T]` (i64, MRoPE rows).
//! Outputs: `output` `[T, H]`, `mixer_output`, `mlp_output` `[T, H]`; linear layers `conv_state_out`,
//! `recurrent_state_out` and `linear_attn.{query, key, value, g, beta, core_output}` (`core_output` `[T, Hv, Dv]`
//! is the DeltaNet output before the gated norm, unscaled); attention layers `new_keys`, `new_values`
//! `[Hkv, T, D]` and `self_attn.gated_output`; an MoE block `mlp.{router_logits [T, E], experts_chosen [T, k]
//! (i64), expert_weights [T, k], shared_output [T, H]}`. The names match the dump format's, less the
//! `layers.{i}.` prefix.
//!
//! # MoE block graph (the probe's fed routing), `T` tokens
//! Inputs `hidden` `[T, H]` (the residual stream after the mixer), `experts_chosen` `[T, k]` (i64) and
//! `expert_weights` `[T, k]`; outputs `mlp_output` `[T, H]` and `mlp.shared_output`: an MoE layer's block from its
//! post-attention norm on, on the routing given ([`Builder::moe_block_graph`]).
//!
//! # Decoder graph
//! Inputs `input_ids` `[T]` (i64), `token_valid`, `positions`, `attention_mask` and every layer's state as
//! `layers.{i}.{conv_state, recurrent_state, past_keys, past_values}`; outputs `logits` `[T, V]`, `embeddings`,
//! `final_norm`, every layer's outputs as `layers.{i}.{output, mixer_output, mlp_output, …}` and the new states as
//! `layers.{i}.{conv_state_out, recurrent_state_out, new_keys, new_values}`.

pub mod attention;
pub mod deltanet;
pub mod linear_attn;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod ops;
pub mod ports;
pub mod rope;
pub mod vision;

use crate::error::{Error, Result};
use crate::ir::{ElemType, Graph, Value};
use rayon::prelude::*;
use reference::config::Config;
use reference::deltanet::Inverse;
use reference::quant::{QuantKind, QuantizedMatrix, Storage};
use reference::schema::{Param, Schema, TensorSpec};
use reference::weights::WeightStore;

/// The static KV context of the attention layers unless asked otherwise (the NPU port's).
pub const DEFAULT_CONTEXT: usize = 1024;

/// How a DeltaNet block is computed inside a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaNetGraphForm {
    /// The single-token matrix form, unrolled over the block's tokens.
    Matrix,
    /// The chunkwise-parallel form over the whole block with the given triangular inverse.
    Chunked(Inverse),
    /// One `Loop` op stepping the recurrence token by token, as the optimum-intel export has it (runs on CPU;
    /// NPUs cannot run `Loop`).
    Loop,
}

impl DeltaNetGraphForm {
    /// A short description (`matrix`, `loop`, `chunked(doubling)`).
    pub fn describe(&self) -> String {
        match self {
            DeltaNetGraphForm::Matrix => "matrix".into(),
            DeltaNetGraphForm::Loop => "loop".into(),
            DeltaNetGraphForm::Chunked(inverse) => format!("chunked({})", inverse.name()),
        }
    }

    /// The form of prompt blocks of `block` tokens as the reference names its forms (`chunked(16, doubling)`: a
    /// graph's chunk is its whole block; a block of one token is the matrix form).
    pub fn describe_block(&self, block: usize) -> String {
        match self {
            DeltaNetGraphForm::Chunked(inverse) if block > 1 => {
                format!("chunked({block}, {})", inverse.name())
            }
            DeltaNetGraphForm::Loop if block > 1 => "loop".into(),
            _ => "matrix".into(),
        }
    }
}

/// How an MoE block's routed experts are computed inside a graph of more than one token (a graph of one token
/// always gathers). Both read the experts' matrices from one stacked constant per projection (`[E, Im, H]` gate and
/// up, `[E, H, Im]` down) and give the same numbers up to the order of a sum (see `docs/moe.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoeGraphForm {
    /// Gathered where the experts are many against the chosen (`E ≥ 16·k`), masked otherwise: the form that was
    /// faster on the CPU device at each measured shape ([`MoeGraphForm::resolve`]).
    #[default]
    Auto,
    /// The chosen experts' matrices gathered by index (`[T·k]` of them), batched products, weighted and summed over
    /// the `k` chosen.
    Gather,
    /// Every expert on every token, combined with a dense `[T, E]` matrix of routing weights (zero for an expert
    /// not chosen) built from the chosen indices: static work, each matrix read once per block.
    Masked,
}

/// [`MoeGraphForm::Auto`] gathers when there are at least this many experts per chosen one. Measured on the CPU
/// device (docs/moe.md): at `E/k` 8 (64 experts, 8 chosen) masked blocks of 16 and 64 tokens were 2.5x and 2.8x
/// faster than gathered ones; at `E/k` 32 (the 35B-A3B's 256 and 8) gathered blocks were 1.6x and 1.4x faster and
/// compiled to half the memory.
pub const GATHER_FROM_EXPERTS_PER_CHOSEN: usize = 16;

impl MoeGraphForm {
    /// `auto`, `gather` or `masked`.
    pub fn name(self) -> &'static str {
        match self {
            MoeGraphForm::Auto => "auto",
            MoeGraphForm::Gather => "gather",
            MoeGraphForm::Masked => "masked",
        }
    }

    /// The form a graph of `tokens` tokens uses in a block of `experts` routed experts with `top_k` chosen per
    /// token: a single token gathers its `k` experts whatever the option; [`MoeGraphForm::Auto`] gathers when
    /// `experts ≥ 16·top_k` ([`GATHER_FROM_EXPERTS_PER_CHOSEN`]). Never [`MoeGraphForm::Auto`].
    pub fn resolve(self, tokens: usize, experts: usize, top_k: usize) -> MoeGraphForm {
        match self {
            _ if tokens == 1 => MoeGraphForm::Gather,
            MoeGraphForm::Auto if experts >= GATHER_FROM_EXPERTS_PER_CHOSEN * top_k => {
                MoeGraphForm::Gather
            }
            MoeGraphForm::Auto => MoeGraphForm::Masked,
            form => form,
        }
    }
}

/// Options of the graphs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GraphOptions {
    /// DeltaNet form for blocks of more than one token (one token always uses the matrix form).
    pub form: DeltaNetGraphForm,
    /// The fp16 rescaling of the DeltaNet output (q × S, gated-norm eps × S²); 1 turns it off.
    pub output_scale: f32,
    /// Static KV context of the attention layers.
    pub context: usize,
    /// Whether the graphs output every tap (the intermediates of the dump format) besides the logits and the
    /// states. A deployed graph has none: extra outputs can change what a device compiler fuses, so tokens and
    /// logits are taken from graphs without taps and the taps from a second set of graphs.
    pub taps: bool,
    /// Whether the decoder graphs take the token embeddings `[T, H]` (`embeddings`, looked up on the host: a
    /// prompt with images carries the vision tower's rows at its image tokens) instead of token ids; the NPU port's
    /// decoder takes them so, its text embeddings a graph of their own.
    pub embeddings_input: bool,
    /// How an MoE block's experts are computed in graphs of more than one token (one token always gathers).
    pub moe: MoeGraphForm,
}

impl Default for GraphOptions {
    /// The NPU port's graphs: chunked with block doubling, the ×1024 rescaling, a context of 1024; with taps; MoE
    /// prompt blocks in the form [`MoeGraphForm::Auto`] chooses.
    fn default() -> Self {
        GraphOptions {
            form: DeltaNetGraphForm::Chunked(Inverse::Doubling),
            output_scale: reference::linear_attn::PORT_OUTPUT_SCALE as f32,
            context: DEFAULT_CONTEXT,
            taps: true,
            embeddings_input: false,
            moe: MoeGraphForm::default(),
        }
    }
}

/// The graph's counterpart of `reference::taps::Taps`: records an intermediate as a graph output under its dump
/// name, or nothing when the graph is built without taps.
#[derive(Debug, Clone, Copy)]
pub struct GraphTaps {
    enabled: bool,
}

impl GraphTaps {
    /// Marks `value` as the output `name` when taps are on.
    pub fn record(
        &self,
        graph: &mut Graph,
        name: impl FnOnce() -> String,
        value: Value,
    ) -> Result<()> {
        if self.enabled {
            graph.result(value, &name())?;
        }
        Ok(())
    }
}

/// Builds graphs for one checkpoint.
pub struct Builder<'a> {
    config: &'a Config,
    weights: &'a WeightStore,
    opts: GraphOptions,
    stream_values: usize,
    /// Paces the hand-back of the checkpoint's pages read ([`crate::pages::Pacer`]).
    pages: crate::pages::Pacer,
}

/// Values per block of rows when a quantized matrix is streamed to a shared `.bin` unless asked otherwise (16 M:
/// 64 MB in f32 while a block is compressed).
pub const STREAM_BLOCK_VALUES: usize = 16 << 20;

impl<'a> Builder<'a> {
    /// A builder over a parsed config and an open weight store (f32).
    pub fn new(config: &'a Config, weights: &'a WeightStore, opts: GraphOptions) -> Result<Self> {
        if opts.context == 0 {
            return Err(Error::Config(
                "the static context must hold at least one token".into(),
            ));
        }
        reference::linear_attn::check_output_scale(opts.output_scale as f64)?;
        Ok(Builder {
            config,
            weights,
            opts,
            stream_values: STREAM_BLOCK_VALUES,
            pages: crate::pages::Pacer::default(),
        })
    }

    /// Compresses a matrix streamed to a shared `.bin` in blocks of about `values` values (whole rows, at least
    /// one; default [`STREAM_BLOCK_VALUES`]). The bytes written do not depend on it.
    pub fn with_stream_block(mut self, values: usize) -> Self {
        self.stream_values = values.max(1);
        self
    }

    /// The config the graphs are built for.
    pub fn config(&self) -> &Config {
        self.config
    }

    /// The options.
    pub fn options(&self) -> &GraphOptions {
        &self.opts
    }

    /// The format the weights are stored in.
    pub fn weight_format(&self) -> reference::quant::WeightFormat {
        self.weights.format()
    }

    /// The checkpoint's files the weights are read from.
    pub fn weight_paths(&self) -> Vec<&std::path::Path> {
        self.weights.paths()
    }

    /// The tap recorder of this builder's graphs.
    fn taps(&self) -> GraphTaps {
        GraphTaps {
            enabled: self.opts.taps,
        }
    }

    /// The tensors of the checkpoint.
    fn schema(&self) -> Schema<'a> {
        Schema::new(self.config)
    }

    /// A tensor's values on the host, as the reference loads them (f32).
    fn host(&self, spec: &TensorSpec) -> Result<Vec<f32>> {
        let t = self.weights.load(spec)?;
        Ok(t.to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// A layer's tensor on the host.
    fn layer_host(&self, layer: usize, param: Param) -> Result<Vec<f32>> {
        self.host(&self.schema().layer(layer, param))
    }

    /// A checkpoint matrix as an f32 value in the graph, stored as the weight store's format says: f32, f16
    /// (converted in the graph), or integer codes with f16 scales dequantized in the graph as
    /// `f32(code) * f32(scale)` (exact, and bit-identical to what the reference loads from the same store).
    ///
    /// In a graph on a [`crate::ir::SharedBin`] every checkpoint constant is keyed by the tensor's name, so graphs
    /// sharing the file share its weights; quantized matrices are compressed and written a block of rows at a time
    /// (the same bytes as compressing them whole), and the checkpoint pages read are handed back every 64 MiB
    /// ([`crate::pages::Pacer`]), so neither the f32 values nor the codes of a large tensor are ever whole in memory.
    fn matrix(&self, graph: &mut Graph, spec: &TensorSpec) -> Result<Value> {
        let value = self.matrix_value(graph, spec)?;
        // The checkpoint's pages just read (a whole tensor, in a graph held in memory) are counted and handed back
        // as they add up: a graph built from many tensors never holds their bf16 resident.
        if graph.shared_bin().is_none() {
            self.pages_read(spec.shape.iter().product());
        }
        Ok(value)
    }

    /// Notes `values` more read from the checkpoint (counted at 4 bytes, the widest a checkpoint stores them), its
    /// pages handed back once enough have been read ([`crate::pages::Pacer`]).
    pub(super) fn pages_read(&self, values: usize) {
        self.pages
            .read(values.saturating_mul(4), &self.weights.paths());
    }

    /// [`Builder::matrix`]'s value.
    fn matrix_value(&self, graph: &mut Graph, spec: &TensorSpec) -> Result<Value> {
        let shape = spec.shape.as_slice();
        let streamed = graph.shared_bin().is_some();
        let key = |part: &str| streamed.then(|| format!("{}#{part}", spec.name));
        let storage = self.weights.storage(spec);
        match storage {
            Storage::Float => {
                let data = self.host(spec)?;
                self.keyed_f32(graph, key("f32").as_deref(), &data, shape)
            }
            Storage::F16 => {
                let h: Vec<half::f16> = self
                    .host(spec)?
                    .iter()
                    .map(|&x| half::f16::from_f32(x))
                    .collect();
                let bytes: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
                let c = graph.constant_streamed(
                    key("f16").as_deref(),
                    ElemType::F16,
                    shape,
                    |sink| sink(&bytes),
                )?;
                graph.convert(c, ElemType::F32)
            }
            Storage::Int4Sym { .. } | Storage::Int8Sym if streamed => {
                let (rows, cols) = match *shape {
                    [rows, cols] | [rows, 1, cols] => (rows, cols),
                    _ => {
                        return Err(Error::graph(
                            graph.name(),
                            format!("{}: only matrices are quantized, not {shape:?}", spec.name),
                        ));
                    }
                };
                let (ty, group) = match storage {
                    Storage::Int4Sym { group } => (ElemType::I4, group),
                    _ => (ElemType::I8, cols),
                };
                let groups = cols / group.max(1);
                // Blocks of about `stream_values` values: whole rows, and an even count of int4 codes.
                let mut block = (self.stream_values / cols.max(1)).max(1);
                if ty == ElemType::I4 && cols % 2 == 1 {
                    block = rows;
                }
                let mut scales: Vec<half::f16> = Vec::new();
                let graph_name = graph.name().to_string();
                let codes = graph.constant_streamed(
                    key("codes").as_deref(),
                    ty,
                    &[rows, groups, group],
                    |sink| {
                        scales.reserve(rows * groups);
                        // A batch of blocks at a time, one per thread, written in order.
                        let starts: Vec<usize> = (0..rows).step_by(block).collect();
                        for batch in starts.chunks(rayon::current_num_threads().max(1)) {
                            let pieces: Vec<Result<QuantizedMatrix>> = batch
                                .par_iter()
                                .map(|&start| {
                                    let rows = start..(start + block).min(rows);
                                    self.weights.quantized_rows(spec, rows)?.ok_or_else(|| {
                                        Error::graph(
                                            &graph_name,
                                            format!("{}: the store did not quantize it", spec.name),
                                        )
                                    })
                                })
                                .collect();
                            for q in pieces {
                                let q = q?;
                                sink(&q.packed_codes())?;
                                scales.extend_from_slice(q.scales());
                            }
                            self.pages_read(batch.len() * block * cols);
                        }
                        Ok(())
                    },
                )?;
                let codes = graph.convert(codes, ElemType::F32)?;
                let scales = graph.constant_streamed(
                    key("scales").as_deref(),
                    ElemType::F16,
                    &[rows, groups, 1],
                    |sink| {
                        let bytes: Vec<u8> = scales.iter().flat_map(|x| x.to_le_bytes()).collect();
                        sink(&bytes)
                    },
                )?;
                let scales = graph.convert(scales, ElemType::F32)?;
                let deq = graph.mul(codes, scales)?;
                graph.reshape(deq, shape)
            }
            Storage::Int4Sym { .. } | Storage::Int8Sym => {
                let q = self.weights.quantized(spec)?.ok_or_else(|| {
                    Error::graph(
                        graph.name(),
                        format!("{}: the store did not quantize it", spec.name),
                    )
                })?;
                let (rows, cols) = (q.rows(), q.cols());
                let [_, groups] = q.scale_shape();
                let group = cols / groups;
                let ty = match q.kind() {
                    QuantKind::Int4Sym { .. } => ElemType::I4,
                    QuantKind::Int8Sym => ElemType::I8,
                };
                let codes = graph.constant_bytes(ty, &[rows, groups, group], &q.packed_codes())?;
                let codes = graph.convert(codes, ElemType::F32)?;
                let scales = graph.const_f16(q.scales(), &[rows, groups, 1])?;
                let scales = graph.convert(scales, ElemType::F32)?;
                let deq = graph.mul(codes, scales)?;
                graph.reshape(deq, shape)
            }
        }
    }

    /// An f32 constant, written once per key in a shared `.bin` (`key` `None`: always written).
    fn keyed_f32(
        &self,
        graph: &mut Graph,
        key: Option<&str>,
        data: &[f32],
        shape: &[usize],
    ) -> Result<Value> {
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        graph.constant_streamed(key, ElemType::F32, shape, |sink| sink(&bytes))
    }

    /// A zero-centred RMSNorm's `1 + w` as a graph constant, folded on the host in f32 (the reference adds the 1 in
    /// f32 too).
    fn norm_weight(&self, graph: &mut Graph, spec: &TensorSpec) -> Result<Value> {
        let w: Vec<f32> = self.host(spec)?.iter().map(|w| w + 1.0).collect();
        let key = graph
            .shared_bin()
            .is_some()
            .then(|| format!("{}#norm", spec.name));
        self.keyed_f32(graph, key.as_deref(), &w, &spec.shape)
    }

    /// A layer's weight matrix in the graph.
    fn layer_matrix(&self, graph: &mut Graph, layer: usize, param: Param) -> Result<Value> {
        self.matrix(graph, &self.schema().layer(layer, param))
    }
}

#[cfg(test)]
mod tests {
    use super::MoeGraphForm::{self, Auto, Gather, Masked};

    #[test]
    fn auto_gathers_where_experts_are_many_against_the_chosen() {
        // The 35B-A3B's 256 experts of 8 chosen gather; 64 of 8 and tiny-moe's 8 of 3 are masked; a token gathers.
        assert_eq!(Auto.resolve(16, 256, 8), Gather);
        assert_eq!(Auto.resolve(16, 128, 8), Gather);
        assert_eq!(Auto.resolve(16, 127, 8), Masked);
        assert_eq!(Auto.resolve(64, 64, 8), Masked);
        assert_eq!(Auto.resolve(16, 8, 3), Masked);
        for form in [Auto, Gather, Masked] {
            assert_eq!(form.resolve(1, 8, 3), Gather, "{form:?}");
        }
        let explicit: [(MoeGraphForm, usize); 2] = [(Gather, 8), (Masked, 256)];
        for (form, experts) in explicit {
            assert_eq!(form.resolve(16, experts, 8), form);
        }
    }
}
