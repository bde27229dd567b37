//! The small manifest that maps an external IR's ports to the roles the backend feeds and reads, and the defaults
//! (optimum-intel's stateful decoder interface) when a directory has none.
//!
//! ```json
//! {
//!   "xml": "openvino_model.xml", "bin": "openvino_model.bin", "stateful": true,
//!   "model": "../../models/tiny", "reference_weights": "int4-nncf:32",
//!   "inputs": {
//!     "input_ids":      {"name": "input_ids",      "type": "i64", "shape": ["batch", "tokens"]},
//!     "attention_mask": {"name": "attention_mask", "type": "i64", "shape": ["batch", "past+tokens"]},
//!     "position_ids":   {"name": "position_ids",   "type": "i64", "shape": ["batch", "tokens"]},
//!     "beam_idx":       {"name": "beam_idx",       "type": "i32", "shape": ["batch"]}
//!   },
//!   "outputs": {"logits": {"name": "logits", "type": "f32", "shape": ["batch", "tokens", "vocab"]}}
//! }
//! ```
//!
//! Roles: `input_ids` (the call's token ids) and `logits` are required; `attention_mask` (1 for every token so far),
//! `position_ids` (the call's text positions) and `beam_idx` (0: one sequence) are fed when mapped. A shape is a list
//! of dims: `batch` (1), `tokens` (the call's), `past+tokens` (every token so far), `vocab`, or a number (an MRoPE
//! `position_ids` is `[3, "batch", "tokens"]`, its rows equal for text). Other keys (the export's command, versions,
//! what it holds) are for people and are not read.
//!
//! `context` (optional) declares a static context: the most tokens one sequence may hold (an IR exported with a
//! fixed-size cache, as static-shape NPU pipelines are). The backend then refuses a call that would go past it,
//! naming it, rather than let the IR cut or overflow; without it the IR takes sequences of any length.

use crate::error::{Error, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The manifest's file name inside an IR directory.
pub const MANIFEST: &str = "manifest.json";

/// The IR file name optimum-intel writes.
pub const DEFAULT_XML: &str = "openvino_model.xml";

/// What the backend feeds: the input roles.
pub const INPUT_ROLES: [&str; 4] = ["input_ids", "attention_mask", "position_ids", "beam_idx"];

/// What the backend reads: the output roles.
pub const OUTPUT_ROLES: [&str; 1] = ["logits"];

/// One dimension of a port's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// The batch: 1.
    Batch,
    /// The call's tokens.
    Tokens,
    /// Every token so far, this call's included.
    PastAndTokens,
    /// The vocabulary (outputs).
    Vocab,
    /// A fixed size.
    Fixed(usize),
}

impl Dim {
    fn parse(v: &serde_json::Value, at: &str) -> Result<Dim> {
        match v {
            serde_json::Value::String(s) => match s.as_str() {
                "batch" => Ok(Dim::Batch),
                "tokens" => Ok(Dim::Tokens),
                "past+tokens" => Ok(Dim::PastAndTokens),
                "vocab" => Ok(Dim::Vocab),
                other => Err(Error::Config(format!(
                    "{at}: unknown dim `{other}` (expected batch, tokens, past+tokens, vocab or a number)"
                ))),
            },
            serde_json::Value::Number(n) => n
                .as_u64()
                .filter(|&n| n > 0)
                .map(|n| Dim::Fixed(n as usize))
                .ok_or_else(|| {
                    Error::Config(format!("{at}: dim {n} is not a positive whole number"))
                }),
            other => Err(Error::Config(format!(
                "{at}: dim {other} is neither a name nor a number"
            ))),
        }
    }

    /// The size for a call of `tokens` after `past` tokens, for a vocabulary of `vocab`.
    pub fn size(self, tokens: usize, past: usize, vocab: usize) -> usize {
        match self {
            Dim::Batch => 1,
            Dim::Tokens => tokens,
            Dim::PastAndTokens => past + tokens,
            Dim::Vocab => vocab,
            Dim::Fixed(n) => n,
        }
    }
}

