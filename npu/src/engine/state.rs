//! The state of one layer on the host, handed to the graphs through the layer kind's state ports.

use crate::error::{Error, Result};
use crate::graphs::ports;
use candle_core::{DType, Device, Tensor};
use reference::backend::Snapshot;
use reference::config::{Config, LayerKind};
use reference::model::state_names;
use std::collections::BTreeMap;

/// The state of one layer, kept on the host between graph calls and handed to the graphs through the layer kind's
/// [`ports::StatePorts`].
#[derive(Debug, Clone)]
pub enum HostLayerState {
    /// Conv `[C, K]` and recurrent `[Hv, Dk, Dv]` states.
    Linear {
        /// Conv state.
        conv: Tensor,
        /// Recurrent state.
        recurrent: Tensor,
    },
    /// A static KV cache `[Hkv, CTX, D]` of which the first `len` slots are filled.
    Attention {
        /// Keys.
        keys: Tensor,
        /// Values.
        values: Tensor,
        /// Filled slots.
        len: usize,
    },
}

impl HostLayerState {
    /// The zero state of `layer`.
    pub fn zeros(config: &Config, layer: usize, context: usize) -> Result<Self> {
        let dev = &Device::Cpu;
        Ok(match config.layer_types[layer] {
            LayerKind::Linear => HostLayerState::Linear {
                conv: Tensor::zeros(
                    (config.linear_conv_dim(), config.linear_conv_kernel_dim),
                    DType::F32,
                    dev,
                )?,
                recurrent: Tensor::zeros(
                    (
                        config.linear_num_value_heads,
                        config.linear_key_head_dim,
                        config.linear_value_head_dim,
                    ),
                    DType::F32,
                    dev,
                )?,
            },
            LayerKind::Full => {
                let shape = (config.num_key_value_heads, context, config.head_dim);
                HostLayerState::Attention {
                    keys: Tensor::zeros(shape, DType::F32, dev)?,
                    values: Tensor::zeros(shape, DType::F32, dev)?,
                    len: 0,
                }
            }
        })
    }

    /// The state under the dump's names: `conv_state`/`recurrent_state` or `key_cache`/`value_cache` (filled part).
    pub fn dump_tensors(&self, layer: usize) -> Result<Vec<(String, Tensor)>> {
        Ok(match self {
            HostLayerState::Linear { conv, recurrent } => {
                let [c, r] = state_names(layer, LayerKind::Linear);
                vec![(c, conv.clone()), (r, recurrent.clone())]
            }
            HostLayerState::Attention { len: 0, .. } => vec![],
            HostLayerState::Attention { keys, values, len } => {
                let [k, v] = state_names(layer, LayerKind::Full);
                vec![
                    (k, keys.narrow(1, 0, *len)?),
                    (v, values.narrow(1, 0, *len)?),
                ]
            }
        })
    }

