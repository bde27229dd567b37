//! A small typed builder of OpenVINO IR (v11): static shapes inferred as the graph is built, constants packed into
//! the `.bin`, deterministic output (the same graph always serialises to the same bytes).
//!
//! Every op method checks its operands and returns an error naming the graph and the op on a mismatch, so a wrong
//! graph fails here, with a readable message, rather than inside OpenVINO's reader.

use crate::error::{Error, Result};
use std::fmt::Write as _;

/// Element types of tensors in a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElemType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// 8-bit signed integer.
    I8,
    /// 8-bit unsigned integer.
    U8,
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
            ElemType::I32 => "i32",
            ElemType::I8 => "i8",
            ElemType::U8 => "u8",
            ElemType::I4 => "i4",
            ElemType::Boolean => "boolean",
        }
    }

    fn precision(self) -> &'static str {
        match self {
            ElemType::F32 => "FP32",
            ElemType::F16 => "FP16",
            ElemType::I64 => "I64",
            ElemType::I32 => "I32",
            ElemType::I8 => "I8",
            ElemType::U8 => "U8",
            ElemType::I4 => "I4",
            ElemType::Boolean => "BOOL",
        }
    }

    /// Bytes needed for `n` elements.
    pub fn byte_size(self, n: usize) -> usize {
        match self {
            ElemType::F32 | ElemType::I32 => 4 * n,
            ElemType::F16 => 2 * n,
            ElemType::I64 => 8 * n,
            ElemType::I8 | ElemType::U8 | ElemType::Boolean => n,
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
    node: usize,
    port: usize,
}

#[derive(Debug, Clone)]
struct Port {
    ty: ElemType,
    shape: Vec<usize>,
    names: Vec<String>,
}

#[derive(Debug, Clone)]
struct Node {
    name: String,
    op: &'static str,
    version: &'static str,
    attrs: Vec<(&'static str, String)>,
    inputs: Vec<Value>,
    outputs: Vec<Port>,
    body: Option<Box<LoopBody>>,
}

/// The body of a `Loop` node: its nodes (constants already pointing into the parent's `.bin`), the port map and
/// the back edges, all by body node ids.
#[derive(Debug, Clone)]
struct LoopBody {
    nodes: Vec<Node>,
    /// `(external input port, body Parameter id, slicing axis)`.
    inputs: Vec<(usize, usize, Option<usize>)>,
    /// `(external output port, body Result id, concatenation axis)`.
    outputs: Vec<(usize, usize, Option<usize>)>,
    /// Body Result id of the execution condition.
    condition: usize,
    /// `(body Result id, body Parameter id)`.
    back_edges: Vec<(usize, usize)>,
}

/// How a `Loop` input reaches its body Parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopInput {
    /// Iteration `i` sees slice `i` (of size 1) along `axis`.
    Sliced {
        /// The slicing axis.
        axis: usize,
    },
    /// Every iteration sees the whole value.
    Invariant,
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

/// A graph under construction.
#[derive(Debug, Clone)]
pub struct Graph {
    name: String,
    nodes: Vec<Node>,
    bin: Vec<u8>,
}

/// Binary element-wise ops (numpy broadcasting).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binary {
    /// `a + b`
    Add,
    /// `a - b`
    Subtract,
    /// `a * b`
    Multiply,
    /// `a / b`
    Divide,
    /// `max(a, b)`
    Maximum,
    /// `a ^ b`
    Power,
    /// `a > b` (boolean)
    Greater,
    /// `a < b` (boolean)
    Less,
}

/// Unary element-wise ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unary {
    /// `exp(x)`
    Exp,
    /// `ln(x)`
    Log,
    /// `sqrt(x)`
    Sqrt,
    /// `1 / (1 + exp(-x))`
    Sigmoid,
    /// `-x`
    Negative,
    /// `sin(x)`
    Sin,
    /// `cos(x)`
    Cos,
    /// `ln(1 + exp(x))`
    SoftPlus,
    /// `x * sigmoid(x)` (SiLU)
    Swish,
}

