//! The vision tower's tensors, written once (under `model.visual.` in a full checkpoint; `i` is a block):
//!
//! | tensor | shape | role |
//! |---|---|---|
//! | `patch_embed.proj.weight` | `[Hv, C, Tp, P, P]` | the Conv3d (kernel = stride = one patch) |
//! | `patch_embed.proj.bias` | `[Hv]` | bias |
//! | `pos_embed.weight` | `[N, Hv]` (N = side²) | the learned position table |
//! | `blocks.i.norm1.weight`, `norm2.weight` (and their `.bias`) | `[Hv]` | LayerNorm weight (bias) |
//! | `blocks.i.attn.qkv.weight` | `[3·Hv, Hv]` | projection (`[3, heads, head_dim]` rows) |
//! | `blocks.i.attn.qkv.bias` | `[3·Hv]` | bias |
//! | `blocks.i.attn.proj.weight`, `.bias` | `[Hv, Hv]`, `[Hv]` | projection, bias |
//! | `blocks.i.mlp.linear_fc1.weight`, `.bias` | `[I, Hv]`, `[I]` | projection, bias |
//! | `blocks.i.mlp.linear_fc2.weight`, `.bias` | `[Hv, I]`, `[Hv]` | projection, bias |
//! | `merger.norm.weight`, `.bias` | `[Hv]` | LayerNorm weight, bias (per patch, before the merge) |
//! | `merger.linear_fc1.weight`, `.bias` | `[4·Hv, 4·Hv]`, `[4·Hv]` | projection, bias |
//! | `merger.linear_fc2.weight`, `.bias` | `[H, 4·Hv]`, `[H]` | projection to the text width, bias |

use crate::vision::config::VisionConfig;

/// The checkpoint prefix of the vision tower.
pub const VISION_PREFIX: &str = "model.visual.";

/// What a vision tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VisionRole {
    /// A linear layer's weight `[out, in]` (the patch Conv3d counts as one, flattened to `[Hv, C·Tp·P·P]`).
    Projection,
    /// A linear layer's, the Conv3d's or a LayerNorm's bias.
    Bias,
    /// A LayerNorm's weight (plain, not zero-centred).
    NormWeight,
    /// The learned position table.
    Table,
}

/// One tensor of the vision tower.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VisionTensor {
    /// The name under [`VISION_PREFIX`].
    pub name: String,
    /// The shape the config implies, as the checkpoint stores it.
    pub shape: Vec<usize>,
    /// The tensor's role.
    pub role: VisionRole,
}

impl VisionTensor {
    fn new(name: impl Into<String>, shape: Vec<usize>, role: VisionRole) -> Self {
        VisionTensor {
            name: name.into(),
            shape,
            role,
        }
    }

    /// Where each dimension of the shape comes from, in the keys of `vision_config`: what an error names when the
    /// checkpoint disagrees.
    pub fn keys(&self) -> Vec<&'static str> {
        const H: &str = "vision_config.hidden_size";
        const M: &str = "vision_config.hidden_size·spatial_merge_size²";
        let n = self.name.as_str();
        let (weight, of) = match n.rsplit_once('.') {
            Some((of, "weight")) => (true, of),
            Some((of, _)) => (false, of),
            None => (false, n),
        };
        let (out, inp): (&'static str, &'static str) = if of == "patch_embed.proj" {
            if weight {
                return vec![
                    H,
                    "vision_config.in_channels",
                    "vision_config.temporal_patch_size",
                    "vision_config.patch_size",
                    "vision_config.patch_size",
                ];
            }
            (H, "")
        } else if of == "pos_embed" {
            ("vision_config.num_position_embeddings", H)
        } else if of.ends_with("attn.qkv") {
            ("3·vision_config.hidden_size", H)
        } else if of.ends_with("mlp.linear_fc1") {
            ("vision_config.intermediate_size", H)
        } else if of.ends_with("mlp.linear_fc2") {
            (H, "vision_config.intermediate_size")
        } else if of == "merger.linear_fc1" {
            (M, M)
        } else if of == "merger.linear_fc2" {
            ("vision_config.out_hidden_size", M)
        } else {
            (H, H)
        };
        if weight && self.shape.len() == 2 {
            vec![out, inp]
        } else {
            vec![out]
        }
    }

    /// The full checkpoint name.
    pub fn full_name(&self) -> String {
        format!("{VISION_PREFIX}{}", self.name)
    }
}

