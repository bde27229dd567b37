//! A set's static vision graphs (the manifest's `vision`): pixel patches of fixed image grids in, the merger's rows
//! out, as the NPU port runs its tower (one graph per fixed grid, one image per call). Each is described by its file,
//! its grids, its input and output ports and, optionally, hidden outputs under the dump's names; [`resolve`] holds
//! the description against the IR's real ports (names, element types, each static dim against the size the
//! checkpoint's vision config gives), errors naming the manifest, the key and the file.

use super::{ElemKind, Taps};
use crate::devices::{IrPorts, PortInfo};
use crate::error::{Error, Result};
use reference::vision::{Grid, VisionConfig};
use std::path::PathBuf;

/// The side of a vision graph a port is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionSide {
    /// The pixel patches `[patches, patch_dim]`.
    Input,
    /// The merger's rows `[rows, hidden]`.
    Output,
}

impl VisionSide {
    /// The manifest's key.
    pub fn key(self) -> &'static str {
        match self {
            VisionSide::Input => "input",
            VisionSide::Output => "output",
        }
    }

    /// The manifest's names of the two axes, in order (a leading `batch` of 1 may come before them).
    pub fn axes(self) -> [&'static str; 2] {
        match self {
            VisionSide::Input => ["patches", "patch_dim"],
            VisionSide::Output => ["rows", "hidden"],
        }
    }
}

/// A vision graph's input or output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisionPort {
    /// The IR's name.
    pub name: String,
    /// Its element type (f32 or f16).
    pub ty: ElemKind,
    /// Whether a batch axis of 1 comes first (`["batch", "patches", "patch_dim"]`).
    pub batch: bool,
}

/// One static vision graph of a set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisionGraph {
    /// Where the manifest describes it (`vision`, `vision[1]`), for messages.
    pub key: String,
    /// The grids of the images it takes, in order (the port's: one image of 32×32 patches).
    pub grids: Vec<Grid>,
    /// The `.xml`.
    pub xml: PathBuf,
    /// The `.bin`.
    pub bin: PathBuf,
    /// The pixel patches in.
    pub input: VisionPort,
    /// The merger's rows out.
    pub output: VisionPort,
    /// Hidden outputs under the dump's names (`vision.patch_embed`, `vision.blocks.{i}.output`, …): `DumpNames`
    /// takes every other output whose name starts with `vision.`; a map's `{i}` is the vision block.
    pub taps: Taps,
}

impl VisionGraph {
    /// The grids as the manifest writes them (`8x10`, `1x8x10` for several frames), for messages.
    pub fn grids_text(&self) -> String {
        self.grids
            .iter()
            .map(grid_text)
            .collect::<Vec<_>>()
            .join(" + ")
    }

    /// The IR file's stem (`vision_h32_w32`), as reports name the graph.
    pub fn name(&self) -> String {
        self.xml.file_stem().map_or_else(
            || self.xml.display().to_string(),
            |s| s.to_string_lossy().into_owned(),
        )
    }
}

/// A grid as `HxW` (an image) or `TxHxW`.
pub fn grid_text(g: &Grid) -> String {
    if g.t == 1 {
        format!("{}x{}", g.h, g.w)
    } else {
        format!("{}x{}x{}", g.t, g.h, g.w)
    }
}

/// One vision graph's ports, resolved and checked: the pixel patches in, the merger's rows out, the taps (dump name,
/// port name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedVision {
    /// The input.
    pub input: VisionPort,
    /// The output.
    pub output: VisionPort,
    /// Hidden outputs: the dump's name and the port's.
    pub taps: Vec<(String, String)>,
    /// The patches the graph takes (Σ over its grids).
    pub patches: usize,
    /// The rows it gives.
    pub rows: usize,
}

fn same_type(ir: &str, ty: ElemKind) -> bool {
    ir == ty.name()
}

