//! Running a prepared graph: host tensors (candle) in, named outputs out, on an OpenVINO device ([`Session`]) or
//! on FP16SIM ([`SimSession`]), both behind [`Executor`]; [`prepare`] picks by the device's name.

use crate::devices::{CompileOptions, Compiled, ExecInfo, compile, openvino_message};
use crate::error::{Error, Result};
use crate::graphs::ports;
use crate::ir::Graph;
use crate::sim::{Kernels, NumericModel, eval::Evaluator};
use candle_core::{DType, Device, Tensor};
use openvino::{ElementType, InferRequest, Shape};
use std::collections::BTreeMap;

/// A graph ready to run on a device.
pub trait Executor {
    /// What it was prepared with.
    fn info(&self) -> &ExecInfo;

    /// Sets every input by name, runs, and returns every output by name.
    fn run(&mut self, inputs: &[(&str, &Tensor)]) -> Result<BTreeMap<String, Tensor>>;

    /// Forgets what the graph keeps between runs: a stateful IR's variables start again from their initial values
    /// (a fresh infer request). A graph whose states are ports keeps nothing: the default does nothing.
    fn reset(&mut self) -> Result<()> {
        Ok(())
    }

    /// Runs with every input the graph declares taken by name from `offered` (an engine offers what a block may
    /// need; a graph declares what it reads, e.g. a per-layer DeltaNet graph no attention mask); a declared input
    /// that is not offered is an error. Returns every output by name.
    fn run_declared(&mut self, offered: &[(String, Tensor)]) -> Result<BTreeMap<String, Tensor>> {
        let names = self.info().inputs.clone();
        let mut chosen = Vec::with_capacity(names.len());
        for name in &names {
            let (_, t) = offered.iter().find(|(n, _)| n == name).ok_or_else(|| {
                Error::Interface(format!(
                    "graph {} reads `{name}`, which its caller does not provide",
                    self.info().graph
                ))
            })?;
            chosen.push((name.as_str(), t));
        }
        self.run(&chosen)
    }
}

/// Prepares `graph` for `device`: the FP16SIM pseudo-device (`FP16SIM[:options]`, options also from the device
/// config) evaluates it in Rust; any other name compiles it with OpenVINO.
pub fn prepare(graph: Graph, device: &str, opts: &CompileOptions) -> Result<Box<dyn Executor>> {
    if NumericModel::is_sim(device) {
        let config: Vec<(String, String)> = opts
            .device_config
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let (model, kernels) = crate::sim::parse_device(device, &config)?;
        return Ok(Box::new(SimSession::with_kernels(
            graph, device, model, kernels,
        )?));
    }
    let mut core = crate::runtime::core()?;
    Ok(Box::new(Session::new(compile(
        &mut core, graph, device, opts,
    )?)?))
}

/// A graph evaluated by FP16SIM.
pub struct SimSession {
    info: ExecInfo,
    evaluator: Evaluator,
}

impl SimSession {
    /// Prepares `graph` under `model`.
    pub fn new(graph: Graph, device: &str, model: NumericModel) -> Result<Self> {
        Self::with_kernels(graph, device, model, Kernels::Tiled)
    }

    /// Prepares `graph` under `model`, computed with `kernels`.
    pub fn with_kernels(
        graph: Graph,
        device: &str,
        model: NumericModel,
        kernels: Kernels,
    ) -> Result<Self> {
        let start = std::time::Instant::now();
        let inputs: Vec<String> = graph.inputs().into_iter().map(|(n, _, _)| n).collect();
        let outputs: Vec<String> = graph.outputs().into_iter().map(|(n, _, _)| n).collect();
        let state_in: Vec<String> = inputs
            .iter()
            .filter(|n| ports::is_state_port(n, true))
            .cloned()
            .collect();
        let state_out: Vec<String> = outputs
            .iter()
            .filter(|n| ports::is_state_port(n, false))
            .cloned()
            .collect();
        let name = graph.name().to_string();
        let evaluator = Evaluator::with_kernels(graph, model, &state_in, &state_out, kernels)?;
        Ok(SimSession {
            info: ExecInfo {
                graph: name,
                device: device.to_string(),
                precision: model.precision().into(),
                execution_devices: Some(model.to_string()),
                properties: model
                    .properties()
                    .into_iter()
                    .chain([("kernels".to_string(), kernels.name().to_string())])
                    .collect(),
                compile_seconds: start.elapsed().as_secs_f64(),
                cache_dir: None,
                loaded_from_cache: None,
                inputs,
                outputs,
            },
            evaluator,
        })
    }
}

impl Executor for SimSession {
    fn info(&self) -> &ExecInfo {
        &self.info
    }

    fn run(&mut self, inputs: &[(&str, &Tensor)]) -> Result<BTreeMap<String, Tensor>> {
        self.evaluator.run(inputs)
    }
}

/// An inference session on one graph compiled by OpenVINO.
pub struct Session {
    info: ExecInfo,
    model: openvino::CompiledModel,
    request: InferRequest,
}

/// The element types a host tensor crosses to and from an OpenVINO device in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HostElem {
    F32,
    F16,
    I64,
    I32,
    /// candle's `u8`, as OpenVINO's boolean.
    Boolean,
}

