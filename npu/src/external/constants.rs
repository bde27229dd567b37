//! The compressed weights an external IR holds, read from its `.xml` and `.bin`: every `i4`/`i8` constant with the
//! decompression chain NNCF writes (`Constant` → `Convert` → `Multiply` by an f16 scale constant → `Reshape`/`Convert`
//! → the `MatMul`, `Gather` or `GroupConvolution` that uses it), as codes and scales, and the checkpoint tensor each
//! one stands for ([`checkpoint_name`]). A test holds them to what the reference's weight format gives the same
//! checkpoint, so that "the reference runs exactly the IR's weights" is checked rather than assumed.
//!
//! The weight is taken in the shape its consumer reads (the decompression's last output): a matrix `[out, in]` read
//! by a MatMul with `transpose_b`, a conv kernel `[C, 1, 1, K]` read as `[C, K]`, or, in an MoE export, the experts
//! stacked `[E, out, in]` for a batched MatMul, read as `E` matrices. NNCF's groups run along the last axis (the
//! input axis) in each case, so each matrix's codes and scales are those of the reference's
//! [`QuantizedMatrix`] for the same checkpoint tensor.

use crate::error::{Error, Result};
use half::f16;
use reference::quant::{QuantKind, QuantizedMatrix, unpack_i4};
use reference::schema::Param;
use std::collections::BTreeMap;
use std::path::Path;

/// One compressed weight matrix of an IR: a whole constant, or one expert's slice of a stacked one.
#[derive(Debug, Clone)]
pub struct IrWeight {
    /// The constant's name in the IR.
    pub constant: String,
    /// The expert, when the constant stacks the experts of an MoE layer (`[E, rows, cols]`); the matrix is then
    /// its slice `[e]`.
    pub expert: Option<usize>,
    /// The op that consumes the decompressed weight (`MatMul`, `Gather`, `GroupConvolution`).
    pub consumer: String,
    /// The codes and scales, as `[rows, cols]` (a conv kernel `[C, 1, 1, K]` as `[C, K]`).
    pub matrix: QuantizedMatrix,
}

impl IrWeight {
    /// The checkpoint tensor this matrix holds ([`checkpoint_name`]).
    pub fn checkpoint_name(&self) -> Result<String> {
        checkpoint_name(&self.constant, self.expert)
    }
}

/// Constant-name prefixes of optimum-intel's export and the checkpoint names they stand for (relative to the
/// decoder prefix, as in [`reference::schema`]).
const PREFIXES: [(&str, &str); 2] = [("self.model.model.", ""), ("self.model.", "")];

/// The DeltaNet conv kernel of layer `i` is folded into a constant named after the reshape it came from.
const CONV_PREFIX: &str = "__module.model.model.layers.";
const CONV_SUFFIX: &str = ".linear_attn/aten::_convolution/Reshape";

/// optimum-intel's MoE export (Qwen3_5MoeModelPatcher) splits each layer's `experts.gate_up_proj` `[E, 2·I, H]` in
/// two along its rows (`chunk(2, dim=-2)`: the gate projections first); OpenVINO folds the split into two constants
/// named after it, the experts' gate and up projections `[E, I, H]`. `experts.down_proj` `[E, H, I]` keeps its name.
const EXPERTS_SPLIT: &str = ".mlp/prim::ListUnpack/VariadicSplit.";
const EXPERTS_DOWN: &str = ".mlp.experts.down_proj";

/// The layer index `i` of `__module.model.model.layers.{i}{suffix}` or `self.model.model.layers.{i}{suffix}`.
fn layer_of<'a>(constant: &'a str, suffix: &str) -> Option<&'a str> {
    ["__module.model.model.layers.", "self.model.model.layers."]
        .iter()
        .find_map(|p| constant.strip_prefix(p)?.strip_suffix(suffix))
        .filter(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()))
}

