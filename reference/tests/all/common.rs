//! Shared strategies, generators and checks.

use candle_core::{DType, Tensor};
use proptest::prelude::*;
use reference::compare::diff;
use reference::deltanet::Inputs;
use reference::ops::l2_normalize;
use reference::synthetic::Rng;

/// Sizes and settings of one random delta-rule case.
#[derive(Debug, Clone)]
pub struct KernelCase {
    pub seed: u64,
    pub heads: usize,
    pub tokens: usize,
    pub dk: usize,
    pub dv: usize,
    pub block: usize,
    /// Most negative per-token log-decay.
    pub g_min: f64,
}

/// Random cases: 1-4 heads, 1-80 tokens (across block boundaries), Dk ≠ Dv, blocks 1-33, decays down to −10.
pub fn kernel_case() -> impl Strategy<Value = KernelCase> {
    (
        any::<u64>(),
        1usize..=4,
        1usize..=80,
        2usize..=9,
        2usize..=9,
        1usize..=33,
        -10.0f64..=-0.01,
    )
        .prop_map(|(seed, heads, tokens, dk, dv, block, g_min)| KernelCase {
            seed,
            heads,
            tokens,
            dk,
            dv,
            block,
            g_min,
        })
}

/// Delta-rule inputs as the layer makes them: l2-normalised keys, l2-normalised queries scaled by `Dk^-0.5`,
/// decays uniform in `[g_min, 0]`, beta in `(0, 1)`; and a non-zero incoming state.
pub fn kernel_inputs(c: &KernelCase, dtype: DType) -> (Inputs, Tensor) {
    let mut rng = Rng::new(c.seed);
    let (h, t, dk, dv) = (c.heads, c.tokens, c.dk, c.dv);
    let q = rng.normal_tensor(&[h, t, dk], 1.0, DType::F64).unwrap();
    let k = rng.normal_tensor(&[h, t, dk], 1.0, DType::F64).unwrap();
    let q = (l2_normalize(&q, 1e-6).unwrap() * (dk as f64).powf(-0.5)).unwrap();
    let k = l2_normalize(&k, 1e-6).unwrap();
    let inputs = Inputs {
        q: q.to_dtype(dtype).unwrap(),
        k: k.to_dtype(dtype).unwrap(),
        v: rng.normal_tensor(&[h, t, dv], 1.0, dtype).unwrap(),
        g: rng.uniform_tensor(&[h, t], c.g_min, 0.0, dtype).unwrap(),
        beta: rng.uniform_tensor(&[h, t], 0.01, 0.99, dtype).unwrap(),
    };
    let state = rng.normal_tensor(&[h, dk, dv], 0.5, dtype).unwrap();
    (inputs, state)
}

/// Fails with a labelled report unless every element is finite and within `rtol` of the expected tensor's
/// largest magnitude.
pub fn assert_close(what: &str, actual: &Tensor, expected: &Tensor, rtol: f64) {
    let d = diff(actual, expected).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        d.within(0.0, rtol),
        "{what}: {d} (tolerance {rtol:.1e} of the max)"
    );
}

/// Same check, as a proptest failure instead of a panic.
pub fn prop_close(
    what: &str,
    actual: &Tensor,
    expected: &Tensor,
    rtol: f64,
) -> Result<(), TestCaseError> {
    let d = diff(actual, expected).map_err(|e| TestCaseError::fail(format!("{what}: {e}")))?;
    prop_assert!(
        d.within(0.0, rtol),
        "{}: {} (tolerance {:.1e} of the max)",
        what,
        d,
        rtol
    );
    Ok(())
}

/// `(I + N)^-1` of one strictly lower triangular `n × n` matrix by forward substitution in f64 on plain vectors.
pub fn exact_unit_lower_inverse(n: &[f64], size: usize) -> Vec<f64> {
    let mut x = vec![0.0; size * size];
    for i in 0..size {
        for col in 0..size {
            let mut v = if i == col { 1.0 } else { 0.0 };
            for j in 0..i {
                v -= n[i * size + j] * x[j * size + col];
            }
            x[i * size + col] = v;
        }
    }
    x
}

/// The bundled test data directory.
pub fn testdata() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}
