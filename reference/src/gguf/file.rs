//! The GGUF container (versions 2 and 3, little-endian), memory mapped: the header, every metadata key/value (all
//! thirteen value types, arrays included), the tensor infos, and where each tensor's bytes are.
//!
//! The parser is this crate's own, not candle's `quantized::gguf_file`: candle 0.11 turns every tensor's type id
//! into its `GgmlDType` while reading the header and refuses the whole file on any type it does not know
//! (`unknown dtype for tensor 16`, for every IQ type, TQ1_0/TQ2_0, MXFP4, NVFP4, Q1_0, Q2_0 and the integer
//! types), which is exactly what llama.cpp's "dynamic" quants are made of; it also does not check that the tensors'
//! bytes lie in the file or do not overlap. Here a tensor's type is a [`GgmlType`] (every id current ggml defines),
//! and whether its values can be decoded is the decoders' question, asked only of the tensors a run reads.
//!
//! Every malformed file is an error naming the file and what is wrong (truncated, bad magic or version, a count
//! larger than the bytes left could hold, a string that is not UTF-8, a duplicate key or tensor, an unknown or
//! removed type id, a shape whose row is not whole blocks, a tensor's bytes outside the file or overlapping
//! another's, an offset off the alignment): never a panic, and never an allocation a count in the file asks for
//! before the file is known to hold that many items.

use super::types::GgmlType;
use crate::error::{Error, Result};
use memmap2::Mmap;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// `GGUF` read as a little-endian `u32`.
const MAGIC: [u8; 4] = *b"GGUF";

/// The alignment of the tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// The most dimensions a ggml tensor has (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// How deep arrays may nest (llama.cpp writes none nested; one level of nesting is allowed, more is refused).
const MAX_ARRAY_DEPTH: usize = 2;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `float32`.
    F32(f32),
    /// `bool` (one byte, 0 or 1).
    Bool(bool),
    /// `string` (UTF-8).
    String(String),
    /// `array` of values of one type.
    Array(Vec<Value>),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float64`.
    F64(f64),
}

impl Value {
    /// The GGUF name of the value's type.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "uint8",
            Value::I8(_) => "int8",
            Value::U16(_) => "uint16",
            Value::I16(_) => "int16",
            Value::U32(_) => "uint32",
            Value::I32(_) => "int32",
            Value::F32(_) => "float32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "uint64",
            Value::I64(_) => "int64",
            Value::F64(_) => "float64",
        }
    }

    /// The value as a non-negative integer, from any integer type.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, from `float32` or `float64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }
}

/// One tensor's header entry, checked against the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The tensor's name (`blk.0.attn_qkv.weight`, ...).
    pub name: String,
    /// Its dimensions in ggml's order: `ne[0]` is the fastest (a PyTorch `[out, in]` matrix is `[in, out]`).
    pub dims: Vec<u64>,
    /// Its type.
    pub ty: GgmlType,
    /// Where its bytes start in the file (the data section's start plus the tensor's offset).
    pub start: u64,
    /// How many bytes it takes.
    pub len: u64,
}

impl TensorInfo {
    /// Its elements.
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Its shape in PyTorch's order (slowest first): `dims` reversed.
    pub fn torch_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A GGUF file, mapped and its header parsed.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    /// The format version (2 or 3).
    pub version: u32,
    /// The metadata in file order.
    pub metadata: Vec<(String, Value)>,
    keys: HashMap<String, usize>,
    /// The tensors in file order.
    pub tensors: Vec<TensorInfo>,
    names: HashMap<String, usize>,
    /// The alignment of the data section (`general.alignment`, else 32).
    pub alignment: u64,
    /// Where the data section starts.
    pub data_offset: u64,
}

impl GgufFile {
    /// Maps and parses `path`, recording it as an input of the run.
    pub fn open(path: &Path) -> Result<Self> {
        let file = crate::inputs::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the file is opened read-only and the map is only read; a checkpoint is not expected to change
        // while a run holds it.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let header = parse(&mmap).map_err(|message| Error::File {
            file: path.display().to_string(),
            message: format!("not a valid GGUF file: {message}"),
        })?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            mmap,
            version: header.version,
            keys: index(header.metadata.iter().map(|(k, _)| k)),
            metadata: header.metadata,
            names: index(header.tensors.iter().map(|t| &t.name)),
            tensors: header.tensors,
            alignment: header.alignment,
            data_offset: header.data_offset,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The metadata value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.names.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor's bytes (their range was checked against the file when it was opened).
    pub fn bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.mmap[info.start as usize..(info.start + info.len) as usize]
    }

    /// The file's map, for weights read in place (each tensor at its [`TensorInfo::start`]).
    pub fn into_mmap(self) -> Mmap {
        self.mmap
    }
}

