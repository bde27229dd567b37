//! Serialising a [`Graph`] as IR v11: the XML of nodes, ports, edges and Loop port maps, and the `.bin`.

use super::loop_op::LoopBody;
use super::{Bin, Graph, Node, Port};
use crate::error::{Error, Result};
use std::fmt::Write as _;

impl Graph {
    /// Writes the IR: `{stem}.xml`, and beside it `{stem}.bin` for a graph that holds its constants in memory. A
    /// graph on a [`super::SharedBin`] writes its XML only, after flushing the shared file, which is its `.bin`
    /// wherever it lies (read it with that path: [`Graph::bin_path`]).
    pub fn save(&self, xml_path: &std::path::Path) -> Result<()> {
        let (xml, bin) = self.serialize();
        if let Some(shared) = self.shared_bin() {
            shared.flush()?;
        } else {
            let bin_path = xml_path.with_extension("bin");
            std::fs::write(&bin_path, bin).map_err(|e| Error::io(&bin_path, e))?;
        }
        std::fs::write(xml_path, xml).map_err(|e| Error::io(xml_path, e))
    }

    /// The `.bin` an IR saved at `xml_path` reads: `{stem}.bin`, or the shared file.
    pub fn bin_path(&self, xml_path: &std::path::Path) -> Result<std::path::PathBuf> {
        match self.shared_bin() {
            Some(shared) => shared.path(),
            None => Ok(xml_path.with_extension("bin")),
        }
    }

    /// The IR: `(xml, bin)`, the weights borrowed (they can be the bulk of a checkpoint). A graph on a
    /// [`super::SharedBin`] has its constants in that file, not here: its `bin` is empty.
    pub fn serialize(&self) -> (String, &[u8]) {
        let mut xml = String::new();
        let _ = writeln!(xml, "<?xml version=\"1.0\"?>");
        let _ = writeln!(xml, "<net name=\"{}\" version=\"11\">", escape(&self.name));
        write_nodes(&mut xml, &self.nodes, 1);
        let _ = writeln!(xml, "</net>");
        let bin: &[u8] = match &self.bin {
            Bin::Memory(v) => v,
            Bin::File(_) => &[],
        };
        (xml, bin)
    }
}

fn write_port(xml: &mut String, indent: &str, id: usize, p: &Port, with_names: bool) {
    let names = if with_names && !p.names.is_empty() {
        format!(" names=\"{}\"", escape(&p.names.join(",")))
    } else {
        String::new()
    };
    let _ = write!(
        xml,
        "{indent}<port id=\"{id}\" precision=\"{}\"{names}",
        p.ty.precision()
    );
    if p.shape.is_empty() {
        let _ = writeln!(xml, " />");
    } else {
        let _ = writeln!(xml, ">");
        for d in &p.shape {
            let _ = writeln!(xml, "{indent}\t<dim>{d}</dim>");
        }
        let _ = writeln!(xml, "{indent}</port>");
    }
}

/// `<layers>` and `<edges>` of a node list, at an indentation depth.
fn write_nodes(xml: &mut String, nodes: &[Node], depth: usize) {
    let t = |n: usize| "\t".repeat(depth + n);
    let _ = writeln!(xml, "{}<layers>", t(0));
    for (id, n) in nodes.iter().enumerate() {
        let _ = writeln!(
            xml,
            "{}<layer id=\"{id}\" name=\"{}\" type=\"{}\" version=\"{}\">",
            t(1),
            escape(&n.name),
            n.op,
            n.version
        );
        if !n.attrs.is_empty() {
            let attrs: Vec<String> = n
                .attrs
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            let _ = writeln!(xml, "{}<data {} />", t(2), attrs.join(" "));
        }
        if let Some(body) = &n.body {
            write_port_map(xml, body, depth + 2);
        }
        if !n.inputs.is_empty() {
            let _ = writeln!(xml, "{}<input>", t(2));
            for (i, v) in n.inputs.iter().enumerate() {
                write_port(xml, &t(3), i, &nodes[v.node].outputs[v.port], false);
            }
            let _ = writeln!(xml, "{}</input>", t(2));
        }
        if !n.outputs.is_empty() {
            let _ = writeln!(xml, "{}<output>", t(2));
            for (j, p) in n.outputs.iter().enumerate() {
                write_port(xml, &t(3), n.inputs.len() + j, p, true);
            }
            let _ = writeln!(xml, "{}</output>", t(2));
        }
        if let Some(body) = &n.body {
            let _ = writeln!(xml, "{}<body>", t(2));
            write_nodes(xml, &body.nodes, depth + 3);
            let _ = writeln!(xml, "{}</body>", t(2));
        }
        let _ = writeln!(xml, "{}</layer>", t(1));
    }
    let _ = writeln!(xml, "{}</layers>", t(0));
    let _ = writeln!(xml, "{}<edges>", t(0));
    for (id, n) in nodes.iter().enumerate() {
        for (i, v) in n.inputs.iter().enumerate() {
            let from_port = nodes[v.node].inputs.len() + v.port;
            let _ = writeln!(
                xml,
                "{}<edge from-layer=\"{}\" from-port=\"{from_port}\" to-layer=\"{id}\" to-port=\"{i}\" />",
                t(1),
                v.node
            );
        }
    }
    let _ = writeln!(xml, "{}</edges>", t(0));
}

fn write_port_map(xml: &mut String, body: &LoopBody, depth: usize) {
    let t = |n: usize| "\t".repeat(depth + n);
    let slicing = |axis: Option<usize>| match axis {
        Some(a) => format!(" axis=\"{a}\" start=\"0\" end=\"-1\" stride=\"1\" part_size=\"1\""),
        None => String::new(),
    };
    let _ = writeln!(xml, "{}<port_map>", t(0));
    for &(port, param, axis) in &body.inputs {
        let _ = writeln!(
            xml,
            "{}<input{} external_port_id=\"{port}\" internal_layer_id=\"{param}\" />",
            t(1),
            slicing(axis)
        );
    }
    for &(port, result, axis) in &body.outputs {
        let _ = writeln!(
            xml,
            "{}<output{} external_port_id=\"{port}\" internal_layer_id=\"{result}\" />",
            t(1),
            slicing(axis)
        );
    }
    let _ = writeln!(
        xml,
        "{}<output external_port_id=\"-1\" internal_layer_id=\"{}\" purpose=\"execution_condition\" />",
        t(1),
        body.condition
    );
    let _ = writeln!(xml, "{}</port_map>", t(0));
    let _ = writeln!(xml, "{}<back_edges>", t(0));
    for &(from, to) in &body.back_edges {
        let _ = writeln!(
            xml,
            "{}<edge from-layer=\"{from}\" to-layer=\"{to}\" />",
            t(1)
        );
    }
    let _ = writeln!(xml, "{}</back_edges>", t(0));
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}
