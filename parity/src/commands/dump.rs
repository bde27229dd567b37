//! `qwen35 dump`: every intermediate of a prompt, the states after it and a greedy continuation, from the reference
//! or a device, in the dump format every backend shares.

use super::Outcome;
use super::args::{
    Backend, DeviceArgs, Dtype, FormArgs, ImageArgs, ModelArgs, PromptArgs, refuse_graph_flags,
};
use crate::device::DeviceUnderTest;
use crate::device::own::engine;
use crate::device::set::{SetGraphs, SetSource};
use crate::device::{DeviceSettings, check_context, check_positions, reference_on};
use crate::dump::{FORMAT, ImageDump, write_dump, write_image_dump};
use crate::images::{
    ImagePrompt, device_images, image_name, reference_images, set_images, set_vision_names,
    vision_config,
};
use crate::memory;
use crate::outputs::Paths;
use anyhow::{Context, Result, bail};
use npu::graphset::Taps;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Arguments of `qwen35 dump`.
#[derive(clap::Args)]
#[command(after_long_help = FORMAT)]
pub struct DumpArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    prompt: PromptArgs,
    #[command(flatten)]
    images: ImageArgs,
    /// Greedy tokens to generate after the prompt (this many, unless NaN logits stop the generation: `nan_at`).
    #[arg(long, default_value_t = 0, value_name = "N")]
    generate: usize,
    /// Output file.
    #[arg(long, value_name = "FILE.safetensors")]
    out: PathBuf,
    #[command(flatten)]
    form: FormArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// Dump a graph set made elsewhere (with --backend openvino): DIR holds its IR files and a manifest.json of their
    /// ports (docs/graph-sets.md), which must expose the dump's hidden outputs (`taps`). With --image, the set's own
    /// vision graphs (its manifest's `vision`) make the image rows its decoder runs on.
    #[arg(long, value_name = "DIR")]
    ir: Option<PathBuf>,
}

/// What a dump will run, validated before any work.
enum Plan {
    Reference(reference::model::RunOptions),
    OpenVino(DeviceSettings),
}

/// Refuses a set whose decoder exposes no hidden outputs: a dump holds every one.
fn refuse_untapped(set: &SetSource) -> Result<()> {
    if let Some(d) = &set.set.decoder
        && d.interface.taps == Taps::None
    {
        bail!(
            "--ir {}: {}'s decoder exposes no hidden outputs (`decoder.taps`), which a dump holds: compare-devices \
             --ir compares what a set exposes",
            set.dir.display(),
            set.set.source
        );
    }
    Ok(())
}

