//! The decoder graphs' IR kept beside the model cache (`npu::engine`'s IR cache): the second engine of the same
//! checkpoint and options reads it back instead of building, and computes bit for bit what a freshly built one
//! computes; another option, a rewritten weight file or a damaged entry gets an entry of its own; old entries are
//! removed. An entry's graphs are compiled from their paths, so a cached start loads the blob without reading the
//! weights.

use candle_core::DType;
use npu::devices::CompileOptions;
use npu::engine::DecoderEngine;
use npu::graphs::{Builder, GraphOptions};
use reference::backend::Backend;
use reference::config::Config;
use reference::weights::WeightStore;
use std::path::{Path, PathBuf};

use crate::common;
use common::run;

fn tiny_copy(dir: &Path) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny");
    let dst = dir.join("tiny");
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
    dst
}

/// An engine of `model` with `context`, blocks of 16, on the CPU, with the model cache in `cache` (or none).
fn engine(model: &Path, context: usize, cache: Option<&Path>) -> DecoderEngine {
    let config = Config::from_file(&model.join("config.json")).unwrap();
    let weights = WeightStore::open(model, DType::F32).unwrap();
    let opts = GraphOptions {
        context,
        ..GraphOptions::default()
    };
    let builder = Builder::new(&config, &weights, opts).unwrap();
    let compile = CompileOptions {
        cache_dir: cache.map(Path::to_path_buf),
        ..CompileOptions::default()
    };
    DecoderEngine::new(&builder, 16, "CPU", &compile).unwrap()
}

fn entries(cache: &Path) -> Vec<String> {
    // The hidden `.qwen35.lock` that runs sharing the cache take is not an entry.
    let mut names: Vec<String> = std::fs::read_dir(cache.join("ir"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| !name.starts_with('.'))
        .collect();
    names.sort();
    names
}

#[test]
fn the_second_engine_reads_the_ir_back_and_computes_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_copy(tmp.path());
    let cache = tmp.path().join("cache");
    let ids: Vec<u32> = (0..35).map(|i| (i * 37 % 500) as u32).collect();

    let mut fresh = engine(&model, 64, None);
    assert_eq!(fresh.record().ir_reused, None, "no cache, nothing kept");
    let expected = run(&mut fresh, &ids, 4).unwrap();

    let mut first = engine(&model, 64, Some(&cache));
    assert_eq!(first.record().ir_reused, Some(false), "built and stored");
    assert_eq!(entries(&cache).len(), 1);
    let mut second = engine(&model, 64, Some(&cache));
    assert_eq!(second.record().ir_reused, Some(true), "read back");
    assert!(second.record().cache_summary().contains("IR read back"));
    for (label, e) in [("stored", &mut first), ("read back", &mut second)] {
        let r = run(e, &ids, 4).unwrap();
        assert_eq!(r.generated, expected.generated, "{label}");
        for (name, t) in &expected.taps {
            let d = reference::compare::diff(&r.taps[name], t).unwrap();
            assert_eq!(d.max_abs, 0.0, "{label}: {name} {d}");
        }
    }
}

