//! Checkpoint weights: safetensors files (single or sharded), memory mapped, converted to the run's dtype.
//!
//! Tensors are asked for by their [`TensorSpec`] ([`crate::schema`]: the name, and the shape the config implies),
//! resolved under the checkpoint's decoder prefix (`model.` text-only, `model.language_model.` multimodal); the
//! vision tower's (`model.visual.*`) by their own specs ([`crate::schema::vision`]); `mtp.*` tensors never.
//!
//! A store opened with a [`WeightFormat`] other than f32 hands out the weights the compressed export runs: each
//! tensor the format selects is quantised from its checkpoint value (converted to f32, exactly for bf16/f16/f32) and
//! dequantised exactly, or rounded to f16; [`WeightStore::quantized`] gives the codes and scales themselves. In an f32
//! run, [`WeightStore::linear`] keeps a quantised matrix as its codes and scales ([`Linear::Packed`]) and an
//! f16-rounded one as f16 ([`Linear::Mapped`] on an owned buffer), each built a block of rows at a time straight
//! from the mapped checkpoint bytes, so no f32 copy of a whole matrix is ever made; the checkpoint pages each block
//! was read from are then handed back ([`SharedMap::release`]).
//!
//! A GGUF file ([`crate::gguf`]) in an f32 run of its own values keeps its weight matrices as their ggml blocks in
//! the mapped file ([`Linear::Gguf`], rows decoded as they are read, the products bit for bit those of the decoded
//! f32 matrix) and decodes only the small tensors into memory; f64 and compressed runs decode it whole (see `gguf`).

use crate::error::{Error, Result};
use crate::gguf::arith::Arithmetic;
use crate::linear::{Elem, Linear, MappedMatrix, SharedMap};
use crate::quant::{Storage, WeightFormat, round_f16};
use crate::schema::TensorSpec;
use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use safetensors::tensor::{Dtype as StDtype, Metadata, TensorInfo};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

mod arith;
mod compressed;
mod experts;
mod gguf;
mod raw;
mod vision;

use raw::{Raw, decode};

struct ShardFile {
    path: PathBuf,
    mmap: SharedMap,
    header_len: usize,
    metadata: Metadata,
}

impl ShardFile {
    fn open(path: &Path) -> Result<Self> {
        let file = crate::inputs::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the file is opened read-only and the map is only read; a checkpoint is not expected to change
        // while a run holds it.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let (header_len, metadata) =
            safetensors::SafeTensors::read_metadata(&mmap[..]).map_err(|e| Error::File {
                file: path.display().to_string(),
                message: format!("not a valid safetensors file: {e}"),
            })?;
        Ok(ShardFile {
            path: path.to_path_buf(),
            mmap: SharedMap::from_mmap(mmap),
            header_len,
            metadata,
        })
    }

    fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.metadata.info(name)
    }

    fn start(&self, info: &TensorInfo) -> usize {
        8 + self.header_len + info.data_offsets.0
    }

    fn bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = self.start(info);
        let end = 8 + self.header_len + info.data_offsets.1;
        &self.mmap.bytes()[start..end]
    }
}

/// Bytes a run holds for weights: its own memory, and pages of the mapped checkpoint (read in place, given back to
/// the kernel under pressure).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// Owned memory (packed codes and scales, converted tensors).
    pub owned: u64,
    /// Mapped checkpoint bytes read in place.
    pub mapped: u64,
}

/// The weights of one checkpoint directory.
pub struct WeightStore {
    dir: PathBuf,
    files: Vec<ShardFile>,
    /// Tensor name → index into `files`.
    index: HashMap<String, usize>,
    prefix: &'static str,
    dtype: DType,
    format: WeightFormat,
    device: Device,
    /// A GGUF's matrices kept packed (f32 runs of a GGUF, see [`gguf`]).
    gguf: Option<gguf::GgufWeights>,
    /// How the reference computes on these weights ([`WeightStore::set_arithmetic`]).
    arithmetic: Arithmetic,
}

/// Decoder name prefixes, text-only export first.
const PREFIXES: [&str; 2] = ["model.", "model.language_model."];

impl WeightStore {
    /// Opens `model.safetensors.index.json` (sharded) or `model.safetensors` in `dir`, or the GGUF file `dir` is or
    /// holds ([`crate::gguf::find`]); tensors will be converted to `dtype` (F32 or F64). The weights are the checkpoint's own ([`WeightFormat::F32`]).
    pub fn open(dir: &Path, dtype: DType) -> Result<Self> {
        Self::open_with_format(dir, dtype, WeightFormat::F32)
    }

