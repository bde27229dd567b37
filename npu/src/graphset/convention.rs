//! Sets known by their port names, so that they need no manifest:
//!
//! - **optimum-intel's stateful export** (`openvino_model.xml`): `input_ids` `[batch, tokens]`, `attention_mask`
//!   `[batch, past+tokens]` (1 for every token so far), `position_ids` `[batch, tokens]`, `beam_idx` `[batch]`, and
//!   `logits` `[batch, tokens, vocab]`; the caches live in `ReadValue`/`Assign` variables.
//! - **the same export made stateless** by OpenVINO's
//!   `openvino._offline_transformations.stateful_to_stateless_transformation`: every variable becomes an input and
//!   an output, `past_key_values.{j}.key|value` → `present.{j}.key|value` (`[batch, kv_heads, past, head_dim]`, a
//!   cache that grows by concatenation), `cache_params.past.conv.{j}` → `cache_params.present.conv.{j}` (`[batch,
//!   channels, kernel]`) and `cache_params.past.ssm.{j}` → `cache_params.present.ssm.{j}` (`[batch, heads, key_dim,
//!   value_dim]`), where `{j}` counts the layers of each kind (the first attention layer's cache is
//!   `past_key_values.0`); `beam_idx` is gone.
//!
//! Element types and the rank of `position_ids` (an MRoPE export has three rows) are read from the IR.

use super::{
    Axis, ElemKind, GraphFile, GraphSet, InputRole, Interface, LogitRows, MaskValues, Names, Part,
    PortSpec, PromptRule, StateKind, StateSpec, Taps,
};
use crate::devices::{IrPorts, read_ports};
use crate::error::{Error, Result};
use std::path::Path;

/// The IR file name optimum-intel writes.
pub const OPTIMUM_XML: &str = "openvino_model.xml";

/// The state names of OpenVINO's stateful-to-stateless transformation: (kind, input pattern, output pattern).
pub const STATELESS_STATES: [(StateKind, &str, &str); 4] = [
    (
        StateKind::Conv,
        "cache_params.past.conv.{j}",
        "cache_params.present.conv.{j}",
    ),
    (
        StateKind::Recurrent,
        "cache_params.past.ssm.{j}",
        "cache_params.present.ssm.{j}",
    ),
    (
        StateKind::Keys,
        "past_key_values.{j}.key",
        "present.{j}.key",
    ),
    (
        StateKind::Values,
        "past_key_values.{j}.value",
        "present.{j}.value",
    ),
];

/// The element type of an IR port, or `default` when absent or of a kind a description cannot name.
fn ty_of(ports: &IrPorts, name: &str, default: ElemKind) -> ElemKind {
    ports
        .input(name)
        .or_else(|| ports.output(name))
        .and_then(|p| ElemKind::parse(&p.ty))
        .unwrap_or(default)
}

/// Whether `name` is a state input of the stateless naming.
fn is_stateless_state(name: &str) -> bool {
    name.starts_with("past_key_values.") || name.starts_with("cache_params.past.")
}

/// The common inputs of both optimum interfaces, as far as the IR has them.
fn optimum_inputs(ports: &IrPorts) -> Vec<(InputRole, PortSpec)> {
    let mut inputs = vec![(
        InputRole::InputIds,
        PortSpec::new(
            "input_ids",
            ty_of(ports, "input_ids", ElemKind::I64),
            &[Axis::Batch, Axis::Tokens],
        ),
    )];
    if ports.input("attention_mask").is_some() {
        inputs.push((
            InputRole::AttentionMask(MaskValues::Ones),
            PortSpec::new(
                "attention_mask",
                ty_of(ports, "attention_mask", ElemKind::I64),
                &[Axis::Batch, Axis::PastTokens],
            ),
        ));
    }
    if let Some(p) = ports.input("position_ids") {
        let mrope = p.shape.as_ref().is_some_and(|s| s.len() == 3);
        let shape: &[Axis] = if mrope {
            &[Axis::Fixed(3), Axis::Batch, Axis::Tokens]
        } else {
            &[Axis::Batch, Axis::Tokens]
        };
        inputs.push((
            InputRole::Positions,
            PortSpec::new(
                "position_ids",
                ty_of(ports, "position_ids", ElemKind::I64),
                shape,
            ),
        ));
    }
    if ports.input("beam_idx").is_some() {
        inputs.push((
            InputRole::BeamIdx,
            PortSpec::new(
                "beam_idx",
                ty_of(ports, "beam_idx", ElemKind::I32),
                &[Axis::Batch],
            ),
        ));
    }
    inputs
}

/// The description of the IR in `dir` that its port names imply (no manifest): optimum-intel's stateful export, or
/// it made stateless.
pub fn detect(dir: &Path) -> Result<GraphSet> {
    let xml = dir.join(OPTIMUM_XML);
    if !xml.is_file() {
        return Err(Error::Config(format!(
            "{}: there is no manifest.json, and {} (optimum-intel's IR) does not exist: describe the graphs in a \
             manifest.json (docs/graph-sets.md)",
            dir.display(),
            xml.display()
        )));
    }
    let bin = xml.with_extension("bin");
    if !bin.is_file() {
        return Err(Error::Config(format!(
            "{}: the IR's bin file {} does not exist",
            dir.display(),
            bin.display()
        )));
    }
    let ports = read_ports(&xml, &bin)?;
    let stateless = ports.inputs.iter().any(|p| is_stateless_state(&p.name));
    let what = if stateless {
        "OpenVINO's stateless naming"
    } else {
        "optimum-intel's stateful interface"
    };
    let states = if stateless {
        STATELESS_STATES
            .iter()
            .filter(|(_, input, _)| {
                let prefix = input.split("{j}").next().unwrap_or(input);
                ports.inputs.iter().any(|p| p.name.starts_with(prefix))
            })
            .map(|&(kind, input, output)| {
                let shape: Vec<Axis> = std::iter::once(Axis::Batch)
                    .chain(kind.canonical().iter().copied())
                    .collect();
                let output_shape = shape
                    .iter()
                    .map(|&a| if a == Axis::Past { Axis::PastTokens } else { a })
                    .collect();
                let first = input.replace("{j}", "0");
                StateSpec {
                    kind,
                    input: Names::fixed(input),
                    output: Names::fixed(output),
                    ty: ty_of(&ports, &first, ElemKind::F32),
                    shape,
                    output_shape,
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    let logits_ty = ty_of(&ports, "logits", ElemKind::F32);
    Ok(GraphSet {
        source: format!("{} (no manifest.json: {what})", dir.display()),
        dir: dir.to_path_buf(),
        model: None,
        reference_weights: None,
        context: None,
        decoder: Some(Part {
            key: "decoder".into(),
            interface: Interface {
                stateful: !stateless,
                prompt: PromptRule::Blocks,
                inputs: optimum_inputs(&ports),
                output: PortSpec::new(
                    "logits",
                    logits_ty,
                    &[Axis::Batch, Axis::Tokens, Axis::Vocab],
                ),
                logit_rows: LogitRows::All,
                states,
                taps: Taps::None,
            },
            graphs: vec![GraphFile {
                tokens: None,
                layer: None,
                xml,
                bin,
            }],
        }),
        layers: None,
        vision: Vec::new(),
    })
}
