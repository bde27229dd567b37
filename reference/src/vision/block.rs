//! The vision tower's layers: LayerNorm, a ViT block (non-causal attention with the axial rotary embedding, kept
//! within each image or frame; a GELU-tanh MLP) and the patch merger (LayerNorm per patch, four patches as one row,
//! an exact-GELU MLP to the text width).

use crate::error::Result;
use crate::linear::Linear;
use crate::ops::softmax_last_dim;
use crate::schema::vision::{VisionSchema, VisionTensor};
use crate::taps::Taps;
use crate::vision::VisionConfig;
use crate::vision::names;
use crate::weights::WeightStore;
use candle_core::{D, Tensor};

/// LayerNorm's epsilon in every vision norm (transformers builds them with `eps=1e-6`; the config has no field).
pub const LAYER_NORM_EPS: f64 = 1e-6;

/// A linear layer with its bias.
#[derive(Debug)]
pub struct Affine {
    weight: Linear,
    bias: Tensor,
}

impl Affine {
    /// Reads `{scope}.weight` `[out, in]` and `{scope}.bias` `[out]`.
    pub fn load(w: &WeightStore, specs: &[VisionTensor; 2]) -> Result<Self> {
        let [weight, bias] = specs;
        let (rows, cols) = (weight.shape[0], weight.shape[1..].iter().product());
        Ok(Affine {
            weight: w.vision_matrix(weight, rows, cols)?,
            bias: w.vision_tensor(bias)?,
        })
    }

    /// `x Wᵀ + b`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.weight.forward(x)?.broadcast_add(&self.bias)?)
    }
}

/// LayerNorm over the last dimension: `(x − mean) / sqrt(var + eps) · w + b`, the biased variance.
#[derive(Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl LayerNorm {
    /// Reads `{scope}.weight` and `{scope}.bias`.
    pub fn load(w: &WeightStore, specs: &[VisionTensor; 2]) -> Result<Self> {
        Ok(LayerNorm {
            weight: w.vision_tensor(&specs[0])?,
            bias: w.vision_tensor(&specs[1])?,
        })
    }

    /// The normalised `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let centred = x.broadcast_sub(&mean)?;
        let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let inv = (var + LAYER_NORM_EPS)?.sqrt()?.recip()?;
        Ok(centred
            .broadcast_mul(&inv)?
            .broadcast_mul(&self.weight)?
            .broadcast_add(&self.bias)?)
    }
}

/// `x · cos + rotate_half(x) · sin` over the whole head: `x` `[S, heads, D]`, `cos`, `sin` `[S, D]`.
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, d / 2)?,
        x.narrow(D::Minus1, d / 2, d / 2)?,
    );
    let half = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    let (cos, sin) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
    Ok((x.broadcast_mul(&cos)? + half.broadcast_mul(&sin)?)?)
}

/// One ViT block.
#[derive(Debug)]
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
    /// Reads block `i`.
    pub fn load(w: &WeightStore, c: &VisionConfig, i: usize) -> Result<Self> {
        let s = VisionSchema::new(c);
        let scope = VisionSchema::block_scope(i);
        let [qkv, proj, fc1, fc2] = s
            .block_linears()
            .map(|(name, out, inp)| s.linear(&format!("{scope}.{name}"), out, inp));
        Ok(VisionBlock {
            norm1: LayerNorm::load(w, &s.layer_norm(&format!("{scope}.norm1")))?,
            norm2: LayerNorm::load(w, &s.layer_norm(&format!("{scope}.norm2")))?,
            qkv: Affine::load(w, &qkv)?,
            proj: Affine::load(w, &proj)?,
            fc1: Affine::load(w, &fc1)?,
            fc2: Affine::load(w, &fc2)?,
            heads: c.num_heads,
        })
    }

    /// The block's output for `x` `[S, Hv]`; attention stays within each of `spans`. Records block `index`'s GELU
    /// input when `taps` are on, and its attention scores too with `scores`.
    pub fn forward(
        &self,
        x: &Tensor,
        rotary: &(Tensor, Tensor),
        spans: &[(usize, usize)],
        taps: &mut Taps,
        index: usize,
        scores: bool,
    ) -> Result<Tensor> {
        let scores = scores && taps.enabled();
        let h =
            (x + self.attention(&self.norm1.forward(x)?, rotary, spans, taps, index, scores)?)?;
        let up = self.fc1.forward(&self.norm2.forward(&h)?)?;
        taps.record(|| names::gelu_input(index), &up)?;
        let m = self.fc2.forward(&up.gelu()?)?;
        Ok((h + m)?)
    }

    fn attention(
        &self,
        x: &Tensor,
        (cos, sin): &(Tensor, Tensor),
        spans: &[(usize, usize)],
        taps: &mut Taps,
        index: usize,
        record_scores: bool,
    ) -> Result<Tensor> {
        let (s, width) = x.dims2()?;
        let d = width / self.heads;
        let qkv = self.qkv.forward(x)?.reshape((s, 3, self.heads, d))?;
        let q = rotate(&qkv.narrow(1, 0, 1)?.squeeze(1)?, cos, sin)?;
        let k = rotate(&qkv.narrow(1, 1, 1)?.squeeze(1)?, cos, sin)?;
        let v = qkv.narrow(1, 2, 1)?.squeeze(1)?;
        let scale = (d as f64).powf(-0.5);
        let mut outs = Vec::with_capacity(spans.len());
        let mut all_scores = Vec::new();
        for &(start, len) in spans {
            // [heads, L, D]
            let q = q.narrow(0, start, len)?.transpose(0, 1)?.contiguous()?;
            let k = k.narrow(0, start, len)?.transpose(0, 1)?.contiguous()?;
            let v = v.narrow(0, start, len)?.transpose(0, 1)?.contiguous()?;
            let scores = (q.matmul(&k.t()?)? * scale)?;
            let o = softmax_last_dim(&scores)?.matmul(&v)?;
            outs.push(o.transpose(0, 1)?.reshape((len, width))?);
            if record_scores {
                all_scores.push(scores.reshape((self.heads, len * len))?);
            }
        }
        if !all_scores.is_empty() {
            taps.record(
                || names::attention_scores(index),
                &Tensor::cat(&all_scores, 1)?,
            )?;
        }
        self.proj.forward(&Tensor::cat(&outs, 0)?)
    }
}

/// The patch merger: LayerNorm per patch, `m²` consecutive patches as one row, `fc2(gelu_erf(fc1(·)))`.
#[derive(Debug)]
pub struct Merger {
    norm: LayerNorm,
    fc1: Affine,
    fc2: Affine,
    unit: usize,
}

impl Merger {
    /// Reads `merger.*`.
    pub fn load(w: &WeightStore, c: &VisionConfig) -> Result<Self> {
        let s = VisionSchema::new(c);
        let [fc1, fc2] = s
            .merger_linears()
            .map(|(name, out, inp)| s.linear(name, out, inp));
        Ok(Merger {
            norm: LayerNorm::load(w, &s.layer_norm("merger.norm"))?,
            fc1: Affine::load(w, &fc1)?,
            fc2: Affine::load(w, &fc2)?,
            unit: c.merge_unit(),
        })
    }

    /// The merged tokens `[S / m², H]` of the last block's output `[S, Hv]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (s, width) = x.dims2()?;
        let rows = self
            .norm
            .forward(x)?
            .reshape((s / self.unit, width * self.unit))?;
        self.fc2.forward(&self.fc1.forward(&rows)?.gelu_erf()?)
    }
}
