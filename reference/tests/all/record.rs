//! A run record survives a dump's metadata: `from_metadata(to_metadata(r)) == r` for every field, and a value that
//! does not parse is an error naming its key.

use reference::backend::{Precision, RunRecord};
use std::collections::BTreeMap;

fn device_record() -> RunRecord {
    RunRecord {
        backend: "openvino".into(),
        device: Some("NPU".into()),
        runtime: Some("2026.4.1-22982".into()),
        device_name: Some("Intel(R) AI Boost".into()),
        driver: Some("1.38.0".into()),
        dtype: "f32".into(),
        precision_requested: Some(Precision::F16),
        precision: Some(Precision::Bf16),
        execution_devices: Some("NPU".into()),
        properties: BTreeMap::from([
            ("INFERENCE_PRECISION_HINT".to_string(), "bf16".to_string()),
            ("NPUW_ONLINE_PIPELINE".to_string(), "REP".to_string()),
        ]),
        weights: "int4:128".into(),
        deltanet_prefill: "chunked(64, doubling)".into(),
        deltanet_decode: "matrix".into(),
        output_scale: 1024.0,
        prefill_block: None,
        block: Some(64),
        context: Some(1024),
        taps: false,
        compile_seconds: Some(187.123456789),
        cache_dir: Some("cache/ov".into()),
        from_cache: BTreeMap::from([
            ("decoder_t1".to_string(), true),
            ("decoder_t64".to_string(), false),
        ]),
        ir_reused: Some(true),
    }
}

#[test]
fn a_record_round_trips_through_the_metadata() {
    let device = device_record();
    assert_eq!(
        RunRecord::from_metadata(&device.to_metadata()).unwrap(),
        device
    );
    let reference = RunRecord {
        backend: "reference".into(),
        dtype: "f64".into(),
        weights: "f32".into(),
        deltanet_prefill: "chunked(64, substitution)".into(),
        deltanet_decode: "matrix".into(),
        output_scale: 1.0,
        prefill_block: Some(16),
        taps: true,
        ..RunRecord::default()
    };
    assert_eq!(
        RunRecord::from_metadata(&reference.to_metadata()).unwrap(),
        reference
    );
    let whole = RunRecord {
        prefill_block: None,
        ..reference.clone()
    };
    assert_eq!(whole.to_metadata()["prefill_block"], "whole prompt");
    assert_eq!(
        RunRecord::from_metadata(&whole.to_metadata()).unwrap(),
        whole
    );
    // A precision a device words its own way is kept as it is.
    let other = RunRecord {
        precision: Some(Precision::Other("dynamic".into())),
        ..device
    };
    assert_eq!(
        RunRecord::from_metadata(&other.to_metadata()).unwrap(),
        other
    );
}

#[test]
fn the_judged_precision_is_the_one_read_back_else_asked_else_the_dtype() {
    let mut r = device_record();
    assert_eq!(r.judged_precision(), Precision::Bf16);
    r.precision = None;
    assert_eq!(r.judged_precision(), Precision::F16);
    r.precision_requested = None;
    assert_eq!(r.judged_precision(), Precision::F32);
    assert!(r.judged_precision().is_full());
    assert_eq!(Precision::parse("FP16"), Precision::F16);
    assert!(!Precision::parse("u8").is_full());
}

#[test]
fn a_value_that_does_not_parse_names_its_key() {
    for (key, value) in [
        ("output_scale", "big"),
        ("block", "-3"),
        ("context", "1k"),
        ("taps", "maybe"),
        ("compile_seconds", "soon"),
        ("from_cache.decoder_t1", "yes"),
        ("prefill_block", "half"),
    ] {
        let mut m = device_record().to_metadata();
        m.insert(key.into(), value.into());
        let e = RunRecord::from_metadata(&m).unwrap_err().to_string();
        assert!(e.contains(key) && e.contains(value), "{key}: {e}");
    }
    // What another program's dump leaves out takes the documented values.
    let bare = RunRecord::from_metadata(&BTreeMap::new()).unwrap();
    assert_eq!(bare.backend, "unknown");
    assert_eq!(bare.dtype, "f32");
    assert_eq!(bare.output_scale, 1.0);
    assert!(bare.taps && bare.precision.is_none() && bare.block.is_none());
}
