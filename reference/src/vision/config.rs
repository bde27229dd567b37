//! The vision tower's configuration: a full checkpoint's `vision_config` and the top-level ids of the tokens that
//! mark images and videos in a prompt.

use crate::config::Fields;
use crate::error::{Error, Result};
use serde_json::Value;
use std::path::Path;

/// transformers' `rope_theta` for the vision tower's axial rotary embedding when `vision_config` has no
/// `rope_parameters` (the released checkpoints' configs have none; `Qwen3_5VisionConfig` then standardises to
/// `{"rope_type": "axial", "rope_theta": 10000.0}`).
pub const DEFAULT_VISION_ROPE_THETA: f64 = 10000.0;

/// The ids of the tokens that carry images and videos in a prompt (top level of a full checkpoint's config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VisionTokens {
    /// `image_token_id`: one per merged image token; the merger's rows replace their embeddings.
    pub image: u32,
    /// `video_token_id`: the same for a video's frames.
    pub video: u32,
    /// `vision_start_token_id`.
    pub start: u32,
    /// `vision_end_token_id`.
    pub end: u32,
}

/// `vision_config` (transformers' `Qwen3_5VisionConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// Number of ViT blocks (`depth`).
    pub depth: usize,
    /// Width of the blocks.
    pub hidden_size: usize,
    /// Inner width of the blocks' MLP.
    pub intermediate_size: usize,
    /// Attention heads; the head dimension is `hidden_size / num_heads`.
    pub num_heads: usize,
    /// Colour channels of a pixel (3).
    pub in_channels: usize,
    /// Side of a square patch in pixels.
    pub patch_size: usize,
    /// Frames per patch (an image is repeated to fill them).
    pub temporal_patch_size: usize,
    /// Side of the square of patches the merger folds into one token.
    pub spatial_merge_size: usize,
    /// Width of the merger's output: the text decoder's hidden size.
    pub out_hidden_size: usize,
    /// Rows of the learned position table, a square number (its side is the grid it was trained on).
    pub num_position_embeddings: usize,
    /// Base of the axial rotary embedding.
    pub rope_theta: f64,
    /// The prompt's vision token ids.
    pub tokens: VisionTokens,
}

impl VisionConfig {
    /// The vision tower of the checkpoint whose `config.json` is `path`; `None` for a text-only config
    /// (`model_type: qwen3_5_text`, or no `vision_config`).
    pub fn from_file(path: &Path) -> Result<Option<Self>> {
        let text = crate::inputs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// [`VisionConfig::from_file`] on the file's text; `source` names the file in errors.
    pub fn from_json_str(text: &str, source: &str) -> Result<Option<Self>> {
        let value: Value = serde_json::from_str(text).map_err(|e| Error::File {
            file: source.to_string(),
            message: format!("not valid JSON: {e}"),
        })?;
        let Some(top) = value.as_object() else {
            return Err(Error::File {
                file: source.to_string(),
                message: "expected a JSON object".into(),
            });
        };
        let outer = Fields {
            file: source.to_string(),
            prefix: "",
            map: top,
        };
        if !top.contains_key("vision_config") {
            return Ok(None);
        }
        let f = Fields {
            file: source.to_string(),
            prefix: "vision_config.",
            map: outer.object("vision_config")?,
        };
        if let Some(act) = f.map.get("hidden_act")
            && act.as_str() != Some("gelu_pytorch_tanh")
        {
            return Err(f.err(
                "hidden_act",
                format!("Qwen3.5's vision blocks use \"gelu_pytorch_tanh\"; found {act}"),
            ));
        }
        match f.map.get("deepstack_visual_indexes") {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(v) => {
                return Err(f.err(
                    "deepstack_visual_indexes",
                    format!("Qwen3.5 has no deepstack mergers (that is Qwen3-VL); found {v}"),
                ));
            }
        }
        let rope_theta = match f.map.get("rope_parameters") {
            None | Some(Value::Null) => DEFAULT_VISION_ROPE_THETA,
            Some(_) => {
                let r = Fields {
                    file: source.to_string(),
                    prefix: "vision_config.rope_parameters.",
                    map: f.object("rope_parameters")?,
                };
                if let Some(t) = r.map.get("rope_type")
                    && t.as_str() != Some("axial")
                {
                    return Err(r.err(
                        "rope_type",
                        format!("the vision tower's rotary embedding is \"axial\"; found {t}"),
                    ));
                }
                r.f64("rope_theta")?
            }
        };
        let id = |key: &str| -> Result<u32> {
            let v = outer.usize(key)?;
            u32::try_from(v).map_err(|_| outer.err(key, "too large for a token id"))
        };
        let config = VisionConfig {
            depth: f.usize("depth")?,
            hidden_size: f.usize("hidden_size")?,
            intermediate_size: f.usize("intermediate_size")?,
            num_heads: f.usize("num_heads")?,
            in_channels: f.usize("in_channels")?,
            patch_size: f.usize("patch_size")?,
            temporal_patch_size: f.usize("temporal_patch_size")?,
            spatial_merge_size: f.usize("spatial_merge_size")?,
            out_hidden_size: f.usize("out_hidden_size")?,
            num_position_embeddings: f.usize("num_position_embeddings")?,
            rope_theta,
            tokens: VisionTokens {
                image: id("image_token_id")?,
                video: id("video_token_id")?,
                start: id("vision_start_token_id")?,
                end: id("vision_end_token_id")?,
            },
        };
        if !config.hidden_size.is_multiple_of(config.num_heads) {
            return Err(f.err(
                "num_heads",
                format!(
                    "{} does not divide hidden_size {}",
                    config.num_heads, config.hidden_size
                ),
            ));
        }
        if !config.head_dim().is_multiple_of(4) {
            return Err(f.err(
                "num_heads",
                format!(
                    "the head dimension {} must be a multiple of 4 (axial rotary: half for rows, half for \
                     columns, each rotated in pairs)",
                    config.head_dim()
                ),
            ));
        }
        let side = config.grid_side();
        if side * side != config.num_position_embeddings {
            return Err(f.err(
                "num_position_embeddings",
                format!(
                    "{} is not a square number (the learned table is a square grid)",
                    config.num_position_embeddings
                ),
            ));
        }
        if side < 2 {
            return Err(f.err(
                "num_position_embeddings",
                "the learned grid must be at least 2x2 to be resampled",
            ));
        }
        Ok(Some(config))
    }

    /// The attention head dimension.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// The side of the learned position grid (`sqrt(num_position_embeddings)`).
    pub fn grid_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt().round() as usize
    }

