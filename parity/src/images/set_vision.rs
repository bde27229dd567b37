//! A graph set's own vision graphs (`--ir DIR`, its manifest's `vision`) making a device's image rows, as the port
//! runs its tower: each image through the set's graph of its grid (one compiled per grid, run per image), the rows
//! and the taps concatenated in image order, which is the order the reference's tower gives them in (attention stays
//! within each image).

use super::{ImagePrompt, ImageSource, Pixels, with_towers};
use anyhow::{Context, Result, bail};
use candle_core::Tensor;
use npu::devices::CompileOptions;
use npu::engine::SetVision;
use npu::graphset::GraphSet;
use npu::graphset::vision::{VisionGraph, grid_text, plan};
use reference::model::TokenTable;
use reference::vision::{Grid, VisionConfig, names};
use std::collections::BTreeMap;

/// Image `i` as an error names it: its file, or its place among the pixel values.
pub fn image_name(source: &ImageSource, pixels: &Pixels, i: usize) -> String {
    match source {
        ImageSource::Files { paths, .. } if i < paths.len() => {
            format!("image {}", paths[i].display())
        }
        _ => format!("image {} of {}", i + 1, pixels.source),
    }
}

/// The set's graphs that take `grids`, by name (`vision_h8_w10`), as reports name them.
pub fn set_vision_names(set: &GraphSet, grids: &[Grid]) -> String {
    let mut used: Vec<String> = Vec::new();
    if let Ok(steps) = plan(&set.vision, grids) {
        for (g, _) in steps {
            let name = set.vision[g].name();
            if !used.contains(&name) {
                used.push(name);
            }
        }
    }
    used.join(", ")
}

/// Runs `set`'s vision graphs on `device` for `pixels` (the images, then the videos apart, each image through the
/// graph of its grid) and builds `ids`' prompt (text rows from `table`) with their rows: what the port's vision graphs hand its
/// decoder. A grid the set has no graph for is an error naming the manifest and the grids it has.
pub fn set_images(
    table: &TokenTable,
    vc: &VisionConfig,
    ids: Vec<u32>,
    pixels: &Pixels,
    set: &GraphSet,
    device: &str,
    compile: &CompileOptions,
) -> Result<ImagePrompt> {
    // Each graph compiled once, on its first image.
    let mut compiled: BTreeMap<usize, SetVision> = BTreeMap::new();
    with_towers(table, vc, ids, pixels, |values, grids| {
        let steps = plan(&set.vision, grids).map_err(|i| {
            let has: Vec<String> = set.vision.iter().map(VisionGraph::grids_text).collect();
            anyhow::anyhow!(
                "{}: no vision graph takes image {} of {} ({} patches): the set's graphs take {}",
                set.source,
                i + 1,
                pixels.source,
                grid_text(&grids[i]),
                has.join(", ")
            )
        })?;
        let mut start = 0;
        let mut parts: Vec<BTreeMap<String, Tensor>> = Vec::new();
        for (g, images) in steps {
            let graph = &set.vision[g];
            let exec = match compiled.entry(g) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => e.insert(
                    SetVision::open(set, graph, vc, device, compile).with_context(|| {
                        format!("{}'s vision graph {} on {device}", set.source, graph.name())
                    })?,
                ),
            };
            let patches: usize = grids[images].iter().map(Grid::patches).sum();
            let x = values.narrow(0, start, patches)?;
            start += patches;
            parts.push(
                exec.run(&x)
                    .with_context(|| format!("{} on {device}", graph.name()))?,
            );
        }
        let taps = concat_rows(parts)?;
        let rows = taps
            .get(names::MERGER)
            .context("the set's vision graph gave no merger output")?
            .clone();
        Ok((rows, taps))
    })
}

/// Every tap all `parts` give, their rows concatenated in order.
fn concat_rows(parts: Vec<BTreeMap<String, Tensor>>) -> Result<BTreeMap<String, Tensor>> {
    let Some(first) = parts.first() else {
        bail!("no images");
    };
    let mut out = BTreeMap::new();
    for name in first.keys() {
        let rows: Option<Vec<&Tensor>> = parts.iter().map(|p| p.get(name)).collect();
        if let Some(rows) = rows {
            out.insert(name.clone(), Tensor::cat(&rows, 0)?);
        }
    }
    Ok(out)
}
