//! `qwen35 export-ir`: this project's static OpenVINO graphs of a checkpoint written as a graph set (decoder graphs
//! per block size, per-layer graphs, one shared `weights.bin`) with the `manifest.json` that describes their ports
//! (`docs/graph-sets.md`), so that what it writes is read back like any set made elsewhere (`--ir DIR`).

use super::Outcome;
use super::args::{Dtype, FormArgs, ModelArgs};
use crate::outputs::{Kind, Paths, StagedDir};
use anyhow::{Context, Result, bail};
use npu::graphs::{Builder, DEFAULT_CONTEXT, GraphOptions};
use npu::graphset::vision::{VisionGraph, VisionPort};
use npu::graphset::{GraphFile, GraphSet, Part, Taps, manifest, own};
use npu::ir::SharedBin;
use reference::linear_attn::PORT_OUTPUT_SCALE;
use std::path::{Component, Path, PathBuf};

/// The parts of a set `export-ir` can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PartArg {
    /// The whole decoder per block size (and the 1-token decoder).
    Decoder,
    /// Each layer's own graph per block size.
    Layers,
}

#[derive(clap::Args)]
/// Arguments of `qwen35 export-ir`.
pub struct ExportArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Output directory: new or empty; it appears whole or not at all (written into a hidden sibling, renamed onto
    /// it at the end).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Prompt block sizes to export (the 1-token graphs are always written).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "16,64",
        value_name = "N,N"
    )]
    blocks: Vec<usize>,
    /// Which graphs: the whole decoder, each layer's own graph, or both (`decoder,layers`).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "decoder")]
    parts: Vec<PartArg>,
    /// Also write each layer's own graph (the same as `--parts decoder,layers`).
    #[arg(long)]
    layers: bool,
    /// Write the graphs as deployed: logits and states only, no hidden outputs (taps).
    #[arg(long)]
    no_taps: bool,
    /// Static KV context.
    #[arg(long, default_value_t = DEFAULT_CONTEXT, value_name = "N")]
    context: usize,
    /// Also write the static vision graph for one image of HxW patches (the NPU port's 32x32), beside the decoder
    /// graphs: `vision_h{H}_w{W}.xml` with its own `.bin`, `pixel_values` in and `vision.merger` out, listed under
    /// `vision` in the manifest. Repeat it for one graph per grid. The decoder graphs then take embeddings (the
    /// port's form), so that the set runs prompts with images: the vision graph's rows for the image tokens, the
    /// host's lookup for the text.
    #[arg(long, value_name = "HxW")]
    image_grid: Vec<String>,
    #[command(flatten)]
    form: FormArgs,
}

/// `target` relative to the directory `base` when both resolve (`../../models/tiny`), else `target` as given.
fn relative(target: &Path, base: &Path) -> PathBuf {
    let (Ok(t), Ok(b)) = (target.canonicalize(), base.canonicalize()) else {
        return target.to_path_buf();
    };
    let (tc, bc): (Vec<Component>, Vec<Component>) =
        (t.components().collect(), b.components().collect());
    let common = tc.iter().zip(&bc).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..bc.len() {
        out.push("..");
    }
    for c in &tc[common..] {
        out.push(c.as_os_str());
    }
    out
}

/// Fails when a value of a list option is given twice (the set would list its graphs twice).
fn refuse_repeats<T: PartialEq + std::fmt::Debug>(flag: &str, values: &[T]) -> Result<()> {
    for (i, v) in values.iter().enumerate() {
        if values[..i].contains(v) {
            bail!("{flag}: {v:?} is given twice");
        }
    }
    Ok(())
}

