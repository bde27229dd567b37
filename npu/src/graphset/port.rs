//! A port as a set's description gives it: its axes (the layout), its element type, and its name or names per layer.

use reference::config::Config;
use std::collections::BTreeMap;

/// One axis of a port's shape. Named axes take their size from the call or the config; a port's layout is the order
/// of its axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Axis {
    /// A batch of 1.
    Batch,
    /// The call's token slots (the block size of a static graph; the call's tokens of a dynamic one).
    Tokens,
    /// The tokens before this call (a cache that grows).
    Past,
    /// The tokens before this call and this call's.
    PastTokens,
    /// The static context's slots.
    Context,
    /// The static context's slots, then this call's tokens.
    ContextTokens,
    /// The vocabulary.
    Vocab,
    /// The hidden size.
    Hidden,
    /// A conv state's channels (`2·Hk·Dk + Hv·Dv`).
    Channels,
    /// A conv state's width (the conv kernel).
    Kernel,
    /// The DeltaNet value heads.
    Heads,
    /// The DeltaNet key head dim.
    KeyDim,
    /// The DeltaNet value head dim.
    ValueDim,
    /// The attention key/value heads.
    KvHeads,
    /// The attention head dim.
    HeadDim,
    /// A fixed size (3 for the MRoPE rows of positions, 1 for an extra axis).
    Fixed(usize),
}

impl Axis {
    /// Every named axis and its manifest name.
    pub const NAMED: [(Axis, &'static str); 15] = [
        (Axis::Batch, "batch"),
        (Axis::Tokens, "tokens"),
        (Axis::Past, "past"),
        (Axis::PastTokens, "past+tokens"),
        (Axis::Context, "context"),
        (Axis::ContextTokens, "context+tokens"),
        (Axis::Vocab, "vocab"),
        (Axis::Hidden, "hidden"),
        (Axis::Channels, "channels"),
        (Axis::Kernel, "kernel"),
        (Axis::Heads, "heads"),
        (Axis::KeyDim, "key_dim"),
        (Axis::ValueDim, "value_dim"),
        (Axis::KvHeads, "kv_heads"),
        (Axis::HeadDim, "head_dim"),
    ];

    /// The manifest's name of the axis (`tokens`, or the number).
    pub fn name(self) -> String {
        match self {
            Axis::Fixed(n) => n.to_string(),
            other => Axis::NAMED
                .iter()
                .find(|(a, _)| *a == other)
                .map_or_else(String::new, |(_, n)| n.to_string()),
        }
    }

    /// Parses an axis name.
    pub fn parse(name: &str) -> Option<Axis> {
        Axis::NAMED
            .iter()
            .find(|(_, n)| *n == name)
            .map(|(a, _)| *a)
    }

    /// The axis's size for `config` in a call of `sizes`, when it is known (a static context of none is not).
    pub fn size(self, config: &Config, sizes: &CallSizes) -> Option<usize> {
        Some(match self {
            Axis::Batch => 1,
            Axis::Tokens => sizes.tokens,
            Axis::Past => sizes.past,
            Axis::PastTokens => sizes.past + sizes.tokens,
            Axis::Context => sizes.context?,
            Axis::ContextTokens => sizes.context? + sizes.tokens,
            Axis::Vocab => config.vocab_size,
            Axis::Hidden => config.hidden_size,
            Axis::Channels => config.linear_conv_dim(),
            Axis::Kernel => config.linear_conv_kernel_dim,
            Axis::Heads => config.linear_num_value_heads,
            Axis::KeyDim => config.linear_key_head_dim,
            Axis::ValueDim => config.linear_value_head_dim,
            Axis::KvHeads => config.num_key_value_heads,
            Axis::HeadDim => config.head_dim,
            Axis::Fixed(n) => n,
        })
    }

    /// The axis's size when it depends on the config only (`None` for the call's axes).
    pub fn static_size(self, config: &Config, context: Option<usize>) -> Option<usize> {
        match self {
            Axis::Tokens | Axis::Past | Axis::PastTokens | Axis::ContextTokens => None,
            other => other.size(
                config,
                &CallSizes {
                    tokens: 0,
                    past: 0,
                    context,
                },
            ),
        }
    }

    /// Whether the axis holds a size of 1 whatever the config (a batch, or a fixed 1).
    pub fn is_unit(self) -> bool {
        matches!(self, Axis::Batch | Axis::Fixed(1))
    }
}

/// The sizes of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallSizes {
    /// Token slots of the call.
    pub tokens: usize,
    /// Tokens before it.
    pub past: usize,
    /// The static context, if the set has one.
    pub context: Option<usize>,
}

/// An element type of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElemKind {
    /// 32-bit floats.
    F32,
    /// 16-bit floats.
    F16,
    /// 64-bit integers.
    I64,
    /// 32-bit integers.
    I32,
    /// Booleans (one byte each).
    Bool,
}

impl ElemKind {
    /// The manifest's name (`f32`, `f16`, `i64`, `i32`, `boolean`).
    pub fn name(self) -> &'static str {
        match self {
            ElemKind::F32 => "f32",
            ElemKind::F16 => "f16",
            ElemKind::I64 => "i64",
            ElemKind::I32 => "i32",
            ElemKind::Bool => "boolean",
        }
    }

    /// Parses a manifest's type name (OpenVINO's names: `f32`, `f16`, `i64`, `i32`, `boolean`).
    pub fn parse(name: &str) -> Option<ElemKind> {
        Some(match name {
            "f32" => ElemKind::F32,
            "f16" => ElemKind::F16,
            "i64" => ElemKind::I64,
            "i32" => ElemKind::I32,
            "boolean" | "bool" | "u8" => ElemKind::Bool,
            _ => return None,
        })
    }

    /// Whether the type holds floats.
    pub fn is_float(self) -> bool {
        matches!(self, ElemKind::F32 | ElemKind::F16)
    }
}

/// A port's name: one name, a pattern (`{i}` the layer, `{j}` its index among the layers of its kind), or one name
/// per layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Names {
    /// A name, or a pattern with `{i}` and `{j}`.
    Pattern(String),
    /// Layer → name.
    PerLayer(BTreeMap<usize, String>),
}

impl Names {
    /// One fixed name.
    pub fn fixed(name: &str) -> Names {
        Names::Pattern(name.to_string())
    }

    /// The name for layer `layer` of `config` (`None`: the layer has none in a per-layer map).
    pub fn resolve(&self, config: &Config, layer: usize) -> Option<String> {
        match self {
            Names::Pattern(p) => Some(
                p.replace("{i}", &layer.to_string())
                    .replace("{j}", &kind_index(config, layer).to_string()),
            ),
            Names::PerLayer(m) => m.get(&layer).cloned(),
        }
    }
}

/// The index of `layer` among the layers of its kind (the `n` of OpenVINO's `cache_params.past.conv.{n}`).
pub fn kind_index(config: &Config, layer: usize) -> usize {
    let kind = config.layer_types[layer];
    config.layer_types[..layer]
        .iter()
        .filter(|&&k| k == kind)
        .count()
}

/// A port as the description gives it: its name(s), element type and layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortSpec {
    /// Its name, or a pattern per layer.
    pub names: Names,
    /// Its element type.
    pub ty: ElemKind,
    /// Its axes, in order.
    pub shape: Vec<Axis>,
}

impl PortSpec {
    /// A port of one name.
    pub fn new(name: &str, ty: ElemKind, shape: &[Axis]) -> Self {
        PortSpec {
            names: Names::fixed(name),
            ty,
            shape: shape.to_vec(),
        }
    }
}
