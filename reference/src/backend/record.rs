//! What a backend ran ([`RunRecord`]), and in what arithmetic ([`Precision`]): what a parity report or a dump states,
//! written to a dump's metadata and read back from it.

use crate::error::{Error, Result};
use std::collections::BTreeMap;

/// The arithmetic a backend computed in: f32 (or f64) on the host, or what a device read back from its compiled
/// graphs (`INFERENCE_PRECISION_HINT`), which may not be what was asked (the CPU plugin asked for f16 computes bf16
/// where it has no f16 arithmetic).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Precision {
    /// 64-bit floats (a double-precision reference run).
    F64,
    /// 32-bit floats.
    F32,
    /// 16-bit floats.
    F16,
    /// bfloat16.
    Bf16,
    /// Anything else a device reports (its own word for it, kept as it is: `dynamic`, `undefined`, …).
    Other(String),
}

impl Precision {
    /// Reads a precision as devices, dumps and the command line write it (`f32`, `FP16`, `bf16`, …); another word
    /// is kept as [`Precision::Other`].
    pub fn parse(s: &str) -> Precision {
        match s.trim().to_ascii_lowercase().as_str() {
            "f64" | "fp64" => Precision::F64,
            "f32" | "fp32" => Precision::F32,
            "f16" | "fp16" => Precision::F16,
            "bf16" => Precision::Bf16,
            _ => Precision::Other(s.trim().to_string()),
        }
    }

    /// Whether this is full single (or double) precision, which is judged by the tight thresholds.
    pub fn is_full(&self) -> bool {
        matches!(self, Precision::F32 | Precision::F64)
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F64 => "f64",
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
            Precision::Other(s) => s,
        })
    }
}

impl serde::Serialize for Precision {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

/// What a backend ran: every setting a parity report or a dump must state.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RunRecord {
    /// `reference` or `openvino` (or another backend's name).
    pub backend: String,
    /// The device (`CPU`, `NPU`, …), for device backends.
    pub device: Option<String>,
    /// The runtime's version (OpenVINO's build number, e.g. `2026.4.1-…`), for device backends.
    pub runtime: Option<String>,
    /// The device's own name (`FULL_DEVICE_NAME`).
    pub device_name: Option<String>,
    /// The device driver's version (`NPU_DRIVER_VERSION`), where reported.
    pub driver: Option<String>,
    /// The dtype of the host tensors (`f32`, or `f64` for a double-precision reference run).
    pub dtype: String,
    /// The inference precision asked of the device.
    pub precision_requested: Option<Precision>,
    /// The inference precision read back from the compiled graphs.
    pub precision: Option<Precision>,
    /// `EXECUTION_DEVICES` read back, where reported.
    pub execution_devices: Option<String>,
    /// Every property set on the device, as read back.
    pub properties: BTreeMap<String, String>,
    /// The weight format (`f32`, `f16`, `int4`, `int4:G`).
    pub weights: String,
    /// The delta-rule form of multi-token calls.
    pub deltanet_prefill: String,
    /// The delta-rule form of single-token calls.
    pub deltanet_decode: String,
    /// The DeltaNet output rescaling.
    pub output_scale: f64,
    /// The reference's prompt pieces (`None`: the whole prompt in one call).
    pub prefill_block: Option<usize>,
    /// A device's prompt block (tokens per graph call).
    pub block: Option<usize>,
    /// A device's static KV context.
    pub context: Option<usize>,
    /// Whether the backend records taps.
    pub taps: bool,
    /// Seconds spent building and compiling, for device backends.
    pub compile_seconds: Option<f64>,
    /// The device's on-disk model cache, when one was used.
    pub cache_dir: Option<String>,
    /// Per compiled graph (by name), whether it was loaded from the model cache (graphs whose device does not say
    /// are absent).
    pub from_cache: BTreeMap<String, bool>,
    /// Whether the device's IR (the graphs and their `.bin`) was read back from the on-disk IR cache beside the
    /// model cache (`Some(true)`), or built and stored there (`Some(false)`); `None`: no cache, built afresh.
    pub ir_reused: Option<bool>,
}

impl RunRecord {
    /// The model cache in words: `off`, or the directory and how many graphs came from it.
    pub fn cache_summary(&self) -> String {
        match &self.cache_dir {
            None => "off".into(),
            Some(dir) => {
                let hits = self.from_cache.values().filter(|&&h| h).count();
                format!(
                    "{dir}: {hits} of {} graphs loaded from the cache{}{}",
                    self.from_cache.len(),
                    if hits == 0 && !self.from_cache.is_empty() {
                        " (compiled and stored)"
                    } else {
                        ""
                    },
                    match self.ir_reused {
                        Some(true) => "; IR read back from the cache",
                        Some(false) => "; IR built and stored",
                        None => "",
                    }
                )
            }
        }
    }

    /// The precision the run is judged by: the one read back, else the one asked, else the host dtype's (a dump
    /// written by another program that says nothing is held to f32).
    pub fn judged_precision(&self) -> Precision {
        self.precision
            .clone()
            .or_else(|| self.precision_requested.clone())
            .unwrap_or_else(|| Precision::parse(&self.dtype))
    }

