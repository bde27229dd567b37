//! Prompts with images: the pixel patches (preprocessed here from image files, or computed elsewhere and read from
//! a safetensors file), the prompt's ids with each image's placeholder run, and the prompt the decoder runs, its
//! image tokens carrying a vision tower's rows (the reference's, or a device's static vision graph's).

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor};
use reference::backend::{
    Backend, EmbeddedPrompt, Forced, Generation, greedy, greedy_embedded, teacher_forced,
    teacher_forced_embedded,
};
use reference::config::Config;
use reference::model::Model;
use reference::taps::Taps;
use reference::tokenizer::ChatTokenizer;
use reference::vision::preprocess::{Preprocessor, RgbImage};
use reference::vision::prompt::{check_image_runs, embedded_prompt, expand_image_runs};
use reference::vision::{Grid, VisionConfig, VisionTower};
use reference::weights::WeightStore;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::prompts::ChatPrompt;

/// Where a run's images come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    /// Image files, preprocessed as the checkpoint's `preprocessor_config.json` says, or resized to `size`
    /// `(width, height)` when given.
    Files {
        /// PNG or JPEG files, in prompt order.
        paths: Vec<PathBuf>,
        /// A fixed size for every image (`--image-size`).
        size: Option<(usize, usize)>,
    },
    /// transformers' `pixel_values` and `image_grid_thw` in a safetensors file.
    PixelValues(PathBuf),
}

/// The pixel patches of a run's images.
#[derive(Debug, Clone)]
pub struct Pixels {
    /// `[Σ patches, 3 · Tp · P · P]` f32, in transformers' `pixel_values` order.
    pub values: Tensor,
    /// One grid per image.
    pub grids: Vec<Grid>,
    /// Where they came from, as reports name it.
    pub source: String,
}

/// The checkpoint's vision tower config, or an error saying the checkpoint has none.
pub fn vision_config(dir: &Path) -> Result<VisionConfig> {
    VisionConfig::from_file(&dir.join("config.json"))?.with_context(|| {
        format!(
            "{}: config.json has no vision_config, so the checkpoint takes no images",
            dir.display()
        )
    })
}