/// Checks `graph` (described by `source`) against its IR's `ports` for the checkpoint's vision tower `vc`.
pub fn resolve(
    source: &str,
    graph: &VisionGraph,
    vc: &VisionConfig,
    ports: &IrPorts,
) -> Result<ResolvedVision> {
    let file = graph.xml.display().to_string();
    let err = |key: &str, message: String| {
        Error::Interface(format!(
            "{source}: `{}.{key}` ({file}): {message}",
            graph.key
        ))
    };
    let merge = vc.spatial_merge_size;
    for (i, g) in graph.grids.iter().enumerate() {
        g.check(merge).map_err(|e| {
            Error::Config(format!(
                "{source}: `{}.grid_thw[{i}]`: {e} (the checkpoint's vision tower merges {merge}x{merge} patches)",
                graph.key
            ))
        })?;
    }
    let patches: usize = graph.grids.iter().map(Grid::patches).sum();
    let rows: usize = graph.grids.iter().map(|g| g.tokens(merge)).sum();
    let check = |side: VisionSide, port: &VisionPort, list: &[PortInfo], sizes: [usize; 2]| {
        let key = side.key();
        let Some(p) = list.iter().find(|p| p.name == port.name) else {
            return Err(err(
                key,
                format!(
                    "names {key} `{}`, which the graph does not have (its {key}s: {})",
                    port.name,
                    list.iter()
                        .map(|p| p.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        };
        if !same_type(&p.ty, port.ty) {
            return Err(err(
                key,
                format!(
                    "`{}` is {} in the graph, the description says {}",
                    port.name,
                    p.ty,
                    port.ty.name()
                ),
            ));
        }
        let Some(dims) = &p.shape else {
            return Ok(());
        };
        let [a, b] = side.axes();
        let mut want: Vec<(&str, usize)> = vec![(a, sizes[0]), (b, sizes[1])];
        if port.batch {
            want.insert(0, ("batch", 1));
        }
        if dims.len() != want.len() {
            return Err(err(
                key,
                format!(
                    "`{}` has {} dims in the graph, the layout [{}] has {}",
                    port.name,
                    dims.len(),
                    want.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
                    want.len()
                ),
            ));
        }
        for (i, (d, (axis, size))) in dims.iter().zip(&want).enumerate() {
            if let Some(d) = d
                && d != size
            {
                return Err(err(
                    key,
                    format!(
                        "`{}` dim {i} is {d} in the graph, but `{axis}` is {size} for grids {}",
                        port.name,
                        graph.grids_text()
                    ),
                ));
            }
        }
        Ok(())
    };
    for (side, port) in [
        (VisionSide::Input, &graph.input),
        (VisionSide::Output, &graph.output),
    ] {
        if !port.ty.is_float() {
            return Err(err(
                side.key(),
                "pixel patches and image rows are f32 or f16".into(),
            ));
        }
    }
    check(
        VisionSide::Input,
        &graph.input,
        &ports.inputs,
        [patches, vc.patch_dim()],
    )?;
    check(
        VisionSide::Output,
        &graph.output,
        &ports.outputs,
        [rows, vc.out_hidden_size],
    )?;
    if let Some(other) = ports.inputs.iter().find(|p| p.name != graph.input.name) {
        return Err(Error::Interface(format!(
            "{source}: {file} has input `{}`, which `{}` does not map (a vision graph takes the pixel patches only)",
            other.name, graph.key
        )));
    }
    let taps = match &graph.taps {
        Taps::None => Vec::new(),
        Taps::DumpNames => ports
            .outputs
            .iter()
            .filter(|p| p.name != graph.output.name && p.name.starts_with("vision."))
            .map(|p| (p.name.clone(), p.name.clone()))
            .collect(),
        Taps::Map(list) => {
            let mut out = Vec::new();
            for (dump, names) in list {
                let blocks: Vec<Option<usize>> = if dump.contains("{i}") {
                    (0..vc.depth).map(Some).collect()
                } else {
                    vec![None]
                };
                for b in blocks {
                    let port = match names {
                        super::Names::Pattern(p) => {
                            b.map_or_else(|| p.clone(), |b| p.replace("{i}", &b.to_string()))
                        }
                        super::Names::PerLayer(m) => match b.and_then(|b| m.get(&b)) {
                            Some(p) => p.clone(),
                            None => continue,
                        },
                    };
                    let d = b.map_or_else(|| dump.clone(), |b| dump.replace("{i}", &b.to_string()));
                    if ports.output(&port).is_none() {
                        return Err(err(
                            &format!("taps.{dump}"),
                            format!("names output `{port}`, which the graph does not have"),
                        ));
                    }
                    out.push((d, port));
                }
            }
            out
        }
    };
    Ok(ResolvedVision {
        input: graph.input.clone(),
        output: graph.output.clone(),
        taps,
        patches,
        rows,
    })
}

/// Which of `graphs` take `grids`, in order: each step a graph (its index) and the run of consecutive images it takes
/// (a graph of several grids takes them together, the one of most grids first), or `Err` with the index of the first
/// image no graph takes.
pub fn plan(
    graphs: &[VisionGraph],
    grids: &[Grid],
) -> std::result::Result<Vec<(usize, std::ops::Range<usize>)>, usize> {
    let mut order: Vec<usize> = (0..graphs.len()).collect();
    order.sort_by_key(|&g| std::cmp::Reverse(graphs[g].grids.len()));
    let mut steps = Vec::new();
    let mut i = 0;
    while i < grids.len() {
        let Some(g) = order
            .iter()
            .copied()
            .find(|&g| grids[i..].starts_with(&graphs[g].grids))
        else {
            return Err(i);
        };
        let n = graphs[g].grids.len();
        steps.push((g, i..i + n));
        i += n;
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(grids: &[(usize, usize)]) -> VisionGraph {
        let port = VisionPort {
            name: "x".into(),
            ty: ElemKind::F32,
            batch: false,
        };
        VisionGraph {
            key: "vision".into(),
            grids: grids.iter().map(|&(h, w)| Grid { t: 1, h, w }).collect(),
            xml: "v.xml".into(),
            bin: "v.bin".into(),
            input: port.clone(),
            output: port,
            taps: Taps::None,
        }
    }

    #[test]
    fn each_image_goes_to_the_graph_of_its_grid_and_a_graph_of_several_takes_them_together() {
        let g = |h, w| Grid { t: 1, h, w };
        let graphs = [
            graph(&[(4, 4)]),
            graph(&[(8, 10)]),
            graph(&[(8, 10), (4, 4)]),
        ];
        assert_eq!(
            plan(&graphs, &[g(4, 4), g(8, 10)]),
            Ok(vec![(0, 0..1), (1, 1..2)])
        );
        assert_eq!(plan(&graphs, &[g(8, 10), g(4, 4)]), Ok(vec![(2, 0..2)]));
        assert_eq!(plan(&graphs, &[g(4, 4), g(8, 8)]), Err(1));
        assert_eq!(plan(&graphs, &[]), Ok(vec![]));
    }
}
