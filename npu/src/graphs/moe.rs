//! The sparse MoE block as graph ops (`reference::moe`), in place of the MLP:
//!
//! - router: `logits = x W_rᵀ` (`mlp.gate.weight` `[E, H]`), `p = softmax(logits)`, the `k` largest `p` in
//!   descending order (`TopK`, stable: equal probabilities lower index first, as the reference orders exact ties),
//!   their weights `p / Σ p` over the chosen (always renormalised);
//! - the routed experts `down_e(silu(gate_e(x)) · up_e(x))`, weighted and summed over the chosen, in one of two forms
//!   ([`MoeGraphForm`]): gathered by index or masked by a dense routing matrix;
//! - the shared expert, an MLP of its own width, times `sigmoid(shared_expert_gate · x)` (`[1, H]`), added.
//!
//! Each projection of the routed experts is one stacked constant (`[E, Im, H]` gate and up, `[E, H, Im]` down; gate
//! and up apart, as the checkpoint stores them and the reference reads them), in the builder's weight format:
//! [`Builder::expert_stack`].
//!
//! The sum over the chosen experts runs in rank order (gather) or in expert order (masked), where the reference adds
//! the experts in ascending expert order: the same numbers up to the rounding of a sum of `k` terms.

use super::mlp::Mlp;
use super::ops::{linear, sigmoid, silu};
use super::{Builder, GraphTaps, MoeGraphForm};
use crate::error::{Error, Result};
use crate::ir::{ElemType, Graph, Value};
use reference::quant::Storage;
use reference::schema::{Param, TensorSpec};
use reference::taps::names;

/// The routed experts' matrices, one stacked constant per projection.
pub struct Experts {
    /// `mlp.experts.{e}.gate_proj` for every `e`: `[E, Im, H]`.
    gate_proj: Stack,
    /// `mlp.experts.{e}.up_proj`: `[E, Im, H]`.
    up_proj: Stack,
    /// `mlp.experts.{e}.down_proj`: `[E, H, Im]`.
    down_proj: Stack,
}

/// One projection of every routed expert, `[E, rows, cols]`, as the graph stores it; its values in f32 are made
/// where they are read: the whole stack for the masked form, the chosen experts for the gathered one.
#[derive(Debug, Clone, Copy)]
pub enum Stack {
    /// The values: f32, or an f16 constant and its `Convert` to f32.
    Values(Value),
    /// Integer codes and their f16 scales, each expert's rows after the one before.
    Coded {
        /// `[E·rows, groups, group]`, INT4 or INT8.
        codes: Value,
        /// `[E·rows, groups, 1]`.
        scales: Value,
        /// `[E, rows, cols]`.
        shape: [usize; 3],
    },
}

impl Stack {
    /// `[E, rows, cols]`.
    pub fn shape(&self, graph: &Graph) -> [usize; 3] {
        match *self {
            Stack::Values(v) => {
                let s = graph.shape(v);
                [s[0], s[1], s[2]]
            }
            Stack::Coded { shape, .. } => shape,
        }
    }

    /// Every expert's matrix in f32, `[E, rows, cols]`: the codes times their scales.
    pub fn whole(&self, graph: &mut Graph) -> Result<Value> {
        match *self {
            Stack::Values(v) => Ok(v),
            Stack::Coded {
                codes,
                scales,
                shape,
            } => {
                let deq = dequantize(graph, codes, scales)?;
                graph.reshape(deq, &shape)
            }
        }
    }

    /// The matrices of experts `index` (`[n]`, i64) in f32, as `[..lead, rows, cols]` (`lead` multiplying to
    /// `n`). Codes are gathered with their scales before they are dequantized, so a device holds the stack as stored
    /// (an OpenVINO plugin folds a constant's dequantization into f32 values: gathering the dequantized stack kept
    /// every expert's matrix in f32).
    pub fn pick(&self, graph: &mut Graph, index: Value, lead: &[usize]) -> Result<Value> {
        let [e, rows, cols] = self.shape(graph);
        let mut out = lead.to_vec();
        out.extend([rows, cols]);
        let w = match *self {
            Stack::Values(v) => graph.gather(v, index, 0)?,
            Stack::Coded { codes, scales, .. } => {
                let per_expert = |graph: &mut Graph, v: Value| -> Result<Value> {
                    let s = graph.shape(v).to_vec();
                    let v = graph.reshape(v, &[e, rows, s[1], s[2]])?;
                    graph.gather(v, index, 0)
                };
                let codes = per_expert(graph, codes)?;
                let scales = per_expert(graph, scales)?;
                dequantize(graph, codes, scales)?
            }
        };
        graph.reshape(w, &out)
    }
}

