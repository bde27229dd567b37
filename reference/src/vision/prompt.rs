//! A prompt with images and videos as the decoder takes it: the ids with each image's (each video frame's) run of
//! placeholder tokens (one per merged row of the tower), their MRoPE positions, and their embeddings with the tower's
//! rows at the placeholders.
//!
//! transformers' processor writes one `image_token_id` per merged row between `vision_start` and `vision_end`
//! (the chat template writes a single one, which the processor expands); [`expand_image_runs`] does the same, and
//! [`check_image_runs`] holds ids given as they are (`--token-ids`) to the images' sizes. A video is written frame by
//! frame, each frame's timestamp text (`<0.5 seconds>`, from the video's metadata) then its run of `video_token_id`
//! between `vision_start` and `vision_end`; [`check_video_runs`] holds the ids to the videos' grids.

use crate::backend::EmbeddedPrompt;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::vision::positions::{rope_index, scatter_rows};
use crate::vision::{Grid, VisionConfig};
use candle_core::Tensor;

/// The merged rows (placeholder tokens) of an image of `grid`.
pub fn merged_tokens(grid: &Grid, merge: usize) -> usize {
    grid.patches() / (merge * merge)
}

/// The runs of image tokens in `ids`: `(first index, length)` of each, in order.
fn runs(ids: &[u32], token: u32) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        if id != token {
            continue;
        }
        match out.last_mut() {
            Some((start, len)) if *start + *len == i => *len += 1,
            _ => out.push((i, 1)),
        }
    }
    out
}

/// Fails unless `ids` hold one run of `image_token_id` per image, in order, each of its merged rows' length and
/// between `vision_start` and `vision_end`; the error says which image and what was found.
pub fn check_image_runs(ids: &[u32], vc: &VisionConfig, grids: &[Grid]) -> Result<()> {
    let t = &vc.tokens;
    let found = runs(ids, t.image);
    if found.len() != grids.len() {
        return Err(Error::Input(format!(
            "the ids hold {} run(s) of image tokens ({}) for {} image(s): each image needs vision_start ({}), \
             its image tokens and vision_end ({})",
            found.len(),
            t.image,
            grids.len(),
            t.start,
            t.end
        )));
    }
    let units: Vec<(String, Grid)> = grids
        .iter()
        .enumerate()
        .map(|(n, g)| (format!("image {}", n + 1), *g))
        .collect();
    check_runs(ids, vc, &found, &units, "image")
}

/// Fails unless `ids` hold one run of `video_token_id` per frame of each video (a grid of `t` frames), in order,
/// each of the frame's merged rows' length and between `vision_start` and `vision_end`; the error names the video
/// and the frame.
pub fn check_video_runs(ids: &[u32], vc: &VisionConfig, grids: &[Grid]) -> Result<()> {
    let t = &vc.tokens;
    let found = runs(ids, t.video);
    let units: Vec<(String, Grid)> = grids
        .iter()
        .enumerate()
        .flat_map(|(v, g)| {
            (0..g.t).map(move |f| {
                (
                    format!("video {}, frame {}", v + 1, f + 1),
                    Grid { t: 1, ..*g },
                )
            })
        })
        .collect();
    if found.len() != units.len() {
        let frames: Vec<String> = grids.iter().map(|g| g.t.to_string()).collect();
        return Err(Error::Input(format!(
            "the ids hold {} run(s) of video tokens ({}) for {} video(s) of {} frame(s): each frame needs its \
             timestamp, vision_start ({}), its video tokens and vision_end ({}), as the processor writes them",
            found.len(),
            t.video,
            grids.len(),
            frames.join(" + "),
            t.start,
            t.end
        )));
    }
    check_runs(ids, vc, &found, &units, "video")
}