fn index<'a>(names: impl Iterator<Item = &'a String>) -> HashMap<String, usize> {
    names.enumerate().map(|(i, n)| (n.clone(), i)).collect()
}

/// What [`parse`] reads from the header.
#[derive(Debug)]
pub(crate) struct Header {
    pub(crate) version: u32,
    pub(crate) metadata: Vec<(String, Value)>,
    pub(crate) tensors: Vec<TensorInfo>,
    pub(crate) alignment: u64,
    pub(crate) data_offset: u64,
}

/// A little-endian reader over the file's bytes whose every read is bounds-checked.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> std::result::Result<&'a [u8], String> {
        if n > self.left() {
            return Err(format!(
                "truncated: {what} at byte {} needs {n} bytes, the file has {} left",
                self.pos,
                self.left()
            ));
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> std::result::Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items of at least `min_size` bytes each, refused when the bytes left could not hold that many.
    fn count(&mut self, min_size: usize, what: &str) -> std::result::Result<usize, String> {
        let at = self.pos;
        let n = self.u64(what)?;
        let most = self.left() / min_size.max(1);
        if n > most as u64 {
            return Err(format!(
                "{what} at byte {at} is {n}, more than the {} bytes left could hold",
                self.left()
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> std::result::Result<String, String> {
        let at = self.pos;
        let len = self.count(1, &format!("the length of {what}"))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} at byte {at} is not UTF-8"))
    }

    fn value(&mut self, ty: u32, depth: usize, what: &str) -> std::result::Result<Value, String> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(what)?[0]),
            1 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => {
                let at = self.pos;
                match self.array::<1>(what)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => {
                        return Err(format!(
                            "{what} at byte {at} is a bool of value {b}, not 0 or 1"
                        ));
                    }
                }
            }
            8 => Value::String(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!("{what} nests arrays deeper than {MAX_ARRAY_DEPTH}"));
                }
                let at = self.pos;
                let item = self.u32(&format!("the item type of {what}"))?;
                let size = min_size(item).ok_or_else(|| {
                    format!("{what} at byte {at} has items of unknown value type {item}")
                })?;
                let n = self.count(size, &format!("the length of {what}"))?;
                let mut items = Vec::with_capacity(n);
                for i in 0..n {
                    items.push(self.value(item, depth + 1, &format!("{what}[{i}]"))?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            other => return Err(format!("{what} has unknown value type {other}")),
        })
    }
}

/// The fewest bytes a value of GGUF type `ty` takes (`None` for an unknown type).
fn min_size(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        10..=12 => 8,
        _ => return None,
    })
}

