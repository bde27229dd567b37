//! The gated delta rule as graph ops, form for form as `reference::deltanet` has it: [`step`] (the single-token
//! matrix form), [`run`] (a form over a block), [`chunk`] (the chunkwise-parallel block with [`tri_inverse`]) and the
//! `Loop` of the optimum-intel export.
//!
//! # Shapes
//! As in the reference, heads first, key heads already repeated to the value heads:
//! `q`, `k` `[Hv, T, Dk]`, `v` `[Hv, T, Dv]`, `g`, `beta` `[Hv, T]`, state `S` `[Hv, Dk, Dv]`, output `o`
//! `[Hv, T, Dv]`.

use super::DeltaNetGraphForm;
use super::ops::exact_const;
use crate::error::Result;
use crate::ir::{ElemType, Graph, LoopInput, LoopOutput, Unary, Value};
use reference::deltanet::Inverse;
use reference::masks;

/// The inputs of the delta rule inside a graph (see the module's shape block), as `reference::deltanet::Inputs`.
#[derive(Debug, Clone, Copy)]
pub struct Inputs {
    /// Queries `[Hv, T, Dk]`.
    pub q: Value,
    /// Keys `[Hv, T, Dk]`.
    pub k: Value,
    /// Values `[Hv, T, Dv]`.
    pub v: Value,
    /// Log-decays `[Hv, T]`.
    pub g: Value,
    /// Write strengths `[Hv, T]`.
    pub beta: Value,
}

impl Inputs {
    /// Token `i` of the block.
    fn token(&self, graph: &mut Graph, i: usize) -> Result<Inputs> {
        Ok(Inputs {
            q: graph.slice(self.q, 1, i, 1)?,
            k: graph.slice(self.k, 1, i, 1)?,
            v: graph.slice(self.v, 1, i, 1)?,
            g: graph.slice(self.g, 1, i, 1)?,
            beta: graph.slice(self.beta, 1, i, 1)?,
        })
    }
}

/// Runs the recurrence over the block in the given form, from `state`; returns `(o, final state)`. A block of one
/// token always takes the matrix form.
pub fn run(
    graph: &mut Graph,
    form: DeltaNetGraphForm,
    x: Inputs,
    state: Value,
) -> Result<(Value, Value)> {
    let t = graph.shape(x.q)[1];
    if t == 1 {
        return step(graph, x, state);
    }
    match form {
        DeltaNetGraphForm::Matrix => {
            let mut s = state;
            let mut outs = Vec::with_capacity(t);
            for i in 0..t {
                let token = x.token(graph, i)?;
                let (o, s_next) = step(graph, token, s)?;
                outs.push(o);
                s = s_next;
            }
            Ok((graph.concat(&outs, 1)?, s))
        }
        DeltaNetGraphForm::Chunked(inverse) => chunk(graph, x, state, inverse),
        DeltaNetGraphForm::Loop => sequential_loop(graph, x, state),
    }
}

/// One token in the matrix form: `[q;k]ᵀS` in one product, `o = d·qᵀS + (q·k)·delta`, `S' = d·S + k deltaᵀ`, with
/// `d = exp(g)`.
pub fn step(graph: &mut Graph, x: Inputs, state: Value) -> Result<(Value, Value)> {
    let hv = graph.shape(x.q)[0];
    let qk = graph.concat(&[x.q, x.k], 1)?; // [Hv, 2, Dk]
    let read = graph.matmul(qk, state, false, false)?; // [Hv, 2, Dv]: qᵀS, kᵀS
    let q_s = graph.slice(read, 1, 0, 1)?;
    let k_s = graph.slice(read, 1, 1, 1)?;
    let d = graph.unary(Unary::Exp, x.g)?;
    let d = graph.reshape(d, &[hv, 1, 1])?;
    let beta = graph.reshape(x.beta, &[hv, 1, 1])?;
    let decayed_k_s = graph.mul(k_s, d)?;
    let diff = graph.sub(x.v, decayed_k_s)?;
    let delta = graph.mul(diff, beta)?; // [Hv, 1, Dv]
    let qk_dot = graph.mul(x.q, x.k)?;
    let qk_dot = graph.reduce_sum(qk_dot, &[2], true)?; // [Hv, 1, 1]
    let decayed_q_s = graph.mul(q_s, d)?;
    let fresh = graph.mul(delta, qk_dot)?;
    let o = graph.add(decayed_q_s, fresh)?;
    let decayed = graph.mul(state, d)?;
    let outer = graph.matmul(x.k, delta, true, false)?; // [Hv, Dk, Dv]
    let s = graph.add(decayed, outer)?;
    Ok((o, s))
}

