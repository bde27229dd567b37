//! The inputs a call feeds that are not states: ids, positions, masks, `token_valid`, `beam_idx`, and the rows of
//! embeddings or hidden states.

use super::{Call, dims, to_port, typed};
use crate::error::{Error, Result};
use crate::graphset::{Axis, InputRole, MaskValues, PortSpec};
use candle_core::Tensor;
use reference::config::Config;

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
        InputRole::Positions => {
            let row = axis(Axis::Fixed(3));
            if row.is_none() && call.positions_differ() {
                return Err(Error::Interface(format!(
                    "{at}: one row of positions cannot carry an image's (its three MRoPE rows differ); the port \
                     needs a `3` axis"
                )));
            }
            by_index(&d, |idx| {
                call.position(row.map_or(0, |r| idx[r]), token_of(idx)) as f64
            })
        }
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

#[cfg(test)]
mod tests {
    use super::super::CallPositions;
    use super::super::tests::{config, values};
    use super::*;
    use crate::graphset::ElemKind;

    #[test]
    fn masks_mark_the_past_and_the_calls_tokens_causally() {
        let c = config();
        // 3 slots, 2 real tokens, after 2 tokens, static context 4.
        let call = Call {
            ids: &[7, 8],
            tokens: 3,
            past: 2,
            context: Some(4),
            positions: CallPositions::TEXT,
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
        // An image's rows, and the text after it shifted by the rope delta.
        let rows: [&[i64]; 3] = [&[5, 5], &[5, 6], &[5, 5]];
        let image = Call {
            positions: CallPositions::Rows(rows),
            ..call
        };
        assert_eq!(
            values(&fill(&c, InputRole::Positions, &pos, &image, "p").unwrap()),
            vec![5., 5., 7., 5., 6., 7., 5., 5., 7.]
        );
        let one_row = PortSpec::new("p", ElemKind::I64, &[Axis::Tokens]);
        assert!(fill(&c, InputRole::Positions, &one_row, &image, "p").is_err());
        let after = Call {
            positions: CallPositions::Text { delta: -1 },
            ..call
        };
        assert_eq!(
            values(&fill(&c, InputRole::Positions, &one_row, &after, "p").unwrap()),
            vec![1., 2., 3.]
        );
        let valid = PortSpec::new("v", ElemKind::Bool, &[Axis::Tokens]);
        assert_eq!(
            values(&fill(&c, InputRole::TokenValid, &valid, &call, "v").unwrap()),
            vec![1., 1., 0.]
        );
    }
}
