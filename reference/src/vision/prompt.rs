//! A prompt with images as the decoder takes it: the ids with each image's run of placeholder tokens (one per merged
//! row of the tower), their MRoPE positions, and their embeddings with the tower's rows at the placeholders.
//!
//! transformers' processor writes one `image_token_id` per merged row between `vision_start` and `vision_end`
//! (the chat template writes a single one, which the processor expands); [`expand_image_runs`] does the same, and
//! [`check_image_runs`] holds ids given as they are (`--token-ids`) to the images' sizes.

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
    for (n, ((start, len), grid)) in found.iter().zip(grids).enumerate() {
        let need = merged_tokens(grid, vc.spatial_merge_size);
        if *len != need {
            return Err(Error::Input(format!(
                "image {}: {len} image token(s) ({}) at index {start}, but its grid of {}x{} patches merges into \
                 {need}",
                n + 1,
                t.image,
                grid.h,
                grid.w
            )));
        }
        let before = start.checked_sub(1).map(|i| ids[i]);
        let after = ids.get(start + len).copied();
        if before != Some(t.start) || after != Some(t.end) {
            return Err(Error::Input(format!(
                "image {}: its image tokens at index {start} are not between vision_start ({}) and vision_end \
                 ({})",
                n + 1,
                t.start,
                t.end
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

/// The prompt the decoder runs: `ids` (checked against the images' runs), their positions (`get_rope_index`) and
/// their embeddings with `rows` (`[Σ merged, H]`, the tower's output for `grids`) at the image tokens.
pub fn embedded_prompt(
    model: &Model,
    vc: &VisionConfig,
    ids: Vec<u32>,
    grids: &[Grid],
    rows: &Tensor,
) -> Result<EmbeddedPrompt> {
    check_image_runs(&ids, vc, grids)?;
    let positions = rope_index(&ids, &vc.tokens, grids, &[], vc.spatial_merge_size)?;
    let table = model.embed(&ids)?;
    let embeddings = if grids.is_empty() {
        table
    } else {
        scatter_rows(
            &table,
            &ids,
            vc.tokens.image,
            &rows.to_dtype(table.dtype())?,
        )?
    };
    Ok(EmbeddedPrompt {
        ids,
        embeddings,
        positions,
    })
}
