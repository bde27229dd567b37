//! The streaming writer: shards, safetensors headers, and the values block by block.

use super::plan::{Init, TensorPlan, config_json, plan};
use super::{BLOCK, SynthOptions};
use crate::error::{Error, Result};
use crate::synthetic::Rng;
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// Blocks generated in parallel before they are written (64 × 64 Ki bf16 values: 8 MiB).
const BATCH_BLOCKS: usize = 64;

/// One shard file and the tensors (indices into the plan) it holds, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The file name (`model-00001-of-00004.safetensors`).
    pub file: String,
    /// Indices into the plan.
    pub tensors: Vec<usize>,
    /// Bytes of tensor data (the header comes on top).
    pub bytes: u64,
}

/// Splits the plan into shards of at most `max_bytes` of data, in plan order (a tensor larger than that gets a
/// shard of its own), named as `save_pretrained` names them.
pub fn shards(plan: &[TensorPlan], max_bytes: u64) -> Vec<Shard> {
    let mut groups: Vec<(Vec<usize>, u64)> = Vec::new();
    for (i, t) in plan.iter().enumerate() {
        match groups.last_mut() {
            Some((members, bytes)) if *bytes + t.bytes() <= max_bytes => {
                members.push(i);
                *bytes += t.bytes();
            }
            _ => groups.push((vec![i], t.bytes())),
        }
    }
    let n = groups.len();
    groups
        .into_iter()
        .enumerate()
        .map(|(i, (tensors, bytes))| Shard {
            file: format!("model-{:05}-of-{n:05}.safetensors", i + 1),
            tensors,
            bytes,
        })
        .collect()
}

/// What was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// Tensors written.
    pub tensors: usize,
    /// Their elements.
    pub parameters: u64,
    /// Elements of the decoder proper (embedding, layers, final norm, LM head).
    pub decoder_parameters: u64,
    /// Every file written with its size in bytes (config, index, shards).
    pub files: Vec<(String, u64)>,
}

impl Summary {
    /// Bytes on disk, every file together.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|(_, b)| b).sum()
    }
}

/// Writes the checkpoint `opts` describes into `dir` (created if needed): `config.json`, the shards and
/// `model.safetensors.index.json`. `progress(done, total)` is called with tensor bytes written so far.
pub fn write_checkpoint(
    dir: &Path,
    opts: &SynthOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Summary> {
    if opts.shard_bytes == 0 {
        return Err(Error::Input("the shard size must be positive".into()));
    }
    let layout = Layout::new(opts)?;
    let (plan, shards) = (&layout.plan, &layout.shards);
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;

    let mut files = Vec::new();
    let mut write_text = |name: &str, text: &str| -> Result<()> {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| Error::io(&path, e))?;
        files.push((name.to_string(), text.len() as u64));
        Ok(())
    };
    write_text("config.json", &layout.config)?;

    let total: u64 = plan.iter().map(TensorPlan::bytes).sum();
    let mut done = 0u64;
    progress(done, total);
    let mut shard_files = Vec::new();
    for shard in shards {
        let path = dir.join(&shard.file);
        let file = std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        let header = header(plan, &shard.tensors);
        out.write_all(&(header.len() as u64).to_le_bytes())
            .and_then(|_| out.write_all(header.as_bytes()))
            .map_err(|e| Error::io(&path, e))?;
        for &i in &shard.tensors {
            write_values(&plan[i], opts.seed, &mut out, &mut |bytes| {
                done += bytes;
                progress(done, total);
            })
            .map_err(|e| Error::io(&path, e))?;
        }
        out.flush().map_err(|e| Error::io(&path, e))?;
        shard_files.push((shard.file.clone(), 8 + header.len() as u64 + shard.bytes));
    }
    write_text("model.safetensors.index.json", &layout.index)?;
    files.extend(shard_files);
    let parameters: u64 = plan.iter().map(|t| t.numel() as u64).sum();
    let decoder_parameters = plan
        .iter()
        .filter(|t| t.name.starts_with("model.language_model.") || t.name == "lm_head.weight")
        .map(|t| t.numel() as u64)
        .sum();
    Ok(Summary {
        tensors: plan.len(),
        parameters,
        decoder_parameters,
        files,
    })
}

/// What a checkpoint is made of before a byte is written: the plan, its shards, and the text of `config.json`
/// and of `model.safetensors.index.json`.
struct Layout {
    plan: Vec<TensorPlan>,
    shards: Vec<Shard>,
    config: String,
    index: String,
}

