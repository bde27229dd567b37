//! Graphs made elsewhere: a stateful OpenVINO IR (optimum-intel's export of Qwen3.5, or any IR with the same kind
//! of interface) run as a [`Backend`] at the logits and token level.
//!
//! The IR's ports come from the directory's manifest ([`manifest`]), or optimum-intel's names when there is none:
//! `input_ids` `[1, T]` i64, `attention_mask` `[1, past + T]` (all ones), `position_ids` (the call's positions),
//! `beam_idx` `[1]` = 0, and `logits` `[1, T, V]` out. The caches live inside the compiled model (`ReadValue` /
//! `Assign` variables), and OpenVINO's C API can neither read nor set them (no `query_state`): [`Backend::reset`]
//! starts a fresh infer request, and the state is **not exposed** — [`Backend::exposes_state`] is false,
//! [`Backend::snapshot`] and [`Backend::restore`] fail rather than pretend, and comparisons report states and hidden
//! layers as not available. [`constants`] reads the compressed weights the IR holds, so that the reference can be
//! checked to run exactly those.

pub mod constants;
pub mod manifest;

use crate::devices::{CompileOptions, ExecInfo, compile_file, openvino_message};
use crate::error::{Error, Result};
use candle_core::{Device, Tensor};
use manifest::{Dim, IrManifest, Port, PortType};
use openvino::{CompiledModel, ElementType, InferRequest, Shape};
use reference::backend::{Backend, Forward, RunRecord, Snapshot};
use reference::config::Config;
use std::path::Path;

/// The backend's name in run records.
pub const BACKEND: &str = "external-ir";

/// Why an external IR's state cannot be compared, as reports say it.
pub const STATE_NOT_EXPOSED: &str = "not exposed by this backend: a stateful IR keeps its caches inside OpenVINO, \
     whose C API cannot read them";

/// An external stateful IR compiled on a device.
pub struct ExternalBackend {
    compiled: CompiledModel,
    request: InferRequest,
    manifest: IrManifest,
    config: Config,
    position: usize,
    info: ExecInfo,
    record: RunRecord,
}

