//! A port's layout and the dump's: the host-side tensors an engine feeds a graph of a set (ids, positions, masks,
//! `token_valid`, embeddings, hidden states, each state in the port's axis order and element type) and the dump's
//! tensors it takes back (a state in the dump's order, a cache's valid rows only).

mod inputs;
mod states;

pub use inputs::{fill, pad_rows, rows};
pub use states::{state_in, state_out};

use super::{Axis, CallSizes, ElemKind, PortSpec};
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use reference::config::Config;

/// One call of a graph: `tokens` slots, the first `ids.len()` real, after `past` tokens.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// The call's real tokens.
    pub ids: &'a [u32],
    /// Token slots of the graph (`ids.len()` for a dynamic graph).
    pub tokens: usize,
    /// Tokens before the call (its first position).
    pub past: usize,
    /// The static context, if any.
    pub context: Option<usize>,
    /// The positions of the call's real tokens: text (`past + delta + slot`), or a prompt with images' MRoPE rows.
    pub positions: CallPositions<'a>,
}

/// The positions of a call's real tokens (padded slots continue as text: they are masked out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallPositions<'a> {
    /// Text positions `past + delta + slot` (`delta` is the state's rope delta: 0 before any image).
    Text {
        /// The next text position minus the tokens so far.
        delta: i64,
    },
    /// The temporal, height and width rows of the real tokens (`get_rope_index`'s, sliced for the call).
    Rows([&'a [i64]; 3]),
}

impl<'a> CallPositions<'a> {
    /// Text positions right after text.
    pub const TEXT: CallPositions<'static> = CallPositions::Text { delta: 0 };

    /// The positions of tokens `from..from + len` of a run whose positions these are (text positions follow the
    /// call's `past`, so they stay as they are).
    pub fn slice(self, from: usize, len: usize) -> Self {
        match self {
            CallPositions::Rows(rows) => CallPositions::Rows(rows.map(|r| &r[from..from + len])),
            text => text,
        }
    }
}

impl Call<'_> {
    /// The position of slot `slot` on MRoPE row `row` (0 for a port of one row).
    pub fn position(&self, row: usize, slot: usize) -> i64 {
        match self.positions {
            CallPositions::Rows(rows) if slot < rows[row].len() => rows[row][slot],
            CallPositions::Rows(rows) => {
                let last = rows
                    .iter()
                    .filter_map(|r| r.last())
                    .copied()
                    .max()
                    .unwrap_or(-1);
                last + 1 + (slot - rows[0].len()) as i64
            }
            CallPositions::Text { delta } => self.past as i64 + delta + slot as i64,
        }
    }

    /// Whether the three rows differ somewhere (an image's tokens): a port of one row cannot carry them.
    pub fn positions_differ(&self) -> bool {
        match self.positions {
            CallPositions::Rows(rows) => rows[1] != rows[0] || rows[2] != rows[0],
            CallPositions::Text { .. } => false,
        }
    }

    /// Real tokens.
    pub fn valid(&self) -> usize {
        self.ids.len()
    }

    /// The sizes of the call's axes.
    pub fn sizes(&self) -> CallSizes {
        CallSizes {
            tokens: self.tokens,
            past: self.past,
            context: self.context,
        }
    }
}

/// The dims of a port in a call; `at` names the port in errors.
pub fn dims(config: &Config, shape: &[Axis], sizes: &CallSizes, at: &str) -> Result<Vec<usize>> {
    shape
        .iter()
        .map(|a| {
            a.size(config, sizes).ok_or_else(|| {
                Error::Config(format!(
                    "{at}: axis `{}` needs a static context (`context` in the manifest)",
                    a.name()
                ))
            })
        })
        .collect()
}

