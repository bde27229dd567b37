//! The state of one layer on the host, in the dump's layout: what a set's state ports carry between calls, converted
//! to and from each port's own layout by [`crate::graphset::layout`].

use crate::error::{Error, Result};
use crate::graphset::StateKind;
use candle_core::{DType, Device, Tensor};
use reference::backend::Snapshot;
use reference::config::{Config, LayerKind};
use reference::model::state_names;

/// The state of one layer, kept on the host between graph calls in the dump's layout.
#[derive(Debug, Clone)]
pub enum HostLayerState {
    /// Conv `[C, K]` and recurrent `[Hv, Dk, Dv]` states.
    Linear {
        /// Conv state.
        conv: Tensor,
        /// Recurrent state.
        recurrent: Tensor,
    },
    /// The KV cache's filled positions, `[Hkv, P, D]` each.
    Attention {
        /// Keys.
        keys: Tensor,
        /// Values.
        values: Tensor,
    },
}

impl HostLayerState {
    /// The state of `layer` before any token.
    pub fn zeros(config: &Config, layer: usize) -> Result<Self> {
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
                let shape = (config.num_key_value_heads, 0, config.head_dim);
                HostLayerState::Attention {
                    keys: Tensor::zeros(shape, DType::F32, dev)?,
                    values: Tensor::zeros(shape, DType::F32, dev)?,
                }
            }
        })
    }

    /// The tensor of one of this layer's states.
    pub fn get(&self, kind: StateKind) -> Option<&Tensor> {
        match (self, kind) {
            (HostLayerState::Linear { conv, .. }, StateKind::Conv) => Some(conv),
            (HostLayerState::Linear { recurrent, .. }, StateKind::Recurrent) => Some(recurrent),
            (HostLayerState::Attention { keys, .. }, StateKind::Keys) => Some(keys),
            (HostLayerState::Attention { values, .. }, StateKind::Values) => Some(values),
            _ => None,
        }
    }

    /// Replaces one of this layer's states.
    pub fn set(&mut self, kind: StateKind, t: Tensor) -> Result<()> {
        let slot = match (self, kind) {
            (HostLayerState::Linear { conv, .. }, StateKind::Conv) => conv,
            (HostLayerState::Linear { recurrent, .. }, StateKind::Recurrent) => recurrent,
            (HostLayerState::Attention { keys, .. }, StateKind::Keys) => keys,
            (HostLayerState::Attention { values, .. }, StateKind::Values) => values,
            (s, k) => {
                return Err(Error::Interface(format!(
                    "a {} layer has no {}",
                    s.kind().name(),
                    k.key()
                )));
            }
        };
        *slot = t;
        Ok(())
    }

    /// The state under the dump's names: `conv_state`/`recurrent_state`, or `key_cache`/`value_cache` (none before
    /// the first token).
    pub fn dump_tensors(&self, layer: usize) -> Result<Vec<(String, Tensor)>> {
        Ok(match self {
            HostLayerState::Linear { conv, recurrent } => {
                let [c, r] = state_names(layer, LayerKind::Linear);
                vec![(c, conv.clone()), (r, recurrent.clone())]
            }
            HostLayerState::Attention { keys, .. } if keys.dim(1)? == 0 => vec![],
            HostLayerState::Attention { keys, values } => {
                let [k, v] = state_names(layer, LayerKind::Full);
                vec![(k, keys.clone()), (v, values.clone())]
            }
        })
    }

    /// Layer `layer`'s state from a snapshot in the dump's names (the inverse of [`HostLayerState::dump_tensors`]),
    /// its shapes checked against the config; a cache may hold at most `context` positions when the graphs have a
    /// static context.
    pub fn from_snapshot(
        config: &Config,
        layer: usize,
        context: Option<usize>,
        snapshot: &Snapshot,
    ) -> Result<Self> {
        let mut state = HostLayerState::zeros(config, layer)?;
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
            HostLayerState::Attention { keys, values } => {
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
                if let Some(context) = context
                    && p > context
                {
                    return Err(Error::Input(format!(
                        "the state holds {p} positions but the static context holds {context}"
                    )));
                }
                if p != snapshot.position {
                    return Err(Error::Input(format!(
                        "layer {layer}: {p} cached positions at text position {}: the graphs take text positions only",
                        snapshot.position
                    )));
                }
                *keys = k;
                *values = v;
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

    /// Filled cache positions (0 for a linear layer, whose state has no length).
    pub fn cached(&self) -> usize {
        match self {
            HostLayerState::Attention { keys, .. } => keys.dim(1).unwrap_or(0),
            HostLayerState::Linear { .. } => 0,
        }
    }
}
