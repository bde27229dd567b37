//! The decoder's tensors, written once: every tensor's name, shape and role, derived from the config.
//!
//! Every reader and writer of weights goes through this list: the reference's loaders, the OpenVINO graph builder,
//! the synthetic checkpoints, and the compression rule of [`crate::quant`] (which decides by [`Role`], never by a
//! name's suffix). A name here is relative to the checkpoint's decoder prefix (`model.` or `model.language_model.`),
//! except `lm_head.weight`, which sits at the top level in both layouts.
//!
//! | tensor (layer `i`) | shape | role |
//! |---|---|---|
//! | `embed_tokens.weight` | `[V, H]` | embedding |
//! | `layers.i.input_layernorm.weight`, `post_attention_layernorm.weight` | `[H]` | norm (`1 + w`) |
//! | `layers.i.linear_attn.in_proj_qkv.weight` | `[2·Hk·Dk + Hv·Dv, H]` | projection |
//! | `layers.i.linear_attn.in_proj_z.weight` | `[Hv·Dv, H]` | projection |
//! | `layers.i.linear_attn.in_proj_b.weight`, `in_proj_a.weight` | `[Hv, H]` | projection |
//! | `layers.i.linear_attn.conv1d.weight` | `[2·Hk·Dk + Hv·Dv, 1, K]` | conv |
//! | `layers.i.linear_attn.A_log`, `dt_bias` | `[Hv]` | decay |
//! | `layers.i.linear_attn.norm.weight` | `[Dv]` | gated norm (`w`) |
//! | `layers.i.linear_attn.out_proj.weight` | `[H, Hv·Dv]` | projection |
//! | `layers.i.self_attn.q_proj.weight` | `[Hq·2D, H]` (query and gate per head) | projection |
//! | `layers.i.self_attn.k_proj.weight`, `v_proj.weight` | `[Hkv·D, H]` | projection |
//! | `layers.i.self_attn.o_proj.weight` | `[H, Hq·D]` | projection |
//! | `layers.i.self_attn.q_norm.weight`, `k_norm.weight` | `[D]` | norm (`1 + w`) |
//! | `layers.i.mlp.gate_proj.weight`, `up_proj.weight` | `[I, H]` | projection |
//! | `layers.i.mlp.down_proj.weight` | `[H, I]` | projection |
//! | MoE decoder, instead of `mlp.*` above: | | |
//! | `layers.i.mlp.gate.weight` (the router) | `[E, H]` | projection |
//! | `layers.i.mlp.experts.e.gate_proj.weight`, `up_proj.weight` (`e < E`) | `[Im, H]` | projection |
//! | `layers.i.mlp.experts.e.down_proj.weight` | `[H, Im]` | projection |
//! | `layers.i.mlp.shared_expert.gate_proj.weight`, `up_proj.weight` | `[Is, H]` | projection |
//! | `layers.i.mlp.shared_expert.down_proj.weight` | `[H, Is]` | projection |
//! | `layers.i.mlp.shared_expert_gate.weight` | `[1, H]` | projection |
//! | `norm.weight` | `[H]` | norm (`1 + w`) |
//! | `lm_head.weight` (absent when tied) | `[V, H]` | LM head |
//!
//! A converted MoE checkpoint may hold a layer's experts fused as transformers 5 keeps them in memory:
//! `layers.i.mlp.experts.gate_up_proj` `[E, 2·Im, H]` (expert `e`'s gate rows, then its up rows) and
//! `layers.i.mlp.experts.down_proj` `[E, H, Im]`. Each expert's matrix is then a run of rows of the fused tensor
//! ([`FusedExpert`]), which the weight store reads in place as it would the expert's own tensor.

use crate::config::{Config, LayerKind, MoeConfig};

/// What a tensor is, which decides how it is loaded, initialised and compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The token embedding `[V, H]` (also the LM head when the embeddings are tied).
    Embedding,
    /// The projection to the vocabulary `[V, H]`.
    LmHead,
    /// A linear layer's weight `[out, in]` (PyTorch's `nn.Linear` layout).
    Projection,
    /// A zero-centred RMSNorm weight: the norm scales by `1 + w`.
    Norm,
    /// The gated norm's plain weight: it scales by `w`.
    GatedNorm,
    /// The depthwise causal convolution's kernel `[C, 1, K]`.
    Conv,
    /// A per-value-head decay parameter (`A_log`, `dt_bias`).
    Decay,
}

