//! A Qwen3.5 GGUF (llama.cpp's architectures `qwen35`, dense, and `qwen35moe`) as the checkpoint it was converted
//! from: the [`Config`] from the file's metadata ([`config`]), and every tensor under the checkpoint's name, in its
//! shape and layout ([`checkpoint_tensors`]), so that the weight store serves a GGUF exactly as it serves the
//! safetensors checkpoint (see [`crate::weights`]).
//!
//! # What llama.cpp's converter does, undone here (and only here: [`layout`])
//!
//! `convert_hf_to_gguf.py` (`Qwen3_5TextModel` / `Qwen3_5MoeTextModel` over `_LinearAttentionVReorderBase` and
//! `Qwen3NextModel`) changes these tensors; each change has its inverse in [`layout`] and a unit test:
//!
//! | checkpoint | GGUF | change |
//! |---|---|---|
//! | every `[a, b]` weight | `ne = [b, a]` | none to the bytes: GGUF lists dimensions fastest first |
//! | `linear_attn.in_proj_qkv` | `attn_qkv` | the value rows' heads reordered, grouped → tiled (when `Hk ≠ Hv`) |
//! | `linear_attn.in_proj_z` | `attn_gate` | rows reordered by value head |
//! | `linear_attn.in_proj_a`, `in_proj_b` | `ssm_alpha`, `ssm_beta` | rows reordered by value head |
//! | `linear_attn.A_log` | `ssm_a` | `-exp(A_log)`, and reordered by value head |
//! | `linear_attn.dt_bias` | `ssm_dt.bias` | reordered by value head |
//! | `linear_attn.conv1d.weight` `[C, 1, K]` | `ssm_conv1d.weight` `ne = [K, C]` | squeezed; the value channels reordered |
//! | `linear_attn.out_proj` | `ssm_out` | columns reordered by value head |
//! | `input_layernorm`, `post_attention_layernorm`, `norm`, `q_norm`, `k_norm` | `attn_norm`, ... | `+ 1` |
//! | `mlp.experts.{e}.{gate,up,down}_proj` | `ffn_{gate,up,down}_exps` `ne = [in, out, E]` | stacked |
//!
//! Unchanged: `linear_attn.norm` (`ssm_norm`, the gated norm's plain weight: no `+ 1`), the full attention's
//! `q_proj` (`attn_q`: the query and its gate stay interleaved per head, `[Hq · 2 · D, H]`), `k_proj`, `v_proj`,
//! `o_proj`, the MLPs, the router (`ffn_gate_inp`), the shared expert and its gate (`ffn_gate_inp_shexp`,
//! `[1, H]`; a file `llama-quantize` wrote holds the gate 1-D, `[H]`, read as `[1, H]`). Qwen3.5 splits its in-projections (`in_proj_qkv`, `in_proj_z`, `in_proj_a`, `in_proj_b`); the fused
//! `in_proj_qkvz`/`in_proj_ba` of Qwen3-Next (`qwen3next`) are not this architecture and are refused.
//!
//! Bits: the reorders, the split of the experts and the squeeze move values unchanged. `(1 + w)` rounded is `g`,
//! and `1 + (g - 1)` is `g` again, so an f32 run's norm scales are the GGUF's exactly. `A_log` is the f32 whose
//! `-exp` (as the reference computes it) is `ssm_a` itself when one exists (it is searched for among the
//! neighbours of `ln(-ssm_a)`), so the reference decays by exactly the value llama.cpp reads; it can differ from
//! the checkpoint's own `-exp(A_log)` by the last bit of torch's `exp` against Rust's.

use super::file::{GgufFile, TensorInfo, Value};
use crate::config::Config;
use crate::error::{Error, Result};
use serde_json::{Map, json};

/// The architectures read (`general.architecture`), and whether each is the MoE decoder.
pub const ARCHITECTURES: [(&str, bool); 2] = [("qwen35", false), ("qwen35moe", true)];

