//! A set's description held against the ports an IR really has: every mapped port must exist with the element type
//! and layout the description gives (each static dim checked against the size its axis takes), and every input of
//! the IR must be mapped. Errors name the port, the file and the manifest key. What passes is the interface resolved
//! for one graph: concrete names per layer.

use super::{
    Axis, CacheUpdate, ElemKind, InputRole, Interface, PortSpec, StateKind, StateSpec, Taps,
};
use crate::devices::{IrPorts, PortInfo};
use crate::error::{Error, Result};
use reference::config::{Config, LayerKind};

/// A port with its concrete name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Port {
    /// The IR's name.
    pub name: String,
    /// Element type.
    pub ty: ElemKind,
    /// Layout.
    pub shape: Vec<Axis>,
    /// Where the description gives it (`decoder.inputs.input_ids`), for messages.
    pub key: String,
}

impl Port {
    /// As a spec of one name.
    pub fn spec(&self) -> PortSpec {
        PortSpec::new(&self.name, self.ty, &self.shape)
    }
}

/// One layer's state, with its ports' names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerState {
    /// The layer.
    pub layer: usize,
    /// Which state.
    pub kind: StateKind,
    /// Its layout and type.
    pub spec: StateSpec,
    /// The input port's name.
    pub input: String,
    /// The output port's name.
    pub output: String,
    /// How a cache is updated.
    pub update: Option<CacheUpdate>,
    /// Where the description gives it, for messages.
    pub key: String,
}

/// One graph's interface, resolved and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The inputs the graph has, by role.
    pub inputs: Vec<(InputRole, Port)>,
    /// The logits, or a per-layer graph's output.
    pub output: Port,
    /// Every layer's states.
    pub states: Vec<LayerState>,
    /// Hidden outputs: the dump's name (within the layer, in a per-layer graph) and the port's.
    pub taps: Vec<(String, String)>,
}

/// What is being checked, for messages.
pub struct Subject<'a> {
    /// The description's source (the manifest).
    pub source: &'a str,
    /// `decoder` or `layers`.
    pub part: &'a str,
    /// The IR file (or the graph's name).
    pub file: &'a str,
    /// The static graph's tokens per call (`None`: dynamic).
    pub tokens: Option<usize>,
    /// The layer of a per-layer graph.
    pub layer: Option<usize>,
    /// The static context.
    pub context: Option<usize>,
}

impl Subject<'_> {
    fn err(&self, key: &str, message: impl std::fmt::Display) -> Error {
        let key = if self.part.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.part)
        };
        Error::Interface(format!(
            "{}: `{key}` ({}): {message}",
            self.source, self.file
        ))
    }
}

/// Whether an IR's element type is the one a description names.
fn same_type(ir: &str, ty: ElemKind) -> bool {
    match ty {
        ElemKind::Bool => ir == "boolean" || ir == "u8",
        other => ir == other.name(),
    }
}

/// A mapped port as the description wants it.
struct Want<'a> {
    key: &'a str,
    name: &'a str,
    ty: ElemKind,
    shape: &'a [Axis],
}

