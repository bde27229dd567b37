//! The decoders of every ggml tensor type against ggml's own: `testdata/gguf/decode/<type>.safetensors` holds random
//! valid blocks and the values ggml's C decoders give them (scripts/make_gguf_decode_vectors.py, which also checks
//! the `gguf` Python package's decoders against them). Every value must have the same f32 bits, from every decoder
//! the CPU runs ([`Decoder`]).

use reference::gguf::decode::{Decoder, dequantize, dequantize_on};
use reference::gguf::types::{ALL, GgmlType};
use safetensors::SafeTensors;

use crate::common::testdata;

/// The types with vectors: every type but the integer ones and F64 (not weights' types).
fn decodable() -> impl Iterator<Item = GgmlType> {
    ALL.into_iter().filter(|ty| {
        !matches!(
            ty,
            GgmlType::I8 | GgmlType::I16 | GgmlType::I32 | GgmlType::I64 | GgmlType::F64
        )
    })
}

#[test]
fn every_type_decodes_as_ggml_does_bit_for_bit() {
    let mut checked = Vec::new();
    for ty in decodable() {
        let name = vector_name(ty);
        let path = testdata()
            .join("gguf/decode")
            .join(format!("{name}.safetensors"));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let meta = meta.metadata().clone().unwrap();
        assert_eq!(meta["type_id"], ty.id().to_string(), "{name}");
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let blocks = file.tensor("blocks").unwrap();
        assert_eq!(blocks.shape()[1], ty.block_bytes(), "{name}");
        let expected: Vec<f32> = file
            .tensor("values")
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(
            expected.len(),
            blocks.shape()[0] * ty.block_elems(),
            "{name}"
        );
        // Every decoder this CPU runs (the scalar one everywhere), each held to ggml's bits.
        for decoder in [Decoder::Scalar, Decoder::Avx2] {
            if !decoder.available() {
                continue;
            }
            let mut got = vec![f32::NAN; expected.len()];
            dequantize_on(ty, blocks.data(), &mut got, decoder).unwrap();
            if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != expected[i].to_bits()) {
                panic!(
                    "{name} (ggml's decoder {}, ours {decoder:?}): value {i} (block {}) is {:e} ({:#010x}), \
                     ggml's is {:e} ({:#010x})",
                    meta["decoder"],
                    i / ty.block_elems(),
                    got[i],
                    got[i].to_bits(),
                    expected[i],
                    expected[i].to_bits()
                );
            }
        }
        checked.push(name);
    }
    // Every vector file is checked: none left behind by a type this test does not know.
    let files = std::fs::read_dir(testdata().join("gguf/decode"))
        .unwrap()
        .count();
    assert_eq!(files, checked.len(), "{checked:?}");
}

/// The file name of a type's vectors: ggml's name as the `gguf` package spells it (`Q4_K`, `IQ2_XXS`, `BF16`).
fn vector_name(ty: GgmlType) -> String {
    ty.name().to_uppercase()
}

/// Decode speed per type, one thread, rows of 4096 values decoded one at a time (as a store of packed weights
/// would): `cargo test --release -p reference --test all gguf_decode_speed -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn gguf_decode_speed() {
    const ROW: usize = 4096;
    const ROWS: usize = 2048;
    for ty in decodable() {
        let row_bytes = ROW / ty.block_elems() * ty.block_bytes();
        // Blocks repeated from the vectors (valid, finite scales).
        let path = testdata()
            .join("gguf/decode")
            .join(format!("{}.safetensors", vector_name(ty)));
        let bytes = std::fs::read(&path).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let blocks = file.tensor("blocks").unwrap().data().to_vec();
        let packed: Vec<u8> = blocks
            .iter()
            .copied()
            .cycle()
            .take(row_bytes * ROWS)
            .collect();
        let mut row = vec![0f32; ROW];
        let mut sink = 0f32;
        let start = std::time::Instant::now();
        for r in 0..ROWS {
            dequantize(ty, &packed[r * row_bytes..][..row_bytes], &mut row).unwrap();
            sink += row[r % ROW];
        }
        let secs = start.elapsed().as_secs_f64();
        println!(
            "{:8} {:7.1} Mvalues/s  {:7.1} MB/s packed in  {:7.1} MB/s f32 out{}",
            vector_name(ty),
            (ROW * ROWS) as f64 / secs / 1e6,
            (row_bytes * ROWS) as f64 / secs / 1e6,
            (4 * ROW * ROWS) as f64 / secs / 1e6,
            if sink.is_nan() { " " } else { "" }
        );
    }
}

/// The decoders on files llama.cpp's quantizer wrote, against what llama.cpp's CPU back end computed from them: the
/// model's first op looks up the prompt's rows of `token_embd.weight` (`ggml_get_rows`, which decodes each row with
/// ggml's `to_float`), and `testdata/gguf/llamacpp/<model>.<type>.dump.safetensors` holds the result
/// (`model.input_embed`, [T, hidden]). Decoding the same rows of the committed GGUF must give the same bits.
#[test]
fn the_embedding_rows_llama_cpp_looked_up_decode_to_the_same_bits() {
    use reference::gguf::file::GgufFile;
    let dir = testdata().join("gguf/llamacpp");
    let mut checked = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    entries.sort();
    for path in entries {
        let gguf = GgufFile::open(&path).unwrap();
        let embd = gguf.tensor("token_embd.weight").expect("token_embd.weight");
        let dump_path = path.with_extension("dump.safetensors");
        let dump_bytes = std::fs::read(&dump_path).unwrap();
        let dump = SafeTensors::deserialize(&dump_bytes).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&dump_bytes).unwrap();
        let tokens: Vec<usize> =
            serde_json::from_str(&meta.metadata().as_ref().unwrap()["token_ids"]).unwrap();
        let looked_up = dump.tensor("model.input_embed").unwrap();
        let hidden = embd.dims[0] as usize;
        assert_eq!(
            looked_up.shape(),
            [tokens.len(), hidden],
            "{}",
            path.display()
        );
        let row_bytes = embd.ty.row_bytes(hidden as u64).unwrap() as usize;
        let all = gguf.bytes(embd);
        let mut row = vec![0f32; hidden];
        for (t, &token) in tokens.iter().enumerate() {
            dequantize(embd.ty, &all[token * row_bytes..][..row_bytes], &mut row).unwrap();
            let theirs = &looked_up.data()[4 * hidden * t..4 * hidden * (t + 1)];
            for (i, (ours, b)) in row.iter().zip(theirs.chunks_exact(4)).enumerate() {
                let theirs = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                assert_eq!(
                    ours.to_bits(),
                    theirs.to_bits(),
                    "{} ({}): token {token} value {i}: ours {ours:e}, llama.cpp's {theirs:e}",
                    path.display(),
                    embd.ty
                );
            }
        }
        checked.push(embd.ty);
    }
    // The committed files' embeddings are of these types (Q4_K_M and Q6_K fall back to Q5_0 or Q8_0 on rows of 32
    // or 64 elements; tiny-tied keeps its tied embedding in Q8_0 in every quantized file; the untied embedding of
    // tiny-moe-gguf is Q4_0 in its Q4_0 file, the one Q4_0 embedding).
    checked.sort();
    checked.dedup();
    use GgmlType::*;
    assert_eq!(checked, [F32, Q4_0, Q5_0, Q8_0, IQ4_NL]);
}
