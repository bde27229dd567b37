//! A small typed builder of OpenVINO IR (v11): static shapes inferred as the graph is built, constants packed into
//! the `.bin`, deterministic output (the same graph always serialises to the same bytes).
//!
//! Every op method checks its operands and returns an error naming the graph and the op on a mismatch, so a wrong
//! graph fails here, with a readable message, rather than inside OpenVINO's reader.
//!
//! [`Graph`] holds the nodes and the `.bin`; its op methods are in `ops` (element-wise, matrix and shape ops) and
//! `loop_op` (the `Loop` op and its body); `xml` writes the IR. A graph keeps its constants in memory, or streams
//! them to a [`SharedBin`] file as it is built: several graphs can point into one such file, and a constant written
//! under a key (a checkpoint tensor) is written once and reused by every graph that asks for the same key (`bin`).

mod bin;
mod loop_op;
mod ops;
mod xml;

pub use bin::SharedBin;
pub use loop_op::{LoopInput, LoopOutput};
pub use ops::{Binary, GeluMode, Unary};

pub(crate) use bin::Bin;

use crate::error::{Error, Result};
pub(crate) use loop_op::LoopBody;

/// Element types of tensors in a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElemType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// 64-bit signed integer.
    I64,
    /// 8-bit signed integer.
    I8,
    /// 4-bit signed integer (two per byte, low nibble first).
    I4,
    /// Boolean.
    Boolean,
}

impl ElemType {
    /// The `element_type` attribute value.
    pub fn ir_name(self) -> &'static str {
        match self {
            ElemType::F32 => "f32",
            ElemType::F16 => "f16",
            ElemType::I64 => "i64",
            ElemType::I8 => "i8",
            ElemType::I4 => "i4",
            ElemType::Boolean => "boolean",
        }
    }

    fn precision(self) -> &'static str {
        match self {
            ElemType::F32 => "FP32",
            ElemType::F16 => "FP16",
            ElemType::I64 => "I64",
            ElemType::I8 => "I8",
            ElemType::I4 => "I4",
            ElemType::Boolean => "BOOL",
        }
    }

    /// Bytes needed for `n` elements.
    pub fn byte_size(self, n: usize) -> usize {
        match self {
            ElemType::F32 => 4 * n,
            ElemType::F16 => 2 * n,
            ElemType::I64 => 8 * n,
            ElemType::I8 | ElemType::Boolean => n,
            ElemType::I4 => n.div_ceil(2),
        }
    }

    fn is_float(self) -> bool {
        matches!(self, ElemType::F32 | ElemType::F16)
    }
}

/// An output of a node: the handle ops take and return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Value {
    pub(crate) node: usize,
    pub(crate) port: usize,
}

#[derive(Debug, Clone)]
pub(crate) struct Port {
    pub(crate) ty: ElemType,
    pub(crate) shape: Vec<usize>,
    pub(crate) names: Vec<String>,
}

/// A node: an op, its attributes, its input values and its output ports (read by the evaluator of `crate::sim`).
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub(crate) name: String,
    pub(crate) op: &'static str,
    pub(crate) version: &'static str,
    pub(crate) attrs: Vec<(&'static str, String)>,
    pub(crate) inputs: Vec<Value>,
    pub(crate) outputs: Vec<Port>,
    pub(crate) body: Option<Box<LoopBody>>,
}

