//! Compressed weights: NNCF-style symmetric INT4/INT8 quantisation, its packing and its errors (the store and the
//! selection rule are in `store.rs`).

use candle_core::{DType, Tensor};
use half::f16;
use proptest::prelude::*;
use reference::quant::{
    QuantKind, QuantizedMatrix, WeightFormat, pack_i4, quantize_int4_sym, quantize_int8_sym,
    unpack_i4,
};
use reference::synthetic::Rng;

pub fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// A random `[rows, cols]` matrix whose rows are of different kinds: ordinary normals of random magnitude, all
/// zeros, values below NNCF's scale floor, a positive extreme (negative scale) or equal extremes of both signs.
fn random_matrix(seed: u64, rows: usize, cols: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let mut w = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let kind = rng.next_u64() % 6;
        let magnitude = 10f64.powf(rng.range(-4.0, 3.0));
        let start = w.len();
        for _ in 0..cols {
            let x = match kind {
                0 => 0.0,
                1 => rng.normal() * 1e-7,
                _ => rng.normal() * magnitude,
            };
            w.push(x as f32);
        }
        let row = &mut w[start..];
        if kind == 4 {
            row[(rng.next_u64() % cols as u64) as usize] = (magnitude * 10.0) as f32;
        }
        if kind == 5 && cols >= 2 {
            row[0] = magnitude as f32;
            row[1] = -(magnitude as f32);
        }
    }
    w
}

/// Per element: within half a quantisation step (plus what rounding the scale to f16 moved the codes' grid), or a
/// full step for the positive extreme clipped to the largest code; codes in range; the largest magnitude of each
/// group at the lowest code (NNCF's signed scale); all-zero groups exactly zero.
fn check_round_trip(w: &[f32], q: &QuantizedMatrix) -> std::result::Result<(), TestCaseError> {
    let (lo, hi) = q.kind().code_range();
    let cols = q.cols();
    let group = q.group_size();
    let deq = q.dequantize();
    prop_assert_eq!(deq.len(), w.len());
    prop_assert_eq!(q.scales().len(), q.scale_shape()[0] * q.scale_shape()[1]);
    for (i, (&x, &d)) in w.iter().zip(&deq).enumerate() {
        let (r, c) = (i / cols, i % cols);
        let code = q.codes()[i];
        prop_assert!((lo..=hi).contains(&code), "code {} at {}", code, i);
        let s = f64::from(q.scale_at(r, c).unwrap());
        prop_assert!(s != 0.0 && s.is_finite());
        let ds = s.abs() * 2f64.powi(-10) + 2f64.powi(-25);
        let rounding = f64::from(code).abs() * ds + 1e-6 * f64::from(x).abs();
        let err = (f64::from(x) - f64::from(d)).abs();
        let half = 0.5 * (s.abs() + ds) + rounding;
        let full = (s.abs() + ds) + rounding;
        prop_assert!(
            err <= half || (code == hi && err <= full),
            "[{}, {}]: w {} dequantised {} (code {}, scale {}): error {:e} > {:e}",
            r,
            c,
            x,
            d,
            code,
            s,
            err,
            half
        );
    }
    for (g, chunk) in w.chunks(group).enumerate() {
        let codes = &q.codes()[g * group..(g + 1) * group];
        let deq = &deq[g * group..(g + 1) * group];
        let max_abs = chunk.iter().fold(0f32, |m, x| m.max(x.abs()));
        if max_abs == 0.0 {
            prop_assert!(codes.iter().all(|&c| c == 0));
            prop_assert!(deq.iter().all(|&d| d == 0.0));
        } else if max_abs / -(lo as f32) >= f32::EPSILON {
            // The scale's sign makes the extreme value land on the lowest code, except when the positive extreme
            // ties with |min| (a constant positive group included): then the scale is positive and it clips to the
            // highest code.
            let min = chunk.iter().copied().fold(f32::INFINITY, f32::min);
            let max = chunk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let (extreme, code) = if min.abs() >= max {
                (min, if min < 0.0 { lo } else { hi })
            } else {
                (max, lo)
            };
            let at = chunk.iter().position(|&x| x == extreme).unwrap();
            prop_assert_eq!(codes[at], code, "group {}: the extreme {}", g, extreme);
        }
    }
    Ok(())
}

