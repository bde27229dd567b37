//! A multimodal prompt's rotary positions and embeddings.
//!
//! Positions, as transformers' `get_rope_index` lays them out: text tokens advance one by one on all three rows; the
//! `N` tokens of an image (a run of `image_token_id`) take `t = s`, `h = s + row`, `w = s + column` over its merged
//! grid (`s` the position the image starts at), and the text after it continues from `s + max(rows, columns)`. A
//! video is split into its frames (Qwen3.5 writes a timestamp before each), each frame a run of `video_token_id`
//! laid out as an image.

use crate::error::{Error, Result};
use crate::rope::Positions;
use crate::vision::{Grid, VisionTokens};
use candle_core::Tensor;

/// The positions `[3, T]` of `ids`, whose image runs are `images` and whose video frames come from `videos`, in
/// prompt order; `merge` is the vision tower's `spatial_merge_size`.
pub fn rope_index(
    ids: &[u32],
    tokens: &VisionTokens,
    images: &[Grid],
    videos: &[Grid],
    merge: usize,
) -> Result<Positions> {
    let frames: Vec<Grid> = videos
        .iter()
        .flat_map(|g| std::iter::repeat_n(Grid { t: 1, ..*g }, g.t))
        .collect();
    let (mut next_image, mut next_frame) = (images.iter(), frames.iter());
    let mut rows: [Vec<i64>; 3] = Default::default();
    let mut current: i64 = 0;
    let mut i = 0;
    while i < ids.len() {
        let kind = ids[i];
        let mut end = i + 1;
        while end < ids.len() && ids[end] == kind {
            end += 1;
        }
        let run = end - i;
        let grid = if kind == tokens.image {
            Some((next_image.next(), "image", images.len()))
        } else if kind == tokens.video {
            Some((next_frame.next(), "video frame", frames.len()))
        } else {
            None
        };
        match grid {
            None => {
                for p in current..current + run as i64 {
                    for r in rows.iter_mut() {
                        r.push(p);
                    }
                }
                current += run as i64;
            }
            Some((None, what, given)) => {
                return Err(Error::Input(format!(
                    "the prompt has more {what} runs than the {given} {what}s given (run at token {i})"
                )));
            }
            Some((Some(g), what, _)) => {
                g.check(merge)?;
                let (gh, gw) = (g.h / merge, g.w / merge);
                if run != gh * gw {
                    return Err(Error::Input(format!(
                        "the {what} at token {i} has {run} placeholder tokens, but its {} x {} patch grid \
                         merges to {}",
                        g.h,
                        g.w,
                        gh * gw
                    )));
                }
                for r in 0..gh {
                    for c in 0..gw {
                        rows[0].push(current);
                        rows[1].push(current + r as i64);
                        rows[2].push(current + c as i64);
                    }
                }
                current += gh.max(gw) as i64;
            }
        }
        i = end;
    }
    let (left_images, left_frames) = (next_image.count(), next_frame.count());
    if left_images + left_frames > 0 {
        return Err(Error::Input(format!(
            "{left_images} image(s) and {left_frames} video frame(s) have no placeholder run in the prompt"
        )));
    }
    Ok(Positions(rows))
}

/// `embeddings` `[T, H]` with the rows at the tokens equal to `token` replaced, in order, by `rows` `[N, H]`.
pub fn scatter_rows(embeddings: &Tensor, ids: &[u32], token: u32, rows: &Tensor) -> Result<Tensor> {
    let t = embeddings.dim(0)?;
    if ids.len() != t {
        return Err(Error::Input(format!(
            "{} token ids for {t} embeddings",
            ids.len()
        )));
    }
    let n = rows.dim(0)?;
    let count = ids.iter().filter(|&&i| i == token).count();
    if count != n {
        return Err(Error::Input(format!(
            "{count} tokens {token} in the prompt for {n} rows of the vision tower"
        )));
    }
    let mut k = 0;
    let index: Vec<u32> = ids
        .iter()
        .enumerate()
        .map(|(p, &id)| {
            if id == token {
                k += 1;
                (t + k - 1) as u32
            } else {
                p as u32
            }
        })
        .collect();
    let all = Tensor::cat(&[embeddings, &rows.to_dtype(embeddings.dtype())?], 0)?;
    let index = Tensor::from_vec(index, t, embeddings.device())?;
    Ok(all.index_select(&index, 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKENS: VisionTokens = VisionTokens {
        image: 9,
        video: 8,
        start: 7,
        end: 6,
    };

    #[test]
    fn an_image_spans_its_grid_and_text_continues_past_its_longer_side() {
        // 2 text, a 4x6-patch image (2x3 merged), 2 text.
        let ids = [1, 7, 9, 9, 9, 9, 9, 9, 6, 2];
        let p = rope_index(&ids, &TOKENS, &[Grid { t: 1, h: 4, w: 6 }], &[], 2).unwrap();
        assert_eq!(p.0[0], vec![0, 1, 2, 2, 2, 2, 2, 2, 5, 6]);
        assert_eq!(p.0[1], vec![0, 1, 2, 2, 2, 3, 3, 3, 5, 6]);
        assert_eq!(p.0[2], vec![0, 1, 2, 3, 4, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn a_video_is_laid_out_frame_by_frame() {
        let ids = [8, 8, 1, 8, 8];
        let p = rope_index(&ids, &TOKENS, &[], &[Grid { t: 2, h: 2, w: 4 }], 2).unwrap();
        assert_eq!(p.0[0], vec![0, 0, 2, 3, 3]);
        assert_eq!(p.0[2], vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn placeholder_counts_must_match_the_grids() {
        let e = rope_index(&[9, 9, 9], &TOKENS, &[Grid { t: 1, h: 4, w: 4 }], &[], 2);
        assert!(format!("{}", e.unwrap_err()).contains("3 placeholder tokens"));
        let e = rope_index(&[1, 2], &TOKENS, &[Grid { t: 1, h: 2, w: 2 }], &[], 2);
        assert!(format!("{}", e.unwrap_err()).contains("no placeholder run"));
        let e = rope_index(&[9], &TOKENS, &[], &[], 2);
        assert!(format!("{}", e.unwrap_err()).contains("more image runs"));
    }
}