    /// The precision read back, in words (`not reported` when the backend says nothing).
    pub fn precision_text(&self) -> String {
        self.precision
            .as_ref()
            .map_or_else(|| "not reported".into(), |p| p.to_string())
    }

    /// The record as a dump's metadata (string values; see the dump format). [`RunRecord::from_metadata`] reads it
    /// back.
    pub fn to_metadata(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        let mut put = |k: &str, v: String| {
            m.insert(k.to_string(), v);
        };
        put("backend", self.backend.clone());
        put("dtype", self.dtype.clone());
        put("weights", self.weights.clone());
        put("deltanet_prefill", self.deltanet_prefill.clone());
        put("deltanet_decode", self.deltanet_decode.clone());
        put("output_scale", self.output_scale.to_string());
        put("taps", self.taps.to_string());
        if self.backend == "reference" {
            put(
                "prefill_block",
                self.prefill_block
                    .map_or(WHOLE_PROMPT.into(), |b| b.to_string()),
            );
        }
        let optional = [
            ("device", &self.device),
            ("device_name", &self.device_name),
            ("driver", &self.driver),
            ("openvino", &self.runtime),
            ("execution_devices", &self.execution_devices),
            ("cache_dir", &self.cache_dir),
        ];
        for (k, v) in optional {
            if let Some(v) = v {
                put(k, v.clone());
            }
        }
        for (k, v) in [
            ("precision_requested", &self.precision_requested),
            ("precision", &self.precision),
        ] {
            if let Some(v) = v {
                put(k, v.to_string());
            }
        }
        if let Some(b) = self.block {
            put("block", b.to_string());
        }
        if let Some(c) = self.context {
            put("context", c.to_string());
        }
        if let Some(s) = self.compile_seconds {
            put("compile_seconds", s.to_string());
        }
        for (graph, hit) in &self.from_cache {
            put(&format!("from_cache.{graph}"), hit.to_string());
        }
        if let Some(r) = self.ir_reused {
            put("ir_reused", r.to_string());
        }
        for (k, v) in &self.properties {
            put(&format!("property.{k}"), v.clone());
        }
        m
    }

    /// The record a dump's metadata holds ([`RunRecord::to_metadata`]'s inverse). Keys another program may not
    /// write have these values when absent: `backend` `unknown`, `dtype` `f32`, `weights`, `deltanet_prefill` and
    /// `deltanet_decode` empty, `output_scale` 1, `taps` true (a dump holds its taps), every optional field none.
    /// A value that does not parse is an error naming its key; keys of the dump format that are not the record's
    /// (`model`, `prompt`, `prompt_seconds`, …) are ignored.
    pub fn from_metadata(m: &BTreeMap<String, String>) -> Result<RunRecord> {
        let get = |k: &str| m.get(k).cloned();
        fn parsed<T: std::str::FromStr>(
            m: &BTreeMap<String, String>,
            k: &str,
        ) -> Result<Option<T>> {
            m.get(k)
                .map(|v| {
                    v.trim().parse::<T>().map_err(|_| {
                        Error::Input(format!("metadata `{k}`: `{v}` is not a valid value"))
                    })
                })
                .transpose()
        }
        let prefill_block = match m.get("prefill_block").map(String::as_str) {
            None | Some(WHOLE_PROMPT) => None,
            Some(_) => parsed::<usize>(m, "prefill_block")?,
        };
        let from_cache = m
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("from_cache.")?, v)))
            .map(|(g, v)| match v.as_str() {
                "true" => Ok((g.to_string(), true)),
                "false" => Ok((g.to_string(), false)),
                other => Err(Error::Input(format!(
                    "metadata `from_cache.{g}`: `{other}` is neither true nor false"
                ))),
            })
            .collect::<Result<_>>()?;
        Ok(RunRecord {
            backend: get("backend").unwrap_or_else(|| "unknown".into()),
            device: get("device"),
            runtime: get("openvino"),
            device_name: get("device_name"),
            driver: get("driver"),
            dtype: get("dtype").unwrap_or_else(|| "f32".into()),
            precision_requested: m.get("precision_requested").map(|p| Precision::parse(p)),
            precision: m.get("precision").map(|p| Precision::parse(p)),
            execution_devices: get("execution_devices"),
            properties: m
                .iter()
                .filter_map(|(k, v)| Some((k.strip_prefix("property.")?.to_string(), v.clone())))
                .collect(),
            weights: get("weights").unwrap_or_default(),
            deltanet_prefill: get("deltanet_prefill").unwrap_or_default(),
            deltanet_decode: get("deltanet_decode").unwrap_or_default(),
            output_scale: parsed(m, "output_scale")?.unwrap_or(1.0),
            prefill_block,
            block: parsed(m, "block")?,
            context: parsed(m, "context")?,
            taps: parsed(m, "taps")?.unwrap_or(true),
            compile_seconds: parsed(m, "compile_seconds")?,
            cache_dir: get("cache_dir"),
            from_cache,
            ir_reused: parsed(m, "ir_reused")?,
        })
    }
}

/// How the metadata says the reference ran its prompt in one call.
const WHOLE_PROMPT: &str = "whole prompt";