/// `codes · scales` in f32.
fn dequantize(graph: &mut Graph, codes: Value, scales: Value) -> Result<Value> {
    let codes = graph.convert(codes, ElemType::F32)?;
    let scales = graph.convert(scales, ElemType::F32)?;
    graph.mul(codes, scales)
}

/// The weights of `mlp.*` in an MoE layer as graph constants, after their checkpoint keys.
pub struct SparseMoe {
    /// `mlp.gate.weight`: the router `[E, H]`.
    gate: Value,
    /// `mlp.experts.*`, stacked.
    experts: Experts,
    /// `mlp.shared_expert.{gate_proj, up_proj, down_proj}`.
    shared_expert: Mlp,
    /// `mlp.shared_expert_gate.weight` `[1, H]`.
    shared_expert_gate: Value,
    /// Experts per token.
    top_k: usize,
}

/// The routing of a call's tokens, as graph values: the block's own ([`SparseMoe::route`]), or given to the graph
/// as inputs ([`SparseMoe::forward_routed`]).
pub struct Routing {
    /// `[T, k]` expert indices (i64), in descending probability.
    pub experts: Value,
    /// `[T, k]` weights, summing to 1 per token.
    pub weights: Value,
}

impl SparseMoe {
    /// Puts layer `layer`'s MoE block into `graph` (the config must have one).
    pub fn load(builder: &Builder, graph: &mut Graph, layer: usize) -> Result<Self> {
        let moe = builder.config.moe.as_ref().ok_or_else(|| {
            Error::Config(format!(
                "layer {layer}: the config has no MoE block (not a qwen3_5_moe decoder)"
            ))
        })?;
        Ok(SparseMoe {
            gate: builder.layer_matrix(graph, layer, Param::RouterGate)?,
            experts: Experts {
                gate_proj: builder.expert_stack(graph, layer, Param::ExpertGateProj)?,
                up_proj: builder.expert_stack(graph, layer, Param::ExpertUpProj)?,
                down_proj: builder.expert_stack(graph, layer, Param::ExpertDownProj)?,
            },
            shared_expert: Mlp::load_params(
                builder,
                graph,
                layer,
                [
                    Param::SharedGateProj,
                    Param::SharedUpProj,
                    Param::SharedDownProj,
                ],
            )?,
            shared_expert_gate: builder.layer_matrix(graph, layer, Param::SharedExpertGate)?,
            top_k: moe.num_experts_per_tok,
        })
    }

    /// The router's logits `[T, E]` of `x` `[T, H]`.
    pub fn router_logits(&self, graph: &mut Graph, x: Value) -> Result<Value> {
        linear(graph, x, self.gate)
    }

    /// The routing of router logits `[T, E]`: softmax, the top `k` in descending probability (lower index first on
    /// exact ties), renormalised.
    pub fn route(&self, graph: &mut Graph, logits: Value) -> Result<Routing> {
        let probs = graph.softmax(logits, 1)?;
        let (top, experts) = graph.topk(probs, self.top_k, 1)?;
        let sum = graph.reduce_sum(top, &[1], true)?;
        let weights = graph.div(top, sum)?;
        Ok(Routing { experts, weights })
    }

    /// `x` `[T, H]` → `[T, H]`, the routed experts in `form` (a single token always gathers), recording
    /// `{scope}.router_logits`, `experts_chosen` (i64), `expert_weights` and `shared_output` (scope: `mlp`, under
    /// `layers.{i}.` in the decoder graph).
    pub fn forward(
        &self,
        graph: &mut Graph,
        x: Value,
        form: MoeGraphForm,
        taps: GraphTaps,
        scope: &str,
    ) -> Result<Value> {
        let logits = self.router_logits(graph, x)?;
        taps.record(graph, || names::mixer(scope, names::ROUTER_LOGITS), logits)?;
        let routing = self.route(graph, logits)?;
        taps.record(
            graph,
            || names::mixer(scope, names::EXPERTS_CHOSEN),
            routing.experts,
        )?;
        taps.record(
            graph,
            || names::mixer(scope, names::EXPERT_WEIGHTS),
            routing.weights,
        )?;
        self.forward_routed(graph, x, &routing, form, taps, scope)
    }

    /// `x` `[T, H]` → `[T, H]` on `routing`, the block's own or given to the graph (the per-layer probe feeds the
    /// reference's, so that the experts' arithmetic is judged apart from the router's choice): the routed experts in
    /// `form` (a single token always gathers) plus the gated shared expert, recording `{scope}.shared_output`.
    pub fn forward_routed(
        &self,
        graph: &mut Graph,
        x: Value,
        routing: &Routing,
        form: MoeGraphForm,
        taps: GraphTaps,
        scope: &str,
    ) -> Result<Value> {
        let t = graph.shape(x)[0];
        let experts = self.experts.gate_proj.shape(graph)[0];
        let out = match form.resolve(t, experts, self.top_k) {
            MoeGraphForm::Masked => self.experts.masked(graph, x, routing)?,
            _ => self.experts.gathered(graph, x, routing)?,
        };
        let gate = linear(graph, x, self.shared_expert_gate)?;
        let gate = sigmoid(graph, gate)?;
        let shared = self.shared_expert.forward(graph, x)?;
        let shared = graph.mul(shared, gate)?;
        taps.record(graph, || names::mixer(scope, names::SHARED_OUTPUT), shared)?;
        graph.add(out, shared)
    }

    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }
}