impl Layout {
    fn new(opts: &SynthOptions) -> Result<Self> {
        let plan = plan(opts.arch, opts.layers)?;
        let shards = shards(&plan, opts.shard_bytes);
        let mut weight_map = BTreeMap::new();
        for shard in &shards {
            for &i in &shard.tensors {
                weight_map.insert(plan[i].name.as_str(), shard.file.as_str());
            }
        }
        let parameters: u64 = plan.iter().map(|t| t.numel() as u64).sum();
        let total: u64 = plan.iter().map(TensorPlan::bytes).sum();
        let index = serde_json::json!({
            "metadata": {"total_parameters": parameters, "total_size": total},
            "weight_map": weight_map,
        });
        let text = |value: &serde_json::Value| -> Result<String> {
            let text =
                serde_json::to_string_pretty(value).map_err(|e| Error::Input(e.to_string()))?;
            Ok(text + "\n")
        };
        Ok(Layout {
            config: text(&config_json(opts.arch, opts.layers, opts.seed)?)?,
            index: text(&index)?,
            plan,
            shards,
        })
    }
}

/// The bytes [`write_checkpoint`] will write for `opts`, every file together (the config, the index, and each shard
/// with its header): what it needs free on the disk, known before anything is written.
pub fn planned_bytes(opts: &SynthOptions) -> Result<u64> {
    if opts.shard_bytes == 0 {
        return Err(Error::Input("the shard size must be positive".into()));
    }
    let layout = Layout::new(opts)?;
    let shards: u64 = layout
        .shards
        .iter()
        .map(|s| 8 + header(&layout.plan, &s.tensors).len() as u64 + s.bytes)
        .sum();
    Ok(layout.config.len() as u64 + layout.index.len() as u64 + shards)
}

/// The JSON header of a shard holding `members` (in that order, contiguous from offset 0), padded with spaces to a
/// multiple of 8 bytes as safetensors writes it.
fn header(plan: &[TensorPlan], members: &[usize]) -> String {
    let mut text = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut offset = 0u64;
    for &i in members {
        let t = &plan[i];
        let shape: Vec<String> = t.shape.iter().map(usize::to_string).collect();
        let name = serde_json::Value::String(t.name.clone()).to_string();
        text.push_str(&format!(
            r#",{name}:{{"dtype":"BF16","shape":[{}],"data_offsets":[{offset},{}]}}"#,
            shape.join(","),
            offset + t.bytes()
        ));
        offset += t.bytes();
    }
    text.push('}');
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    text
}

/// FNV-1a of a name: the tensor's part of its seed.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The generator of block `block` of the tensor called `name`.
fn block_rng(seed: u64, name: &str, block: u64) -> Rng {
    let tensor = Rng::new(seed ^ name_hash(name)).next_u64();
    Rng::new(tensor ^ Rng::new(block).next_u64())
}

/// Fills `out` (bf16, little-endian) with block `block` of tensor `t`.
fn fill_block(t: &TensorPlan, seed: u64, block: usize, out: &mut [u8]) {
    let mut rng = block_rng(seed, &t.name, block as u64);
    let n = out.len() / 2;
    let mut put = |i: usize, x: f32| {
        out[2 * i..2 * i + 2].copy_from_slice(&half::bf16::from_f32(x).to_le_bytes());
    };
    match t.init {
        Init::Normal { mean, std } => {
            // Box–Muller on two 24-bit uniforms from one draw: two normals per draw.
            let mut i = 0;
            while i < n {
                let bits = rng.next_u64();
                let u1 = ((bits >> 40) as f32 + 0.5) / (1u32 << 24) as f32;
                let u2 = (bits & 0xFF_FFFF) as f32 / (1u32 << 24) as f32;
                let r = (-2.0 * u1.ln()).sqrt();
                let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
                put(i, mean + std * r * c);
                if i + 1 < n {
                    put(i + 1, mean + std * r * s);
                }
                i += 2;
            }
        }
        Init::ALog { lo, hi } => {
            for i in 0..n {
                put(i, rng.range(lo, hi).ln() as f32);
            }
        }
        Init::DtBias { lo, hi } => {
            for i in 0..n {
                let dt = rng.range(lo.ln(), hi.ln()).exp();
                // softplus⁻¹(dt) = dt + ln(1 − exp(−dt)).
                put(i, (dt + (-(-dt).exp_m1()).ln()) as f32);
            }
        }
    }
}

/// Generates tensor `t` batch by batch (blocks in parallel) and writes it; `written(bytes)` after each batch.
fn write_values(
    t: &TensorPlan,
    seed: u64,
    out: &mut impl Write,
    written: &mut dyn FnMut(u64),
) -> std::io::Result<()> {
    let n = t.numel();
    let blocks = n.div_ceil(BLOCK);
    let mut buffer = vec![0u8; 2 * BLOCK * BATCH_BLOCKS.min(blocks)];
    let mut first = 0;
    while first < blocks {
        let count = BATCH_BLOCKS.min(blocks - first);
        let elements = (n - first * BLOCK).min(count * BLOCK);
        let bytes = &mut buffer[..2 * elements];
        bytes
            .par_chunks_mut(2 * BLOCK)
            .enumerate()
            .for_each(|(j, chunk)| fill_block(t, seed, first + j, chunk));
        out.write_all(bytes)?;
        written(bytes.len() as u64);
        first += count;
    }
    Ok(())
}