/// The recurrence as one `Loop` over the tokens, the optimum-intel export's form (the body is
/// `reference::deltanet::sequential`'s step): `S ← exp(g) S; delta = beta (v − Sᵀk); S ← S + k deltaᵀ; o = Sᵀq`.
pub fn sequential_loop(graph: &mut Graph, x: Inputs, state: Value) -> Result<(Value, Value)> {
    let (hv, t, dk) = (
        graph.shape(x.q)[0],
        graph.shape(x.q)[1],
        graph.shape(x.q)[2],
    );
    let dv = graph.shape(x.v)[2];
    let mut body = Graph::new(&format!("{}_deltanet_loop", graph.name()));
    let q = body.parameter("q_t", ElemType::F32, &[hv, 1, dk]);
    let k = body.parameter("k_t", ElemType::F32, &[hv, 1, dk]);
    let v = body.parameter("v_t", ElemType::F32, &[hv, 1, dv]);
    let g = body.parameter("g_t", ElemType::F32, &[hv, 1]);
    let beta = body.parameter("beta_t", ElemType::F32, &[hv, 1]);
    let s = body.parameter("state", ElemType::F32, &[hv, dk, dv]);
    let decay = body.unary(Unary::Exp, g)?;
    let decay = body.reshape(decay, &[hv, 1, 1])?;
    let s = body.mul(s, decay)?;
    let recalled = body.matmul(k, s, false, false)?; // Sᵀk as a row: [Hv, 1, Dv]
    let diff = body.sub(v, recalled)?;
    let beta = body.reshape(beta, &[hv, 1, 1])?;
    let delta = body.mul(diff, beta)?;
    let outer = body.matmul(k, delta, true, false)?; // [Hv, Dk, Dv]
    let s = body.add(s, outer)?;
    let o = body.matmul(q, s, false, false)?; // [Hv, 1, Dv]
    body.result(s, "loop_state_out")?;
    body.result(o, "loop_o_t")?;
    let outs = graph.loop_op(
        t,
        body,
        &[
            (x.q, LoopInput::Sliced { axis: 1 }),
            (x.k, LoopInput::Sliced { axis: 1 }),
            (x.v, LoopInput::Sliced { axis: 1 }),
            (x.g, LoopInput::Sliced { axis: 1 }),
            (x.beta, LoopInput::Sliced { axis: 1 }),
            (state, LoopInput::Merged { result: 0 }),
        ],
        &[
            LoopOutput::Concat { result: 1, axis: 1 },
            LoopOutput::Last { result: 0 },
        ],
    )?;
    Ok((outs[0], outs[1]))
}

/// One block of the chunkwise-parallel form, from incoming state `S0` (padding already masked into `g` and `beta`).
/// With `G = cumsum(g)`:
/// ```text
/// N   = diag(beta) [exp(G_t − G_j) k_t·k_j]_{j<t}
/// D   = (I + N)^-1 diag(beta) (V − diag(exp G) K S0)
/// O   = diag(exp G) Q S0 + [exp(G_t − G_j) q_t·k_j]_{j<=t} D
/// S_T = exp(G_T) S0 + Kᵀ diag(exp(G_T − G)) D
/// ```
/// `G_t − G_j` is the segment sum `g_{j+1} + … + g_t` ([`segment_sums`]), masked in log space (zero above the
/// diagonal before `exp`), so strong decays neither lose accuracy nor overflow.
pub fn chunk(
    graph: &mut Graph,
    x: Inputs,
    state: Value,
    inverse: Inverse,
) -> Result<(Value, Value)> {
    let (h, t) = (graph.shape(x.q)[0], graph.shape(x.q)[1]);
    let big_g = cumsum(graph, x.g)?; // [H, T]
    let g_t = graph.reshape(big_g, &[h, t, 1])?;
    let strict = exact_const(graph, &masks::causal(t, false), &[t, t])?;
    let inclusive = exact_const(graph, &masks::causal(t, true), &[t, t])?;
    let seg = segment_sums(graph, x.g, strict, inclusive)?; // [H, T(t), T(j)] = G_t − G_j, summed directly
    let decay_strict = masked_exp(graph, seg, strict)?;
    let decay_incl = masked_exp(graph, seg, inclusive)?;

    let beta = graph.reshape(x.beta, &[h, t, 1])?;
    let kk = graph.matmul(x.k, x.k, false, true)?;
    let n = graph.mul(kk, decay_strict)?;
    let n = graph.mul(n, beta)?;
    let a_inv = tri_inverse(graph, n, inverse)?;

    let exp_g = graph.unary(Unary::Exp, g_t)?; // [H, T, 1]
    let k_s0 = graph.matmul(x.k, state, false, false)?; // [H, T, Dv]
    let k_s0 = graph.mul(k_s0, exp_g)?;
    let rhs = graph.sub(x.v, k_s0)?;
    let rhs = graph.mul(rhs, beta)?;
    let deltas = graph.matmul(a_inv, rhs, false, false)?; // [H, T, Dv]

    let q_s0 = graph.matmul(x.q, state, false, false)?;
    let q_s0 = graph.mul(q_s0, exp_g)?;
    let qk = graph.matmul(x.q, x.k, false, true)?;
    let intra = graph.mul(qk, decay_incl)?;
    let intra = graph.matmul(intra, deltas, false, false)?;
    let o = graph.add(q_s0, intra)?;

    let g_last = graph.slice(big_g, 1, t - 1, 1)?; // [H, 1]
    let to_end = graph.slice(decay_incl, 1, t - 1, 1)?; // exp(G_T − G_t): the decays' last row, [H, 1, T]
    let to_end = graph.reshape(to_end, &[h, t, 1])?;
    let k_weighted = graph.mul(x.k, to_end)?;
    let update = graph.matmul(k_weighted, deltas, true, false)?; // [H, Dk, Dv]
    let decay_all = graph.unary(Unary::Exp, g_last)?;
    let decay_all = graph.reshape(decay_all, &[h, 1, 1])?;
    let kept = graph.mul(state, decay_all)?;
    let s = graph.add(kept, update)?;
    Ok((o, s))
}

