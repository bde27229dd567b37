//! The `Loop` op (opset5): a body graph run a static number of times, with sliced, carried and stacked values.

use super::{ElemType, Graph, Node, Port, Value};
use crate::error::Result;

/// The body of a `Loop` node: its nodes (constants already pointing into the parent's `.bin`), the port map and
/// the back edges, all by body node ids.
#[derive(Debug, Clone)]
pub(crate) struct LoopBody {
    pub(crate) nodes: Vec<Node>,
    /// `(external input port, body Parameter id, slicing axis)`.
    pub(crate) inputs: Vec<(usize, usize, Option<usize>)>,
    /// `(external output port, body Result id, concatenation axis)`.
    pub(crate) outputs: Vec<(usize, usize, Option<usize>)>,
    /// Body Result id of the execution condition.
    pub(crate) condition: usize,
    /// `(body Result id, body Parameter id)`.
    pub(crate) back_edges: Vec<(usize, usize)>,
}

/// How a `Loop` input reaches its body Parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopInput {
    /// Iteration `i` sees slice `i` (of size 1) along `axis`.
    Sliced {
        /// The slicing axis.
        axis: usize,
    },
    /// The first iteration sees the value, the next ones the body result with this index (a carried state).
    Merged {
        /// Index of the body result fed back.
        result: usize,
    },
}

/// Which body result a `Loop` output takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopOutput {
    /// The value of the last iteration.
    Last {
        /// Index of the body result.
        result: usize,
    },
    /// The values of every iteration, concatenated along `axis`.
    Concat {
        /// Index of the body result.
        result: usize,
        /// The concatenation axis.
        axis: usize,
    },
}

impl Graph {
    /// A `Loop` (opset5) running `body` `trips` times. `inputs[i]` feeds the body's `i`-th parameter; every body
    /// result listed in `outputs` becomes an output of the loop, in that order. The body's constants move into this
    /// graph's `.bin`.
    pub fn loop_op(
        &mut self,
        trips: usize,
        body: Graph,
        inputs: &[(Value, LoopInput)],
        outputs: &[LoopOutput],
    ) -> Result<Vec<Value>> {
        let params: Vec<usize> = (0..body.nodes.len())
            .filter(|&i| body.nodes[i].op == "Parameter")
            .collect();
        let mut results: Vec<usize> = (0..body.nodes.len())
            .filter(|&i| body.nodes[i].op == "Result")
            .collect();
        if params.len() != inputs.len() {
            return Err(self.err(
                "Loop",
                format!(
                    "{} inputs for {} body parameters",
                    inputs.len(),
                    params.len()
                ),
            ));
        }
        let result_shape = |r: usize| {
            let v = body.nodes[r].inputs[0];
            let p = &body.nodes[v.node].outputs[v.port];
            (p.ty, p.shape.clone())
        };
        let mut port_inputs = Vec::new();
        let mut back_edges = Vec::new();
        for (k, (&(value, how), &param)) in inputs.iter().zip(&params).enumerate() {
            let outer = self.shape(value).to_vec();
            let inner = body.nodes[param].outputs[0].shape.clone();
            let expected = match how {
                LoopInput::Sliced { axis } => {
                    if axis >= outer.len() || outer[axis] != trips {
                        return Err(self.err(
                            "Loop",
                            format!("input {k}: {outer:?} has no {trips} slices on axis {axis}"),
                        ));
                    }
                    let mut s = outer.clone();
                    s[axis] = 1;
                    s
                }
                LoopInput::Merged { result } => {
                    let r = *results
                        .get(result)
                        .ok_or_else(|| self.err("Loop", format!("no body result {result}")))?;
                    if result_shape(r).1 != outer {
                        return Err(self.err(
                            "Loop",
                            format!("input {k}: carried result {result} is not {outer:?}"),
                        ));
                    }
                    back_edges.push((r, param));
                    outer.clone()
                }
            };
            if inner != expected || body.nodes[param].outputs[0].ty != self.elem(value) {
                return Err(self.err(
                    "Loop",
                    format!("input {k}: body parameter {inner:?}, expected {expected:?}"),
                ));
            }
            let axis = match how {
                LoopInput::Sliced { axis } => Some(axis),
                _ => None,
            };
            port_inputs.push((2 + k, param, axis));
        }
        let mut out_types = Vec::new();
        let mut port_outputs = Vec::new();
        for (j, o) in outputs.iter().enumerate() {
            let (idx, axis) = match *o {
                LoopOutput::Last { result } => (result, None),
                LoopOutput::Concat { result, axis } => (result, Some(axis)),
            };
            let r = *results
                .get(idx)
                .ok_or_else(|| self.err("Loop", format!("no body result {idx}")))?;
            let (ty, mut shape) = result_shape(r);
            if let Some(a) = axis {
                if a >= shape.len() || shape[a] != 1 {
                    return Err(self.err(
                        "Loop",
                        format!("output {j}: {shape:?} cannot be stacked on axis {a}"),
                    ));
                }
                shape[a] = trips;
            }
            out_types.push((ty, shape));
            port_outputs.push((2 + inputs.len() + j, r, axis));
        }
        // The body: constants rebased into this graph's .bin, plus an always-true execution condition.
        let body_bin = body.bin.read(0, body.bin.len()?)?.into_owned();
        let shift = self.bin.append(&body_bin)?;
        let mut nodes = body.nodes;
        for n in nodes.iter_mut().filter(|n| n.op == "Const") {
            for (k, v) in n.attrs.iter_mut() {
                if *k == "offset" {
                    *v = (v.parse::<usize>().unwrap_or(0) + shift).to_string();
                }
            }
        }
        let offset = self.bin.append(&[1])?;
        let cond_const = nodes.len();
        nodes.push(Node {
            name: "loop_condition".into(),
            op: "Const",
            version: "opset1",
            attrs: vec![
                ("element_type", "boolean".into()),
                ("shape", String::new()),
                ("offset", offset.to_string()),
                ("size", "1".into()),
            ],
            inputs: vec![],
            outputs: vec![Port {
                ty: ElemType::Boolean,
                shape: vec![],
                names: vec![],
            }],
            body: None,
        });
        let condition = nodes.len();
        nodes.push(Node {
            name: "loop_condition/sink_port_0".into(),
            op: "Result",
            version: "opset1",
            attrs: vec![],
            inputs: vec![Value {
                node: cond_const,
                port: 0,
            }],
            outputs: vec![],
            body: None,
        });
        results.push(condition);
        let trip = self.const_i64(&[trips as i64], &[])?;
        let exec = self.constant_bytes(ElemType::Boolean, &[], &[1])?;
        let mut all_inputs = vec![trip, exec];
        all_inputs.extend(inputs.iter().map(|(v, _)| *v));
        let id = self.push("Loop", "opset5", vec![], all_inputs, out_types);
        self.nodes[id].body = Some(Box::new(LoopBody {
            nodes,
            inputs: port_inputs,
            outputs: port_outputs,
            condition,
            back_edges,
        }));
        Ok((0..outputs.len())
            .map(|port| Value { node: id, port })
            .collect())
    }
}