    /// Layer `layer`'s state from a snapshot in the dump's names (the inverse of [`HostLayerState::dump_tensors`]):
    /// a KV cache of `P` positions fills the first `P` of `context` slots. Shapes are checked against the config.
    pub fn from_snapshot(
        config: &Config,
        layer: usize,
        context: usize,
        snapshot: &Snapshot,
    ) -> Result<Self> {
        let mut state = HostLayerState::zeros(config, layer, context)?;
        let [a, b] = state_names(layer, state.kind());
        let get = |name: &str| snapshot.tensors.get(name).map(|t| t.to_dtype(DType::F32));
        let shape_err = |name: &str, got: &[usize], want: &[usize]| {
            Error::Input(format!(
                "state `{name}` has shape {got:?}, the graphs take {want:?}"
            ))
        };
        match &mut state {
            HostLayerState::Linear { conv, recurrent } => {
                for (name, slot) in [(&a, conv), (&b, recurrent)] {
                    let t = get(name)
                        .ok_or_else(|| Error::Input(format!("the state has no `{name}`")))??;
                    if t.dims() != slot.dims() {
                        return Err(shape_err(name, t.dims(), slot.dims()));
                    }
                    *slot = t;
                }
            }
            HostLayerState::Attention { keys, values, len } => {
                let (Some(k), Some(v)) = (get(&a), get(&b)) else {
                    return Ok(state); // no token seen yet
                };
                let (k, v) = (k?, v?);
                let p = k.dim(1)?;
                let want = [config.num_key_value_heads, p, config.head_dim];
                for (name, t) in [(&a, &k), (&b, &v)] {
                    if t.dims() != want {
                        return Err(shape_err(name, t.dims(), &want));
                    }
                }
                if p > context {
                    return Err(Error::Input(format!(
                        "the state holds {p} positions but the static context holds {context} (--context)"
                    )));
                }
                if p != snapshot.position {
                    return Err(Error::Input(format!(
                        "layer {layer}: {p} cached positions at text position {}: the graphs take text positions only",
                        snapshot.position
                    )));
                }
                *keys = append_cache(keys, &k, 0, p)?;
                *values = append_cache(values, &v, 0, p)?;
                *len = p;
            }
        }
        Ok(state)
    }

    /// The layer kind this state belongs to.
    pub fn kind(&self) -> LayerKind {
        match self {
            HostLayerState::Linear { .. } => LayerKind::Linear,
            HostLayerState::Attention { .. } => LayerKind::Full,
        }
    }

    /// The graph inputs carrying this state, named under `prefix` (see [`ports::StatePorts`]).
    pub fn feed(&self, prefix: &str) -> [(String, Tensor); 2] {
        let [a, b] = ports::state_ports(self.kind()).inputs;
        let (x, y) = match self {
            HostLayerState::Linear { conv, recurrent } => (conv, recurrent),
            HostLayerState::Attention { keys, values, .. } => (keys, values),
        };
        [
            (format!("{prefix}{a}"), x.clone()),
            (format!("{prefix}{b}"), y.clone()),
        ]
    }

    /// Takes this layer's new state out of a call's outputs (named under `prefix`, see [`ports::StatePorts`]): the new conv
    /// and recurrent states, or the block's keys and values, of which the first `valid` are appended to the cache.
    pub fn take_from(
        &mut self,
        outputs: &mut BTreeMap<String, Tensor>,
        prefix: &str,
        valid: usize,
    ) -> Result<()> {
        let [a, b] = ports::state_ports(self.kind()).outputs;
        let mut take = |name: &str| {
            let port = format!("{prefix}{name}");
            outputs
                .remove(&port)
                .ok_or_else(|| Error::Interface(format!("the graph has no output `{port}`")))
        };
        let (x, y) = (take(a)?, take(b)?);
        match self {
            HostLayerState::Linear { conv, recurrent } => {
                *conv = x;
                *recurrent = y;
            }
            HostLayerState::Attention { keys, values, len } => {
                *keys = append_cache(keys, &x, *len, valid)?;
                *values = append_cache(values, &y, *len, valid)?;
                *len += valid;
            }
        }
        Ok(())
    }

    /// Filled cache slots (0 for a linear layer, whose state has no length).
    pub(crate) fn cached(&self) -> usize {
        match self {
            HostLayerState::Attention { len, .. } => *len,
            HostLayerState::Linear { .. } => 0,
        }
    }
}

/// Appends the first `n` tokens of `new` (`[Hkv, T, D]`) to a static cache at slot `len`.
fn append_cache(cache: &Tensor, new: &Tensor, len: usize, n: usize) -> Result<Tensor> {
    let ctx = cache.dim(1)?;
    let rows = new.narrow(1, 0, n)?;
    let mut parts = vec![];
    if len > 0 {
        parts.push(cache.narrow(1, 0, len)?);
    }
    parts.push(rows);
    if len + n < ctx {
        parts.push(cache.narrow(1, len + n, ctx - len - n)?);
    }
    Ok(Tensor::cat(&parts, 1)?)
}
