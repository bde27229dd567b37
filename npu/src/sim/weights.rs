//! Checkpoint matrices read where they lie: the graph builder's weight forms (an f32 constant; an f16 one and its
//! `Convert`; integer codes and f16 scales dequantized by `Convert`, `Multiply` and `Reshape`) recognised in a graph
//! and decoded a tile of rows at a time, from the `.bin` as it stores them, by the one product or gather that reads
//! them, instead of every op of the chain writing the whole matrix in f32.
//!
//! An MoE block's experts stacked `[E, rows, cols]` (one projection of every expert, in the same forms) are read the
//! same way, an expert's matrix being `rows` consecutive rows of the stack: by the `Gather` that picks whole experts
//! and by the batched product over every expert.
//!
//! A decoded value is what the chain's ops would store: the storage rounding of the constant on entry and of every
//! op's result, that is `round(round(code) · round(scale))` for codes and `round(value)` for floats (rounding twice
//! is rounding once: a stored value rounds to itself).

use super::kernel::{Rows, dequantize, round_lane};
use crate::error::{Error, Result};
use crate::ir::{ElemType, Graph, Node};
use std::collections::{HashMap, HashSet};

/// Where a matrix's values lie in the `.bin`, and how they are stored.
#[derive(Debug, Clone)]
pub(super) struct Weight {
    /// 1 for a matrix `[rows, cols]`; `E` for `E` matrices stacked `[E, rows, cols]` (an MoE block's experts).
    pub(super) experts: usize,
    /// Rows of each matrix.
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// `(offset, size)` of the values (or the codes).
    pub(super) data: (usize, usize),
    pub(super) form: Form,
    /// The chain's nodes (the one read last first), replaced by the reader.
    pub(super) nodes: Vec<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Form {
    F32,
    F16,
    /// Integer codes (`I4` or `I8`) with one f16 scale per group of `group` columns at `scales`.
    Codes {
        ty: ElemType,
        scales: (usize, usize),
        group: usize,
    },
}

fn offsets(n: &Node) -> Option<(usize, usize)> {
    let num = |k: &str| n.attr(k).and_then(|v| v.parse().ok());
    Some((num("offset")?, num("size")?))
}

/// The constant `id` of type `ty` and its shape.
fn constant(nodes: &[Node], id: usize, ty: ElemType) -> Option<(&Node, &[usize])> {
    let n = &nodes[id];
    (n.op == "Const" && n.outputs[0].ty == ty).then(|| (n, n.outputs[0].shape.as_slice()))
}

/// The node feeding input `i` of `n`, when it reads that node's first port.
fn input(n: &Node, i: usize) -> Option<usize> {
    let v = n.inputs.get(i)?;
    (v.port == 0).then_some(v.node)
}

fn is_convert_to_f32(n: &Node) -> bool {
    n.op == "Convert" && n.attr("destination_type") == Some("f32")
}

/// The matrix `[rows, cols]` (or the stack `[E, rows, cols]`) node `id` computes from constants alone, in one of the
/// builder's weight forms.
pub(super) fn recognise(nodes: &[Node], id: usize) -> Option<Weight> {
    let n = &nodes[id];
    let shape = &n.outputs[0].shape;
    let (experts, rows, cols) = match *shape.as_slice() {
        [rows, cols] => (1, rows, cols),
        [experts, rows, cols] => (experts, rows, cols),
        _ => return None,
    };
    if n.outputs[0].ty != ElemType::F32 {
        return None;
    }
    let weight = |data, form, nodes: Vec<usize>| {
        Some(Weight {
            experts,
            rows,
            cols,
            data,
            form,
            nodes,
        })
    };
    match n.op {
        "Const" => weight(offsets(n)?, Form::F32, vec![id]),
        "Convert" if is_convert_to_f32(n) => {
            let c = input(n, 0)?;
            let (cn, _) = constant(nodes, c, ElemType::F16)?;
            weight(offsets(cn)?, Form::F16, vec![id, c])
        }
        "Reshape" => {
            let (mul, target) = (input(n, 0)?, input(n, 1)?);
            let m = &nodes[mul];
            if m.op != "Multiply" {
                return None;
            }
            let (cc, sc) = (input(m, 0)?, input(m, 1)?);
            let (codes_convert, scales_convert) = (&nodes[cc], &nodes[sc]);
            if !is_convert_to_f32(codes_convert) || !is_convert_to_f32(scales_convert) {
                return None;
            }
            let (codes, scales) = (input(codes_convert, 0)?, input(scales_convert, 0)?);
            let (codes_node, codes_shape) = constant(nodes, codes, ElemType::I4)
                .or_else(|| constant(nodes, codes, ElemType::I8))?;
            let (scales_node, scales_shape) = constant(nodes, scales, ElemType::F16)?;
            let &[r, groups, group] = codes_shape else {
                return None;
            };
            if r != experts * rows || groups * group != cols || scales_shape != [r, groups, 1] {
                return None;
            }
            weight(
                offsets(codes_node)?,
                Form::Codes {
                    ty: codes_node.outputs[0].ty,
                    scales: offsets(scales_node)?,
                    group,
                },
                vec![id, mul, cc, sc, codes, scales, target],
            )
        }
        _ => None,
    }
}

/// A recognised matrix over its bytes.
pub(super) struct Packed<'a> {
    pub(super) weight: &'a Weight,
    pub(super) data: &'a [u8],
    pub(super) scales: &'a [u8],
}