/// The checkpoint tensor (as [`reference::schema::TensorSpec::name`]) that an optimum-intel constant holds:
/// `self.model.model.X` → `X`, `self.model.lm_head.weight` → `lm_head.weight`, and
/// `__module.model.model.layers.{i}.linear_attn/aten::_convolution/Reshape` → `layers.{i}.linear_attn.conv1d.weight`.
/// With `expert` `Some(e)`, the expert's matrix of a stacked MoE constant: `…layers.{i}.mlp/prim::ListUnpack/
/// VariadicSplit.0` and `.1` → `layers.{i}.mlp.experts.{e}.gate_proj.weight` and `up_proj.weight`,
/// `self.model.model.layers.{i}.mlp.experts.down_proj` → `layers.{i}.mlp.experts.{e}.down_proj.weight`. Anything
/// else is an error naming the constant.
pub fn checkpoint_name(constant: &str, expert: Option<usize>) -> Result<String> {
    if let Some(e) = expert {
        let param = [
            (format!("{EXPERTS_SPLIT}0"), Param::ExpertGateProj(e)),
            (format!("{EXPERTS_SPLIT}1"), Param::ExpertUpProj(e)),
            (EXPERTS_DOWN.to_string(), Param::ExpertDownProj(e)),
        ]
        .into_iter()
        .find_map(|(suffix, param)| Some((layer_of(constant, &suffix)?, param)));
        return match param {
            Some((layer, param)) => Ok(format!("layers.{layer}.{}", param.key())),
            None => Err(Error::Interface(format!(
                "IR constant `{constant}` (expert {e} of a stacked weight) maps to no expert's tensor (known: \
                 …layers.N{EXPERTS_SPLIT}0 and 1, …layers.N{EXPERTS_DOWN})"
            ))),
        };
    }
    if let Some(layer) = constant
        .strip_prefix(CONV_PREFIX)
        .and_then(|r| r.strip_suffix(CONV_SUFFIX))
        .filter(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()))
    {
        return Ok(format!("layers.{layer}.linear_attn.conv1d.weight"));
    }
    for (prefix, replacement) in PREFIXES {
        if let Some(rest) = constant.strip_prefix(prefix)
            && !rest.is_empty()
            && !rest.contains('/')
        {
            return Ok(format!("{replacement}{rest}"));
        }
    }
    Err(Error::Interface(format!(
        "IR constant `{constant}` maps to no checkpoint tensor (known: {}X, {CONV_PREFIX}N{CONV_SUFFIX})",
        PREFIXES.map(|(p, _)| p).join("X, ")
    )))
}

struct Layer {
    name: String,
    kind: String,
    element_type: Option<String>,
    shape: Vec<usize>,
    offset: usize,
    size: usize,
    /// The dims of its first output port.
    output: Vec<usize>,
    /// A MatMul's `transpose_b`.
    transpose_b: Option<bool>,
}

/// The dims of a comma-separated `shape` attribute or of a port's `<dim>` children (a dynamic one as 0).
fn dims<'a>(items: impl Iterator<Item = &'a str>) -> Vec<usize> {
    items
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse().unwrap_or(0))
        .collect()
}

