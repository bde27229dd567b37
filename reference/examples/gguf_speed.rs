//! Decode speed of a GGUF file's tensors, per ggml type, and the speed of the reference on its matrices kept packed
//! (`docs/speed.md`, "GGUF weights kept packed"; `scripts/gguf_speed.sh` runs it on a 9B-shaped Q4_K_M file).
//!
//! ```text
//! cargo run --release -p reference --example gguf_speed -- FILE.gguf [--model] [--matrix]
//! ```
//!
//! Prints, for one and for two threads: each type's tensors, values, bytes and decode throughput (values/s, every
//! tensor decoded whole into a new buffer, rows split across the threads), and the whole file's; then, on one
//! thread, the row decoders' throughput per type and [`Decoder`] (every matrix decoded a row at a time into one
//! buffer, as the products decode them). `--matrix`: the largest layer matrix of the file's most common type other
//! than f32 multiplied packed ([`Linear::Gguf`]) and as its decoded f32 copy ([`MappedMatrix`] on the f32 bytes: the
//! expanded path), 1 token and 64 tokens. `examples/gguf_synth.rs` writes files of one such matrix of each type. `--model`: the reference loaded on
//! the file (matrices packed), a prompt of 64 tokens and decode steps of one token, timed, and what it holds.
//! Times are wall-clock seconds (the best of three runs); on a shared machine say so.

use rayon::prelude::*;
use reference::gguf::GgmlType;
use reference::gguf::decode::{Decoder, dequantize_on};
use reference::gguf::file::GgufFile;
use reference::linear::{Elem, GgufMatrix, MappedMatrix, SharedMap};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Per type: tensors, values, bytes, seconds.
type ByType = BTreeMap<&'static str, (usize, u64, u64, f64)>;

fn best_of<T>(runs: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::INFINITY;
    let mut out = None;
    for _ in 0..runs {
        let t = Instant::now();
        let v = f();
        best = best.min(t.elapsed().as_secs_f64());
        out = Some(v);
    }
    (best, out.expect("at least one run"))
}

/// Decodes every tensor of `file` (rows split across the pool's threads): per type, (tensors, values, bytes, s).
fn decode_all(file: &GgufFile) -> Res<ByType> {
    let mut by_type = ByType::new();
    for info in &file.tensors {
        let bytes = file.bytes(info);
        let cols = info.dims.first().copied().unwrap_or(1) as usize;
        let rows = (info.numel() as usize) / cols.max(1);
        let row_bytes = bytes.len() / rows.max(1);
        let mut out = vec![0f32; rows * cols];
        let (s, ok) = best_of(1, || {
            out.par_chunks_mut(cols.max(1) * 64)
                .zip(bytes.par_chunks(row_bytes.max(1) * 64))
                .try_for_each(|(o, b)| reference::gguf::decode::dequantize(info.ty, b, o))
        });
        ok?;
        let e = by_type.entry(info.ty.name()).or_default();
        e.0 += 1;
        e.1 += info.numel();
        e.2 += bytes.len() as u64;
        e.3 += s;
    }
    Ok(by_type)
}

fn report_decode(file: &GgufFile, threads: usize) -> Res<()> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let by_type = pool.install(|| decode_all(file))?;
    println!("decode, {threads} thread(s): type, tensors, values, bytes, seconds, Mvalues/s, MB/s");
    let mut total = (0usize, 0u64, 0u64, 0f64);
    for (ty, (n, v, b, s)) in &by_type {
        println!(
            "  {ty:8} {n:5} {v:13} {b:12} {s:8.3} {:9.1} {:8.1}",
            *v as f64 / s / 1e6,
            *b as f64 / s / 1e6
        );
        total = (total.0 + n, total.1 + v, total.2 + b, total.3 + s);
    }
    let (n, v, b, s) = total;
    println!(
        "  {:8} {n:5} {v:13} {b:12} {s:8.3} {:9.1} {:8.1}",
        "all",
        v as f64 / s / 1e6,
        b as f64 / s / 1e6
    );
    Ok(())
}

