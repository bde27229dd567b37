//! A graph set: the decoder as somebody's static or dynamic OpenVINO graphs, described by what each port carries, so
//! that one engine ([`crate::engine`]) runs this project's own graphs, the ones `qwen35 export-ir` writes, and graphs
//! made elsewhere (a porter's hand-written NPU graphs, optimum-intel's export, that export made stateless by
//! OpenVINO's transformation) alike.
//!
//! A set has up to two parts. The **decoder** part is one or more IR files keyed by the tokens per call (a 1-token
//! decoder and prompt blocks of 16 and 64 tokens, or one file that takes any number), all with one interface: per
//! port a role (token ids or host-side embeddings, positions, the attention mask, `token_valid`, logits), per layer
//! the states in and out with their layout, optionally hidden outputs, and the host rule for a prompt (padded blocks
//! with `token_valid`, or full blocks then single tokens). A **stateful** decoder keeps its caches inside OpenVINO
//! instead (`ReadValue`/`Assign`), and nothing outside can read them. The **per-layer** part is one IR per layer and
//! block size (hidden in, hidden out, the layer's states in and out), as a per-layer probe and NPUW compile a
//! decoder.
//!
//! The description comes from a `manifest.json` ([`manifest`], documented with a worked example in
//! `docs/graph-sets.md`), or, without one, from the port names of two interfaces worth knowing ([`convention`]):
//! optimum-intel's stateful export, and what `stateful_to_stateless_transformation` makes of it. This project's own
//! graphs are described by [`own`]. A set may bring its own static vision graphs ([`vision`]), whose rows feed a
//! decoder that takes embeddings. [`layout`] converts between a port's layout and the dump's (the states the
//! reference keeps), and [`check`] holds a description against the ports an IR really has.

pub mod check;
pub mod convention;
pub mod layout;
pub mod manifest;
pub mod own;
mod port;
pub mod vision;

pub use port::{Axis, CallSizes, ElemKind, Names, PortSpec, kind_index};

use crate::error::{Error, Result};
use reference::config::LayerKind;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// What an input carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputRole {
    /// The call's token ids (padded slots hold 0).
    InputIds,
    /// The call's token embeddings, looked up on the host from the checkpoint's table (padded slots: token 0's).
    Embeddings,
    /// The text positions of the call's slots: one row, or three equal MRoPE rows (a fixed axis of 3).
    Positions,
    /// The attention mask ([`MaskValues`]): over the tokens so far, or over a static context with the valid slots
    /// marked; with a `tokens` axis too, causal within the call.
    AttentionMask(MaskValues),
    /// 1 for a real token, 0 for a padded slot.
    TokenValid,
    /// Which beam each row continues: 0 (a stateful export's `beam_idx`).
    BeamIdx,
    /// Per-layer graphs: the residual stream entering the layer (padded slots repeat the last row).
    Hidden,
}

impl InputRole {
    /// The manifest's key of the role.
    pub fn key(self) -> &'static str {
        match self {
            InputRole::InputIds => "input_ids",
            InputRole::Embeddings => "embeddings",
            InputRole::Positions => "positions",
            InputRole::AttentionMask(_) => "attention_mask",
            InputRole::TokenValid => "token_valid",
            InputRole::BeamIdx => "beam_idx",
            InputRole::Hidden => "hidden",
        }
    }
}

/// The values of an attention mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskValues {
    /// 1 where a query may attend, 0 elsewhere (in the port's type).
    Ones,
    /// 0 where a query may attend, −inf elsewhere (an additive bias, float).
    Bias,
}

/// Which rows of logits a graph outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// Every slot's.
    All,
    /// The last slot's only.
    Last,
}

/// A state of a layer, as the dump names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateKind {
    /// A DeltaNet layer's conv state `[channels, kernel]`.
    Conv,
    /// A DeltaNet layer's recurrent state `[heads, key_dim, value_dim]`.
    Recurrent,
    /// An attention layer's keys `[kv_heads, positions, head_dim]`.
    Keys,
    /// An attention layer's values.
    Values,
}

impl StateKind {
    /// Every kind, in the manifest's order.
    pub const ALL: [StateKind; 4] = [
        StateKind::Conv,
        StateKind::Recurrent,
        StateKind::Keys,
        StateKind::Values,
    ];

