//! The element-wise, matrix and shape ops of [`Graph`], each checking its operands and inferring its output.

use super::{ElemType, Graph, Value, broadcast};
use crate::error::Result;

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
}

/// Unary element-wise ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unary {
    /// `exp(x)`
    Exp,
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

/// The two forms of GELU (`Gelu-7`'s `approximation_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GeluMode {
    /// `x/2 · (1 + erf(x/√2))` (PyTorch's `nn.GELU()`).
    Erf,
    /// `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))` (PyTorch's `gelu(approximate="tanh")`).
    Tanh,
}

impl GeluMode {
    /// The attribute's value.
    pub fn attr(self) -> &'static str {
        match self {
            GeluMode::Erf => "ERF",
            GeluMode::Tanh => "TANH",
        }
    }
}

impl Binary {
    fn op(self) -> &'static str {
        match self {
            Binary::Add => "Add",
            Binary::Subtract => "Subtract",
            Binary::Multiply => "Multiply",
            Binary::Divide => "Divide",
        }
    }
}

impl Unary {
    fn op(self) -> (&'static str, &'static str) {
        match self {
            Unary::Exp => ("Exp", "opset1"),
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

impl Graph {
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
        let ty = ta;
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

    /// GELU of a float tensor, in the form `mode` names.
    pub fn gelu(&mut self, x: Value, mode: GeluMode) -> Result<Value> {
        if !self.elem(x).is_float() {
            return Err(self.err(
                "Gelu",
                format!("needs a float input, got {}", self.elem(x).ir_name()),
            ));
        }
        let (ty, shape) = (self.elem(x), self.shape(x).to_vec());
        Ok(self.one(
            "Gelu",
            "opset7",
            vec![("approximation_mode", mode.attr().into())],
            vec![x],
            ty,
            shape,
        ))
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
        if self.elem(indices) != ElemType::I64 || axis >= ds.len() {
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
}

impl Graph {
    /// The `k` largest values along `axis` and their indices (`TopK-11`: mode `max`, sorted by value in descending
    /// order, `stable`: equal values keep their input order, the lower index first; indices `i64`). Returns
    /// `(values, indices)`, both of `x`'s shape with `axis` of length `k`.
    pub fn topk(&mut self, x: Value, k: usize, axis: usize) -> Result<(Value, Value)> {
        let (ty, mut shape) = (self.elem(x), self.shape(x).to_vec());
        if axis >= shape.len() || k == 0 || k > shape[axis] || !ty.is_float() {
            return Err(self.err(
                "TopK",
                format!(
                    "top {k} along axis {axis} of a {} tensor {shape:?}",
                    ty.ir_name()
                ),
            ));
        }
        shape[axis] = k;
        let kc = self.const_i64(&[k as i64], &[])?;
        let node = self.push(
            "TopK",
            "opset11",
            vec![
                ("axis", axis.to_string()),
                ("mode", "max".into()),
                ("sort", "value".into()),
                ("index_element_type", "i64".into()),
                ("stable", "true".into()),
            ],
            vec![x, kc],
            vec![(ty, shape.clone()), (ElemType::I64, shape)],
        );
        Ok((Value { node, port: 0 }, Value { node, port: 1 }))
    }

    /// One-hot rows of integer `indices` over `depth` classes, as f32 (`OneHot-1` with 1 on and 0 off, the new axis
    /// last): `indices.shape + [depth]`.
    pub fn one_hot(&mut self, indices: Value, depth: usize) -> Result<Value> {
        if self.elem(indices) != ElemType::I64 || depth == 0 {
            return Err(self.err(
                "OneHot",
                format!(
                    "{} indices over {depth} classes (i64, depth ≥ 1)",
                    self.elem(indices).ir_name()
                ),
            ));
        }
        let mut shape = self.shape(indices).to_vec();
        shape.push(depth);
        let d = self.const_i64(&[depth as i64], &[])?;
        let on = self.scalar(1.0)?;
        let off = self.scalar(0.0)?;
        Ok(self.one(
            "OneHot",
            "opset1",
            vec![("axis", "-1".into())],
            vec![indices, d, on, off],
            ElemType::F32,
            shape,
        ))
    }
}
