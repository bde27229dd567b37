//! A port's layout and the dump's: the host-side tensors an engine feeds a graph of a set (ids, positions, masks,
//! `token_valid`, embeddings, hidden states, each state in the port's axis order and element type) and the dump's
//! tensors it takes back (a state in the dump's order, a cache's valid rows only).

use super::{Axis, CacheUpdate, CallSizes, ElemKind, InputRole, MaskValues, PortSpec, StateKind};
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
}

impl Call<'_> {
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
fn typed(values: Vec<f64>, dims: &[usize], ty: ElemKind) -> Result<Tensor> {
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

/// The values of a port whose every element depends on its index along some axes, row-major.
fn by_index(dims: &[usize], mut value: impl FnMut(&[usize]) -> f64) -> Vec<f64> {
    let count: usize = dims.iter().product();
    let mut index = vec![0usize; dims.len()];
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        out.push(value(&index));
        for d in (0..dims.len()).rev() {
            index[d] += 1;
            if index[d] < dims[d] {
                break;
            }
            index[d] = 0;
        }
    }
    out
}

/// Whether query slot `q` (none: the mask has no query axis) may attend key slot `k` along the mask's key axis:
/// the filled slots before the call, and the call's own tokens up to the query (with no query axis: its real
/// tokens). A mask over `tokens` alone covers the call's own tokens (and forgets the past).
fn visible(key_axis: Axis, q: Option<usize>, k: usize, call: &Call) -> bool {
    let own = |j: usize| match q {
        Some(q) => j <= q,
        None => j < call.valid(),
    };
    match key_axis {
        Axis::PastTokens | Axis::Context => k < call.past || own(k - call.past),
        Axis::ContextTokens => {
            let ctx = call.context.unwrap_or(0);
            if k < ctx { k < call.past } else { own(k - ctx) }
        }
        Axis::Tokens => own(k),
        _ => false,
    }
}

/// The tensor an input role carries in `call`: ids (padded slots 0), positions, the mask, `token_valid`,
/// `beam_idx`. Embeddings and hidden states come from [`rows`].
pub fn fill(
    config: &Config,
    role: InputRole,
    port: &PortSpec,
    call: &Call,
    at: &str,
) -> Result<Tensor> {
    let sizes = call.sizes();
    let d = dims(config, &port.shape, &sizes, at)?;
    let axis = |a: Axis| port.shape.iter().position(|&x| x == a);
    let tokens = axis(Axis::Tokens);
    let token_of = |idx: &[usize]| tokens.map_or(0, |t| idx[t]);
    let values = match role {
        InputRole::InputIds => {
            if tokens.is_none() {
                return Err(Error::Config(format!(
                    "{at}: token ids need a `tokens` axis"
                )));
            }
            by_index(&d, |idx| {
                call.ids.get(token_of(idx)).map_or(0.0, |&id| f64::from(id))
            })
        }
        InputRole::Positions => by_index(&d, |idx| (call.past + token_of(idx)) as f64),
        InputRole::TokenValid => by_index(&d, |idx| {
            if token_of(idx) < call.valid() {
                1.0
            } else {
                0.0
            }
        }),
        InputRole::BeamIdx => by_index(&d, |_| 0.0),
        InputRole::AttentionMask(values) => {
            // The keys: the tokens so far, a static context, or the call's own tokens only.
            let key = port
                .shape
                .iter()
                .position(|a| matches!(a, Axis::PastTokens | Axis::Context | Axis::ContextTokens))
                .or(tokens)
                .ok_or_else(|| {
                    Error::Config(format!(
                        "{at}: an attention mask needs a key axis: `past+tokens`, `context`, `context+tokens` or \
                         `tokens`"
                    ))
                })?;
            let query = tokens.filter(|&t| t != key);
            if values == MaskValues::Bias && !port.ty.is_float() {
                return Err(Error::Config(format!(
                    "{at}: an additive mask (`bias`) is float, not {}",
                    port.ty.name()
                )));
            }
            let key_axis = port.shape[key];
            by_index(&d, |idx| {
                let seen = visible(key_axis, query.map(|t| idx[t]), idx[key], call);
                match (values, seen) {
                    (MaskValues::Ones, true) => 1.0,
                    (MaskValues::Ones, false) => 0.0,
                    (MaskValues::Bias, true) => 0.0,
                    (MaskValues::Bias, false) => f64::NEG_INFINITY,
                }
            })
        }
        InputRole::Embeddings | InputRole::Hidden => {
            return Err(Error::Interface(format!(
                "{at}: {} comes from the host's rows, not from the call's indices",
                role.key()
            )));
        }
    };
    typed(values, &d, port.ty)
}

