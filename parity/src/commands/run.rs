//! `qwen35 run`: greedy chat generation on the reference decoder (a chat message, or token ids as they are), the
//! text printed as it comes.

use super::Outcome;
use super::args::{FormArgs, ImageArgs, ModelArgs};
use crate::device::{check_positions, reference_on};
use crate::images::{image_ids, reference_images, vision_config};
use crate::non_finite::explain_reference;
use crate::prompts::{ChatPrompt, parse_token_ids};
use anyhow::{Context, Result};
use reference::backend::{greedy, greedy_embedded};
use reference::model::Model;
use reference::tokenizer::ChatTokenizer;

/// Arguments of `qwen35 run`.
#[derive(clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The user message.
    #[arg(long, required_unless_present = "token_ids")]
    prompt: Option<String>,
    /// The prompt as token ids, comma separated, fed as they are (a prompt with videos comes so: each frame's
    /// timestamp, vision_start, video tokens and vision_end as the processor wrote them).
    #[arg(long, value_name = "1,2,3", conflicts_with_all = ["prompt", "system", "think"])]
    token_ids: Option<String>,
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
    images: ImageArgs,
    #[command(flatten)]
    form: FormArgs,
}

/// Runs `qwen35 run`.
pub fn exec(args: RunArgs) -> Result<Outcome> {
    let opts = args.form.run_options()?;
    let (dir, config, mut store) = args.model.open()?;
    args.form.apply_arithmetic(&mut store)?;
    let tok = ChatTokenizer::load(&dir)?;
    let given = args
        .token_ids
        .as_deref()
        .map(|t| parse_token_ids(t, "--token-ids"))
        .transpose()?;
    let chat = ChatPrompt {
        prompt: args.prompt.clone().unwrap_or_default(),
        system: args.system.clone(),
        think: args.think,
    };
    let model = Model::from_weights(config.clone(), &store)?;
    // With images: the vision tower first, its rows at the image tokens of the prompt.
    let images = match args.images.source()? {
        Some(source) => {
            let vc = vision_config(&dir)?;
            let pixels = source.load_with_videos(&dir, &vc)?;
            let chat = given.is_none().then_some(&chat);
            let ids = image_ids(
                given.as_deref(),
                chat,
                &dir,
                &config,
                &vc,
                &pixels.grids,
                pixels.video_grids(),
            )?;
            Some(reference_images(&model.token_table(), &store, &vc, ids, &pixels, false)?.prompt)
        }
        None => None,
    };
    let ids = match (&images, given) {
        (Some(p), _) => p.ids.clone(),
        (None, Some(ids)) => {
            config.check_token_ids(&ids).context("--token-ids")?;
            ids
        }
        (None, None) => tok.encode_chat(&chat.messages(), chat.think)?,
    };
    check_positions(ids.len(), args.max_tokens, &config, "--max-tokens")?;
    let mut backend = reference_on(model, &store, opts, false)?;
    let mut stop = tok.stop_ids();
    stop.extend(config.eos_token_ids.iter().copied());
    let mut generated = Vec::new();
    let mut printed = 0;
    let on_token = |id| {
        generated.push(id);
        if stop.contains(&id) {
            return Ok(());
        }
        let text = tok.decode(&generated, true)?;
        // Print only whole characters: a token may end inside a multi-byte character.
        if !text.ends_with('\u{FFFD}') && text.len() > printed {
            crate::out!("{}", &text[printed..]);
            printed = text.len();
        }
        Ok(())
    };
    let generation = match &images {
        Some(prompt) => greedy_embedded(
            &mut backend,
            prompt,
            args.max_tokens,
            &stop,
            false,
            on_token,
        )?,
        None => greedy(&mut backend, &ids, args.max_tokens, &stop, false, on_token)?,
    };
    let text = tok.decode(&generated, true)?;
    if text.len() > printed {
        crate::out!("{}", &text[printed..]);
    }
    crate::outln!();
    if let Some(i) = generation.nan_at {
        crate::errln!(
            "error: the logits hold NaN at generated token {i}, so no token could be chosen there: {}",
            explain_reference(&config, &store, opts, &ids)?
        );
        return Ok(Outcome::Fail);
    }
    crate::errln!(
        "[{}] prompt {} tokens in {:.2} s ({:.1} tok/s); generated {} tokens in {:.2} s ({:.1} tok/s)",
        dir.display(),
        ids.len(),
        generation.prompt_seconds,
        ids.len() as f64 / generation.prompt_seconds.max(1e-9),
        generation.tokens.len(),
        generation.decode_seconds,
        generation.tokens.len() as f64 / generation.decode_seconds.max(1e-9),
    );
    Ok(Outcome::Pass)
}
