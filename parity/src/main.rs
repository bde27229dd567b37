//! `qwen35`: run, dump and compare the Qwen3.5 decoder.
//!
//! Exit codes: 0 success, 1 a failed check, 2 an error (bad input, missing file, failed run).

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use npu::graphs::{Builder, DEFAULT_CONTEXT, GraphOptions};
use parity::device::{DeviceSettings, openvino_dump};
use parity::dump::{FORMAT, reference_dump};
use parity::options::{Backend, DeviceArgs, Dtype, FormArgs, ModelArgs, parse_token_ids};
use reference::linear_attn::PORT_OUTPUT_SCALE;
use reference::model::greedy_continue;
use reference::taps::Taps;
use reference::tokenizer::{ChatTokenizer, Message};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser)]
#[command(
    name = "qwen35",
    version,
    about = "Reference runs and parity dumps of the Qwen3.5 hybrid decoder"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Greedy chat generation on the reference decoder.
    Run(RunArgs),
    /// Run a prompt and write every intermediate, the states and a greedy continuation to a safetensors file.
    #[command(after_long_help = FORMAT)]
    Dump(DumpArgs),
    /// The OpenVINO runtime and its devices: names, architecture, NPU driver, precisions.
    Devices(DevicesArgs),
    /// Write the static OpenVINO graphs of a checkpoint (decoder and per-layer) and a manifest of their interfaces.
    ExportIr(ExportArgs),
}

#[derive(clap::Args)]
struct DevicesArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct ExportArgs {
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

#[derive(clap::Args)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The user message.
    #[arg(long)]
    prompt: String,
    /// An optional system message.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64, value_name = "N")]
    max_tokens: usize,
    /// Thinking mode (the template's `enable_thinking`); off by default.
    #[arg(long)]
    think: bool,
    #[command(flatten)]
    form: FormArgs,
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["token_ids", "prompt"])))]
struct DumpArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt as token ids, comma separated.
    #[arg(long, value_name = "1,2,3")]
    token_ids: Option<String>,
    /// The prompt as a user message, formatted with the checkpoint's chat template.
    #[arg(long)]
    prompt: Option<String>,
    /// An optional system message before --prompt.
    #[arg(long, requires = "prompt")]
    system: Option<String>,
    /// Thinking mode for --prompt.
    #[arg(long)]
    think: bool,
    /// Greedy tokens to generate after the prompt (exactly this many).
    #[arg(long, default_value_t = 0, value_name = "N")]
    generate: usize,
    /// Output file.
    #[arg(long, value_name = "FILE.safetensors")]
    out: PathBuf,
    #[command(flatten)]
    form: FormArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

fn messages(system: Option<&str>, prompt: &str) -> Vec<Message> {
    let mut m = Vec::new();
    if let Some(s) = system {
        m.push(Message::new("system", s));
    }
    m.push(Message::new("user", prompt));
    m
}

fn run(args: RunArgs) -> Result<()> {
    let opts = args.form.run_options()?;
    let (dir, _, _, model) = args.model.load()?;
    let tok = ChatTokenizer::load(&dir)?;
    let ids = tok.encode_chat(&messages(args.system.as_deref(), &args.prompt), args.think)?;
    let start = Instant::now();
    let mut state = model.new_state()?;
    let logits = model.prefill(&ids, &mut state, &opts, &mut Taps::off())?;
    let prefill_time = start.elapsed();
    let mut stop = tok.stop_ids();
    stop.extend(model.config().eos_token_ids.iter().copied());
    let mut generated = Vec::new();
    let mut printed = 0;
    let mut out = std::io::stdout().lock();
    let decode_start = Instant::now();
    let tokens = greedy_continue(
        &model,
        &mut state,
        logits,
        args.max_tokens,
        &stop,
        &opts,
        |id| {
            generated.push(id);
            if stop.contains(&id) {
                return Ok(());
            }
            let text = tok.decode(&generated, true)?;
            // Print only whole characters: a token may end inside a multi-byte character.
            if !text.ends_with('\u{FFFD}') && text.len() > printed {
                let _ = write!(out, "{}", &text[printed..]);
                let _ = out.flush();
                printed = text.len();
            }
            Ok(())
        },
    )?;
    let decode_time = decode_start.elapsed();
    let text = tok.decode(&generated, true)?;
    if text.len() > printed {
        write!(out, "{}", &text[printed..])?;
    }
    writeln!(out)?;
    eprintln!(
        "[{}] prompt {} tokens in {:.2} s ({:.1} tok/s); generated {} tokens in {:.2} s ({:.1} tok/s)",
        dir.display(),
        ids.len(),
        prefill_time.as_secs_f64(),
        ids.len() as f64 / prefill_time.as_secs_f64(),
        tokens.len(),
        decode_time.as_secs_f64(),
        tokens.len() as f64 / decode_time.as_secs_f64().max(1e-9),
    );
    Ok(())
}