/// Exactly `f32(code) · f32(scale)`, and that product is exact (no rounding in f32).
fn check_exact_dequantisation(q: &QuantizedMatrix) {
    let deq = q.dequantize();
    for (i, &d) in deq.iter().enumerate() {
        let code = q.codes()[i];
        let scale = q.scale_at(i / q.cols(), i % q.cols()).unwrap();
        let product = code as f32 * f32::from(scale);
        assert_eq!(d.to_bits(), product.to_bits(), "element {i}");
        assert_eq!(
            f64::from(code) * scale.to_f64(),
            f64::from(d),
            "element {i}"
        );
    }
}

fn matrix_case() -> impl Strategy<Value = (u64, usize, usize, usize)> {
    (
        any::<u64>(),
        1usize..6,
        prop::sample::select(vec![1usize, 2, 3, 8, 32, 128]),
        1usize..4,
    )
        .prop_map(|(seed, rows, group, groups)| (seed, rows, group, groups))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn int4_round_trip_within_half_a_step((seed, rows, group, groups) in matrix_case()) {
        let cols = group * groups;
        let w = random_matrix(seed, rows, cols);
        let q = quantize_int4_sym(&w, rows, cols, group).unwrap();
        prop_assert_eq!(q.kind(), QuantKind::Int4Sym { group });
        prop_assert_eq!(q.scale_shape(), [rows, groups]);
        check_round_trip(&w, &q)?;
    }

    #[test]
    fn int8_round_trip_within_half_a_step((seed, rows, group, groups) in matrix_case()) {
        let cols = group * groups;
        let w = random_matrix(seed, rows, cols);
        let q = quantize_int8_sym(&w, rows, cols).unwrap();
        prop_assert_eq!(q.scale_shape(), [rows, 1]);
        check_round_trip(&w, &q)?;
    }

    #[test]
    fn pack_i4_round_trips(codes in prop::collection::vec(-8i8..=7, 0..300)) {
        let packed = pack_i4(&codes).unwrap();
        prop_assert_eq!(packed.len(), codes.len().div_ceil(2));
        prop_assert_eq!(unpack_i4(&packed, codes.len()).unwrap(), codes);
    }
}

#[test]
fn dequantised_values_are_code_times_scale_bitwise() {
    for (seed, rows, cols, group) in [(1, 7, 256, 128), (2, 5, 96, 32), (3, 3, 64, 64)] {
        let w = random_matrix(seed, rows, cols);
        check_exact_dequantisation(&quantize_int4_sym(&w, rows, cols, group).unwrap());
        check_exact_dequantisation(&quantize_int8_sym(&w, rows, cols).unwrap());
    }
}

#[test]
fn zero_rows_give_exact_zeros() {
    let w = vec![0f32; 3 * 8];
    for q in [
        quantize_int4_sym(&w, 3, 8, 4).unwrap(),
        quantize_int8_sym(&w, 3, 8).unwrap(),
    ] {
        assert!(q.codes().iter().all(|&c| c == 0));
        // NNCF's floor: f32 epsilon (2^-23), representable in f16.
        assert!(q.scales().iter().all(|&s| f32::from(s) == f32::EPSILON));
        assert!(q.dequantize().iter().all(|d| d.to_bits() == 0f32.to_bits()));
    }
}

