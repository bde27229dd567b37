//! Compressed weights: NNCF-style symmetric INT4/INT8 quantisation and f16 rounding, the selection rule on real
//! checkpoint names, and whole-model runs on the compressed weights.

use crate::common::*;
use crate::goldens::load_golden;
use candle_core::{DType, Tensor};
use half::f16;
use proptest::prelude::*;
use reference::compare::diff;
use reference::config::Config;
use reference::model::{Model, RunOptions, argmax};
use reference::quant::{
    QuantKind, QuantizedMatrix, Storage, WeightFormat, pack_i4, quantize_int4_sym,
    quantize_int8_sym, unpack_i4,
};
use reference::schema::{Param, Role, Schema, TensorSpec};
use reference::synthetic::{Rng, random_weights, small_config_json, write_safetensors};
use reference::taps::Taps;
use reference::weights::WeightStore;
use reference::{Error, Result};
use std::path::Path;

/// Every tensor of a checkpoint directory with its shape, from the safetensors headers.
fn tensor_shapes(dir: &Path) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        for (name, info) in meta.tensors() {
            out.push((name, info.shape.clone()));
        }
    }
    out.sort();
    out
}

/// The decoder tensors (the store reads nothing else).
fn decoder_tensors(dir: &Path, prefix: &str) -> Vec<(String, Vec<usize>)> {
    tensor_shapes(dir)
        .into_iter()
        .filter(|(n, _)| n.starts_with(prefix) || n == "lm_head.weight")
        .collect()
}

fn values(t: &Tensor) -> Vec<f32> {
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
    ] {
        assert_eq!(WeightFormat::parse(text).unwrap(), format);
        assert_eq!(format.name(), text);
        assert_eq!(text.parse::<WeightFormat>().unwrap(), format);
    }
    assert_eq!(WeightFormat::parse("int4:128").unwrap().name(), "int4");
    for bad in ["bf16", "int4:0", "int4:x", "int4:", "int8"] {
        let e = WeightFormat::parse(bad).unwrap_err().to_string();
        assert!(e.contains(bad), "{e}");
    }
}

/// The schema names exactly the decoder tensors each testdata checkpoint holds, with the same shapes: every loader,
/// the graph builder and the compression rule read through it.
#[test]
fn schema_lists_exactly_the_checkpoint_tensors() {
    for (name, prefix) in [
        ("tiny", "model."),
        ("tiny-tied", "model."),
        ("tiny-full", "model.language_model."),
    ] {
        let dir = testdata().join("models").join(name);
        let config = Config::from_file(&dir.join("config.json")).unwrap();
        let mut expected: Vec<(String, Vec<usize>)> = Schema::new(&config)
            .tensors()
            .into_iter()
            .map(|t| (t.full_name(prefix), t.shape))
            .collect();
        expected.sort();
        assert_eq!(decoder_tensors(&dir, prefix), expected, "{name}");
    }
}

/// The rule on the roles and shapes of the real checkpoint layout (tiny-full: hidden 64, MLP and value widths 128).
#[test]
fn selection_rule_on_tiny_full() {
    let dir = testdata().join("models/tiny-full");
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let tensors = Schema::new(&config).tensors();
    assert_eq!(tensors.len(), 3 + 6 * 14 + 2 * 11);
    let int4 = WeightFormat::parse("int4").unwrap();
    let int4_32 = WeightFormat::parse("int4:32").unwrap();
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for t in &tensors {
        let (name, shape) = (&t.name, &t.shape);
        let (at128, at32) = match t.param {
            Param::EmbedTokens | Param::LmHead => (Storage::Int8Sym, Storage::Int8Sym),
            p if p.role() == Role::Projection => {
                // Only the projections reading 128 inputs (the MLP down projection, the DeltaNet output projection
                // and the attention output projection) have a width divisible by 128; at group 32 all of them do.
                let wide = matches!(p, Param::DownProj | Param::OutProj | Param::OProj);
                assert_eq!(shape[1], if wide { 128 } else { 64 }, "{name}");
                let at128 = if wide {
                    Storage::Int4Sym { group: 128 }
                } else {
                    Storage::Int8Sym
                };
                (at128, Storage::Int4Sym { group: 32 })
            }
            _ => (Storage::Float, Storage::Float),
        };
        assert_eq!(
            int4.storage(t.role(), shape),
            at128,
            "{name} {shape:?} int4"
        );
        assert_eq!(
            int4_32.storage(t.role(), shape),
            at32,
            "{name} {shape:?} int4:32"
        );
        assert_eq!(
            WeightFormat::F16.storage(t.role(), shape),
            Storage::F16,
            "{name}"
        );
        assert_eq!(
            WeightFormat::F32.storage(t.role(), shape),
            Storage::Float,
            "{name}"
        );
        *counts.entry(format!("{at128:?}")).or_default() += 1;
    }
    println!("tiny-full under int4 (group 128): {counts:?}");
    // Conv kernels, norms and decay parameters stay float whatever their shape.
    for role in [Role::Conv, Role::Norm, Role::GatedNorm, Role::Decay] {
        assert_eq!(int4.storage(role, &[128, 128]), Storage::Float, "{role:?}");
    }
}