/// Checks one mapped port against the IR's `ports` (its inputs, or its outputs: `side`).
fn check_port(
    s: &Subject,
    config: &Config,
    want: Want,
    ports: &[PortInfo],
    side: &str,
) -> Result<()> {
    let Want {
        key,
        name,
        ty,
        shape,
    } = want;
    let Some(p) = ports.iter().find(|p| p.name == name) else {
        return Err(s.err(
            key,
            format!(
                "names {side} `{name}`, which the graph does not have (its {side}s: {})",
                ports
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    };
    if !same_type(&p.ty, ty) {
        return Err(s.err(
            key,
            format!(
                "`{name}` is {} in the graph, the description says {}",
                p.ty,
                ty.name()
            ),
        ));
    }
    let Some(dims) = &p.shape else {
        return Ok(());
    };
    if dims.len() != shape.len() {
        return Err(s.err(
            key,
            format!(
                "`{name}` has {} dims in the graph, the layout [{}] has {}",
                dims.len(),
                shape
                    .iter()
                    .map(|a| a.name())
                    .collect::<Vec<_>>()
                    .join(", "),
                shape.len()
            ),
        ));
    }
    for (i, (d, a)) in dims.iter().zip(shape).enumerate() {
        // A graph whose token axis is static takes that many tokens a call, whatever its entry says: an entry that
        // gives no `tokens` (any count) would be fed other counts and fail inside the runtime.
        if let (Some(d), Axis::Tokens | Axis::ContextTokens, None) = (d, a, s.tokens) {
            return Err(s.err(
                key,
                format!(
                    "`{name}` dim {i} (`{}`) is static in the graph ({d}), but its entry gives no `tokens` (any \
                     count): give the graph's tokens per call as the entry's `tokens`",
                    a.name()
                ),
            ));
        }
        let expected = match a {
            Axis::Tokens => s.tokens,
            Axis::ContextTokens => s.tokens.zip(s.context).map(|(t, c)| t + c),
            other => other.static_size(config, s.context),
        };
        if let (Some(d), Some(e)) = (d, expected)
            && *d != e
        {
            return Err(s.err(
                key,
                format!(
                    "`{name}` dim {i} is {d} in the graph, but `{}` is {e} here",
                    a.name()
                ),
            ));
        }
    }
    Ok(())
}

/// Whether a per-layer graph of `kind` may lack an input role (a DeltaNet layer reads no mask or positions, an
/// attention layer no `token_valid`).
fn optional_for(role: InputRole, kind: Option<LayerKind>) -> bool {
    matches!(
        (role, kind),
        (InputRole::TokenValid, Some(LayerKind::Full))
            | (
                InputRole::AttentionMask(_) | InputRole::Positions,
                Some(LayerKind::Linear)
            )
    )
}

/// The states of `layer` as `iface` maps them (an error names a state the layer's kind needs and the description
/// lacks).
fn layer_states(
    s: &Subject,
    config: &Config,
    iface: &Interface,
    layer: usize,
) -> Result<Vec<LayerState>> {
    let kind = config.layer_types[layer];
    let mut out = Vec::new();
    for sk in StateKind::ALL
        .into_iter()
        .filter(|k| k.layer_kind() == kind)
    {
        let key = format!("states.{}", sk.key());
        let spec = iface.state(sk).ok_or_else(|| {
            s.err(
                &key,
                format!("missing: layer {layer} ({}) has this state", kind.name()),
            )
        })?;
        let name = |n: &super::Names, which: &str| {
            n.resolve(config, layer).ok_or_else(|| {
                s.err(
                    &format!("{key}.{which}"),
                    format!("no name for layer {layer}"),
                )
            })
        };
        out.push(LayerState {
            layer,
            kind: sk,
            input: name(&spec.input, "input")?,
            output: name(&spec.output, "output")?,
            update: spec.update(&format!("{}: `{}.{key}`", s.source, s.part))?,
            spec: spec.clone(),
            key,
        });
    }
    Ok(out)
}

/// Resolves `iface` for one graph and checks it against the graph's `ports`.
pub fn resolve(
    s: &Subject,
    config: &Config,
    iface: &Interface,
    ports: &IrPorts,
) -> Result<Resolved> {
    let kind = s.layer.map(|l| config.layer_types[l]);
    let layer_for_names = s.layer.unwrap_or(0);
    let mut inputs = Vec::new();
    for (role, spec) in &iface.inputs {
        let key = format!("inputs.{}", role.key());
        let name = spec
            .names
            .resolve(config, layer_for_names)
            .ok_or_else(|| s.err(&key, "no name for this graph"))?;
        if ports.input(&name).is_none() && optional_for(*role, kind) {
            continue;
        }
        check_port(
            s,
            config,
            Want {
                key: &key,
                name: &name,
                ty: spec.ty,
                shape: &spec.shape,
            },
            &ports.inputs,
            "input",
        )?;
        if let (InputRole::Embeddings | InputRole::Hidden, false) = (role, spec.ty.is_float()) {
            return Err(s.err(&key, "hidden states are float"));
        }
        inputs.push((
            *role,
            Port {
                name,
                ty: spec.ty,
                shape: spec.shape.clone(),
                key,
            },
        ));
    }
    let out_key = if s.layer.is_some() {
        "outputs.output"
    } else {
        "outputs.logits"
    };
    let out_name = iface
        .output
        .names
        .resolve(config, layer_for_names)
        .ok_or_else(|| s.err(out_key, "no name for this graph"))?;
    check_port(
        s,
        config,
        Want {
            key: out_key,
            name: &out_name,
            ty: iface.output.ty,
            shape: &iface.output.shape,
        },
        &ports.outputs,
        "output",
    )?;
    if !iface.output.ty.is_float() {
        return Err(s.err(out_key, "logits and hidden states are float"));
    }
    let mut states = Vec::new();
    if !iface.stateful {
        let layers: Vec<usize> = match s.layer {
            Some(l) => vec![l],
            None => (0..config.num_layers()).collect(),
        };
        for l in layers {
            for st in layer_states(s, config, iface, l)? {
                if st.update.is_some_and(|u| u != CacheUpdate::Concat) && s.context.is_none() {
                    return Err(s.err(
                        &st.key,
                        "a static KV cache needs `context` (the most tokens a sequence may hold) in the manifest",
                    ));
                }
                check_port(
                    s,
                    config,
                    Want {
                        key: &format!("{}.input", st.key),
                        name: &st.input,
                        ty: st.spec.ty,
                        shape: &st.spec.shape,
                    },
                    &ports.inputs,
                    "input",
                )?;
                check_port(
                    s,
                    config,
                    Want {
                        key: &format!("{}.output", st.key),
                        name: &st.output,
                        ty: st.spec.ty,
                        shape: &st.spec.output_shape,
                    },
                    &ports.outputs,
                    "output",
                )?;
                states.push(st);
            }
        }
    }
    let mapped = |name: &str| {
        inputs.iter().any(|(_, p)| p.name == name) || states.iter().any(|st| st.input == name)
    };
    if let Some(unmapped) = ports.inputs.iter().find(|p| !mapped(&p.name)) {
        return Err(Error::Interface(format!(
            "{}: {} has input `{}`, which the description maps to no role{}",
            s.source,
            s.file,
            unmapped.name,
            if iface.stateful {
                " (a stateful decoder has no state ports: is the graph stateless? describe its states under \
                 `decoder.states`)"
            } else {
                ""
            }
        )));
    }
    let state_outputs: Vec<&str> = states.iter().map(|st| st.output.as_str()).collect();
    let taps = match &iface.taps {
        Taps::None => Vec::new(),
        Taps::DumpNames => ports
            .outputs
            .iter()
            .filter(|p| p.name != out_name && !state_outputs.contains(&p.name.as_str()))
            .map(|p| (p.name.clone(), p.name.clone()))
            .collect(),
        Taps::Map(list) => {
            let mut out = Vec::new();
            let layers: Vec<usize> = match s.layer {
                Some(l) => vec![l],
                None => (0..config.num_layers()).collect(),
            };
            for (dump, port) in list {
                let per_layer = dump.contains("{i}");
                for &l in if per_layer {
                    &layers[..]
                } else {
                    &layers[..1.min(layers.len())]
                } {
                    let d = dump.replace("{i}", &l.to_string());
                    let Some(p) = port.resolve(config, l) else {
                        continue;
                    };
                    if ports.output(&p).is_none() {
                        return Err(s.err(
                            &format!("taps.{dump}"),
                            format!("names output `{p}`, which the graph does not have"),
                        ));
                    }
                    out.push((d, p));
                }
            }
            out
        }
    };
    Ok(Resolved {
        inputs,
        output: Port {
            name: out_name,
            ty: iface.output.ty,
            shape: iface.output.shape.clone(),
            key: out_key.into(),
        },
        states,
        taps,
    })
}
