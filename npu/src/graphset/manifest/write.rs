//! Writing a graph set's `manifest.json` (what `qwen35 export-ir` writes; [`super::manifest`] reads it back).

use super::{FORMAT, VERSION};
use crate::graphset::vision::{VisionGraph, VisionPort, VisionSide};
use crate::graphset::{
    Axis, GraphSet, InputRole, LogitRows, MaskValues, Names, Part, PortSpec, Taps,
};
use serde_json::{Map, Value, json};
use std::path::Path;

fn axes_json(shape: &[Axis]) -> Value {
    Value::Array(
        shape
            .iter()
            .map(|a| match a {
                Axis::Fixed(n) => json!(n),
                other => json!(other.name()),
            })
            .collect(),
    )
}

fn names_json(n: &Names) -> Value {
    match n {
        Names::Pattern(p) => json!(p),
        Names::PerLayer(m) => {
            Value::Object(m.iter().map(|(l, n)| (l.to_string(), json!(n))).collect())
        }
    }
}

fn port_json(p: &PortSpec) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("name".into(), names_json(&p.names));
    m.insert("type".into(), json!(p.ty.name()));
    m.insert("shape".into(), axes_json(&p.shape));
    m
}

/// A part as the manifest writes it; file paths relative to `dir`.
fn part_json(part: &Part, dir: &Path) -> Value {
    let i = &part.interface;
    let rel = |p: &Path| {
        p.strip_prefix(dir)
            .unwrap_or(p)
            .to_string_lossy()
            .into_owned()
    };
    let graphs: Vec<Value> = part
        .graphs
        .iter()
        .map(|g| {
            let mut m = Map::new();
            if let Some(l) = g.layer {
                m.insert("layer".into(), json!(l));
            }
            m.insert("tokens".into(), g.tokens.map_or(json!("any"), |t| json!(t)));
            m.insert("xml".into(), json!(rel(&g.xml)));
            m.insert("bin".into(), json!(rel(&g.bin)));
            Value::Object(m)
        })
        .collect();
    let mut inputs = Map::new();
    for (role, p) in &i.inputs {
        let mut m = port_json(p);
        if let InputRole::AttentionMask(v) = role {
            m.insert(
                "values".into(),
                json!(match v {
                    MaskValues::Ones => "ones",
                    MaskValues::Bias => "bias",
                }),
            );
        }
        inputs.insert(role.key().into(), Value::Object(m));
    }
    let mut output = port_json(&i.output);
    let main = if part.graphs.iter().any(|g| g.layer.is_some()) {
        "output"
    } else {
        output.insert(
            "rows".into(),
            json!(match i.logit_rows {
                LogitRows::All => "all",
                LogitRows::Last => "last",
            }),
        );
        "logits"
    };
    let mut states = Map::new();
    for s in &i.states {
        states.insert(
            s.kind.key().into(),
            json!({
                "input": names_json(&s.input),
                "output": names_json(&s.output),
                "type": s.ty.name(),
                "shape": axes_json(&s.shape),
                "output_shape": axes_json(&s.output_shape),
            }),
        );
    }
    let mut m = Map::new();
    m.insert("graphs".into(), Value::Array(graphs));
    if i.stateful {
        m.insert("stateful".into(), json!(true));
    }
    m.insert("prompt".into(), json!(i.prompt.name()));
    m.insert("inputs".into(), Value::Object(inputs));
    m.insert("outputs".into(), json!({ main: Value::Object(output) }));
    if !states.is_empty() {
        m.insert("states".into(), Value::Object(states));
    }
    if let Some(t) = taps_json(&i.taps) {
        m.insert("taps".into(), t);
    }
    Value::Object(m)
}

/// A part's or a vision graph's `taps` (none when it has none).
fn taps_json(taps: &Taps) -> Option<Value> {
    match taps {
        Taps::None => None,
        Taps::DumpNames => Some(json!("dump")),
        Taps::Map(list) => Some(Value::Object(
            list.iter()
                .map(|(d, n)| (d.clone(), names_json(n)))
                .collect(),
        )),
    }
}

/// A set's vision graphs as the manifest writes them (a list); file paths relative to `dir`.
fn vision_json(graphs: &[VisionGraph], dir: &Path) -> Value {
    let rel = |p: &Path| {
        p.strip_prefix(dir)
            .unwrap_or(p)
            .to_string_lossy()
            .into_owned()
    };
    let port = |p: &VisionPort, side: VisionSide| {
        let [a, b] = side.axes();
        let shape: Vec<&str> = if p.batch {
            vec!["batch", a, b]
        } else {
            vec![a, b]
        };
        json!({"name": p.name, "type": p.ty.name(), "shape": shape})
    };
    Value::Array(
        graphs
            .iter()
            .map(|g| {
                let mut m = Map::new();
                m.insert("xml".into(), json!(rel(&g.xml)));
                m.insert("bin".into(), json!(rel(&g.bin)));
                m.insert(
                    "grid_thw".into(),
                    json!(g.grids.iter().map(|g| [g.t, g.h, g.w]).collect::<Vec<_>>()),
                );
                m.insert("input".into(), port(&g.input, VisionSide::Input));
                m.insert("output".into(), port(&g.output, VisionSide::Output));
                if let Some(t) = taps_json(&g.taps) {
                    m.insert("taps".into(), t);
                }
                Value::Object(m)
            })
            .collect(),
    )
}

/// The manifest of `set` (paths relative to its directory), with `extra` keys for people (what made it).
pub fn to_json(set: &GraphSet, extra: Map<String, Value>) -> Value {
    let mut m = Map::new();
    m.insert("format".into(), json!(FORMAT));
    m.insert("version".into(), json!(VERSION));
    if let Some(model) = &set.model {
        m.insert("model".into(), json!(model.to_string_lossy()));
    }
    if let Some(w) = &set.reference_weights {
        m.insert("reference_weights".into(), json!(w));
    }
    if let Some(c) = set.context {
        m.insert("context".into(), json!(c));
    }
    if let Some(d) = &set.decoder {
        m.insert("decoder".into(), part_json(d, &set.dir));
    }
    if let Some(l) = &set.layers {
        m.insert("layers".into(), part_json(l, &set.dir));
    }
    if !set.vision.is_empty() {
        m.insert("vision".into(), vision_json(&set.vision, &set.dir));
    }
    m.extend(extra);
    Value::Object(m)
}