/// One parameter of the decoder, by its checkpoint key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Param {
    /// `embed_tokens.weight`.
    EmbedTokens,
    /// `layers.i.input_layernorm.weight`.
    InputLayernorm,
    /// `layers.i.post_attention_layernorm.weight`.
    PostAttentionLayernorm,
    /// `layers.i.linear_attn.in_proj_qkv.weight`.
    InProjQkv,
    /// `layers.i.linear_attn.in_proj_z.weight`.
    InProjZ,
    /// `layers.i.linear_attn.in_proj_b.weight`.
    InProjB,
    /// `layers.i.linear_attn.in_proj_a.weight`.
    InProjA,
    /// `layers.i.linear_attn.conv1d.weight`.
    Conv1d,
    /// `layers.i.linear_attn.A_log`.
    ALog,
    /// `layers.i.linear_attn.dt_bias`.
    DtBias,
    /// `layers.i.linear_attn.norm.weight` (the gated norm).
    LinearNorm,
    /// `layers.i.linear_attn.out_proj.weight`.
    OutProj,
    /// `layers.i.self_attn.q_proj.weight`.
    QProj,
    /// `layers.i.self_attn.k_proj.weight`.
    KProj,
    /// `layers.i.self_attn.v_proj.weight`.
    VProj,
    /// `layers.i.self_attn.o_proj.weight`.
    OProj,
    /// `layers.i.self_attn.q_norm.weight`.
    QNorm,
    /// `layers.i.self_attn.k_norm.weight`.
    KNorm,
    /// `layers.i.mlp.gate_proj.weight`.
    GateProj,
    /// `layers.i.mlp.up_proj.weight`.
    UpProj,
    /// `layers.i.mlp.down_proj.weight`.
    DownProj,
    /// `layers.i.mlp.gate.weight`: the MoE router `[E, H]`.
    RouterGate,
    /// `layers.i.mlp.experts.{e}.gate_proj.weight`.
    ExpertGateProj(usize),
    /// `layers.i.mlp.experts.{e}.up_proj.weight`.
    ExpertUpProj(usize),
    /// `layers.i.mlp.experts.{e}.down_proj.weight`.
    ExpertDownProj(usize),
    /// `layers.i.mlp.shared_expert.gate_proj.weight`.
    SharedGateProj,
    /// `layers.i.mlp.shared_expert.up_proj.weight`.
    SharedUpProj,
    /// `layers.i.mlp.shared_expert.down_proj.weight`.
    SharedDownProj,
    /// `layers.i.mlp.shared_expert_gate.weight` `[1, H]`.
    SharedExpertGate,
    /// `norm.weight` (the final norm).
    Norm,
    /// `lm_head.weight`.
    LmHead,
}

/// The Gated DeltaNet mixer's parameters, in checkpoint order.
pub const LINEAR_ATTN: [Param; 9] = [
    Param::InProjQkv,
    Param::InProjZ,
    Param::InProjB,
    Param::InProjA,
    Param::Conv1d,
    Param::ALog,
    Param::DtBias,
    Param::LinearNorm,
    Param::OutProj,
];

/// The gated attention mixer's parameters, in checkpoint order.
pub const SELF_ATTN: [Param; 6] = [
    Param::QProj,
    Param::KProj,
    Param::VProj,
    Param::OProj,
    Param::QNorm,
    Param::KNorm,
];

/// The MoE block's parameters besides the experts, in checkpoint order: the router, then (after the experts) the
/// shared expert and its gate.
pub const MOE_ROUTER: Param = Param::RouterGate;

/// The shared expert's parameters and its gate, in checkpoint order.
pub const SHARED_EXPERT: [Param; 4] = [
    Param::SharedGateProj,
    Param::SharedUpProj,
    Param::SharedDownProj,
    Param::SharedExpertGate,
];