/// One thread: every 2-D tensor decoded a row at a time into one buffer by each decoder the CPU runs; per type and
/// decoder, values and seconds (best of three).
fn report_rows(file: &GgufFile) -> Res<()> {
    let mut by_type: BTreeMap<(&'static str, String), (u64, f64)> = BTreeMap::new();
    for info in file.tensors.iter().filter(|t| t.dims.len() == 2) {
        let bytes = file.bytes(info);
        let cols = info.dims[0] as usize;
        let row_bytes = info.ty.row_bytes(cols as u64)? as usize;
        let mut row = vec![0f32; cols];
        for decoder in [Decoder::Scalar, Decoder::Avx2] {
            if !decoder.available() {
                continue;
            }
            let (s, ok) = best_of(3, || {
                bytes
                    .chunks_exact(row_bytes)
                    .try_for_each(|b| dequantize_on(info.ty, b, &mut row, decoder))
            });
            ok?;
            let e = by_type
                .entry((info.ty.name(), format!("{decoder:?}")))
                .or_default();
            e.0 += info.numel();
            e.1 += s;
        }
    }
    println!("row decode, 1 thread: type, decoder, values, seconds, Mvalues/s");
    for ((ty, decoder), (v, s)) in &by_type {
        println!(
            "  {ty:8} {decoder:7} {v:13} {s:8.3} {:9.1}",
            *v as f64 / s / 1e6
        );
    }
    Ok(())
}

fn report_matrix(path: &Path) -> Res<()> {
    let file = GgufFile::open(path)?;
    let mut count: BTreeMap<GgmlType, usize> = BTreeMap::new();
    for t in file
        .tensors
        .iter()
        .filter(|t| t.dims.len() == 2 && t.ty != GgmlType::F32)
    {
        *count.entry(t.ty).or_default() += 1;
    }
    let Some((&ty, _)) = count.iter().max_by_key(|(_, n)| **n) else {
        println!("matrix: no matrix of a type other than f32 in the file");
        return Ok(());
    };
    let info = file
        .tensors
        .iter()
        .filter(|t| t.dims.len() == 2 && t.ty == ty && t.name.starts_with("blk."))
        .max_by_key(|t| t.numel())
        .expect("a matrix of the most common type")
        .clone();
    let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
    let map = SharedMap::from_mmap(file.into_mmap());
    let packed = GgufMatrix::new(&map, info.start as usize, ty, (rows, cols), None, None)?;
    let values = packed.rows_f32(0, rows);
    let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    drop(values);
    let expanded = MappedMatrix::new(&SharedMap::from_vec(f32_bytes), 0, rows, cols, Elem::F32)?;
    println!(
        "matrix {} ({ty}, [{rows}, {cols}], {} bytes packed, {} as f32): seconds, packed vs expanded",
        info.name,
        packed.byte_len(),
        rows * cols * 4
    );
    for t in [1usize, 64] {
        let x = candle_core::Tensor::from_vec(
            (0..t * cols)
                .map(|i| ((i % 97) as f32 - 48.0) / 97.0)
                .collect::<Vec<_>>(),
            (t, cols),
            &candle_core::Device::Cpu,
        )?;
        let (sp, yp) = best_of(3, || packed.forward(&x));
        let (se, ye) = best_of(3, || expanded.forward(&x));
        let same = yp?.flatten_all()?.to_vec1::<f32>()? == ye?.flatten_all()?.to_vec1::<f32>()?;
        println!("  {t:3} token(s): packed {sp:.4} s, expanded {se:.4} s, same bits: {same}");
    }
    Ok(())
}

fn report_model(path: &Path) -> Res<()> {
    use reference::weights::WeightStore;
    let t0 = Instant::now();
    let config = reference::gguf::model_config(path)?;
    let store = WeightStore::open(path, candle_core::DType::F32)?;
    let model = reference::Model::from_weights(config.clone(), &store)?;
    println!(
        "model: loaded (matrices packed) in {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    println!("  holds {:?}", store.model_held(&config)?);
    let opts = reference::RunOptions::default();
    let mut taps = reference::Taps::off();
    let vocab = config.vocab_size as u32;
    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 7919 + 11) % vocab).collect();
    let mut state = model.new_state()?;
    let t = Instant::now();
    let logits = model.forward(&prompt, &mut state, &opts, &mut taps)?;
    println!("  prompt of 64 tokens: {:.2} s", t.elapsed().as_secs_f64());
    let mut next = argmax(&logits.to_vec1::<f32>()?);
    let mut steps = vec![];
    for _ in 0..4 {
        let t = Instant::now();
        let logits = model.forward(&[next], &mut state, &opts, &mut taps)?;
        steps.push(t.elapsed().as_secs_f64());
        next = argmax(&logits.to_vec1::<f32>()?);
    }
    println!("  decode steps (1 token each): {steps:.2?} s");
    Ok(())
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len())
        .max_by(|&a, &b| v[a].total_cmp(&v[b]))
        .unwrap_or(0) as u32
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map(PathBuf::from)
    else {
        return Err("usage: gguf_speed FILE.gguf [--model] [--matrix]".into());
    };
    let file = GgufFile::open(&path)?;
    let bytes: u64 = file.tensors.iter().map(|t| t.len).sum();
    println!(
        "{}: {} tensors, {bytes} bytes of tensor data",
        path.display(),
        file.tensors.len()
    );
    let t = Instant::now();
    let sum = file
        .tensors
        .iter()
        .map(|i| {
            file.bytes(i)
                .iter()
                .step_by(4096)
                .map(|&b| b as u64)
                .sum::<u64>()
        })
        .sum::<u64>();
    println!(
        "touch every page of the map: {:.2} s (checksum {sum})",
        t.elapsed().as_secs_f64()
    );
    for threads in [1, 2] {
        report_decode(&file, threads)?;
    }
    report_rows(&file)?;
    drop(file);
    if args.iter().any(|a| a == "--matrix") {
        report_matrix(&path)?;
    }
    if args.iter().any(|a| a == "--model") {
        report_model(&path)?;
    }
    Ok(())
}
