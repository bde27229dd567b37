use super::layout::*;
use super::*;
use crate::gguf::types::GgmlType;
use proptest::prelude::*;

const HEADS: Heads = Heads {
    hk: 2,
    hv: 6,
    dk: 3,
    dv: 2,
};

/// The converter's reorder (`_reorder_v_heads`): `[Hk, r, d]` → `[r, Hk, d]` along the rows.
fn tile_rows(values: &[f32], cols: usize, heads: Heads, rows_per_head: usize) -> Vec<f32> {
    let r = heads.hv / heads.hk;
    let head = rows_per_head * cols;
    let mut out = values.to_vec();
    for k in 0..heads.hk {
        for j in 0..r {
            let from = (k * r + j) * head;
            let to = (j * heads.hk + k) * head;
            out[to..to + head].copy_from_slice(&values[from..from + head]);
        }
    }
    out
}

fn iota(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32).collect()
}

#[test]
fn value_heads_go_back_to_their_groups() {
    // Six value heads of one value each: key head 0 owns checkpoint heads 0, 1, 2 and key head 1 heads 3, 4, 5;
    // llama.cpp tiles them as 0, 3, 1, 4, 2, 5.
    let mut gguf = vec![0., 3., 1., 4., 2., 5.];
    ungroup_rows(&mut gguf, 1, HEADS, 1);
    assert_eq!(gguf, iota(6));
    let checkpoint = iota(6 * 2 * 5);
    let mut values = tile_rows(&checkpoint, 5, HEADS, 2);
    assert_ne!(values, checkpoint);
    ungroup_rows(&mut values, 5, HEADS, 2);
    assert_eq!(values, checkpoint);
}

#[test]
fn qkv_keeps_query_and_key_rows_and_reorders_the_values() {
    let cols = 4;
    let qk = 2 * HEADS.hk * HEADS.dk;
    let checkpoint = iota((qk + HEADS.hv * HEADS.dv) * cols);
    let mut gguf = checkpoint[..qk * cols].to_vec();
    gguf.extend(tile_rows(&checkpoint[qk * cols..], cols, HEADS, HEADS.dv));
    let shape = [qk + HEADS.hv * HEADS.dv, cols];
    assert_eq!(
        undo(Layout::QkvRows, &mut gguf, &shape, HEADS).unwrap(),
        shape
    );
    assert_eq!(gguf, checkpoint);
}

#[test]
fn the_convolution_is_unsqueezed_and_its_value_channels_reordered() {
    let k = 4;
    let qk = 2 * HEADS.hk * HEADS.dk;
    let channels = qk + HEADS.hv * HEADS.dv;
    let checkpoint = iota(channels * k);
    let mut gguf = checkpoint[..qk * k].to_vec();
    gguf.extend(tile_rows(&checkpoint[qk * k..], k, HEADS, HEADS.dv));
    let shape = undo(Layout::Conv, &mut gguf, &[channels, k], HEADS).unwrap();
    assert_eq!(shape, vec![channels, 1, k]);
    assert_eq!(gguf, checkpoint);
}

#[test]
fn out_proj_columns_are_reordered() {
    let rows = 3;
    let cols = HEADS.hv * HEADS.dv;
    let checkpoint = iota(rows * cols);
    let mut gguf: Vec<f32> = checkpoint
        .chunks(cols)
        .flat_map(|row| tile_rows(row, 1, HEADS, HEADS.dv))
        .collect();
    undo(Layout::ValueColumns, &mut gguf, &[rows, cols], HEADS).unwrap();
    assert_eq!(gguf, checkpoint);
}

#[test]
fn nothing_moves_when_key_and_value_heads_are_as_many() {
    let heads = Heads { hv: 2, ..HEADS };
    let mut values = vec![1., 2.];
    ungroup_rows(&mut values, 1, heads, 1);
    assert_eq!(values, [1., 2.]);
}

#[test]
fn a_bad_shape_is_an_error() {
    let mut v = vec![0.; 10];
    assert!(
        undo(Layout::ValueRows, &mut v, &[5, 2], HEADS)
            .unwrap_err()
            .contains("rows")
    );
}

/// The shared expert's gate `[1, H]`: the converter writes `ne = [H, 1]`, `llama-quantize` a 1-D `[H]` (every
/// quantized Qwen3.5-MoE GGUF of llama.cpp 0c1e570: `testdata/gguf/llamacpp/tiny-moe-gguf.q8_0.gguf`); both are
/// the checkpoint's `[1, H]`, values unmoved, and a matrix of more rows is refused.
#[test]
fn the_shared_expert_gate_is_one_row_whether_stored_1d_or_2d() {
    assert_eq!(
        target("blk.2.ffn_gate_inp_shexp.weight", 4),
        Ok(Target::One(
            "model.layers.2.mlp.shared_expert_gate.weight".into(),
            Layout::OneRow
        ))
    );
    for shape in [&[5][..], &[1, 5]] {
        let mut v = iota(5);
        assert_eq!(undo(Layout::OneRow, &mut v, shape, HEADS), Ok(vec![1, 5]));
        assert_eq!(v, iota(5));
    }
    let e = undo(Layout::OneRow, &mut iota(10), &[2, 5], HEADS).unwrap_err();
    assert!(e.contains("[2, 5]") && e.contains("one row"), "{e}");
}