/// The exponents of the decays between two tokens of a block, `[H, T(t), T(j)]`: `g_{j+1} + … + g_t` for `j < t`
/// and exactly 0 elsewhere, as the product `inclusive · (g ⊙ strict)`, as the reference computes them
/// (`reference::deltanet`, `segment_sums`: why not `G_t − G_j`).
fn segment_sums(graph: &mut Graph, g: Value, strict: Value, inclusive: Value) -> Result<Value> {
    let (h, t) = (graph.shape(g)[0], graph.shape(g)[1]);
    let g_i = graph.reshape(g, &[h, t, 1])?;
    let terms = graph.mul(g_i, strict)?; // [H, T(i), T(j)] = g_i [j < i]
    graph.matmul(inclusive, terms, false, false)
}

/// Cumulative sum along the token axis of `[H, T]`, as one product with the inclusive upper triangle of ones.
fn cumsum(graph: &mut Graph, g: Value) -> Result<Value> {
    let t = graph.shape(g)[1];
    let upper = exact_const(graph, &masks::cumsum_matrix(t), &[t, t])?;
    graph.matmul(g, upper, false, false)
}

/// `exp(x)` where `mask` is 1 and exactly 0 elsewhere; masked entries are zeroed before `exp`, so a positive
/// exponent above the diagonal can never overflow into `inf · 0 = NaN`.
fn masked_exp(graph: &mut Graph, x: Value, mask: Value) -> Result<Value> {
    let zeroed = graph.mul(x, mask)?;
    let e = graph.unary(Unary::Exp, zeroed)?;
    graph.mul(e, mask)
}

/// `(I + N)^-1` for a batch `[H, n, n]` of strictly lower triangular `N`, by the chosen method.
pub fn tri_inverse(graph: &mut Graph, n: Value, method: Inverse) -> Result<Value> {
    let (h, size) = (graph.shape(n)[0], graph.shape(n)[1]);
    let identity: Vec<f64> = (0..size * size)
        .map(|i| if i / size == i % size { 1.0 } else { 0.0 })
        .collect();
    let eye = exact_const(graph, &identity, &[size, size])?;
    match method {
        Inverse::Substitution => {
            // Row i of X = (I + N)^-1 is e_i − N[i, :i] X[:i, :].
            let first = graph.slice(eye, 0, 0, 1)?;
            let first = graph.reshape(first, &[1, 1, size])?;
            let zeros = graph.const_f32(&vec![0.0; h * size], &[h, 1, size])?;
            let mut x = graph.add(first, zeros)?; // [H, 1, n]
            for i in 1..size {
                let row_n = graph.slice(n, 1, i, 1)?;
                let coeffs = graph.slice(row_n, 2, 0, i)?; // [H, 1, i]
                let prod = graph.matmul(coeffs, x, false, false)?; // [H, 1, n]
                let e = graph.slice(eye, 0, i, 1)?;
                let row = graph.sub(e, prod)?;
                x = graph.concat(&[x, row], 1)?;
            }
            Ok(x)
        }
        Inverse::Doubling => {
            // X starts as the inverse of the unit diagonal; each pass doubles the block size of the sub-inverse.
            let a = graph.add(n, eye)?;
            let mut x = eye;
            let mut s = 1;
            while s < size {
                // The lower off-diagonal halves of the 2s blocks.
                let off = exact_const(graph, &masks::block_band(size, s), &[size, size])?;
                let c = graph.mul(a, off)?;
                let xc = graph.matmul(x, c, false, false)?;
                let xcx = graph.matmul(xc, x, false, false)?;
                x = graph.sub(x, xcx)?;
                s *= 2;
            }
            Ok(x)
        }
        Inverse::Series => {
            let mut p = graph.sub(eye, n)?;
            let mut power = n;
            let mut covered = 2;
            while covered < size {
                power = graph.matmul(power, power, false, false)?;
                let factor = graph.add(eye, power)?;
                p = graph.matmul(p, factor, false, false)?;
                covered *= 2;
            }
            Ok(p)
        }
    }
}