impl Binary {
    fn op(self) -> &'static str {
        match self {
            Binary::Add => "Add",
            Binary::Subtract => "Subtract",
            Binary::Multiply => "Multiply",
            Binary::Divide => "Divide",
            Binary::Maximum => "Maximum",
            Binary::Power => "Power",
            Binary::Greater => "Greater",
            Binary::Less => "Less",
        }
    }
}

impl Unary {
    fn op(self) -> (&'static str, &'static str) {
        match self {
            Unary::Exp => ("Exp", "opset1"),
            Unary::Log => ("Log", "opset1"),
            Unary::Sqrt => ("Sqrt", "opset1"),
            Unary::Sigmoid => ("Sigmoid", "opset1"),
            Unary::Negative => ("Negative", "opset1"),
            Unary::Sin => ("Sin", "opset1"),
            Unary::Cos => ("Cos", "opset1"),
            Unary::SoftPlus => ("SoftPlus", "opset4"),
            Unary::Swish => ("Swish", "opset4"),
        }
    }
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
    /// An empty graph.
    pub fn new(name: &str) -> Self {
        Graph {
            name: name.to_string(),
            nodes: Vec::new(),
            bin: Vec::new(),
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
        let offset = self.bin.len();
        self.bin.extend_from_slice(bytes);
        Ok(self.one(
            "Const",
            "opset1",
            vec![
                ("element_type", ty.ir_name().into()),
                ("shape", dims(shape)),
                ("offset", offset.to_string()),
                ("size", bytes.len().to_string()),
            ],
            vec![],
            ty,
            shape.to_vec(),
        ))
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

    /// An element-wise binary op with numpy broadcasting.
    pub fn binary(&mut self, op: Binary, a: Value, b: Value) -> Result<Value> {
        let (ta, tb) = (self.elem(a), self.elem(b));
        if ta != tb {
            return Err(self.err(
                op.op(),
                format!("element types {} and {}", ta.ir_name(), tb.ir_name()),
            ));
        }
        let shape = broadcast(self.shape(a), self.shape(b)).ok_or_else(|| {
            self.err(
                op.op(),
                format!(
                    "shapes {:?} and {:?} do not broadcast",
                    self.shape(a),
                    self.shape(b)
                ),
            )
        })?;
        let ty = if matches!(op, Binary::Greater | Binary::Less) {
            ElemType::Boolean
        } else {
            ta
        };
        Ok(self.one(
            op.op(),
            "opset1",
            vec![("auto_broadcast", "numpy".into())],
            vec![a, b],
            ty,
            shape,
        ))
    }

    /// `a + b`.
    pub fn add(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(Binary::Add, a, b)
    }

    /// `a - b`.
    pub fn sub(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(Binary::Subtract, a, b)
    }

    /// `a * b`.
    pub fn mul(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(Binary::Multiply, a, b)
    }

    /// `a / b`.
    pub fn div(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(Binary::Divide, a, b)
    }

    /// An element-wise unary op on a float tensor.
    pub fn unary(&mut self, op: Unary, x: Value) -> Result<Value> {
        let (name, version) = op.op();
        if !self.elem(x).is_float() {
            return Err(self.err(
                name,
                format!("needs a float input, got {}", self.elem(x).ir_name()),
            ));
        }
        let (ty, shape) = (self.elem(x), self.shape(x).to_vec());
        Ok(self.one(name, version, vec![], vec![x], ty, shape))
    }

    /// Matrix product with optional transposes of the last two dims; leading dims broadcast.
    pub fn matmul(
        &mut self,
        a: Value,
        b: Value,
        transpose_a: bool,
        transpose_b: bool,
    ) -> Result<Value> {
        let (sa, sb) = (self.shape(a).to_vec(), self.shape(b).to_vec());
        if sa.len() < 2 || sb.len() < 2 || self.elem(a) != self.elem(b) {
            return Err(self.err(
                "MatMul",
                format!("operands {sa:?} and {sb:?} (rank ≥ 2, same type)"),
            ));
        }
        let (m, k) = if transpose_a {
            (sa[sa.len() - 1], sa[sa.len() - 2])
        } else {
            (sa[sa.len() - 2], sa[sa.len() - 1])
        };
        let (k2, n) = if transpose_b {
            (sb[sb.len() - 1], sb[sb.len() - 2])
        } else {
            (sb[sb.len() - 2], sb[sb.len() - 1])
        };
        if k != k2 {
            return Err(self.err(
                "MatMul",
                format!(
                    "inner dims differ: {sa:?} x {sb:?} (transpose {transpose_a}, {transpose_b})"
                ),
            ));
        }
        let mut batch = broadcast(&sa[..sa.len() - 2], &sb[..sb.len() - 2]).ok_or_else(|| {
            self.err(
                "MatMul",
                format!("batch dims of {sa:?} and {sb:?} do not broadcast"),
            )
        })?;
        batch.extend([m, n]);
        let ty = self.elem(a);
        Ok(self.one(
            "MatMul",
            "opset1",
            vec![
                ("transpose_a", transpose_a.to_string()),
                ("transpose_b", transpose_b.to_string()),
            ],
            vec![a, b],
            ty,
            batch,
        ))
    }

    /// Reshape to a static shape with the same number of elements.
    pub fn reshape(&mut self, x: Value, shape: &[usize]) -> Result<Value> {
        let n: usize = self.shape(x).iter().product();
        if n != shape.iter().product::<usize>() {
            return Err(self.err(
                "Reshape",
                format!("{:?} cannot become {shape:?}", self.shape(x)),
            ));
        }
        if self.shape(x) == shape {
            return Ok(x);
        }
        let target: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let t = self.const_i64(&target, &[shape.len()])?;
        let ty = self.elem(x);
        Ok(self.one(
            "Reshape",
            "opset1",
            vec![("special_zero", "false".into())],
            vec![x, t],
            ty,
            shape.to_vec(),
        ))
    }

    /// Permutes dimensions.
    pub fn transpose(&mut self, x: Value, perm: &[usize]) -> Result<Value> {
        let s = self.shape(x).to_vec();
        let mut sorted = perm.to_vec();
        sorted.sort_unstable();
        if sorted != (0..s.len()).collect::<Vec<_>>() {
            return Err(self.err(
                "Transpose",
                format!("{perm:?} is not a permutation of {} dims", s.len()),
            ));
        }
        let p: Vec<i64> = perm.iter().map(|&d| d as i64).collect();
        let pc = self.const_i64(&p, &[perm.len()])?;
        let ty = self.elem(x);
        let shape = perm.iter().map(|&i| s[i]).collect();
        Ok(self.one("Transpose", "opset1", vec![], vec![x, pc], ty, shape))
    }

    /// Joins values along `axis`.
    pub fn concat(&mut self, values: &[Value], axis: usize) -> Result<Value> {
        let first = self.shape(values[0]).to_vec();
        let ty = self.elem(values[0]);
        let mut shape = first.clone();
        shape[axis] = 0;
        for &v in values {
            let s = self.shape(v);
            let same = s.len() == first.len()
                && s.iter()
                    .zip(&first)
                    .enumerate()
                    .all(|(i, (a, b))| i == axis || a == b);
            if !same || self.elem(v) != ty {
                return Err(self.err(
                    "Concat",
                    format!("{s:?} does not join {first:?} along axis {axis}"),
                ));
            }
            shape[axis] += s[axis];
        }
        if values.len() == 1 {
            return Ok(values[0]);
        }
        Ok(self.one(
            "Concat",
            "opset1",
            vec![("axis", axis.to_string())],
            values.to_vec(),
            ty,
            shape,
        ))
    }

    /// Elements `start..start + len` along `axis`.
    pub fn slice(&mut self, x: Value, axis: usize, start: usize, len: usize) -> Result<Value> {
        let mut shape = self.shape(x).to_vec();
        if axis >= shape.len() || start + len > shape[axis] || len == 0 {
            return Err(self.err(
                "Slice",
                format!("{start}..{} of axis {axis} of {shape:?}", start + len),
            ));
        }
        if start == 0 && len == shape[axis] {
            return Ok(x);
        }
        shape[axis] = len;
        let b = self.const_i64(&[start as i64], &[1])?;
        let e = self.const_i64(&[(start + len) as i64], &[1])?;
        let s = self.const_i64(&[1], &[1])?;
        let a = self.const_i64(&[axis as i64], &[1])?;
        let ty = self.elem(x);
        Ok(self.one("Slice", "opset8", vec![], vec![x, b, e, s, a], ty, shape))
    }

    /// Rows of `data` along `axis` picked by integer `indices` (any shape).
    pub fn gather(&mut self, data: Value, indices: Value, axis: usize) -> Result<Value> {
        let ds = self.shape(data).to_vec();
        if !matches!(self.elem(indices), ElemType::I64 | ElemType::I32) || axis >= ds.len() {
            return Err(self.err(
                "Gather",
                "indices must be integers and the axis inside the data",
            ));
        }
        let mut shape = ds[..axis].to_vec();
        shape.extend_from_slice(self.shape(indices));
        shape.extend_from_slice(&ds[axis + 1..]);
        let ax = self.const_i64(&[axis as i64], &[])?;
        let ty = self.elem(data);
        Ok(self.one(
            "Gather",
            "opset8",
            vec![("batch_dims", "0".into())],
            vec![data, indices, ax],
            ty,
            shape,
        ))
    }

    fn reduce(
        &mut self,
        op: &'static str,
        x: Value,
        axes: &[usize],
        keep_dims: bool,
    ) -> Result<Value> {
        let s = self.shape(x).to_vec();
        if axes.iter().any(|&a| a >= s.len()) {
            return Err(self.err(op, format!("axes {axes:?} of {s:?}")));
        }
        let shape: Vec<usize> = if keep_dims {
            s.iter()
                .enumerate()
                .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
                .collect()
        } else {
            s.iter()
                .enumerate()
                .filter(|(i, _)| !axes.contains(i))
                .map(|(_, &d)| d)
                .collect()
        };
        let a: Vec<i64> = axes.iter().map(|&d| d as i64).collect();
        let ac = self.const_i64(&a, &[axes.len()])?;
        let ty = self.elem(x);
        Ok(self.one(
            op,
            "opset1",
            vec![("keep_dims", keep_dims.to_string())],
            vec![x, ac],
            ty,
            shape,
        ))
    }

    /// Sum over `axes`.
    pub fn reduce_sum(&mut self, x: Value, axes: &[usize], keep_dims: bool) -> Result<Value> {
        self.reduce("ReduceSum", x, axes, keep_dims)
    }

    /// Mean over `axes`.
    pub fn reduce_mean(&mut self, x: Value, axes: &[usize], keep_dims: bool) -> Result<Value> {
        self.reduce("ReduceMean", x, axes, keep_dims)
    }

    /// Maximum over `axes`.
    pub fn reduce_max(&mut self, x: Value, axes: &[usize], keep_dims: bool) -> Result<Value> {
        self.reduce("ReduceMax", x, axes, keep_dims)
    }

    /// Softmax over `axis`.
    pub fn softmax(&mut self, x: Value, axis: usize) -> Result<Value> {
        let (ty, shape) = (self.elem(x), self.shape(x).to_vec());
        if axis >= shape.len() || !ty.is_float() {
            return Err(self.err(
                "SoftMax",
                format!("axis {axis} of a {} tensor {shape:?}", ty.ir_name()),
            ));
        }
        Ok(self.one(
            "SoftMax",
            "opset8",
            vec![("axis", axis.to_string())],
            vec![x],
            ty,
            shape,
        ))
    }

    /// Element type conversion.
    pub fn convert(&mut self, x: Value, to: ElemType) -> Result<Value> {
        if self.elem(x) == to {
            return Ok(x);
        }
        let shape = self.shape(x).to_vec();
        Ok(self.one(
            "Convert",
            "opset1",
            vec![("destination_type", to.ir_name().into())],
            vec![x],
            to,
            shape,
        ))
    }

    /// `cond ? a : b` element-wise (numpy broadcasting).
    pub fn select(&mut self, cond: Value, a: Value, b: Value) -> Result<Value> {
        if self.elem(cond) != ElemType::Boolean || self.elem(a) != self.elem(b) {
            return Err(self.err(
                "Select",
                "needs a boolean condition and two values of one type",
            ));
        }
        let s = broadcast(self.shape(a), self.shape(b))
            .and_then(|s| broadcast(self.shape(cond), &s))
            .ok_or_else(|| self.err("Select", "shapes do not broadcast"))?;
        let ty = self.elem(a);
        Ok(self.one(
            "Select",
            "opset1",
            vec![("auto_broadcast", "numpy".into())],
            vec![cond, a, b],
            ty,
            s,
        ))
    }

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
                LoopInput::Invariant => outer.clone(),
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
        let shift = self.bin.len();
        self.bin.extend_from_slice(&body.bin);
        let mut nodes = body.nodes;
        for n in nodes.iter_mut().filter(|n| n.op == "Const") {
            for (k, v) in n.attrs.iter_mut() {
                if *k == "offset" {
                    *v = (v.parse::<usize>().unwrap_or(0) + shift).to_string();
                }
            }
        }
        let offset = self.bin.len();
        self.bin.push(1);
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

    /// An op this builder does not wrap, with a declared output type and shape (not checked here: OpenVINO's
    /// reader validates it).
    pub fn custom(
        &mut self,
        op: &'static str,
        version: &'static str,
        attrs: Vec<(&'static str, String)>,
        inputs: &[Value],
        ty: ElemType,
        shape: &[usize],
    ) -> Value {
        self.one(op, version, attrs, inputs.to_vec(), ty, shape.to_vec())
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

    /// Writes `{stem}.xml` and `{stem}.bin`.
    pub fn save(&self, xml_path: &std::path::Path) -> Result<()> {
        let (xml, bin) = self.serialize();
        let bin_path = xml_path.with_extension("bin");
        std::fs::write(xml_path, xml).map_err(|e| Error::io(xml_path, e))?;
        std::fs::write(&bin_path, bin).map_err(|e| Error::io(&bin_path, e))
    }

    /// The IR: `(xml, bin)`, the weights borrowed (they can be the bulk of a checkpoint).
    pub fn serialize(&self) -> (String, &[u8]) {
        let mut xml = String::new();
        let _ = writeln!(xml, "<?xml version=\"1.0\"?>");
        let _ = writeln!(xml, "<net name=\"{}\" version=\"11\">", escape(&self.name));
        write_nodes(&mut xml, &self.nodes, 1);
        let _ = writeln!(xml, "</net>");
        (xml, &self.bin)
    }
}

fn write_port(xml: &mut String, indent: &str, id: usize, p: &Port, with_names: bool) {
    let names = if with_names && !p.names.is_empty() {
        format!(" names=\"{}\"", escape(&p.names.join(",")))
    } else {
        String::new()
    };
    let _ = write!(
        xml,
        "{indent}<port id=\"{id}\" precision=\"{}\"{names}",
        p.ty.precision()
    );
    if p.shape.is_empty() {
        let _ = writeln!(xml, " />");
    } else {
        let _ = writeln!(xml, ">");
        for d in &p.shape {
            let _ = writeln!(xml, "{indent}\t<dim>{d}</dim>");
        }
        let _ = writeln!(xml, "{indent}</port>");
    }
}

/// `<layers>` and `<edges>` of a node list, at an indentation depth.
fn write_nodes(xml: &mut String, nodes: &[Node], depth: usize) {
    let t = |n: usize| "\t".repeat(depth + n);
    let _ = writeln!(xml, "{}<layers>", t(0));
    for (id, n) in nodes.iter().enumerate() {
        let _ = writeln!(
            xml,
            "{}<layer id=\"{id}\" name=\"{}\" type=\"{}\" version=\"{}\">",
            t(1),
            escape(&n.name),
            n.op,
            n.version
        );
        if !n.attrs.is_empty() {
            let attrs: Vec<String> = n
                .attrs
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            let _ = writeln!(xml, "{}<data {} />", t(2), attrs.join(" "));
        }
        if let Some(body) = &n.body {
            write_port_map(xml, body, depth + 2);
        }
        if !n.inputs.is_empty() {
            let _ = writeln!(xml, "{}<input>", t(2));
            for (i, v) in n.inputs.iter().enumerate() {
                write_port(xml, &t(3), i, &nodes[v.node].outputs[v.port], false);
            }
            let _ = writeln!(xml, "{}</input>", t(2));
        }
        if !n.outputs.is_empty() {
            let _ = writeln!(xml, "{}<output>", t(2));
            for (j, p) in n.outputs.iter().enumerate() {
                write_port(xml, &t(3), n.inputs.len() + j, p, true);
            }
            let _ = writeln!(xml, "{}</output>", t(2));
        }
        if let Some(body) = &n.body {
            let _ = writeln!(xml, "{}<body>", t(2));
            write_nodes(xml, &body.nodes, depth + 3);
            let _ = writeln!(xml, "{}</body>", t(2));
        }
        let _ = writeln!(xml, "{}</layer>", t(1));
    }
    let _ = writeln!(xml, "{}</layers>", t(0));
    let _ = writeln!(xml, "{}<edges>", t(0));
    for (id, n) in nodes.iter().enumerate() {
        for (i, v) in n.inputs.iter().enumerate() {
            let from_port = nodes[v.node].inputs.len() + v.port;
            let _ = writeln!(
                xml,
                "{}<edge from-layer=\"{}\" from-port=\"{from_port}\" to-layer=\"{id}\" to-port=\"{i}\" />",
                t(1),
                v.node
            );
        }
    }
    let _ = writeln!(xml, "{}</edges>", t(0));
}

fn write_port_map(xml: &mut String, body: &LoopBody, depth: usize) {
    let t = |n: usize| "\t".repeat(depth + n);
    let slicing = |axis: Option<usize>| match axis {
        Some(a) => format!(" axis=\"{a}\" start=\"0\" end=\"-1\" stride=\"1\" part_size=\"1\""),
        None => String::new(),
    };
    let _ = writeln!(xml, "{}<port_map>", t(0));
    for &(port, param, axis) in &body.inputs {
        let _ = writeln!(
            xml,
            "{}<input{} external_port_id=\"{port}\" internal_layer_id=\"{param}\" />",
            t(1),
            slicing(axis)
        );
    }
    for &(port, result, axis) in &body.outputs {
        let _ = writeln!(
            xml,
            "{}<output{} external_port_id=\"{port}\" internal_layer_id=\"{result}\" />",
            t(1),
            slicing(axis)
        );
    }
    let _ = writeln!(
        xml,
        "{}<output external_port_id=\"-1\" internal_layer_id=\"{}\" purpose=\"execution_condition\" />",
        t(1),
        body.condition
    );
    let _ = writeln!(xml, "{}</port_map>", t(0));
    let _ = writeln!(xml, "{}<back_edges>", t(0));
    for &(from, to) in &body.back_edges {
        let _ = writeln!(
            xml,
            "{}<edge from-layer=\"{from}\" to-layer=\"{to}\" />",
            t(1)
        );
    }
    let _ = writeln!(xml, "{}</back_edges>", t(0));
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
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