/// The bf16 sharded checkpoint runs under int4 (group 128, mixed int4/int8) and its quantised forms agree with what
/// the store serves.
#[test]
fn tiny_full_runs_under_int4() {
    let dir = testdata().join("models/tiny-full");
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let s = Schema::new(&config);
    let store =
        WeightStore::open_with_format(&dir, DType::F32, WeightFormat::parse("int4").unwrap())
            .unwrap();
    let down = store
        .quantized(&s.layer(0, Param::DownProj))
        .unwrap()
        .unwrap();
    assert_eq!(down.kind(), QuantKind::Int4Sym { group: 128 });
    assert_eq!(down.scale_shape(), [64, 1]);
    let up = store
        .quantized(&s.layer(0, Param::UpProj))
        .unwrap()
        .unwrap();
    assert_eq!(up.kind(), QuantKind::Int8Sym);
    // What the store serves (and the model runs on) is the quantised form dequantised, bit for bit.
    for (param, q) in [(Param::DownProj, &down), (Param::UpProj, &up)] {
        let spec = s.layer(0, param);
        let name = &spec.name;
        let served = values(&store.load(&spec).unwrap());
        let expected = q.dequantize();
        assert_eq!(served.len(), expected.len(), "{name}");
        assert!(
            served
                .iter()
                .zip(&expected)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: served values differ from the dequantised form"
        );
    }
    assert!(
        store
            .quantized(&s.layer(0, Param::InputLayernorm))
            .unwrap()
            .is_none()
    );
    let model = Model::from_weights(config, &store).unwrap();
    let logits = model
        .prefill(
            &[1, 2, 3, 4, 5],
            &mut model.new_state().unwrap(),
            &RunOptions::default(),
            &mut Taps::off(),
        )
        .unwrap();
    assert!(values(&logits).iter().all(|x| x.is_finite()));
}

/// What the store serves equals the quantised form dequantised (bitwise), the checkpoint value for float tensors,
/// and the same values widened exactly in f64 runs; f16 serves every tensor rounded to f16.
#[test]
fn store_serves_exactly_the_compressed_values() {
    let dir = testdata().join("models/tiny");
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let plain = WeightStore::open(&dir, DType::F32).unwrap();
    let format = WeightFormat::Int4Sym { group: 32 };
    let q32 = WeightStore::open_with_format(&dir, DType::F32, format).unwrap();
    let q64 = WeightStore::open_with_format(&dir, DType::F64, format).unwrap();
    let f16s = WeightStore::open_with_format(&dir, DType::F32, WeightFormat::F16).unwrap();
    let (mut quantised, mut float) = (0, 0);
    for spec in Schema::new(&config).tensors() {
        let name = &spec.name;
        let original = values(&plain.load(&spec).unwrap());
        let served = values(&q32.load(&spec).unwrap());
        match q32.quantized(&spec).unwrap() {
            Some(q) => {
                quantised += 1;
                let expected = q.dequantize();
                assert!(
                    served
                        .iter()
                        .zip(&expected)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{name}"
                );
                assert_ne!(served, original, "{name}: quantisation changed nothing");
                let projection = spec.role() == Role::Projection;
                assert_eq!(
                    q.kind(),
                    if projection {
                        QuantKind::Int4Sym { group: 32 }
                    } else {
                        QuantKind::Int8Sym
                    },
                    "{name}"
                );
            }
            None => {
                float += 1;
                assert_eq!(served, original, "{name}");
            }
        }
        let wide: Vec<f64> = q64
            .load(&spec)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(
            wide.iter().zip(&served).all(|(a, b)| *a == f64::from(*b)),
            "{name}: f64 run"
        );
        let halves = values(&f16s.load(&spec).unwrap());
        for (h, o) in halves.iter().zip(&original) {
            assert_eq!(*h, f16::from_f32(*o).to_f32(), "{name}");
        }
        assert!(f16s.quantized(&spec).unwrap().is_none());
    }
    println!("tiny under int4:32: {quantised} tensors quantised, {float} kept float");
    assert_eq!(quantised, 2 + 3 * 8 + 4 + 3);
}