/// Runs `qwen35 export-ir`.
pub fn exec(args: ExportArgs) -> Result<Outcome> {
    Paths::new()
        .with(&args.model)
        .output("--out", Some(&args.out), Kind::NewDir)
        .check()?;
    refuse_repeats("--blocks", &args.blocks)?;
    refuse_repeats("--parts", &args.parts)?;
    if args.model.dtype != Dtype::F32 {
        bail!(
            "--dtype applies to reference runs; graphs are written in f32 with --weights storage"
        );
    }
    let form = args.form.graph_form()?;
    if args.blocks.contains(&0) {
        bail!("--blocks: block sizes must be at least 1");
    }
    if args.context == 0 {
        bail!("--context must be at least 1");
    }
    if let Some(b) = args.blocks.iter().find(|&&b| b > args.context) {
        bail!(
            "--blocks {b}: a block longer than the static context of {} (--context) never fits",
            args.context
        );
    }
    let grids = args
        .image_grid
        .iter()
        .map(|g| {
            let (h, w) = super::args::parse_pair("--image-grid", g, "HxW in patches, e.g. 32x32")?;
            Ok(reference::vision::Grid { t: 1, h, w })
        })
        .collect::<Result<Vec<_>>>()?;
    if let Some(i) = (0..grids.len()).find(|&i| grids[..i].contains(&grids[i])) {
        bail!(
            "--image-grid {} is given twice (one graph per grid)",
            args.image_grid[i]
        );
    }
    let (dir, config, store) = args.model.open_for(&args.form)?;
    let vc = if grids.is_empty() {
        None
    } else {
        let vc = crate::images::vision_config(&dir)?;
        for (g, text) in grids.iter().zip(&args.image_grid) {
            g.check(vc.spatial_merge_size)
                .with_context(|| format!("--image-grid {text}"))?;
            crate::memory::need(
                &format!("--image-grid {text} (a vision graph over its patches)"),
                crate::memory::vision_work_bytes(&vc, (g.h as u64).saturating_mul(g.w as u64)),
            )?;
        }
        Some(vc)
    };
    let opts = GraphOptions {
        form,
        output_scale: args.form.output_scale(PORT_OUTPUT_SCALE)? as f32,
        context: args.context,
        taps: !args.no_taps,
        // A set that runs images: its decoder takes the image rows with the text's.
        embeddings_input: !grids.is_empty(),
        moe: args.form.moe_form(),
    };
    let builder = Builder::new(&config, &store, opts)?;
    // Written into a sibling and moved into place whole: an error or an interruption leaves no partial set behind.
    let staged = StagedDir::create("--out", &args.out)?;
    let out = staged.path().to_path_buf();
    let mut sizes = vec![1];
    sizes.extend(args.blocks.iter().copied().filter(|&b| b != 1));
    sizes.sort_unstable();
    sizes.dedup();
    let decoder = args.parts.contains(&PartArg::Decoder);
    let layers = args.layers || args.parts.contains(&PartArg::Layers);
    let bin_name = "weights.bin";
    let bin_path = out.join(bin_name);
    let bin = SharedBin::create(&bin_path)?;
    let file = |name: &str| GraphFile {
        tokens: None,
        layer: None,
        xml: out.join(format!("{name}.xml")),
        bin: bin_path.clone(),
    };
    let mut decoder_files = Vec::new();
    let mut layer_files = Vec::new();
    for &t in &sizes {
        if decoder {
            let g = builder.decoder_graph_on(t, Some(&bin))?;
            let f = GraphFile {
                tokens: Some(t),
                ..file(g.name())
            };
            g.save(&f.xml)?;
            decoder_files.push(f);
        }
        if layers {
            for layer in 0..config.num_layers() {
                let g = builder.layer_graph_on(layer, t, Some(&bin))?;
                let f = GraphFile {
                    tokens: Some(t),
                    layer: Some(layer),
                    ..file(g.name())
                };
                g.save(&f.xml)?;
                layer_files.push(f);
            }
        }
    }
    bin.flush()?;
    let mut count = decoder_files.len() + layer_files.len();
    let mut vision = Vec::new();
    for (g, text) in grids.iter().zip(&args.image_grid) {
        let vc = vc.as_ref().context("the checkpoint's vision config")?;
        let graph =
            npu::graphs::vision::vision_graph(vc, &store, std::slice::from_ref(g), opts.taps)
                .map_err(|e| anyhow::anyhow!("--image-grid {text}: {e}"))?;
        let xml = out.join(format!("vision_h{}_w{}.xml", g.h, g.w));
        graph.save(&xml)?;
        count += 1;
        let port = |name: &str| VisionPort {
            name: name.to_string(),
            ty: npu::graphset::ElemKind::F32,
            batch: false,
        };
        vision.push(VisionGraph {
            key: format!("vision[{}]", vision.len()),
            grids: vec![*g],
            bin: xml.with_extension("bin"),
            xml,
            input: port(npu::graphs::vision::PIXELS),
            output: port(reference::vision::names::MERGER),
            taps: if opts.taps {
                Taps::DumpNames
            } else {
                Taps::None
            },
        });
    }
    let set = GraphSet {
        source: args.out.join(manifest::MANIFEST).display().to_string(),
        dir: out.clone(),
        // The sibling has the same parent: the path from it is the path from --out.
        model: Some(relative(&dir, &out)),
        reference_weights: Some(store.format().name()),
        context: Some(args.context),
        decoder: decoder.then(|| Part {
            key: "decoder".into(),
            interface: own::decoder(&config, opts.taps, opts.embeddings_input),
            graphs: decoder_files,
        }),
        layers: layers.then(|| Part {
            key: "layers".into(),
            interface: own::layer(&config),
            graphs: layer_files,
        }),
        vision,
    };
    let mut extra = serde_json::Map::new();
    extra.insert(
        "export".into(),
        serde_json::json!({
            "tool": format!("qwen35 {}", env!("CARGO_PKG_VERSION")),
            "deltanet_form": form.describe(),
            "output_scale": opts.output_scale,
            "taps": opts.taps,
            "blocks": sizes,
        }),
    );
    let text = serde_json::to_string_pretty(&manifest::to_json(&set, extra))? + "\n";
    crate::report::write(&out.join(manifest::MANIFEST), &text)?;
    staged.commit()?;
    crate::errln!(
        "wrote {count} graphs, {bin_name} and {} to {}",
        manifest::MANIFEST,
        args.out.display()
    );
    Ok(Outcome::Pass)
}
