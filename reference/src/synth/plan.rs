//! What a synthetic checkpoint holds: its config and every tensor's name, shape and initialisation.

use super::arch::Arch;
use crate::config::{Config, LayerKind};
use crate::error::{Error, Result};
use crate::schema::vision::{VisionRole, VisionSchema};
use crate::schema::{FusedExpert, Param, Role, Schema};
use crate::vision::VisionConfig;
use serde_json::{Value, json};

/// The layer kinds of the real pattern: every fourth layer is full attention.
fn layer_types(layers: usize) -> Vec<&'static str> {
    (0..layers)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                LayerKind::Full.name()
            } else {
                LayerKind::Linear.name()
            }
        })
        .collect()
}

/// The nested `config.json` of a checkpoint of `arch` with `layers` decoder layers, with the fields the real
/// repository's has (and a `synthetic` object saying what made it and from which seed).
pub fn config_json(arch: Arch, layers: usize, seed: u64) -> Result<Value> {
    if layers == 0 {
        return Err(Error::Input("a checkpoint needs at least one layer".into()));
    }
    let d = arch.dims();
    let v = d.vision;
    let mut text = json!({
        "attention_bias": false,
        "attention_dropout": 0.0,
        "attn_output_gate": true,
        "bos_token_id": null,
        "dtype": "bfloat16",
        "eos_token_id": d.eos,
        "full_attention_interval": 4,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "layer_types": layer_types(layers),
        "linear_conv_kernel_dim": d.conv_kernel,
        "linear_key_head_dim": d.linear_key_dim,
        "linear_num_key_heads": d.linear_key_heads,
        "linear_num_value_heads": d.linear_value_heads,
        "linear_value_head_dim": d.linear_value_dim,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": false,
        "num_attention_heads": d.heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": d.kv_heads,
        "pad_token_id": null,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": true,
            "mrope_section": d.mrope_section,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default"
        },
        "tie_word_embeddings": false,
        "use_cache": true,
        "vocab_size": d.vocab
    });
    let fields = text.as_object_mut().expect("an object");
    let (architecture, model_type, vision_type) = match d.moe {
        None => {
            fields.insert("intermediate_size".into(), json!(d.intermediate));
            fields.insert("model_type".into(), json!("qwen3_5_text"));
            (
                "Qwen3_5ForConditionalGeneration",
                "qwen3_5",
                "qwen3_5_vision",
            )
        }
        Some(m) => {
            // The released MoE config has no dense `intermediate_size`, and the router's fields.
            for (key, value) in [
                ("model_type", json!("qwen3_5_moe_text")),
                ("moe_intermediate_size", json!(m.expert_width)),
                ("num_experts", json!(m.experts)),
                ("num_experts_per_tok", json!(m.per_token)),
                ("output_router_logits", json!(false)),
                ("router_aux_loss_coef", json!(0.001)),
                ("shared_expert_intermediate_size", json!(m.shared_width)),
            ] {
                fields.insert(key.into(), value);
            }
            (
                "Qwen3_5MoeForConditionalGeneration",
                "qwen3_5_moe",
                "qwen3_5_moe_vision",
            )
        }
    };
    Ok(json!({
        "architectures": [architecture],
        "image_token_id": 248056,
        "model_type": model_type,
        "synthetic": {"generator": "qwen35 synth", "arch": arch.name(), "seed": seed},
        "text_config": text,
        "tie_word_embeddings": false,
        "video_token_id": 248057,
        "vision_config": {
            "deepstack_visual_indexes": [],
            "depth": v.depth,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": v.hidden,
            "in_channels": v.in_channels,
            "initializer_range": 0.02,
            "intermediate_size": v.intermediate,
            "model_type": vision_type,
            "num_heads": v.heads,
            "num_position_embeddings": v.positions,
            "out_hidden_size": d.hidden,
            "patch_size": v.patch,
            "spatial_merge_size": v.merge,
            "temporal_patch_size": v.temporal_patch
        },
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053
    }))
}

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// `mean + std · N(0, 1)`.
    Normal {
        /// The mean.
        mean: f32,
        /// The standard deviation.
        std: f32,
    },
    /// `A_log = ln(A)` with `A` uniform in `[lo, hi]`.
    ALog {
        /// The smallest `A`.
        lo: f64,
        /// The largest `A`.
        hi: f64,
    },
    /// `dt_bias = softplus⁻¹(dt)` with `dt` log-uniform in `[lo, hi]`.
    DtBias {
        /// The smallest `dt`.
        lo: f64,
        /// The largest `dt`.
        hi: f64,
    },
}

impl Init {
    fn normal(std: f64) -> Self {
        Init::Normal {
            mean: 0.0,
            std: std as f32,
        }
    }

    /// `N(0, 1/fan_in)` for a weight of this shape (`fan_in`: every dimension but the first).
    fn fan_in(shape: &[usize]) -> Self {
        let fan: usize = shape[1..].iter().product();
        Init::normal(1.0 / (fan.max(1) as f64).sqrt())
    }
}

/// One tensor of the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorPlan {
    /// The full name (`model.language_model.layers.0.linear_attn.A_log`).
    pub name: String,
    /// The shape.
    pub shape: Vec<usize>,
    /// How its values are drawn.
    pub init: Init,
}