#[test]
fn packing_follows_openvino_nibble_order() {
    // Element 0 in the low nibble, element 1 in the high one, two's complement.
    assert_eq!(pack_i4(&[1, -1]).unwrap(), vec![0xF1]);
    assert_eq!(pack_i4(&[-8, 7, 3]).unwrap(), vec![0x78, 0x03]);
    let q = quantize_int4_sym(&[1.0, -0.5, 0.0, 0.25], 1, 4, 4).unwrap();
    assert_eq!(q.packed_codes(), pack_i4(q.codes()).unwrap());
    assert!(pack_i4(&[8]).is_err());
    assert!(pack_i4(&[-9]).is_err());
    assert!(unpack_i4(&[0x12], 3).is_err());
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let w = [1.0f32, f32::NAN, 0.0, 2.0];
    let e = quantize_int8_sym(&w, 2, 2).unwrap_err().to_string();
    assert!(e.contains("[0, 1]") && e.contains("non-finite"), "{e}");
    assert!(quantize_int4_sym(&[1.0; 4], 1, 4, 3).is_err());
    assert!(quantize_int4_sym(&[1.0; 4], 1, 4, 0).is_err());
    assert!(quantize_int8_sym(&[1.0; 4], 3, 2).is_err());
    assert!(quantize_int8_sym(&[], 2, 0).is_err());
    // A scale beyond the f16 range (|w| / 8 > 65504) cannot be stored.
    assert!(quantize_int4_sym(&[1e6, 0.0], 1, 2, 2).is_err());
    assert!(
        QuantizedMatrix::from_parts(
            QuantKind::Int4Sym { group: 2 },
            1,
            2,
            vec![8, 0],
            vec![f16::ONE]
        )
        .is_err()
    );
    assert!(
        QuantizedMatrix::from_parts(QuantKind::Int8Sym, 1, 2, vec![1, 0], vec![f16::INFINITY])
            .is_err()
    );
    let q = QuantizedMatrix::from_parts(
        QuantKind::Int4Sym { group: 2 },
        1,
        4,
        vec![-8, 7, 1, 0],
        vec![f16::from_f32(0.5), f16::from_f32(-0.25)],
    )
    .unwrap();
    assert_eq!(q.dequantize(), vec![-4.0, 3.5, -0.25, -0.0]);
}

#[test]
fn format_names_parse_back() {
    for (text, format) in [
        ("f32", WeightFormat::F32),
        ("f16", WeightFormat::F16),
        ("int4", WeightFormat::Int4Sym { group: 128 }),
        ("int4:32", WeightFormat::Int4Sym { group: 32 }),
        ("int4-nncf", WeightFormat::Int4Nncf { group: 128 }),
        ("int4-nncf:32", WeightFormat::Int4Nncf { group: 32 }),
    ] {
        assert_eq!(WeightFormat::parse(text).unwrap(), format);
        assert_eq!(format.name(), text);
        assert_eq!(text.parse::<WeightFormat>().unwrap(), format);
    }
    assert_eq!(WeightFormat::parse("int4:128").unwrap().name(), "int4");
    for bad in [
        "bf16",
        "int4:0",
        "int4:x",
        "int4:",
        "int8",
        "f32:8",
        "int4-nncf:0",
        "int4nncf",
    ] {
        let e = WeightFormat::parse(bad).unwrap_err().to_string();
        assert!(e.contains(bad), "{e}");
    }
}

#[test]
fn the_nncf_rule_adds_int8_conv_weights_and_nothing_else() {
    use reference::quant::Storage;
    use reference::schema::Role;
    let (plain, nncf) = (
        WeightFormat::Int4Sym { group: 32 },
        WeightFormat::Int4Nncf { group: 32 },
    );
    let cases: [(Role, &[usize]); 7] = [
        (Role::Conv, &[160, 1, 4]),
        (Role::Projection, &[96, 64]),
        (Role::Projection, &[96, 48]),
        (Role::Embedding, &[512, 64]),
        (Role::LmHead, &[512, 64]),
        (Role::Norm, &[64]),
        (Role::Decay, &[4]),
    ];
    for (role, shape) in cases {
        let expected = match role {
            Role::Conv => Storage::Int8Sym,
            _ => plain.storage(role, shape),
        };
        assert_eq!(nncf.storage(role, shape), expected, "{role:?} {shape:?}");
    }
    assert_eq!(plain.storage(Role::Conv, &[160, 1, 4]), Storage::Float);
}
