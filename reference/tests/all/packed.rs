//! Compressed weights in f32 runs: the store hands out quantised matrices as their codes and scales
//! ([`Linear::Packed`]) and f16-rounded ones as f16 ([`Linear::Mapped`]), never as a whole f32 copy; every product
//! and lookup computes what the dequantised (or rounded) dense weights give.

use crate::common::*;
use crate::quant::values;
use candle_core::{DType, Device, Tensor};
use reference::Error;
use reference::config::Config;
use reference::linear::{
    Elem, Linear, MATVEC_MAX_TOKENS, MappedMatrix, PromptKernel, SharedMap, matvec,
};
use reference::quant::{Storage, WeightFormat};
use reference::schema::{Param, Schema};
use reference::synthetic::{random_weights, small_config_json, write_safetensors};
use reference::weights::WeightStore;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Deterministic inputs in [-1, 1).
fn inputs(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Every matrix of the bf16 (tiny-full) and f32 (tiny, tied) checkpoints under each compressed format: the kind of
/// `Linear` the store gives, its values (the dequantised or rounded ones `load` serves, bit for bit), its codes (those
/// of `quantized`), the lookup, and the products: bit for bit the f32 matvec on the dense values for T ≤ 8, candle's
/// product of the dense values above.
#[test]
fn compressed_matrices_are_held_compact_and_compute_the_dense_values() {
    for model in ["tiny-full", "tiny-tied"] {
        let dir = testdata().join("models").join(model);
        let config = Config::from_file(&dir.join("config.json")).unwrap();
        for format in ["int4", "int4:32", "int4-nncf:16", "f16"] {
            let format = WeightFormat::parse(format).unwrap();
            let store = WeightStore::open_with_format(&dir, DType::F32, format).unwrap();
            let wide = WeightStore::open_with_format(&dir, DType::F64, format).unwrap();
            let mut packed = 0;
            for spec in Schema::new(&config).tensors() {
                let &[rows, cols] = spec.shape.as_slice() else {
                    continue;
                };
                let what = format!("{model} {format} {}", spec.name);
                let dense = store.load(&spec).unwrap();
                let dense_values = values(&dense);
                let linear = store.linear(&spec).unwrap();
                match (store.storage(&spec), &linear) {
                    (Storage::Int4Sym { .. } | Storage::Int8Sym, Linear::Packed(p)) => {
                        packed += 1;
                        let q = store.quantized(&spec).unwrap().unwrap();
                        assert_eq!(p.to_quantized().unwrap(), q, "{what}");
                        assert_eq!(p.kind(), q.kind(), "{what}");
                        let code_bytes = rows * (cols * q.kind().bits() as usize).div_ceil(8);
                        assert_eq!(p.held_bytes(), code_bytes + 2 * q.scales().len(), "{what}");
                        assert_eq!(store.read_in_place_bytes(&spec).unwrap(), None);
                    }
                    (Storage::F16, Linear::Mapped(m)) => {
                        assert_eq!(m.elem(), Elem::F16, "{what}");
                        assert_eq!(store.read_in_place_bytes(&spec).unwrap(), Some(2));
                    }
                    (storage, other) => panic!("{what}: {storage:?} held as {other:?}"),
                }
                // An f64 run keeps the dense tensor.
                assert!(
                    matches!(wide.linear(&spec).unwrap(), Linear::Dense(_)),
                    "{what}"
                );
                assert_eq!(
                    bits(&values(&linear.to_tensor().unwrap())),
                    bits(&dense_values),
                    "{what}"
                );
                let ids = [0u32, (rows - 1) as u32, (rows / 2) as u32];
                let looked = values(&linear.gather(&ids).unwrap());
                for (k, &id) in ids.iter().enumerate() {
                    let r = id as usize;
                    assert_eq!(
                        bits(&looked[k * cols..(k + 1) * cols]),
                        bits(&dense_values[r * cols..(r + 1) * cols]),
                        "{what} row {r}"
                    );
                }
                assert!(linear.gather(&[rows as u32]).is_err(), "{what}");
                let f32_bytes: Vec<u8> =
                    dense_values.iter().flat_map(|v| v.to_le_bytes()).collect();
                let as_f32 =
                    MappedMatrix::new(&SharedMap::from_vec(f32_bytes), 0, rows, cols, Elem::F32)
                        .unwrap();
                for t in [1, 2, 3, 5, 8, MATVEC_MAX_TOKENS + 3] {
                    let x = inputs(t * cols, 3 + t as u64);
                    let xt = Tensor::from_vec(x.clone(), (t, cols), &Device::Cpu).unwrap();
                    let y = values(&linear.forward(&xt).unwrap());
                    // A prompt on mapped or packed weights runs the prompt kernel where the CPU has it: the
                    // matvec's sums.
                    let prompt_kernel = matches!(linear, Linear::Mapped(_) | Linear::Packed(_))
                        && PromptKernel::detect() == PromptKernel::Avx512;
                    let expected = if t <= MATVEC_MAX_TOKENS || prompt_kernel {
                        matvec(&as_f32, &x, t)
                    } else {
                        values(&reference::ops::linear(&xt, &dense).unwrap())
                    };
                    assert_eq!(bits(&y), bits(&expected), "{what} T={t}");
                }
            }
            if format == WeightFormat::F16 {
                assert_eq!(packed, 0);
            } else {
                assert!(packed > 0, "{model} {format}: nothing packed");
            }
        }
    }
}

/// A quantised projection takes half a byte a weight (int4) plus its scales, an int8 one a byte.
#[test]
fn packed_matrices_hold_their_codes_compactly() {
    let dir = testdata().join("models/tiny-full");
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let s = Schema::new(&config);
    let store =
        WeightStore::open_with_format(&dir, DType::F32, WeightFormat::Int4Sym { group: 32 })
            .unwrap();
    let down = s.layer(0, Param::DownProj);
    let Linear::Packed(p) = store.linear(&down).unwrap() else {
        panic!("down_proj is not packed");
    };
    let [rows, cols] = [down.shape[0], down.shape[1]];
    assert_eq!(p.held_bytes(), rows * cols / 2 + 2 * rows * cols / 32);
    let embed = s.global(Param::EmbedTokens);
    let Linear::Packed(e) = store.linear(&embed).unwrap() else {
        panic!("the embedding is not packed");
    };
    assert_eq!(
        e.held_bytes(),
        embed.shape[0] * embed.shape[1] + 2 * embed.shape[0]
    );
}

/// A weight that cannot be quantised (NaN) is refused when the packed matrix is built, naming the file and tensor.
#[test]
fn packing_a_bad_weight_names_the_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let text = small_config_json().to_string();
    std::fs::write(tmp.path().join("config.json"), &text).unwrap();
    let config = Config::from_json_str(&text, "config.json").unwrap();
    let up = Schema::new(&config).layer(0, Param::UpProj);
    let mut weights = random_weights(&config, "model.", 5).unwrap();
    let name = up.full_name("model.");
    let mut w = values(&weights[&name]);
    let last = w.len() - 1;
    w[last] = f32::INFINITY;
    weights.insert(
        name.clone(),
        Tensor::from_vec(w, up.shape.as_slice(), &Device::Cpu).unwrap(),
    );
    write_safetensors(&tmp.path().join("model.safetensors"), &weights, DType::F32).unwrap();
    let store =
        WeightStore::open_with_format(tmp.path(), DType::F32, WeightFormat::Int4Sym { group: 8 })
            .unwrap();
    let e = store.linear(&up).unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(e, Error::Weights { .. })
            && text.contains("model.safetensors")
            && text.contains(&name)
            && text.contains("non-finite"),
        "{text}"
    );
    // f16 rounds it (to the largest f16, as the exporter clamps) instead.
    let store = WeightStore::open_with_format(tmp.path(), DType::F32, WeightFormat::F16).unwrap();
    let m = store.linear(&up).unwrap().to_tensor().unwrap();
    assert_eq!(*values(&m).last().unwrap(), 65504.0);
}
