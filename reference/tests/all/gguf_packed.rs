//! A GGUF's weight matrices kept packed in the mapped file ([`reference::linear::Linear::Gguf`]) against the same
//! file with every tensor decoded to f32 in memory ([`WeightStore::open_expanded`]): on every committed GGUF the two
//! give the same logits bit for bit, for a prompt (the prompt path) and for the decode steps after it (the
//! matrix-vector path), and the packed store holds the file's blocks mapped instead of four bytes a weight.

use crate::common::testdata;
use candle_core::DType;
use reference::linear::Linear;
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
