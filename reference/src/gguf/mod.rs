//! GGUF checkpoints, as llama.cpp writes them: [`types`] names every ggml tensor type with its block size; [`file`]
//! reads the container; [`arith`] models llama.cpp's CPU arithmetic on a GGUF's weights; [`model`] maps a Qwen3.5 GGUF's metadata and tensors onto the reference's config and the
//! checkpoint's tensor names and layouts; [`tokenizer`] builds the tokenizer its vocabulary and merges describe.
//! [`find`] says whether a `--model` path is a GGUF, [`model_config`] and [`packed_image`] (its matrices kept packed
//! in the mapped file) or [`checkpoint_image`] (every tensor decoded) are what the config reader and the weight
//! store open in its place, so every command taking `--model` runs a GGUF.

pub mod arith;
pub mod decode;
pub mod file;
pub mod types;

pub use types::GgmlType;

pub mod model;
pub mod tokenizer;

use crate::config::Config;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// The GGUF file a model path names: the path itself when it is a file ending in `.gguf`; for a directory, the one
/// `.gguf` file in it when it holds no safetensors checkpoint (a checkpoint beside a GGUF is the checkpoint run).
/// `None` when the path is a checkpoint directory; an error when a directory holds several GGUF files and no
/// checkpoint, naming them.
pub fn find(path: &Path) -> Result<Option<PathBuf>> {
    if path.is_file() {
        return Ok(is_gguf(path).then(|| path.to_path_buf()));
    }
    if !path.is_dir()
        || path.join("model.safetensors").exists()
        || path.join("model.safetensors.index.json").exists()
    {
        return Ok(None);
    }
    let entries = std::fs::read_dir(path).map_err(|e| Error::io(path, e))?;
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && is_gguf(p))
        .collect();
    found.sort();
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(Error::File {
            file: path.display().to_string(),
            message: format!(
                "holds {} GGUF files ({}) and no safetensors checkpoint: give --model the one to run",
                found.len(),
                found
                    .iter()
                    .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
    }
}

fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The config of the model at `path`: a GGUF's metadata when [`find`] finds one (a `config.json` beside it is not
/// read), else the directory's `config.json`.
pub fn model_config(path: &Path) -> Result<Config> {
    match find(path)? {
        Some(gguf) => model::config(&file::GgufFile::open(&gguf)?),
        None => Config::from_file(&path.join("config.json")),
    }
}

/// A GGUF as the safetensors checkpoint it was converted from (f32, the checkpoint's names, shapes and layouts: see
/// [`model`]), serialised, with its config: what the weight store maps in place of the checkpoint's file when it
/// decodes every tensor (f64 and compressed runs, and [`crate::weights::WeightStore::open_expanded`]).
pub fn checkpoint_image(path: &Path) -> Result<(Config, Vec<u8>)> {
    let file = file::GgufFile::open(path)?;
    let config = model::config(&file)?;
    let tensors = model::checkpoint_tensors(&file, &config)?;
    Ok((config, safetensors_image(&tensors)))
}

/// Test-only: writes the GGUF at `path` into the directory `dir` as the checkpoint the weight store would serve
/// (`config.json` and `model.safetensors`: [`checkpoint_image`]'s), with `fault` planted in the mapping (see
/// [`model::fault`]). No command reaches it; `parity/tests/all/gguf_faults.rs` runs what it writes.
#[doc(hidden)]
pub fn write_checkpoint(path: &Path, fault: Option<model::fault::Fault>, dir: &Path) -> Result<()> {
    let file = file::GgufFile::open(path)?;
    let json = model::config_json(&file, fault)?;
    let config = model::parse_config(&file, json.clone())?;
    let tensors = model::checkpoint_tensors_with(&file, &config, fault)?;
    let write = |name: &str, bytes: &[u8]| {
        let out = dir.join(name);
        std::fs::write(&out, bytes).map_err(|e| Error::io(&out, e))
    };
    let text = serde_json::to_string_pretty(&serde_json::Value::Object(json))
        .map_err(|e| Error::Input(format!("config.json of {}: {e}", path.display())))?;
    write("config.json", text.as_bytes())?;
    write("model.safetensors", &safetensors_image(&tensors))
}

/// A GGUF with its weight matrices kept packed ([`model::packed::split`]): the config, the split, the decoded
/// tensors serialised as [`checkpoint_image`] serialises them, and the file's map the packed matrices point into.
pub fn packed_image(path: &Path) -> Result<PackedImage> {
    let file = file::GgufFile::open(path)?;
    let config = model::config(&file)?;
    let split = model::packed::split(&file, &config)?;
    let image = safetensors_image(&split.decoded);
    Ok(PackedImage {
        config,
        packed: split.packed,
        types: split.types,
        image,
        map: file.into_mmap(),
    })
}

/// What [`packed_image`] returns.
pub struct PackedImage {
    /// The decoder's config.
    pub config: Config,
    /// The matrices kept packed.
    pub packed: Vec<model::packed::PackedTensor>,
    /// Every checkpoint tensor's GGUF type.
    pub types: Vec<(String, GgmlType)>,
    /// The decoded tensors as a safetensors file.
    pub image: Vec<u8>,
    /// The GGUF's map.
    pub map: memmap2::Mmap,
}

/// Tensors serialised as a safetensors file (f32, in order).
fn safetensors_image(tensors: &[model::CheckpointTensor]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for t in tensors {
        let len = t.values.len() * 4;
        header.insert(
            t.name.clone(),
            serde_json::json!({"dtype": "F32", "shape": t.shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut text = serde_json::Value::Object(header).to_string().into_bytes();
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = Vec::with_capacity(8 + text.len() + offset);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    for t in tensors {
        for v in &t.values {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}
