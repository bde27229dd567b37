//! An evaluator of this project's IR graphs with a chosen arithmetic ([`NumericModel`]): every op the graph builder
//! emits, `Loop` included, written here from the OpenVINO op specifications and sharing no code with OpenVINO.
//!
//! Values are f32 vectors holding exactly what the modelled device stores: constants and inputs are rounded to the
//! storage format on entry, every op's result on exit. A matrix product rounds each term `a·b` to the storage format
//! (subnormals flushed when the model flushes) before summing; sums and reductions accumulate in f32 or in the
//! storage format; element-wise functions and the softmax compute in f32 from stored inputs and round their result.

use super::Kernels;
use super::consts::decode_consts;
use super::norms::find_norms;
use super::numeric::NumericModel;
use super::ops::{concat, from_tensor, slice, to_tensor, topk_node};
use super::value::{Data, V, Val};
use super::weights::{GatheredProduct, Weight, find_gathered_products, find_weights};
use crate::error::{Error, Result};
use crate::ir::{Graph, LoopBody, Node, Value};
use candle_core::Tensor;
use std::collections::{BTreeMap, HashMap, HashSet};

/// Evaluates graphs of one [`NumericModel`].
pub struct Evaluator {
    pub(super) graph: Graph,
    pub(super) model: NumericModel,
    pub(super) kernels: Kernels,
    /// The checkpoint matrices read where they lie, by the node computing them (top level), and every node of
    /// their weight chains, which is not evaluated.
    weights: HashMap<usize, Weight>,
    deferred: HashSet<usize>,
    /// The products over experts gathered from a stack, by the product's node (their `Gather` and `Reshape` are
    /// among `deferred`).
    gathered: HashMap<usize, GatheredProduct>,
    /// The graph's `.bin` mapped, when it is a file.
    pub(super) map: Option<memmap2::Mmap>,
    /// Decoded constants by node id (top level and Loop bodies share the `.bin`).
    consts: HashMap<(usize, usize), V>,
    /// Inputs and producers of the outputs that hold states (kept in f32 when the model keeps states in f32).
    state_inputs: HashSet<String>,
    state_producers: HashSet<usize>,
    /// Under fused normalizations: the statistic's nodes (square, sum or mean, plus eps, root), whose results are
    /// not rounded, by (scope, node id).
    norm_inner: HashSet<(usize, usize)>,
    /// Under fused normalizations: the eps constants, exact (unrounded) f32.
    norm_eps: HashMap<(usize, usize), V>,
}

impl Evaluator {
    /// An evaluator of `graph`; `state_inputs`/`state_outputs` name the ports that carry states between calls.
    pub fn new(
        graph: Graph,
        model: NumericModel,
        state_inputs: &[String],
        state_outputs: &[String],
    ) -> Result<Self> {
        Self::with_kernels(graph, model, state_inputs, state_outputs, Kernels::Tiled)
    }

    /// [`Evaluator::new`] computing with `kernels`.
    pub fn with_kernels(
        graph: Graph,
        model: NumericModel,
        state_inputs: &[String],
        state_outputs: &[String],
        kernels: Kernels,
    ) -> Result<Self> {
        let (mut weights, mut deferred) = match kernels {
            Kernels::Plain => Default::default(),
            Kernels::Tiled => find_weights(&graph),
        };
        let (gathered, replaced, coded) = match kernels {
            Kernels::Plain => Default::default(),
            Kernels::Tiled => find_gathered_products(&graph, &weights),
        };
        weights.extend(coded);
        deferred.extend(replaced);
        let map = match kernels {
            Kernels::Plain => None,
            Kernels::Tiled => graph.bin_map()?,
        };
        let mut consts = HashMap::new();
        decode_consts(&graph, &graph.nodes, 0, &model, &deferred, &mut consts)?;
        let mut state_producers = HashSet::new();
        for n in graph.nodes.iter().filter(|n| n.op == "Result") {
            let v = n.inputs[0];
            let port = &graph.nodes[v.node].outputs[v.port];
            if port.names.iter().any(|name| state_outputs.contains(name)) {
                state_producers.insert(v.node);
            }
        }
        let (mut norm_inner, mut norm_eps) = (HashSet::new(), HashMap::new());
        if model.fused_norm {
            find_norms(&graph, &graph.nodes, 0, &mut norm_inner, &mut norm_eps)?;
        }
        Ok(Evaluator {
            graph,
            model,
            kernels,
            weights,
            deferred,
            gathered,
            map,
            consts,
            state_inputs: state_inputs.iter().cloned().collect(),
            state_producers,
            norm_inner,
            norm_eps,
        })
    }

