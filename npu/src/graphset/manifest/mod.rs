//! `manifest.json`: a graph set's description, read and written. The format is documented, with a worked example,
//! in `docs/graph-sets.md`; in short:
//!
//! ```json
//! {
//!   "format": "qwen35-graph-set", "version": 2,
//!   "model": "../../models/tiny", "reference_weights": "f32", "context": 1024,
//!   "decoder": {
//!     "graphs": [{"tokens": 1, "xml": "decoder_t1.xml"}, {"tokens": 16, "xml": "decoder_t16.xml"}],
//!     "prompt": "padded",
//!     "inputs": {
//!       "input_ids": {"name": "input_ids", "type": "i64", "shape": ["tokens"]},
//!       "token_valid": {"name": "token_valid", "type": "f32", "shape": ["tokens"]},
//!       "attention_mask": {"name": "attention_mask", "type": "f32", "shape": ["tokens", "context+tokens"],
//!                          "values": "bias"},
//!       "positions": {"name": "positions", "type": "i64", "shape": [3, "tokens"]}
//!     },
//!     "outputs": {"logits": {"name": "logits", "type": "f32", "shape": ["tokens", "vocab"]}},
//!     "states": {
//!       "conv_state": {"input": "layers.{i}.conv_state", "output": "layers.{i}.conv_state_out",
//!                      "type": "f32", "shape": ["channels", "kernel"]},
//!       "key_cache": {"input": "layers.{i}.past_keys", "output": "layers.{i}.new_keys", "type": "f32",
//!                     "shape": ["kv_heads", "context", "head_dim"], "output_shape": ["kv_heads", "tokens", "head_dim"]}
//!     },
//!     "taps": "dump"
//!   },
//!   "layers": {"graphs": [{"layer": 0, "tokens": 16, "xml": "layer0_t16.xml"}], "inputs": {"hidden": …}, …}
//! }
//! ```
//!
//! The first form of this manifest (`"format": "qwen35-external-ir"`, `"version": 1`: one stateful IR, its
//! `inputs` and `outputs` at the top) is still read, as a stateful decoder. `vision` lists the set's static vision
//! graphs (`{"xml", "grid_thw", "input", "output", "taps"}`, one object or a list; [`crate::graphset::vision`]).
//! Keys this module does not know are for people (the export's command, versions, what the IR holds) and are not
//! read.

mod reader;
mod vision;
mod write;

use crate::error::{Error, Result};
use crate::graphset::GraphSet;
use reader::Reader;
use serde_json::{Map, Value, json};
use std::path::{Path, PathBuf};

/// The manifest's file name inside a set's directory.
pub const MANIFEST: &str = "manifest.json";

/// The `format` of a graph-set manifest.
pub const FORMAT: &str = "qwen35-graph-set";

/// The version this module writes.
pub const VERSION: u64 = 2;

/// The `format` of the first manifest (one stateful IR), still read.
pub const FORMAT_V1: &str = "qwen35-external-ir";

/// Parses a manifest's text; `dir` resolves its paths, `source` names it in errors.
pub fn parse(text: &str, dir: &Path, source: &str) -> Result<GraphSet> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| Error::Config(format!("{source}: not valid JSON: {e}")))?;
    let r = Reader { source, dir };
    let m = r.object(&v, "(top)")?;
    let format = m.get("format").and_then(Value::as_str);
    if format == Some(FORMAT_V1) || (format.is_none() && m.contains_key("inputs")) {
        return parse_v1(&r, m);
    }
    if format != Some(FORMAT) {
        return Err(Error::Config(format!(
            "{source}: `format` is {}, expected \"{FORMAT}\"",
            format.map_or("missing".into(), |f| format!("\"{f}\""))
        )));
    }
    match m.get("version").and_then(Value::as_u64) {
        Some(VERSION) => {}
        other => {
            return Err(r.err(
                "version",
                format!(
                    "{} (this qwen35 reads version {VERSION})",
                    other.map_or("missing".into(), |v| v.to_string())
                ),
            ));
        }
    }
    r.known(
        m,
        "(top)",
        &[
            "format",
            "version",
            "model",
            "reference_weights",
            "context",
            "decoder",
            "layers",
            "export",
            "vision",
            "holds",
            "check",
            "meaning",
            "weights",
            "deltanet_form",
            "output_scale",
        ],
    )?;
    let context = match m.get("context") {
        None | Some(Value::Null) => None,
        Some(c) => Some(r.count(c, "context")?),
    };
    let decoder = m
        .get("decoder")
        .map(|d| r.part(d, "decoder", false))
        .transpose()?;
    let layers = m
        .get("layers")
        .map(|d| r.part(d, "layers", true))
        .transpose()?;
    if decoder.is_none() && layers.is_none() {
        return Err(Error::Config(format!(
            "{source}: neither `decoder` nor `layers`: the set has no graphs"
        )));
    }
    if let Some(l) = &layers
        && l.interface.stateful
    {
        return Err(r.err(
            "layers.stateful",
            "per-layer graphs take their states as ports",
        ));
    }
    let vision = m
        .get("vision")
        .map(|v| r.vision(v))
        .transpose()?
        .unwrap_or_default();
    let (model, reference_weights) = checkpoint(&r, m)?;
    Ok(GraphSet {
        source: source.to_string(),
        dir: dir.to_path_buf(),
        model,
        reference_weights,
        context,
        decoder,
        layers,
        vision,
    })
}

