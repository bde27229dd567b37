//! The names of the graphs' inputs and outputs, shared by the builder that creates them and the engine that feeds and
//! reads them. Tap outputs carry the dump's names ([`reference::taps::names`]); this module names the rest.
//!
//! A per-layer graph's ports have these names as they are; in the decoder graph every per-layer port is prefixed by
//! `layers.{i}.` ([`layer_prefix`]).

use reference::config::LayerKind;

/// Token ids `[T]` (i64), decoder graphs.
pub const INPUT_IDS: &str = "input_ids";
/// Token embeddings `[T, H]` (f32, looked up on the host), decoder graphs built to take them.
pub const EMBEDDINGS: &str = "embeddings";
/// The residual stream entering the layer `[T, H]`, per-layer graphs.
pub const HIDDEN: &str = "hidden";
/// 1 for a real token, 0 for a padded slot `[T]`.
pub const TOKEN_VALID: &str = "token_valid";
/// The additive attention bias `[T, CTX + T]` (0 or −inf).
pub const ATTENTION_MASK: &str = "attention_mask";
/// MRoPE positions `[3, T]` (i64): temporal, height and width rows.
pub const POSITIONS: &str = "positions";
/// The experts each token chose `[T, k]` (i64), an MoE block graph fed its routing
/// ([`crate::graphs::Builder::moe_block_graph`]).
pub const EXPERTS_CHOSEN: &str = "experts_chosen";
/// Their weights `[T, k]`, an MoE block graph fed its routing.
pub const EXPERT_WEIGHTS: &str = "expert_weights";

/// The ports through which a layer's state enters and leaves a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatePorts {
    /// The incoming state: `conv_state`, `recurrent_state` or `past_keys`, `past_values`.
    pub inputs: [&'static str; 2],
    /// What the graph gives back: the new conv and recurrent states, or the block's own keys and values (which the
    /// host appends to its static cache).
    pub outputs: [&'static str; 2],
}

/// The state ports of a layer of this kind.
///
/// Linear attention: `conv_state` `[C, K]` and `recurrent_state` `[Hv, Dk, Dv]` in, `conv_state_out` and
/// `recurrent_state_out` out. Full attention: `past_keys` and `past_values` `[Hkv, CTX, D]` in, `new_keys` and
/// `new_values` `[Hkv, T, D]` out.
pub fn state_ports(kind: LayerKind) -> StatePorts {
    match kind {
        LayerKind::Linear => StatePorts {
            inputs: ["conv_state", "recurrent_state"],
            outputs: ["conv_state_out", "recurrent_state_out"],
        },
        LayerKind::Full => StatePorts {
            inputs: ["past_keys", "past_values"],
            outputs: ["new_keys", "new_values"],
        },
    }
}

/// The prefix of layer `layer`'s ports in the decoder graph: `layers.{layer}.`.
pub fn layer_prefix(layer: usize) -> String {
    format!("layers.{layer}.")
}

/// [`layer_prefix`] as a graph set's name pattern: `layers.{i}.`.
pub fn layer_prefix_pattern() -> String {
    "layers.{i}.".to_string()
}

/// Whether `name` is a state port (an input when `input`, else an output) of a per-layer graph or, under
/// `layers.{i}.`, of the decoder graph.
pub fn is_state_port(name: &str, input: bool) -> bool {
    let local = name
        .strip_prefix("layers.")
        .and_then(|rest| rest.split_once('.'))
        .filter(|(layer, _)| layer.parse::<usize>().is_ok())
        .map_or(name, |(_, port)| port);
    [LayerKind::Linear, LayerKind::Full].iter().any(|&k| {
        let p = state_ports(k);
        if input { p.inputs } else { p.outputs }.contains(&local)
    })
}
