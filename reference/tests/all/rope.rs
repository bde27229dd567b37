//! The rotary embedding against a slow scalar oracle written from SPEC.md's formula.

use crate::common::*;
use candle_core::{DType, Device, Tensor};
use proptest::prelude::*;
use reference::config::Config;
use reference::rope::{Positions, Rope};
use reference::synthetic::Rng;

/// Partial interleaved-MRoPE rotation of `x` `[T, heads, head_dim]` (flat), one value at a time in f64:
/// - `inv_freq_i = theta^(−2i/rd)` as the checkpoint rounds it: the exponent `2i/rd`, the power `theta^exponent` and
///   its reciprocal each rounded to f32;
/// - frequency `i` reads the height row when `i % 3 == 1 && i < 3·section[1]`, the width row when
///   `i % 3 == 2 && i < 3·section[2]`, else the temporal row;
/// - the angle `position · inv_freq_i` multiplied in the run's dtype (rounded to f32 in an f32 run), its cos and sin
///   taken in f64;
/// - rotate-half on the first `rd` dims: dim `i < rd/2` pairs with `i + rd/2`,
///   `y_i = x_i cos − x_{i+rd/2} sin`, `y_{i+rd/2} = x_{i+rd/2} cos + x_i sin`; dims from `rd` on pass through.
fn rope_by_hand(case: &RopeCase, x: &[f64], dtype: DType) -> Vec<f64> {
    let (d, rd) = (case.head_dim, case.rotary_dim());
    let half = rd / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| {
            let exponent = (2 * i) as f32 / rd as f32;
            let power = case.theta.powf(exponent as f64) as f32;
            1.0f32 / power
        })
        .collect();
    let row_of = |i: usize| match case.section {
        Some(s) if i % 3 == 1 && i < 3 * s[1] => 1,
        Some(s) if i % 3 == 2 && i < 3 * s[2] => 2,
        _ => 0,
    };
    let tokens = case.rows[0].len();
    let mut y = x.to_vec();
    for t in 0..tokens {
        for i in 0..half {
            let position = case.rows[row_of(i)][t];
            let angle = match dtype {
                DType::F64 => position as f64 * inv_freq[i] as f64,
                DType::F32 => (position as f32 * inv_freq[i]) as f64,
                other => panic!("no oracle for {other:?}"),
            };
            let (sin, cos) = angle.sin_cos();
            for h in 0..case.heads {
                let base = (t * case.heads + h) * d;
                let (a, b) = (x[base + i], x[base + i + half]);
                y[base + i] = a * cos - b * sin;
                y[base + i + half] = b * cos + a * sin;
            }
        }
    }
    y
}

/// The input `[T, heads, head_dim]` of a case, in `dtype`, and its values.
fn input(case: &RopeCase, dtype: DType) -> (Tensor, Vec<f64>) {
    let shape = [case.rows[0].len(), case.heads, case.head_dim];
    let x = Rng::new(case.seed)
        .normal_tensor(&shape, 1.0, dtype)
        .unwrap();
    let values = x
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    (x, values)
}

/// `RotaryTables::apply` of a case in `dtype`, through the model's own config parsing and tables.
fn rope_by_model(case: &RopeCase, x: &Tensor) -> Tensor {
    let config = Config::from_json_str(&case.config_json().to_string(), "config.json").unwrap();
    assert_eq!(config.rotary_dim(), case.rotary_dim());
    let tables = Rope::new(&config)
        .tables(&Positions(case.rows.clone()), x.dtype(), &Device::Cpu)
        .unwrap();
    tables.apply(x).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// In f64 the rotation is the scalar oracle's to rounding, for any head size, partial factor, base and section,
    /// text positions near and far (where an exact f64 `inv_freq` would be off by 1e-2 radians) and multimodal rows.
    #[test]
    fn rope_matches_scalar_oracle_f64(case in rope_case()) {
        let (x, values) = input(&case, DType::F64);
        let y = rope_by_model(&case, &x);
        let expected = rope_by_hand(&case, &values, DType::F64);
        let expected = Tensor::from_vec(expected, x.dims(), &Device::Cpu).unwrap();
        prop_close("rotated", &y, &expected, 1e-12)?;
    }

    /// In f32 the angle is the f32 product `position · inv_freq` (transformers' rounding), not a more precise one
    /// rounded afterwards: far out the two differ by up to half an f32 step of the angle (1.6e-2 at 3e5).
    #[test]
    fn rope_matches_scalar_oracle_f32(case in rope_case()) {
        let (x, values) = input(&case, DType::F32);
        let y = rope_by_model(&case, &x);
        let expected = rope_by_hand(&case, &values, DType::F32);
        let expected = Tensor::from_vec(expected, x.dims(), &Device::Cpu).unwrap();
        prop_close("rotated", &y, &expected, 1e-6)?;
    }

    /// RoPE is a rotation: norms are preserved for any positions, text or multimodal rows.
    #[test]
    fn rope_preserves_norms(case in rope_case()) {
        let (x, _) = input(&case, DType::F64);
        let y = rope_by_model(&case, &x);
        let norm = |x: &Tensor| x.sqr().unwrap().sum_keepdim(2).unwrap();
        prop_close("norms", &norm(&y), &norm(&x), 1e-12)?;
    }
}
