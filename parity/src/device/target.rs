//! What a checking command (compare-devices, probe, validate) puts under test: this project's graphs of the
//! checkpoint (or llama.cpp on its GGUF file), or a graph set made elsewhere and the checkpoint the reference runs
//! against it. The one place that decides whose graphs a run uses, for the decoder and the vision tower alike: the
//! commands ask it for the device and for the device's image rows, never which kind it is.

use super::fault::Fault;
use super::llamacpp::{self, LlamaCppDevice};
use super::own::OwnGraphs;
use super::set::{SetGraphs, SetSource};
use super::{DeviceSettings, DeviceUnderTest};
use crate::images::{ImagePrompt, Pixels, device_images, set_images, set_vision_names};
use anyhow::{Result, bail};
use reference::config::Config;
use reference::model::TokenTable;
use reference::vision::{Grid, VisionConfig};
use reference::weights::WeightStore;
use std::path::{Path, PathBuf};

/// The graphs under test and the checkpoint the reference runs.
pub enum Target {
    /// This project's graphs (or llama.cpp's, for `--devices llama.cpp`), built from the checkpoint: its directory
    /// (or GGUF file), config and weights.
    Own(Box<(PathBuf, Config, WeightStore)>),
    /// A set made elsewhere.
    Set(Box<SetSource>),
}

impl Target {
    /// The checkpoint the reference runs: its directory, config and weights.
    pub fn checkpoint(&self) -> (&Path, &Config, &WeightStore) {
        match self {
            Target::Own(c) => (&c.0, &c.1, &c.2),
            Target::Set(s) => (&s.checkpoint, &s.config, &s.store),
        }
    }

    /// The set made elsewhere, if that is what is tested (what a report says of it, and its memory).
    pub fn set(&self) -> Option<&SetSource> {
        match self {
            Target::Set(s) => Some(s),
            Target::Own(_) => None,
        }
    }

    /// The static context of the graphs (`settings`' for this project's), and where it comes from.
    pub fn context(&self, settings: &DeviceSettings) -> (Option<usize>, String) {
        match self {
            Target::Set(s) => s.context(),
            Target::Own(_) => (Some(settings.graph.context), "--context".into()),
        }
    }

    /// Fails, before any work, unless the device can make the image rows of images of `grids` (and videos of
    /// `videos`): a set needs a vision graph of each grid; `name(i)` names image `i` in the error.
    pub fn check_images(
        &self,
        grids: &[Grid],
        videos: &[Grid],
        name: impl Fn(usize) -> String,
    ) -> Result<()> {
        match self {
            Target::Set(s) => s.check_images(grids, videos, name),
            Target::Own(_) => Ok(()),
        }
    }

    /// The device's image rows for the prompt `ids` with `pixels`, made by its own vision graphs (this project's
    /// built from the checkpoint, or the set's, compiled as its decoder is) on `settings.device`, the text rows
    /// from `host`; and the vision graph in words, for the report.
    pub fn images(
        &self,
        host: &TokenTable,
        vc: &VisionConfig,
        ids: Vec<u32>,
        pixels: &Pixels,
        settings: &DeviceSettings,
    ) -> Result<(ImagePrompt, String)> {
        let device = &settings.device;
        if llamacpp::is_llamacpp(device) {
            bail!(
                "--devices {device}: llama.cpp is driven with token ids only here; a prompt with images needs \
                 a device with a vision graph"
            );
        }
        Ok(match self {
            Target::Set(s) => (
                set_images(host, vc, ids, pixels, &s.set, device, &settings.compile)?,
                format!(
                    "the set's vision graph {}",
                    set_vision_names(&s.set, &pixels.grids)
                ),
            ),
            Target::Own(c) => (
                device_images(host, &c.2, vc, ids, pixels, device, &settings.compile)?,
                "the device's vision graph".to_string(),
            ),
        })
    }

    /// The device under test on `settings.device`: llama.cpp on the GGUF file, this project's graphs with
    /// `settings`, or the set compiled with `settings.compile`; misbehaving as `fault` says (tests only).
    pub fn device(
        &self,
        settings: DeviceSettings,
        fault: Option<Fault>,
    ) -> Result<Box<dyn DeviceUnderTest + '_>> {
        if llamacpp::is_llamacpp(&settings.device) {
            let Target::Own(c) = self else {
                bail!(
                    "--devices {}: llama.cpp runs a GGUF file (--model FILE.gguf), not a graph set (--ir)",
                    settings.device
                );
            };
            let gguf = llamacpp::gguf_of(&c.0)?;
            return Ok(Box::new(LlamaCppDevice::open(
                &gguf,
                &c.1,
                &settings.device,
                settings.graph.context,
                fault,
            )?));
        }
        Ok(match self {
            Target::Set(s) => Box::new(SetGraphs::open(
                s,
                &settings.device,
                &settings.compile,
                fault,
            )?),
            Target::Own(c) => Box::new(OwnGraphs::open(&c.1, &c.2, settings, fault)?),
        })
    }
}
