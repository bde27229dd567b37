//! The static vision graph (`reference::vision`), as the NPU port fuses it: for a fixed set of image grids (the
//! port's one 32×32-patch image, or any grids asked for), pixel patches in, the merger's rows out, with everything
//! that depends only on the grids folded in as constants: the learned position table resampled to the grids
//! (`reference::vision::grid::resample_table`), the axial rotary tables, and, when the graph holds more than one
//! image or frame, the additive block mask that keeps attention within each.
//!
//! Input `pixel_values` `[N, C·Tp·P·P]` (f32, the processor's patches, merge-block order); output `vision.merger`
//! `[N / m², H]`; with taps also `vision.patch_embed` and `vision.blocks.{i}.output` `[N, Hv]`. The names are the
//! dump format's. Weights are f32 constants read from the checkpoint as the reference reads them.

pub mod block;

use super::GraphTaps;
use crate::error::{Error, Result};
use crate::ir::{ElemType, Graph};
use block::{Affine, Merger, Shared, VisionBlock};
use reference::schema::vision::VisionSchema;
use reference::vision::grid::{attention_spans, resample_table, rotary};
use reference::vision::{Grid, VisionConfig, names};
use reference::weights::WeightStore;

/// The graph's input: the pixel patches.
pub const PIXELS: &str = "pixel_values";

/// The additive mask `[S, S]`: 0 within each span, −inf across.
fn block_mask(spans: &[(usize, usize)], s: usize) -> Vec<f32> {
    let mut mask = vec![f32::NEG_INFINITY; s * s];
    for &(start, len) in spans {
        for i in start..start + len {
            mask[i * s + start..i * s + start + len].fill(0.0);
        }
    }
    mask
}

/// The static vision graph of `config`'s tower for `grids`, its weights from `w` (an f32 store).
pub fn vision_graph(
    config: &VisionConfig,
    w: &WeightStore,
    grids: &[Grid],
    taps: bool,
) -> Result<Graph> {
    if grids.is_empty() {
        return Err(Error::Config(
            "a vision graph needs at least one image grid".into(),
        ));
    }
    let merge = config.spatial_merge_size;
    for g in grids {
        g.check(merge)?;
    }
    let taps = GraphTaps { enabled: taps };
    let s: usize = grids.iter().map(Grid::patches).sum();
    let schema = VisionSchema::new(config);
    let mut graph = Graph::new("vision");
    let pixels = graph.parameter(PIXELS, ElemType::F32, &[s, config.patch_dim()]);

    let patch_embed = Affine::load(&mut graph, w, &[schema.patch_weight(), schema.patch_bias()])?;
    let embedded = patch_embed.forward(&mut graph, pixels)?;
    taps.record(&mut graph, || names::PATCH_EMBED.into(), embedded)?;

    let table = w
        .vision_tensor(&schema.pos_embed())?
        .to_dtype(candle_core::DType::F32)?;
    let resampled = resample_table(&table, grids, config.grid_side(), merge)?;
    let resampled = graph.const_f32(
        &resampled.flatten_all()?.to_vec1::<f32>()?,
        &[s, config.hidden_size],
    )?;
    let mut h = graph.add(embedded, resampled)?;

    let shared = shared(&mut graph, config, grids)?;
    for i in 0..config.depth {
        let block = VisionBlock::load(&mut graph, w, config, i)?;
        h = block.forward(&mut graph, h, &shared)?;
        taps.record(&mut graph, || names::block(i), h)?;
    }
    let merger = Merger::load(&mut graph, w, config)?;
    let merged = merger.forward(&mut graph, h)?;
    graph.result(merged, names::MERGER)?;
    Ok(graph)
}

/// What every block of a graph for `grids` reads: the axial rotary tables and, for several images or frames, the
/// block mask.
fn shared(graph: &mut Graph, config: &VisionConfig, grids: &[Grid]) -> Result<Shared> {
    let merge = config.spatial_merge_size;
    let s: usize = grids.iter().map(Grid::patches).sum();
    let d = config.head_dim();
    let (cos, sin) = rotary(grids, merge, d, config.rope_theta, candle_core::DType::F32)?;
    let cos = graph.const_f32(&cos.flatten_all()?.to_vec1::<f32>()?, &[s, 1, d])?;
    let sin = graph.const_f32(&sin.flatten_all()?.to_vec1::<f32>()?, &[s, 1, d])?;
    let spans = attention_spans(grids);
    let mask = if spans.len() > 1 {
        Some(graph.const_f32(&block_mask(&spans, s), &[s, s])?)
    } else {
        None
    };
    Ok(Shared {
        rotary: (cos, sin),
        mask,
    })
}

/// The input of a one-block graph: the block's input rows `[N, Hv]`.
pub const BLOCK_INPUT: &str = "hidden";

/// Block `index` of the tower alone for `grids` (the probe's unit): `hidden` `[N, Hv]` in,
/// `vision.blocks.{index}.output` out.
pub fn vision_block_graph(
    config: &VisionConfig,
    w: &WeightStore,
    grids: &[Grid],
    index: usize,
) -> Result<Graph> {
    if grids.is_empty() || index >= config.depth {
        return Err(Error::Config(format!(
            "vision block {index} of a tower of {} for {} grid(s)",
            config.depth,
            grids.len()
        )));
    }
    for g in grids {
        g.check(config.spatial_merge_size)?;
    }
    let s: usize = grids.iter().map(Grid::patches).sum();
    let mut graph = Graph::new(&format!("vision_block{index}"));
    let h = graph.parameter(BLOCK_INPUT, ElemType::F32, &[s, config.hidden_size]);
    let shared = shared(&mut graph, config, grids)?;
    let block = VisionBlock::load(&mut graph, w, config, index)?;
    let out = block.forward(&mut graph, h, &shared)?;
    graph.result(out, &names::block(index))?;
    Ok(graph)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_keeps_each_span_to_itself() {
        let m = block_mask(&[(0, 2), (2, 1)], 3);
        let open: Vec<bool> = m.iter().map(|x| *x == 0.0).collect();
        assert_eq!(
            open,
            vec![true, true, false, true, true, false, false, false, true]
        );
    }
}