/// The element type of an input the backend fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortType {
    /// 64-bit integers.
    I64,
    /// 32-bit integers.
    I32,
    /// 32-bit floats.
    F32,
}

/// One port of the IR, by role.
#[derive(Debug, Clone, PartialEq)]
pub struct Port {
    /// The role (`input_ids`, `logits`, …).
    pub role: String,
    /// The IR's name for it.
    pub name: String,
    /// Its element type.
    pub ty: PortType,
    /// Its shape.
    pub shape: Vec<Dim>,
}

/// An external IR's interface and files.
#[derive(Debug, Clone, PartialEq)]
pub struct IrManifest {
    /// Where the manifest came from (the file, or the directory when defaults were taken), for messages.
    pub source: String,
    /// The IR's `.xml`.
    pub xml: PathBuf,
    /// The IR's `.bin`.
    pub bin: PathBuf,
    /// The checkpoint the IR was exported from, when the manifest names it (resolved against the directory).
    pub model: Option<PathBuf>,
    /// The reference weight format that holds the same weights (`f32`, `int4-nncf:32`), when the manifest says.
    pub reference_weights: Option<String>,
    /// The static context the manifest declares (the most tokens a sequence may hold), if any.
    pub context: Option<usize>,
    /// Input ports by role.
    pub inputs: Vec<Port>,
    /// Output ports by role.
    pub outputs: Vec<Port>,
}

