//! Property test: a dump file cut short, with any byte changed, or with a header claiming other lengths is read or
//! refused with an error naming the file, never a panic (nor an allocation the file's size does not back); and a
//! dump that reads is compared by `diff` or refused, never a panic.

use candle_core::{Device, Tensor};
use parity::dump::Dump;
use proptest::prelude::*;
use std::collections::BTreeMap;

/// The bytes of a small dump: ids, logits, a tap and a state.
fn dump_bytes() -> Vec<u8> {
    let dev = Device::Cpu;
    let mut tensors = BTreeMap::new();
    tensors.insert(
        "token_ids".to_string(),
        Tensor::new(&[1i64, 2, 3], &dev).unwrap(),
    );
    tensors.insert("generated".to_string(), Tensor::new(&[4i64], &dev).unwrap());
    tensors.insert(
        "logits".to_string(),
        Tensor::arange(0f32, 24.0, &dev)
            .unwrap()
            .reshape((3, 8))
            .unwrap(),
    );
    tensors.insert(
        "layers.0.output".to_string(),
        Tensor::ones((3, 4), candle_core::DType::F32, &dev).unwrap(),
    );
    tensors.insert(
        "layers.0.recurrent_state".to_string(),
        Tensor::zeros((2, 2, 2), candle_core::DType::F32, &dev).unwrap(),
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.safetensors");
    Dump {
        tensors,
        metadata: BTreeMap::from([("backend".to_string(), "reference".to_string())]),
    }
    .write(&path)
    .unwrap();
    std::fs::read(&path).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(384))]

    #[test]
    fn a_corrupted_dump_is_read_or_refused(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in any::<prop::sample::Index>(),
        header_len in prop_oneof![Just(None), any::<u64>().prop_map(Some)],
    ) {
        let mut bytes = dump_bytes();
        for (at, b) in &edits {
            let i = at.index(bytes.len());
            bytes[i] = *b;
        }
        if let Some(n) = header_len {
            bytes[..8].copy_from_slice(&n.to_le_bytes());
        }
        bytes.truncate(cut.index(bytes.len() + 1).max(if edits.is_empty() { 0 } else { 1 }));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        match Dump::read(&path) {
            Ok(d) => {
                // What reads must be usable by the comparison: the binary's diff of it against itself ends with a
                // verdict or an error, never a panic.
                if d.tensors.contains_key("logits") {
                    let o = std::process::Command::new(env!("CARGO_BIN_EXE_qwen35"))
                        .arg("diff")
                        .arg(&path)
                        .arg(&path)
                        .output()
                        .unwrap();
                    let err = String::from_utf8_lossy(&o.stderr);
                    prop_assert!(!err.contains("panicked"), "{}", err);
                    prop_assert!(matches!(o.status.code(), Some(0..=2)), "{:?}", o.status);
                }
            }
            Err(e) => prop_assert!(format!("{e:#}").contains("x.safetensors"), "{e:#}"),
        }
    }
}