    /// The manifest's key, which is the dump's name less `layers.{i}.`.
    pub fn key(self) -> &'static str {
        match self {
            StateKind::Conv => "conv_state",
            StateKind::Recurrent => "recurrent_state",
            StateKind::Keys => "key_cache",
            StateKind::Values => "value_cache",
        }
    }

    /// The layer kind that has this state.
    pub fn layer_kind(self) -> LayerKind {
        match self {
            StateKind::Conv | StateKind::Recurrent => LayerKind::Linear,
            StateKind::Keys | StateKind::Values => LayerKind::Full,
        }
    }

    /// The dump's axes of the state, in the dump's order; a cache's positions are [`Axis::Past`].
    pub fn canonical(self) -> &'static [Axis] {
        match self {
            StateKind::Conv => &[Axis::Channels, Axis::Kernel],
            StateKind::Recurrent => &[Axis::Heads, Axis::KeyDim, Axis::ValueDim],
            StateKind::Keys | StateKind::Values => &[Axis::KvHeads, Axis::Past, Axis::HeadDim],
        }
    }

    /// The state's dump name in layer `layer`.
    pub fn dump_name(self, layer: usize) -> String {
        format!("layers.{layer}.{}", self.key())
    }

    /// The state's kind from its dump name less the layer prefix.
    pub fn from_key(key: &str) -> Option<StateKind> {
        StateKind::ALL.into_iter().find(|k| k.key() == key)
    }
}

/// How the graph updates a KV cache, told by the positions axis of the state's input and output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheUpdate {
    /// The input holds the tokens so far (`past`), the output them and this call's (`past+tokens`): a cache that
    /// grows by concatenation.
    Concat,
    /// The input and output hold the static context's slots (`context`): the graph writes this call's rows at the
    /// current length itself.
    InPlace,
    /// The input holds the static context's slots, the output this call's rows only (`tokens`): the host writes
    /// them at the current length.
    Rows,
}

/// A state of every layer of its kind, in and out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateSpec {
    /// Which state.
    pub kind: StateKind,
    /// The input's name per layer.
    pub input: Names,
    /// The output's name per layer.
    pub output: Names,
    /// Element type of both.
    pub ty: ElemKind,
    /// The input's axes.
    pub shape: Vec<Axis>,
    /// The output's axes.
    pub output_shape: Vec<Axis>,
}

impl StateSpec {
    /// How a cache is updated (`None` for a DeltaNet state, which is replaced), from the positions axes; errors name
    /// `at`.
    pub fn update(&self, at: &str) -> Result<Option<CacheUpdate>> {
        if self.kind.layer_kind() == LayerKind::Linear {
            return Ok(None);
        }
        let positions = |shape: &[Axis]| {
            shape.iter().copied().find(|a| {
                matches!(
                    a,
                    Axis::Past | Axis::PastTokens | Axis::Context | Axis::Tokens
                )
            })
        };
        match (positions(&self.shape), positions(&self.output_shape)) {
            (Some(Axis::Past), Some(Axis::PastTokens)) => Ok(Some(CacheUpdate::Concat)),
            (Some(Axis::Context), Some(Axis::Context)) => Ok(Some(CacheUpdate::InPlace)),
            (Some(Axis::Context), Some(Axis::Tokens)) => Ok(Some(CacheUpdate::Rows)),
            (i, o) => Err(Error::Config(format!(
                "{at}: a KV cache's positions go `past` → `past+tokens` (a cache that grows), `context` → `context` \
                 (static slots the graph writes) or `context` → `tokens` (the call's rows, written by the host); \
                 got `{}` → `{}`",
                i.map_or("none".into(), Axis::name),
                o.map_or("none".into(), Axis::name)
            ))),
        }
    }
}

/// Which outputs are hidden states (taps), under the dump's names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Taps {
    /// None.
    None,
    /// Every output whose name is a dump name (this project's graphs: within a layer in a per-layer graph).
    DumpNames,
    /// Dump name (a pattern with `{i}`) → the port's name(s).
    Map(Vec<(String, Names)>),
}

/// The host's rule for a call of several tokens on static graphs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptRule {
    /// Blocks of the largest size, then the tail in the smallest block that holds it, its empty slots padded and
    /// marked in `token_valid`.
    Padded,
    /// Blocks of the largest size that fits, then smaller ones, then single tokens: nothing padded.
    Blocks,
}

impl PromptRule {
    /// The manifest's name.
    pub fn name(self) -> &'static str {
        match self {
            PromptRule::Padded => "padded",
            PromptRule::Blocks => "blocks",
        }
    }
}

/// The interface every graph of one part of a set shares.
#[derive(Debug, Clone, PartialEq)]
pub struct Interface {
    /// The caches live inside the compiled model (no state ports).
    pub stateful: bool,
    /// The host rule for a prompt.
    pub prompt: PromptRule,
    /// Inputs by role.
    pub inputs: Vec<(InputRole, PortSpec)>,
    /// The decoder's logits (and which rows), or a per-layer graph's output.
    pub output: PortSpec,
    /// Which rows of logits (decoder sets).
    pub logit_rows: LogitRows,
    /// The states, in and out.
    pub states: Vec<StateSpec>,
    /// Hidden outputs.
    pub taps: Taps,
}

impl Interface {
    /// The port of an input role, if mapped.
    pub fn input(&self, key: &str) -> Option<&PortSpec> {
        self.inputs
            .iter()
            .find(|(r, _)| r.key() == key)
            .map(|(_, p)| p)
    }

