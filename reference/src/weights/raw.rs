//! One tensor's bytes in its shard ([`Raw`]) and their exact conversions.

use super::ShardFile;
use crate::error::{Error, Result};
use safetensors::tensor::Dtype as StDtype;

/// Decodes little-endian elements of `N` bytes each (exact widening conversions only).
pub(super) fn decode<const N: usize, T>(bytes: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            f(a)
        })
        .collect()
}

/// One tensor's bytes in its shard, shape and size already checked.
pub(super) struct Raw<'a> {
    pub(super) file: &'a ShardFile,
    pub(super) name: &'a str,
    pub(super) dtype: StDtype,
    pub(super) bytes: &'a [u8],
}

impl Raw<'_> {
    pub(super) fn err(&self, message: String) -> Error {
        Error::Weights {
            file: self.file.path.display().to_string(),
            key: self.name.to_string(),
            message,
        }
    }

    /// Rows `rows` of a tensor of `total` rows (a range already checked against `total`).
    pub(super) fn rows(&self, rows: std::ops::Range<usize>, total: usize) -> Raw<'_> {
        let row_bytes = self.bytes.len() / total.max(1);
        Raw {
            bytes: &self.bytes[rows.start * row_bytes..rows.end * row_bytes],
            file: self.file,
            name: self.name,
            dtype: self.dtype,
        }
    }

    /// Hands back the resident pages of these bytes in the shard's map (read once, converted: see
    /// [`SharedMap::release`]).
    pub(super) fn release(&self) {
        let start = self.bytes.as_ptr() as usize - self.file.mmap.bytes().as_ptr() as usize;
        self.file.mmap.release(start..start + self.bytes.len());
    }

    pub(super) fn unsupported(&self, dtype: StDtype) -> Error {
        self.err(format!(
            "dtype {dtype:?} is not a supported weight type (bf16, f16, f32, f64)"
        ))
    }

    /// The values in f32, as the compressor sees them: exact from bf16, f16 and f32, rounded to nearest from f64.
    pub(super) fn values_f32(&self) -> Result<Vec<f32>> {
        let b = self.bytes;
        Ok(match self.dtype {
            StDtype::F32 => decode::<4, f32>(b, f32::from_le_bytes),
            StDtype::F64 => decode::<8, f32>(b, |x| f64::from_le_bytes(x) as f32),
            StDtype::BF16 => decode::<2, f32>(b, |x| half::bf16::from_le_bytes(x).to_f32()),
            StDtype::F16 => decode::<2, f32>(b, |x| half::f16::from_le_bytes(x).to_f32()),
            other => return Err(self.unsupported(other)),
        })
    }

    /// The values in f64 (exact from every supported dtype).
    pub(super) fn values_f64(&self) -> Result<Vec<f64>> {
        let b = self.bytes;
        Ok(match self.dtype {
            StDtype::F32 => decode::<4, f64>(b, |x| f32::from_le_bytes(x) as f64),
            StDtype::F64 => decode::<8, f64>(b, f64::from_le_bytes),
            StDtype::BF16 => decode::<2, f64>(b, |x| half::bf16::from_le_bytes(x).to_f64()),
            StDtype::F16 => decode::<2, f64>(b, |x| half::f16::from_le_bytes(x).to_f64()),
            other => return Err(self.unsupported(other)),
        })
    }
}