/// The architecture of a GGUF file: `qwen35` or `qwen35moe`; anything else is an error naming the key.
pub fn architecture(file: &GgufFile) -> Result<(&'static str, bool)> {
    let key = "general.architecture";
    let arch = match file.get(key) {
        Some(Value::String(s)) => s.as_str(),
        Some(v) => {
            return Err(meta_err(
                file,
                key,
                format!("a {}, not a string", v.type_name()),
            ));
        }
        None => return Err(meta_err(file, key, "missing".into())),
    };
    ARCHITECTURES
        .iter()
        .find(|(name, _)| *name == arch)
        .copied()
        .ok_or_else(|| {
            meta_err(
                file,
                key,
                format!(
                    "`{arch}` is not a Qwen3.5 decoder (expected `qwen35` or `qwen35moe`{})",
                    if arch == "qwen3next" {
                        "; Qwen3-Next's fused projections are another model"
                    } else {
                        ""
                    }
                ),
            )
        })
}

fn meta_err(file: &GgufFile, key: &str, message: String) -> Error {
    Error::Config {
        file: file.path().display().to_string(),
        key: key.to_string(),
        message,
    }
}

/// Reads the metadata the math needs, each key required (a missing one is an error naming it, never a default).
struct Meta<'a> {
    file: &'a GgufFile,
    arch: &'static str,
}

impl Meta<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    fn value(&self, key: &str) -> Result<&Value> {
        self.file.get(key).ok_or_else(|| {
            meta_err(
                self.file,
                key,
                "missing (required by the decoder, no default is assumed)".into(),
            )
        })
    }

    fn usize(&self, suffix: &str) -> Result<usize> {
        let key = self.key(suffix);
        let v = self.value(&key)?;
        v.as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| {
                meta_err(
                    self.file,
                    &key,
                    format!("a {} is not a count", v.type_name()),
                )
            })
    }

    /// A float the converter wrote as f32 from the config's decimal: the shortest decimal that rounds to it, so
    /// that `1e-06` comes back as the f64 `1e-06` the checkpoint's config gives, not `9.99999997e-07`.
    fn f64(&self, suffix: &str) -> Result<f64> {
        let key = self.key(suffix);
        match self.value(&key)? {
            Value::F32(x) => Ok(format!("{x}").parse().unwrap_or(f64::from(*x))),
            Value::F64(x) => Ok(*x),
            v => Err(meta_err(
                self.file,
                &key,
                format!("a {}, not a float", v.type_name()),
            )),
        }
    }
}

/// The decoder's config from the file's metadata: every value the math reads, a missing key an error naming it.
/// The config is checked as a `config.json` is (its errors then name the checkpoint key the value became).
pub fn config(file: &GgufFile) -> Result<Config> {
    parse_config(file, config_json(file, None)?)
}

/// The config a `config_json` map holds, checked as a `config.json` is.
pub(crate) fn parse_config(file: &GgufFile, c: Map<String, serde_json::Value>) -> Result<Config> {
    let text = serde_json::Value::Object(c).to_string();
    Config::from_json_str(&text, &file.path().display().to_string())
}

