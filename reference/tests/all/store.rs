//! The weight store and the schema: the schema names exactly what the checkpoints hold, the compression rule by
//! role, what the store serves under each format, its errors, and whole-model runs on compressed weights.

use crate::common::*;
use crate::goldens::load_golden;
use crate::quant::values;
use candle_core::{DType, Tensor};
use half::f16;
use reference::compare::diff;
use reference::config::Config;
use reference::model::{Model, RunOptions, argmax};
use reference::quant::{QuantKind, Storage, WeightFormat};
use reference::schema::{Param, Role, Schema, TensorSpec};
use reference::synthetic::{random_weights, small_config_json, write_safetensors};
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
