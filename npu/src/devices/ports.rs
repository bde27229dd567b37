//! The inputs and outputs of an IR: as built by the graph builder, or as OpenVINO reads them from a file without
//! compiling it.

use super::openvino_message;
use crate::error::{Error, Result};
use crate::ir::Graph;
use crate::runtime;
use std::path::Path;

/// One port of an IR as OpenVINO (or the graph builder) reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Its name.
    pub name: String,
    /// Its element type, in OpenVINO's IR names (`f32`, `f16`, `i64`, `i32`, `boolean`, …).
    pub ty: String,
    /// Its dims (`None`: a dynamic dim), or `None` for a dynamic rank.
    pub shape: Option<Vec<Option<usize>>>,
}

/// The inputs and outputs of an IR.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IrPorts {
    /// Inputs, in order.
    pub inputs: Vec<PortInfo>,
    /// Outputs, in order.
    pub outputs: Vec<PortInfo>,
}

impl IrPorts {
    /// The ports of one of this project's graphs, as built.
    pub fn of_graph(graph: &Graph) -> Self {
        let info = |list: Vec<(String, crate::ir::ElemType, Vec<usize>)>| {
            list.into_iter()
                .map(|(name, ty, dims)| PortInfo {
                    name,
                    ty: ty.ir_name().to_string(),
                    shape: Some(dims.into_iter().map(Some).collect()),
                })
                .collect()
        };
        IrPorts {
            inputs: info(graph.inputs()),
            outputs: info(graph.outputs()),
        }
    }

    /// The input called `name`.
    pub fn input(&self, name: &str) -> Option<&PortInfo> {
        self.inputs.iter().find(|p| p.name == name)
    }

    /// The output called `name`.
    pub fn output(&self, name: &str) -> Option<&PortInfo> {
        self.outputs.iter().find(|p| p.name == name)
    }
}

/// OpenVINO's IR name of an element type.
pub fn element_type_name(t: openvino::ElementType) -> String {
    use openvino::ElementType as E;
    match t {
        E::F32 => "f32".into(),
        E::F16 => "f16".into(),
        E::Bf16 => "bf16".into(),
        E::F64 => "f64".into(),
        E::I64 => "i64".into(),
        E::I32 => "i32".into(),
        E::I8 => "i8".into(),
        E::U8 => "u8".into(),
        E::Boolean => "boolean".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// The ports of the IR `xml` (weights `bin`), read without compiling it.
pub fn read_ports(xml: &Path, bin: &Path) -> Result<IrPorts> {
    check_weights_file(xml, bin)?;
    runtime::load()?;
    let mut core = runtime::core()?;
    let name = xml.display().to_string();
    let err = |e: &dyn std::fmt::Display| Error::OpenVino {
        stage: "reading",
        graph: name.clone(),
        device: "(none)".into(),
        message: openvino_message(e),
    };
    let model = core
        .read_model_from_file(&xml.to_string_lossy(), &bin.to_string_lossy())
        .map_err(|e| err(&e))?;
    let port = |node: openvino::Node| -> Result<PortInfo> {
        let shape = node.get_partial_shape().map_err(|e| err(&e))?;
        let shape = if shape.get_rank().is_dynamic() {
            None
        } else {
            Some(
                shape
                    .get_dimensions()
                    .iter()
                    .map(|d| (!d.is_dynamic()).then_some(d.get_min() as usize))
                    .collect(),
            )
        };
        Ok(PortInfo {
            name: node.get_name().map_err(|e| err(&e))?,
            ty: element_type_name(node.get_element_type().map_err(|e| err(&e))?),
            shape,
        })
    };
    let inputs = (0..model.get_inputs_len().map_err(|e| err(&e))?)
        .map(|i| port(model.get_input_by_index(i).map_err(|e| err(&e))?))
        .collect::<Result<_>>()?;
    let outputs = (0..model.get_outputs_len().map_err(|e| err(&e))?)
        .map(|i| port(model.get_output_by_index(i).map_err(|e| err(&e))?))
        .collect::<Result<_>>()?;
    Ok(IrPorts { inputs, outputs })
}

/// Fails, naming the `.bin`, when it is shorter than the constants of `xml` say (an empty or truncated weights file,
/// or another graph's): OpenVINO itself would blame the `.xml` in its own words. Every `Const` layer's `<data>`
/// (Loop bodies included) reads `size` bytes at `offset` of the `.bin`; the largest end must lie within the file.
pub fn check_weights_file(xml: &Path, bin: &Path) -> Result<()> {
    let text = reference::inputs::read_to_string(xml).map_err(|e| Error::io(xml, e))?;
    let doc = roxmltree::Document::parse(&text)
        .map_err(|e| Error::Config(format!("{}: not valid XML: {e}", xml.display())))?;
    let mut furthest: Option<(u64, String)> = None;
    for layer in doc
        .descendants()
        .filter(|n| n.has_tag_name("layer") && n.attribute("type") == Some("Const"))
    {
        let Some(data) = layer.children().find(|c| c.has_tag_name("data")) else {
            continue;
        };
        let number = |k: &str| data.attribute(k).and_then(|v| v.parse::<u64>().ok());
        let (Some(offset), Some(size)) = (number("offset"), number("size")) else {
            continue;
        };
        let end = offset.saturating_add(size);
        if furthest.as_ref().is_none_or(|(e, _)| end > *e) {
            let name = layer.attribute("name").unwrap_or("?").to_string();
            furthest = Some((end, name));
        }
    }
    let Some((end, name)) = furthest else {
        return Ok(());
    };
    let len = std::fs::metadata(bin).map_err(|e| Error::io(bin, e))?.len();
    if len < end {
        return Err(Error::Config(format!(
            "{}: the weights file is {len} bytes, but {}'s constant `{name}` reads up to byte {end}: the .bin is {} \
             (or is another graph's)",
            bin.display(),
            xml.file_name().map_or_else(
                || xml.display().to_string(),
                |n| n.to_string_lossy().into_owned()
            ),
            if len == 0 { "empty" } else { "truncated" }
        )));
    }
    Ok(())
}