/// Pads `[n, …]` to `[tokens, …]` by repeating the last row. The padded rows never reach a valid one (masked out
/// of attention, `token_valid` zeroing their decay and write strength), but they are computed: rows of zeros would
/// make the RMSNorms divide 0 by 0 wherever the norm's epsilon does not survive the device's arithmetic (1e-6 is
/// flushed to zero in fp16), and the NaN would reach valid rows through products with zero weights. A real token's
/// row (as the decoder graphs get from padding with token 0) is what a deployed graph sees.
pub fn pad_rows(x: &Tensor, tokens: usize) -> Result<Tensor> {
    let n = x.dim(0)?;
    if n == tokens {
        return Ok(x.clone());
    }
    let last = x.narrow(0, n - 1, 1)?;
    let mut rows = vec![x.clone()];
    rows.extend(std::iter::repeat_n(last, tokens - n));
    Ok(Tensor::cat(&rows, 0)?)
}

/// `rows` `[n, H]` (the call's embeddings or hidden states) padded to the call's slots by repeating the last row, in
/// the port's layout and type.
pub fn rows(
    config: &Config,
    port: &PortSpec,
    rows: &Tensor,
    call: &Call,
    at: &str,
) -> Result<Tensor> {
    let padded = pad_rows(rows, call.tokens)?;
    to_port(
        &padded,
        &[Axis::Tokens, Axis::Hidden],
        port,
        &dims(config, &port.shape, &call.sizes(), at)?,
        at,
    )
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
    spec: &super::StateSpec,
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
    spec: &super::StateSpec,
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

/// The dims of a state before any token: a cache of 0 positions.
pub fn empty_state(config: &Config, kind: StateKind) -> Result<Tensor> {
    let d: Vec<usize> = kind
        .canonical()
        .iter()
        .map(|a| {
            a.size(
                config,
                &CallSizes {
                    tokens: 0,
                    past: 0,
                    context: None,
                },
            )
            .unwrap_or(0)
        })
        .collect();
    Ok(Tensor::zeros(d, DType::F32, &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graphset::{MaskValues, StateSpec};

    fn config() -> Config {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny");
        Config::from_file(&dir.join("config.json")).unwrap()
    }

    fn values(t: &Tensor) -> Vec<f64> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn masks_mark_the_past_and_the_calls_tokens_causally() {
        let c = config();
        // 3 slots, 2 real tokens, after 2 tokens, static context 4.
        let call = Call {
            ids: &[7, 8],
            tokens: 3,
            past: 2,
            context: Some(4),
        };
        let bias = PortSpec::new("m", ElemKind::F32, &[Axis::Tokens, Axis::ContextTokens]);
        let got = values(
            &fill(
                &c,
                InputRole::AttentionMask(MaskValues::Bias),
                &bias,
                &call,
                "m",
            )
            .unwrap(),
        );
        assert_eq!(got, reference::masks::attention_bias(3, 2, 4));
        // Ones over the static context, the call's tokens written at slots 2..: causal per query.
        let ones = PortSpec::new(
            "m",
            ElemKind::I64,
            &[Axis::Batch, Axis::Tokens, Axis::Context],
        );
        let got = values(
            &fill(
                &c,
                InputRole::AttentionMask(MaskValues::Ones),
                &ones,
                &call,
                "m",
            )
            .unwrap(),
        );
        #[rustfmt::skip]
        assert_eq!(got, vec![1., 1., 1., 0., 1., 1., 1., 1., 1., 1., 1., 1.]);
        // Ones over the tokens so far without a query axis: the padded slot is 0.
        let grow = PortSpec::new("m", ElemKind::I64, &[Axis::Batch, Axis::PastTokens]);
        let got = values(
            &fill(
                &c,
                InputRole::AttentionMask(MaskValues::Ones),
                &grow,
                &call,
                "m",
            )
            .unwrap(),
        );
        assert_eq!(got, vec![1., 1., 1., 1., 0.]);
        let ids = PortSpec::new("i", ElemKind::I32, &[Axis::Batch, Axis::Tokens]);
        assert_eq!(
            values(&fill(&c, InputRole::InputIds, &ids, &call, "i").unwrap()),
            vec![7., 8., 0.]
        );
        let pos = PortSpec::new("p", ElemKind::I64, &[Axis::Fixed(3), Axis::Tokens]);
        assert_eq!(
            values(&fill(&c, InputRole::Positions, &pos, &call, "p").unwrap()),
            vec![2., 3., 4., 2., 3., 4., 2., 3., 4.]
        );
        let valid = PortSpec::new("v", ElemKind::Bool, &[Axis::Tokens]);
        assert_eq!(
            values(&fill(&c, InputRole::TokenValid, &valid, &call, "v").unwrap()),
            vec![1., 1., 0.]
        );
    }

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
