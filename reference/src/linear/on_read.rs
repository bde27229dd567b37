//! A matrix kept as the checkpoint stores it and quantised a row at a time when read: the embedding of a compressed
//! run, of which a lookup reads a few rows. Quantisation is per row (one scale per row, or per group of a row), so a
//! row quantised alone has exactly the codes and scales it has in the whole matrix's: the values are those of the
//! packed matrix, without holding its codes (the 9B's INT8 embedding is 1.0 GB).

use super::{MappedMatrix, PackedMatrix};
use crate::error::{Error, Result};
use crate::quant::{QuantKind, QuantizedMatrix, quantize_as};
use candle_core::{Device, Tensor};
use std::ops::Range;

/// A matrix read in place and quantised as `kind` row by row when read.
#[derive(Debug, Clone)]
pub struct QuantizedOnRead {
    map: MappedMatrix,
    kind: QuantKind,
}

impl QuantizedOnRead {
    /// `map` quantised as `kind` when read.
    pub fn new(map: MappedMatrix, kind: QuantKind) -> Self {
        QuantizedOnRead { map, kind }
    }

    /// The codes and scales of rows `r`.
    fn quantize(&self, r: Range<usize>) -> Result<QuantizedMatrix> {
        let cols = self.map.cols();
        quantize_as(
            &self.map.rows_f32(r.start, r.len()),
            r.len(),
            cols,
            self.kind,
        )
    }

    /// Hands back the pages of the rows read so far ([`MappedMatrix::release_pages`]).
    pub fn release_pages(&self) {
        self.map.release_pages();
    }

    /// The rows `ids`, quantised and dequantised, `[ids.len(), cols]`; an id outside the matrix is an error.
    pub fn gather(&self, ids: &[u32]) -> Result<Tensor> {
        let (rows, cols) = (self.map.rows(), self.map.cols());
        let mut out = Vec::with_capacity(ids.len() * cols);
        for &id in ids {
            let r = id as usize;
            if r >= rows {
                return Err(Error::Input(format!(
                    "row {r} is outside a matrix of {rows} rows"
                )));
            }
            out.extend(self.quantize(r..r + 1)?.dequantize());
        }
        Ok(Tensor::from_vec(out, (ids.len(), cols), &Device::Cpu)?)
    }

    /// The whole matrix packed (a full copy of its codes): for a product, which reads every row.
    pub fn packed(&self) -> Result<PackedMatrix> {
        let (rows, cols) = (self.map.rows(), self.map.cols());
        let block = ((1 << 20) / cols.max(1)).max(1);
        PackedMatrix::from_row_blocks(self.kind, rows, cols, block, |r| self.quantize(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::{Elem, SharedMap};

    #[test]
    fn a_row_quantised_alone_has_the_whole_matrix_values() {
        let (rows, cols) = (9, 64);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 250.0 - 2.0) * (1 + i % 5) as f32)
            .collect();
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect();
        let map =
            MappedMatrix::new(&SharedMap::from_vec(bytes), 0, rows, cols, Elem::Bf16).unwrap();
        let widened = map.rows_f32(0, rows);
        for kind in [QuantKind::Int8Sym, QuantKind::Int4Sym { group: 16 }] {
            let whole = quantize_as(&widened, rows, cols, kind)
                .unwrap()
                .dequantize();
            let m = QuantizedOnRead::new(map.clone(), kind);
            let ids = [3u32, 0, 8, 3];
            let got: Vec<f32> = m
                .gather(&ids)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            for (k, &id) in ids.iter().enumerate() {
                let r = id as usize;
                let (a, b) = (
                    &got[k * cols..(k + 1) * cols],
                    &whole[r * cols..(r + 1) * cols],
                );
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{kind:?} row {r}"
                );
            }
            let all: Vec<f32> = m
                .packed()
                .unwrap()
                .to_tensor()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!(
                all.iter()
                    .zip(&whole)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{kind:?} packed"
            );
            assert!(
                m.gather(&[rows as u32]).is_err(),
                "a row past the matrix is refused"
            );
        }
    }
}