impl Packed<'_> {
    /// Checks that the bytes hold the matrix.
    pub(super) fn check(&self) -> Result<()> {
        let w = self.weight;
        let n = w.experts * w.rows * w.cols;
        let need = match w.form {
            Form::F32 => 4 * n,
            Form::F16 => 2 * n,
            Form::Codes { ty, group, .. } => {
                if self.scales.len() < 2 * (n / group.max(1)) {
                    return Err(Error::Interface(
                        "a matrix's scales lie outside the .bin".into(),
                    ));
                }
                ty.byte_size(n)
            }
        };
        if self.data.len() < need {
            return Err(Error::Interface(format!(
                "{} [{}, {}] matrices need {need} bytes, the .bin holds {}",
                w.experts,
                w.rows,
                w.cols,
                self.data.len()
            )));
        }
        Ok(())
    }
}

/// The rows of one matrix of a stack: rows `first..` of the source.
pub(super) struct Offset<'a, W>(pub &'a W, pub usize);

impl<W: Rows> Rows for Offset<'_, W> {
    fn rows<const S: u8, const FTZ: bool>(
        &self,
        r0: usize,
        r1: usize,
        out: &mut [f32],
    ) -> Result<()> {
        self.0.rows::<S, FTZ>(self.1 + r0, self.1 + r1, out)
    }
}

