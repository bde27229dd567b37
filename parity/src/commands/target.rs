//! What a checking command (compare-devices, probe, validate) puts under test, shared by them: this project's graphs
//! of `--model`'s checkpoint, or a graph set made elsewhere (`--ir DIR`) and the checkpoint the reference runs
//! against it.

use super::args::{FormArgs, GraphArgs, ModelArgs, refuse_graph_flags};
use crate::device::fault::Fault;
use crate::device::llamacpp::LlamaCppDevice;
use crate::device::own::OwnGraphs;
use crate::device::set::{SetGraphs, SetSource};
use crate::device::{DeviceSettings, DeviceUnderTest};
use anyhow::{Result, bail};
use reference::config::Config;
use reference::weights::WeightStore;
use std::path::{Path, PathBuf};

/// The graphs under test and the checkpoint the reference runs.
pub enum Target {
    /// This project's graphs, built from the checkpoint: its directory, config and weights.
    Own(Box<(PathBuf, Config, WeightStore)>),
    /// A set made elsewhere.
    Set(Box<SetSource>),
}

impl Target {
    /// Opens `--ir DIR` (refusing the options of this project's graphs, warning when the manifest says the graphs
    /// hold other weights), else `--model`'s checkpoint.
    pub fn open(
        model: &ModelArgs,
        ir: Option<&Path>,
        form: &FormArgs,
        graph: &GraphArgs,
    ) -> Result<Self> {
        Ok(match ir {
            Some(ir) => {
                refuse_graph_flags(form, graph, ir)?;
                if form.arithmetic.is_some() {
                    bail!(
                        "--arithmetic applies to the reference on a GGUF file checked against llama.cpp \
                         (--devices llama.cpp); a set made elsewhere (--ir {}) computes as its graphs do",
                        ir.display()
                    );
                }
                let s = model.open_set(ir)?;
                if let Some(w) = &s.weights_warning {
                    crate::errln!("warning: {w}");
                }
                Target::Set(Box::new(s))
            }
            None => {
                let (dir, config, mut store) = model.open_for(form)?;
                // The reference computes as --arithmetic says; OpenVINO devices refuse it (their graph form).
                form.apply_arithmetic(&mut store)?;
                Target::Own(Box::new((dir, config, store)))
            }
        })
    }

    /// The checkpoint the reference runs: its directory, config and weights.
    pub fn checkpoint(&self) -> (&Path, &Config, &WeightStore) {
        match self {
            Target::Own(c) => (&c.0, &c.1, &c.2),
            Target::Set(s) => (&s.checkpoint, &s.config, &s.store),
        }
    }

    /// The set made elsewhere, if that is what is tested.
    pub fn set(&self) -> Option<&SetSource> {
        match self {
            Target::Set(s) => Some(s),
            Target::Own(_) => None,
        }
    }

    /// The static context of the graphs (`settings`' for this project's), and where it comes from.
    pub fn context(&self, settings: &DeviceSettings) -> (Option<usize>, String) {
        match self {
            Target::Set(s) => s.context(),
            Target::Own(_) => (Some(settings.graph.context), "--context".into()),
        }
    }

    /// The device under test on `settings.device`: this project's graphs with `settings`, or the set compiled with
    /// `graph`'s compile options; misbehaving as `fault` says (tests only).
    pub fn device(
        &self,
        settings: DeviceSettings,
        graph: &GraphArgs,
        fault: Option<Fault>,
    ) -> Result<Box<dyn DeviceUnderTest + '_>> {
        if crate::device::llamacpp::is_llamacpp(&settings.device) {
            let Target::Own(c) = self else {
                bail!(
                    "--devices {}: llama.cpp runs a GGUF file (--model FILE.gguf), not a graph set (--ir)",
                    settings.device
                );
            };
            let gguf = crate::device::llamacpp::gguf_of(&c.0)?;
            return Ok(Box::new(LlamaCppDevice::open(
                &gguf,
                &c.1,
                &settings.device,
                settings.graph.context,
                fault,
            )?));
        }
        Ok(match self {
            Target::Set(s) => {
                let compile = graph.compile(&settings.device)?;
                Box::new(SetGraphs::open(s, &settings.device, &compile, fault)?)
            }
            Target::Own(c) => Box::new(OwnGraphs::open(&c.1, &c.2, settings, fault)?),
        })
    }
}
