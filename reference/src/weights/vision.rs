//! The vision tower's tensors (`model.visual.*`, see [`crate::schema::vision`]): read as the checkpoint stores them,
//! converted exactly to the run's dtype. The store's [`crate::quant::WeightFormat`] compresses the decoder only.

use super::WeightStore;
use crate::error::Result;
use crate::linear::{Elem, Linear, MappedMatrix};
use crate::schema::vision::VisionTensor;
use candle_core::{DType, Tensor};
use safetensors::tensor::Dtype as StDtype;

impl WeightStore {
    /// A vision tensor, checked against the shape its spec gives and converted exactly to the store's dtype.
    pub fn vision_tensor(&self, spec: &VisionTensor) -> Result<Tensor> {
        let name = spec.full_name();
        let raw = self.raw(&name, &spec.shape, &spec.keys())?;
        self.exact(&raw, &spec.shape)
    }

    /// A vision matrix `[out, in]`, viewed as `[rows, cols]` (the patch Conv3d's `[Hv, C, Tp, P, P]` as
    /// `[Hv, C·Tp·P·P]`): read in place from the mapped checkpoint in an f32 run when stored as bf16, f16 or f32,
    /// converted exactly otherwise.
    pub fn vision_matrix(&self, spec: &VisionTensor, rows: usize, cols: usize) -> Result<Linear> {
        let name = spec.full_name();
        let raw = self.raw(&name, &spec.shape, &spec.keys())?;
        if rows * cols != spec.shape.iter().product::<usize>() {
            return Err(raw.err(format!(
                "{:?} cannot be viewed as a [{rows}, {cols}] matrix",
                spec.shape
            )));
        }
        let elem = match raw.dtype {
            StDtype::BF16 => Some(Elem::Bf16),
            StDtype::F16 => Some(Elem::F16),
            StDtype::F32 => Some(Elem::F32),
            _ => None,
        };
        if let (Some(elem), DType::F32) = (elem, self.dtype) {
            let file = raw.file;
            let info = file.info(&name).expect("checked by raw");
            let m = MappedMatrix::new(&file.mmap, file.start(info), rows, cols, elem)
                .map_err(|e| raw.err(e.to_string()))?;
            return Ok(Linear::Mapped(m));
        }
        Ok(Linear::Dense(
            self.exact(&raw, &spec.shape)?.reshape((rows, cols))?,
        ))
    }
}
