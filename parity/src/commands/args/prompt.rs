//! The prompt options several commands share (`--token-ids`, `--prompt`, `--system`, `--think`).

use crate::images::ImageSource;
use crate::prompts::{ChatPrompt, PromptSource, parse_token_ids};
use anyhow::{Context, Result, bail};
use clap::Args;
use reference::config::Config;
use std::path::{Path, PathBuf};

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

    /// The ids of a prompt with `pixels`' images and videos (see [`crate::images::image_ids`]; with videos the ids
    /// are given as --token-ids).
    pub fn vision_ids(
        &self,
        dir: &Path,
        config: &Config,
        vc: &reference::vision::VisionConfig,
        pixels: &crate::images::Pixels,
    ) -> Result<Vec<u32>> {
        self.check_chat_options(None)?;
        let ids = self
            .token_ids
            .as_deref()
            .map(|t| parse_token_ids(t, "--token-ids"))
            .transpose()?;
        let chat = self.prompt.as_ref().map(|_| self.chat());
        crate::images::image_ids(
            ids.as_deref(),
            chat.as_ref(),
            dir,
            config,
            vc,
            &pixels.grids,
            pixels.video_grids(),
        )
    }

    /// The chat message of --prompt.
    pub fn chat(&self) -> ChatPrompt {
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

/// The images of a prompt (`--image`, `--image-size`, `--pixel-values`).
#[derive(Debug, Clone, Args)]
pub struct ImageArgs {
    /// An image (PNG or JPEG) shown before the prompt's text, preprocessed as the checkpoint's
    /// preprocessor_config.json says; repeat for several. With --token-ids, the ids hold each image's vision_start,
    /// image tokens (one per merged row) and vision_end.
    #[arg(long = "image", value_name = "FILE")]
    pub images: Vec<PathBuf>,
    /// Resize every --image to WIDTHxHEIGHT (whole merge blocks) instead, as the NPU port does (512x512).
    #[arg(long, value_name = "WxH", requires = "images")]
    pub image_size: Option<String>,
    /// Pixel values computed elsewhere: a safetensors file holding transformers' `pixel_values` and
    /// `image_grid_thw`, or its videos' `pixel_values_videos` and `video_grid_thw` (run, dump, compare-devices), or
    /// both, fed to the vision tower as they are. With videos, --token-ids holds each frame's run as the processor
    /// wrote it (its timestamp, vision_start, one video token per merged row, vision_end).
    #[arg(long, value_name = "FILE.safetensors", conflicts_with = "images")]
    pub pixel_values: Option<PathBuf>,
}

impl ImageArgs {
    /// Where the images come from, `None` for a prompt of text.
    pub fn source(&self) -> Result<Option<ImageSource>> {
        if let Some(p) = &self.pixel_values {
            return Ok(Some(ImageSource::PixelValues(p.clone())));
        }
        if self.images.is_empty() {
            return Ok(None);
        }
        let size = self
            .image_size
            .as_deref()
            .map(|s| super::parse_pair("--image-size", s, "WIDTHxHEIGHT in pixels, e.g. 512x512"))
            .transpose()?;
        Ok(Some(ImageSource::Files {
            paths: self.images.clone(),
            size,
        }))
    }
}
