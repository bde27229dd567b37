//! A GGUF's weight matrices kept packed in the mapped file ([`reference::linear::Linear::Gguf`]) against the same
//! file with every tensor decoded to f32 in memory ([`WeightStore::open_expanded`]): on every committed GGUF the two
//! give the same logits bit for bit, for a prompt (the prompt path) and for the decode steps after it (the
//! matrix-vector path), and the packed store holds the file's blocks mapped instead of four bytes a weight. And on
//! random blocks of every ggml type, a packed matrix's products are those of its decoded values stored as f32, bit
//! for bit, whatever the shape and the token count.

use crate::common::testdata;
use candle_core::{DType, Device, Tensor};
use proptest::prelude::*;
use reference::gguf::GgmlType;
use reference::gguf::decode::{Decoder, dequantize_on, random_blocks};
use reference::gguf::types::ALL;
use reference::linear::{Elem, GgufMatrix, Linear, MappedMatrix, SharedMap};
use reference::schema::{Role, Schema};
use reference::taps::Taps;
use reference::weights::WeightStore;
use reference::{Model, RunOptions};
use std::path::PathBuf;

/// Every GGUF under testdata: the converter's f32 files and llama.cpp's quantized ones.
fn ggufs() -> Vec<PathBuf> {
    let mut out = vec![];
    for dir in ["gguf/models", "gguf/llamacpp"] {
        for entry in std::fs::read_dir(testdata().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "gguf") {
                out.push(path);
            }
        }
    }
    out.sort();
    assert!(out.len() >= 10, "the committed GGUFs: {out:?}");
    out
}

/// The logits of a 12-token prompt (longer than the matrix-vector limit) and of 4 greedy steps after it, as bits.
fn logits_bits(model: &Model) -> Vec<Vec<u32>> {
    let mut state = model.new_state().unwrap();
    let (opts, mut taps) = (RunOptions::default(), Taps::off());
    let mut ids: Vec<u32> = vec![3, 71, 200, 9, 411, 17, 5, 88, 301, 42, 7, 150];
    let vocab = model.config().vocab_size as u32;
    ids.iter_mut().for_each(|i| *i %= vocab);
    let mut out = vec![];
    for _ in 0..5 {
        let row: Vec<f32> = model
            .forward(&ids, &mut state, &opts, &mut taps)
            .unwrap()
            .to_vec1()
            .unwrap();
        let next = (0..row.len())
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap() as u32;
        out.push(row.iter().map(|v| v.to_bits()).collect());
        ids = vec![next];
    }
    out
}

#[test]
fn packed_matrices_give_the_expanded_logits_bit_for_bit() {
    for path in ggufs() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let config = reference::gguf::model_config(&path).unwrap();
        let packed = WeightStore::open(&path, DType::F32).unwrap();
        let expanded = WeightStore::open_expanded(&path, DType::F32).unwrap();
        // Every matrix of the packed store is a GGUF tensor's blocks, its type the one the store names.
        let mut kept = 0;
        for spec in Schema::new(&config).tensors() {
            let matrix = matches!(
                spec.role(),
                Role::Projection | Role::LmHead | Role::Embedding
            );
            if !matrix || (spec.role() == Role::LmHead && config.tie_word_embeddings) {
                continue;
            }
            let l = packed.linear(&spec).unwrap();
            assert!(matches!(l, Linear::Gguf(_)), "{name}: {spec:?} is {l:?}");
            assert_eq!(l.ggml_type(), packed.ggml_type(&spec), "{name}: {spec:?}");
            assert!(l.ggml_type().is_some());
            assert_eq!(expanded.linear(&spec).unwrap().ggml_type(), None);
            // The decoded matrix is the expanded tensor, and `load` decodes it too.
            let a = l
                .to_tensor()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let b = expanded
                .load(&spec)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&a) == bits(&b), "{name}: {spec:?} decoded");
            kept += 1;
        }
        assert!(kept > 0);
        let a = logits_bits(&Model::from_weights(config.clone(), &packed).unwrap());
        let b = logits_bits(&Model::from_weights(config.clone(), &expanded).unwrap());
        for (step, (x, y)) in a.iter().zip(&b).enumerate() {
            let same = x.iter().zip(y).filter(|(p, q)| p == q).count();
            assert!(
                x == y,
                "{name}: step {step}: {} of {} logits differ",
                x.len() - same,
                x.len()
            );
        }
        // Held: the packed store maps the file's matrices and owns only the small tensors; the expanded store
        // owns four bytes a weight.
        let hp = packed.model_held(&config).unwrap();
        let he = expanded.model_held(&config).unwrap();
        let file = std::fs::metadata(&path).unwrap().len();
        eprintln!("{name}: file {file} B; packed holds {hp:?}; expanded {he:?}");
        assert!(hp.mapped > 0 && hp.mapped <= file, "{name}: {hp:?}");
        assert!(hp.owned < he.owned / 4, "{name}: {hp:?} vs {he:?}");
        assert_eq!(he.mapped, 0);
    }
}

#[test]
fn f64_and_compressed_runs_of_a_gguf_decode_it_whole() {
    let path = testdata().join("gguf/llamacpp/tiny-tied.q4_k_m.gguf");
    let config = reference::gguf::model_config(&path).unwrap();
    let spec = Schema::new(&config).global(reference::schema::Param::EmbedTokens);
    let f64 = WeightStore::open(&path, DType::F64).unwrap();
    assert!(matches!(f64.linear(&spec).unwrap(), Linear::Dense(_)));
    assert_eq!(f64.ggml_type(&spec), None);
    let f32 = WeightStore::open(&path, DType::F32).unwrap();
    let l = f32.linear(&spec).unwrap();
    assert!(matches!(l, Linear::Gguf(_)));
    assert!(l.ggml_type().is_some());
    assert_eq!(l.ggml_type(), f32.ggml_type(&spec));
}