impl ImageSource {
    /// The pixel patches, checked against the tower's patch size.
    pub fn load(&self, dir: &Path, vc: &VisionConfig) -> Result<Pixels> {
        let pixels = match self {
            ImageSource::Files { paths, size } => {
                let p = Preprocessor::from_dir(dir)?;
                let images = paths
                    .iter()
                    .map(|path| {
                        RgbImage::open(path).with_context(|| format!("--image {}", path.display()))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let (values, grids) = p.pixel_values(&images, *size)?;
                let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
                Pixels {
                    values,
                    grids,
                    source: names.join(", "),
                }
            }
            ImageSource::PixelValues(path) => read_pixel_values(path)?,
        };
        let dim = vc.patch_dim();
        let (rows, width) = pixels.values.dims2()?;
        let patches: usize = pixels.grids.iter().map(Grid::patches).sum();
        if width != dim || rows != patches {
            bail!(
                "{}: pixel values [{rows}, {width}] for grids of {patches} patches; the vision tower takes \
                 [{patches}, {dim}]",
                pixels.source
            );
        }
        Ok(pixels)
    }
}

/// `pixel_values` and `image_grid_thw` from a safetensors file (as transformers' processor returns them).
fn read_pixel_values(path: &Path) -> Result<Pixels> {
    let at = format!("--pixel-values {}", path.display());
    let t = candle_core::safetensors::load(path, &Device::Cpu).with_context(|| at.clone())?;
    let get = |key: &str| {
        t.get(key).with_context(|| {
            format!("{at}: no tensor `{key}` (transformers' processor output holds it)")
        })
    };
    let values = get("pixel_values")?.to_dtype(DType::F32)?;
    let thw = get("image_grid_thw")?;
    if thw.rank() != 2 || thw.dim(1)? != 3 {
        bail!(
            "{at}: `image_grid_thw` is {:?}, expected [images, 3]",
            thw.dims()
        );
    }
    let rows: Vec<Vec<i64>> = thw.to_dtype(DType::I64)?.to_vec2()?;
    let grids = rows
        .iter()
        .map(|r| match r.as_slice() {
            &[t, h, w] if t == 1 && h > 0 && w > 0 => Ok(Grid {
                t: 1,
                h: h as usize,
                w: w as usize,
            }),
            _ => bail!("{at}: `image_grid_thw` row {r:?} is not an image's (1, h, w)"),
        })
        .collect::<Result<Vec<_>>>()?;
    if values.rank() != 2 {
        bail!(
            "{at}: `pixel_values` is {:?}, expected [patches, dim]",
            values.dims()
        );
    }
    Ok(Pixels {
        values,
        grids,
        source: at,
    })
}

/// The ids of a prompt with `grids` images: token ids given as they are (each image's run checked), or a chat
/// message through the template with the images before its text, each placeholder expanded to its image's rows.
pub fn image_ids(
    token_ids: Option<&[u32]>,
    chat: Option<&ChatPrompt>,
    dir: &Path,
    config: &Config,
    vc: &VisionConfig,
    grids: &[Grid],
) -> Result<Vec<u32>> {
    let ids = match (token_ids, chat) {
        (Some(ids), _) => {
            check_image_runs(ids, vc, grids).context("--token-ids")?;
            ids.to_vec()
        }
        (None, Some(chat)) => {
            let tok = ChatTokenizer::load(dir)?;
            let t = &vc.tokens;
            let placeholder = tok.decode(&[t.start, t.image, t.end], false)?;
            let ids = tok.encode_chat_with_images(
                &chat.messages(),
                grids.len(),
                &placeholder,
                chat.think,
            )?;
            expand_image_runs(&ids, vc, grids).context("--prompt")?
        }
        (None, None) => bail!("give the prompt as --prompt TEXT or --token-ids LIST"),
    };
    config.check_token_ids(&ids).context("--token-ids")?;
    Ok(ids)
}

/// A prompt with images: a vision tower's taps (`vision.*`) and the prompt the decoder runs with its rows.
pub struct ImagePrompt {
    /// The decoder's prompt.
    pub prompt: EmbeddedPrompt,
    /// `vision.patch_embed`, `vision.pos_embed`, `vision.blocks.{i}.output`, `vision.merger`.
    pub taps: BTreeMap<String, Tensor>,
}

/// Runs the reference's vision tower on `pixels` (from `store`) and builds `ids`' prompt on `model`; `scores`
/// records the blocks' attention scores too (for the range report: they hold the square of the patches).
pub fn reference_images(
    model: &Model,
    store: &WeightStore,
    vc: &VisionConfig,
    ids: Vec<u32>,
    pixels: &Pixels,
    scores: bool,
) -> Result<ImagePrompt> {
    let mut tower = VisionTower::load(vc.clone(), store)?;
    if scores {
        tower = tower.with_attention_scores();
    }
    let mut taps = Taps::on();
    let rows = tower.forward(
        &pixels.values.to_dtype(model.dtype())?,
        &pixels.grids,
        &mut taps,
    )?;
    let prompt = embedded_prompt(model, vc, ids, &pixels.grids, &rows)?;
    Ok(ImagePrompt {
        prompt,
        taps: taps.take(),
    })
}

/// Runs the static vision graph for `pixels`' grids (every tap out) on `device` and builds `ids`' prompt on `model`
/// with the graph's rows: what a device's vision tower hands its decoder.
pub fn device_images(
    model: &Model,
    store: &WeightStore,
    vc: &VisionConfig,
    ids: Vec<u32>,
    pixels: &Pixels,
    device: &str,
    compile: &npu::devices::CompileOptions,
) -> Result<ImagePrompt> {
    let graph = npu::graphs::vision::vision_graph(vc, store, &pixels.grids, true)?;
    let mut exec = npu::infer::prepare(graph, device, compile)
        .with_context(|| format!("the vision graph on {device}"))?;
    let taps = exec.run(&[(npu::graphs::vision::PIXELS, &pixels.values)])?;
    let rows = taps
        .get(reference::vision::names::MERGER)
        .context("the vision graph gave no merger output")?;
    let prompt = embedded_prompt(model, vc, ids, &pixels.grids, rows)?;
    Ok(ImagePrompt { prompt, taps })
}

/// What a run feeds a backend: token ids, or a prompt with images (its embeddings made by one vision tower).
#[derive(Debug, Clone)]
pub enum PromptInput {
    /// Token ids.
    Ids(Vec<u32>),
    /// A prompt with images.
    Images(EmbeddedPrompt),
}

impl PromptInput {
    /// The prompt's token ids.
    pub fn ids(&self) -> &[u32] {
        match self {
            PromptInput::Ids(ids) => ids,
            PromptInput::Images(p) => &p.ids,
        }
    }

    /// [`greedy`] or [`greedy_embedded`] from a fresh state.
    pub fn greedy(
        &self,
        backend: &mut dyn Backend,
        max_new: usize,
        all_logits: bool,
    ) -> reference::Result<Generation> {
        match self {
            PromptInput::Ids(ids) => greedy(backend, ids, max_new, &[], all_logits, |_| Ok(())),
            PromptInput::Images(p) => {
                greedy_embedded(backend, p, max_new, &[], all_logits, |_| Ok(()))
            }
        }
    }

    /// [`teacher_forced`] or [`teacher_forced_embedded`] from a fresh state.
    pub fn forced(
        &self,
        backend: &mut dyn Backend,
        continuation: &[u32],
    ) -> reference::Result<Forced> {
        match self {
            PromptInput::Ids(ids) => teacher_forced(backend, ids, continuation),
            PromptInput::Images(p) => teacher_forced_embedded(backend, p, continuation),
        }
    }
}
