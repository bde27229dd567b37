//! Running a compiled graph: host tensors (candle) in, named outputs out.

use crate::devices::{Compiled, openvino_message};
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use openvino::{ElementType, InferRequest, Shape};
use std::collections::BTreeMap;

/// An inference session on one compiled graph.
pub struct Session {
    /// The compiled graph and what it was compiled with.
    pub compiled: Compiled,
    request: InferRequest,
}

fn to_ov(t: &Tensor) -> std::result::Result<openvino::Tensor, String> {
    let dims: Vec<i64> = t.dims().iter().map(|&d| d as i64).collect();
    let shape = Shape::new(&dims).map_err(|e| e.to_string())?;
    let flat = t.flatten_all().map_err(|e| e.to_string())?;
    let (ty, bytes): (ElementType, Vec<u8>) = match t.dtype() {
        DType::F32 => (
            ElementType::F32,
            flat.to_vec1::<f32>()
                .map_err(|e| e.to_string())?
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        ),
        DType::I64 => (
            ElementType::I64,
            flat.to_vec1::<i64>()
                .map_err(|e| e.to_string())?
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        ),
        other => return Err(format!("host tensors must be f32 or i64, got {other:?}")),
    };
    let mut out = openvino::Tensor::new(ty, &shape).map_err(|e| e.to_string())?;
    out.get_raw_data_mut()
        .map_err(|e| e.to_string())?
        .copy_from_slice(&bytes);
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
    let raw = t.get_raw_data().map_err(|e| e.to_string())?;
    let dev = &Device::Cpu;
    let tensor = match t.get_element_type().map_err(|e| e.to_string())? {
        ElementType::F32 => {
            let v: Vec<f32> = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            Tensor::from_vec(v, shape, dev)
        }
        ElementType::F16 => {
            let v: Vec<f32> = raw
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect();
            Tensor::from_vec(v, shape, dev)
        }
        ElementType::I64 => {
            let v: Vec<i64> = raw
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect();
            Tensor::from_vec(v, shape, dev)
        }
        other => return Err(format!("unsupported output element type {other:?}")),
    };
    tensor.map_err(|e| e.to_string())
}

impl Session {
    /// Creates the infer request of a compiled graph.
    pub fn new(mut compiled: Compiled) -> Result<Self> {
        let request = compiled
            .model
            .create_infer_request()
            .map_err(|e| Error::OpenVino {
                stage: "inference",
                graph: compiled.graph.clone(),
                device: compiled.device.clone(),
                message: format!("creating the request: {}", openvino_message(&e)),
            })?;
        Ok(Session { compiled, request })
    }

    fn err(&self, message: String) -> Error {
        Error::OpenVino {
            stage: "inference",
            graph: self.compiled.graph.clone(),
            device: self.compiled.device.clone(),
            message,
        }
    }

    /// Runs with every input the graph declares taken by name from `offered` (an engine offers what a block may
    /// need; a graph declares what it reads, e.g. a per-layer DeltaNet graph no attention mask); a declared input
    /// that is not offered is an error. Returns every output by name.
    pub fn run_declared(
        &mut self,
        offered: &[(String, Tensor)],
    ) -> Result<BTreeMap<String, Tensor>> {
        let names = self.compiled.inputs.clone();
        let mut chosen = Vec::with_capacity(names.len());
        for name in &names {
            let (_, t) = offered.iter().find(|(n, _)| n == name).ok_or_else(|| {
                Error::Interface(format!(
                    "graph {} reads `{name}`, which its caller does not provide",
                    self.compiled.graph
                ))
            })?;
            chosen.push((name.as_str(), t));
        }
        self.run(&chosen)
    }

    /// Sets every input by name, runs, and returns every output by name.
    pub fn run(&mut self, inputs: &[(&str, &Tensor)]) -> Result<BTreeMap<String, Tensor>> {
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
        for name in self.compiled.outputs.clone() {
            let t = self
                .request
                .get_tensor(&name)
                .map_err(|e| self.err(format!("output `{name}`: {}", openvino_message(&e))))?;
            let t = from_ov(&t).map_err(|e| self.err(format!("output `{name}`: {e}")))?;
            out.insert(name, t);
        }
        Ok(out)
    }
}