/// Every type the decoders read (the integer types have no values).
fn decodable() -> Vec<GgmlType> {
    ALL.into_iter()
        .filter(|ty| {
            !matches!(
                ty,
                GgmlType::I8 | GgmlType::I16 | GgmlType::I32 | GgmlType::I64
            )
        })
        .collect()
}

/// A `[rows, blocks · block]` GGUF matrix of random blocks of `ty` (finite values) at an odd offset of its buffer,
/// its rows (and when `reorder`, its columns) in a random order, against the same values decoded by the scalar
/// decoder and stored as f32 in those orders: `x Wᵀ` for `t` tokens must have the same bits both ways (the
/// matrix-vector kernel for few tokens, the prompt kernel or the blocked GEMM for more).
fn packed_product_is_the_decoded_one(
    ty: GgmlType,
    rows: usize,
    blocks: usize,
    t: usize,
    reorder: bool,
    seed: u64,
) -> Result<(), String> {
    let cols = blocks * ty.block_elems();
    let bytes = random_blocks(ty, rows * blocks, seed).map_err(|e| e.to_string())?;
    let mut stored = vec![0f32; rows * cols];
    dequantize_on(ty, &bytes, &mut stored, Decoder::Scalar).map_err(|e| e.to_string())?;
    let mut rng = seed | 1;
    let mut shuffled = |n: usize| {
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            order.swap(i, (rng % (i as u64 + 1)) as usize);
        }
        order
    };
    let row_order = shuffled(rows);
    let col_order = reorder.then(|| shuffled(cols));
    let mut f32_bytes = Vec::with_capacity(4 * rows * cols);
    for &s in &row_order {
        for c in 0..cols {
            let c = col_order.as_ref().map_or(c, |o| o[c]);
            f32_bytes.extend_from_slice(&stored[s * cols + c].to_le_bytes());
        }
    }
    let mut buf = vec![0u8];
    buf.extend_from_slice(&bytes);
    let packed = GgufMatrix::new(
        &SharedMap::from_vec(buf),
        1,
        ty,
        (rows, cols),
        Some(row_order),
        col_order,
    )
    .map_err(|e| e.to_string())?;
    let decoded = MappedMatrix::new(&SharedMap::from_vec(f32_bytes), 0, rows, cols, Elem::F32)
        .map_err(|e| e.to_string())?;
    let mut state = seed ^ 0x5555;
    let xs: Vec<f32> = (0..t * cols)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    let x = Tensor::from_vec(xs, (t, cols), &Device::Cpu).map_err(|e| e.to_string())?;
    let bits = |y: candle_core::Tensor| -> Vec<u32> {
        let v: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
        v.iter().map(|v| v.to_bits()).collect()
    };
    let a = bits(packed.forward(&x).map_err(|e| e.to_string())?);
    let b = bits(decoded.forward(&x).map_err(|e| e.to_string())?);
    if a != b {
        let differ = a.iter().zip(&b).filter(|(p, q)| p != q).count();
        return Err(format!(
            "{ty} [{rows}, {cols}] T={t} reorder {reorder} seed {seed}: {differ} of {} outputs differ",
            a.len()
        ));
    }
    // The decoded rows are the values too (lookups and the GEMM path read them).
    let whole = bits(packed.to_tensor().map_err(|e| e.to_string())?);
    let expected = bits(decoded.to_tensor().map_err(|e| e.to_string())?);
    if whole != expected {
        return Err(format!("{ty} [{rows}, {cols}]: the decoded matrix differs"));
    }
    Ok(())
}

/// Every type, few and many tokens, shapes that fill no tile (the kernels' rows, tokens and 32-value steps).
#[test]
fn a_packed_product_of_every_type_is_the_decoded_product_bit_for_bit() {
    for (k, ty) in decodable().into_iter().enumerate() {
        // Blocks of one value: columns that leave a tail of the 32-value steps.
        let blocks = if ty.block_elems() == 1 { 75 } else { 3 };
        for (rows, t, reorder) in [(7, 1, false), (5, 3, true), (13, 9, false), (6, 37, true)] {
            let seed = k as u64 * 31 + t as u64;
            packed_product_is_the_decoded_one(ty, rows, blocks, t, reorder, seed).unwrap();
        }
        // Rows of more than 4096 values: the matrix-vector product decodes them a segment at a time (the last one
        // partial, with the `n mod 32` tail for one-value blocks).
        let wide = 4100usize.div_ceil(ty.block_elems());
        for (t, reorder) in [(1, false), (5, false), (2, true)] {
            let seed = k as u64 * 7 + t as u64;
            packed_product_is_the_decoded_one(ty, 3, wide, t, reorder, seed).unwrap();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn a_packed_product_is_the_decoded_product_bit_for_bit(
        which in 0usize..31,
        rows in 1usize..20,
        blocks in 1usize..5,
        t in prop::sample::select(vec![1usize, 2, 5, 8, 9, 16, 33]),
        reorder in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let types = decodable();
        let ty = types[which % types.len()];
        let blocks = if ty.block_elems() == 1 { blocks * 29 } else { blocks };
        packed_product_is_the_decoded_one(ty, rows, blocks, t, reorder, seed)
            .map_err(TestCaseError::fail)?;
    }
}