#[test]
fn a_positive_decay_is_an_error() {
    assert!(a_log(&mut [0.5]).unwrap_err().contains("negative"));
    assert!(a_log(&mut [f32::NEG_INFINITY]).is_err());
}

#[test]
fn mtp_layers_are_skipped_and_unknown_names_refused() {
    assert_eq!(target("blk.4.attn_norm.weight", 4), Ok(Target::Skip));
    assert!(target("blk.0.in_proj_qkvz.weight", 4).is_err());
    assert!(target("rope_freqs.weight", 4).is_err());
    assert_eq!(
        target("blk.1.ssm_a", 4),
        Ok(Target::One(
            "model.layers.1.linear_attn.A_log".into(),
            Layout::Decay
        ))
    );
}

/// A value's GGUF type id and bytes.
fn encode(v: &Value) -> (u32, Vec<u8>) {
    match v {
        Value::U8(x) => (0, vec![*x]),
        Value::I8(x) => (1, x.to_le_bytes().to_vec()),
        Value::U16(x) => (2, x.to_le_bytes().to_vec()),
        Value::I16(x) => (3, x.to_le_bytes().to_vec()),
        Value::U32(x) => (4, x.to_le_bytes().to_vec()),
        Value::I32(x) => (5, x.to_le_bytes().to_vec()),
        Value::F32(x) => (6, x.to_le_bytes().to_vec()),
        Value::Bool(x) => (7, vec![u8::from(*x)]),
        Value::String(s) => (8, crate::gguf::file::tests::string_value(s)),
        Value::Array(items) => {
            let item = items.first().map_or(4, |i| encode(i).0);
            let mut out = item.to_le_bytes().to_vec();
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                out.extend(encode(i).1);
            }
            (9, out)
        }
        Value::U64(x) => (10, x.to_le_bytes().to_vec()),
        Value::I64(x) => (11, x.to_le_bytes().to_vec()),
        Value::F64(x) => (12, x.to_le_bytes().to_vec()),
    }
}

/// The tiny models' GGUF rewritten without the metadata key `drop`, opened from a temporary file.
fn without(name: &str, drop: &str) -> (tempfile::TempDir, GgufFile) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../testdata/gguf/models/{name}-f32.gguf"));
    let file = GgufFile::open(&path).unwrap();
    let meta: Vec<(&str, u32, Vec<u8>)> = file
        .metadata
        .iter()
        .filter(|(k, _)| k != drop)
        .map(|(k, v)| {
            let (ty, bytes) = encode(v);
            (k.as_str(), ty, bytes)
        })
        .collect();
    let tensors: Vec<(&str, Vec<u64>, GgmlType, Vec<u8>)> = file
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.as_str(),
                t.dims.clone(),
                t.ty,
                file.bytes(t).to_vec(),
            )
        })
        .collect();
    let bytes = crate::gguf::file::tests::write(&meta, &tensors, file.alignment);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m.gguf");
    std::fs::write(&out, bytes).unwrap();
    let reopened = GgufFile::open(&out).unwrap();
    (dir, reopened)
}

#[test]
fn every_key_the_math_reads_is_required_and_named_when_missing() {
    for (name, arch) in [("tiny", "qwen35"), ("tiny-moe", "qwen35moe")] {
        let (_dir, whole) = without(name, "");
        config(&whole).unwrap();
        let mut required = vec!["general.architecture".to_string()];
        for suffix in [
            "block_count",
            "embedding_length",
            "attention.head_count",
            "attention.head_count_kv",
            "attention.key_length",
            "attention.value_length",
            "ssm.time_step_rank",
            "ssm.inner_size",
            "ssm.group_count",
            "ssm.state_size",
            "ssm.conv_kernel",
            "attention.layer_norm_rms_epsilon",
            "context_length",
            "rope.dimension_count",
            "rope.freq_base",
        ] {
            required.push(format!("{arch}.{suffix}"));
        }
        let own: &[&str] = if arch == "qwen35moe" {
            &[
                "expert_count",
                "expert_used_count",
                "expert_feed_forward_length",
                "expert_shared_feed_forward_length",
            ]
        } else {
            &["feed_forward_length"]
        };
        required.extend(own.iter().map(|s| format!("{arch}.{s}")));
        for key in &required {
            let (_dir, file) = without(name, key);
            let e = config(&file).unwrap_err().to_string();
            assert!(e.contains(key.as_str()), "{name} without {key}: {e}");
        }
        // The layer kinds: the recurrent layers' list, else the interval; neither is an error naming both.
        let (_dir, file) = without(name, &format!("{arch}.attention.recurrent_layers"));
        assert_eq!(config(&file).unwrap(), config(&whole).unwrap());
    }
}

proptest! {
    /// `1 + w` rounded to f32 and then `- 1` gives back a `w'` whose `1 + w'` is the GGUF's value exactly: the
    /// reference's norm scale is llama.cpp's, bit for bit.
    #[test]
    fn plus_one_round_trips_to_the_same_scale(w in -4.0f32..4.0) {
        let g = w + 1.0;
        let mut v = [g];
        minus_one(&mut v);
        prop_assert_eq!((v[0] + 1.0).to_bits(), g.to_bits());
    }

    /// The `A_log` found gives back `ssm_a` exactly under the reference's `-exp`.
    #[test]
    fn a_log_gives_back_the_decay(x in -6.0f32..3.0) {
        let a = -x.exp();
        let mut v = [a];
        a_log(&mut v).unwrap();
        prop_assert_eq!(-v[0].exp(), a);
    }
}
