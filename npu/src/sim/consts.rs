//! The graph's constants decoded from its `.bin` (the graph's and every Loop body's), floats rounded to the storage
//! format on entry.

use super::numeric::NumericModel;
use super::value::{Data, V, Val};
use crate::error::{Error, Result};
use crate::ir::{ElemType, Graph, Node};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

/// Decodes every constant of `nodes` (scope 0: the graph; a Loop body: its node's address), rounded to storage
/// when it is a float.
pub(super) fn decode_consts(
    graph: &Graph,
    nodes: &[Node],
    scope: usize,
    model: &NumericModel,
    deferred: &HashSet<usize>,
    out: &mut HashMap<(usize, usize), V>,
) -> Result<()> {
    for (id, n) in nodes.iter().enumerate() {
        if let Some(body) = &n.body {
            let scope = n as *const Node as usize;
            decode_consts(graph, &body.nodes, scope, model, &HashSet::new(), out)?;
        }
        if n.op != "Const" || (scope == 0 && deferred.contains(&id)) {
            continue;
        }
        let num = |k: &str| -> Result<usize> {
            n.attr(k)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| Error::Interface(format!("Const {} has no {k}", n.name)))
        };
        let (offset, size) = (num("offset")?, num("size")?);
        let bytes = graph
            .bin_bytes(offset, size)
            .map_err(|_| Error::Interface(format!("Const {} outside the .bin", n.name)))?;
        let port = &n.outputs[0];
        let count: usize = port.shape.iter().product();
        let data = match port.ty {
            ElemType::F32 => Data::F(
                bytes
                    .chunks_exact(4)
                    .map(|c| model.round(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                    .collect(),
            ),
            ElemType::F16 => Data::F(
                bytes
                    .chunks_exact(2)
                    .map(|c| model.round(half::f16::from_le_bytes([c[0], c[1]]).to_f32()))
                    .collect(),
            ),
            ElemType::I64 => Data::I(
                bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                    .collect(),
            ),
            ElemType::I8 => Data::I(bytes.iter().map(|&b| b as i8 as i64).collect()),
            ElemType::I4 => Data::I(
                reference::quant::unpack_i4(&bytes, count)?
                    .into_iter()
                    .map(i64::from)
                    .collect(),
            ),
            ElemType::Boolean => Data::B(bytes.iter().map(|&b| b != 0).collect()),
        };
        out.insert(
            (scope, id),
            Rc::new(Val {
                shape: port.shape.clone(),
                data,
            }),
        );
    }
    Ok(())
}
