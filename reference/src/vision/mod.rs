//! The Qwen3.5 vision tower (transformers 5.23 `Qwen3_5VisionModel`), f32 or f64: pixel patches in, one row of the
//! text width per merged token out.
//!
//! 1. Patch embedding: the Conv3d whose kernel and stride are one patch (`[C, Tp, P, P]`) is a linear layer over the
//!    flattened patch (the processor's `pixel_values` row), with bias.
//! 2. The learned position table (`side × side`) resampled to each image's grid ([`grid::resample_table`]), added.
//! 3. The blocks ([`block::VisionBlock`]), attention kept within each image or video frame.
//! 4. The merger ([`block::Merger`]): `m²` patches of a merge block become one token of the text width.
//!
//! Taps (dump names): `vision.patch_embed` (the Conv3d's output), `vision.pos_embed` (the resampled table),
//! `vision.blocks.{i}.output`, `vision.merger`. [`positions`] lays out a prompt's multimodal rotary positions
//! (transformers' `get_rope_index`) and puts the merger's rows in place of the image tokens' embeddings.

pub mod block;
pub mod config;
pub mod grid;
pub mod positions;
pub mod preprocess;
pub mod prompt;

pub use config::{VisionConfig, VisionTokens};
pub use grid::Grid;

use crate::error::{Error, Result};
use crate::schema::vision::VisionSchema;
use crate::taps::Taps;
use crate::weights::WeightStore;
use block::{Affine, Merger, VisionBlock};
use candle_core::{DType, Tensor};

/// Tap names of the vision tower.
pub mod names {
    /// The patch embedding's output `[N, Hv]` (before the position table is added).
    pub const PATCH_EMBED: &str = "vision.patch_embed";
    /// The resampled learned position table `[N, Hv]`.
    pub const POS_EMBED: &str = "vision.pos_embed";
    /// The merger's output `[N / m², H]`.
    pub const MERGER: &str = "vision.merger";

    /// The output `[N, Hv]` of block `i`.
    pub fn block(i: usize) -> String {
        format!("vision.blocks.{i}.output")
    }

    /// Block `i`'s scaled attention scores before the softmax, each image's (or frame's) `[heads, L, L]` flattened
    /// and the images side by side: `[heads, Σ L²]` (recorded by [`super::VisionTower::with_attention_scores`]).
    pub fn attention_scores(i: usize) -> String {
        format!("vision.blocks.{i}.attention_scores")
    }

    /// Block `i`'s MLP input to its GELU (`fc1`'s output) `[N, I]`.
    pub fn gelu_input(i: usize) -> String {
        format!("vision.blocks.{i}.gelu_input")
    }
}

/// The vision tower with its weights.
#[derive(Debug)]
pub struct VisionTower {
    config: VisionConfig,
    patch_embed: Affine,
    pos_embed: Tensor,
    blocks: Vec<VisionBlock>,
    merger: Merger,
    dtype: DType,
    scores: bool,
}

impl VisionTower {
    /// Reads the tower's weights (`model.visual.*`) from `w`, in its dtype.
    pub fn load(config: VisionConfig, w: &WeightStore) -> Result<Self> {
        let s = VisionSchema::new(&config);
        let patch_embed = Affine::load(w, &[s.patch_weight(), s.patch_bias()])?;
        let pos_embed = w.vision_tensor(&s.pos_embed())?;
        let blocks = (0..config.depth)
            .map(|i| VisionBlock::load(w, &config, i))
            .collect::<Result<_>>()?;
        let merger = Merger::load(w, &config)?;
        Ok(VisionTower {
            config,
            patch_embed,
            pos_embed,
            blocks,
            merger,
            dtype: w.dtype(),
            scores: false,
        })
    }

    /// The tower recording each block's attention scores too when its taps are on
    /// ([`names::attention_scores`]: `[heads, Σ L²]`, the square of the patches, so only the range report asks).
    pub fn with_attention_scores(mut self) -> Self {
        self.scores = true;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// The merged tokens `[Σ tokens, H]` of `pixels` `[Σ patches, C·Tp·P·P]` (the processor's `pixel_values`, every
    /// image and video of a prompt in order), whose grids are `grids`.
    pub fn forward(&self, pixels: &Tensor, grids: &[Grid], taps: &mut Taps) -> Result<Tensor> {
        let c = &self.config;
        let merge = c.spatial_merge_size;
        for g in grids {
            g.check(merge)?;
        }
        let patches: usize = grids.iter().map(Grid::patches).sum();
        let (rows, cols) = pixels.dims2().map_err(|_| {
            Error::Input(format!(
                "pixel values of shape {:?}: expected [patches, {}]",
                pixels.dims(),
                c.patch_dim()
            ))
        })?;
        if rows != patches || cols != c.patch_dim() {
            return Err(Error::Input(format!(
                "pixel values [{rows}, {cols}] for grids {grids:?}: expected [{patches}, {}] ({} patches of \
                 {} x {} x {}x{} values)",
                c.patch_dim(),
                patches,
                c.in_channels,
                c.temporal_patch_size,
                c.patch_size,
                c.patch_size
            )));
        }
        let pixels = pixels.to_dtype(self.dtype)?;
        let embedded = self.patch_embed.forward(&pixels)?;
        taps.record(|| names::PATCH_EMBED.into(), &embedded)?;
        let table = grid::resample_table(&self.pos_embed, grids, c.grid_side(), merge)?;
        taps.record(|| names::POS_EMBED.into(), &table)?;
        let mut h = (embedded + table)?;
        let rotary = grid::rotary(grids, merge, c.head_dim(), c.rope_theta, self.dtype)?;
        let spans = grid::attention_spans(grids);
        for (i, block) in self.blocks.iter().enumerate() {
            h = block.forward(&h, &rotary, &spans, taps, i, self.scores)?;
            taps.record(|| names::block(i), &h)?;
        }
        let merged = self.merger.forward(&h)?;
        taps.record(|| names::MERGER.into(), &merged)?;
        Ok(merged)
    }
}
