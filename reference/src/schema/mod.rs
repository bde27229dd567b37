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
//! | `norm.weight` | `[H]` | norm (`1 + w`) |
//! | `lm_head.weight` (absent when tied) | `[V, H]` | LM head |

use crate::config::{Config, LayerKind};

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

/// The parameters every block has besides its mixer, in checkpoint order.
pub const BLOCK: [Param; 5] = [
    Param::GateProj,
    Param::UpProj,
    Param::DownProj,
    Param::InputLayernorm,
    Param::PostAttentionLayernorm,
];

impl Param {
    /// The key within its scope: `linear_attn.A_log` inside a layer, `norm.weight` for the model.
    pub fn key(self) -> &'static str {
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
            | Param::DownProj => Role::Projection,
        }
    }

    /// Whether the parameter belongs to a layer (`layers.{i}.…`) rather than to the model.
    pub fn per_layer(self) -> bool {
        !matches!(self, Param::EmbedTokens | Param::Norm | Param::LmHead)
    }

    /// The shape the config implies.
    pub fn shape(self, c: &Config) -> Vec<usize> {
        let h = c.hidden_size;
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
        }
    }
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
            name: param.key().to_string(),
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

    /// The parameters of a layer of this kind, in checkpoint order: the mixer's, then the MLP's and the norms.
    pub fn layer_params(kind: LayerKind) -> Vec<Param> {
        let mixer: &[Param] = match kind {
            LayerKind::Linear => &LINEAR_ATTN,
            LayerKind::Full => &SELF_ATTN,
        };
        mixer.iter().chain(&BLOCK).copied().collect()
    }

    /// Every tensor of layer `layer`, in checkpoint order.
    pub fn layer_tensors(&self, layer: usize) -> Vec<TensorSpec> {
        Self::layer_params(self.config.layer_types[layer])
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

pub mod vision;