impl ExternalBackend {
    /// Compiles the IR described by `manifest` for `device` (`opts` set first; on CPU the KV cache is kept in the
    /// requested precision unless the device config says otherwise), and checks its ports against the manifest:
    /// every mapped port must exist and every input of the IR must be mapped. `config` is the checkpoint's.
    pub fn open(
        manifest: IrManifest,
        config: Config,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        crate::runtime::load()?;
        let mut core = crate::runtime::core()?;
        let mut opts = opts.clone();
        if device.starts_with("CPU") {
            opts.device_config
                .entry("KV_CACHE_PRECISION".into())
                .or_insert_with(|| opts.precision.hint().to_string());
        }
        let name = manifest
            .xml
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "external IR".into());
        let compiled = compile_file(&mut core, &manifest.xml, &name, device, &opts)?;
        let info = compiled.info;
        for (section, ports, have) in [
            ("inputs", &manifest.inputs, &info.inputs),
            ("outputs", &manifest.outputs, &info.outputs),
        ] {
            for p in ports {
                if !have.contains(&p.name) {
                    return Err(Error::Interface(format!(
                        "{}: `{section}.{}` names `{}`, which {} does not have ({section}: {})",
                        manifest.source,
                        p.role,
                        p.name,
                        manifest.xml.display(),
                        have.join(", ")
                    )));
                }
            }
        }
        if let Some(unmapped) = info
            .inputs
            .iter()
            .find(|i| !manifest.inputs.iter().any(|p| &p.name == *i))
        {
            return Err(Error::Interface(format!(
                "{} has input `{unmapped}`, which {} maps to no role (a stateless export with explicit caches is \
                 not supported)",
                manifest.xml.display(),
                manifest.source
            )));
        }
        let mut model = compiled.model;
        let request = new_request(&mut model, &info)?;
        let d = crate::devices::describe(&core, device);
        let record = RunRecord {
            backend: BACKEND.into(),
            device: Some(device.to_string()),
            runtime: Some(crate::runtime::load()?.version.clone()),
            device_name: Some(d.full_name),
            driver: d.driver_version,
            dtype: "f32".into(),
            precision_requested: Some(opts.precision.hint().into()),
            precision: Some(info.precision.clone()),
            execution_devices: info.execution_devices.clone(),
            properties: info.properties.clone(),
            weights: manifest
                .reference_weights
                .clone()
                .unwrap_or_else(|| "as exported".into()),
            deltanet_prefill: "as exported".into(),
            deltanet_decode: "as exported".into(),
            output_scale: 1.0,
            prefill_block: None,
            block: None,
            context: manifest.context,
            taps: false,
            compile_seconds: Some(info.compile_seconds),
            cache_dir: info.cache_dir.as_ref().map(|d| d.display().to_string()),
            from_cache: info
                .loaded_from_cache
                .map(|hit| (info.graph.clone(), hit))
                .into_iter()
                .collect(),
        };
        Ok(ExternalBackend {
            compiled: model,
            request,
            manifest,
            config,
            position: 0,
            info,
            record,
        })
    }

    /// Reads the manifest of `dir` (or takes optimum-intel's interface) and opens the IR: [`ExternalBackend::open`].
    pub fn open_dir(
        dir: &Path,
        config: Config,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        Self::open(IrManifest::open(dir)?, config, device, opts)
    }

    /// What the IR was compiled with.
    pub fn info(&self) -> &ExecInfo {
        &self.info
    }

    /// The manifest in use.
    pub fn manifest(&self) -> &IrManifest {
        &self.manifest
    }

    fn err(&self, message: String) -> Error {
        Error::OpenVino {
            stage: "inference",
            graph: self.info.graph.clone(),
            device: self.info.device.clone(),
            message,
        }
    }

    /// The tensor of an input role for a call of `ids` after `past` tokens.
    fn input(&self, port: &Port, ids: &[u32], past: usize) -> Result<openvino::Tensor> {
        let t = ids.len();
        let vocab = self.config.vocab_size;
        let dims: Vec<usize> = port.shape.iter().map(|d| d.size(t, past, vocab)).collect();
        let count: usize = dims.iter().product();
        // Values in row-major order: the index along the `tokens` axis decides a token's id or position.
        let tokens_axis = port.shape.iter().position(|d| *d == Dim::Tokens);
        let stride: usize = tokens_axis.map_or(1, |a| dims[a + 1..].iter().product());
        let value = |i: usize| -> i64 {
            let token = tokens_axis.map_or(0, |_| (i / stride) % t.max(1));
            match port.role.as_str() {
                "input_ids" => i64::from(ids[token]),
                "attention_mask" => 1,
                "position_ids" => (past + token) as i64,
                _ => 0, // beam_idx: the one sequence
            }
        };
        if port.role == "input_ids" && tokens_axis.is_none() {
            return Err(Error::Config(format!(
                "{}: `inputs.input_ids` has no `tokens` dim",
                self.manifest.source
            )));
        }
        let (ty, bytes): (ElementType, Vec<u8>) = match port.ty {
            PortType::I64 => (
                ElementType::I64,
                (0..count).flat_map(|i| value(i).to_le_bytes()).collect(),
            ),
            PortType::I32 => (
                ElementType::I32,
                (0..count)
                    .flat_map(|i| (value(i) as i32).to_le_bytes())
                    .collect(),
            ),
            PortType::F32 => (
                ElementType::F32,
                (0..count)
                    .flat_map(|i| (value(i) as f32).to_le_bytes())
                    .collect(),
            ),
        };
        let shape: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let ov = |e: openvino::InferenceError| {
            self.err(format!("input `{}`: {}", port.name, openvino_message(&e)))
        };
        let shape = Shape::new(&shape).map_err(ov)?;
        let mut tensor = openvino::Tensor::new(ty, &shape).map_err(ov)?;
        tensor
            .get_raw_data_mut()
            .map_err(ov)?
            .copy_from_slice(&bytes);
        Ok(tensor)
    }

    fn run(&mut self, ids: &[u32], all_logits: bool) -> Result<Forward> {
        if ids.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        self.config.check_token_ids(ids)?;
        let past = self.position;
        if let Some(context) = self.manifest.context
            && past + ids.len() > context
        {
            return Err(Error::Input(format!(
                "{} tokens after {past} need {} cache slots, but {} declares a static context of {context}",
                ids.len(),
                past + ids.len(),
                self.manifest.source
            )));
        }
        let inputs = self
            .manifest
            .inputs
            .iter()
            .map(|p| Ok((p.name.clone(), self.input(p, ids, past)?)))
            .collect::<Result<Vec<_>>>()?;
        for (name, t) in &inputs {
            self.request
                .set_tensor(name, t)
                .map_err(|e| self.err(format!("input `{name}`: {}", openvino_message(&e))))?;
        }
        self.request
            .infer()
            .map_err(|e| self.err(openvino_message(&e)))?;
        self.position += ids.len();
        let port = self
            .manifest
            .output("logits")
            .ok_or_else(|| Error::Interface("the manifest maps no `logits`".into()))?;
        let out = self
            .request
            .get_tensor(&port.name)
            .map_err(|e| self.err(format!("output `{}`: {}", port.name, openvino_message(&e))))?;
        let logits = logits_of(&out, ids.len(), self.config.vocab_size)
            .map_err(|m| self.err(format!("output `{}`: {m}", port.name)))?;
        let logits = if all_logits {
            logits
        } else {
            logits.narrow(0, ids.len() - 1, 1)?
        };
        Ok(Forward {
            logits,
            taps: Default::default(),
        })
    }
}