/// The manifest's `model` (resolved against its folder) and `reference_weights` (checked to be a weight format).
fn checkpoint(r: &Reader, m: &Map<String, Value>) -> Result<(Option<PathBuf>, Option<String>)> {
    let model = m
        .get("model")
        .map(|v| r.string(v, "model").map(|s| r.dir.join(s)))
        .transpose()?;
    let weights = m
        .get("reference_weights")
        .map(|v| r.string(v, "reference_weights"))
        .transpose()?;
    if let Some(w) = weights {
        reference::quant::WeightFormat::parse(w).map_err(|e| r.err("reference_weights", e))?;
    }
    Ok((model, weights.map(str::to_string)))
}

/// The first manifest: one stateful IR (`xml`, `bin`), its `inputs` and `outputs` at the top.
fn parse_v1(r: &Reader, m: &Map<String, Value>) -> Result<GraphSet> {
    match m.get("version") {
        None => {}
        Some(v) if v.as_u64() == Some(1) => {}
        Some(v) => {
            return Err(r.err(
                "version",
                format!("{v}: a manifest of format \"{FORMAT_V1}\" is version 1 (version {VERSION} is \"{FORMAT}\")"),
            ));
        }
    }
    if m.get("stateful").and_then(Value::as_bool) == Some(false) {
        return Err(r.err(
            "stateful",
            format!(
                "false: a set with explicit caches is described by a manifest of format \"{FORMAT}\" (its \
                 `decoder.states`; see docs/graph-sets.md)"
            ),
        ));
    }
    let xml = m
        .get("xml")
        .map(|v| r.string(v, "xml"))
        .transpose()?
        .unwrap_or(super::convention::OPTIMUM_XML);
    let mut graph = Map::new();
    graph.insert("xml".into(), json!(xml));
    if let Some(b) = m.get("bin") {
        graph.insert("bin".into(), b.clone());
    }
    let mut decoder = Map::new();
    decoder.insert("graphs".into(), Value::Array(vec![Value::Object(graph)]));
    decoder.insert("stateful".into(), json!(true));
    for k in ["inputs", "outputs"] {
        let mut v = m.get(k).cloned().ok_or_else(|| r.err(k, "missing"))?;
        // Version 1 called the positions `position_ids`, as optimum-intel names the port.
        if let Some(obj) = v.as_object_mut()
            && let Some(p) = obj.remove("position_ids")
        {
            obj.insert("positions".into(), p);
        }
        decoder.insert(k.into(), v);
    }
    let mut part = r.part(&Value::Object(decoder), "decoder", false)?;
    part.key = String::new();
    let (model, reference_weights) = checkpoint(r, m)?;
    Ok(GraphSet {
        source: r.source.to_string(),
        dir: r.dir.to_path_buf(),
        model,
        reference_weights,
        context: match m.get("context") {
            None | Some(Value::Null) => None,
            Some(c) => Some(r.count(c, "context")?),
        },
        decoder: Some(part),
        layers: None,
        vision: Vec::new(),
    })
}

/// Reads `dir/manifest.json`, or takes the description the IR's port names imply ([`super::convention`]) when there
/// is none. Checks that every file exists.
pub fn open(dir: &Path) -> Result<GraphSet> {
    if !dir.is_dir() {
        return Err(Error::Config(format!("{}: not a directory", dir.display())));
    }
    let path = dir.join(MANIFEST);
    let set = if path.exists() {
        let text = reference::inputs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        parse(&text, dir, &path.display().to_string())?
    } else {
        super::convention::detect(dir)?
    };
    let files = set
        .decoder
        .iter()
        .chain(&set.layers)
        .flat_map(|p| &p.graphs)
        .map(|g| (&g.xml, &g.bin))
        .chain(set.vision.iter().map(|g| (&g.xml, &g.bin)));
    for (xml, bin) in files {
        for (key, file) in [("xml", xml), ("bin", bin)] {
            if !file.exists() {
                return Err(Error::Config(format!(
                    "{}: the {key} file {} does not exist",
                    set.source,
                    file.display()
                )));
            }
            reference::inputs::declare(file).map_err(|e| {
                Error::Config(format!(
                    "{}: the {key} file {}: {e}",
                    set.source,
                    file.display()
                ))
            })?;
        }
    }
    Ok(set)
}

pub use write::to_json;