    /// The values of one patch: `in_channels · temporal_patch_size · patch_size²`.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Patches per merged token (`spatial_merge_size²`).
    pub fn merge_unit(&self) -> usize {
        self.spatial_merge_size * self.spatial_merge_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn full() -> Value {
        json!({
            "model_type": "qwen3_5",
            "image_token_id": 514, "video_token_id": 515,
            "vision_start_token_id": 512, "vision_end_token_id": 513,
            "vision_config": {
                "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3,
                "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64,
                "num_position_embeddings": 36, "hidden_act": "gelu_pytorch_tanh"
            }
        })
    }

    fn parse(v: &Value) -> Result<Option<VisionConfig>> {
        VisionConfig::from_json_str(&v.to_string(), "config.json")
    }

    fn expect_err(v: Value, key: &str) {
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains(key), "{key}: {e}");
    }

    #[test]
    fn reads_the_tower_and_the_token_ids() {
        let c = parse(&full()).unwrap().unwrap();
        assert_eq!((c.head_dim(), c.grid_side(), c.patch_dim()), (16, 6, 96));
        assert_eq!(c.rope_theta, DEFAULT_VISION_ROPE_THETA);
        assert_eq!(c.tokens.image, 514);
        let mut v = full();
        v["vision_config"]["rope_parameters"] = json!({"rope_type": "axial", "rope_theta": 500.0});
        assert_eq!(parse(&v).unwrap().unwrap().rope_theta, 500.0);
        assert_eq!(parse(&json!({"model_type": "qwen3_5_text"})).unwrap(), None);
    }

    #[test]
    fn rejects_what_the_tower_cannot_be() {
        let mut v = full();
        v["vision_config"].as_object_mut().unwrap().remove("depth");
        expect_err(v, "vision_config.depth");
        let mut v = full();
        v.as_object_mut().unwrap().remove("image_token_id");
        expect_err(v, "image_token_id");
        let mut v = full();
        v["vision_config"]["num_position_embeddings"] = json!(40);
        expect_err(v, "vision_config.num_position_embeddings");
        let mut v = full();
        v["vision_config"]["num_heads"] = json!(3);
        expect_err(v, "vision_config.num_heads");
        let mut v = full();
        v["vision_config"]["deepstack_visual_indexes"] = json!([1, 2]);
        expect_err(v, "deepstack_visual_indexes");
        let mut v = full();
        v["vision_config"]["hidden_act"] = json!("gelu");
        expect_err(v, "vision_config.hidden_act");
        let mut v = full();
        v["vision_config"]["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 1.0});
        expect_err(v, "vision_config.rope_parameters.rope_type");
    }
}
