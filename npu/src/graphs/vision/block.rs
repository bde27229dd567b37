//! The vision tower's layers as graph ops (`reference::vision::block`): LayerNorm, a ViT block and the merger, the
//! same names and the same math.

use crate::error::Result;
use crate::ir::{GeluMode, Graph, Unary, Value};
use reference::schema::vision::{VisionSchema, VisionTensor};
use reference::vision::VisionConfig;
use reference::vision::block::LAYER_NORM_EPS;
use reference::weights::WeightStore;

/// A vision tensor as an f32 constant of the given shape.
pub(crate) fn constant(
    graph: &mut Graph,
    w: &WeightStore,
    spec: &VisionTensor,
    shape: &[usize],
) -> Result<Value> {
    let t = w.vision_tensor(spec)?.to_dtype(candle_core::DType::F32)?;
    graph.const_f32(&t.flatten_all()?.to_vec1::<f32>()?, shape)
}

/// A linear layer with its bias.
pub struct Affine {
    weight: Value,
    bias: Value,
}

impl Affine {
    /// `weight` `[out, in…]` (viewed `[out, Π in]`) and `bias` `[out]` as constants.
    pub fn load(graph: &mut Graph, w: &WeightStore, specs: &[VisionTensor; 2]) -> Result<Self> {
        let [weight, bias] = specs;
        let (rows, cols) = (weight.shape[0], weight.shape[1..].iter().product());
        Ok(Affine {
            weight: constant(graph, w, weight, &[rows, cols])?,
            bias: constant(graph, w, bias, &[rows])?,
        })
    }

    /// `x Wᵀ + b`.
    pub fn forward(&self, graph: &mut Graph, x: Value) -> Result<Value> {
        let y = graph.matmul(x, self.weight, false, true)?;
        graph.add(y, self.bias)
    }
}

/// LayerNorm over the last dimension: `(x − mean) / sqrt(var + eps) · w + b`.
pub struct LayerNorm {
    weight: Value,
    bias: Value,
}

impl LayerNorm {
    /// `weight` and `bias` as constants.
    pub fn load(graph: &mut Graph, w: &WeightStore, specs: &[VisionTensor; 2]) -> Result<Self> {
        let n = specs[0].shape[0];
        Ok(LayerNorm {
            weight: constant(graph, w, &specs[0], &[n])?,
            bias: constant(graph, w, &specs[1], &[n])?,
        })
    }

    /// The normalised `x`.
    pub fn forward(&self, graph: &mut Graph, x: Value) -> Result<Value> {
        let last = graph.shape(x).len() - 1;
        let mean = graph.reduce_mean(x, &[last], true)?;
        let centred = graph.sub(x, mean)?;
        let sq = graph.mul(centred, centred)?;
        let var = graph.reduce_mean(sq, &[last], true)?;
        let eps = graph.scalar(LAYER_NORM_EPS as f32)?;
        let var = graph.add(var, eps)?;
        let root = graph.unary(Unary::Sqrt, var)?;
        let normed = graph.div(centred, root)?;
        let scaled = graph.mul(normed, self.weight)?;
        graph.add(scaled, self.bias)
    }
}

/// `x · cos + rotate_half(x) · sin` over the whole head: `x` `[S, heads, D]`, `cos`, `sin` `[S, 1, D]`.
fn rotate(graph: &mut Graph, x: Value, cos: Value, sin: Value) -> Result<Value> {
    let d = graph.shape(x)[2];
    let x1 = graph.slice(x, 2, 0, d / 2)?;
    let x2 = graph.slice(x, 2, d / 2, d / 2)?;
    let neg = graph.unary(Unary::Negative, x2)?;
    let half = graph.concat(&[neg, x1], 2)?;
    let a = graph.mul(x, cos)?;
    let b = graph.mul(half, sin)?;
    graph.add(a, b)
}

/// What every block of one static graph shares: the rotary tables and the block mask, as constants.
pub struct Shared {
    /// `cos`, `sin` `[S, 1, D]`.
    pub rotary: (Value, Value),
    /// The additive mask `[S, S]` keeping attention within each image or frame; `None` for a single span.
    pub mask: Option<Value>,
}

/// One ViT block.
pub struct VisionBlock {
    norm1: LayerNorm,
    norm2: LayerNorm,
    qkv: Affine,
    proj: Affine,
    fc1: Affine,
    fc2: Affine,
    heads: usize,
}

