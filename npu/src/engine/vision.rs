//! A set's static vision graph on a device ([`crate::graphset::vision`]): checked against its IR's ports, compiled,
//! and run on the pixel patches of the images of its grids, its outputs handed back under the dump's names
//! (`vision.merger` and whatever taps it exposes).

use crate::devices::{CompileOptions, ExecInfo, compile_ir, read_ports};
use crate::error::{Error, Result};
use crate::graphset::GraphSet;
use crate::graphset::vision::{ResolvedVision, VisionGraph, resolve};
use crate::infer::{Executor, Session};
use candle_core::{DType, Tensor};
use reference::vision::{VisionConfig, names};
use std::collections::BTreeMap;

/// One of a set's vision graphs, compiled for a device.
pub struct SetVision {
    exec: Box<dyn Executor>,
    ports: ResolvedVision,
    name: String,
}

impl SetVision {
    /// Checks `graph` of `set` against its IR's ports for the checkpoint's tower `vc` and compiles it for `device`
    /// (an OpenVINO device).
    pub fn open(
        set: &GraphSet,
        graph: &VisionGraph,
        vc: &VisionConfig,
        device: &str,
        opts: &CompileOptions,
    ) -> Result<Self> {
        if crate::sim::NumericModel::is_sim(device) {
            return Err(Error::Config(format!(
                "{device} evaluates this project's own graphs; {}'s vision graph runs on an OpenVINO device",
                set.source
            )));
        }
        crate::runtime::load()?;
        let ports = resolve(&set.source, graph, vc, &read_ports(&graph.xml, &graph.bin)?)?;
        let name = graph.name();
        let mut core = crate::runtime::core()?;
        let compiled = compile_ir(&mut core, &graph.xml, &graph.bin, &name, device, opts)?;
        Ok(SetVision {
            exec: Box::new(Session::new(compiled)?),
            ports,
            name,
        })
    }

    /// The graph's name (its file's stem).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What it was compiled with.
    pub fn info(&self) -> &ExecInfo {
        self.exec.info()
    }

    /// Runs the pixel patches `[patches, patch_dim]` of the graph's images: `vision.merger` `[rows, hidden]` and
    /// the taps the graph exposes, in f32 under the dump's names, a batch axis dropped.
    pub fn run(&mut self, pixels: &Tensor) -> Result<BTreeMap<String, Tensor>> {
        let p = &self.ports;
        let (patches, _) = pixels.dims2()?;
        if patches != p.patches {
            return Err(Error::Input(format!(
                "{} takes {} patches, given {patches}",
                self.name, p.patches
            )));
        }
        let ty = match p.input.ty {
            crate::graphset::ElemKind::F16 => DType::F16,
            _ => DType::F32,
        };
        let mut x = pixels.to_dtype(ty)?;
        if p.input.batch {
            x = x.unsqueeze(0)?;
        }
        let mut out = self.exec.run(&[(p.input.name.as_str(), &x)])?;
        // A batch of one, as the port's layout may have it: the rows alone.
        let rows = |t: Tensor| -> Result<Tensor> {
            let t = if t.rank() > 2 && t.dim(0)? == 1 {
                t.squeeze(0)?
            } else {
                t
            };
            Ok(t.to_dtype(DType::F32)?)
        };
        let mut taps = BTreeMap::new();
        let merger = out.remove(&p.output.name).ok_or_else(|| {
            Error::Interface(format!("{} gave no output `{}`", self.name, p.output.name))
        })?;
        taps.insert(names::MERGER.to_string(), rows(merger)?);
        for (dump, port) in &p.taps {
            let t = out.remove(port).ok_or_else(|| {
                Error::Interface(format!("{} gave no output `{port}`", self.name))
            })?;
            taps.insert(dump.clone(), rows(t)?);
        }
        Ok(taps)
    }
}