fn new_request(model: &mut CompiledModel, info: &ExecInfo) -> Result<InferRequest> {
    model.create_infer_request().map_err(|e| Error::OpenVino {
        stage: "inference",
        graph: info.graph.clone(),
        device: info.device.clone(),
        message: format!("creating the request: {}", openvino_message(&e)),
    })
}

/// The logits `[T, V]` of a call of `tokens` from an output `[1, T, V]` (f32 or f16).
fn logits_of(
    t: &openvino::Tensor,
    tokens: usize,
    vocab: usize,
) -> std::result::Result<Tensor, String> {
    let dims: Vec<usize> = t
        .get_shape()
        .map_err(|e| e.to_string())?
        .get_dimensions()
        .iter()
        .map(|&d| d as usize)
        .collect();
    let rows = match dims.as_slice() {
        [1, rows, v] if *v == vocab => *rows,
        other => {
            return Err(format!(
                "shape {other:?}, expected [1, {tokens}, {vocab}] (batch, tokens, vocabulary)"
            ));
        }
    };
    if rows != tokens {
        return Err(format!(
            "{rows} rows of logits for a call of {tokens} tokens (an IR that outputs only the last token's logits \
             cannot be teacher-forced)"
        ));
    }
    let raw = t.get_raw_data().map_err(|e| e.to_string())?;
    let values: Vec<f32> = match t.get_element_type().map_err(|e| e.to_string())? {
        ElementType::F32 => raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        ElementType::F16 => raw
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => return Err(format!("element type {other:?}, expected f32 or f16")),
    };
    Tensor::from_vec(values, (rows, vocab), &Device::Cpu).map_err(|e| e.to_string())
}

impl Backend for ExternalBackend {
    fn config(&self) -> &Config {
        &self.config
    }

    fn record(&self) -> &RunRecord {
        &self.record
    }

    /// A fresh infer request: its state variables start from their initial (empty) values.
    fn reset(&mut self) -> reference::Result<()> {
        self.request = new_request(&mut self.compiled, &self.info).map_err(into_reference)?;
        self.position = 0;
        Ok(())
    }

    /// One call of the IR on `ids`; its taps are always empty.
    fn forward(&mut self, ids: &[u32], all_logits: bool) -> reference::Result<Forward> {
        self.run(ids, all_logits).map_err(into_reference)
    }

    fn exposes_state(&self) -> bool {
        false
    }

    fn position(&self) -> reference::Result<usize> {
        Ok(self.position)
    }

    /// Fails: the state is inside OpenVINO ([`STATE_NOT_EXPOSED`]).
    fn snapshot(&self) -> reference::Result<Snapshot> {
        Err(reference::Error::Backend(format!(
            "the state of {} is {STATE_NOT_EXPOSED}",
            self.manifest.xml.display()
        )))
    }

    /// Fails: the state is inside OpenVINO ([`STATE_NOT_EXPOSED`]).
    fn restore(&mut self, _snapshot: &Snapshot) -> reference::Result<()> {
        Err(reference::Error::Backend(format!(
            "cannot set the state of {}: it is {STATE_NOT_EXPOSED}",
            self.manifest.xml.display()
        )))
    }
}

fn into_reference(e: Error) -> reference::Error {
    match e {
        Error::Reference(e) => e,
        Error::Input(m) => reference::Error::Input(m),
        other => reference::Error::Backend(other.to_string()),
    }
}
