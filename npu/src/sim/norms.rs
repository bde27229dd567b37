//! Fused normalizations: where the graph builder wrote RMSNorm or the L2 norm op by op, the nodes of its statistic,
//! so that `norm=fused` evaluates them as one kernel keeping the statistic in f32.

use super::consts::decode_consts;
use super::numeric::{NumericModel, Storage};
use super::value::V;
use crate::error::Result;
use crate::ir::{ElemType, Graph, Node, Value};
use std::collections::{HashMap, HashSet};

/// Finds the normalizations of `nodes` (and of Loop bodies): `Divide(x, Sqrt(Add(Reduce{Mean,Sum}(Multiply(x, x)),
/// eps)))` with `eps` a constant, as the graph builder writes RMSNorm and the L2 norm. Records the statistic's nodes
/// and the eps constant (decoded exactly) for a fused evaluation.
pub(super) fn find_norms(
    graph: &Graph,
    nodes: &[Node],
    scope: usize,
    inner: &mut HashSet<(usize, usize)>,
    eps: &mut HashMap<(usize, usize), V>,
) -> Result<()> {
    for n in nodes {
        if let Some(body) = &n.body {
            find_norms(graph, &body.nodes, n as *const Node as usize, inner, eps)?;
        }
    }
    let producer = |v: Value, op: &str| (nodes[v.node].op == op).then_some(v.node);
    for div in nodes.iter().filter(|n| n.op == "Divide") {
        let x = div.inputs[0];
        let Some(root) = producer(div.inputs[1], "Sqrt") else {
            continue;
        };
        let Some(add) = producer(nodes[root].inputs[0], "Add") else {
            continue;
        };
        let (a, b) = (nodes[add].inputs[0], nodes[add].inputs[1]);
        let (reduce, constant) = match (nodes[a.node].op, nodes[b.node].op) {
            ("ReduceMean" | "ReduceSum", "Const") => (a.node, b.node),
            ("Const", "ReduceMean" | "ReduceSum") => (b.node, a.node),
            _ => continue,
        };
        let Some(square) = producer(nodes[reduce].inputs[0], "Multiply") else {
            continue;
        };
        if nodes[square].inputs[0] != x || nodes[square].inputs[1] != x {
            continue;
        }
        let c = &nodes[constant];
        if c.outputs[0].ty != ElemType::F32 || c.outputs[0].shape.iter().product::<usize>() != 1 {
            continue;
        }
        let exact = NumericModel {
            storage: Storage::F32,
            flush_subnormals: false,
            ..NumericModel::default()
        };
        let mut one = HashMap::new();
        decode_consts(
            graph,
            std::slice::from_ref(c),
            0,
            &exact,
            &HashSet::new(),
            &mut one,
        )?;
        if let Some(v) = one.into_values().next() {
            eps.insert((scope, constant), v);
        }
        inner.extend([square, reduce, add, root].map(|id| (scope, id)));
    }
    Ok(())
}