/// Reads every compressed weight of the IR `xml` (constants in `bin`).
pub fn compressed_weights(xml: &Path, bin: &Path) -> Result<Vec<IrWeight>> {
    let text = reference::inputs::read_to_string(xml).map_err(|e| Error::io(xml, e))?;
    let data = reference::inputs::read(bin).map_err(|e| Error::io(bin, e))?;
    let at = xml.display().to_string();
    let bad = |m: String| Error::Config(format!("{at}: {m}"));
    let doc = roxmltree::Document::parse(&text).map_err(|e| bad(format!("not valid XML: {e}")))?;
    let mut layers = BTreeMap::new();
    let mut consumers: BTreeMap<u64, Vec<(u64, u64)>> = BTreeMap::new();
    let mut producers: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    let number = |n: roxmltree::Node, key: &str| -> Result<u64> {
        n.attribute(key)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| {
                bad(format!(
                    "a <{}> has no numeric `{key}`",
                    n.tag_name().name()
                ))
            })
    };
    // Only the top level: a Loop's body has layers and edges of its own (ids restart there).
    let top = |section: &'static str| {
        doc.root_element()
            .children()
            .filter(move |c| c.tag_name().name() == section)
            .flat_map(|c| c.children())
            .filter(|c| c.is_element())
    };
    for n in top("layers").chain(top("edges")) {
        match n.tag_name().name() {
            "layer" => {
                let data = n.children().find(|c| c.tag_name().name() == "data");
                let attr = |k: &str| data.and_then(|d| d.attribute(k));
                let shape = attr("shape")
                    .map(|s| dims(s.split(',')))
                    .unwrap_or_default();
                let output = n
                    .children()
                    .find(|c| c.tag_name().name() == "output")
                    .and_then(|o| o.children().find(|c| c.tag_name().name() == "port"))
                    .map(|port| {
                        dims(
                            port.children()
                                .filter(|d| d.tag_name().name() == "dim")
                                .filter_map(|d| d.text()),
                        )
                    })
                    .unwrap_or_default();
                layers.insert(
                    number(n, "id")?,
                    Layer {
                        name: n.attribute("name").unwrap_or_default().to_string(),
                        kind: n.attribute("type").unwrap_or_default().to_string(),
                        element_type: attr("element_type").map(str::to_string),
                        shape,
                        offset: attr("offset").and_then(|v| v.parse().ok()).unwrap_or(0),
                        size: attr("size").and_then(|v| v.parse().ok()).unwrap_or(0),
                        output,
                        transpose_b: attr("transpose_b").map(|v| v == "true"),
                    },
                );
            }
            "edge" => {
                let (from, to) = (number(n, "from-layer")?, number(n, "to-layer")?);
                let to_port = number(n, "to-port")?;
                consumers.entry(from).or_default().push((to, to_port));
                producers.insert((to, to_port), from);
            }
            _ => {}
        }
    }
    let single_consumer = |id: u64| -> Option<u64> {
        match consumers.get(&id).map(Vec::as_slice) {
            Some([(to, _)]) => Some(*to),
            _ => None,
        }
    };
    let bytes = |l: &Layer| -> Result<&[u8]> {
        data.get(l.offset..l.offset + l.size).ok_or_else(|| {
            bad(format!(
                "constant `{}` lies outside {} ({} bytes at {})",
                l.name,
                bin.display(),
                l.size,
                l.offset
            ))
        })
    };
    let mut out = Vec::new();
    for (&id, layer) in &layers {
        let ty = layer.element_type.as_deref().unwrap_or_default();
        if layer.kind != "Const" || !matches!(ty, "i4" | "i8" | "u4" | "u8") {
            continue;
        }
        let name = &layer.name;
        if ty.starts_with('u') {
            return Err(bad(format!(
                "constant `{name}` holds unsigned ({ty}) codes: asymmetric compression is not supported"
            )));
        }
        // Constant -> Convert -> Multiply(scale).
        let convert = single_consumer(id)
            .filter(|c| layers[c].kind == "Convert")
            .ok_or_else(|| bad(format!("constant `{name}` does not feed one Convert")))?;
        let multiply = single_consumer(convert).ok_or_else(|| {
            bad(format!(
                "constant `{name}`: its Convert does not feed one op"
            ))
        })?;
        match layers[&multiply].kind.as_str() {
            "Multiply" => {}
            "Subtract" => {
                return Err(bad(format!(
                    "constant `{name}` has a zero point (Subtract): asymmetric compression is not supported"
                )));
            }
            other => {
                return Err(bad(format!(
                    "constant `{name}`: expected Convert -> Multiply, found Convert -> {other}"
                )));
            }
        }
        let scale_id = [0, 1]
            .iter()
            .filter_map(|p| producers.get(&(multiply, *p)))
            .find(|&&p| p != convert)
            .copied()
            .ok_or_else(|| {
                bad(format!(
                    "constant `{name}`: its Multiply has no scale input"
                ))
            })?;
        let scale = &layers[&scale_id];
        if scale.kind != "Const" || scale.element_type.as_deref() != Some("f16") {
            return Err(bad(format!(
                "constant `{name}`: the scale `{}` is not an f16 constant",
                scale.name
            )));
        }
        // Follow Reshape / Convert down to the op that uses the weight.
        let mut node = multiply;
        let consumer = loop {
            let next = single_consumer(node)
                .ok_or_else(|| bad(format!("constant `{name}`: its decompression branches")))?;
            match layers[&next].kind.as_str() {
                "Reshape" | "Convert" => node = next,
                _ => break next,
            }
        };
        // The weight as its consumer reads it: matrices [rows, cols], experts stacked [E, rows, cols], a conv
        // kernel [C, 1, 1, K] as [C, K].
        let weight = &layers[&node].output;
        let consumer_layer = &layers[&consumer];
        let count: usize = layer.shape.iter().product();
        let (stack, rows) = match (consumer_layer.kind.as_str(), weight.as_slice()) {
            ("MatMul", _) if consumer_layer.transpose_b != Some(true) => {
                return Err(bad(format!(
                    "constant `{name}`: its MatMul reads the weight as [in, out] (transpose_b false); only \
                     [out, in] weights (transpose_b true) are supported"
                )));
            }
            ("MatMul", &[e, r, _]) => (Some(e), r),
            (_, &[r, _]) | ("GroupConvolution" | "Convolution", &[r, ..]) => (None, r),
            (kind, w) => {
                return Err(bad(format!(
                    "constant `{name}`: a {w:?} weight read by a {kind} is not a layout of this project \
                     (matrices, stacked experts [E, out, in], conv kernels [C, 1, 1, K])"
                )));
            }
        };
        let scales_count: usize = scale.shape.iter().product();
        let all_rows = stack.unwrap_or(1) * rows;
        if rows == 0
            || weight.iter().product::<usize>() != count
            || !count.is_multiple_of(all_rows)
            || scales_count == 0
            || !scales_count.is_multiple_of(all_rows)
        {
            return Err(bad(format!(
                "constant `{name}` {:?} with scales {:?}, read as {weight:?}: not a per-row or per-group layout",
                layer.shape, scale.shape
            )));
        }
        let cols = count / all_rows;
        let per_row = scales_count / all_rows;
        let codes = match ty {
            "i4" => unpack_i4(bytes(layer)?, count)?,
            _ => bytes(layer)?.iter().map(|&b| b as i8).collect(),
        };
        if codes.len() != count {
            return Err(bad(format!(
                "constant `{name}` holds {} codes, {count} expected",
                codes.len()
            )));
        }
        let scales: Vec<f16> = bytes(scale)?
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]))
            .collect();
        let kind = match (ty, per_row) {
            ("i4", g) if cols.is_multiple_of(g) => QuantKind::Int4Sym { group: cols / g },
            ("i8", 1) => QuantKind::Int8Sym,
            _ => {
                return Err(bad(format!(
                    "constant `{name}`: {ty} codes {:?} with {per_row} scales per row is not a layout of this \
                     project (int4 in groups, int8 per row)",
                    layer.shape
                )));
            }
        };
        for e in 0..stack.unwrap_or(1) {
            let codes = codes[e * rows * cols..(e + 1) * rows * cols].to_vec();
            let scales = scales[e * rows * per_row..(e + 1) * rows * per_row].to_vec();
            let matrix = QuantizedMatrix::from_parts(kind, rows, cols, codes, scales)
                .map_err(|err| bad(format!("constant `{name}`: {err}")))?;
            out.push(IrWeight {
                constant: name.clone(),
                expert: stack.map(|_| e),
                consumer: consumer_layer.kind.clone(),
                matrix,
            });
        }
    }
    Ok(out)
}
