//! A state in a port's layout and back: the dump's layout (a cache's filled rows) converted to each state port's
//! input, and each output taken back (a static cache's valid rows, the call's rows appended).

use super::{Call, dims, from_port, to_port};
use crate::error::{Error, Result};
use crate::graphset::{Axis, CacheUpdate, PortSpec, StateKind, StateSpec};
use candle_core::Tensor;
use reference::config::Config;

/// The positions axis of a cache layout (`past`, `context`, `tokens` or `past+tokens`).
fn positions_axis(shape: &[Axis]) -> Axis {
    shape
        .iter()
        .copied()
        .find(|a| {
            matches!(
                a,
                Axis::Past | Axis::PastTokens | Axis::Context | Axis::Tokens
            )
        })
        .unwrap_or(Axis::Past)
}

/// The dump's axes of a state, its cache positions labelled as `positions`.
fn dump_axes(kind: StateKind, positions: Axis) -> Vec<Axis> {
    kind.canonical()
        .iter()
        .map(|&a| if a == Axis::Past { positions } else { a })
        .collect()
}

/// A state in the dump's layout (`[C, K]`, `[Hv, Dk, Dv]`, or a cache's `P` filled rows `[Hkv, P, D]`) as the
/// port's input: permuted, a static cache padded with zeros to its context.
pub fn state_in(
    config: &Config,
    kind: StateKind,
    spec: &StateSpec,
    state: &Tensor,
    call: &Call,
    at: &str,
) -> Result<Tensor> {
    let positions = positions_axis(&spec.shape);
    let t = match (kind.layer_kind(), positions) {
        (reference::config::LayerKind::Full, Axis::Context) => {
            let ctx = call.context.ok_or_else(|| {
                Error::Config(format!(
                    "{at}: a static cache needs `context` in the manifest"
                ))
            })?;
            let p = state.dim(1)?;
            if p > ctx {
                return Err(Error::Input(format!(
                    "{at}: the state holds {p} positions but the static context holds {ctx}"
                )));
            }
            if p == ctx {
                state.clone()
            } else {
                let (h, _, d) = state.dims3()?;
                let zeros = Tensor::zeros((h, ctx - p, d), state.dtype(), state.device())?;
                Tensor::cat(&[state, &zeros], 1)?
            }
        }
        _ => state.clone(),
    };
    let port = PortSpec {
        names: spec.input.clone(),
        ty: spec.ty,
        shape: spec.shape.clone(),
    };
    let d = dims(config, &spec.shape, &call.sizes(), at)?;
    to_port(&t, &dump_axes(kind, positions), &port, &d, at)
}

/// The state after a call, in the dump's layout, from the port's output: a DeltaNet state as it is; a cache's
/// filled rows (`past + valid`), appending the call's rows to `before` when the graph outputs only those.
pub fn state_out(
    kind: StateKind,
    spec: &StateSpec,
    update: Option<CacheUpdate>,
    out: &Tensor,
    before: &Tensor,
    call: &Call,
    at: &str,
) -> Result<Tensor> {
    let positions = positions_axis(&spec.output_shape);
    let t = from_port(out, &spec.output_shape, &dump_axes(kind, positions), at)?;
    let (past, valid) = (call.past, call.valid());
    Ok(match update {
        None => t,
        Some(CacheUpdate::Rows) => {
            let rows = t.narrow(1, 0, valid)?;
            if past == 0 {
                rows
            } else {
                Tensor::cat(&[before, &rows], 1)?
            }
        }
        Some(CacheUpdate::Concat | CacheUpdate::InPlace) => {
            let have = t.dim(1)?;
            if have < past + valid {
                return Err(Error::Interface(format!(
                    "{at}: {have} cache positions after a call of {valid} tokens after {past}"
                )));
            }
            t.narrow(1, 0, past + valid)?
        }
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{config, values};
    use super::*;
    use crate::graphset::ElemKind;
    use candle_core::{DType, Device};

    #[test]
    fn caches_are_padded_to_the_context_and_take_back_their_valid_rows() {
        let c = config();
        let (h, d) = (c.num_key_value_heads, c.head_dim);
        let before = Tensor::ones((h, 2, d), DType::F32, &Device::Cpu).unwrap();
        let call = Call {
            ids: &[1, 2],
            tokens: 3,
            past: 2,
            context: Some(6),
            positions: super::super::CallPositions::TEXT,
        };
        let spec = |shape: &[Axis], out: &[Axis]| StateSpec {
            kind: StateKind::Keys,
            input: crate::graphset::Names::fixed("k"),
            output: crate::graphset::Names::fixed("k_out"),
            ty: ElemKind::F32,
            shape: shape.to_vec(),
            output_shape: out.to_vec(),
        };
        // Static slots the graph writes: in 6 slots (2 filled, the rest zero), out 6 slots of which 4 are kept.
        let s = spec(
            &[Axis::Batch, Axis::KvHeads, Axis::Context, Axis::HeadDim],
            &[Axis::Batch, Axis::KvHeads, Axis::Context, Axis::HeadDim],
        );
        let input = state_in(&c, StateKind::Keys, &s, &before, &call, "k").unwrap();
        assert_eq!(input.dims(), &[1, h, 6, d]);
        assert_eq!(
            values(&input.narrow(2, 2, 4).unwrap()).iter().sum::<f64>(),
            0.0
        );
        let out = Tensor::full(3f32, (1, h, 6, d), &Device::Cpu).unwrap();
        let after = state_out(
            StateKind::Keys,
            &s,
            s.update("k").unwrap(),
            &out,
            &before,
            &call,
            "k",
        )
        .unwrap();
        assert_eq!(after.dims(), &[h, 4, d]);
        // The call's rows only, written by the host: the two real ones appended (the padded slot dropped).
        let r = spec(
            &[Axis::KvHeads, Axis::Context, Axis::HeadDim],
            &[Axis::KvHeads, Axis::Tokens, Axis::HeadDim],
        );
        let rows = Tensor::full(5f32, (h, 3, d), &Device::Cpu).unwrap();
        let after = state_out(
            StateKind::Keys,
            &r,
            r.update("k").unwrap(),
            &rows,
            &before,
            &call,
            "k",
        )
        .unwrap();
        assert_eq!(after.dims(), &[h, 4, d]);
        assert_eq!(values(&after.narrow(1, 2, 2).unwrap())[0], 5.0);
        assert_eq!(values(&after.narrow(1, 0, 2).unwrap())[0], 1.0);
        // More filled positions than the context holds is an error naming the port.
        let long = Call {
            context: Some(1),
            ..call
        };
        assert!(
            state_in(&c, StateKind::Keys, &s, &before, &long, "k")
                .unwrap_err()
                .to_string()
                .contains("k:")
        );
    }
}
