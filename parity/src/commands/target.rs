//! The target of a checking command (compare-devices, probe, validate) from its arguments: `--ir DIR`'s set
//! (refusing the options of this project's graphs, warning when the manifest says the graphs hold other weights),
//! else `--model`'s checkpoint with `--arithmetic` set on the reference.

use super::args::{FormArgs, GraphArgs, ModelArgs, refuse_graph_flags};
use crate::device::target::Target;
use anyhow::{Result, bail};
use std::path::Path;

/// Opens `--ir DIR`, else `--model`'s checkpoint.
pub fn open(
    model: &ModelArgs,
    ir: Option<&Path>,
    form: &FormArgs,
    graph: &GraphArgs,
) -> Result<Target> {
    Ok(match ir {
        Some(ir) => {
            refuse_graph_flags(form, graph, ir)?;
            if form.arithmetic.is_some() {
                bail!(
                    "--arithmetic applies to the reference on a GGUF file checked against llama.cpp (--devices \
                     llama.cpp); a set made elsewhere (--ir {}) computes as its graphs do",
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
