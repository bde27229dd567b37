//! This project's graphs ([`crate::graphs`]) described as a graph set: the interface the engine runs them through,
//! and the one `qwen35 export-ir` writes into its manifest, so that its output is read back as any graph set made
//! elsewhere. The port names are [`crate::graphs::ports`]'s.

use super::{
    Axis, ElemKind, InputRole, Interface, LogitRows, MaskValues, Names, PortSpec, PromptRule,
    StateKind, StateSpec, Taps,
};
use crate::graphs::ports;
use reference::config::{Config, LayerKind};
use reference::taps::names;

/// The state ports of this project's graphs, under `prefix` (`layers.{i}.` in the decoder, none in a per-layer
/// graph): conv and recurrent states replaced, the KV cache a static context whose new rows the host writes.
fn states(config: &Config, prefix: &str) -> Vec<StateSpec> {
    let mut out = Vec::new();
    let has = |k: LayerKind| config.layer_types.contains(&k);
    let name = |p: &str| Names::Pattern(format!("{prefix}{p}"));
    if has(LayerKind::Linear) {
        let p = ports::state_ports(LayerKind::Linear);
        out.push(StateSpec {
            kind: StateKind::Conv,
            input: name(p.inputs[0]),
            output: name(p.outputs[0]),
            ty: ElemKind::F32,
            shape: vec![Axis::Channels, Axis::Kernel],
            output_shape: vec![Axis::Channels, Axis::Kernel],
        });
        out.push(StateSpec {
            kind: StateKind::Recurrent,
            input: name(p.inputs[1]),
            output: name(p.outputs[1]),
            ty: ElemKind::F32,
            shape: vec![Axis::Heads, Axis::KeyDim, Axis::ValueDim],
            output_shape: vec![Axis::Heads, Axis::KeyDim, Axis::ValueDim],
        });
    }
    if has(LayerKind::Full) {
        let p = ports::state_ports(LayerKind::Full);
        for (i, kind) in [StateKind::Keys, StateKind::Values].into_iter().enumerate() {
            out.push(StateSpec {
                kind,
                input: name(p.inputs[i]),
                output: name(p.outputs[i]),
                ty: ElemKind::F32,
                shape: vec![Axis::KvHeads, Axis::Context, Axis::HeadDim],
                output_shape: vec![Axis::KvHeads, Axis::Tokens, Axis::HeadDim],
            });
        }
    }
    out
}

/// The block inputs every graph of `config` reads: `token_valid` (DeltaNet layers), the attention bias and the MRoPE
/// positions (attention layers).
fn block_inputs(config: &Config) -> Vec<(InputRole, PortSpec)> {
    let mut out = Vec::new();
    if config.layer_types.contains(&LayerKind::Linear) {
        out.push((
            InputRole::TokenValid,
            PortSpec::new(ports::TOKEN_VALID, ElemKind::F32, &[Axis::Tokens]),
        ));
    }
    if config.layer_types.contains(&LayerKind::Full) {
        out.push((
            InputRole::AttentionMask(MaskValues::Bias),
            PortSpec::new(
                ports::ATTENTION_MASK,
                ElemKind::F32,
                &[Axis::Tokens, Axis::ContextTokens],
            ),
        ));
        out.push((
            InputRole::Positions,
            PortSpec::new(
                ports::POSITIONS,
                ElemKind::I64,
                &[Axis::Fixed(3), Axis::Tokens],
            ),
        ));
    }
    out
}

/// The interface of this project's decoder graphs (built with taps or not, taking token ids or embeddings).
pub fn decoder(config: &Config, taps: bool, embeddings_input: bool) -> Interface {
    let mut inputs = vec![if embeddings_input {
        (
            InputRole::Embeddings,
            PortSpec::new(
                ports::EMBEDDINGS,
                ElemKind::F32,
                &[Axis::Tokens, Axis::Hidden],
            ),
        )
    } else {
        (
            InputRole::InputIds,
            PortSpec::new(ports::INPUT_IDS, ElemKind::I64, &[Axis::Tokens]),
        )
    }];
    inputs.extend(block_inputs(config));
    Interface {
        stateful: false,
        prompt: PromptRule::Padded,
        inputs,
        output: PortSpec::new(names::LOGITS, ElemKind::F32, &[Axis::Tokens, Axis::Vocab]),
        logit_rows: LogitRows::All,
        states: states(config, &ports::layer_prefix_pattern()),
        taps: if taps { Taps::DumpNames } else { Taps::None },
    }
}

/// The interface of this project's per-layer graphs (always with taps: a per-layer graph is the probe's unit). The
/// inputs of both layer kinds are listed; a graph reads those of its own kind.
pub fn layer(config: &Config) -> Interface {
    let mut inputs = vec![(
        InputRole::Hidden,
        PortSpec::new(ports::HIDDEN, ElemKind::F32, &[Axis::Tokens, Axis::Hidden]),
    )];
    inputs.extend(block_inputs(config));
    Interface {
        stateful: false,
        prompt: PromptRule::Padded,
        inputs,
        output: PortSpec::new(names::OUTPUT, ElemKind::F32, &[Axis::Tokens, Axis::Hidden]),
        logit_rows: LogitRows::All,
        states: states(config, ""),
        taps: Taps::DumpNames,
    }
}
