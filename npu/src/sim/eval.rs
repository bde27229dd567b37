//! An evaluator of this project's IR graphs with a chosen arithmetic ([`NumericModel`]): every op the graph builder
//! emits, `Loop` included, written here from the OpenVINO op specifications and sharing no code with OpenVINO.
//!
//! Values are f32 vectors holding exactly what the modelled device stores: constants and inputs are rounded to the
//! storage format on entry, every op's result on exit. A matrix product rounds each term `a·b` to the storage format
//! (subnormals flushed when the model flushes) before summing; sums and reductions accumulate in f32 or in the
//! storage format; element-wise functions and the softmax compute in f32 from stored inputs and round their result.

use super::Kernels;
use super::norms::find_norms;
use super::numeric::{Accumulation, NumericModel};
use super::ops::{
    binary, binary_int, concat, convert, from_tensor, gather, gelu_erf, gelu_tanh, one_hot_node,
    slice, softmax, to_tensor, topk_node, transpose, unary,
};
use super::weights::{GatheredProduct, Weight, find_gathered_products, find_weights};
use crate::error::{Error, Result};
use crate::ir::{ElemType, Graph, LoopBody, Node, Value};
use candle_core::Tensor;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::rc::Rc;

/// The data of a value.
#[derive(Debug, Clone)]
pub(super) enum Data {
    F(Vec<f32>),
    I(Vec<i64>),
    B(Vec<bool>),
}

/// A value: a shape and its data, row-major.
#[derive(Debug, Clone)]
pub(super) struct Val {
    pub(super) shape: Vec<usize>,
    pub(super) data: Data,
}

pub(super) type V = Rc<Val>;

impl Val {
    pub(super) fn f(shape: Vec<usize>, data: Vec<f32>) -> V {
        Rc::new(Val {
            shape,
            data: Data::F(data),
        })
    }

    pub(super) fn floats(&self) -> Result<&[f32]> {
        match &self.data {
            Data::F(v) => Ok(v),
            _ => Err(Error::Interface("a float value was expected".into())),
        }
    }

    pub(super) fn ints(&self) -> Result<Vec<i64>> {
        match &self.data {
            Data::I(v) => Ok(v.clone()),
            Data::F(v) => Ok(v.iter().map(|&x| x as i64).collect()),
            Data::B(v) => Ok(v.iter().map(|&b| b as i64).collect()),
        }
    }
}

/// Row-major strides of a shape.
pub(super) fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// The numpy broadcast of two shapes.
pub(super) fn broadcast(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    (0..n)
        .map(|i| {
            let x = if i + a.len() >= n {
                a[i + a.len() - n]
            } else {
                1
            };
            let y = if i + b.len() >= n {
                b[i + b.len() - n]
            } else {
                1
            };
            match (x, y) {
                (x, y) if x == y => Ok(x),
                (1, y) => Ok(y),
                (x, 1) => Ok(x),
                _ => Err(Error::Interface(format!(
                    "{a:?} and {b:?} do not broadcast"
                ))),
            }
        })
        .collect()
}