/// What a dump will run, validated before any work.
enum Plan {
    Reference(reference::model::RunOptions),
    OpenVino(DeviceSettings),
}

fn dump(args: DumpArgs) -> Result<()> {
    // Validate the backend's options before any work; those of the other backend are refused, not ignored.
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
            Plan::OpenVino(DeviceSettings::resolve(&args.device, &args.form)?)
        }
    };
    // The reference model is built only for a reference dump: a device dump needs the weights, not a second copy
    // of them in f32.
    let (dir, config, store) = args.model.open()?;
    let (ids, prompt) = match (&args.token_ids, &args.prompt) {
        (Some(t), _) => (parse_token_ids(t)?, None),
        (None, Some(p)) => {
            let tok = ChatTokenizer::load(&dir)?;
            (
                tok.encode_chat(&messages(args.system.as_deref(), p), args.think)?,
                Some(p.clone()),
            )
        }
        (None, None) => unreachable!("clap requires one of --token-ids and --prompt"),
    };
    config.check_token_ids(&ids).context("--token-ids")?;
    let mut d = match &plan {
        Plan::Reference(opts) => {
            let model = reference::model::Model::from_weights(config.clone(), &store)?;
            let mut d = reference_dump(&model, &ids, args.generate, opts)?;
            d.metadata.insert("weights".into(), store.format().name());
            d
        }
        Plan::OpenVino(settings) => openvino_dump(&config, &store, &ids, args.generate, settings)?,
    };
    d.metadata.insert("model".into(), dir.display().to_string());
    if let Some(p) = prompt {
        d.metadata.insert("prompt".into(), p);
    }
    d.write(&args.out)?;
    eprintln!(
        "wrote {} tensors ({} prompt tokens, {} generated, {} on {}) to {}",
        d.tensors.len(),
        ids.len(),
        args.generate,
        d.metadata["backend"],
        d.metadata
            .get("device")
            .map(String::as_str)
            .unwrap_or("the CPU reference"),
        args.out.display()
    );
    Ok(())
}

fn devices(args: DevicesArgs) -> Result<()> {
    let (version, devices) = npu::devices::list()?;
    let runtime = npu::runtime::load()?;
    if args.json {
        let list: Vec<serde_json::Value> = devices
            .iter()
            .map(|d| {
                serde_json::json!({
                    "name": d.name, "full_name": d.full_name, "architecture": d.architecture,
                    "driver_version": d.driver_version, "capabilities": d.capabilities,
                    "default_precision": d.default_precision,
                })
            })
            .collect();
        let out = serde_json::json!({
            "openvino": version, "library": runtime.library.display().to_string(), "devices": list
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("OpenVINO {version} ({})", runtime.library.display());
    for d in devices {
        println!("{}: {}", d.name, d.full_name);
        if let Some(a) = &d.architecture {
            println!("  architecture: {a}");
        }
        if let Some(v) = &d.driver_version {
            println!("  NPU driver: {v}");
        }
        println!("  capabilities: {}", d.capabilities.join(" "));
        if let Some(p) = &d.default_precision {
            println!("  default inference precision: {p} (reference runs ask for f32 explicitly)");
        }
    }
    Ok(())
}

fn export_ir(args: ExportArgs) -> Result<()> {
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
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => run(a),
        Command::Dump(a) => dump(a),
        Command::Devices(a) => devices(a),
        Command::ExportIr(a) => export_ir(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
