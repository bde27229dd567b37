//! Prompts with images and videos: the pixel patches (preprocessed here from image files, or computed elsewhere and
//! read from a safetensors file, videos' too), the prompt's ids with each image's (each video frame's) placeholder
//! run, and the prompt the decoder runs, its image and video tokens carrying a vision tower's rows (the reference's,
//! or a device's static vision graph's). As transformers does, the tower runs on the images and on the videos apart:
//! the images' taps are `vision.*`, the videos' `video.vision.*` (the goldens' names for their video case).

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor};
use reference::backend::{
    Backend, EmbeddedPrompt, Forced, Generation, greedy, greedy_embedded, teacher_forced,
    teacher_forced_embedded,
};
use reference::config::Config;
use reference::model::TokenTable;
use reference::taps::Taps;
use reference::tokenizer::ChatTokenizer;
use reference::vision::preprocess::{Preprocessor, RgbImage};
use reference::vision::prompt::{
    TowerRows, check_image_runs, check_video_runs, embedded_prompt_on, expand_image_runs,
};
use reference::vision::{Grid, VisionConfig, VisionTower};
use reference::weights::WeightStore;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::prompts::ChatPrompt;

mod set_vision;
pub use set_vision::{image_name, set_images, set_vision_names};

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
    /// transformers' `pixel_values` and `image_grid_thw`, `pixel_values_videos` and `video_grid_thw`, or both pairs,
    /// in a safetensors file.
    PixelValues(PathBuf),
}

/// The pixel patches of a run's images (and videos).
#[derive(Debug, Clone)]
pub struct Pixels {
    /// The images' `[Σ patches, 3 · Tp · P · P]` f32, in transformers' `pixel_values` order (no rows when only
    /// videos were given).
    pub values: Tensor,
    /// One grid per image.
    pub grids: Vec<Grid>,
    /// The videos, when given (`pixel_values_videos` and `video_grid_thw`).
    pub videos: Option<Videos>,
    /// Where they came from, as reports name it.
    pub source: String,
}

/// The pixel patches of a run's videos, which the tower takes apart from the images.
#[derive(Debug, Clone)]
pub struct Videos {
    /// `[Σ patches, 3 · Tp · P · P]` f32, every frame of every video in order (`pixel_values_videos`).
    pub values: Tensor,
    /// One grid per video, `t` its frames (temporal patches).
    pub grids: Vec<Grid>,
}

impl Pixels {
    /// Every patch the towers take: the images' and the videos'.
    pub fn patches(&self) -> usize {
        self.grids
            .iter()
            .chain(self.video_grids())
            .map(Grid::patches)
            .sum()
    }

    /// The videos' grids (none without videos).
    pub fn video_grids(&self) -> &[Grid] {
        self.videos.as_ref().map_or(&[], |v| &v.grids)
    }

    /// What the prompt holds, as a report labels it: `with 2 image(s)`, `with 1 video(s) of 2 frame(s)`, or both.
    pub fn label(&self) -> String {
        let mut parts = Vec::new();
        if !self.grids.is_empty() || self.videos.is_none() {
            parts.push(format!("{} image(s)", self.grids.len()));
        }
        if let Some(v) = &self.videos {
            let frames: usize = v.grids.iter().map(|g| g.t).sum();
            parts.push(format!("{} video(s) of {frames} frame(s)", v.grids.len()));
        }
        format!("with {}", parts.join(" and "))
    }
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
    /// The images' pixel patches, checked against the tower's patch size; a file holding videos is refused (the
    /// commands that take videos call [`ImageSource::load_with_videos`]).
    pub fn load(&self, dir: &Path, vc: &VisionConfig) -> Result<Pixels> {
        let pixels = self.load_with_videos(dir, vc)?;
        if pixels.videos.is_some() {
            bail!(
                "{}: `pixel_values_videos` holds video; this command takes images only (run, dump and \
                 compare-devices take videos)",
                pixels.source
            );
        }
        Ok(pixels)
    }

