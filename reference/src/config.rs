//! The decoder configuration, read from a checkpoint's `config.json`.
//!
//! Two forms are accepted: a real checkpoint's (`model_type: qwen3_5`, the decoder under `text_config`) and a
//! text-only export's (`model_type: qwen3_5_text`, fields at top level); the MoE decoder (Qwen3.5-35B-A3B,
//! transformers' `Qwen3_5MoeTextConfig`) in the same two forms, `qwen3_5_moe` and `qwen3_5_moe_text`. Every field the
//! decoder depends on is read and checked; nothing numeric has a default in code.

use crate::error::{Error, Result};
use serde_json::{Map, Value};
use std::path::Path;

mod moe;
pub use moe::MoeConfig;

/// The kind of token mixer a layer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet linear attention (`linear_attention`).
    Linear,
    /// Gated full attention with partial RoPE (`full_attention`).
    Full,
}

impl LayerKind {
    /// The name used in `layer_types`.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::Linear => "linear_attention",
            LayerKind::Full => "full_attention",
        }
    }
}

/// Rotary position embedding parameters (`rope_parameters`).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// The base `theta`.
    pub theta: f64,
    /// The fraction of the head dimension that is rotated.
    pub partial_rotary_factor: f64,
    /// Sizes of the temporal/height/width frequency sections (interleaved MRoPE), summing to `rotary_dim / 2`.
    /// Absent in configs without multimodal positions; text positions never need it.
    pub mrope_section: Option<[usize; 3]>,
}

/// The text decoder's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Model width.
    pub hidden_size: usize,
    /// The dense MLP's inner width; 0 in an MoE decoder, which has no dense MLP (see [`Config::moe`]).
    pub intermediate_size: usize,
    /// The MoE block every layer has in place of the dense MLP (`model_type` `qwen3_5_moe`/`qwen3_5_moe_text`).
    pub moe: Option<MoeConfig>,
    /// The mixer kind of every layer.
    pub layer_types: Vec<LayerKind>,
    /// Full-attention query heads.
    pub num_attention_heads: usize,
    /// Full-attention key/value heads.
    pub num_key_value_heads: usize,
    /// Full-attention head dimension.
    pub head_dim: usize,
    /// Linear-attention key heads (`Hk`).
    pub linear_num_key_heads: usize,
    /// Linear-attention value heads (`Hv`), a multiple of `Hk`.
    pub linear_num_value_heads: usize,
    /// Linear-attention key head dimension (`Dk`).
    pub linear_key_head_dim: usize,
    /// Linear-attention value head dimension (`Dv`).
    pub linear_value_head_dim: usize,
    /// Depthwise causal convolution width (`K`).
    pub linear_conv_kernel_dim: usize,
    /// Epsilon of every RMSNorm and of the gated norm.
    pub rms_norm_eps: f64,
    /// Vocabulary size (rows of the embedding and the LM head).
    pub vocab_size: usize,
    /// The most positions a sequence may hold (`max_position_embeddings`): prompts and generations past it are
    /// refused by the commands, never run.
    pub max_position_embeddings: usize,
    /// Whether the LM head is the embedding matrix.
    pub tie_word_embeddings: bool,
    /// RoPE parameters.
    pub rope: RopeConfig,
    /// End-of-sequence token ids listed in the config (may be empty).
    pub eos_token_ids: Vec<u32>,
    /// Whether the file was a full (nested, multimodal) checkpoint config.
    pub nested: bool,
}

/// The fields of one JSON object of a config file, with the path of their keys for errors.
pub(crate) struct Fields<'a> {
    pub(crate) file: String,
    pub(crate) prefix: &'a str,
    pub(crate) map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    pub(crate) fn err(&self, key: &str, message: impl Into<String>) -> Error {
        Error::Config {
            file: self.file.clone(),
            key: format!("{}{}", self.prefix, key),
            message: message.into(),
        }
    }

    pub(crate) fn get(&self, key: &str) -> Result<&'a Value> {
        self.map.get(key).ok_or_else(|| {
            self.err(
                key,
                "missing (required by the decoder, no default is assumed)",
            )
        })
    }

    pub(crate) fn usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key)?;
        let n = v
            .as_u64()
            .ok_or_else(|| self.err(key, format!("expected a non-negative integer, found {v}")))?;
        if n == 0 {
            return Err(self.err(key, "must be positive"));
        }
        usize::try_from(n).map_err(|_| self.err(key, "too large"))
    }

    pub(crate) fn f64(&self, key: &str) -> Result<f64> {
        let v = self.get(key)?;
        v.as_f64()
            .ok_or_else(|| self.err(key, format!("expected a number, found {v}")))
    }

    pub(crate) fn bool(&self, key: &str) -> Result<bool> {
        let v = self.get(key)?;
        v.as_bool()
            .ok_or_else(|| self.err(key, format!("expected true or false, found {v}")))
    }

    pub(crate) fn object(&self, key: &str) -> Result<&'a Map<String, Value>> {
        let v = self.get(key)?;
        v.as_object()
            .ok_or_else(|| self.err(key, format!("expected an object, found {v}")))
    }
}