impl Experts {
    /// The chosen experts only: their matrices gathered from the stacks by index (`T·k` of each), one product per
    /// token and rank, weighted and summed over the `k` chosen. `x` `[T, H]` → `[T, H]`.
    ///
    /// # Shapes
    /// `x` `[T, 1, 1, H]` · gathered `gate_proj`, `up_proj` `[T, k, Im, H]`ᵀ → `[T, k, 1, Im]`; · gathered
    /// `down_proj` `[T, k, H, Im]`ᵀ → `[T, k, 1, H]`; times the weights `[T, k, 1]`, summed over `k`.
    pub fn gathered(&self, graph: &mut Graph, x: Value, routing: &Routing) -> Result<Value> {
        let (t, h) = (graph.shape(x)[0], graph.shape(x)[1]);
        let k = graph.shape(routing.experts)[1];
        let index = graph.reshape(routing.experts, &[t * k])?;
        let pick = |graph: &mut Graph, stack: &Stack| stack.pick(graph, index, &[t, k]);
        let x = graph.reshape(x, &[t, 1, 1, h])?;
        let gate_proj = pick(graph, &self.gate_proj)?;
        let gate = linear(graph, x, gate_proj)?;
        let gate = silu(graph, gate)?;
        let up_proj = pick(graph, &self.up_proj)?;
        let up = linear(graph, x, up_proj)?;
        let hidden = graph.mul(gate, up)?;
        let down_proj = pick(graph, &self.down_proj)?;
        let y = linear(graph, hidden, down_proj)?;
        let y = graph.reshape(y, &[t, k, h])?;
        let w = graph.reshape(routing.weights, &[t, k, 1])?;
        let y = graph.mul(y, w)?;
        graph.reduce_sum(y, &[1], false)
    }

    /// Every expert on every token, combined with the dense routing matrix `[T, E]` (each token's renormalised
    /// weight at its chosen experts, zero elsewhere) built from the chosen indices by `OneHot`. `x` `[T, H]` →
    /// `[T, H]`.
    ///
    /// # Shapes
    /// `x` `[T, H]` · `gate_proj`, `up_proj` `[E, Im, H]`ᵀ → `[E, T, Im]`; · `down_proj` `[E, H, Im]`ᵀ →
    /// `[E, T, H]`; times the routing matrix as `[E, T, 1]`, summed over `E`.
    pub fn masked(&self, graph: &mut Graph, x: Value, routing: &Routing) -> Result<Value> {
        let t = graph.shape(x)[0];
        let e = self.gate_proj.shape(graph)[0];
        let k = graph.shape(routing.experts)[1];
        let gate_proj = self.gate_proj.whole(graph)?;
        let gate = linear(graph, x, gate_proj)?;
        let gate = silu(graph, gate)?;
        let up_proj = self.up_proj.whole(graph)?;
        let up = linear(graph, x, up_proj)?;
        let hidden = graph.mul(gate, up)?;
        let down_proj = self.down_proj.whole(graph)?;
        let y = linear(graph, hidden, down_proj)?;
        // `[T, k, E]` one-hot rows times the weights `[T, k, 1]`, summed over `k`: the dense `[T, E]` matrix.
        let chosen = graph.one_hot(routing.experts, e)?;
        let w = graph.reshape(routing.weights, &[t, k, 1])?;
        let dense = graph.mul(chosen, w)?;
        let dense = graph.reduce_sum(dense, &[1], false)?;
        let dense = graph.transpose(dense, &[1, 0])?;
        let dense = graph.reshape(dense, &[e, t, 1])?;
        let y = graph.mul(y, dense)?;
        graph.reduce_sum(y, &[0], false)
    }
}

