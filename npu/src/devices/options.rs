//! What is asked of a device before compiling: the inference precision, the device configuration (a file, or
//! `QWEN35_DEVICE_CONFIG`), the model cache, and the properties they come to with this project's defaults.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The inference precision asked of a device (`INFERENCE_PRECISION_HINT`); what actually ran is read back from the
/// compiled model. (Not the reference's dtype, which is f32 or f64.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InferencePrecision {
    /// Full f32 arithmetic (reference runs).
    F32,
    /// Half precision, as an NPU computes.
    F16,
}

impl InferencePrecision {
    /// The property value.
    pub fn hint(self) -> &'static str {
        match self {
            InferencePrecision::F32 => "f32",
            InferencePrecision::F16 => "f16",
        }
    }

    /// Parses a property value (`f32`, `f16`).
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(InferencePrecision::F32),
            "f16" => Ok(InferencePrecision::F16),
            other => Err(Error::Config(format!(
                "inference precision `{other}`: expected f32 or f16"
            ))),
        }
    }
}

/// Everything set on a device before compiling.
#[derive(Debug, Clone, PartialEq)]
pub struct CompileOptions {
    /// `INFERENCE_PRECISION_HINT`.
    pub precision: InferencePrecision,
    /// Further device properties (e.g. NPUW settings), from `--device-config` or `QWEN35_DEVICE_CONFIG`.
    pub device_config: BTreeMap<String, String>,
    /// OpenVINO's on-disk model cache (`CACHE_DIR`): a compiled graph is stored there, keyed by the graph (topology
    /// and weights), the device and the properties, and a later compile of the same graph loads it instead of
    /// compiling. `None`: no cache.
    pub cache_dir: Option<PathBuf>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            precision: InferencePrecision::F32,
            device_config: BTreeMap::new(),
            cache_dir: None,
        }
    }
}

/// Whether `device` caches compiled graphs unless told otherwise: NPUs, whose first compile of a decoder takes
/// minutes (the port measured 187 s on NPU 4000 and up to 40 minutes on NPU 3720, 15-21 s from the cache).
pub fn caches_by_default(device: &str) -> bool {
    device.starts_with("NPU")
}

/// The environment variable holding device configuration as a JSON object.
pub const DEVICE_CONFIG_ENV: &str = "QWEN35_DEVICE_CONFIG";

/// Parses device configuration JSON: a flat object of property names to strings, numbers or booleans.
pub fn parse_device_config(json: &str, source: &str) -> Result<BTreeMap<String, String>> {
    let value: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| Error::Config(format!("{source}: device config is not valid JSON: {e}")))?;
    let obj = value.as_object().ok_or_else(|| {
        Error::Config(format!(
            "{source}: device config must be a JSON object of properties"
        ))
    })?;
    obj.iter()
        .map(|(k, v)| {
            let s = match v {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Number(n) => n.to_string(),
                serde_json::Value::Bool(b) => if *b { "YES" } else { "NO" }.to_string(),
                other => {
                    return Err(Error::Config(format!(
                        "{source}: property `{k}` must be a string, number or boolean, found {other}"
                    )));
                }
            };
            Ok((k.clone(), s))
        })
        .collect()
}

/// Device configuration from a file if given, else from `QWEN35_DEVICE_CONFIG` if set (a JSON object, or the path
/// of a file holding one), else empty.
pub fn device_config(file: Option<&Path>) -> Result<BTreeMap<String, String>> {
    if let Some(path) = file {
        let text = reference::inputs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        return parse_device_config(&text, &path.display().to_string());
    }
    match std::env::var(DEVICE_CONFIG_ENV) {
        Ok(text) if text.trim_start().starts_with('{') => {
            parse_device_config(&text, DEVICE_CONFIG_ENV)
        }
        Ok(path) => {
            let source = format!("{DEVICE_CONFIG_ENV}={path}");
            let text = reference::inputs::read_to_string(Path::new(&path)).map_err(|e| {
                Error::Config(format!(
                    "{source}: takes a JSON object of device properties or the path of a file holding one; \
                     reading it as a path failed: {e}"
                ))
            })?;
            parse_device_config(&text, &source)
        }
        Err(_) => Ok(BTreeMap::new()),
    }
}

/// The properties set on `device` before compiling: the precision, this project's defaults for the device, then
/// the user's device config (which overrides both).
///
/// CPU defaults, both needed for exact reference runs on OpenVINO 2026.4:
/// - `DYNAMIC_QUANTIZATION_GROUP_SIZE=0`: by default the CPU plugin quantizes activations to int8 on the fly when
///   the weights are int4/int8 (moving the tiny model's activations by ~0.5%); an NPU does not.
/// - `SNIPPETS_MODE=DISABLE`: the plugin's snippets tokenization crashes (SIGSEGV) compiling a residual add whose
///   MLP output is also a graph output, at 4 and 8 tokens.
pub fn requested_properties(device: &str, opts: &CompileOptions) -> BTreeMap<String, String> {
    let mut p = BTreeMap::new();
    p.insert(
        "INFERENCE_PRECISION_HINT".to_string(),
        opts.precision.hint().to_string(),
    );
    if device.starts_with("CPU") {
        p.insert(
            "DYNAMIC_QUANTIZATION_GROUP_SIZE".to_string(),
            "0".to_string(),
        );
        p.insert("SNIPPETS_MODE".to_string(), "DISABLE".to_string());
    }
    p.extend(opts.device_config.clone());
    p
}