impl Node {
    /// The attribute `key`.
    pub(crate) fn attr(&self, key: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// A graph under construction.
#[derive(Debug, Clone)]
pub struct Graph {
    name: String,
    pub(crate) nodes: Vec<Node>,
    pub(crate) bin: Bin,
}

fn dims(shape: &[usize]) -> String {
    shape
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Numpy broadcast of two shapes.
fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
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
        out[i] = match (x, y) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

impl Graph {
    /// An empty graph whose constants are kept in memory.
    pub fn new(name: &str) -> Self {
        Graph {
            name: name.to_string(),
            nodes: Vec::new(),
            bin: Bin::Memory(Vec::new()),
        }
    }

    /// An empty graph whose constants are appended to `bin` as they are created (never held in memory); its IR is
    /// its XML plus that file, which other graphs may share.
    pub fn with_shared_bin(name: &str, bin: &SharedBin) -> Self {
        Graph {
            name: name.to_string(),
            nodes: Vec::new(),
            bin: Bin::File(bin.clone()),
        }
    }

    /// The shared `.bin` this graph's constants are written to (`None`: they are in memory).
    pub fn shared_bin(&self) -> Option<&SharedBin> {
        match &self.bin {
            Bin::Memory(_) => None,
            Bin::File(f) => Some(f),
        }
    }

    /// The graph's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The static shape of a value.
    pub fn shape(&self, v: Value) -> &[usize] {
        &self.nodes[v.node].outputs[v.port].shape
    }

    /// The element type of a value.
    pub fn elem(&self, v: Value) -> ElemType {
        self.nodes[v.node].outputs[v.port].ty
    }

    fn err(&self, op: &str, message: impl Into<String>) -> Error {
        Error::graph(&self.name, format!("{op}: {}", message.into()))
    }

    fn push(
        &mut self,
        op: &'static str,
        version: &'static str,
        attrs: Vec<(&'static str, String)>,
        inputs: Vec<Value>,
        outputs: Vec<(ElemType, Vec<usize>)>,
    ) -> usize {
        let id = self.nodes.len();
        self.nodes.push(Node {
            name: format!("{op}_{id}"),
            op,
            version,
            attrs,
            inputs,
            outputs: outputs
                .into_iter()
                .map(|(ty, shape)| Port {
                    ty,
                    shape,
                    names: vec![],
                })
                .collect(),
            body: None,
        });
        id
    }

    fn one(
        &mut self,
        op: &'static str,
        version: &'static str,
        attrs: Vec<(&'static str, String)>,
        inputs: Vec<Value>,
        ty: ElemType,
        shape: Vec<usize>,
    ) -> Value {
        let node = self.push(op, version, attrs, inputs, vec![(ty, shape)]);
        Value { node, port: 0 }
    }

    /// A graph input.
    pub fn parameter(&mut self, name: &str, ty: ElemType, shape: &[usize]) -> Value {
        let v = self.one(
            "Parameter",
            "opset1",
            vec![
                ("shape", dims(shape)),
                ("element_type", ty.ir_name().into()),
            ],
            vec![],
            ty,
            shape.to_vec(),
        );
        self.nodes[v.node].name = name.to_string();
        self.nodes[v.node].outputs[0].names.push(name.to_string());
        v
    }

    /// A constant from raw little-endian bytes.
    pub fn constant_bytes(&mut self, ty: ElemType, shape: &[usize], bytes: &[u8]) -> Result<Value> {
        let n: usize = shape.iter().product();
        if bytes.len() != ty.byte_size(n) {
            return Err(self.err(
                "Const",
                format!("{} bytes for {n} {} values", bytes.len(), ty.ir_name()),
            ));
        }
        let offset = self.bin.append(bytes)?;
        Ok(self.const_at(ty, shape, offset, bytes.len()))
    }

    /// A constant of `ty` and `shape` whose bytes `write` produces in pieces (each piece passed to the sink it is
    /// given, in order), so that a large tensor never needs to be whole in memory. With a [`SharedBin`] and a `key`,
    /// a constant already written under that key (with the same type and shape) is reused without calling `write`.
    /// Fails if `write` fails or produces another number of bytes than the type and shape need.
    pub fn constant_streamed(
        &mut self,
        key: Option<&str>,
        ty: ElemType,
        shape: &[usize],
        write: impl FnOnce(&mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>,
    ) -> Result<Value> {
        let n: usize = shape.iter().product();
        let size = ty.byte_size(n);
        if let (Some(key), Bin::File(f)) = (key, &self.bin)
            && let Some(offset) = f.lookup(key, ty, shape, size)?
        {
            return Ok(self.const_at(ty, shape, offset, size));
        }
        let start = self.bin.len()?;
        {
            let bin = &mut self.bin;
            let mut sink = |bytes: &[u8]| -> Result<()> { bin.append(bytes).map(|_| ()) };
            write(&mut sink)?;
        }
        let written = self.bin.len()? - start;
        if written != size {
            return Err(self.err(
                "Const",
                format!(
                    "{written} bytes written for {n} {} values ({size} expected)",
                    ty.ir_name()
                ),
            ));
        }
        if let (Some(key), Bin::File(f)) = (key, &self.bin) {
            f.remember(key, ty, shape, start, size)?;
        }
        Ok(self.const_at(ty, shape, start, size))
    }

    /// A `Const` node over `size` bytes at `offset` of the `.bin`.
    fn const_at(&mut self, ty: ElemType, shape: &[usize], offset: usize, size: usize) -> Value {
        self.one(
            "Const",
            "opset1",
            vec![
                ("element_type", ty.ir_name().into()),
                ("shape", dims(shape)),
                ("offset", offset.to_string()),
                ("size", size.to_string()),
            ],
            vec![],
            ty,
            shape.to_vec(),
        )
    }

    /// The graph's `.bin` file mapped (`None`: its constants are held in memory).
    pub(crate) fn bin_map(&self) -> Result<Option<memmap2::Mmap>> {
        match &self.bin {
            Bin::Memory(_) => Ok(None),
            Bin::File(f) => f.map().map(Some),
        }
    }

    /// The `size` bytes at `offset` of the graph's `.bin` (read back from the file for a shared one).
    pub(crate) fn bin_bytes(
        &self,
        offset: usize,
        size: usize,
    ) -> Result<std::borrow::Cow<'_, [u8]>> {
        self.bin.read(offset, size)
    }

    /// An f32 constant.
    pub fn const_f32(&mut self, data: &[f32], shape: &[usize]) -> Result<Value> {
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.constant_bytes(ElemType::F32, shape, &bytes)
    }

    /// An f16 constant.
    pub fn const_f16(&mut self, data: &[half::f16], shape: &[usize]) -> Result<Value> {
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.constant_bytes(ElemType::F16, shape, &bytes)
    }

    /// An i64 constant.
    pub fn const_i64(&mut self, data: &[i64], shape: &[usize]) -> Result<Value> {
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.constant_bytes(ElemType::I64, shape, &bytes)
    }

    /// A scalar f32 constant (shape `[]`, broadcasts anywhere).
    pub fn scalar(&mut self, x: f32) -> Result<Value> {
        self.const_f32(&[x], &[])
    }

    /// Marks `v` as a graph output named `name`.
    pub fn result(&mut self, v: Value, name: &str) -> Result<()> {
        let port = &mut self.nodes[v.node].outputs[v.port];
        if !port.names.is_empty() && self.nodes[v.node].op != "Parameter" {
            return Err(self.err(
                "Result",
                format!("`{name}`: this value is already an output"),
            ));
        }
        self.nodes[v.node].outputs[v.port]
            .names
            .push(name.to_string());
        let node = self.push("Result", "opset1", vec![], vec![v], vec![]);
        self.nodes[node].name = format!("{name}/sink_port_0");
        Ok(())
    }

    /// Number of nodes (for tests and reports).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Inputs `(name, type, shape)` in creation order.
    pub fn inputs(&self) -> Vec<(String, ElemType, Vec<usize>)> {
        self.nodes
            .iter()
            .filter(|n| n.op == "Parameter")
            .map(|n| (n.name.clone(), n.outputs[0].ty, n.outputs[0].shape.clone()))
            .collect()
    }

    /// Outputs `(name, type, shape)` in creation order.
    pub fn outputs(&self) -> Vec<(String, ElemType, Vec<usize>)> {
        self.nodes
            .iter()
            .filter(|n| n.op == "Result")
            .map(|n| {
                let v = n.inputs[0];
                let port = &self.nodes[v.node].outputs[v.port];
                (
                    port.names.last().cloned().unwrap_or_default(),
                    port.ty,
                    port.shape.clone(),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_inferred_and_mismatches_named() {
        let mut g = Graph::new("t");
        let x = g.parameter("x", ElemType::F32, &[2, 3, 4]);
        let w = g.const_f32(&[0.0; 20], &[5, 4]).unwrap();
        let y = g.matmul(x, w, false, true).unwrap();
        assert_eq!(g.shape(y), &[2, 3, 5]);
        let e = g.matmul(x, w, false, false).unwrap_err().to_string();
        assert!(e.contains("graph t") && e.contains("MatMul"), "{e}");
        let s = g.reduce_mean(y, &[2], true).unwrap();
        assert_eq!(g.shape(s), &[2, 3, 1]);
        let b = g.add(y, s).unwrap();
        assert_eq!(g.shape(b), &[2, 3, 5]);
        let t = g.transpose(b, &[2, 0, 1]).unwrap();
        assert_eq!(g.shape(t), &[5, 2, 3]);
        assert!(g.reshape(t, &[7]).is_err());
        let sl = g.slice(t, 0, 1, 3).unwrap();
        assert_eq!(g.shape(sl), &[3, 2, 3]);
        let c = g.concat(&[sl, t], 0).unwrap();
        assert_eq!(g.shape(c), &[8, 2, 3]);
    }

    #[test]
    fn serialisation_is_deterministic() {
        let build = || {
            let mut g = Graph::new("d");
            let x = g.parameter("x", ElemType::F32, &[2]);
            let c = g.const_f32(&[1.0, 2.0], &[2]).unwrap();
            let y = g.add(x, c).unwrap();
            g.result(y, "y").unwrap();
            let (xml, bin) = g.serialize();
            (xml, bin.to_vec())
        };
        assert_eq!(build(), build());
    }
}
