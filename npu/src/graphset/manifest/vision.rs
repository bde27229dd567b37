//! The manifest's `vision`: one static vision graph (an object) or several (a list), each
//! `{"xml", "bin"?, "grid_thw", "input", "output", "taps"?}` (`graph` is read as `xml`, the name the first export-ir
//! wrote); see `docs/graph-sets.md`.

use super::reader::Reader;
use crate::error::Result;
use crate::graphset::vision::{VisionGraph, VisionPort, VisionSide};
use crate::graphset::{ElemKind, Taps};
use reference::vision::Grid;
use serde_json::Value;

impl Reader<'_> {
    /// The `vision` entry: its graphs, in order.
    pub(super) fn vision(&self, v: &Value) -> Result<Vec<VisionGraph>> {
        let list: Vec<(String, &Value)> = match v {
            Value::Array(list) if list.is_empty() => {
                return Err(self.err("vision", "no vision graphs"));
            }
            Value::Array(list) => list
                .iter()
                .enumerate()
                .map(|(i, g)| (format!("vision[{i}]"), g))
                .collect(),
            Value::Object(_) => vec![("vision".to_string(), v)],
            _ => {
                return Err(self.err(
                    "vision",
                    "expected a vision graph (an object) or a list of them",
                ));
            }
        };
        let graphs = list
            .into_iter()
            .map(|(at, g)| self.vision_graph(g, &at))
            .collect::<Result<Vec<_>>>()?;
        for (i, g) in graphs.iter().enumerate() {
            if let Some(same) = graphs[..i].iter().find(|o| o.grids == g.grids) {
                return Err(self.err(
                    &format!("{}.grid_thw", g.key),
                    format!(
                        "grids {} again (`{}` has them): one graph per set of grids",
                        g.grids_text(),
                        same.key
                    ),
                ));
            }
        }
        Ok(graphs)
    }

    fn vision_graph(&self, v: &Value, at: &str) -> Result<VisionGraph> {
        let m = self.object(v, at)?;
        self.known(
            m,
            at,
            &[
                "xml", "graph", "bin", "grid_thw", "input", "output", "taps", "meaning",
            ],
        )?;
        let xml = match (m.get("xml"), m.get("graph")) {
            (Some(_), Some(_)) => {
                return Err(self.err(
                    &format!("{at}.graph"),
                    "give the file as `xml` or `graph`, not both",
                ));
            }
            (Some(x), None) => self.string(x, &format!("{at}.xml"))?,
            (None, Some(x)) => self.string(x, &format!("{at}.graph"))?,
            (None, None) => return Err(self.err(&format!("{at}.xml"), "missing")),
        };
        let xml = self.dir.join(xml);
        let bin = match m.get("bin") {
            Some(b) => self.dir.join(self.string(b, &format!("{at}.bin"))?),
            None => xml.with_extension("bin"),
        };
        let grids_at = format!("{at}.grid_thw");
        let rows = m
            .get("grid_thw")
            .ok_or_else(|| self.err(&grids_at, "missing"))?
            .as_array()
            .ok_or_else(|| self.err(&grids_at, "expected a list of [t, h, w]"))?;
        if rows.is_empty() {
            return Err(self.err(&grids_at, "no grids"));
        }
        let grids = rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let at = format!("{grids_at}[{i}]");
                let n = r
                    .as_array()
                    .filter(|r| r.len() == 3)
                    .ok_or_else(|| self.err(&at, "expected [t, h, w]"))?;
                let [t, h, w] = [0, 1, 2].map(|k| self.count(&n[k], &at));
                Ok(Grid {
                    t: t?,
                    h: h?,
                    w: w?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let port = |side: VisionSide| -> Result<VisionPort> {
            let key = format!("{at}.{}", side.key());
            let v = m.get(side.key()).ok_or_else(|| self.err(&key, "missing"))?;
            self.vision_port(v, &key, side)
        };
        let taps = match m.get("taps") {
            Some(Value::Bool(true)) => Taps::DumpNames,
            Some(Value::Bool(false)) => Taps::None,
            other => self.taps(other, &format!("{at}.taps"))?,
        };
        Ok(VisionGraph {
            key: at.to_string(),
            grids,
            xml,
            bin,
            input: port(VisionSide::Input)?,
            output: port(VisionSide::Output)?,
            taps,
        })
    }

    /// A vision port: its name, or `{"name", "type", "shape"}` with the shape `[a, b]` or `["batch", a, b]`.
    fn vision_port(&self, v: &Value, at: &str, side: VisionSide) -> Result<VisionPort> {
        if let Value::String(name) = v {
            return Ok(VisionPort {
                name: name.clone(),
                ty: ElemKind::F32,
                batch: false,
            });
        }
        let m = self.object(v, at)?;
        self.known(m, at, &["name", "type", "shape", "meaning"])?;
        let name = self.string(
            m.get("name")
                .ok_or_else(|| self.err(&format!("{at}.name"), "missing"))?,
            &format!("{at}.name"),
        )?;
        let ty = self.ty(m.get("type"), &format!("{at}.type"), ElemKind::F32)?;
        if !ty.is_float() {
            return Err(self.err(
                &format!("{at}.type"),
                "pixel patches and image rows are f32 or f16",
            ));
        }
        let [a, b] = side.axes();
        let batch = match m.get("shape") {
            None => false,
            Some(s) => {
                let axes: Vec<String> = s
                    .as_array()
                    .map(|l| {
                        l.iter()
                            .map(|x| match x {
                                Value::String(s) => s.clone(),
                                other => other.to_string(),
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let axes: Vec<&str> = axes.iter().map(String::as_str).collect();
                match axes.as_slice() {
                    [x, y] if [*x, *y] == [a, b] => false,
                    ["batch" | "1", x, y] if [*x, *y] == [a, b] => true,
                    _ => {
                        return Err(self.err(
                            &format!("{at}.shape"),
                            format!(
                                "{s} (expected [\"{a}\", \"{b}\"] or [\"batch\", \"{a}\", \"{b}\"])"
                            ),
                        ));
                    }
                }
            }
        };
        Ok(VisionPort {
            name: name.to_string(),
            ty,
            batch,
        })
    }
}
