use super::*;
use proptest::prelude::*;

pub(crate) use super::write;

pub(crate) fn string_value(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

fn sample() -> Vec<u8> {
    let mut array = 4u32.to_le_bytes().to_vec();
    array.extend_from_slice(&3u64.to_le_bytes());
    for x in [1u32, 2, 3] {
        array.extend_from_slice(&x.to_le_bytes());
    }
    let mut strings = 8u32.to_le_bytes().to_vec();
    strings.extend_from_slice(&2u64.to_le_bytes());
    strings.extend(string_value("a"));
    strings.extend(string_value("bc"));
    let f32s: Vec<u8> = (0..12).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let q8: Vec<u8> = (0..2 * 34).map(|i| i as u8).collect();
    write(
        &[
            ("general.architecture", 8, string_value("qwen35")),
            ("x.u32", 4, 7u32.to_le_bytes().to_vec()),
            ("x.f32", 6, 0.5f32.to_le_bytes().to_vec()),
            ("x.bool", 7, vec![1]),
            ("x.i64", 11, (-3i64).to_le_bytes().to_vec()),
            ("x.f64", 12, 2.5f64.to_le_bytes().to_vec()),
            ("x.u8", 0, vec![9]),
            ("x.arr", 9, array),
            ("x.strs", 9, strings),
        ],
        &[
            ("a", vec![3, 4], GgmlType::F32, f32s),
            ("b", vec![32, 2], GgmlType::Q8_0, q8),
        ],
        32,
    )
}

#[test]
fn a_written_file_reads_back() {
    let h = parse(&sample()).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.metadata[0].1, Value::String("qwen35".into()));
    assert_eq!(h.metadata[2].1, Value::F32(0.5));
    assert_eq!(h.metadata[4].1, Value::I64(-3));
    assert_eq!(
        h.metadata[7].1,
        Value::Array(vec![Value::U32(1), Value::U32(2), Value::U32(3)])
    );
    assert_eq!(
        h.metadata[8].1,
        Value::Array(vec![Value::String("a".into()), Value::String("bc".into())])
    );
    assert_eq!(h.tensors[0].torch_shape(), vec![4, 3]);
    assert_eq!(h.tensors[0].len, 48);
    assert_eq!(h.tensors[1].len, 68);
    assert_eq!(h.tensors[0].start, h.data_offset);
    assert_eq!(h.tensors[1].start, h.data_offset + 64);
    assert_eq!(h.data_offset % 32, 0);
}

#[test]
fn malformed_files_are_named_errors() {
    let good = sample();
    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    assert!(parse(&bad_magic).unwrap_err().contains("magic"));
    let mut v1 = good.clone();
    v1[4] = 1;
    assert!(parse(&v1).unwrap_err().contains("version 1"));
    let mut huge = good.clone();
    huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(parse(&huge).unwrap_err().contains("tensor count"));
    assert!(
        parse(&good[..good.len() - 1])
            .unwrap_err()
            .contains("past the file's end")
    );
    // A Q8_0 row of 33 elements is not whole blocks.
    let odd = write(&[], &[("q", vec![33], GgmlType::Q8_0, vec![0; 34])], 32);
    assert!(parse(&odd).unwrap_err().contains("whole number"));
    // A removed type id.
    let mut removed = write(&[], &[("t", vec![32], GgmlType::Q4_0, vec![0; 18])], 32);
    // The type follows the header (24), the name (8 + 1), the dimension count (4) and one dimension (8).
    let at = 24 + 9 + 4 + 8;
    removed[at..at + 4].copy_from_slice(&4u32.to_le_bytes());
    assert!(
        parse(&removed).unwrap_err().contains("Q4_2"),
        "{:?}",
        parse(&removed)
    );
}

#[test]
fn overlapping_tensors_are_refused() {
    let mut file = write(
        &[],
        &[
            ("a", vec![16], GgmlType::F32, vec![0; 64]),
            ("b", vec![16], GgmlType::F32, vec![0; 64]),
        ],
        32,
    );
    // Point `b` at `a`'s second half.
    let text = file.clone();
    let b_at = text
        .windows(1 + 8)
        .position(|w| w == b"\x01\x00\x00\x00\x00\x00\x00\x00b")
        .unwrap()
        + 9;
    let offset_at = b_at + 4 + 8 + 4;
    file[offset_at..offset_at + 8].copy_from_slice(&32u64.to_le_bytes());
    assert!(parse(&file).unwrap_err().contains("overlap"));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any prefix of a valid file, and any byte of it changed, gives a header or an error, never a panic; a
    /// strict prefix that cuts into the header or the data is always an error.
    #[test]
    fn truncated_or_corrupted_files_are_errors_never_panics(cut in 0usize..400, at in 0usize..400, byte: u8) {
        let good = sample();
        let cut = cut.min(good.len() - 1);
        prop_assert!(parse(&good[..cut]).is_err());
        let mut bad = good.clone();
        let at = at % good.len();
        bad[at] = byte;
        let _ = parse(&bad);
    }
}