    /// The graph's name.
    pub fn name(&self) -> &str {
        self.graph.name()
    }

    /// The graph being evaluated.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Runs the graph on `inputs` (by name, f32 or i64) and returns every output by name.
    pub fn run(&self, inputs: &[(&str, &Tensor)]) -> Result<BTreeMap<String, Tensor>> {
        let mut given: HashMap<&str, V> = HashMap::new();
        for (name, t) in inputs {
            given.insert(name, from_tensor(t)?);
        }
        let values = self.eval_nodes(&self.graph.nodes, 0, &mut |_, node: &Node| {
            let v = given.get(node.name.as_str()).cloned().ok_or_else(|| {
                Error::Interface(format!(
                    "graph {} reads `{}`, which its caller does not provide",
                    self.graph.name(),
                    node.name
                ))
            })?;
            let keep = self.model.f32_state && self.state_inputs.contains(&node.name);
            Ok(if keep { v } else { self.round_val(&v) })
        })?;
        let mut out = BTreeMap::new();
        for n in self.graph.nodes.iter().filter(|n| n.op == "Result") {
            let v = n.inputs[0];
            let name = self.graph.nodes[v.node].outputs[v.port]
                .names
                .last()
                .cloned()
                .unwrap_or_default();
            out.insert(name, to_tensor(&values[v.node][v.port])?);
        }
        Ok(out)
    }

    fn round_val(&self, v: &V) -> V {
        match &v.data {
            Data::F(x) if !self.model.is_exact_f32() => Val::f(
                v.shape.clone(),
                x.iter().map(|&a| self.model.round(a)).collect(),
            ),
            _ => v.clone(),
        }
    }

