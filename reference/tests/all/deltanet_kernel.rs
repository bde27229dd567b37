//! The f32 fast paths (the plain-memory kernels behind `chunked` with forward substitution, `step` and the matrix
//! form of `run`) against the tensor forms they restate and the sequential oracle.

use crate::common::*;
use candle_core::{DType, Tensor};
use reference::deltanet::{
    Form, Inputs, Inverse, chunked, chunked_candle, run, sequential, step, step_candle,
};

const TOKENS: [usize; 6] = [1, 5, 63, 64, 65, 200];
const BLOCKS: [usize; 5] = [1, 7, 16, 64, 100];

/// f32 inputs of `tokens` tokens, taken as a strided view (tokens 2.. of a longer sequence), so the kernels also
/// see non-contiguous tensors.
fn case(
    heads: usize,
    tokens: usize,
    dk: usize,
    dv: usize,
    g_min: f64,
    seed: u64,
) -> (Inputs, Tensor) {
    let c = KernelCase {
        seed,
        heads,
        tokens: tokens + 2,
        dk,
        dv,
        block: 1,
        g_min,
    };
    let (x, s0) = kernel_inputs(&c, DType::F32);
    (x.narrow(2, tokens).unwrap(), s0)
}

/// The same inputs in f64 (exactly: f32 → f64 is exact).
fn widened(x: &Inputs, s0: &Tensor) -> (Inputs, Tensor) {
    let f = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    let x = Inputs {
        q: f(&x.q),
        k: f(&x.k),
        v: f(&x.v),
        g: f(&x.g),
        beta: f(&x.beta),
    };
    (x, f(s0))
}

fn as_f32(t: &Tensor) -> Tensor {
    t.to_dtype(DType::F32).unwrap()
}

/// Odd lengths, several block sizes, mild and strong decays (down to −60 per token, where `exp(G)` of a chunk
/// underflows to zero, and `exp(g)` of a token is 1e-26, and an unmasked `exp(G_t − G_j)` would overflow), small head
/// dims (register-tile edges) and the real 128: the fast chunked form is within the f32 tolerance of the chunked
/// tests of the sequential oracle (f32 and f64) and of the tensor form of the same algorithm.
///
/// The tensor form is held to the same tolerance at every decay: it sums the exponent of each decay directly, as
/// the kernel does. Written as the difference of the cumulative sums `G_t − G_j`, it was 2.9e-5 of the max output
/// off at −20 (Dk = 128, T = 63), outside this tolerance: the test failed with that form.
#[test]
fn fast_chunked_equals_tensor_form_and_oracle() {
    for (heads, dk, dv) in [(2, 9, 20), (2, 128, 128)] {
        for g_min in [-1.0, -10.0, -20.0, -60.0] {
            for (n, &t) in TOKENS.iter().enumerate() {
                let (x, s0) = case(heads, t, dk, dv, g_min, 100 + n as u64);
                let (o_seq, s_seq) = sequential(&x, &s0).unwrap();
                let (x64, s64) = widened(&x, &s0);
                let (o_64, s_64) = sequential(&x64, &s64).unwrap();
                let (o_64, s_64) = (as_f32(&o_64), as_f32(&s_64));
                for block in BLOCKS {
                    let what = format!("Dk {dk} Dv {dv} g_min {g_min} T {t} block {block}");
                    let (o, s) = chunked(&x, &s0, block, Inverse::Substitution).unwrap();
                    assert_close(&format!("o vs sequential, {what}"), &o, &o_seq, 2e-5);
                    assert_close(&format!("S vs sequential, {what}"), &s, &s_seq, 2e-5);
                    assert_close(&format!("o vs f64 sequential, {what}"), &o, &o_64, 2e-5);
                    assert_close(&format!("S vs f64 sequential, {what}"), &s, &s_64, 2e-5);
                    let (o_c, s_c) = chunked_candle(&x, &s0, block, Inverse::Substitution).unwrap();
                    assert_close(&format!("o vs tensor form, {what}"), &o, &o_c, 2e-5);
                    assert_close(&format!("S vs tensor form, {what}"), &s, &s_c, 2e-5);
                }
            }
        }
    }
}

/// The fast matrix form (`run` over T tokens, and `step` on one) equals the tensor step and the oracle.
#[test]
fn fast_matrix_form_equals_tensor_step_and_oracle() {
    for (heads, dk, dv) in [(3, 9, 20), (2, 128, 128)] {
        for (n, &t) in TOKENS.iter().enumerate() {
            let (x, s0) = case(heads, t, dk, dv, -20.0, 200 + n as u64);
            let what = format!("Dk {dk} Dv {dv} T {t}");
            let (o_seq, s_seq) = sequential(&x, &s0).unwrap();
            let (o, s) = run(Form::Matrix, &x, &s0).unwrap();
            assert_close(&format!("o vs sequential, {what}"), &o, &o_seq, 2e-5);
            assert_close(&format!("S vs sequential, {what}"), &s, &s_seq, 2e-5);

            let mut s_step = s0.clone();
            let mut outs = Vec::new();
            for i in 0..t {
                let (o_i, next) = step_candle(&x.narrow(i, 1).unwrap(), &s_step).unwrap();
                outs.push(o_i);
                s_step = next;
            }
            let o_step = Tensor::cat(&outs, 1).unwrap();
            assert_close(&format!("o vs tensor steps, {what}"), &o, &o_step, 2e-5);
            assert_close(&format!("S vs tensor steps, {what}"), &s, &s_step, 2e-5);

            let first = x.narrow(0, 1).unwrap();
            let (o1, s1) = step(&first, &s0).unwrap();
            let (o1_c, s1_c) = step_candle(&first, &s0).unwrap();
            assert_close(&format!("one step o, {what}"), &o1, &o1_c, 1e-6);
            assert_close(&format!("one step S, {what}"), &s1, &s1_c, 1e-6);
        }
    }
}