/// The `config.json` the file's metadata makes ([`config`] checks and reads it), `fault` planted in it.
pub(crate) fn config_json(
    file: &GgufFile,
    fault: Option<fault::Fault>,
) -> Result<Map<String, serde_json::Value>> {
    let (arch, moe) = architecture(file)?;
    let m = Meta { file, arch };
    let mut c = Map::new();
    c.insert(
        "model_type".into(),
        json!(if moe {
            "qwen3_5_moe_text"
        } else {
            "qwen3_5_text"
        }),
    );
    let nextn = match file.get(&m.key("nextn_predict_layers")) {
        Some(v) => v.as_u64().unwrap_or(0) as usize,
        None => 0,
    };
    let blocks = m.usize("block_count")?;
    let layers = blocks
        .checked_sub(nextn)
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            meta_err(
                file,
                &m.key("block_count"),
                format!("{blocks} blocks leave no decoder layer after {nextn} MTP layers"),
            )
        })?;
    c.insert("num_hidden_layers".into(), json!(layers));
    let recurrent_key = m.key("attention.recurrent_layers");
    match file.get(&recurrent_key) {
        Some(Value::Array(items)) => {
            let kinds = items
                .iter()
                .take(layers)
                .map(|v| match v {
                    Value::Bool(true) => Ok("linear_attention"),
                    Value::Bool(false) => Ok("full_attention"),
                    other => Err(meta_err(
                        file,
                        &recurrent_key,
                        format!("holds a {}, not bools", other.type_name()),
                    )),
                })
                .collect::<Result<Vec<_>>>()?;
            if kinds.len() != layers {
                return Err(meta_err(
                    file,
                    &recurrent_key,
                    format!(
                        "lists {} layers, fewer than the {layers} decoder layers",
                        kinds.len()
                    ),
                ));
            }
            c.insert("layer_types".into(), json!(kinds));
        }
        Some(v) => {
            return Err(meta_err(
                file,
                &recurrent_key,
                format!("a {}, not an array", v.type_name()),
            ));
        }
        None => {
            let interval = m.usize("full_attention_interval").map_err(|_| {
                meta_err(
                    file,
                    &recurrent_key,
                    format!(
                        "missing, and so is {}: the layer kinds cannot be derived",
                        m.key("full_attention_interval")
                    ),
                )
            })?;
            c.insert("full_attention_interval".into(), json!(interval));
        }
    }
    c.insert("hidden_size".into(), json!(m.usize("embedding_length")?));
    if moe {
        c.insert("num_experts".into(), json!(m.usize("expert_count")?));
        c.insert(
            "num_experts_per_tok".into(),
            json!(m.usize("expert_used_count")?),
        );
        c.insert(
            "moe_intermediate_size".into(),
            json!(m.usize("expert_feed_forward_length")?),
        );
        c.insert(
            "shared_expert_intermediate_size".into(),
            json!(m.usize("expert_shared_feed_forward_length")?),
        );
    } else {
        c.insert(
            "intermediate_size".into(),
            json!(m.usize("feed_forward_length")?),
        );
    }
    c.insert(
        "num_attention_heads".into(),
        json!(m.usize("attention.head_count")?),
    );
    c.insert(
        "num_key_value_heads".into(),
        json!(m.usize("attention.head_count_kv")?),
    );
    let head_dim = m.usize("attention.key_length")?;
    let value_length = m.usize("attention.value_length")?;
    if value_length != head_dim {
        return Err(meta_err(
            file,
            &m.key("attention.value_length"),
            format!(
                "{value_length} differs from attention.key_length {head_dim}: Qwen3.5 has one head dimension"
            ),
        ));
    }
    c.insert("head_dim".into(), json!(head_dim));
    let hv = m.usize("ssm.time_step_rank")?;
    let inner = m.usize("ssm.inner_size")?;
    if hv == 0 || !inner.is_multiple_of(hv) {
        return Err(meta_err(
            file,
            &m.key("ssm.inner_size"),
            format!("{inner} is not a whole number of {hv} value heads (ssm.time_step_rank)"),
        ));
    }
    c.insert(
        "linear_num_key_heads".into(),
        json!(m.usize("ssm.group_count")?),
    );
    c.insert("linear_num_value_heads".into(), json!(hv));
    c.insert(
        "linear_key_head_dim".into(),
        json!(m.usize("ssm.state_size")?),
    );
    c.insert("linear_value_head_dim".into(), json!(inner / hv));
    c.insert(
        "linear_conv_kernel_dim".into(),
        json!(m.usize("ssm.conv_kernel")?),
    );
    c.insert(
        "rms_norm_eps".into(),
        json!(m.f64("attention.layer_norm_rms_epsilon")?),
    );
    c.insert(
        "max_position_embeddings".into(),
        json!(m.usize("context_length")?),
    );
    let embed = tensor(file, "token_embd.weight")?;
    let vocab = match embed.dims.as_slice() {
        [_, rows] => *rows,
        other => {
            return Err(tensor_err(
                file,
                &embed.name,
                format!("is {other:?}, not a matrix"),
            ));
        }
    };
    c.insert("vocab_size".into(), json!(vocab));
    c.insert(
        "tie_word_embeddings".into(),
        json!(file.tensor("output.weight").is_none()),
    );
    let rotary = m.usize("rope.dimension_count")?;
    let mut rope = Map::new();
    rope.insert("rope_theta".into(), json!(m.f64("rope.freq_base")?));
    rope.insert(
        "partial_rotary_factor".into(),
        json!(rotary as f64 / head_dim as f64),
    );
    let sections_key = m.key("rope.dimension_sections");
    if let Some(v) = file.get(&sections_key) {
        let sections: Vec<u64> = match v {
            Value::Array(items) => items.iter().filter_map(Value::as_u64).collect(),
            _ => vec![],
        };
        match sections.as_slice() {
            [t, h, w] | [t, h, w, 0] => {
                rope.insert("mrope_section".into(), json!([t, h, w]));
            }
            _ => {
                return Err(meta_err(
                    file,
                    &sections_key,
                    format!("{v:?} is not three sections (and a fourth of 0)"),
                ));
            }
        }
    }
    c.insert("rope_parameters".into(), serde_json::Value::Object(rope));
    let mut eos = vec![];
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(v) = file.get(key) {
            let id = v.as_u64().ok_or_else(|| {
                meta_err(file, key, format!("a {} is not a token id", v.type_name()))
            })?;
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    c.insert("eos_token_id".into(), json!(eos));
    if let Some(f) = fault {
        f.config(file, &mut c)?;
    }
    Ok(c)
}

