//! The compressed matrices of a store whose format quantises or rounds them: packed INT4/INT8 codes and scales, or
//! f16-rounded values, built from the mapped checkpoint a block of rows at a time (the pages read handed back after
//! each block), never from a whole-tensor f32 copy.

use super::{Raw, WeightStore};
use crate::error::{Error, Result};
use crate::linear::{Elem, Linear, MappedMatrix, PackedMatrix, QuantizedOnRead, SharedMap};
use crate::quant::{
    QuantKind, QuantizedMatrix, Storage, quantize_int4_sym, quantize_int8_sym, round_f16,
};
use crate::schema::TensorSpec;
use candle_core::DType;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use safetensors::tensor::Dtype as StDtype;

impl WeightStore {
    /// An embedding table: [`WeightStore::linear`], but a quantised one in an f32 run is read in place and quantised
    /// a row at a time as it is looked up ([`Linear::OnRead`], the same values as the packed codes) when the
    /// checkpoint stores it as bf16, f16 or f32. Not for a table that is also the LM head (tied), which every
    /// forward call multiplies whole.
    pub fn embedding(&self, spec: &TensorSpec) -> Result<Linear> {
        match self.on_read(spec)? {
            Some(m) => Ok(Linear::OnRead(m)),
            None => self.linear(spec),
        }
    }

    /// The quantised matrix read in place, when [`WeightStore::embedding`] can quantise it on read.
    pub(super) fn on_read(&self, spec: &TensorSpec) -> Result<Option<QuantizedOnRead>> {
        let kind = match self.storage(spec) {
            Storage::Int4Sym { group } => QuantKind::Int4Sym { group },
            Storage::Int8Sym => QuantKind::Int8Sym,
            _ => return Ok(None),
        };
        let full_name = self.full_name(spec);
        let raw = self.raw(&full_name, &spec.shape, &spec.param.shape_keys())?;
        let elem = match raw.dtype {
            StDtype::BF16 => Elem::Bf16,
            StDtype::F16 => Elem::F16,
            StDtype::F32 => Elem::F32,
            _ => return Ok(None),
        };
        let &[rows, cols] = spec.shape.as_slice() else {
            return Ok(None);
        };
        if self.dtype != DType::F32 {
            return Ok(None);
        }
        let m = MappedMatrix::new(&raw.file.mmap, raw.start(), rows, cols, elem)
            .map_err(|e| raw.err(e.to_string()))?;
        Ok(Some(QuantizedOnRead::new(m, kind)))
    }

    /// Rows per block when a matrix is quantised or rounded a block at a time (about 1 M values: 4 MB of f32).
    pub(super) fn block_rows(cols: usize) -> usize {
        ((1 << 20) / cols.max(1)).max(1)
    }

    /// A quantised matrix as codes and scales, quantised from the checkpoint bytes a block of rows at a time (in
    /// parallel); the codes are those of [`WeightStore::quantized`] (quantisation is per row or per group of a row).
    pub(super) fn packed(
        &self,
        spec: &TensorSpec,
        rows: usize,
        cols: usize,
    ) -> Result<PackedMatrix> {
        let full_name = self.full_name(spec);
        let raw = self.raw(&full_name, &spec.shape, &spec.param.shape_keys())?;
        let kind = match self.storage(spec) {
            Storage::Int4Sym { group } => QuantKind::Int4Sym { group },
            Storage::Int8Sym => QuantKind::Int8Sym,
            other => {
                return Err(raw.err(format!(
                    "the {} format stores this tensor as {other:?}, not quantised",
                    self.format
                )));
            }
        };
        let packed = PackedMatrix::from_row_blocks(kind, rows, cols, Self::block_rows(cols), |r| {
            let q = self
                .quantized_rows(spec, r.clone())?
                .ok_or_else(|| raw.err("not quantised under this format".into()))?;
            raw.rows(r, rows).release();
            Ok(q)
        })
        .map_err(|e| match e {
            Error::Input(m) => raw.err(m),
            e => e,
        })?;
        Ok(packed)
    }