impl Rows for Packed<'_> {
    fn rows<const S: u8, const FTZ: bool>(
        &self,
        r0: usize,
        r1: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let cols = self.weight.cols;
        let round = round_lane::<S, FTZ>;
        match self.weight.form {
            Form::F32 => {
                for (o, b) in out
                    .iter_mut()
                    .zip(self.data[4 * r0 * cols..4 * r1 * cols].chunks_exact(4))
                {
                    *o = round(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                }
            }
            Form::F16 => {
                for (o, b) in out
                    .iter_mut()
                    .zip(self.data[2 * r0 * cols..2 * r1 * cols].chunks_exact(2))
                {
                    *o = round(half::f16::from_le_bytes([b[0], b[1]]).to_f32());
                }
            }
            Form::Codes { ty, group, .. } => {
                let groups = cols / group;
                let mut codes = vec![0f32; group];
                for r in r0..r1 {
                    for g in 0..groups {
                        let s = 2 * (r * groups + g);
                        let scale = round(
                            half::f16::from_le_bytes([self.scales[s], self.scales[s + 1]]).to_f32(),
                        );
                        let first = r * cols + g * group;
                        match ty {
                            ElemType::I8 => {
                                for (c, &b) in
                                    codes.iter_mut().zip(&self.data[first..first + group])
                                {
                                    *c = f32::from(b as i8);
                                }
                            }
                            _ if first.is_multiple_of(2) && group.is_multiple_of(2) => {
                                let bytes = &self.data[first / 2..(first + group) / 2];
                                for (pair, &b) in codes.chunks_exact_mut(2).zip(bytes) {
                                    pair[0] = f32::from(((b << 4) as i8) >> 4);
                                    pair[1] = f32::from((b as i8) >> 4);
                                }
                            }
                            _ => {
                                for (j, c) in codes.iter_mut().enumerate() {
                                    let i = first + j;
                                    let byte = self.data[i / 2];
                                    let nibble = if i.is_multiple_of(2) {
                                        byte & 0x0f
                                    } else {
                                        byte >> 4
                                    };
                                    *c = f32::from(((nibble << 4) as i8) >> 4);
                                }
                            }
                        }
                        let o = &mut out
                            [(r - r0) * cols + g * group..(r - r0) * cols + (g + 1) * group];
                        dequantize::<S, FTZ>(&codes, scale, o);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Whether `n` (a `Gather` of three inputs) gathers on axis 0.
fn gathers_on_axis_zero(graph: &Graph, n: &Node) -> bool {
    let c = &graph.nodes[n.inputs[2].node];
    let at = |k: &str| c.attr(k).and_then(|v| v.parse::<usize>().ok());
    c.op == "Const"
        && c.outputs[0].ty == ElemType::I64
        && matches!((at("offset"), at("size")), (Some(o), Some(8))
            if graph.bin_bytes(o, 8).is_ok_and(|b| b.as_ref() == [0; 8]))
}

/// The checkpoint matrices of the graph's top level that only products (as `b` of `a @ bᵀ`) and row gathers read,
/// and the nodes of their chains.
pub(super) fn find_weights(graph: &Graph) -> (HashMap<usize, Weight>, HashSet<usize>) {
    let nodes = &graph.nodes;
    let mut readers: Vec<Vec<(usize, usize)>> = vec![Vec::new(); nodes.len()];
    for (id, n) in nodes.iter().enumerate() {
        for (i, v) in n.inputs.iter().enumerate() {
            readers[v.node].push((id, i));
        }
    }
    let axis_zero = |n: &Node| gathers_on_axis_zero(graph, n);
    let reads_rows = |&(id, i): &(usize, usize)| {
        let n = &nodes[id];
        match n.op {
            "MatMul" => {
                i == 1
                    && n.attr("transpose_b") == Some("true")
                    && n.attr("transpose_a") != Some("true")
            }
            "Gather" => i == 0 && n.inputs.len() == 3 && axis_zero(n),
            _ => false,
        }
    };
    let (mut weights, mut deferred) = (HashMap::new(), HashSet::new());
    for id in 0..nodes.len() {
        if readers[id].is_empty() || !readers[id].iter().all(reads_rows) {
            continue;
        }
        let Some(w) = recognise(nodes, id) else {
            continue;
        };
        // Every other node of the chain is read by the chain alone.
        let inner_only = w.nodes[1..]
            .iter()
            .all(|&c| readers[c].iter().all(|(r, _)| w.nodes.contains(r)));
        if inner_only {
            deferred.extend(w.nodes.iter().copied());
            weights.insert(id, w);
        }
    }
    (weights, deferred)
}

/// A product over experts gathered by index, `MatMul(x, Reshape(Gather(stack, indices, 0)), transpose_b)` (an MoE
/// block's gather form), computed from the stack where it lies: each chosen expert's matrix read once for every row
/// that chose it, instead of the `T·k` gathered matrices written out before their products.
#[derive(Debug, Clone)]
pub(super) struct GatheredProduct {
    /// The stack's [`Weight`] (its chain's last node).
    pub(super) weight: usize,
    /// The expert indices, as the `Gather` reads them.
    pub(super) indices: crate::ir::Value,
    /// The leading dims of the gathered matrices after the reshape (`[T, k]`).
    pub(super) batch: Vec<usize>,
}

/// The gathered products of the graph's top level over the stacks of `weights`, by the product's node, and the
/// `Gather` and `Reshape` nodes they replace (each read by the next alone).
///
/// Besides a stack of [`find_weights`] gathered whole, a stack of integer codes whose codes and scales are gathered
/// before they are dequantized (`Reshape(Multiply(Convert(Gather(Reshape(codes))), Convert(Gather(Reshape(scales)))))`,
/// the builder's gathered form for INT4/INT8 experts): its [`Weight`] is returned too, keyed by the product's
/// `Reshape`.
pub(super) fn find_gathered_products(
    graph: &Graph,
    weights: &HashMap<usize, Weight>,
) -> (
    HashMap<usize, GatheredProduct>,
    HashSet<usize>,
    HashMap<usize, Weight>,
) {
    let nodes = &graph.nodes;
    let mut readers: Vec<Vec<(usize, usize)>> = vec![Vec::new(); nodes.len()];
    for (id, n) in nodes.iter().enumerate() {
        for (i, v) in n.inputs.iter().enumerate() {
            readers[v.node].push((id, i));
        }
    }
    let only_reader = |id: usize| match readers[id].as_slice() {
        [one] => Some(*one),
        _ => None,
    };
    let (mut found, mut replaced) = (HashMap::new(), HashSet::new());
    for (g, n) in nodes.iter().enumerate() {
        // `find_weights` admits a Gather as a stack's reader only on axis 0 with three inputs.
        let Some(w) = input(n, 0).and_then(|s| weights.get(&s).map(|w| (s, w))) else {
            continue;
        };
        if n.op != "Gather" || w.1.experts < 2 || n.outputs.len() != 1 {
            continue;
        }
        let Some((r, 0)) = only_reader(g) else {
            continue;
        };
        let Some((m, 1)) = only_reader(r) else {
            continue;
        };
        let (reshape, product) = (&nodes[r], &nodes[m]);
        let shape = &reshape.outputs[0].shape;
        let indices = n.inputs[1];
        let count: usize = nodes[indices.node].outputs[indices.port]
            .shape
            .iter()
            .product();
        let fits = reshape.op == "Reshape"
            && product.op == "MatMul"
            && product.attr("transpose_b") == Some("true")
            && product.attr("transpose_a") != Some("true")
            && shape.len() >= 3
            && shape[shape.len() - 2..] == [w.1.rows, w.1.cols]
            && shape[..shape.len() - 2].iter().product::<usize>() == count;
        if fits {
            found.insert(
                m,
                GatheredProduct {
                    weight: w.0,
                    indices,
                    batch: shape[..shape.len() - 2].to_vec(),
                },
            );
            replaced.extend([g, r]);
        }
    }
    let mut coded = HashMap::new();
    for (m, n) in nodes.iter().enumerate() {
        let product = n.op == "MatMul"
            && n.attr("transpose_b") == Some("true")
            && n.attr("transpose_a") != Some("true");
        let Some(r) = input(n, 1).filter(|_| product) else {
            continue;
        };
        let Some((w, indices, batch)) = gathered_codes(graph, r) else {
            continue;
        };
        // The product reads the chain's last node alone, and every other node of the chain only the chain reads.
        let inner_only = only_reader(r) == Some((m, 1))
            && w.nodes[1..]
                .iter()
                .all(|&c| readers[c].iter().all(|(x, _)| w.nodes.contains(x)));
        if inner_only {
            replaced.extend(w.nodes.iter().copied());
            found.insert(
                m,
                GatheredProduct {
                    weight: r,
                    indices,
                    batch,
                },
            );
            coded.insert(r, w);
        }
    }
    (found, replaced, coded)
}

/// The stack of codes node `r` computes from the experts `indices` chose, gathered before they are dequantized, as
/// `[.., rows, cols]`: its [`Weight`] (the chain's nodes, `r` first), the indices and the leading dims.
fn gathered_codes(graph: &Graph, r: usize) -> Option<(Weight, crate::ir::Value, Vec<usize>)> {
    let nodes = &graph.nodes;
    let reshape = &nodes[r];
    let mul = input(reshape, 0)?;
    if reshape.op != "Reshape" || nodes[mul].op != "Multiply" {
        return None;
    }
    let (cc, cs) = (input(&nodes[mul], 0)?, input(&nodes[mul], 1)?);
    if !is_convert_to_f32(&nodes[cc]) || !is_convert_to_f32(&nodes[cs]) {
        return None;
    }
    let (gc, gs) = (input(&nodes[cc], 0)?, input(&nodes[cs], 0)?);
    let gather = |g: usize| {
        let n = &nodes[g];
        n.op == "Gather" && n.inputs.len() == 3 && gathers_on_axis_zero(graph, n)
    };
    if !gather(gc) || !gather(gs) || nodes[gc].inputs[1] != nodes[gs].inputs[1] {
        return None;
    }
    let (rc, rs) = (input(&nodes[gc], 0)?, input(&nodes[gs], 0)?);
    if nodes[rc].op != "Reshape" || nodes[rs].op != "Reshape" {
        return None;
    }
    let (codes, scales) = (input(&nodes[rc], 0)?, input(&nodes[rs], 0)?);
    let (codes_node, codes_shape) =
        constant(nodes, codes, ElemType::I4).or_else(|| constant(nodes, codes, ElemType::I8))?;
    let (scales_node, scales_shape) = constant(nodes, scales, ElemType::F16)?;
    let (&[er, groups, group], &[experts, rows, g2, g3]) =
        (codes_shape, nodes[rc].outputs[0].shape.as_slice())
    else {
        return None;
    };
    let out = &reshape.outputs[0].shape;
    let cols = groups * group;
    let indices = nodes[gc].inputs[1];
    let count: usize = nodes[indices.node].outputs[indices.port]
        .shape
        .iter()
        .product();
    let fits = er == experts * rows
        && (g2, g3) == (groups, group)
        && scales_shape == [er, groups, 1]
        && out.len() >= 3
        && out[out.len() - 2..] == [rows, cols]
        && out[..out.len() - 2].iter().product::<usize>() == count;
    if !fits {
        return None;
    }
    let weight = Weight {
        experts,
        rows,
        cols,
        data: offsets(codes_node)?,
        form: Form::Codes {
            ty: codes_node.outputs[0].ty,
            scales: offsets(scales_node)?,
            group,
        },
        nodes: vec![r, mul, cc, cs, gc, gs, rc, rs, codes, scales],
    };
    Some((weight, indices, out[..out.len() - 2].to_vec()))
}