impl TensorPlan {
    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes in bf16.
    pub fn bytes(&self) -> u64 {
        2 * self.numel() as u64
    }
}

/// The standard deviation of the zero-centred norm weights and of the gated norm's weight around 1.
const NORM_STD: f64 = 0.1;

/// The initialisation of a decoder (or MTP) parameter.
fn decoder_init(param: Param, shape: &[usize]) -> Init {
    match param {
        Param::EmbedTokens => Init::normal(1.0),
        Param::InProjA => Init::normal(0.5 / (shape[1] as f64).sqrt()),
        Param::ALog => Init::ALog { lo: 1.0, hi: 16.0 },
        Param::DtBias => Init::DtBias { lo: 1e-3, hi: 1e-1 },
        Param::LinearNorm => Init::Normal {
            mean: 1.0,
            std: NORM_STD as f32,
        },
        p => match p.role() {
            Role::Norm => Init::normal(NORM_STD),
            // Projections, the LM head and the conv kernel ([C, 1, K]: fan-in K).
            _ => Init::fan_in(shape),
        },
    }
}

/// Every tensor of a checkpoint of `arch` with `layers` layers, in file order: the decoder (embedding, layers, final
/// norm) under `model.language_model.`, `lm_head.weight`, the MTP head, the vision tower.
///
/// An MoE decoder's experts are stored as the released Qwen3.5-35B-A3B stores them: fused, each layer's in
/// `mlp.experts.gate_up_proj` `[E, 2·Im, H]` and `mlp.experts.down_proj` `[E, H, Im]` ([`FusedExpert`]), while
/// its MTP layer keeps them one by one (`mtp.layers.0.mlp.experts.{e}.gate_proj.weight`, …).
pub fn plan(arch: Arch, layers: usize) -> Result<Vec<TensorPlan>> {
    let config_value = config_json(arch, layers, 0)?;
    let config = Config::from_json_str(&config_value.to_string(), "(synthetic config)")?;
    let h = config.hidden_size;
    let mut out = Vec::new();
    for spec in Schema::new(&config).tensors() {
        if let (Some(fused), Some(moe)) = (FusedExpert::of(&spec.name), &config.moe) {
            // Expert 0's gate and down projections stand where the two fused tensors go; the rest are in them.
            if fused.expert == 0 && fused.half == 0 {
                let shape = fused.shape(moe, h);
                out.push(TensorPlan {
                    name: format!("model.language_model.{}", fused.name),
                    // Each expert's matrix N(0, 1/fan_in), its fan-in the last dimension.
                    init: Init::normal(1.0 / (shape[2] as f64).sqrt()),
                    shape,
                });
            }
            continue;
        }
        out.push(TensorPlan {
            name: spec.full_name("model.language_model."),
            init: decoder_init(spec.param, &spec.shape),
            shape: spec.shape,
        });
    }

    // Multi-token prediction: norms of the embedding and of the last hidden state, a fusing projection, one full
    // attention layer (with the decoder's MLP or MoE block), a final norm.
    push(&mut out, "mtp.fc.weight", vec![h, 2 * h], None);
    for norm in ["pre_fc_norm_embedding", "pre_fc_norm_hidden"] {
        push(
            &mut out,
            &format!("mtp.{norm}.weight"),
            vec![h],
            Some(Init::normal(NORM_STD)),
        );
    }
    for param in Schema::new(&config).params_of_kind(LayerKind::Full) {
        let shape = param.shape(&config);
        let init = decoder_init(param, &shape);
        push(
            &mut out,
            &format!("mtp.layers.0.{}", param.key()),
            shape,
            Some(init),
        );
    }
    push(
        &mut out,
        "mtp.norm.weight",
        vec![h],
        Some(Init::normal(NORM_STD)),
    );

    // The vision tower (Qwen3-VL style, without deepstack mergers), as the schema lists it.
    let vision = VisionConfig::from_json_str(&config_value.to_string(), "(synthetic config)")?
        .ok_or_else(|| Error::Input("the synthetic config has no vision tower".into()))?;
    let layer_norm = Init::Normal {
        mean: 1.0,
        std: NORM_STD as f32,
    };
    for t in VisionSchema::new(&vision).tensors() {
        let init = match t.role {
            VisionRole::Projection => None,
            VisionRole::Bias => Some(BIAS),
            VisionRole::NormWeight => Some(layer_norm),
            VisionRole::Table => Some(Init::normal(0.02)),
        };
        push(&mut out, &t.full_name(), t.shape, init);
    }
    Ok(out)
}

/// The biases of the vision tower.
const BIAS: Init = Init::Normal {
    mean: 0.0,
    std: 0.02,
};

/// Appends a tensor; `None` initialises it `N(0, 1/fan_in)`.
fn push(out: &mut Vec<TensorPlan>, name: &str, shape: Vec<usize>, init: Option<Init>) {
    let init = init.unwrap_or_else(|| Init::fan_in(&shape));
    out.push(TensorPlan {
        name: name.to_string(),
        shape,
        init,
    });
}