    /// A matrix rounded to f16 (as [`WeightStore::load`] rounds it), held as f16 bytes and read by the f16 matvec;
    /// rounded from the checkpoint bytes a block of rows at a time (in parallel).
    pub(super) fn rounded_f16(
        &self,
        spec: &TensorSpec,
        rows: usize,
        cols: usize,
    ) -> Result<MappedMatrix> {
        let full_name = self.full_name(spec);
        let raw = self.raw(&full_name, &spec.shape, &spec.param.shape_keys())?;
        let block = Self::block_rows(cols);
        let mut bytes = vec![0u8; rows * cols * 2];
        bytes
            .par_chunks_mut((block * cols * 2).max(1))
            .enumerate()
            .try_for_each(|(b, dst)| -> Result<()> {
                let start = b * block;
                let part = raw.rows(start..start + dst.len() / 2 / cols.max(1), rows);
                if part.dtype == StDtype::F64 {
                    for (v, out) in part.values_f64()?.into_iter().zip(dst.chunks_exact_mut(2)) {
                        out.copy_from_slice(&round_f16(v).to_le_bytes());
                    }
                } else {
                    // bf16, f16 and f32 values are exact in f32, so rounding them from f32 (vectorised, after the
                    // same clamp to ±65504) gives round_f16's results.
                    let mut v = part.values_f32()?;
                    let max = f32::from(half::f16::MAX);
                    for x in &mut v {
                        *x = x.clamp(-max, max);
                    }
                    let mut h = vec![half::f16::ZERO; v.len()];
                    h.convert_from_f32_slice(&v);
                    for (x, out) in h.iter().zip(dst.chunks_exact_mut(2)) {
                        out.copy_from_slice(&x.to_le_bytes());
                    }
                }
                part.release();
                Ok(())
            })?;
        MappedMatrix::new(&SharedMap::from_vec(bytes), 0, rows, cols, Elem::F16)
            .map_err(|e| raw.err(e.to_string()))
    }

    /// The codes and scales of a tensor the store's format quantises (`None` when it stays float or f16): the
    /// constants an OpenVINO graph stores so that `f32(code) · f32(scale)` equals what [`WeightStore::load`] returns.
    pub fn quantized(&self, spec: &TensorSpec) -> Result<Option<QuantizedMatrix>> {
        let full_name = self.full_name(spec);
        let raw = self.raw(&full_name, &spec.shape, &spec.param.shape_keys())?;
        if self.storage(spec).is_quantized() {
            self.quantize(&raw, spec).map(Some)
        } else {
            Ok(None)
        }
    }

    /// [`WeightStore::quantized`] for the rows `rows` of the matrix only: quantisation is per row (one scale per row
    /// or per group of a row), so these are exactly those rows of the whole tensor's codes and scales. Lets a large
    /// tensor be compressed in pieces, never whole in f32.
    pub fn quantized_rows(
        &self,
        spec: &TensorSpec,
        rows: std::ops::Range<usize>,
    ) -> Result<Option<QuantizedMatrix>> {
        let full_name = self.full_name(spec);
        let raw = self.raw(&full_name, &spec.shape, &spec.param.shape_keys())?;
        if !self.storage(spec).is_quantized() {
            return Ok(None);
        }
        let total = spec.shape.first().copied().unwrap_or(0);
        if rows.start > rows.end || rows.end > total {
            return Err(raw.err(format!("rows {rows:?} of a tensor of {total} rows")));
        }
        let mut shape = spec.shape.clone();
        shape[0] = rows.len();
        let part = raw.rows(rows, total);
        let part_spec = TensorSpec {
            shape,
            ..spec.clone()
        };
        self.quantize(&part, &part_spec).map(Some)
    }

    /// Quantises a tensor as the store's format prescribes for it: a matrix `[out, in]`, or a conv kernel
    /// `[C, 1, K]` as the matrix `[C, K]` (one row per channel).
    pub(super) fn quantize(&self, raw: &Raw, spec: &TensorSpec) -> Result<QuantizedMatrix> {
        let shape = spec.shape.as_slice();
        let (rows, cols) = match *shape {
            [rows, cols] => (rows, cols),
            [rows, 1, cols] => (rows, cols),
            _ => {
                return Err(raw.err(format!(
                    "only matrices and [C, 1, K] kernels are quantised, this one has shape {shape:?}"
                )));
            }
        };
        let w = raw.values_f32()?;
        let q = match self.storage(spec) {
            Storage::Int4Sym { group } => quantize_int4_sym(&w, rows, cols, group),
            Storage::Int8Sym => quantize_int8_sym(&w, rows, cols),
            other => {
                return Err(raw.err(format!(
                    "the {} format stores this tensor as {other:?}, not quantised",
                    self.format
                )));
            }
        };
        q.map_err(|e| raw.err(format!("{} quantisation: {e}", self.format)))
    }
}
