//! Safetensors files this project writes (dumps, synthetic checkpoints): tensors in their own dtypes plus string
//! metadata. Reading checkpoints is [`crate::weights`]' job.

use crate::error::{Error, Result};
use candle_core::DType;
use candle_core::Tensor;
use safetensors::tensor::{Dtype as StDtype, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Writes tensors (each in its own dtype: f32, f64, f16, bf16, i64 or u32) and string metadata to a safetensors
/// file.
pub fn save_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, Tensor>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let err = |message: String| Error::Weights {
        file: path.display().to_string(),
        key: "(write)".into(),
        message,
    };
    let mut encoded: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> =
        Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let (dtype, bytes) = tensor_bytes(t)?.ok_or_else(|| {
            err(format!(
                "tensor `{name}`: cannot write dtype {:?}",
                t.dtype()
            ))
        })?;
        encoded.push((name.clone(), dtype, t.dims().to_vec(), bytes));
    }
    let views = encoded
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| err(format!("tensor `{name}`: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta: HashMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let meta = if meta.is_empty() { None } else { Some(meta) };
    safetensors::serialize_to_file(views, meta, path).map_err(|e| err(e.to_string()))
}

/// A tensor's values as safetensors stores them (little-endian, row-major) with its safetensors dtype, for f32, f64,
/// f16, bf16, i64 and u32 tensors (`None` for another dtype).
pub fn tensor_bytes(t: &Tensor) -> Result<Option<(StDtype, Vec<u8>)>> {
    let flat = t.flatten_all()?;
    Ok(Some(match t.dtype() {
        DType::F32 => (
            StDtype::F32,
            le_bytes(flat.to_vec1::<f32>()?, f32::to_le_bytes),
        ),
        DType::F64 => (
            StDtype::F64,
            le_bytes(flat.to_vec1::<f64>()?, f64::to_le_bytes),
        ),
        DType::F16 => (
            StDtype::F16,
            le_bytes(flat.to_vec1::<half::f16>()?, half::f16::to_le_bytes),
        ),
        DType::BF16 => (
            StDtype::BF16,
            le_bytes(flat.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
        ),
        DType::I64 => (
            StDtype::I64,
            le_bytes(flat.to_vec1::<i64>()?, i64::to_le_bytes),
        ),
        DType::U32 => (
            StDtype::U32,
            le_bytes(flat.to_vec1::<u32>()?, u32::to_le_bytes),
        ),
        _ => return Ok(None),
    }))
}

fn le_bytes<T, const N: usize>(values: Vec<T>, f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    values.into_iter().flat_map(f).collect()
}