#[derive(Deserialize)]
struct RawManifest {
    xml: Option<String>,
    bin: Option<String>,
    #[serde(default = "yes")]
    stateful: bool,
    model: Option<String>,
    reference_weights: Option<String>,
    context: Option<usize>,
    inputs: Option<BTreeMap<String, RawPort>>,
    outputs: Option<BTreeMap<String, RawPort>>,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
struct RawPort {
    name: Option<String>,
    #[serde(rename = "type")]
    ty: Option<String>,
    shape: Option<Vec<serde_json::Value>>,
}

/// The optimum-intel interface (see the module docs): the default of every role.
fn default_port(role: &str) -> Option<(PortType, Vec<Dim>)> {
    Some(match role {
        "input_ids" => (PortType::I64, vec![Dim::Batch, Dim::Tokens]),
        "attention_mask" => (PortType::I64, vec![Dim::Batch, Dim::PastAndTokens]),
        "position_ids" => (PortType::I64, vec![Dim::Batch, Dim::Tokens]),
        "beam_idx" => (PortType::I32, vec![Dim::Batch]),
        "logits" => (PortType::F32, vec![Dim::Batch, Dim::Tokens, Dim::Vocab]),
        _ => return None,
    })
}

impl IrManifest {
    /// Reads `dir/manifest.json`, or takes the optimum-intel defaults (`openvino_model.xml`, every role under its
    /// own name) when there is none. Checks that the `.xml` and `.bin` exist.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::Config(format!(
                "--ir {}: not a directory",
                dir.display()
            )));
        }
        let path = dir.join(MANIFEST);
        let m = if path.exists() {
            let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
            Self::parse(&text, dir, &path.display().to_string())?
        } else {
            Self::defaults(dir)
        };
        for (key, file) in [("xml", &m.xml), ("bin", &m.bin)] {
            if !file.is_file() {
                return Err(Error::Config(format!(
                    "{}: the IR's {key} file {} does not exist",
                    m.source,
                    file.display()
                )));
            }
        }
        Ok(m)
    }

    /// optimum-intel's interface for the IR in `dir`.
    pub fn defaults(dir: &Path) -> Self {
        let xml = dir.join(DEFAULT_XML);
        let port = |role: &str| {
            let (ty, shape) = default_port(role).unwrap_or((PortType::F32, vec![]));
            Port {
                role: role.to_string(),
                name: role.to_string(),
                ty,
                shape,
            }
        };
        IrManifest {
            source: format!(
                "{} (no {MANIFEST}: optimum-intel's interface)",
                dir.display()
            ),
            bin: xml.with_extension("bin"),
            xml,
            model: None,
            reference_weights: None,
            context: None,
            inputs: INPUT_ROLES.iter().map(|r| port(r)).collect(),
            outputs: OUTPUT_ROLES.iter().map(|r| port(r)).collect(),
        }
    }

    /// Parses a manifest's text; `dir` resolves its paths, `source` names it in errors.
    pub fn parse(text: &str, dir: &Path, source: &str) -> Result<Self> {
        let raw: RawManifest = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("{source}: not a valid IR manifest: {e}")))?;
        if !raw.stateful {
            return Err(Error::Config(format!(
                "{source}: `stateful` is false; only stateful IRs (the caches inside the model) are supported"
            )));
        }
        let xml = dir.join(raw.xml.as_deref().unwrap_or(DEFAULT_XML));
        let bin = raw
            .bin
            .map(|b| dir.join(b))
            .unwrap_or_else(|| xml.with_extension("bin"));
        let ports = |section: &str,
                     roles: &[&str],
                     raw: Option<BTreeMap<String, RawPort>>|
         -> Result<Vec<Port>> {
            let Some(raw) = raw else {
                return Err(Error::Config(format!(
                    "{source}: key `{section}` is missing"
                )));
            };
            if let Some(unknown) = raw.keys().find(|k| !roles.contains(&k.as_str())) {
                return Err(Error::Config(format!(
                    "{source}: `{section}.{unknown}` is not a role (expected one of {})",
                    roles.join(", ")
                )));
            }
            let mut out = Vec::new();
            for (role, p) in raw {
                let at = format!("{source}: `{section}.{role}`");
                let (default_ty, default_shape) =
                    default_port(&role).unwrap_or((PortType::F32, vec![]));
                let name = p
                    .name
                    .ok_or_else(|| Error::Config(format!("{at}: key `name` is missing")))?;
                let ty = match p.ty.as_deref() {
                    None => default_ty,
                    Some("i64") => PortType::I64,
                    Some("i32") => PortType::I32,
                    Some("f32") => PortType::F32,
                    Some(other) => {
                        return Err(Error::Config(format!(
                            "{at}: type `{other}` (expected i64, i32 or f32)"
                        )));
                    }
                };
                let shape = match p.shape {
                    None => default_shape,
                    Some(dims) => dims
                        .iter()
                        .map(|d| Dim::parse(d, &format!("{at}.shape")))
                        .collect::<Result<_>>()?,
                };
                out.push(Port {
                    role,
                    name,
                    ty,
                    shape,
                });
            }
            Ok(out)
        };
        if raw.context == Some(0) {
            return Err(Error::Config(format!(
                "{source}: `context` is 0; a static context holds at least one token"
            )));
        }
        let inputs = ports("inputs", &INPUT_ROLES, raw.inputs)?;
        let outputs = ports("outputs", &OUTPUT_ROLES, raw.outputs)?;
        for (section, list, role) in [
            ("inputs", &inputs, "input_ids"),
            ("outputs", &outputs, "logits"),
        ] {
            if !list.iter().any(|p| p.role == role) {
                return Err(Error::Config(format!(
                    "{source}: key `{section}.{role}` is missing"
                )));
            }
        }
        Ok(IrManifest {
            source: source.to_string(),
            xml,
            bin,
            model: raw.model.map(|m| dir.join(m)),
            reference_weights: raw.reference_weights,
            context: raw.context,
            inputs,
            outputs,
        })
    }

    /// The port of a role, if mapped.
    pub fn input(&self, role: &str) -> Option<&Port> {
        self.inputs.iter().find(|p| p.role == role)
    }

    /// The output port of a role, if mapped.
    pub fn output(&self, role: &str) -> Option<&Port> {
        self.outputs.iter().find(|p| p.role == role)
    }
}