/// A host tensor of `values` (row-major, `dims`) in the port's element type.
pub(super) fn typed(values: Vec<f64>, dims: &[usize], ty: ElemKind) -> Result<Tensor> {
    let dev = &Device::Cpu;
    Ok(match ty {
        ElemKind::F32 => Tensor::from_vec(
            values.iter().map(|&v| v as f32).collect::<Vec<_>>(),
            dims,
            dev,
        )?,
        ElemKind::F16 => Tensor::from_vec(
            values.iter().map(|&v| v as f32).collect::<Vec<_>>(),
            dims,
            dev,
        )?
        .to_dtype(DType::F16)?,
        ElemKind::I64 => Tensor::from_vec(
            values.iter().map(|&v| v as i64).collect::<Vec<_>>(),
            dims,
            dev,
        )?,
        ElemKind::I32 => Tensor::from_vec(
            values.iter().map(|&v| v as i32).collect::<Vec<_>>(),
            dims,
            dev,
        )?,
        ElemKind::Bool => Tensor::from_vec(
            values
                .iter()
                .map(|&v| u8::from(v != 0.0))
                .collect::<Vec<_>>(),
            dims,
            dev,
        )?,
    })
}

/// A tensor with named axes `from` in the layout of `port` (its dims `dims`): the named axes permuted into the
/// port's order, unit axes (batch, a fixed 1) inserted, converted to the port's type.
pub fn to_port(
    t: &Tensor,
    from: &[Axis],
    port: &PortSpec,
    dims: &[usize],
    at: &str,
) -> Result<Tensor> {
    let named: Vec<Axis> = port
        .shape
        .iter()
        .copied()
        .filter(|a| !a.is_unit())
        .collect();
    let perm = named
        .iter()
        .map(|a| {
            from.iter().position(|f| f == a).ok_or_else(|| {
                Error::Config(format!(
                    "{at}: axis `{}` is not one of the tensor's ({})",
                    a.name(),
                    from.iter().map(|a| a.name()).collect::<Vec<_>>().join(", ")
                ))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if perm.len() != from.len() {
        return Err(Error::Config(format!(
            "{at}: the port's axes ({}) do not hold every axis of the tensor ({})",
            port.shape
                .iter()
                .map(|a| a.name())
                .collect::<Vec<_>>()
                .join(", "),
            from.iter().map(|a| a.name()).collect::<Vec<_>>().join(", ")
        )));
    }
    let permuted = if perm.iter().enumerate().all(|(i, &p)| i == p) {
        t.clone()
    } else {
        t.permute(perm)?.contiguous()?
    };
    let out = permuted.reshape(dims)?;
    Ok(match port.ty {
        ElemKind::F16 => out.to_dtype(DType::F16)?,
        ElemKind::F32 => out.to_dtype(DType::F32)?,
        other => {
            return Err(Error::Config(format!(
                "{at}: a float tensor cannot go to a port of type {}",
                other.name()
            )));
        }
    })
}

/// A port's tensor (axes `shape`) with its unit axes removed and the named ones permuted into the order `to`, in
/// f32.
pub fn from_port(t: &Tensor, shape: &[Axis], to: &[Axis], at: &str) -> Result<Tensor> {
    if t.rank() != shape.len() {
        return Err(Error::Interface(format!(
            "{at}: {} dims, the manifest's layout has {} ({})",
            t.rank(),
            shape.len(),
            shape
                .iter()
                .map(|a| a.name())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let kept: Vec<usize> = shape
        .iter()
        .enumerate()
        .filter(|(_, a)| !a.is_unit())
        .map(|(i, _)| i)
        .collect();
    let kept_dims: Vec<usize> = kept
        .iter()
        .map(|&i| t.dim(i))
        .collect::<candle_core::Result<_>>()?;
    let squeezed = t.reshape(kept_dims)?;
    let named: Vec<Axis> = kept.iter().map(|&i| shape[i]).collect();
    let perm = to
        .iter()
        .map(|a| {
            named.iter().position(|n| n == a).ok_or_else(|| {
                Error::Config(format!("{at}: the layout has no axis `{}`", a.name()))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let out = if perm.iter().enumerate().all(|(i, &p)| i == p) {
        squeezed
    } else {
        squeezed.permute(perm)?.contiguous()?
    };
    Ok(out.to_dtype(DType::F32)?)
}

#[cfg(test)]
mod tests {
    use reference::config::Config;

    /// The tiny model's config.
    pub fn config() -> Config {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny");
        Config::from_file(&dir.join("config.json")).unwrap()
    }

    /// Every value of `t` in f64.
    pub fn values(t: &candle_core::Tensor) -> Vec<f64> {
        t.flatten_all()
            .unwrap()
            .to_dtype(candle_core::DType::F64)
            .unwrap()
            .to_vec1()
            .unwrap()
    }
}
