//! `qwen35 export-ir`: the static OpenVINO graphs of a checkpoint (decoder and per-layer) and a manifest of their
//! interfaces.

use crate::commands::Outcome;
use crate::options::{Dtype, FormArgs, ModelArgs};
use anyhow::{Context, Result, bail};
use npu::graphs::{Builder, DEFAULT_CONTEXT, GraphOptions};
use reference::linear_attn::PORT_OUTPUT_SCALE;
use std::path::PathBuf;

#[derive(clap::Args)]
/// Arguments of `qwen35 export-ir`.
pub struct ExportArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Output directory.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Prompt block sizes to export (single-token graphs are always written).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "16,64",
        value_name = "N,N"
    )]
    blocks: Vec<usize>,
    /// Also write each layer's own graph (the probe's unit) for every block size.
    #[arg(long)]
    layers: bool,
    /// Static KV context.
    #[arg(long, default_value_t = DEFAULT_CONTEXT, value_name = "N")]
    context: usize,
    #[command(flatten)]
    form: FormArgs,
}

/// Runs `qwen35 export-ir`.
pub fn exec(args: ExportArgs) -> Result<Outcome> {
    if args.model.dtype != Dtype::F32 {
        bail!(
            "--dtype applies to reference runs; graphs are written in f32 with --weights storage"
        );
    }
    let form = args.form.graph_form()?;
    let (dir, config, store) = args.model.open()?;
    if args.blocks.contains(&0) {
        bail!("--blocks: block sizes must be at least 1");
    }
    let opts = GraphOptions {
        form,
        output_scale: args.form.output_scale(PORT_OUTPUT_SCALE)? as f32,
        context: args.context,
        taps: true,
    };
    let builder = Builder::new(&config, &store, opts)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut sizes = vec![1];
    sizes.extend(args.blocks.iter().copied().filter(|&b| b != 1));
    let mut graphs = Vec::new();
    let describe = |g: &npu::ir::Graph, file: &str| {
        let ports = |list: Vec<(String, npu::ir::ElemType, Vec<usize>)>| -> Vec<serde_json::Value> {
            list.into_iter()
                .map(|(n, t, s)| serde_json::json!({"name": n, "type": t.ir_name(), "shape": s}))
                .collect()
        };
        serde_json::json!({"name": g.name(), "xml": file, "bin": file.replace(".xml", ".bin"),
                           "inputs": ports(g.inputs()), "outputs": ports(g.outputs())})
    };
    for &t in &sizes {
        let g = builder.decoder_graph(t)?;
        let file = format!("{}.xml", g.name());
        g.save(&args.out.join(&file))?;
        graphs.push(describe(&g, &file));
        if args.layers {
            for layer in 0..config.num_layers() {
                let g = builder.layer_graph(layer, t)?;
                let file = format!("{}.xml", g.name());
                g.save(&args.out.join(&file))?;
                graphs.push(describe(&g, &file));
            }
        }
    }
    let manifest = serde_json::json!({
        "model": dir.display().to_string(),
        "weights": store.format().name(),
        "deltanet_form": form.describe(),
        "output_scale": opts.output_scale,
        "context": opts.context,
        "graphs": graphs,
    });
    let path = args.out.join("manifest.json");
    std::fs::write(&path, serde_json::to_string_pretty(&manifest)?)
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!(
        "wrote {} graphs and manifest.json to {}",
        graphs.len(),
        args.out.display()
    );
    Ok(Outcome::Pass)
}