fn tensor<'a>(file: &'a GgufFile, name: &str) -> Result<&'a TensorInfo> {
    file.tensor(name)
        .ok_or_else(|| tensor_err(file, name, "missing".into()))
}

fn tensor_err(file: &GgufFile, name: &str, message: String) -> Error {
    Error::Weights {
        file: file.path().display().to_string(),
        key: name.to_string(),
        message,
    }
}

/// One tensor under its checkpoint name (`model.layers.0.linear_attn.A_log`, `lm_head.weight`, ...), in the
/// checkpoint's shape and layout, as f32.
pub struct CheckpointTensor {
    /// The checkpoint's name.
    pub name: String,
    /// The checkpoint's shape (PyTorch order).
    pub shape: Vec<usize>,
    /// The values, row-major.
    pub values: Vec<f32>,
}

/// What a GGUF tensor is in the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Target {
    /// One tensor, `layout` undone.
    One(String, Layout),
    /// The stacked experts `[E, out, in]`, split into `model.layers.{i}.mlp.experts.{e}.{proj}.weight`.
    Experts { layer: usize, proj: &'static str },
    /// An MTP layer's (`blk.N` past the decoder's layers): not read by the reference.
    Skip,
}

/// Which of the converter's changes a tensor went through (see the module's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// None.
    Plain,
    /// A one-row matrix `[1, H]` (the shared expert's gate): the converter writes it `[1, H]` (`ne = [H, 1]`),
    /// `llama-quantize` 1-D `[H]` (ggml counts no trailing dimension of 1, `ggml_n_dims`); the values as they are.
    OneRow,
    /// A zero-centred norm weight: the GGUF holds `1 + w`.
    PlusOne,
    /// `in_proj_qkv`: the value rows after `2·Hk·Dk` query and key rows reordered.
    QkvRows,
    /// Rows reordered by value head, `Dv` rows a head (`in_proj_z`).
    ValueRows,
    /// One row (or element) a value head (`in_proj_a`, `in_proj_b`, `dt_bias`).
    HeadRows,
    /// `ssm_a = -exp(A_log)`, one element a value head.
    Decay,
    /// The convolution: squeezed `[C, K]`, the value channels reordered.
    Conv,
    /// `out_proj`: columns reordered by value head.
    ValueColumns,
}

