//! The prompt options several commands share (`--token-ids`, `--prompt`, `--system`, `--think`).

use crate::prompts::{ChatPrompt, PromptSource, parse_token_ids};
use anyhow::{Context, Result, bail};
use clap::Args;
use reference::config::Config;
use std::path::Path;

/// The prompt of a run: token ids, or a chat message formatted with the checkpoint's template.
#[derive(Debug, Clone, Args)]
pub struct PromptArgs {
    /// The prompt as token ids, comma separated.
    #[arg(long, value_name = "1,2,3", conflicts_with = "prompt")]
    pub token_ids: Option<String>,
    /// The prompt as a user message, formatted with the checkpoint's chat template.
    #[arg(long)]
    pub prompt: Option<String>,
    /// An optional system message before --prompt.
    #[arg(long, requires = "prompt")]
    pub system: Option<String>,
    /// Thinking mode for --prompt.
    #[arg(long, requires = "prompt")]
    pub think: bool,
}

impl PromptArgs {
    /// Whether a prompt was given.
    pub fn given(&self) -> bool {
        self.token_ids.is_some() || self.prompt.is_some()
    }

    /// Fails on an option of a chat message given without one (`--system`, `--think` without `--prompt`), naming
    /// what it was given with: it would be ignored.
    fn check_chat_options(&self, file: Option<&Path>) -> Result<()> {
        if self.prompt.is_some() {
            return Ok(());
        }
        let with = match (&self.token_ids, file) {
            (Some(_), _) => "--token-ids (ids are fed as they are)".to_string(),
            (None, Some(f)) => format!(
                "--prompts {} (each line says its own messages and thinking)",
                f.display()
            ),
            (None, None) => "no --prompt".to_string(),
        };
        for (flag, given) in [("--system", self.system.is_some()), ("--think", self.think)] {
            if given {
                bail!("{flag} applies to --prompt, a chat message; it was given with {with}");
            }
        }
        Ok(())
    }

    /// The token ids (checked against the vocabulary) and the prompt text if any.
    pub fn ids(&self, dir: &Path, config: &Config) -> Result<(Vec<u32>, Option<String>)> {
        self.check_chat_options(None)?;
        let (ids, text) = match (&self.token_ids, &self.prompt) {
            (Some(t), _) => (parse_token_ids(t, "--token-ids")?, None),
            (None, Some(p)) => (self.chat().encode(dir)?, Some(p.clone())),
            (None, None) => bail!("give the prompt as --prompt TEXT or --token-ids LIST"),
        };
        config.check_token_ids(&ids).context("--token-ids")?;
        Ok((ids, text))
    }

    fn chat(&self) -> ChatPrompt {
        ChatPrompt {
            prompt: self.prompt.clone().unwrap_or_default(),
            system: self.system.clone(),
            think: self.think,
        }
    }

    /// Where the prompts of a run come from: this prompt, else `file` (`--prompts`), else the shipped set.
    pub fn source(&self, file: Option<&Path>) -> Result<PromptSource> {
        self.check_chat_options(file)?;
        Ok(match (&self.token_ids, &self.prompt, file) {
            (Some(t), _, _) => PromptSource::Ids(parse_token_ids(t, "--token-ids")?),
            (None, Some(_), _) => PromptSource::Chat(self.chat()),
            (None, None, Some(f)) => PromptSource::File(f.to_path_buf()),
            (None, None, None) => PromptSource::Default,
        })
    }
}