/// Runs `qwen35 dump`.
pub fn exec(args: DumpArgs) -> Result<Outcome> {
    Paths::new()
        .with(&args.model)
        .with(&args.device)
        .input("--ir", args.ir.as_ref())
        .file("--out", Some(&args.out))
        .check()?;
    if !args.prompt.given() {
        bail!("give the prompt as --prompt TEXT or --token-ids LIST");
    }
    // Validate the backend's options before any work; those of the other backend are refused, not ignored.
    let image_source = args.images.source()?;
    let plan = match args.device.backend {
        Backend::Reference => {
            args.device.check_reference()?;
            Plan::Reference(args.form.run_options()?)
        }
        Backend::Openvino => {
            if args.model.dtype != Dtype::F32 {
                bail!(
                    "--dtype f64 applies to the reference; OpenVINO graphs compute in f32 or f16 (--precision)"
                );
            }
            let device = args.device.device.as_deref().unwrap_or("CPU");
            let mut settings = args.device.graph.settings(device, &args.form)?;
            // The image tokens' rows come from the vision graph: the decoder graphs take embeddings.
            settings.graph.embeddings_input = image_source.is_some();
            Plan::OpenVino(settings)
        }
    };
    // A set made elsewhere brings its graphs and names its checkpoint; else this project's graphs of --model's.
    let set_source = match (&args.ir, &plan) {
        (Some(ir), Plan::OpenVino(_)) => {
            refuse_graph_flags(&args.form, &args.device.graph, ir)?;
            let s = args.model.open_set(ir)?;
            refuse_untapped(&s)?;
            Some(s)
        }
        (Some(_), Plan::Reference(_)) => bail!("--ir applies to --backend openvino"),
        (None, _) => None,
    };
    let (dir, config, store) = match &set_source {
        // The checkpoint the set was opened against (--model, else the one its manifest names).
        Some(s) => ModelArgs {
            model: Some(s.checkpoint.clone()),
            ..args.model.clone()
        }
        .open()?,
        None => {
            let (dir, config, mut store) = args.model.open_for(&args.form)?;
            if let Plan::Reference(_) = plan {
                args.form.apply_arithmetic(&mut store)?;
            }
            (dir, config, store)
        }
    };
    let images = match &image_source {
        Some(source) => {
            let vc = vision_config(&dir)?;
            let pixels = source.load_with_videos(&dir, &vc)?;
            let ids = args.prompt.vision_ids(&dir, &config, &vc, &pixels)?;
            if let Some(s) = &set_source {
                s.check_images(&pixels.grids, pixels.video_grids(), |i| {
                    image_name(source, &pixels, i)
                })?;
            }
            Some((vc, pixels, ids))
        }
        None => None,
    };
    let (ids, prompt) = match &images {
        Some((_, _, ids)) => (ids.clone(), args.prompt.prompt.clone()),
        None => args.prompt.ids(&dir, &config)?,
    };
    check_positions(ids.len(), args.generate, &config, "--generate")?;
    let format = store.format();
    let dtype = args.model.dtype.dtype();
    let memory_for = |format| -> Result<crate::memory::Plan> {
        let run = (
            "the run".to_string(),
            memory::run_bytes(&config, 1, ids.len() + args.generate),
        );
        let mut m = crate::memory::Plan::default();
        match &plan {
            Plan::Reference(_) => m.phase(
                "the reference",
                vec![
                    (
                        "its weights".into(),
                        memory::reference_bytes(&dir, &config, dtype, format)?,
                    ),
                    run,
                ],
            ),
            Plan::OpenVino(s) => {
                let mut parts = match &set_source {
                    Some(set) => vec![
                        ("its graphs".into(), memory::set_graph_bytes(&set.set)),
                        ("the runtime".into(), memory::RUNTIME_BYTES),
                    ],
                    None => memory::graph_parts(
                        &config,
                        format,
                        &s.device,
                        &[s.block],
                        s.graph.moe,
                        s.graph.context,
                    ),
                };
                parts.push(run);
                m.phase(format!("{}: the graphs with taps", s.device), parts)
            }
        };
        if let Some((vc, pixels, _)) = &images {
            let devices: Vec<&str> = match &plan {
                Plan::OpenVino(s) => vec![s.device.as_str()],
                _ => Vec::new(),
            };
            memory::add_images(&mut m, vc, pixels.patches(), 1, &devices);
        }
        Ok(m)
    };
    memory::check_formats("dump", format, memory_for, Vec::new())?;
    let mut metadata = BTreeMap::from([("model".to_string(), dir.display().to_string())]);
    if let Some(p) = prompt {
        metadata.insert("prompt".into(), p);
    }
    if let Some((_, pixels, _)) = &images {
        metadata.insert("images".into(), pixels.source.clone());
        if let Some(v) = &pixels.videos {
            let grids: Vec<String> = v
                .grids
                .iter()
                .map(|g| format!("{}x{}x{}", g.t, g.h, g.w))
                .collect();
            metadata.insert("videos".into(), grids.join(", "));
        }
    }
    // The reference model runs the reference's side; the OpenVINO path needs only its embedding table (the text rows
    // of a prompt with images).
    let model = match &plan {
        Plan::OpenVino(_) => None,
        _ => Some(reference::model::Model::from_weights(
            config.clone(),
            &store,
        )?),
    };
    let table = match (&model, &images) {
        (_, None) => None,
        (Some(m), Some(_)) => Some(m.token_table()),
        (None, Some(_)) => Some(reference::model::TokenTable::load(&config, &store)?),
    };
    let image_prompt = |device: Option<&DeviceSettings>| -> Result<Option<ImagePrompt>> {
        let (Some((vc, pixels, ids)), Some(table)) = (&images, &table) else {
            return Ok(None);
        };
        Ok(Some(match device {
            None => reference_images(table, &store, vc, ids.clone(), pixels, false)?,
            // A set made elsewhere: its own vision graphs, compiled as its decoder is.
            Some(s) => match &set_source {
                Some(set) => set_images(
                    table,
                    vc,
                    ids.clone(),
                    pixels,
                    &set.set,
                    &s.device,
                    &args.device.graph.compile(&s.device)?,
                )?,
                None => device_images(
                    table,
                    &store,
                    vc,
                    ids.clone(),
                    pixels,
                    &s.device,
                    &s.compile,
                )?,
            },
        }))
    };
    let write = |backend: &mut dyn reference::backend::Backend,
                 images: Option<ImagePrompt>,
                 metadata| match &images {
        Some(i) => write_image_dump(
            backend,
            ImageDump {
                prompt: &i.prompt,
                vision: &i.taps,
            },
            args.generate,
            metadata,
            &args.out,
        ),
        None => write_dump(backend, &ids, args.generate, metadata, &args.out),
    };
    let d = match &plan {
        Plan::Reference(opts) => {
            let images = image_prompt(None)?;
            let model = model.clone().context("the reference model")?;
            let mut backend = reference_on(model, &store, *opts, true)?;
            write(&mut backend, images, metadata)?
        }
        Plan::OpenVino(settings) => match &set_source {
            Some(set) => {
                if let (Some(context), at) = set.context() {
                    check_context(ids.len(), args.generate, context, &at)?;
                }
                let mut metadata = metadata;
                if let Some((_, pixels, _)) = &images {
                    metadata.insert(
                        "vision_graph".into(),
                        set_vision_names(&set.set, &pixels.grids),
                    );
                }
                let images = image_prompt(Some(settings))?;
                let compile = args.device.graph.compile(&settings.device)?;
                let mut graphs = SetGraphs::open(set, &settings.device, &compile, None)?;
                write(graphs.deployed()?, images, metadata)?
            }
            None => {
                check_context(
                    ids.len(),
                    args.generate,
                    settings.graph.context,
                    "--context",
                )?;
                let images = image_prompt(Some(settings))?;
                let mut backend = engine(&config, &store, settings, true)?;
                write(&mut backend, images, metadata)?
            }
        },
    };
    crate::errln!(
        "wrote {} tensors ({} prompt tokens, {} generated, {} on {}) to {}",
        d.tensors,
        ids.len(),
        d.generated,
        d.metadata["backend"],
        d.metadata
            .get("device")
            .map(String::as_str)
            .unwrap_or("the CPU reference"),
        args.out.display()
    );
    // A run that produced NaN or infinity is a finding: the file is kept (it is what to look at), the exit is 1.
    let stopped = d.metadata.get("nan_at").map(|i| {
        format!(
            "the logits hold NaN at generated token {i}, so {} of the {} tokens asked were generated (`nan_at`)",
            d.generated, args.generate
        )
    });
    let first = crate::non_finite::summary(&d.non_finite);
    if stopped.is_some() || first.is_some() {
        let what: Vec<String> = [stopped, first].into_iter().flatten().collect();
        crate::errln!("error: {}", what.join("; "));
        return Ok(Outcome::Fail);
    }
    Ok(Outcome::Pass)
}