    /// Whether an input role is mapped.
    pub fn has(&self, key: &str) -> bool {
        self.input(key).is_some()
    }

    /// The state of a kind, if mapped.
    pub fn state(&self, kind: StateKind) -> Option<&StateSpec> {
        self.states.iter().find(|s| s.kind == kind)
    }
}

/// One IR file of a set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphFile {
    /// Tokens per call (`None`: any number, a dynamic graph).
    pub tokens: Option<usize>,
    /// The layer, in a per-layer set.
    pub layer: Option<usize>,
    /// The `.xml`.
    pub xml: PathBuf,
    /// The `.bin`.
    pub bin: PathBuf,
}

/// One part of a set: its interface and its files.
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    /// Where the manifest describes it (`decoder`, `layers`; empty for a version-1 manifest, whose keys are at the
    /// top), for messages.
    pub key: String,
    /// The interface of every file.
    pub interface: Interface,
    /// The files.
    pub graphs: Vec<GraphFile>,
}

/// A graph set made elsewhere (or exported by this project): its files and what their ports carry.
#[derive(Debug, Clone, PartialEq)]
pub struct GraphSet {
    /// Where the description came from (the manifest, or the directory and the convention), for messages.
    pub source: String,
    /// The directory.
    pub dir: PathBuf,
    /// The checkpoint the graphs were made from, when the manifest names it (resolved against the directory).
    pub model: Option<PathBuf>,
    /// The reference weight format that holds the same weights (`f32`, `int4-nncf:32`), when the manifest says.
    pub reference_weights: Option<String>,
    /// The static context: the most tokens a sequence may hold.
    pub context: Option<usize>,
    /// The whole decoder.
    pub decoder: Option<Part>,
    /// One graph per layer (and block size).
    pub layers: Option<Part>,
    /// Static vision graphs, one per fixed set of image grids (the manifest's `vision`; [`vision`]).
    pub vision: Vec<vision::VisionGraph>,
}

impl GraphSet {
    /// Fails when the set names a layer the model does not have (`layers` of them): a per-layer graph, or a state
    /// or port name given for that layer; the error names the manifest and the layer.
    pub fn check_layers(&self, layers: usize) -> Result<()> {
        let beyond = |l: usize, what: String| -> Result<()> {
            if l >= layers {
                return Err(Error::Config(format!(
                    "{}: {what} names layer {l}, but the model has {layers} layers (0 to {})",
                    self.source,
                    layers.saturating_sub(1)
                )));
            }
            Ok(())
        };
        let names = |n: &Names, what: &str| -> Result<()> {
            if let Names::PerLayer(m) = n {
                for &l in m.keys() {
                    beyond(l, what.to_string())?;
                }
            }
            Ok(())
        };
        for part in self.decoder.iter().chain(&self.layers) {
            let key = &part.key;
            for g in &part.graphs {
                if let Some(l) = g.layer {
                    beyond(l, format!("`{key}` graph {}", g.xml.display()))?;
                }
            }
            let i = &part.interface;
            for s in &i.states {
                names(&s.input, &format!("`{key}` state input {:?}", s.kind))?;
                names(&s.output, &format!("`{key}` state output {:?}", s.kind))?;
            }
            for (role, p) in &i.inputs {
                names(&p.names, &format!("`{key}` input {role:?}"))?;
            }
            names(&i.output.names, &format!("`{key}` output"))?;
            if let Taps::Map(m) = &i.taps {
                for (dump, n) in m {
                    names(n, &format!("`{key}` tap {dump}"))?;
                }
            }
        }
        Ok(())
    }

    /// The decoder part, or an error naming what is missing.
    pub fn decoder(&self) -> Result<&Part> {
        self.decoder.as_ref().ok_or_else(|| {
            Error::Config(format!(
                "{}: the set has no `decoder` graphs (only per-layer ones)",
                self.source
            ))
        })
    }

    /// The token counts of the decoder's static graphs (empty for a dynamic or absent decoder).
    pub fn decoder_blocks(&self) -> Vec<usize> {
        let mut b: Vec<usize> = self
            .decoder
            .iter()
            .flat_map(|p| p.graphs.iter().filter_map(|g| g.tokens))
            .collect();
        b.sort_unstable();
        b.dedup();
        b
    }

    /// The layers that have per-layer graphs, and their block sizes.
    pub fn layer_blocks(&self) -> BTreeMap<usize, Vec<usize>> {
        let mut m: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for g in self.layers.iter().flat_map(|p| &p.graphs) {
            if let (Some(l), Some(t)) = (g.layer, g.tokens) {
                m.entry(l).or_default().push(t);
            }
        }
        for v in m.values_mut() {
            v.sort_unstable();
            v.dedup();
        }
        m
    }
}