/// The tensors of a vision tower with a given config (and the text width its merger projects to).
#[derive(Debug, Clone, Copy)]
pub struct VisionSchema<'a> {
    config: &'a VisionConfig,
}

impl<'a> VisionSchema<'a> {
    /// The schema of `config`.
    pub fn new(config: &'a VisionConfig) -> Self {
        VisionSchema { config }
    }

    /// The patch embedding's Conv3d weight `[Hv, C, Tp, P, P]`.
    pub fn patch_weight(&self) -> VisionTensor {
        let c = self.config;
        VisionTensor::new(
            "patch_embed.proj.weight",
            vec![
                c.hidden_size,
                c.in_channels,
                c.temporal_patch_size,
                c.patch_size,
                c.patch_size,
            ],
            VisionRole::Projection,
        )
    }

    /// The patch embedding's bias `[Hv]`.
    pub fn patch_bias(&self) -> VisionTensor {
        VisionTensor::new(
            "patch_embed.proj.bias",
            vec![self.config.hidden_size],
            VisionRole::Bias,
        )
    }

    /// The learned position table `[N, Hv]`.
    pub fn pos_embed(&self) -> VisionTensor {
        let c = self.config;
        VisionTensor::new(
            "pos_embed.weight",
            vec![c.num_position_embeddings, c.hidden_size],
            VisionRole::Table,
        )
    }

    /// A LayerNorm's `weight` and `bias` under `scope` (`blocks.0.norm1`, `merger.norm`).
    pub fn layer_norm(&self, scope: &str) -> [VisionTensor; 2] {
        let h = self.config.hidden_size;
        [
            VisionTensor::new(format!("{scope}.weight"), vec![h], VisionRole::NormWeight),
            VisionTensor::new(format!("{scope}.bias"), vec![h], VisionRole::Bias),
        ]
    }

    /// A linear layer's `weight` `[out, in]` and `bias` `[out]` under `scope`.
    pub fn linear(&self, scope: &str, out: usize, inp: usize) -> [VisionTensor; 2] {
        [
            VisionTensor::new(
                format!("{scope}.weight"),
                vec![out, inp],
                VisionRole::Projection,
            ),
            VisionTensor::new(format!("{scope}.bias"), vec![out], VisionRole::Bias),
        ]
    }

    /// The scope of block `i` (`blocks.{i}`).
    pub fn block_scope(i: usize) -> String {
        format!("blocks.{i}")
    }

    /// The linear layers of a block: `attn.qkv`, `attn.proj`, `mlp.linear_fc1`, `mlp.linear_fc2`, with their
    /// `(out, in)`.
    pub fn block_linears(&self) -> [(&'static str, usize, usize); 4] {
        let (h, i) = (self.config.hidden_size, self.config.intermediate_size);
        [
            ("attn.qkv", 3 * h, h),
            ("attn.proj", h, h),
            ("mlp.linear_fc1", i, h),
            ("mlp.linear_fc2", h, i),
        ]
    }

    /// The merger's linear layers `linear_fc1`, `linear_fc2` with their `(out, in)`.
    pub fn merger_linears(&self) -> [(&'static str, usize, usize); 2] {
        let c = self.config;
        let merged = c.hidden_size * c.merge_unit();
        [
            ("merger.linear_fc1", merged, merged),
            ("merger.linear_fc2", c.out_hidden_size, merged),
        ]
    }

    /// Every tensor of the vision tower, in checkpoint order (patch embedding, table, blocks, merger).
    pub fn tensors(&self) -> Vec<VisionTensor> {
        let mut out = vec![self.patch_weight(), self.patch_bias(), self.pos_embed()];
        for b in 0..self.config.depth {
            let scope = Self::block_scope(b);
            out.extend(self.layer_norm(&format!("{scope}.norm1")));
            out.extend(self.layer_norm(&format!("{scope}.norm2")));
            for (name, o, i) in self.block_linears() {
                out.extend(self.linear(&format!("{scope}.{name}"), o, i));
            }
        }
        out.extend(self.layer_norm("merger.norm"));
        for (name, o, i) in self.merger_linears() {
            out.extend(self.linear(name, o, i));
        }
        out
    }
}