/// For every element of `out` (a broadcast shape), the flat index into a value of shape `shape`.
pub(super) fn broadcast_index(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let n = out.len();
    let st = strides(shape);
    let offset = n - shape.len();
    let total: usize = out.iter().product();
    let out_st = strides(out);
    (0..total)
        .map(|flat| {
            let mut idx = 0;
            for (d, &os) in out_st.iter().enumerate() {
                let coord = (flat / os) % out[d];
                if d >= offset && shape[d - offset] != 1 {
                    idx += coord * st[d - offset];
                }
            }
            idx
        })
        .collect()
}

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

    /// One op on its (already stored) arguments; the caller rounds the result. `fused`: a node of a fused
    /// normalization's statistic (a reduction then sums in f32 whatever the accumulation).
    fn op(&self, op: &str, node: &Node, a: &[V], fused: bool) -> Result<V> {
        let attr = |k: &str| node.attr(k).unwrap_or("");
        Ok(match op {
            "Add" | "Subtract" | "Multiply" | "Divide" => {
                if let (Data::I(_), Data::I(_)) = (&a[0].data, &a[1].data) {
                    let f: fn(i64, i64) -> i64 = match op {
                        "Add" => |x, y| x + y,
                        "Subtract" => |x, y| x - y,
                        "Multiply" => |x, y| x * y,
                        _ => |x, y| if y == 0 { 0 } else { x / y },
                    };
                    return binary_int(&a[0], &a[1], f);
                }
                let f: fn(f32, f32) -> f32 = match op {
                    "Add" => |x, y| x + y,
                    "Subtract" => |x, y| x - y,
                    "Multiply" => |x, y| x * y,
                    _ => |x, y| x / y,
                };
                binary(&a[0], &a[1], f)?
            }
            "Exp" => unary(&a[0], f32::exp)?,
            "Sqrt" => unary(&a[0], f32::sqrt)?,
            "Sigmoid" => unary(&a[0], |x| 1.0 / (1.0 + (-x).exp()))?,
            "Negative" => unary(&a[0], |x| -x)?,
            "Sin" => unary(&a[0], f32::sin)?,
            "Cos" => unary(&a[0], f32::cos)?,
            "SoftPlus" => unary(&a[0], |x| {
                // OpenVINO's SoftPlus returns x beyond the threshold where ln(1 + e^x) rounds to x.
                if x > 20.0 { x } else { x.exp().ln_1p() }
            })?,
            "Swish" => unary(&a[0], |x| x / (1.0 + (-x).exp()))?,
            "Gelu" => match attr("approximation_mode") {
                "TANH" => unary(&a[0], gelu_tanh)?,
                "ERF" | "" => unary(&a[0], gelu_erf)?,
                other => {
                    return Err(Error::Interface(format!("Gelu approximation_mode {other}")));
                }
            },
            "MatMul" => self.matmul(
                &a[0],
                &a[1],
                attr("transpose_a") == "true",
                attr("transpose_b") == "true",
            )?,
            "Reshape" => {
                let shape: Vec<usize> = a[1].ints()?.iter().map(|&d| d as usize).collect();
                Rc::new(Val {
                    shape,
                    data: a[0].data.clone(),
                })
            }
            "Transpose" => {
                let perm: Vec<usize> = a[1].ints()?.iter().map(|&d| d as usize).collect();
                transpose(&a[0], &perm)?
            }
            "Concat" => {
                let axis: usize = attr("axis")
                    .parse()
                    .map_err(|_| Error::Interface("Concat axis".into()))?;
                concat(a, axis)?
            }
            "Slice" => {
                let (start, stop, step, axis) = (
                    a[1].ints()?[0],
                    a[2].ints()?[0],
                    a[3].ints()?[0],
                    a[4].ints()?[0] as usize,
                );
                if step != 1 {
                    return Err(Error::Interface(format!("Slice step {step}")));
                }
                slice(&a[0], axis, start as usize, (stop - start) as usize)?
            }
            "Gather" => {
                let axis = a[2].ints()?[0] as usize;
                gather(&a[0], &a[1], axis)?
            }
            "ReduceSum" | "ReduceMean" => {
                let axes: Vec<usize> = a[1].ints()?.iter().map(|&d| d as usize).collect();
                self.reduce(
                    &a[0],
                    &axes,
                    attr("keep_dims") == "true",
                    op == "ReduceMean",
                    fused,
                )?
            }
            "SoftMax" => {
                let axis: usize = attr("axis")
                    .parse()
                    .map_err(|_| Error::Interface("SoftMax axis".into()))?;
                softmax(&a[0], axis)?
            }
            "Convert" => convert(&a[0], attr("destination_type"))?,
            "OneHot" => one_hot_node(node, a)?,
            other => {
                return Err(Error::Interface(format!(
                    "{other} is not an op FP16SIM evaluates"
                )));
            }
        })
    }

    fn reduce(&self, x: &V, axes: &[usize], keep: bool, mean: bool, fused: bool) -> Result<V> {
        let xs = x.floats()?;
        let shape = &x.shape;
        let reduced: Vec<usize> = shape
            .iter()
            .enumerate()
            .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
            .collect();
        let count: usize = axes.iter().map(|&a| shape[a]).product();
        let st = strides(shape);
        let rst = strides(&reduced);
        let mut acc = vec![0f32; reduced.iter().product()];
        let acc_storage = self.model.accumulation == Accumulation::Storage
            && !self.model.is_exact_f32()
            && !fused;
        for (flat, &v) in xs.iter().enumerate() {
            let mut r = 0;
            for d in 0..shape.len() {
                let c = (flat / st[d]) % shape[d];
                if !axes.contains(&d) {
                    r += c * rst[d];
                }
            }
            acc[r] += v;
            if acc_storage {
                acc[r] = self.model.round(acc[r]);
            }
        }
        if mean {
            for v in &mut acc {
                *v /= count as f32;
            }
        }
        let out_shape = if keep {
            reduced
        } else {
            shape
                .iter()
                .enumerate()
                .filter(|(i, _)| !axes.contains(i))
                .map(|(_, &d)| d)
                .collect()
        };
        Ok(Val::f(out_shape, acc))
    }
}

/// Decodes every constant of `nodes` (scope 0: the graph; a Loop body: its node's address), rounded to storage
/// when it is a float.
pub(super) fn decode_consts(
    graph: &Graph,
    nodes: &[Node],
    scope: usize,
    model: &NumericModel,
    deferred: &HashSet<usize>,
    out: &mut HashMap<(usize, usize), V>,
) -> Result<()> {
    for (id, n) in nodes.iter().enumerate() {
        if let Some(body) = &n.body {
            let scope = n as *const Node as usize;
            decode_consts(graph, &body.nodes, scope, model, &HashSet::new(), out)?;
        }
        if n.op != "Const" || (scope == 0 && deferred.contains(&id)) {
            continue;
        }
        let num = |k: &str| -> Result<usize> {
            n.attr(k)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| Error::Interface(format!("Const {} has no {k}", n.name)))
        };
        let (offset, size) = (num("offset")?, num("size")?);
        let bytes = graph
            .bin_bytes(offset, size)
            .map_err(|_| Error::Interface(format!("Const {} outside the .bin", n.name)))?;
        let port = &n.outputs[0];
        let count: usize = port.shape.iter().product();
        let data = match port.ty {
            ElemType::F32 => Data::F(
                bytes
                    .chunks_exact(4)
                    .map(|c| model.round(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                    .collect(),
            ),
            ElemType::F16 => Data::F(
                bytes
                    .chunks_exact(2)
                    .map(|c| model.round(half::f16::from_le_bytes([c[0], c[1]]).to_f32()))
                    .collect(),
            ),
            ElemType::I64 => Data::I(
                bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                    .collect(),
            ),
            ElemType::I8 => Data::I(bytes.iter().map(|&b| b as i8 as i64).collect()),
            ElemType::I4 => Data::I(
                reference::quant::unpack_i4(&bytes, count)?
                    .into_iter()
                    .map(i64::from)
                    .collect(),
            ),
            ElemType::Boolean => Data::B(bytes.iter().map(|&b| b != 0).collect()),
        };
        out.insert(
            (scope, id),
            Rc::new(Val {
                shape: port.shape.clone(),
                data,
            }),
        );
    }
    Ok(())
}