impl Config {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = crate::inputs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Parses and validates a config; `source` names the file in errors.
    pub fn from_json_str(text: &str, source: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| Error::File {
            file: source.to_string(),
            message: format!("not valid JSON: {e}"),
        })?;
        let top = value.as_object().ok_or_else(|| Error::File {
            file: source.to_string(),
            message: "expected a JSON object".into(),
        })?;
        let outer = Fields {
            file: source.to_string(),
            prefix: "",
            map: top,
        };
        let model_type = outer
            .get("model_type")?
            .as_str()
            .ok_or_else(|| outer.err("model_type", "expected a string"))?;
        match model_type {
            "qwen3_5" | "qwen3_5_moe" => {
                let inner = Fields {
                    file: source.to_string(),
                    prefix: "text_config.",
                    map: outer.object("text_config")?,
                };
                let moe = moe::nested_text_type(&inner, model_type)?;
                Self::from_fields(&inner, Some(&outer), moe)
            }
            "qwen3_5_text" => Self::from_fields(&outer, None, false),
            "qwen3_5_moe_text" => Self::from_fields(&outer, None, true),
            other => Err(outer.err(
                "model_type",
                format!(
                    "`{other}` is not a Qwen3.5 decoder (expected `qwen3_5`, `qwen3_5_text`, `qwen3_5_moe` or \
                     `qwen3_5_moe_text`)"
                ),
            )),
        }
    }

    fn from_fields(f: &Fields, outer: Option<&Fields>, moe: bool) -> Result<Self> {
        let moe = moe::fields(f, moe)?;
        let num_hidden_layers = f.usize("num_hidden_layers")?;
        let layer_types = match f.map.get("layer_types") {
            Some(Value::Array(items)) => {
                let kinds = items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| match v.as_str() {
                        Some("linear_attention") => Ok(LayerKind::Linear),
                        Some("full_attention") => Ok(LayerKind::Full),
                        _ => Err(f.err(
                            &format!("layer_types[{i}]"),
                            format!("unknown layer type {v} (expected \"linear_attention\" or \"full_attention\")"),
                        )),
                    })
                    .collect::<Result<Vec<_>>>()?;
                if kinds.len() != num_hidden_layers {
                    return Err(f.err(
                        "layer_types",
                        format!(
                            "lists {} layers but num_hidden_layers is {num_hidden_layers}",
                            kinds.len()
                        ),
                    ));
                }
                kinds
            }
            Some(v) => return Err(f.err("layer_types", format!("expected a list, found {v}"))),
            None => {
                if !f.map.contains_key("full_attention_interval") {
                    return Err(f.err(
                        "layer_types",
                        "missing, and so is full_attention_interval: the layer kinds cannot be derived",
                    ));
                }
                let interval = f.usize("full_attention_interval")?;
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerKind::Full
                        } else {
                            LayerKind::Linear
                        }
                    })
                    .collect()
            }
        };

        if let Some(act) = f.map.get("hidden_act")
            && act.as_str() != Some("silu")
        {
            return Err(f.err(
                "hidden_act",
                format!("only \"silu\" is supported, found {act}"),
            ));
        }
        if let Some(bias) = f.map.get("attention_bias")
            && bias.as_bool() != Some(false)
        {
            return Err(f.err(
                "attention_bias",
                format!("Qwen3.5 attention has no bias; found {bias}"),
            ));
        }

        let tie_word_embeddings = match (f.map.get("tie_word_embeddings"), outer) {
            (Some(_), Some(o)) if o.map.contains_key("tie_word_embeddings") => {
                let inner = f.bool("tie_word_embeddings")?;
                let top = o.bool("tie_word_embeddings")?;
                if inner != top {
                    return Err(f.err(
                        "tie_word_embeddings",
                        format!("is {inner} but the top-level tie_word_embeddings is {top}"),
                    ));
                }
                inner
            }
            (Some(_), _) => f.bool("tie_word_embeddings")?,
            (None, Some(o)) => o.bool("tie_word_embeddings")?,
            (None, None) => f.bool("tie_word_embeddings")?,
        };

        let rope_fields = Fields {
            file: f.file.clone(),
            prefix: if f.prefix.is_empty() {
                "rope_parameters."
            } else {
                "text_config.rope_parameters."
            },
            map: f.object("rope_parameters")?,
        };
        if let Some(t) = rope_fields.map.get("rope_type")
            && t.as_str() != Some("default")
        {
            return Err(rope_fields.err(
                "rope_type",
                format!("only \"default\" RoPE is supported, found {t}"),
            ));
        }
        if let Some(v) = rope_fields.map.get("mrope_interleaved")
            && v.as_bool() != Some(true)
        {
            return Err(rope_fields.err(
                "mrope_interleaved",
                format!("Qwen3.5 interleaves its MRoPE sections; found {v}"),
            ));
        }
        let mrope_section = match rope_fields.map.get("mrope_section") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) if a.len() == 3 && a.iter().all(|x| x.as_u64().is_some()) => {
                Some([
                    a[0].as_u64().unwrap_or_default() as usize,
                    a[1].as_u64().unwrap_or_default() as usize,
                    a[2].as_u64().unwrap_or_default() as usize,
                ])
            }
            Some(v) => {
                return Err(rope_fields.err(
                    "mrope_section",
                    format!("expected three non-negative integers, found {v}"),
                ));
            }
        };
        let rope = RopeConfig {
            theta: rope_fields.f64("rope_theta")?,
            partial_rotary_factor: rope_fields.f64("partial_rotary_factor")?,
            mrope_section,
        };

        let eos_key = if f.map.contains_key("eos_token_id") {
            f
        } else {
            outer.unwrap_or(f)
        };
        let as_id = |v: &Value| -> Result<u32> {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| eos_key.err("eos_token_id", format!("{v} is not a token id")))
        };
        let eos_token_ids = match eos_key.map.get("eos_token_id") {
            None | Some(Value::Null) => vec![],
            Some(Value::Array(a)) => a.iter().map(as_id).collect::<Result<_>>()?,
            Some(v) => vec![as_id(v)?],
        };

        let config = Config {
            hidden_size: f.usize("hidden_size")?,
            intermediate_size: moe::dense_width(f, moe.as_ref())?,
            moe,
            layer_types,
            num_attention_heads: f.usize("num_attention_heads")?,
            num_key_value_heads: f.usize("num_key_value_heads")?,
            head_dim: f.usize("head_dim")?,
            linear_num_key_heads: f.usize("linear_num_key_heads")?,
            linear_num_value_heads: f.usize("linear_num_value_heads")?,
            linear_key_head_dim: f.usize("linear_key_head_dim")?,
            linear_value_head_dim: f.usize("linear_value_head_dim")?,
            linear_conv_kernel_dim: f.usize("linear_conv_kernel_dim")?,
            rms_norm_eps: f.f64("rms_norm_eps")?,
            vocab_size: f.usize("vocab_size")?,
            max_position_embeddings: f.usize("max_position_embeddings")?,
            tie_word_embeddings,
            rope,
            eos_token_ids,
            nested: outer.is_some(),
        };
        config.validate(f)?;
        Ok(config)
    }

    fn validate(&self, f: &Fields) -> Result<()> {
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(f.err(
                "num_key_value_heads",
                format!(
                    "{} query heads are not a multiple of {} key/value heads",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if !self
            .linear_num_value_heads
            .is_multiple_of(self.linear_num_key_heads)
        {
            return Err(f.err(
                "linear_num_value_heads",
                format!(
                    "{} value heads are not a multiple of {} key heads",
                    self.linear_num_value_heads, self.linear_num_key_heads
                ),
            ));
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0) {
            return Err(f.err(
                "rms_norm_eps",
                format!("{} is not in (0, 1)", self.rms_norm_eps),
            ));
        }
        let rope_key = |k: &str| format!("rope_parameters.{k}");
        if self.rope.theta.is_nan() || self.rope.theta <= 1.0 || !self.rope.theta.is_finite() {
            return Err(f.err(
                &rope_key("rope_theta"),
                format!("{} must be > 1", self.rope.theta),
            ));
        }
        let p = self.rope.partial_rotary_factor;
        let rd = self.head_dim as f64 * p;
        if p.is_nan()
            || p <= 0.0
            || p > 1.0
            || rd.fract() != 0.0
            || !(rd as usize).is_multiple_of(2)
        {
            return Err(f.err(
                &rope_key("partial_rotary_factor"),
                format!(
                    "{p} times head_dim {} must give an even number of rotary dimensions in 2..=head_dim",
                    self.head_dim
                ),
            ));
        }
        if let Some(s) = self.rope.mrope_section
            && s.iter().sum::<usize>() != self.rotary_dim() / 2
        {
            return Err(f.err(
                &rope_key("mrope_section"),
                format!(
                    "{s:?} sums to {} but rotary_dim / 2 is {}",
                    s.iter().sum::<usize>(),
                    self.rotary_dim() / 2
                ),
            ));
        }
        if let Some(&id) = self
            .eos_token_ids
            .iter()
            .find(|&&id| id as usize >= self.vocab_size)
        {
            return Err(f.err(
                "eos_token_id",
                format!("{id} is outside the vocabulary of {}", self.vocab_size),
            ));
        }
        Ok(())
    }

    /// Checks that every id is inside the vocabulary.
    pub fn check_token_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().position(|&id| id as usize >= self.vocab_size) {
            Some(i) => Err(Error::Input(format!(
                "token id {} at position {i} is outside the vocabulary of {}",
                ids[i], self.vocab_size
            ))),
            None => Ok(()),
        }
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }

    /// Rotated dimensions per attention head (`head_dim * partial_rotary_factor`).
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.rope.partial_rotary_factor) as usize
    }

    /// Width of the query (and of the key) part of `in_proj_qkv`: `Hk * Dk`.
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }

    /// Width of the value part of `in_proj_qkv`: `Hv * Dv`.
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Channels of the causal convolution: `2 Hk Dk + Hv Dv`.
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn flat() -> Value {
        serde_json::json!({
            "model_type": "qwen3_5_text",
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 24, "linear_conv_kernel_dim": 4,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "vocab_size": 300, "tie_word_embeddings": false,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": true}
        })
    }

    pub(super) fn parse(v: &Value) -> Result<Config> {
        Config::from_json_str(&v.to_string(), "config.json")
    }

    #[test]
    fn flat_and_nested_forms_agree() {
        let a = parse(&flat()).unwrap();
        let nested = serde_json::json!({
            "model_type": "qwen3_5", "tie_word_embeddings": false,
            "text_config": flat(), "vision_config": {"depth": 1}
        });
        let mut b = parse(&nested).unwrap();
        assert!(b.nested);
        b.nested = false;
        assert_eq!(a, b);
        assert_eq!(a.rotary_dim(), 8);
        assert_eq!(a.linear_conv_dim(), 2 * 32 + 96);
    }

    #[test]
    fn layer_types_derived_from_interval() {
        let mut v = flat();
        let m = v.as_object_mut().unwrap();
        m.remove("layer_types");
        m.insert("full_attention_interval".into(), 2.into());
        let c = parse(&v).unwrap();
        assert_eq!(
            c.layer_types,
            vec![
                LayerKind::Linear,
                LayerKind::Full,
                LayerKind::Linear,
                LayerKind::Full
            ]
        );
    }

    pub(super) fn expect_err(v: Value, needle: &str) {
        let e = parse(&v).unwrap_err().to_string();
        assert!(
            e.contains(needle),
            "error `{e}` does not mention `{needle}`"
        );
        assert!(
            e.starts_with("config.json"),
            "error `{e}` does not name the file"
        );
    }

    #[test]
    fn missing_and_inconsistent_fields_are_named() {
        let mut v = flat();
        v.as_object_mut().unwrap().remove("rms_norm_eps");
        expect_err(v, "rms_norm_eps");

        let mut v = flat();
        v["linear_num_value_heads"] = 3.into();
        expect_err(v, "linear_num_value_heads");

        let mut v = flat();
        v["num_key_value_heads"] = 3.into();
        expect_err(v, "num_key_value_heads");

        let mut v = flat();
        v["layer_types"][1] = "mamba".into();
        expect_err(v, "layer_types[1]");

        let mut v = flat();
        v["num_hidden_layers"] = 5.into();
        expect_err(v, "layer_types");

        let mut v = flat();
        v["rope_parameters"]["mrope_section"] = serde_json::json!([2, 2, 2]);
        expect_err(v, "mrope_section");

        let mut v = flat();
        v["rope_parameters"]["partial_rotary_factor"] = 0.3.into();
        expect_err(v, "partial_rotary_factor");

        let mut v = flat();
        v["model_type"] = "llama".into();
        expect_err(v, "model_type");

        let mut v = flat();
        v["eos_token_id"] = serde_json::json!([3, -1]);
        expect_err(v, "eos_token_id");

        let mut v = flat();
        v.as_object_mut().unwrap().remove("layer_types");
        v["full_attention_interval"] = 0.into();
        expect_err(v, "full_attention_interval");

        let mut v = flat();
        v.as_object_mut().unwrap().remove("tie_word_embeddings");
        expect_err(v, "tie_word_embeddings");

        let nested = serde_json::json!({
            "model_type": "qwen3_5", "tie_word_embeddings": true, "text_config": flat()
        });
        expect_err(nested, "text_config.tie_word_embeddings");
    }
}