/// A host tensor's element type and little-endian bytes, as an OpenVINO tensor holds them.
pub(crate) fn host_bytes(t: &Tensor) -> std::result::Result<(HostElem, Vec<u8>), String> {
    let flat = t.flatten_all().map_err(|e| e.to_string())?;
    let err = |e: candle_core::Error| e.to_string();
    Ok(match t.dtype() {
        DType::F32 => (
            HostElem::F32,
            flat.to_vec1::<f32>()
                .map_err(err)?
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        ),
        DType::F16 => (
            HostElem::F16,
            flat.to_vec1::<half::f16>()
                .map_err(err)?
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        ),
        DType::I64 => (
            HostElem::I64,
            flat.to_vec1::<i64>()
                .map_err(err)?
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        ),
        DType::I32 => (
            HostElem::I32,
            flat.to_vec1::<i32>()
                .map_err(err)?
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        ),
        DType::U8 => (HostElem::Boolean, flat.to_vec1::<u8>().map_err(err)?),
        other => {
            return Err(format!(
                "host tensors must be f32, f16, i64, i32 or boolean, got {other:?}"
            ));
        }
    })
}

/// The host tensor of an OpenVINO output of `elem` and `shape` whose bytes are `raw` (f16 widened to f32, i32 to
/// i64).
pub(crate) fn host_tensor(
    elem: HostElem,
    shape: Vec<usize>,
    raw: &[u8],
) -> std::result::Result<Tensor, String> {
    let dev = &Device::Cpu;
    if shape.contains(&0) {
        return Tensor::zeros(shape, DType::F32, dev).map_err(|e| e.to_string());
    }
    let tensor = match elem {
        HostElem::F32 => {
            let v: Vec<f32> = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            Tensor::from_vec(v, shape, dev)
        }
        HostElem::F16 => {
            let v: Vec<f32> = raw
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect();
            Tensor::from_vec(v, shape, dev)
        }
        HostElem::I64 => {
            let v: Vec<i64> = raw
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect();
            Tensor::from_vec(v, shape, dev)
        }
        HostElem::I32 => {
            let v: Vec<i64> = raw
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes(c.try_into().unwrap_or([0; 4]))))
                .collect();
            Tensor::from_vec(v, shape, dev)
        }
        HostElem::Boolean => return Err("unsupported output element type boolean".into()),
    };
    tensor.map_err(|e| e.to_string())
}

fn to_ov(t: &Tensor) -> std::result::Result<openvino::Tensor, String> {
    let dims: Vec<i64> = t.dims().iter().map(|&d| d as i64).collect();
    let shape = Shape::new(&dims).map_err(|e| e.to_string())?;
    let (elem, bytes) = host_bytes(t)?;
    let ty = match elem {
        HostElem::F32 => ElementType::F32,
        HostElem::F16 => ElementType::F16,
        HostElem::I64 => ElementType::I64,
        HostElem::I32 => ElementType::I32,
        HostElem::Boolean => ElementType::Boolean,
    };
    let mut out = openvino::Tensor::new(ty, &shape).map_err(|e| e.to_string())?;
    if !bytes.is_empty() {
        out.get_raw_data_mut()
            .map_err(|e| e.to_string())?
            .copy_from_slice(&bytes);
    }
    Ok(out)
}

fn from_ov(t: &openvino::Tensor) -> std::result::Result<Tensor, String> {
    let shape: Vec<usize> = t
        .get_shape()
        .map_err(|e| e.to_string())?
        .get_dimensions()
        .iter()
        .map(|&d| d as usize)
        .collect();
    let elem = match t.get_element_type().map_err(|e| e.to_string())? {
        ElementType::F32 => HostElem::F32,
        ElementType::F16 => HostElem::F16,
        ElementType::I64 => HostElem::I64,
        ElementType::I32 => HostElem::I32,
        other => return Err(format!("unsupported output element type {other:?}")),
    };
    if shape.contains(&0) {
        return host_tensor(elem, shape, &[]);
    }
    host_tensor(elem, shape, t.get_raw_data().map_err(|e| e.to_string())?)
}

impl Session {
    /// Creates the infer request of a compiled graph.
    pub fn new(mut compiled: Compiled) -> Result<Self> {
        let request = compiled.model.create_infer_request().map_err(|e| {
            compiled
                .info
                .inference_error(format!("creating the request: {}", openvino_message(&e)))
        })?;
        Ok(Session {
            info: compiled.info,
            model: compiled.model,
            request,
        })
    }

    fn err(&self, message: String) -> Error {
        self.info.inference_error(message)
    }
}

impl Executor for Session {
    fn info(&self) -> &ExecInfo {
        &self.info
    }

    fn run(&mut self, inputs: &[(&str, &Tensor)]) -> Result<BTreeMap<String, Tensor>> {
        for (name, t) in inputs {
            let ov = to_ov(t).map_err(|e| self.err(format!("input `{name}`: {e}")))?;
            self.request.set_tensor(name, &ov).map_err(|e| {
                self.err(format!(
                    "input `{name}` {:?}: {}",
                    t.dims(),
                    openvino_message(&e)
                ))
            })?;
        }
        self.request
            .infer()
            .map_err(|e| self.err(openvino_message(&e)))?;
        let mut out = BTreeMap::new();
        for name in self.info.outputs.clone() {
            let t = self
                .request
                .get_tensor(&name)
                .map_err(|e| self.err(format!("output `{name}`: {}", openvino_message(&e))))?;
            let t = from_ov(&t).map_err(|e| self.err(format!("output `{name}`: {e}")))?;
            out.insert(name, t);
        }
        Ok(out)
    }

    /// A fresh infer request: a stateful IR's variables start from their initial values.
    fn reset(&mut self) -> Result<()> {
        self.request = self
            .model
            .create_infer_request()
            .map_err(|e| self.err(format!("creating the request: {}", openvino_message(&e))))?;
        Ok(())
    }
}