/// The parameters every block has besides its mixer, in checkpoint order (a dense decoder's).
pub const BLOCK: [Param; 5] = [
    Param::GateProj,
    Param::UpProj,
    Param::DownProj,
    Param::InputLayernorm,
    Param::PostAttentionLayernorm,
];

impl Param {
    /// The key within its scope: `linear_attn.A_log` inside a layer, `norm.weight` for the model.
    pub fn key(self) -> String {
        match self {
            Param::ExpertGateProj(e) => format!("mlp.experts.{e}.gate_proj.weight"),
            Param::ExpertUpProj(e) => format!("mlp.experts.{e}.up_proj.weight"),
            Param::ExpertDownProj(e) => format!("mlp.experts.{e}.down_proj.weight"),
            other => other.fixed_key().to_string(),
        }
    }

    fn fixed_key(self) -> &'static str {
        match self {
            Param::EmbedTokens => "embed_tokens.weight",
            Param::InputLayernorm => "input_layernorm.weight",
            Param::PostAttentionLayernorm => "post_attention_layernorm.weight",
            Param::InProjQkv => "linear_attn.in_proj_qkv.weight",
            Param::InProjZ => "linear_attn.in_proj_z.weight",
            Param::InProjB => "linear_attn.in_proj_b.weight",
            Param::InProjA => "linear_attn.in_proj_a.weight",
            Param::Conv1d => "linear_attn.conv1d.weight",
            Param::ALog => "linear_attn.A_log",
            Param::DtBias => "linear_attn.dt_bias",
            Param::LinearNorm => "linear_attn.norm.weight",
            Param::OutProj => "linear_attn.out_proj.weight",
            Param::QProj => "self_attn.q_proj.weight",
            Param::KProj => "self_attn.k_proj.weight",
            Param::VProj => "self_attn.v_proj.weight",
            Param::OProj => "self_attn.o_proj.weight",
            Param::QNorm => "self_attn.q_norm.weight",
            Param::KNorm => "self_attn.k_norm.weight",
            Param::GateProj => "mlp.gate_proj.weight",
            Param::UpProj => "mlp.up_proj.weight",
            Param::DownProj => "mlp.down_proj.weight",
            Param::RouterGate => "mlp.gate.weight",
            Param::SharedGateProj => "mlp.shared_expert.gate_proj.weight",
            Param::SharedUpProj => "mlp.shared_expert.up_proj.weight",
            Param::SharedDownProj => "mlp.shared_expert.down_proj.weight",
            Param::SharedExpertGate => "mlp.shared_expert_gate.weight",
            Param::ExpertGateProj(_) | Param::ExpertUpProj(_) | Param::ExpertDownProj(_) => {
                unreachable!("keys with an expert index are formatted by Param::key")
            }
            Param::Norm => "norm.weight",
            Param::LmHead => "lm_head.weight",
        }
    }

    /// The tensor's role.
    pub fn role(self) -> Role {
        match self {
            Param::EmbedTokens => Role::Embedding,
            Param::LmHead => Role::LmHead,
            Param::InputLayernorm
            | Param::PostAttentionLayernorm
            | Param::QNorm
            | Param::KNorm
            | Param::Norm => Role::Norm,
            Param::LinearNorm => Role::GatedNorm,
            Param::Conv1d => Role::Conv,
            Param::ALog | Param::DtBias => Role::Decay,
            Param::InProjQkv
            | Param::InProjZ
            | Param::InProjB
            | Param::InProjA
            | Param::OutProj
            | Param::QProj
            | Param::KProj
            | Param::VProj
            | Param::OProj
            | Param::GateProj
            | Param::UpProj
            | Param::DownProj
            | Param::RouterGate
            | Param::ExpertGateProj(_)
            | Param::ExpertUpProj(_)
            | Param::ExpertDownProj(_)
            | Param::SharedGateProj
            | Param::SharedUpProj
            | Param::SharedDownProj
            | Param::SharedExpertGate => Role::Projection,
        }
    }

    /// Whether the parameter belongs to a layer (`layers.{i}.…`) rather than to the model.
    pub fn per_layer(self) -> bool {
        !matches!(self, Param::EmbedTokens | Param::Norm | Param::LmHead)
    }

    /// The shape the config implies (an MoE parameter's: zero-sized widths in a dense config, which has none).
    pub fn shape(self, c: &Config) -> Vec<usize> {
        let h = c.hidden_size;
        let (e, im, is) = c.moe.as_ref().map_or((0, 0, 0), |m| {
            (
                m.num_experts,
                m.moe_intermediate_size,
                m.shared_expert_intermediate_size,
            )
        });
        let (hv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
        let (nh, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let inner = c.intermediate_size;
        match self {
            Param::EmbedTokens | Param::LmHead => vec![c.vocab_size, h],
            Param::InputLayernorm | Param::PostAttentionLayernorm | Param::Norm => vec![h],
            Param::InProjQkv => vec![c.linear_conv_dim(), h],
            Param::InProjZ => vec![hv * dv, h],
            Param::InProjB | Param::InProjA => vec![hv, h],
            Param::Conv1d => vec![c.linear_conv_dim(), 1, c.linear_conv_kernel_dim],
            Param::ALog | Param::DtBias => vec![hv],
            Param::LinearNorm => vec![dv],
            Param::OutProj => vec![h, hv * dv],
            Param::QProj => vec![nh * d * 2, h],
            Param::KProj | Param::VProj => vec![nkv * d, h],
            Param::OProj => vec![h, nh * d],
            Param::QNorm | Param::KNorm => vec![d],
            Param::GateProj | Param::UpProj => vec![inner, h],
            Param::DownProj => vec![h, inner],
            Param::RouterGate => vec![e, h],
            Param::ExpertGateProj(_) | Param::ExpertUpProj(_) => vec![im, h],
            Param::ExpertDownProj(_) => vec![h, im],
            Param::SharedGateProj | Param::SharedUpProj => vec![is, h],
            Param::SharedDownProj => vec![h, is],
            Param::SharedExpertGate => vec![1, h],
        }
    }
}

impl Param {
    /// Where each dimension of [`Param::shape`] comes from, in the config's own keys: what a shape that disagrees
    /// with the checkpoint's names, so the key at fault is the one an error points to.
    pub fn shape_keys(self) -> Vec<&'static str> {
        const H: &str = "hidden_size";
        const CONV: &str = "2·linear_num_key_heads·linear_key_head_dim + linear_num_value_heads·linear_value_head_dim";
        const V: &str = "linear_num_value_heads·linear_value_head_dim";
        match self {
            Param::EmbedTokens | Param::LmHead => vec!["vocab_size", H],
            Param::InputLayernorm | Param::PostAttentionLayernorm | Param::Norm => vec![H],
            Param::InProjQkv => vec![CONV, H],
            Param::InProjZ => vec![V, H],
            Param::InProjB | Param::InProjA => vec!["linear_num_value_heads", H],
            Param::Conv1d => vec![CONV, "1", "linear_conv_kernel_dim"],
            Param::ALog | Param::DtBias => vec!["linear_num_value_heads"],
            Param::LinearNorm => vec!["linear_value_head_dim"],
            Param::OutProj => vec![H, V],
            Param::QProj => vec!["2·num_attention_heads·head_dim", H],
            Param::KProj | Param::VProj => vec!["num_key_value_heads·head_dim", H],
            Param::OProj => vec![H, "num_attention_heads·head_dim"],
            Param::QNorm | Param::KNorm => vec!["head_dim"],
            Param::GateProj | Param::UpProj => vec!["intermediate_size", H],
            Param::DownProj => vec![H, "intermediate_size"],
            Param::RouterGate => vec!["num_experts", H],
            Param::ExpertGateProj(_) | Param::ExpertUpProj(_) => vec!["moe_intermediate_size", H],
            Param::ExpertDownProj(_) => vec![H, "moe_intermediate_size"],
            Param::SharedGateProj | Param::SharedUpProj => {
                vec!["shared_expert_intermediate_size", H]
            }
            Param::SharedDownProj => vec![H, "shared_expert_intermediate_size"],
            Param::SharedExpertGate => vec!["1", H],
        }
    }
}