#[test]
fn another_option_a_rewritten_file_or_a_damaged_entry_is_built_again() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_copy(tmp.path());
    let cache = tmp.path().join("cache");
    assert_eq!(
        engine(&model, 64, Some(&cache)).record().ir_reused,
        Some(false)
    );
    // Another static context: other graphs, another entry; the first one stays.
    assert_eq!(
        engine(&model, 48, Some(&cache)).record().ir_reused,
        Some(false)
    );
    assert_eq!(entries(&cache).len(), 2);
    assert_eq!(
        engine(&model, 64, Some(&cache)).record().ir_reused,
        Some(true)
    );
    // A weight file rewritten in place (a new modification time): built again.
    let weights = model.join("model.safetensors");
    let f = std::fs::File::options()
        .append(true)
        .open(&weights)
        .unwrap();
    f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5))
        .unwrap();
    drop(f);
    assert_eq!(
        engine(&model, 64, Some(&cache)).record().ir_reused,
        Some(false)
    );
    assert_eq!(
        engine(&model, 64, Some(&cache)).record().ir_reused,
        Some(true)
    );
    // More entries than are kept: the least recently used go (the two made for the old file and one more), the
    // most recently used stay.
    const { assert!(npu::engine::IR_CACHE_KEEP >= 3) };
    for context in (0..npu::engine::IR_CACHE_KEEP - 1).map(|i| 40 - 8 * i) {
        assert_eq!(
            engine(&model, context, Some(&cache)).record().ir_reused,
            Some(false)
        );
    }
    assert_eq!(
        entries(&cache).len(),
        npu::engine::IR_CACHE_KEEP,
        "{:?}",
        entries(&cache)
    );
    assert_eq!(
        engine(&model, 64, Some(&cache)).record().ir_reused,
        Some(true),
        "the entry used last before them is kept"
    );
    // An entry whose identity does not match what it is read for (here: damaged) is built again, not read.
    for e in entries(&cache) {
        std::fs::write(cache.join("ir").join(e).join("identity"), "damaged").unwrap();
    }
    assert_eq!(
        engine(&model, 64, Some(&cache)).record().ir_reused,
        Some(false)
    );
    assert_eq!(
        engine(&model, 64, Some(&cache)).record().ir_reused,
        Some(true)
    );
}

#[test]
fn a_cached_start_compiles_from_the_path_and_never_reads_the_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_copy(tmp.path());
    let cache = tmp.path().join("cache");
    let ids: Vec<u32> = (0..21).map(|i| (i * 53 % 500) as u32).collect();

    let mut first = engine(&model, 64, Some(&cache));
    assert_eq!(first.record().from_cache.get("decoder_t16"), Some(&false));
    let expected = run(&mut first, &ids, 3).unwrap();
    drop(first);
    let entry = cache.join("ir").join(&entries(&cache)[0]);
    // OpenVINO's reader finds the weights beside the graph under its own stem: a link to the shared file.
    let link = entry.join("decoder_t16.bin");
    assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
    assert_eq!(
        link.canonicalize().unwrap(),
        entry.join("weights.bin").canonicalize().unwrap()
    );

    // Zero the largest constant in place (a weight matrix; the graph and its shapes unchanged): a start that hashed
    // or read the weights would miss the model cache and compute with zeros; compiled from its path, it loads the
    // blob and computes what the first start did.
    let xml = std::fs::read_to_string(entry.join("decoder_t16.xml")).unwrap();
    let number = |s: &str, key: &str| -> u64 {
        let at = s.find(key).unwrap() + key.len();
        s[at..].split('"').next().unwrap().parse().unwrap()
    };
    let (offset, size) = xml
        .split("<data ")
        .skip(1)
        .filter(|d| d.contains(" offset=\""))
        .map(|d| (number(d, "offset=\""), number(d, "size=\"")))
        .max_by_key(|&(_, size)| size)
        .unwrap();
    assert!(size >= 4096, "the largest constant holds {size} bytes");
    let bin = entry.join("weights.bin");
    let mut bytes = std::fs::read(&bin).unwrap();
    bytes[offset as usize..(offset + size) as usize].fill(0);
    std::fs::write(&bin, bytes).unwrap();
    let mut second = engine(&model, 64, Some(&cache));
    assert_eq!(second.record().ir_reused, Some(true));
    assert_eq!(second.record().from_cache.get("decoder_t16"), Some(&true));
    let r = run(&mut second, &ids, 3).unwrap();
    assert_eq!(r.generated, expected.generated);
    for (name, t) in &expected.taps {
        let d = reference::compare::diff(&r.taps[name], t).unwrap();
        assert_eq!(d.max_abs, 0.0, "{name} {d}");
    }
}