impl VisionBlock {
    /// Block `i`'s weights as constants.
    pub fn load(graph: &mut Graph, w: &WeightStore, c: &VisionConfig, i: usize) -> Result<Self> {
        let s = VisionSchema::new(c);
        let scope = VisionSchema::block_scope(i);
        let [qkv, proj, fc1, fc2] = s
            .block_linears()
            .map(|(name, out, inp)| s.linear(&format!("{scope}.{name}"), out, inp));
        Ok(VisionBlock {
            norm1: LayerNorm::load(graph, w, &s.layer_norm(&format!("{scope}.norm1")))?,
            norm2: LayerNorm::load(graph, w, &s.layer_norm(&format!("{scope}.norm2")))?,
            qkv: Affine::load(graph, w, &qkv)?,
            proj: Affine::load(graph, w, &proj)?,
            fc1: Affine::load(graph, w, &fc1)?,
            fc2: Affine::load(graph, w, &fc2)?,
            heads: c.num_heads,
        })
    }

    /// The block's output for `x` `[S, Hv]`.
    pub fn forward(&self, graph: &mut Graph, x: Value, shared: &Shared) -> Result<Value> {
        let normed = self.norm1.forward(graph, x)?;
        let attn = self.attention(graph, normed, shared)?;
        let h = graph.add(x, attn)?;
        let normed = self.norm2.forward(graph, h)?;
        let up = self.fc1.forward(graph, normed)?;
        let act = graph.gelu(up, GeluMode::Tanh)?;
        let m = self.fc2.forward(graph, act)?;
        graph.add(h, m)
    }

    fn attention(&self, graph: &mut Graph, x: Value, shared: &Shared) -> Result<Value> {
        let (s, width) = (graph.shape(x)[0], graph.shape(x)[1]);
        let d = width / self.heads;
        let qkv = self.qkv.forward(graph, x)?;
        let qkv = graph.reshape(qkv, &[s, 3, self.heads, d])?;
        let (cos, sin) = shared.rotary;
        let mut parts = Vec::with_capacity(3);
        for i in 0..3 {
            let p = graph.slice(qkv, 1, i, 1)?;
            parts.push(graph.reshape(p, &[s, self.heads, d])?);
        }
        let q = rotate(graph, parts[0], cos, sin)?;
        let k = rotate(graph, parts[1], cos, sin)?;
        // [heads, S, D]
        let q = graph.transpose(q, &[1, 0, 2])?;
        let k = graph.transpose(k, &[1, 0, 2])?;
        let v = graph.transpose(parts[2], &[1, 0, 2])?;
        let scores = graph.matmul(q, k, false, true)?;
        let scale = graph.scalar((d as f64).powf(-0.5) as f32)?;
        let mut scores = graph.mul(scores, scale)?;
        if let Some(mask) = shared.mask {
            scores = graph.add(scores, mask)?;
        }
        let probs = graph.softmax(scores, 2)?;
        let o = graph.matmul(probs, v, false, false)?;
        let o = graph.transpose(o, &[1, 0, 2])?;
        let o = graph.reshape(o, &[s, width])?;
        self.proj.forward(graph, o)
    }
}

/// The patch merger: LayerNorm per patch, `m²` consecutive patches as one row, `fc2(gelu_erf(fc1(·)))`.
pub struct Merger {
    norm: LayerNorm,
    fc1: Affine,
    fc2: Affine,
    unit: usize,
}

impl Merger {
    /// `merger.*` as constants.
    pub fn load(graph: &mut Graph, w: &WeightStore, c: &VisionConfig) -> Result<Self> {
        let s = VisionSchema::new(c);
        let [fc1, fc2] = s
            .merger_linears()
            .map(|(name, out, inp)| s.linear(name, out, inp));
        Ok(Merger {
            norm: LayerNorm::load(graph, w, &s.layer_norm("merger.norm"))?,
            fc1: Affine::load(graph, w, &fc1)?,
            fc2: Affine::load(graph, w, &fc2)?,
            unit: c.merge_unit(),
        })
    }

    /// The merged tokens `[S / m², H]` of `x` `[S, Hv]`.
    pub fn forward(&self, graph: &mut Graph, x: Value) -> Result<Value> {
        let (s, width) = (graph.shape(x)[0], graph.shape(x)[1]);
        let normed = self.norm.forward(graph, x)?;
        let rows = graph.reshape(normed, &[s / self.unit, width * self.unit])?;
        let up = self.fc1.forward(graph, rows)?;
        let act = graph.gelu(up, GeluMode::Erf)?;
        self.fc2.forward(graph, act)
    }
}