/// Says which dimensions of `found` disagree with `expected`, the shape the config implies, and the config keys
/// each comes from (`keys`, one per dimension, e.g. [`Param::shape_keys`]): `dimension 0 is 160 in the file,
/// 4000000000000064 by the config's 2·linear_num_key_heads·linear_key_head_dim + …`.
pub fn shape_disagreement(keys: &[&str], found: &[usize], expected: &[usize]) -> String {
    if found.len() != expected.len() {
        return format!(
            "a tensor of rank {} where the config implies rank {}",
            found.len(),
            expected.len()
        );
    }
    found
        .iter()
        .zip(expected)
        .enumerate()
        .filter(|(_, (f, e))| f != e)
        .map(|(i, (f, e))| {
            let from = keys.get(i).copied().unwrap_or("?");
            format!("dimension {i} is {f} in the file, {e} by the config's {from}")
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// One tensor of the decoder: which parameter of which layer, its name and its shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorSpec {
    /// The parameter.
    pub param: Param,
    /// The layer, for per-layer parameters.
    pub layer: Option<usize>,
    /// The name under the decoder prefix (`layers.0.linear_attn.A_log`); `lm_head.weight` for the LM head, which
    /// has no prefix.
    pub name: String,
    /// The shape the config implies.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// The tensor's role.
    pub fn role(&self) -> Role {
        self.param.role()
    }

    /// The full checkpoint name under a decoder prefix (`model.`, `model.language_model.`).
    pub fn full_name(&self, prefix: &str) -> String {
        if self.param == Param::LmHead {
            self.name.clone()
        } else {
            format!("{prefix}{}", self.name)
        }
    }
}

/// The tensors of a decoder with a given config.
#[derive(Debug, Clone, Copy)]
pub struct Schema<'a> {
    config: &'a Config,
}

impl<'a> Schema<'a> {
    /// The schema of `config`.
    pub fn new(config: &'a Config) -> Self {
        Schema { config }
    }

    /// A model-level tensor (`embed_tokens`, `norm`, `lm_head`).
    ///
    /// # Panics
    /// If `param` is a per-layer parameter (a programming error, not an input error).
    pub fn global(&self, param: Param) -> TensorSpec {
        assert!(!param.per_layer(), "{param:?} is a per-layer parameter");
        TensorSpec {
            param,
            layer: None,
            name: param.key(),
            shape: param.shape(self.config),
        }
    }

    /// A tensor of layer `layer`.
    ///
    /// # Panics
    /// If `param` is a model-level parameter (a programming error).
    pub fn layer(&self, layer: usize, param: Param) -> TensorSpec {
        assert!(param.per_layer(), "{param:?} is a model-level parameter");
        TensorSpec {
            param,
            layer: Some(layer),
            name: format!("layers.{layer}.{}", param.key()),
            shape: param.shape(self.config),
        }
    }

    /// The parameters of a dense decoder's layer of this kind, in checkpoint order: the mixer's, then the MLP's and
    /// the norms.
    pub fn layer_params(kind: LayerKind) -> Vec<Param> {
        let mixer: &[Param] = match kind {
            LayerKind::Linear => &LINEAR_ATTN,
            LayerKind::Full => &SELF_ATTN,
        };
        mixer.iter().chain(&BLOCK).copied().collect()
    }

    /// The MoE block's parameters in checkpoint order: the router, each expert's gate, up and down projections,
    /// the shared expert and its gate.
    pub fn moe_params(moe: &MoeConfig) -> Vec<Param> {
        let mut out = vec![MOE_ROUTER];
        for e in 0..moe.num_experts {
            out.extend([
                Param::ExpertGateProj(e),
                Param::ExpertUpProj(e),
                Param::ExpertDownProj(e),
            ]);
        }
        out.extend(SHARED_EXPERT);
        out
    }

    /// The parameters of layer `layer` of this decoder, in checkpoint order: the mixer's, the MLP's (dense) or the
    /// MoE block's, and the norms.
    pub fn params_of_layer(&self, layer: usize) -> Vec<Param> {
        self.params_of_kind(self.config.layer_types[layer])
    }

    /// The parameters of a layer of this kind in this decoder (dense or MoE), in checkpoint order; also those of
    /// the multi-token-prediction head's layer, a full-attention layer of the decoder's own kind.
    pub fn params_of_kind(&self, kind: LayerKind) -> Vec<Param> {
        let dense = Self::layer_params(kind);
        match &self.config.moe {
            None => dense,
            Some(moe) => {
                let norms = [Param::InputLayernorm, Param::PostAttentionLayernorm];
                let mixer = dense.iter().filter(|p| !BLOCK.contains(p));
                mixer
                    .copied()
                    .chain(Self::moe_params(moe))
                    .chain(norms)
                    .collect()
            }
        }
    }

    /// Every tensor of layer `layer`, in checkpoint order.
    pub fn layer_tensors(&self, layer: usize) -> Vec<TensorSpec> {
        self.params_of_layer(layer)
            .into_iter()
            .map(|p| self.layer(layer, p))
            .collect()
    }

    /// Every decoder tensor the checkpoint must hold, in checkpoint order: the embedding, each layer's tensors, the
    /// final norm, and the LM head unless the embeddings are tied.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        let mut out = vec![self.global(Param::EmbedTokens)];
        for layer in 0..self.config.num_layers() {
            out.extend(self.layer_tensors(layer));
        }
        out.push(self.global(Param::Norm));
        if !self.config.tie_word_embeddings {
            out.push(self.global(Param::LmHead));
        }
        out
    }

    /// The LM head's tensor: `lm_head.weight`, or the embedding when tied.
    pub fn lm_head(&self) -> TensorSpec {
        if self.config.tie_word_embeddings {
            self.global(Param::EmbedTokens)
        } else {
            self.global(Param::LmHead)
        }
    }
}