impl Builder<'_> {
    /// Every routed expert's matrix of one projection (`param(e)` for `e` in `0..E`) as one constant
    /// `[E, rows, cols]`, stored as [`Builder::matrix`] stores each of them on its own: f32; f16 converted in the
    /// graph; or integer codes `[E·rows, groups, group]` and f16 scales `[E·rows, groups, 1]` dequantized in the
    /// graph, each expert's own codes and scales as the weight store quantizes that expert (the experts one after
    /// the other), so the values are bit for bit the reference's on the same store.
    ///
    /// The experts are read and written one at a time. In a graph on a [`crate::ir::SharedBin`] the stack is keyed
    /// by its first expert's tensor name and the count (`layers.{i}.mlp.experts.0.gate_proj.weight#stack8#f32`), so
    /// every graph on the file shares it.
    pub(super) fn expert_stack(
        &self,
        graph: &mut Graph,
        layer: usize,
        param: fn(usize) -> Param,
    ) -> Result<Stack> {
        let experts = self.config.moe.as_ref().map_or(0, |m| m.num_experts);
        let s = self.schema();
        let specs: Vec<TensorSpec> = (0..experts).map(|e| s.layer(layer, param(e))).collect();
        let graph_name = graph.name().to_string();
        let err = |m: String| Error::graph(&graph_name, m);
        let first = specs
            .first()
            .ok_or_else(|| err(format!("layer {layer}: an MoE block without experts")))?;
        let &[rows, cols] = first.shape.as_slice() else {
            return Err(err(format!("{}: not a matrix", first.name)));
        };
        let shape = [experts, rows, cols];
        let streamed = graph.shared_bin().is_some();
        let key = |part: &str| streamed.then(|| format!("{}#stack{experts}#{part}", first.name));
        // Each expert's bytes in turn, the checkpoint's pages read handed back as they add up.
        let each = |bytes_of: &dyn Fn(&TensorSpec) -> Result<Vec<u8>>,
                    sink: &mut dyn FnMut(&[u8]) -> Result<()>|
         -> Result<()> {
            for spec in &specs {
                sink(&bytes_of(spec)?)?;
                self.pages_read(spec.shape.iter().product());
            }
            Ok(())
        };
        let storage = self.weights.storage(first);
        match storage {
            Storage::Float => {
                let f32_bytes = |spec: &TensorSpec| -> Result<Vec<u8>> {
                    Ok(self
                        .host(spec)?
                        .iter()
                        .flat_map(|x| x.to_le_bytes())
                        .collect())
                };
                let c = graph.constant_streamed(
                    key("f32").as_deref(),
                    ElemType::F32,
                    &shape,
                    |sink| each(&f32_bytes, sink),
                )?;
                Ok(Stack::Values(c))
            }
            Storage::F16 => {
                let f16_bytes = |spec: &TensorSpec| -> Result<Vec<u8>> {
                    Ok(self
                        .host(spec)?
                        .iter()
                        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                        .collect())
                };
                let c = graph.constant_streamed(
                    key("f16").as_deref(),
                    ElemType::F16,
                    &shape,
                    |sink| each(&f16_bytes, sink),
                )?;
                Ok(Stack::Values(graph.convert(c, ElemType::F32)?))
            }
            Storage::Int4Sym { .. } | Storage::Int8Sym => {
                let (ty, group) = match storage {
                    Storage::Int4Sym { group } => (ElemType::I4, group),
                    _ => (ElemType::I8, cols),
                };
                if group == 0 || cols % group != 0 {
                    return Err(err(format!(
                        "{}: groups of {group} do not divide {cols} columns",
                        first.name
                    )));
                }
                if ty == ElemType::I4 && (rows * cols) % 2 == 1 {
                    return Err(err(format!(
                        "{}: an expert of {rows}x{cols} INT4 codes does not fill whole bytes, so the experts \
                         cannot be stacked",
                        first.name
                    )));
                }
                let groups = cols / group;
                let scales = std::cell::RefCell::new(Vec::<half::f16>::with_capacity(
                    experts * rows * groups,
                ));
                let codes_of = |spec: &TensorSpec| -> Result<Vec<u8>> {
                    let q = self.weights.quantized(spec)?.ok_or_else(|| {
                        err(format!("{}: the store did not quantize it", spec.name))
                    })?;
                    if q.scale_shape() != [rows, groups] {
                        return Err(err(format!(
                            "{}: scales {:?}, not the [{rows}, {groups}] of its stack",
                            spec.name,
                            q.scale_shape()
                        )));
                    }
                    scales.borrow_mut().extend_from_slice(q.scales());
                    Ok(q.packed_codes())
                };
                let codes = graph.constant_streamed(
                    key("codes").as_deref(),
                    ty,
                    &[experts * rows, groups, group],
                    |sink| each(&codes_of, sink),
                )?;
                let scales = graph.constant_streamed(
                    key("scales").as_deref(),
                    ElemType::F16,
                    &[experts * rows, groups, 1],
                    |sink| {
                        let bytes: Vec<u8> = scales
                            .borrow()
                            .iter()
                            .flat_map(|x| x.to_le_bytes())
                            .collect();
                        sink(&bytes)
                    },
                )?;
                Ok(Stack::Coded {
                    codes,
                    scales,
                    shape,
                })
            }
        }
    }
}