#[test]
fn store_errors_name_the_file_and_tensor() {
    let dir = testdata().join("models/tiny");
    let e = WeightStore::open_with_format(&dir, DType::F32, WeightFormat::Int4Sym { group: 0 });
    assert!(matches!(e, Err(Error::Input(_))));
    let store = WeightStore::open_with_format(&dir, DType::F32, WeightFormat::F16).unwrap();
    let nope = TensorSpec {
        param: Param::Norm,
        layer: None,
        name: "nope.weight".into(),
        shape: vec![2, 2],
    };
    let e = store.quantized(&nope).unwrap_err();
    assert!(e.to_string().contains("model.nope.weight"), "{e}");

    // A NaN in a projection: f32 and f16 serve it, int4 refuses it naming the file and the tensor.
    let tmp = tempfile::tempdir().unwrap();
    let text = small_config_json().to_string();
    std::fs::write(tmp.path().join("config.json"), &text).unwrap();
    let config = Config::from_json_str(&text, "config.json").unwrap();
    let up = Schema::new(&config).layer(0, Param::UpProj);
    let mut weights = random_weights(&config, "model.", 3).unwrap();
    let name = up.full_name("model.");
    let mut w = values(&weights[&name]);
    w[5] = f32::NAN;
    weights.insert(
        name.clone(),
        Tensor::from_vec(w, up.shape.as_slice(), &candle_core::Device::Cpu).unwrap(),
    );
    write_safetensors(&tmp.path().join("model.safetensors"), &weights, DType::F32).unwrap();
    for format in [WeightFormat::F32, WeightFormat::F16] {
        let store = WeightStore::open_with_format(tmp.path(), DType::F32, format).unwrap();
        assert!(store.load(&up).is_ok());
    }
    let store =
        WeightStore::open_with_format(tmp.path(), DType::F32, WeightFormat::Int4Sym { group: 8 })
            .unwrap();
    let e = store.load(&up).unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(e, Error::Weights { .. })
            && text.contains("model.safetensors")
            && text.contains(&name)
            && text.contains("non-finite"),
        "{text}"
    );
}

/// The last-position logits of every prompt position, and the model run.
fn run(dir: &Path, format: WeightFormat, ids: &[u32]) -> Result<Tensor> {
    let config = Config::from_file(&dir.join("config.json"))?;
    let store = WeightStore::open_with_format(dir, DType::F32, format)?;
    let model = Model::from_weights(config, &store)?;
    let mut taps = Taps::on();
    model.prefill(
        ids,
        &mut model.new_state()?,
        &RunOptions::default(),
        &mut taps,
    )?;
    Ok(taps.get("logits").unwrap().clone())
}

/// Fraction of positions whose argmax agrees.
fn argmax_agreement(a: &Tensor, b: &Tensor) -> f64 {
    let t = a.dims()[0];
    let same = (0..t)
        .filter(|&i| argmax(&a.get(i).unwrap()).unwrap() == argmax(&b.get(i).unwrap()).unwrap())
        .count();
    same as f64 / t as f64
}

/// The tiny model on its golden prompt with f16 weights, `int4` (group 128: on this model's widths int8 everywhere
/// but the attention output projection) and `int4:32` (every projection int4): finite logits that really differ from
/// the f32 run, f16 much closer than either int4 run.
#[test]
fn tiny_model_runs_on_compressed_weights() {
    let dir = testdata().join("models/tiny");
    let golden = load_golden(&testdata().join("goldens/tiny.safetensors"));
    let ids: Vec<u32> = golden.tensors["token_ids"]
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect();
    let base = run(&dir, WeightFormat::F32, &ids).unwrap();
    let mut measured = Vec::new();
    for format in [
        WeightFormat::F16,
        WeightFormat::Int4Sym { group: 128 },
        WeightFormat::Int4Sym { group: 32 },
    ] {
        let logits = run(&dir, format, &ids).unwrap();
        let d = diff(&logits, &base).unwrap();
        assert_eq!(d.non_finite, 0, "{format}: non-finite logits");
        assert!(d.max_abs > 0.0, "{format}: no difference from f32");
        let agree = argmax_agreement(&logits, &base);
        println!(
            "tiny, {} prompt tokens, {format} vs f32 logits: max |diff| {:.3e} ({:.3e} of max |logit| {:.3e}), \
             argmax agreement {:.1}%",
            ids.len(),
            d.max_abs,
            d.relative(),
            d.scale,
            100.0 * agree
        );
        measured.push((d.max_abs, agree));
    }
    let [(f16_err, f16_agree), (mixed_err, _), (int4_err, _)] = measured[..] else {
        unreachable!()
    };
    for (what, err) in [("int4", mixed_err), ("int4:32", int4_err)] {
        assert!(
            f16_err * 20.0 < err,
            "f16 ({f16_err:.3e}) is not much closer to f32 than {what} ({err:.3e})"
        );
    }
    assert!(f16_agree >= 0.9, "f16 argmax agreement {f16_agree}");
}