/// Each run of `found` against its unit (what errors call it, and its grid of one image or frame).
fn check_runs(
    ids: &[u32],
    vc: &VisionConfig,
    found: &[(usize, usize)],
    units: &[(String, Grid)],
    kind: &str,
) -> Result<()> {
    let t = &vc.tokens;
    let token = if kind == "video" { t.video } else { t.image };
    for ((start, len), (name, grid)) in found.iter().zip(units) {
        let need = merged_tokens(grid, vc.spatial_merge_size);
        if *len != need {
            return Err(Error::Input(format!(
                "{name}: {len} {kind} token(s) ({token}) at index {start}, but its grid of {}x{} patches merges \
                 into {need}",
                grid.h, grid.w
            )));
        }
        let before = start.checked_sub(1).map(|i| ids[i]);
        let after = ids.get(start + len).copied();
        if before != Some(t.start) || after != Some(t.end) {
            return Err(Error::Input(format!(
                "{name}: its {kind} tokens at index {start} are not between vision_start ({}) and vision_end ({})",
                t.start, t.end
            )));
        }
    }
    Ok(())
}

/// `ids` with each image's single placeholder token (as a chat template writes it) repeated to the image's merged
/// rows, as transformers' processor expands it; the result passes [`check_image_runs`].
pub fn expand_image_runs(ids: &[u32], vc: &VisionConfig, grids: &[Grid]) -> Result<Vec<u32>> {
    let found = runs(ids, vc.tokens.image);
    if found.len() != grids.len() || found.iter().any(|&(_, len)| len != 1) {
        return Err(Error::Input(format!(
            "the prompt holds {} image placeholder(s) for {} image(s)",
            found.len(),
            grids.len()
        )));
    }
    let mut out = Vec::with_capacity(ids.len());
    let mut image = 0;
    for &id in ids {
        if id == vc.tokens.image {
            let n = merged_tokens(&grids[image], vc.spatial_merge_size);
            out.extend(std::iter::repeat_n(id, n));
            image += 1;
        } else {
            out.push(id);
        }
    }
    check_image_runs(&out, vc, grids)?;
    Ok(out)
}

/// A vision tower's output for some grids (a prompt's images, or its videos: transformers runs the tower on each
/// apart): `rows` `[Σ merged, H]` for `grids`.
#[derive(Debug, Clone, Copy)]
pub struct TowerRows<'a> {
    /// The grids the tower ran on, in prompt order.
    pub grids: &'a [Grid],
    /// The merger's rows for them.
    pub rows: &'a Tensor,
}

/// The prompt the decoder runs: `ids` (checked against the images' runs and the videos' frames), their positions
/// (`get_rope_index` with both) and their embeddings with the images' rows at the image tokens and the videos' at
/// the video tokens.
pub fn embedded_prompt(
    model: &Model,
    vc: &VisionConfig,
    ids: Vec<u32>,
    images: Option<TowerRows>,
    videos: Option<TowerRows>,
) -> Result<EmbeddedPrompt> {
    let table = model.embed(&ids)?;
    embedded_prompt_on(table, vc, ids, images, videos)
}

/// [`embedded_prompt`] on `table`, the embedding table's rows of `ids` (`[T, H]`, looked up once): a run that makes
/// several prompts of the same ids (one per device's vision graph) needs the table's rows, not the whole model.
pub fn embedded_prompt_on(
    table: Tensor,
    vc: &VisionConfig,
    ids: Vec<u32>,
    images: Option<TowerRows>,
    videos: Option<TowerRows>,
) -> Result<EmbeddedPrompt> {
    if table.dims2()?.0 != ids.len() {
        return Err(Error::Input(format!(
            "embedding rows {:?} for {} ids",
            table.dims(),
            ids.len()
        )));
    }
    let image_grids = images.map_or(&[][..], |r| r.grids);
    let video_grids = videos.map_or(&[][..], |r| r.grids);
    check_image_runs(&ids, vc, image_grids)?;
    check_video_runs(&ids, vc, video_grids)?;
    let positions = rope_index(
        &ids,
        &vc.tokens,
        image_grids,
        video_grids,
        vc.spatial_merge_size,
    )?;
    let mut embeddings = table;
    for (given, token) in [(images, vc.tokens.image), (videos, vc.tokens.video)] {
        if let Some(r) = given.filter(|r| !r.grids.is_empty()) {
            embeddings = scatter_rows(
                &embeddings,
                &ids,
                token,
                &r.rows.to_dtype(embeddings.dtype())?,
            )?;
        }
    }
    Ok(EmbeddedPrompt {
        ids,
        embeddings,
        positions,
    })
}