    /// The pixel patches of the images and, from a `--pixel-values` file holding them, the videos, checked against
    /// the tower's patch size and merge blocks.
    pub fn load_with_videos(&self, dir: &Path, vc: &VisionConfig) -> Result<Pixels> {
        let pixels = match self {
            ImageSource::Files { paths, size } => {
                let p = Preprocessor::from_dir(dir)?;
                check_image_memory(&p, paths, *size, dir, vc)?;
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
                    videos: None,
                    source: names.join(", "),
                }
            }
            ImageSource::PixelValues(path) => return read_pixel_values(path, vc),
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

/// Fails unless decoding `paths` and preprocessing them as `p` says (or to `fixed` `(width, height)`), then running the
/// vision tower over their patches, fits the memory available: every size from the files' headers, the flag and
/// `preprocessor_config.json`, counted before any image is decoded (a grey image as the RGB it is converted to),
/// an error naming the image and what set its size.
fn check_image_memory(
    p: &Preprocessor,
    paths: &[PathBuf],
    fixed: Option<(usize, usize)>,
    dir: &Path,
    vc: &VisionConfig,
) -> Result<()> {
    let config = dir.join("preprocessor_config.json");
    let mut total = 0u64;
    for path in paths {
        let at = || format!("--image {}", path.display());
        let (width, height) = RgbImage::dimensions(path).with_context(at)?;
        let ((w, h), by) = match fixed {
            Some(wh) => (wh, format!("--image-size {}x{}", wh.0, wh.1)),
            None if p.do_resize => {
                let (h, w) = p.target_size(height, width).with_context(at)?;
                ((w, h), format!("the pixel bounds of {}", config.display()))
            }
            None => ((width, height), "its own size (no resizing)".to_string()),
        };
        let (w, h) = (w as u64, h as u64);
        // The decoded image and its RGB conversion, the resized image and its intermediate pass (8 bits a
        // channel), the normalised planes and the patches (f32).
        let decoded = 6u64.saturating_mul((width as u64).saturating_mul(height as u64));
        let pixels = w.saturating_mul(h);
        let preprocessed = (6 + 12 + 12 * p.temporal_patch_size as u64).saturating_mul(pixels);
        let patches = pixels / (p.patch_size as u64).pow(2).max(1);
        total = total
            .saturating_add(decoded)
            .saturating_add(preprocessed)
            .saturating_add(crate::memory::vision_work_bytes(vc, patches));
        crate::memory::need(
            &format!(
                "{} ({width}x{height}, resized to {w}x{h} by {by}; decoded, preprocessed and through the vision \
                 tower, with the images before it)",
                at()
            ),
            total,
        )?;
    }
    Ok(())
}

/// The images' and the videos' patches from a safetensors file, as transformers' processors return them: `pixel_values`
/// with `image_grid_thw`, `pixel_values_videos` with `video_grid_thw`, or both pairs; each checked against its grids
/// and the tower, an error naming the file and the key.
fn read_pixel_values(path: &Path, vc: &VisionConfig) -> Result<Pixels> {
    let at = format!("--pixel-values {}", path.display());
    let bytes = reference::inputs::read(path).with_context(|| at.clone())?;
    let t =
        candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).with_context(|| at.clone())?;
    let images = read_pair(&t, &at, vc, ["pixel_values", "image_grid_thw"])?;
    let videos = read_pair(&t, &at, vc, ["pixel_values_videos", "video_grid_thw"])?;
    let (values, grids) = match (images, &videos) {
        (Some(p), _) => p,
        (None, Some(_)) => (
            Tensor::zeros((0, vc.patch_dim()), DType::F32, &Device::Cpu)?,
            Vec::new(),
        ),
        (None, None) => bail!(
            "{at}: no `pixel_values` with `image_grid_thw` (images) nor `pixel_values_videos` with \
             `video_grid_thw` (videos), the keys of transformers' processor output"
        ),
    };
    Ok(Pixels {
        values,
        grids,
        videos: videos.map(|(values, grids)| Videos { values, grids }),
        source: at,
    })
}

/// One pair of `[values key, grid key]` (`None` when the file holds neither), checked: the grid `[n, 3]` of
/// positive rows in whole merge blocks (an image's `t` is 1), the values `[Σ t·h·w, patch dim]`.
fn read_pair(
    t: &std::collections::HashMap<String, Tensor>,
    at: &str,
    vc: &VisionConfig,
    [values_key, grid_key]: [&str; 2],
) -> Result<Option<(Tensor, Vec<Grid>)>> {
    let video = values_key.ends_with("videos");
    let (values, thw) = match (t.get(values_key), t.get(grid_key)) {
        (None, None) => return Ok(None),
        (Some(_), None) => {
            bail!("{at}: `{values_key}` without `{grid_key}`, which says whose patches they are")
        }
        (None, Some(_)) => {
            bail!("{at}: `{grid_key}` without `{values_key}`, the patches it describes")
        }
        (Some(v), Some(g)) => (v, g),
    };
    if thw.rank() != 2 || thw.dim(1)? != 3 || thw.dim(0)? == 0 {
        bail!(
            "{at}: `{grid_key}` is {:?}, expected [{}, 3] with at least one row",
            thw.dims(),
            if video { "videos" } else { "images" }
        );
    }
    let merge = vc.spatial_merge_size;
    let rows: Vec<Vec<i64>> = thw.to_dtype(DType::I64)?.to_vec2()?;
    let grids = rows
        .iter()
        .enumerate()
        .map(|(n, r)| {
            let whole = |x: i64| x > 0 && (x as usize).is_multiple_of(merge);
            match *r.as_slice() {
                [t, h, w] if (if video { t >= 1 } else { t == 1 }) && whole(h) && whole(w) => Ok(Grid {
                    t: t as usize,
                    h: h as usize,
                    w: w as usize,
                }),
                _ => bail!(
                    "{at}: `{grid_key}` row {n} {r:?} is not {} with h and w whole {merge}x{merge} merge blocks of \
                     patches",
                    if video { "a video's (t, h, w)" } else { "an image's (1, h, w)" }
                ),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let dim = vc.patch_dim();
    let patches: usize = grids.iter().map(Grid::patches).sum();
    if values.rank() != 2 || values.dims() != [patches, dim] {
        bail!(
            "{at}: `{values_key}` is {:?}, but `{grid_key}` {rows:?} makes {patches} patches of {dim} values: \
             expected [{patches}, {dim}]",
            values.dims()
        );
    }
    // Raw 0-255 pixels stored as integers would run as values no processor made; a NaN or an Inf among the values
    // is the file's, not the checkpoint's: both are this input's errors, named here before any tower runs.
    if !values.dtype().is_float() {
        bail!(
            "{at}: `{values_key}` holds {:?} integers; the processor's output is rescaled and normalised floats \
             (raw pixels are never cast and run)",
            values.dtype()
        );
    }
    let values = values.to_dtype(DType::F32)?;
    let flat = values.flatten_all()?.to_vec1::<f32>()?;
    if let Some(i) = flat.iter().position(|x| !x.is_finite()) {
        bail!(
            "{at}: `{values_key}` holds {} at patch {}, value {}: the pixel values are not finite",
            flat[i],
            i / dim.max(1),
            i % dim.max(1)
        );
    }
    Ok(Some((values, grids)))
}

/// The ids of a prompt with images of `grids` and videos of `videos`: token ids given as they are (each image's run
/// and each video frame's checked), or a chat message through the template with the images before its text, each
/// placeholder expanded to its image's rows. A chat message with videos is refused: the processor writes each
/// frame's timestamp from the video's metadata (its fps and sampled frames), which pixel values do not carry.
pub fn image_ids(
    token_ids: Option<&[u32]>,
    chat: Option<&ChatPrompt>,
    dir: &Path,
    config: &Config,
    vc: &VisionConfig,
    grids: &[Grid],
    videos: &[Grid],
) -> Result<Vec<u32>> {
    let ids = match (token_ids, chat) {
        (Some(ids), _) => {
            check_image_runs(ids, vc, grids).context("--token-ids")?;
            check_video_runs(ids, vc, videos).context("--token-ids")?;
            ids.to_vec()
        }
        (None, Some(_)) if !videos.is_empty() => bail!(
            "--prompt with videos: transformers' processor writes each frame's timestamp (`<0.5 seconds>`) from the \
             video's metadata (fps, sampled frames), which pixel values do not carry; give the prompt as \
             --token-ids holding each frame's timestamp, vision_start ({}), its {} video tokens ({}) and \
             vision_end ({}) as the processor wrote them",
            vc.tokens.start,
            videos
                .iter()
                .map(|g| g.h * g.w / (vc.spatial_merge_size * vc.spatial_merge_size))
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(" / "),
            vc.tokens.video,
            vc.tokens.end
        ),
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

/// A prompt with images (videos): a vision tower's taps and the prompt the decoder runs with its rows.
pub struct ImagePrompt {
    /// The decoder's prompt.
    pub prompt: EmbeddedPrompt,
    /// The images' `vision.patch_embed`, `vision.pos_embed`, `vision.blocks.{i}.output`, `vision.merger`; the
    /// videos' the same names under `video.` ([`video_tap`]).
    pub taps: BTreeMap<String, Tensor>,
}

/// The name of a tap of the tower's run on the videos (`video.vision.merger`): transformers runs the tower on the
/// videos apart from the images, and the goldens name its taps so in their video case.
pub fn video_tap(name: &str) -> String {
    format!("video.{name}")
}

/// Runs `tower` (pixels and grids in, the merger's rows and the taps out) on the images, then on the videos, and
/// builds `ids`' prompt with both rows, its text rows from `table`.
fn with_towers(
    table: &TokenTable,
    vc: &VisionConfig,
    ids: Vec<u32>,
    pixels: &Pixels,
    mut tower: impl FnMut(&Tensor, &[Grid]) -> Result<(Tensor, BTreeMap<String, Tensor>)>,
) -> Result<ImagePrompt> {
    let mut taps = BTreeMap::new();
    let images = if pixels.grids.is_empty() {
        None
    } else {
        let (rows, t) = tower(&pixels.values, &pixels.grids)?;
        taps.extend(t);
        Some(rows)
    };
    let videos = match &pixels.videos {
        Some(v) => {
            let (rows, t) = tower(&v.values, &v.grids).context("the videos")?;
            taps.extend(t.into_iter().map(|(name, t)| (video_tap(&name), t)));
            Some(rows)
        }
        None => None,
    };
    let prompt = embedded_prompt_on(
        table.embed(&ids)?,
        vc,
        ids,
        images.as_ref().map(|rows| TowerRows {
            grids: &pixels.grids,
            rows,
        }),
        videos.as_ref().map(|rows| TowerRows {
            grids: pixels.video_grids(),
            rows,
        }),
    )?;
    Ok(ImagePrompt { prompt, taps })
}

/// Runs the reference's vision tower on `pixels` (from `store`; the images, then the videos apart) and builds
/// `ids`' prompt, its text rows from `table`; `scores`
/// records the blocks' attention scores too (for the range report: they hold the square of the patches).
pub fn reference_images(
    table: &TokenTable,
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
    with_towers(table, vc, ids, pixels, |values, grids| {
        let mut taps = Taps::on();
        let rows = tower.forward(&values.to_dtype(table.dtype())?, grids, &mut taps)?;
        Ok((rows, taps.take()))
    })
}

/// Runs the static vision graph for `pixels`' grids (every tap out) on `device`, the images' graph and the videos'
/// apart, and builds `ids`' prompt (text rows from `table`) with the graphs' rows: what a device's vision tower hands its decoder.
pub fn device_images(
    table: &TokenTable,
    store: &WeightStore,
    vc: &VisionConfig,
    ids: Vec<u32>,
    pixels: &Pixels,
    device: &str,
    compile: &npu::devices::CompileOptions,
) -> Result<ImagePrompt> {
    with_towers(table, vc, ids, pixels, |values, grids| {
        let graph = npu::graphs::vision::vision_graph(vc, store, grids, true)?;
        let mut exec = npu::infer::prepare(graph, device, compile)
            .with_context(|| format!("the vision graph on {device}"))?;
        let taps = exec.run(&[(npu::graphs::vision::PIXELS, values)])?;
        let rows = taps
            .get(reference::vision::names::MERGER)
            .context("the vision graph gave no merger output")?
            .clone();
        Ok((rows, taps))
    })
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