    /// Evaluates a node list (the graph's, or a Loop body's: `scope` tells their constants apart); `parameter`
    /// supplies each Parameter node's value.
    fn eval_nodes(
        &self,
        nodes: &[Node],
        scope: usize,
        parameter: &mut dyn FnMut(usize, &Node) -> Result<V>,
    ) -> Result<Vec<Vec<V>>> {
        // Each value is dropped after its last reader (those the results read are kept).
        let mut last = vec![0usize; nodes.len()];
        for (id, node) in nodes.iter().enumerate() {
            for v in &node.inputs {
                let reader = if node.op == "Result" { usize::MAX } else { id };
                last[v.node] = last[v.node].max(reader);
            }
        }
        let top = scope == 0;
        if top {
            // A gathered product reads its indices where its Gather would have.
            for (&id, g) in &self.gathered {
                last[g.indices.node] = last[g.indices.node].max(id);
            }
        }
        let mut values: Vec<Vec<V>> = Vec::with_capacity(nodes.len());
        for (id, node) in nodes.iter().enumerate() {
            if top && self.deferred.contains(&id) {
                // A node of a weight chain: its matrix is read by its reader, where it lies.
                values.push(vec![Val::f(node.outputs[0].shape.clone(), Vec::new())]);
                continue;
            }
            let arg = |i: usize| -> V {
                let Value { node, port } = node.inputs[i];
                values[node][port].clone()
            };
            let err = |m: String| {
                Error::Interface(format!(
                    "{}: {} {}: {m}",
                    self.graph.name(),
                    node.op,
                    node.name
                ))
            };
            let fused = self.norm_inner.contains(&(scope, id));
            let keep_f32 =
                fused || (self.model.f32_state && scope == 0 && self.state_producers.contains(&id));
            let out: Vec<V> = match node.op {
                "Parameter" => vec![parameter(id, node)?],
                "Const" => vec![
                    self.norm_eps
                        .get(&(scope, id))
                        .or_else(|| self.consts.get(&(scope, id)))
                        .cloned()
                        .ok_or_else(|| err("constant not decoded".into()))?,
                ],
                "Result" => vec![],
                "Loop" => {
                    self.eval_loop(node, &(0..node.inputs.len()).map(arg).collect::<Vec<_>>())?
                }
                // Two outputs: the values (stored values, unchanged) and their i64 indices.
                "TopK" => topk_node(node, &(0..node.inputs.len()).map(arg).collect::<Vec<_>>())
                    .map_err(|e| err(e.to_string()))?,
                op => {
                    let args: Vec<V> = (0..node.inputs.len()).map(arg).collect();
                    let weight = |i: usize| {
                        (top && node.inputs.len() > i)
                            .then(|| self.weights.get(&node.inputs[i].node))
                            .flatten()
                    };
                    let gathered = top.then(|| self.gathered.get(&id)).flatten();
                    let v = match (op, weight(0), weight(1)) {
                        ("MatMul", ..) if let Some(g) = gathered => {
                            let indices = &values[g.indices.node][g.indices.port];
                            self.gathered_product(
                                &args[0],
                                &self.weights[&g.weight],
                                indices,
                                &g.batch,
                            )
                        }
                        ("MatMul", _, Some(w)) => self.weight_product(&args[0], w),
                        ("Gather", Some(w), _) => self.weight_gather(w, &args[1]),
                        _ => self.op(op, node, &args, fused),
                    }
                    .map_err(|e| err(e.to_string()))?;
                    vec![if keep_f32 { v } else { self.round_val(&v) }]
                }
            };
            values.push(out);
            for v in &node.inputs {
                if last[v.node] == id {
                    values[v.node] = Vec::new();
                }
            }
        }
        Ok(values)
    }

    fn eval_loop(&self, node: &Node, args: &[V]) -> Result<Vec<V>> {
        let body: &LoopBody = node
            .body
            .as_deref()
            .ok_or_else(|| Error::Interface("a Loop without a body".into()))?;
        let trips = args[0].ints()?.first().copied().unwrap_or(0).max(0) as usize;
        // A body's constants are keyed by its Loop node's address, stable while the evaluator owns the graph.
        let scope = node as *const Node as usize;
        let mut carried: HashMap<usize, V> = HashMap::new();
        let mut per_iteration: Vec<Vec<V>> = vec![Vec::new(); body.outputs.len()];
        for it in 0..trips {
            let mut parameter = |pid: usize, _: &Node| -> Result<V> {
                let &(port, _, axis) = body
                    .inputs
                    .iter()
                    .find(|(_, param, _)| *param == pid)
                    .ok_or_else(|| Error::Interface("Loop parameter not mapped".into()))?;
                let outer = &args[port];
                Ok(match (axis, carried.get(&pid)) {
                    (_, Some(v)) => v.clone(),
                    (Some(a), None) => slice(outer, a, it, 1)?,
                    (None, None) => outer.clone(),
                })
            };
            let values = self.eval_nodes(&body.nodes, scope, &mut parameter)?;
            let result_value = |rid: usize| -> V {
                let v = body.nodes[rid].inputs[0];
                values[v.node][v.port].clone()
            };
            for &(result, param) in &body.back_edges {
                carried.insert(param, result_value(result));
            }
            for (j, &(_, result, _)) in body.outputs.iter().enumerate() {
                per_iteration[j].push(result_value(result));
            }
        }
        body.outputs
            .iter()
            .enumerate()
            .map(|(j, &(_, _, axis))| match axis {
                None => per_iteration[j]
                    .last()
                    .cloned()
                    .ok_or_else(|| Error::Interface("a Loop of zero iterations".into())),
                Some(a) => concat(&per_iteration[j], a),
            })
            .collect()
    }
}
