//! This project's decoder graphs built from the checkpoint and prepared for a device: held in memory for FP16SIM,
//! written to disk (and kept beside the model cache, [`super::ir_cache`]) and compiled for an OpenVINO device.

use super::SetGraph;
use crate::devices::{CompileOptions, IrPorts, compile_ir};
use crate::error::Result;
use crate::graphs::Builder;
use crate::graphset::Interface;
use crate::graphset::check::{Subject, resolve};
use crate::infer::{Executor, Session, prepare};
use crate::ov_path::PathSession;

/// The decoder graphs for calls of `sizes` tokens on `device`, each checked against `interface` before it is
/// compiled; and whether their IR was read back from the IR cache (`None`: no cache, or FP16SIM).
pub(super) fn decoder_graphs(
    builder: &Builder,
    sizes: &[usize],
    device: &str,
    opts: &CompileOptions,
    interface: &Interface,
) -> Result<(Vec<SetGraph>, Option<bool>)> {
    let (config, context) = (builder.config(), builder.options().context);
    let mut graphs = Vec::new();
    let mut ir_reused = None;
    if crate::sim::NumericModel::is_sim(device) {
        // FP16SIM evaluates the graphs where they are built: their constants streamed to one unlinked scratch
        // `.bin` (every weight written once for all of them), which each evaluator maps and reads a matrix at a
        // time; nothing of the weights is held in memory.
        let bin = crate::ir::SharedBin::scratch()?;
        for &tokens in sizes {
            let graph = builder.decoder_graph_on(tokens, Some(&bin))?;
            let ports = IrPorts::of_graph(&graph);
            let ports = resolve(
                &decoder_subject(graph.name(), tokens, context),
                config,
                interface,
                &ports,
            )?;
            let exec = prepare(graph, device, opts)?;
            graphs.push(SetGraph {
                tokens: Some(tokens),
                exec,
                ports,
            });
        }
    } else {
        // On an OpenVINO device both graphs stream their constants to one `.bin` and point into it: the weights
        // are compressed and written once, never held in memory, kept on disk beside the model cache when there
        // is one (`ir_cache`), and while each graph compiles the file's pages (which the CPU plugin reads once,
        // copying the weights into its own layout) are handed back every 250 ms (`crate::pages`).
        let ir = super::ir_cache::decoder_ir(builder, sizes, opts.cache_dir.as_deref())?;
        ir_reused = ir.reused;
        let mut core = crate::runtime::core()?;
        for g in &ir.graphs {
            let name = format!("decoder_t{}", g.tokens);
            let ports = resolve(
                &decoder_subject(&name, g.tokens, context),
                config,
                interface,
                &g.ports,
            )?;
            let releaser = crate::pages::Releaser::start(
                vec![g.bin.clone()],
                std::time::Duration::from_millis(250),
            );
            // An IR cache entry's path names its contents: compiled from its path, a cached start neither reads
            // nor hashes the weights (`crate::ov_path`). A scratch IR is compiled from a read model.
            let exec: Box<dyn Executor> =
                if ir.reused.is_some() && super::ir_cache::link_stem_bin(&g.xml, &g.bin) {
                    crate::devices::require(&core, device)?;
                    Box::new(PathSession::compile(&g.xml, &name, device, opts)?)
                } else {
                    Box::new(Session::new(compile_ir(
                        &mut core, &g.xml, &g.bin, &name, device, opts,
                    )?)?)
                };
            drop(releaser);
            graphs.push(SetGraph {
                tokens: Some(g.tokens),
                exec,
                ports,
            });
        }
    }
    Ok((graphs, ir_reused))
}

/// What a port check of this project's decoder graph `file` (calls of `tokens`) is about.
fn decoder_subject(file: &str, tokens: usize, context: usize) -> Subject<'_> {
    Subject {
        source: "this project's decoder graphs",
        part: "decoder",
        file,
        tokens: Some(tokens),
        layer: None,
        context: Some(context),
    }
}