/// Garbage tokens appended and masked (`g = 0, beta = 0`) leave the fast paths' state and the real tokens'
/// outputs bit for bit as without them, whether they share the last chunk or fill chunks of their own.
#[test]
fn masked_padding_leaves_fast_paths_exactly_unchanged() {
    for (t, pad, block) in [
        (5, 3, 16),
        (63, 1, 64),
        (64, 64, 64),
        (65, 100, 64),
        (200, 7, 7),
    ] {
        let (x, s0) = case(2, t, 9, 20, -20.0, t as u64);
        let (junk, _) = case(2, pad, 9, 20, -3.0, 999);
        let cat = |a: &Tensor, b: &Tensor| Tensor::cat(&[a, b], 1).unwrap();
        let padded = Inputs {
            q: cat(&x.q, &junk.q),
            k: cat(&x.k, &junk.k),
            v: cat(&x.v, &junk.v),
            g: cat(&x.g, &junk.g),
            beta: cat(&x.beta, &junk.beta),
        };
        let mut valid = vec![1f32; t];
        valid.resize(t + pad, 0.0);
        let valid = Tensor::new(valid, &candle_core::Device::Cpu).unwrap();
        let padded = padded.mask_padding(&valid).unwrap();
        let forms = [
            Form::Chunked {
                block,
                inverse: Inverse::Substitution,
            },
            Form::Matrix,
        ];
        for form in forms {
            let what = format!("{} T {t} pad {pad}", form.describe());
            let (o_ref, s_ref) = run(form, &x, &s0).unwrap();
            let (o, s) = run(form, &padded, &s0).unwrap();
            assert_eq!(values(&s), values(&s_ref), "state, {what}");
            assert_eq!(
                values(&o.narrow(1, 0, t).unwrap()),
                values(&o_ref),
                "outputs, {what}"
            );
        }
    }
}

/// Masked tokens in the middle of a sequence are skipped: the fast chunked form equals the oracle run on the
/// sequence without them.
#[test]
fn masked_tokens_inside_the_sequence_are_skipped() {
    let (t, block) = (150, 64);
    let (x, s0) = case(2, t, 16, 24, -5.0, 7);
    let hole = 50..90; // across a chunk boundary
    let valid: Vec<f32> = (0..t)
        .map(|i| if hole.contains(&i) { 0.0 } else { 1.0 })
        .collect();
    let valid = Tensor::new(valid, &candle_core::Device::Cpu).unwrap();
    let (o, s) = chunked(
        &x.mask_padding(&valid).unwrap(),
        &s0,
        block,
        Inverse::Substitution,
    )
    .unwrap();
    let cat = |a: &Tensor, b: &Tensor| Tensor::cat(&[a, b], 1).unwrap();
    let (before, after) = (
        x.narrow(0, hole.start).unwrap(),
        x.narrow(hole.end, t - hole.end).unwrap(),
    );
    let kept = Inputs {
        q: cat(&before.q, &after.q),
        k: cat(&before.k, &after.k),
        v: cat(&before.v, &after.v),
        g: cat(&before.g, &after.g),
        beta: cat(&before.beta, &after.beta),
    };
    let (o_ref, s_ref) = sequential(&kept, &s0).unwrap();
    assert_close("state", &s, &s_ref, 2e-5);
    let real = cat(
        &o.narrow(1, 0, hole.start).unwrap(),
        &o.narrow(1, hole.end, t - hole.end).unwrap(),
    );
    assert_close("outputs of the real tokens", &real, &o_ref, 2e-5);
}

/// Bad calls of the fast paths fail with a message, as the tensor forms do.
#[test]
fn fast_paths_refuse_bad_input() {
    let (x, s0) = case(2, 10, 8, 8, -1.0, 1);
    let err = chunked(&x, &s0, 0, Inverse::Substitution)
        .unwrap_err()
        .to_string();
    assert!(err.contains("block size"), "{err}");
    let wrong_state = s0.narrow(2, 0, 4).unwrap();
    let err = chunked(&x, &wrong_state, 16, Inverse::Substitution)
        .unwrap_err()
        .to_string();
    assert!(err.contains("inconsistent shapes"), "{err}");
    let err = run(Form::Matrix, &x, &wrong_state).unwrap_err().to_string();
    assert!(err.contains("inconsistent shapes"), "{err}");
    let err = step(&x.narrow(0, 2).unwrap(), &s0).unwrap_err().to_string();
    assert!(err.contains("one token"), "{err}");
    // An empty sequence leaves the state as it was.
    let (o, s) = chunked(&x.narrow(0, 0).unwrap(), &s0, 16, Inverse::Substitution).unwrap();
    assert_eq!(o.dims(), [2, 0, 8]);
    assert_eq!(values(&s), values(&s0));
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}
