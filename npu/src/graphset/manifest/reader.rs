//! Reading a manifest's JSON, key by key: every value checked, every error naming the manifest and the key.

use crate::error::{Error, Result};
use crate::graphset::{
    Axis, ElemKind, GraphFile, InputRole, Interface, LogitRows, MaskValues, Names, Part, PortSpec,
    PromptRule, StateKind, StateSpec, Taps,
};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// A manifest being read: the file for messages, and the directory paths resolve against.
pub(super) struct Reader<'a> {
    pub(super) source: &'a str,
    pub(super) dir: &'a Path,
}

impl Reader<'_> {
    pub(super) fn err(&self, at: &str, message: impl std::fmt::Display) -> Error {
        Error::Config(format!("{}: `{at}`: {message}", self.source))
    }

    pub(super) fn object<'v>(&self, v: &'v Value, at: &str) -> Result<&'v Map<String, Value>> {
        v.as_object()
            .ok_or_else(|| self.err(at, "expected an object"))
    }

    pub(super) fn string<'v>(&self, v: &'v Value, at: &str) -> Result<&'v str> {
        v.as_str().ok_or_else(|| self.err(at, "expected a string"))
    }

    pub(super) fn count(&self, v: &Value, at: &str) -> Result<usize> {
        v.as_u64()
            .filter(|&n| n > 0)
            .map(|n| n as usize)
            .ok_or_else(|| self.err(at, "expected a whole number ≥ 1"))
    }

    /// Only the keys in `known` (the others are refused, naming them).
    pub(super) fn known(&self, m: &Map<String, Value>, at: &str, known: &[&str]) -> Result<()> {
        if let Some(k) = m.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(self.err(
                &format!("{at}.{k}"),
                format!("not a key here (expected one of {})", known.join(", ")),
            ));
        }
        Ok(())
    }

    pub(super) fn axes(&self, v: &Value, at: &str) -> Result<Vec<Axis>> {
        let list = v
            .as_array()
            .ok_or_else(|| self.err(at, "expected a list of axes"))?;
        list.iter()
            .enumerate()
            .map(|(i, a)| match a {
                Value::String(s) => Axis::parse(s).ok_or_else(|| {
                    self.err(
                        &format!("{at}[{i}]"),
                        format!(
                            "unknown axis `{s}` (expected {} or a number)",
                            Axis::NAMED
                                .iter()
                                .map(|(_, n)| *n)
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    )
                }),
                Value::Number(_) => Ok(Axis::Fixed(self.count(a, &format!("{at}[{i}]"))?)),
                _ => Err(self.err(&format!("{at}[{i}]"), "expected an axis name or a number")),
            })
            .collect()
    }

    pub(super) fn ty(&self, v: Option<&Value>, at: &str, default: ElemKind) -> Result<ElemKind> {
        match v {
            None => Ok(default),
            Some(v) => {
                let s = self.string(v, at)?;
                ElemKind::parse(s).ok_or_else(|| {
                    self.err(
                        at,
                        format!("type `{s}` (expected f32, f16, i64, i32 or boolean)"),
                    )
                })
            }
        }
    }

    pub(super) fn names(&self, v: &Value, at: &str) -> Result<Names> {
        match v {
            Value::String(s) => Ok(Names::Pattern(s.clone())),
            Value::Object(m) => m
                .iter()
                .map(|(k, v)| {
                    let layer = k.parse::<usize>().map_err(|_| {
                        self.err(&format!("{at}.{k}"), "a per-layer name's key is the layer number")
                    })?;
                    Ok((layer, self.string(v, &format!("{at}.{k}"))?.to_string()))
                })
                .collect::<Result<BTreeMap<_, _>>>()
                .map(Names::PerLayer),
            _ => Err(self.err(
                at,
                "expected a name (a pattern with {i} for the layer, {j} for its index among its kind) or an \
                 object of layer → name",
            )),
        }
    }

    /// A port: `{"name", "type", "shape"}` (type and shape defaulted by the role when absent).
    pub(super) fn port(
        &self,
        v: &Value,
        at: &str,
        default: (ElemKind, &[Axis]),
        extra: &[&str],
    ) -> Result<PortSpec> {
        let m = self.object(v, at)?;
        let mut known = vec!["name", "type", "shape", "meaning"];
        known.extend_from_slice(extra);
        self.known(m, at, &known)?;
        let name = m
            .get("name")
            .ok_or_else(|| self.err(&format!("{at}.name"), "missing"))?;
        Ok(PortSpec {
            names: self.names(name, &format!("{at}.name"))?,
            ty: self.ty(m.get("type"), &format!("{at}.type"), default.0)?,
            shape: match m.get("shape") {
                Some(s) => self.axes(s, &format!("{at}.shape"))?,
                None => default.1.to_vec(),
            },
        })
    }

    pub(super) fn graphs(&self, v: &Value, at: &str, per_layer: bool) -> Result<Vec<GraphFile>> {
        let list = v
            .as_array()
            .ok_or_else(|| self.err(at, "expected a list of graph files"))?;
        if list.is_empty() {
            return Err(self.err(at, "no graph files"));
        }
        let mut out = Vec::new();
        for (i, g) in list.iter().enumerate() {
            let at = format!("{at}[{i}]");
            let m = self.object(g, &at)?;
            self.known(m, &at, &["tokens", "layer", "xml", "bin", "name", "kind"])?;
            let xml = self.string(
                m.get("xml")
                    .ok_or_else(|| self.err(&format!("{at}.xml"), "missing"))?,
                &format!("{at}.xml"),
            )?;
            let xml = self.dir.join(xml);
            let bin = match m.get("bin") {
                Some(b) => self.dir.join(self.string(b, &format!("{at}.bin"))?),
                None => xml.with_extension("bin"),
            };
            let tokens = match m.get("tokens") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) if s == "any" => None,
                Some(t) => Some(self.count(t, &format!("{at}.tokens"))?),
            };
            let layer =
                match (m.get("layer"), per_layer) {
                    (Some(l), true) => Some(l.as_u64().ok_or_else(|| {
                        self.err(&format!("{at}.layer"), "expected a layer number")
                    })? as usize),
                    (None, true) => return Err(self.err(&format!("{at}.layer"), "missing")),
                    (Some(_), false) => {
                        return Err(self.err(
                            &format!("{at}.layer"),
                            "a decoder graph is every layer; per-layer graphs go under `layers`",
                        ));
                    }
                    (None, false) => None,
                };
            if per_layer && tokens.is_none() {
                return Err(self.err(
                    &format!("{at}.tokens"),
                    "a per-layer graph needs its tokens per call",
                ));
            }
            // Two files for one call (one layer, one token count) leave which one runs to chance.
            if let Some(j) = out.iter().position(|g: &GraphFile| {
                g.layer == layer && g.tokens == tokens && (g.xml != xml || g.bin != bin)
            }) {
                let which = match layer {
                    Some(l) => format!("layer {l}"),
                    None => "the decoder".to_string(),
                };
                let calls = match tokens {
                    Some(t) => format!("{t} tokens"),
                    None => "any token count".to_string(),
                };
                return Err(self.err(
                    &at,
                    format!(
                        "a second graph of {which} for {calls} ({} and {}, entry {j}): one graph per layer and \
                         token count",
                        xml.display(),
                        out[j].xml.display()
                    ),
                ));
            }
            out.push(GraphFile {
                tokens,
                layer,
                xml,
                bin,
            });
        }
        Ok(out)
    }

    pub(super) fn taps(&self, v: Option<&Value>, at: &str) -> Result<Taps> {
        match v {
            None | Some(Value::Null) => Ok(Taps::None),
            Some(Value::String(s)) if s == "dump" => Ok(Taps::DumpNames),
            Some(Value::Object(m)) => m
                .iter()
                .map(|(dump, port)| Ok((dump.clone(), self.names(port, &format!("{at}.{dump}"))?)))
                .collect::<Result<Vec<_>>>()
                .map(Taps::Map),
            Some(_) => Err(self.err(
                at,
                "expected \"dump\" (outputs under the dump's names) or an object of dump name → port name",
            )),
        }
    }

    pub(super) fn part(&self, v: &Value, at: &str, per_layer: bool) -> Result<Part> {
        let m = self.object(v, at)?;
        self.known(
            m,
            at,
            &[
                "graphs", "stateful", "prompt", "inputs", "outputs", "states", "taps", "meaning",
            ],
        )?;
        let graphs = self.graphs(
            m.get("graphs")
                .ok_or_else(|| self.err(&format!("{at}.graphs"), "missing"))?,
            &format!("{at}.graphs"),
            per_layer,
        )?;
        let stateful = match m.get("stateful") {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(&format!("{at}.stateful"), "expected true or false"))?,
        };
        let prompt = match m.get("prompt") {
            None => PromptRule::Padded,
            Some(v) => match self.string(v, &format!("{at}.prompt"))? {
                "padded" => PromptRule::Padded,
                "blocks" => PromptRule::Blocks,
                other => {
                    return Err(self.err(
                        &format!("{at}.prompt"),
                        format!("`{other}` (expected padded or blocks)"),
                    ));
                }
            },
        };
        let inputs_at = format!("{at}.inputs");
        let inputs_v = self.object(
            m.get("inputs")
                .ok_or_else(|| self.err(&inputs_at, "missing"))?,
            &inputs_at,
        )?;
        let roles: &[&str] = if per_layer {
            &["hidden", "token_valid", "attention_mask", "positions"]
        } else {
            &[
                "input_ids",
                "embeddings",
                "positions",
                "attention_mask",
                "token_valid",
                "beam_idx",
            ]
        };
        self.known(inputs_v, &inputs_at, roles)?;
        let mut inputs = Vec::new();
        for (key, v) in inputs_v {
            let at = format!("{inputs_at}.{key}");
            let (role, default): (InputRole, (ElemKind, &[Axis])) = match key.as_str() {
                "input_ids" => (
                    InputRole::InputIds,
                    (ElemKind::I64, &[Axis::Batch, Axis::Tokens]),
                ),
                "embeddings" => (
                    InputRole::Embeddings,
                    (ElemKind::F32, &[Axis::Batch, Axis::Tokens, Axis::Hidden]),
                ),
                "hidden" => (
                    InputRole::Hidden,
                    (ElemKind::F32, &[Axis::Tokens, Axis::Hidden]),
                ),
                "positions" => (
                    InputRole::Positions,
                    (ElemKind::I64, &[Axis::Batch, Axis::Tokens]),
                ),
                "token_valid" => (InputRole::TokenValid, (ElemKind::F32, &[Axis::Tokens])),
                "beam_idx" => (InputRole::BeamIdx, (ElemKind::I32, &[Axis::Batch])),
                _ => {
                    let values = match self.object(v, &at)?.get("values") {
                        None => MaskValues::Ones,
                        Some(x) => match self.string(x, &format!("{at}.values"))? {
                            "ones" => MaskValues::Ones,
                            "bias" => MaskValues::Bias,
                            other => {
                                return Err(self.err(
                                    &format!("{at}.values"),
                                    format!("`{other}` (expected ones or bias)"),
                                ));
                            }
                        },
                    };
                    (
                        InputRole::AttentionMask(values),
                        (ElemKind::I64, &[Axis::Batch, Axis::PastTokens]),
                    )
                }
            };
            inputs.push((role, self.port(v, &at, default, &["values"])?));
        }
        if !per_layer
            && !inputs
                .iter()
                .any(|(r, _)| matches!(r, InputRole::InputIds | InputRole::Embeddings))
        {
            return Err(self.err(&inputs_at, "maps neither `input_ids` nor `embeddings`"));
        }
        if per_layer && !inputs.iter().any(|(r, _)| *r == InputRole::Hidden) {
            return Err(self.err(&format!("{inputs_at}.hidden"), "missing"));
        }
        let outputs_at = format!("{at}.outputs");
        let outputs = self.object(
            m.get("outputs")
                .ok_or_else(|| self.err(&outputs_at, "missing"))?,
            &outputs_at,
        )?;
        let (main, default): (&str, (ElemKind, &[Axis])) = if per_layer {
            ("output", (ElemKind::F32, &[Axis::Tokens, Axis::Hidden]))
        } else {
            (
                "logits",
                (ElemKind::F32, &[Axis::Batch, Axis::Tokens, Axis::Vocab]),
            )
        };
        self.known(outputs, &outputs_at, &[main])?;
        let main_at = format!("{outputs_at}.{main}");
        let out_v = outputs
            .get(main)
            .ok_or_else(|| self.err(&main_at, "missing"))?;
        let output = self.port(out_v, &main_at, default, &["rows"])?;
        let logit_rows = match self.object(out_v, &main_at)?.get("rows") {
            None => LogitRows::All,
            Some(r) => match self.string(r, &format!("{main_at}.rows"))? {
                "all" => LogitRows::All,
                "last" => LogitRows::Last,
                other => {
                    return Err(self.err(
                        &format!("{main_at}.rows"),
                        format!("`{other}` (expected all or last)"),
                    ));
                }
            },
        };
        let mut states = Vec::new();
        if let Some(sv) = m.get("states") {
            let states_at = format!("{at}.states");
            let sm = self.object(sv, &states_at)?;
            let keys: Vec<&str> = StateKind::ALL.iter().map(|k| k.key()).collect();
            self.known(sm, &states_at, &keys)?;
            for (key, v) in sm {
                let at = format!("{states_at}.{key}");
                let kind =
                    StateKind::from_key(key).ok_or_else(|| self.err(&at, "unknown state"))?;
                let s = self.object(v, &at)?;
                self.known(
                    s,
                    &at,
                    &[
                        "input",
                        "output",
                        "type",
                        "shape",
                        "output_shape",
                        "meaning",
                    ],
                )?;
                let get = |k: &str| {
                    s.get(k)
                        .ok_or_else(|| self.err(&format!("{at}.{k}"), "missing"))
                };
                let shape = self.axes(get("shape")?, &format!("{at}.shape"))?;
                let output_shape = match s.get("output_shape") {
                    Some(o) => self.axes(o, &format!("{at}.output_shape"))?,
                    None => shape
                        .iter()
                        .map(|&a| if a == Axis::Past { Axis::PastTokens } else { a })
                        .collect(),
                };
                let spec = StateSpec {
                    kind,
                    input: self.names(get("input")?, &format!("{at}.input"))?,
                    output: self.names(get("output")?, &format!("{at}.output"))?,
                    ty: self.ty(s.get("type"), &format!("{at}.type"), ElemKind::F32)?,
                    shape,
                    output_shape,
                };
                if !spec.ty.is_float() {
                    return Err(self.err(&format!("{at}.type"), "a state is f32 or f16"));
                }
                spec.update(&format!("{}: `{at}`", self.source))?;
                states.push(spec);
            }
        }
        if stateful && !states.is_empty() {
            return Err(self.err(
                &format!("{at}.states"),
                "a stateful decoder keeps its caches inside the model: it has no state ports",
            ));
        }
        Ok(Part {
            key: at.to_string(),
            interface: Interface {
                stateful,
                prompt,
                inputs,
                output,
                logit_rows,
                states,
                taps: self.taps(m.get("taps"), &format!("{at}.taps"))?,
            },
            graphs,
        })
    }
}