/// Where one expert's matrix sits in a layer's fused expert tensor (the form transformers 5 keeps in memory and a
/// converted checkpoint may store): rows `first_row..first_row + rows` of the fused tensor viewed as a matrix of its
/// last dimension's width.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedExpert {
    /// The fused tensor's name under the decoder prefix: `layers.{i}.mlp.experts.gate_up_proj` or `…down_proj`.
    pub name: String,
    /// The expert.
    pub expert: usize,
    /// Which rows of the expert's block: 0 for the gate (or down) projection, 1 for the up projection (the second
    /// half of `gate_up_proj`'s `2·Im` rows).
    pub half: usize,
}

impl FusedExpert {
    /// The fused tensor holding `name`'s matrix, when `name` (under the decoder prefix) is an expert's
    /// `layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`.
    pub fn of(name: &str) -> Option<FusedExpert> {
        let rest = name.strip_prefix("layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let rest = rest.strip_prefix("mlp.experts.")?;
        let (expert, proj) = rest.split_once('.')?;
        let expert: usize = expert.parse().ok()?;
        let (fused, half) = match proj {
            "gate_proj.weight" => ("gate_up_proj", 0),
            "up_proj.weight" => ("gate_up_proj", 1),
            "down_proj.weight" => ("down_proj", 0),
            _ => return None,
        };
        Some(FusedExpert {
            name: format!("layers.{layer}.mlp.experts.{fused}"),
            expert,
            half,
        })
    }

    /// The fused tensor's shape for a config: `[E, 2·Im, H]` or `[E, H, Im]`.
    pub fn shape(&self, moe: &MoeConfig, hidden: usize) -> Vec<usize> {
        let (e, im) = (moe.num_experts, moe.moe_intermediate_size);
        if self.name.ends_with("gate_up_proj") {
            vec![e, 2 * im, hidden]
        } else {
            vec![e, hidden, im]
        }
    }

    /// The first row of the expert's matrix `[rows, cols]` in the fused tensor viewed as `[·, cols]`, given the
    /// fused tensor's shape.
    pub fn first_row(&self, fused_shape: &[usize]) -> usize {
        let per_expert = fused_shape.get(1).copied().unwrap_or(0);
        if self.name.ends_with("gate_up_proj") {
            self.expert * per_expert + self.half * per_expert / 2
        } else {
            self.expert * per_expert
        }
    }
}

pub mod vision;

#[cfg(test)]
mod tests;