/// The checkpoint name and layout of a GGUF tensor of a `layers`-layer decoder, or an error naming it.
pub(crate) fn target(name: &str, layers: usize) -> std::result::Result<Target, String> {
    let global = |n: &str, layout| Ok(Target::One(n.to_string(), layout));
    match name {
        "token_embd.weight" => return global("model.embed_tokens.weight", Layout::Plain),
        "output.weight" => return global("lm_head.weight", Layout::Plain),
        "output_norm.weight" => return global("model.norm.weight", Layout::PlusOne),
        _ => {}
    }
    let unknown = || "not a tensor of a Qwen3.5 decoder this reader knows".to_string();
    let rest = name.strip_prefix("blk.").ok_or_else(unknown)?;
    let (layer, key) = rest.split_once('.').ok_or_else(unknown)?;
    let layer: usize = layer.parse().map_err(|_| unknown())?;
    if layer >= layers {
        return Ok(Target::Skip);
    }
    let (checkpoint, layout) = match key {
        "attn_norm.weight" => ("input_layernorm.weight", Layout::PlusOne),
        "post_attention_norm.weight" => ("post_attention_layernorm.weight", Layout::PlusOne),
        "attn_qkv.weight" => ("linear_attn.in_proj_qkv.weight", Layout::QkvRows),
        "attn_gate.weight" => ("linear_attn.in_proj_z.weight", Layout::ValueRows),
        "ssm_alpha.weight" => ("linear_attn.in_proj_a.weight", Layout::HeadRows),
        "ssm_beta.weight" => ("linear_attn.in_proj_b.weight", Layout::HeadRows),
        "ssm_a" => ("linear_attn.A_log", Layout::Decay),
        "ssm_dt.bias" => ("linear_attn.dt_bias", Layout::HeadRows),
        "ssm_conv1d.weight" => ("linear_attn.conv1d.weight", Layout::Conv),
        "ssm_norm.weight" => ("linear_attn.norm.weight", Layout::Plain),
        "ssm_out.weight" => ("linear_attn.out_proj.weight", Layout::ValueColumns),
        "attn_q.weight" => ("self_attn.q_proj.weight", Layout::Plain),
        "attn_k.weight" => ("self_attn.k_proj.weight", Layout::Plain),
        "attn_v.weight" => ("self_attn.v_proj.weight", Layout::Plain),
        "attn_output.weight" => ("self_attn.o_proj.weight", Layout::Plain),
        "attn_q_norm.weight" => ("self_attn.q_norm.weight", Layout::PlusOne),
        "attn_k_norm.weight" => ("self_attn.k_norm.weight", Layout::PlusOne),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", Layout::Plain),
        "ffn_up.weight" => ("mlp.up_proj.weight", Layout::Plain),
        "ffn_down.weight" => ("mlp.down_proj.weight", Layout::Plain),
        "ffn_gate_inp.weight" => ("mlp.gate.weight", Layout::Plain),
        "ffn_gate_shexp.weight" => ("mlp.shared_expert.gate_proj.weight", Layout::Plain),
        "ffn_up_shexp.weight" => ("mlp.shared_expert.up_proj.weight", Layout::Plain),
        "ffn_down_shexp.weight" => ("mlp.shared_expert.down_proj.weight", Layout::Plain),
        "ffn_gate_inp_shexp.weight" => ("mlp.shared_expert_gate.weight", Layout::OneRow),
        "ffn_gate_exps.weight" => {
            return Ok(Target::Experts {
                layer,
                proj: "gate_proj",
            });
        }
        "ffn_up_exps.weight" => {
            return Ok(Target::Experts {
                layer,
                proj: "up_proj",
            });
        }
        "ffn_down_exps.weight" => {
            return Ok(Target::Experts {
                layer,
                proj: "down_proj",
            });
        }
        _ => return Err(unknown()),
    };
    Ok(Target::One(
        format!("model.layers.{layer}.{checkpoint}"),
        layout,
    ))
}

/// A tensor's values as f32.
///
/// Only F32, F16 and BF16 are decoded here, a private stand-in until the decoders of every ggml type
/// (`gguf::decode::dequantize`, another branch) are merged; any other type is an error naming the tensor.
fn values(file: &GgufFile, info: &TensorInfo) -> Result<Vec<f32>> {
    let n = usize::try_from(info.numel()).map_err(|_| {
        tensor_err(
            file,
            &info.name,
            "more elements than this machine can address".into(),
        )
    })?;
    let mut out = vec![0f32; n];
    super::decode::dequantize(info.ty, file.bytes(info), &mut out)
        .map_err(|e| tensor_err(file, &info.name, e.to_string()))?;
    Ok(out)
}

/// Every tensor of the file under its checkpoint name, shape and layout (see the module's table), checked against
/// `config`'s dimensions.
pub fn checkpoint_tensors(file: &GgufFile, config: &Config) -> Result<Vec<CheckpointTensor>> {
    checkpoint_tensors_with(file, config, None)
}

/// [`checkpoint_tensors`] with `fault` planted in the mapping.
pub(crate) fn checkpoint_tensors_with(
    file: &GgufFile,
    config: &Config,
    fault: Option<fault::Fault>,
) -> Result<Vec<CheckpointTensor>> {
    let mut out = packed::split_with(file, config, fault, false)?.decoded;
    if let Some(f) = fault {
        f.tensors(&mut out, config);
    }
    Ok(out)
}

#[doc(hidden)]
pub mod fault;
pub mod layout;
pub mod packed;

#[cfg(test)]
mod tests;
