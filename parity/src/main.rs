//! `qwen35`: run, dump and compare the Qwen3.5 decoder.
//!
//! Exit codes: 0 success, 1 a failed check, 2 an error (bad input, missing file, failed run).

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use parity::dump::{FORMAT, reference_dump};
use parity::options::{FormArgs, ModelArgs, parse_token_ids};
use reference::model::{Model, greedy_continue};
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
    let dir = args.model.dir()?;
    let tok = ChatTokenizer::load(&dir)?;
    let model = Model::load(&dir, args.model.dtype.dtype())?;
    let ids = tok.encode_chat(&messages(args.system.as_deref(), &args.prompt), args.think)?;
    let start = Instant::now();
    let mut state = model.new_state()?;
    let logits = model.prefill(&ids, &mut state, &opts, &mut Taps::off())?;
    let prefill_time = start.elapsed();
    let stop = tok.stop_ids();
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

fn dump(args: DumpArgs) -> Result<()> {
    let opts = args.form.run_options()?;
    let dir = args.model.dir()?;
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
    let model = Model::load(&dir, args.model.dtype.dtype())?;
    model.check_ids(&ids).context("--token-ids")?;
    let mut d = reference_dump(&model, &ids, args.generate, &opts)?;
    d.metadata.insert("model".into(), dir.display().to_string());
    if let Some(p) = prompt {
        d.metadata.insert("prompt".into(), p);
    }
    d.write(&args.out)?;
    eprintln!(
        "wrote {} tensors ({} prompt tokens, {} generated) to {}",
        d.tensors.len(),
        ids.len(),
        args.generate,
        args.out.display()
    );
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => run(a),
        Command::Dump(a) => dump(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