    /// [`WeightStore::open`] with the weights compressed as `format` prescribes (see [`WeightFormat::storage`]):
    /// [`WeightStore::load`] and [`WeightStore::linear`] return the dequantised (or f16-rounded) values, exact in f32
    /// and widened exactly for F64 runs.
    pub fn open_with_format(dir: &Path, dtype: DType, format: WeightFormat) -> Result<Self> {
        Self::open_inner(dir, dtype, format, true)
    }

    /// Opens the store; a GGUF's matrices are kept packed when `pack` and the run allows it.
    fn open_inner(dir: &Path, dtype: DType, format: WeightFormat, pack: bool) -> Result<Self> {
        format.validate()?;
        if !matches!(dtype, DType::F32 | DType::F64) {
            return Err(Error::Input(format!(
                "the reference computes in f32 or f64, not {dtype:?}"
            )));
        }
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut files = Vec::new();
        let mut index = HashMap::new();
        let mut packed = None;
        if let Some(path) = crate::gguf::find(dir)? {
            let (file, weights) = gguf::open(&path, pack && gguf::keeps_packed(dtype, format))?;
            for name in file.metadata.tensors().keys() {
                index.insert(name.clone(), 0);
            }
            files.push(file);
            packed = weights;
        } else if index_path.exists() {
            let text = crate::inputs::read_to_string(&index_path)
                .map_err(|e| Error::io(&index_path, e))?;
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::File {
                file: index_path.display().to_string(),
                message: format!("not valid JSON: {e}"),
            })?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::File {
                    file: index_path.display().to_string(),
                    message: "`weight_map` is missing or not an object".into(),
                })?;
            let mut shard_names: BTreeMap<String, usize> = BTreeMap::new();
            for (tensor, shard) in map {
                let shard = shard.as_str().ok_or_else(|| Error::Weights {
                    file: index_path.display().to_string(),
                    key: tensor.clone(),
                    message: format!("its `weight_map` entry {shard} is not a file name"),
                })?;
                // A shard is a file of the checkpoint's own directory: no directories, no `..`, no absolute path
                // (an index must not make the run read files elsewhere).
                let plain = Path::new(shard)
                    .components()
                    .all(|c| matches!(c, std::path::Component::Normal(_)));
                if shard.is_empty() || !plain || shard.contains('/') || shard.contains('\\') {
                    return Err(Error::Weights {
                        file: index_path.display().to_string(),
                        key: tensor.clone(),
                        message: format!(
                            "its shard `{shard}` is not a file name in the checkpoint's directory (no paths \
                             allowed in `weight_map`)"
                        ),
                    });
                }
                let next = shard_names.len();
                let file_idx = *shard_names.entry(shard.to_string()).or_insert(next);
                index.insert(tensor.clone(), file_idx);
            }
            let mut ordered: Vec<(String, usize)> = shard_names.into_iter().collect();
            ordered.sort_by_key(|(_, i)| *i);
            for (name, _) in &ordered {
                let path = dir.join(name);
                if !path.exists() {
                    return Err(Error::Weights {
                        file: index_path.display().to_string(),
                        key: name.clone(),
                        message: format!(
                            "the index lists shard `{name}` but {} does not exist",
                            path.display()
                        ),
                    });
                }
                files.push(ShardFile::open(&path)?);
            }
            for (tensor, &file_idx) in &index {
                if files[file_idx].info(tensor).is_none() {
                    return Err(Error::Weights {
                        file: files[file_idx].path.display().to_string(),
                        key: tensor.clone(),
                        message: format!(
                            "listed in {} but absent from this shard",
                            index_path.display()
                        ),
                    });
                }
            }
        } else if single.exists() {
            let file = ShardFile::open(&single)?;
            for name in file.metadata.tensors().keys() {
                index.insert(name.clone(), 0);
            }
            files.push(file);
        } else {
            return Err(Error::File {
                file: dir.display().to_string(),
                message: "neither model.safetensors nor model.safetensors.index.json is here"
                    .into(),
            });
        }

        let present: Vec<&str> = PREFIXES
            .iter()
            .copied()
            .filter(|p| {
                let name = format!("{p}embed_tokens.weight");
                index.contains_key(&name) || packed.as_ref().is_some_and(|g| g.has(&name))
            })
            .collect();
        let prefix = match present.as_slice() {
            [p] => *p,
            [] => {
                return Err(Error::Weights {
                    file: dir.display().to_string(),
                    key: "model.embed_tokens.weight".into(),
                    message:
                        "no decoder embedding found (looked for `model.embed_tokens.weight` and \
                              `model.language_model.embed_tokens.weight`)"
                            .into(),
                });
            }
            _ => {
                return Err(Error::Weights {
                    file: dir.display().to_string(),
                    key: "model.embed_tokens.weight".into(),
                    message: "both `model.` and `model.language_model.` decoder names are present: ambiguous"
                        .into(),
                });
            }
        };
        Ok(WeightStore {
            dir: dir.to_path_buf(),
            files,
            index,
            prefix,
            dtype,
            format,
            device: Device::Cpu,
            gguf: packed,
            arithmetic: Arithmetic::Reference,
        })
    }

    /// The compression the weights are served with.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// How a tensor is stored under the store's format.
    pub fn storage(&self, spec: &TensorSpec) -> Storage {
        self.format.storage(spec.role(), &spec.shape)
    }

    /// The dtype tensors are converted to.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The decoder prefix found in this checkpoint (`model.` or `model.language_model.`).
    pub fn prefix(&self) -> &'static str {
        self.prefix
    }

    /// The tensor's full name in this checkpoint.
    pub fn full_name(&self, spec: &TensorSpec) -> String {
        spec.full_name(self.prefix)
    }

    /// A decoder tensor, checked against the shape its spec gives and converted to the store's dtype; quantised
    /// then dequantised, or rounded to f16, when the store's format selects it.
    pub fn load(&self, spec: &TensorSpec) -> Result<Tensor> {
        if let Some(m) = self.gguf_matrix(spec)? {
            return self.tensor_of(m.rows_f32(0, m.rows()), &spec.shape);
        }
        let full_name = self.full_name(spec);
        let raw = self.raw(&full_name, &spec.shape, &spec.param.shape_keys())?;
        match self.storage(spec) {
            Storage::Float => self.exact(&raw, &spec.shape),
            Storage::F16 => {
                let values: Vec<f64> = raw.values_f64()?;
                let rounded = values.into_iter().map(|x| round_f16(x).to_f32()).collect();
                self.tensor_of(rounded, &spec.shape)
            }
            Storage::Int4Sym { .. } | Storage::Int8Sym => {
                let q = self.quantize(&raw, spec)?;
                self.tensor_of(q.dequantize(), &spec.shape)
            }
        }
    }

    /// A matrix `[out, in]` for a linear layer or an embedding. In an f32 run: read in place from the mapped
    /// checkpoint when the format keeps the tensor as stored and it is bf16, f16 or f32; the codes and scales
    /// ([`Linear::Packed`]) when the format quantises it; the f16-rounded values held as f16 when the format rounds it
    /// (see [`crate::linear`]). Otherwise (f64 runs) the tensor [`WeightStore::load`] returns. The values are the same
    /// on every path.
    pub fn linear(&self, spec: &TensorSpec) -> Result<Linear> {
        let weight = self.stored_linear(spec)?;
        self.rounded_input(spec, weight)
    }

    /// [`WeightStore::linear`] without the arithmetic's input rounding.
    fn stored_linear(&self, spec: &TensorSpec) -> Result<Linear> {
        if let Some(l) = self.gguf_linear(spec)? {
            return Ok(l);
        }
        if let Some(m) = self.mapped(spec)? {
            return Ok(Linear::Mapped(m));
        }
        if self.dtype == DType::F32
            && let &[rows, cols] = spec.shape.as_slice()
        {
            match self.storage(spec) {
                Storage::Int4Sym { .. } | Storage::Int8Sym => {
                    return Ok(Linear::Packed(self.packed(spec, rows, cols)?));
                }
                Storage::F16 => return Ok(Linear::Mapped(self.rounded_f16(spec, rows, cols)?)),
                Storage::Float => {}
            }
        }
        Ok(Linear::Dense(self.load(spec)?))
    }

    /// The matrix as stored, when [`WeightStore::linear`] reads it in place.
    fn mapped(&self, spec: &TensorSpec) -> Result<Option<MappedMatrix>> {
        if self.gguf_matrix(spec)?.is_some() {
            return Ok(None);
        }
        let full_name = self.full_name(spec);
        let raw = self.raw(&full_name, &spec.shape, &spec.param.shape_keys())?;
        let elem = match raw.dtype {
            StDtype::BF16 => Some(Elem::Bf16),
            StDtype::F16 => Some(Elem::F16),
            StDtype::F32 => Some(Elem::F32),
            _ => None,
        };
        match (elem, self.dtype, self.storage(spec), spec.shape.as_slice()) {
            (Some(elem), DType::F32, Storage::Float, &[rows, cols]) => {
                let m = MappedMatrix::new(&raw.file.mmap, raw.start(), rows, cols, elem)
                    .map_err(|e| raw.err(e.to_string()))?;
                Ok(Some(m))
            }
            _ => Ok(None),
        }
    }

    /// The bytes per element [`WeightStore::linear`] reads for this matrix when it holds it as whole stored values
    /// (read in place, or rounded to f16 in an f32 run: 2), `None` when it holds a converted tensor or packed INT4/INT8
    /// codes instead.
    pub fn read_in_place_bytes(&self, spec: &TensorSpec) -> Result<Option<usize>> {
        if let Some(m) = self.mapped(spec)? {
            return Ok(Some(m.elem().size()));
        }
        Ok(
            match (self.dtype, self.storage(spec), spec.shape.as_slice()) {
                (DType::F32, Storage::F16, [_, _]) => Some(2),
                _ => None,
            },
        )
    }

    /// The bytes a matrix-vector product over this matrix reads, as [`WeightStore::linear`] holds it: the stored
    /// elements when read in place, 2 per weight rounded to f16, the codes (INT4 two to a byte, a row starting on a
    /// byte) and f16 scales of packed INT4/INT8 weights in an f32 run, and the run's dtype otherwise.
    pub fn linear_bytes(&self, spec: &TensorSpec) -> Result<u64> {
        let (rows, cols) = match spec.shape.as_slice() {
            &[rows, cols] => (rows as u64, cols as u64),
            other => {
                return Err(Error::Input(format!(
                    "{}: a linear weight is a matrix, not {other:?}",
                    self.full_name(spec)
                )));
            }
        };
        if let Some(size) = self.read_in_place_bytes(spec)? {
            return Ok(rows * cols * size as u64);
        }
        if let Some(m) = self.gguf_matrix(spec)? {
            return Ok(m.byte_len() as u64);
        }
        let run = if self.dtype == DType::F64 { 8 } else { 4 };
        Ok(match (self.dtype, self.storage(spec)) {
            (DType::F32, Storage::Int4Sym { group }) => {
                rows * cols.div_ceil(2) + 2 * rows * cols.div_ceil(group.max(1) as u64)
            }
            (DType::F32, Storage::Int8Sym) => rows * cols + 2 * rows,
            _ => rows * cols * run,
        })
    }

    /// The memory a run holds for this tensor as the reference keeps it: a matrix as [`WeightStore::linear`] holds
    /// it (read in place: pages of the mapped checkpoint, which the kernel can take back; packed or rounded: owned),
    /// any other tensor as [`WeightStore::load`] converts it (owned).
    pub fn held(&self, spec: &TensorSpec) -> Result<Held> {
        if let Some(h) = self.gguf_held(spec)? {
            return Ok(h);
        }
        if spec.shape.len() == 2 {
            let bytes = self.linear_bytes(spec)?;
            // A GGUF decoded into memory is mapped from an owned buffer: owned.
            return Ok(if self.mapped(spec)?.is_some_and(|m| m.in_file_map()) {
                Held {
                    owned: 0,
                    mapped: bytes,
                }
            } else {
                Held {
                    owned: bytes,
                    mapped: 0,
                }
            });
        }
        let numel: u64 = spec.shape.iter().map(|&d| d as u64).product();
        let size = if self.dtype == DType::F64 { 8 } else { 4 };
        Ok(Held {
            owned: numel * size,
            mapped: 0,
        })
    }

    /// [`WeightStore::held`] over every decoder tensor of `config`: what the reference model holds (an untied
    /// embedding it quantises on read holds nothing but mapped pages).
    pub fn model_held(&self, config: &crate::config::Config) -> Result<Held> {
        let mut total = Held::default();
        for spec in crate::schema::Schema::new(config).tensors() {
            let on_read = spec.role() == crate::schema::Role::Embedding
                && !config.tie_word_embeddings
                && self.on_read(&spec)?.is_some();
            let h = if on_read {
                Held {
                    owned: 0,
                    mapped: self
                        .raw(
                            &self.full_name(&spec),
                            &spec.shape,
                            &spec.param.shape_keys(),
                        )?
                        .bytes
                        .len() as u64,
                }
            } else {
                self.held(&spec)?
            };
            total.owned += h.owned;
            total.mapped += h.mapped;
        }
        Ok(total)
    }

    /// The maps of the checkpoint's files, shared: a model hands their pages back as it is done with them.
    pub fn maps(&self) -> Vec<SharedMap> {
        let gguf = self.gguf.as_ref().map(|g| g.map().clone());
        self.files
            .iter()
            .map(|f| f.mmap.clone())
            .chain(gguf)
            .collect()
    }

    /// The checkpoint files this store maps (one per shard).
    pub fn paths(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path.as_path()).collect()
    }

    /// Looks a tensor up (an MoE expert's also in its layer's fused tensor) and checks its shape and byte count.
    /// `keys` names the config keys each dimension of `shape` comes from, for the error when the file disagrees.
    fn raw<'a>(&'a self, full_name: &'a str, shape: &[usize], keys: &[&str]) -> Result<Raw<'a>> {
        let Some(&file_idx) = self.index.get(full_name) else {
            return experts::fused_raw(self, full_name, shape);
        };
        let file = &self.files[file_idx];
        let info = file.info(full_name).ok_or_else(|| Error::Weights {
            file: file.path.display().to_string(),
            key: full_name.to_string(),
            message: "missing".into(),
        })?;
        let raw = Raw {
            file,
            name: full_name,
            dtype: info.dtype,
            bytes: file.bytes(info),
        };
        if info.shape != shape {
            return Err(raw.err(format!(
                "shape {:?} does not match the config, which implies {:?}: {}",
                info.shape,
                shape,
                crate::schema::shape_disagreement(keys, &info.shape, shape)
            )));
        }
        let n: usize = shape.iter().product();
        let expected_bytes = n * info.dtype.bitsize() / 8;
        if raw.bytes.len() != expected_bytes {
            return Err(raw.err(format!(
                "holds {} bytes, {expected_bytes} expected for {:?} {:?}",
                raw.bytes.len(),
                info.dtype,
                shape
            )));
        }
        Ok(raw)
    }

    /// The checkpoint's values, converted exactly (or, from f64 to an f32 run, rounded) to the store's dtype.
    fn exact(&self, raw: &Raw, shape: &[usize]) -> Result<Tensor> {
        let bytes = raw.bytes;
        let tensor = match (raw.dtype, self.dtype) {
            (StDtype::F32, DType::F32) => Tensor::from_vec(
                decode::<4, f32>(bytes, f32::from_le_bytes),
                shape,
                &self.device,
            )?,
            (StDtype::F32, _) => Tensor::from_vec(
                decode::<4, f64>(bytes, |b| f32::from_le_bytes(b) as f64),
                shape,
                &self.device,
            )?,
            (StDtype::F64, _) => Tensor::from_vec(
                decode::<8, f64>(bytes, f64::from_le_bytes),
                shape,
                &self.device,
            )?
            .to_dtype(self.dtype)?,
            (StDtype::BF16, DType::F32) => Tensor::from_vec(
                decode::<2, f32>(bytes, |b| half::bf16::from_le_bytes(b).to_f32()),
                shape,
                &self.device,
            )?,
            (StDtype::BF16, _) => Tensor::from_vec(
                decode::<2, f64>(bytes, |b| half::bf16::from_le_bytes(b).to_f64()),
                shape,
                &self.device,
            )?,
            (StDtype::F16, DType::F32) => Tensor::from_vec(
                decode::<2, f32>(bytes, |b| half::f16::from_le_bytes(b).to_f32()),
                shape,
                &self.device,
            )?,
            (StDtype::F16, _) => Tensor::from_vec(
                decode::<2, f64>(bytes, |b| half::f16::from_le_bytes(b).to_f64()),
                shape,
                &self.device,
            )?,
            (other, _) => return Err(raw.unsupported(other)),
        };
        Ok(tensor)
    }

    /// A tensor of the store's dtype from f32 values (widened exactly for F64 runs).
    fn tensor_of(&self, values: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        let t = Tensor::from_vec(values, shape, &self.device)?;
        Ok(if self.dtype == DType::F32 {
            t
        } else {
            t.to_dtype(self.dtype)?
        })
    }

    fn location(&self) -> String {
        if self.files.len() == 1 {
            self.files[0].path.display().to_string()
        } else {
            self.dir.display().to_string()
        }
    }
}