/// Parses a whole GGUF file's header and checks every tensor's bytes against the file.
pub(crate) fn parse(bytes: &[u8]) -> std::result::Result<Header, String> {
    let mut c = Cursor { bytes, pos: 0 };
    let magic = c.array::<4>("the magic")?;
    if magic != MAGIC {
        return Err(format!(
            "bad magic {magic:02x?} (a GGUF file starts with `GGUF`)"
        ));
    }
    let version = c.u32("the version")?;
    if !(2..=3).contains(&version) {
        return Err(format!("version {version} is not supported (2 and 3 are)"));
    }
    // The fewest bytes of a tensor info: an empty name (8), no dimensions (4), the type (4), the offset (8).
    let n_tensors = c.count(24, "the tensor count")?;
    // The fewest bytes of a key/value: an empty key (8), the type (4), a one-byte value.
    let n_kv = c.count(13, "the metadata count")?;

    let mut metadata = Vec::with_capacity(n_kv);
    let mut seen = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = c.string(&format!("the key of metadata entry {i}"))?;
        let ty = c.u32(&format!("the value type of `{key}`"))?;
        let value = c.value(ty, 0, &format!("`{key}`"))?;
        if seen.insert(key.clone(), i).is_some() {
            return Err(format!("metadata key `{key}` appears twice"));
        }
        metadata.push((key, value));
    }
    let alignment = match seen.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if *a > 0 && a.is_power_of_two() => u64::from(*a),
        Some(other) => {
            return Err(format!(
                "`general.alignment` is {other:?}, not a uint32 power of two"
            ));
        }
    };

    let mut tensors = Vec::with_capacity(n_tensors);
    let mut names = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = c.string(&format!("the name of tensor {i}"))?;
        let n_dims = c.u32(&format!("the dimension count of `{name}`"))? as usize;
        if n_dims > MAX_DIMS {
            return Err(format!(
                "tensor `{name}` has {n_dims} dimensions, more than ggml's {MAX_DIMS}"
            ));
        }
        let mut dims = Vec::with_capacity(n_dims);
        for d in 0..n_dims {
            dims.push(c.u64(&format!("dimension {d} of `{name}`"))?);
        }
        let id = c.u32(&format!("the type of `{name}`"))?;
        let ty = GgmlType::from_id(id).map_err(|e| format!("tensor `{name}`: {e}"))?;
        let offset = c.u64(&format!("the offset of `{name}`"))?;
        if names.insert(name.clone(), i).is_some() {
            return Err(format!("tensor `{name}` appears twice"));
        }
        let len = byte_len(ty, &dims).map_err(|e| format!("tensor `{name}` {dims:?}: {e}"))?;
        if !offset.is_multiple_of(alignment) {
            return Err(format!(
                "tensor `{name}`'s offset {offset} is not a multiple of the alignment {alignment}"
            ));
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            start: offset,
            len,
        });
    }
    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let file_len = bytes.len() as u64;
    for t in &mut tensors {
        let start = data_offset.checked_add(t.start);
        let end = start.and_then(|s| s.checked_add(t.len));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_len => t.start = start,
            _ => {
                return Err(format!(
                    "tensor `{}` ({} bytes of {} at data offset {}) ends past the file's end ({file_len} bytes; the \
                     data section starts at {data_offset}): truncated or a bad offset",
                    t.name, t.len, t.ty, t.start
                ));
            }
        }
    }
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| (t.start, t.len));
    for pair in order.windows(2) {
        if pair[0].start + pair[0].len > pair[1].start {
            return Err(format!(
                "tensors `{}` and `{}` overlap (bytes {}..{} and {}..{})",
                pair[0].name,
                pair[1].name,
                pair[0].start,
                pair[0].start + pair[0].len,
                pair[1].start,
                pair[1].start + pair[1].len
            ));
        }
    }
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

/// The bytes a tensor of type `ty` and dimensions `dims` (`ne[0]` first) takes: whole blocks along `ne[0]`.
pub(crate) fn byte_len(ty: GgmlType, dims: &[u64]) -> std::result::Result<u64, String> {
    // A tensor of no dimensions is one element (`ne` all 1).
    let Some((&row, rest)) = dims.split_first() else {
        return ty.row_bytes(1);
    };
    let mut len = ty.row_bytes(row)?;
    for &d in rest {
        len = len
            .checked_mul(d)
            .ok_or_else(|| format!("{} bytes overflow", ty.name()))?;
    }
    Ok(len)
}

/// A GGUF file (version 3) written whole in memory: `metadata` as (key, value type id, the value's bytes), `tensors`
/// as (name, dimensions fastest first, type, the data's bytes), the data aligned to `alignment` (a power of two;
/// `general.alignment` must say so when it is not 32). For tests and synthetic benchmark files: nothing is checked.
pub fn write(
    metadata: &[(&str, u32, Vec<u8>)],
    tensors: &[(&str, Vec<u64>, GgmlType, Vec<u8>)],
    alignment: u64,
) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    let string = |out: &mut Vec<u8>, s: &str| {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    };
    for (key, ty, value) in metadata {
        string(&mut out, key);
        out.extend_from_slice(&ty.to_le_bytes());
        out.extend_from_slice(value);
    }
    let mut offset = 0u64;
    let mut offsets = Vec::new();
    for (name, dims, ty, data) in tensors {
        string(&mut out, name);
        out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&ty.id().to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offsets.push(offset);
        offset = (offset + data.len() as u64).div_ceil(alignment) * alignment;
    }
    let start = (out.len() as u64).div_ceil(alignment) * alignment;
    out.resize(start as usize, 0);
    for ((_, _, _, data), off) in tensors.iter().zip(offsets) {
        out.resize((start + off) as usize, 0);
        out.extend_from_slice(data);
    }
    out
}

#[cfg(test)]
pub(crate) mod tests;
