//! The weight store's side of [`Arithmetic`]: which arithmetic a run models, and each GGUF weight's `vec_dot_type`
//! (of the ggml type the store read as it opened the file: [`WeightStore::ggml_type`]) wrapped around the matrix
//! [`WeightStore::linear`] hands out ([`Linear::RoundedInput`]).

use super::WeightStore;
use crate::error::{Error, Result};
use crate::gguf::arith::{Arithmetic, InputRounding};
use crate::linear::Linear;
use crate::quant::WeightFormat;
use crate::schema::TensorSpec;
use candle_core::DType;

impl WeightStore {
    /// Sets how the reference computes on these weights. [`Arithmetic::LlamaCpp`] models llama.cpp's CPU on a
    /// GGUF's own ggml types (see [`crate::gguf::arith`]): refused, naming the model, for a safetensors checkpoint
    /// (no ggml types to model), for weights compressed by `--weights` (not the file's types), for f64 runs
    /// (llama.cpp computes in f32) and for a GGUF opened with every tensor decoded ([`WeightStore::open_expanded`]:
    /// its types are not kept).
    pub fn set_arithmetic(&mut self, arithmetic: Arithmetic) -> Result<()> {
        if arithmetic == Arithmetic::LlamaCpp {
            let refuse = |why: String| {
                Err(Error::Input(format!(
                    "arithmetic {}: {why}",
                    Arithmetic::LlamaCpp.name()
                )))
            };
            let Some(gguf) = crate::gguf::find(&self.dir)? else {
                return refuse(format!(
                    "{} is a safetensors checkpoint, not a GGUF file: it has no ggml types whose llama.cpp \
                     arithmetic could be modelled",
                    self.dir.display()
                ));
            };
            if self.format != WeightFormat::F32 {
                return refuse(format!(
                    "the weights are compressed as {} here, not the GGUF's own types",
                    self.format.name()
                ));
            }
            if self.dtype != DType::F32 {
                return refuse(format!("llama.cpp computes in f32, not {:?}", self.dtype));
            }
            if self.gguf.is_none() {
                return refuse(format!(
                    "{} was opened with every tensor decoded to f32: its ggml types are not kept",
                    gguf.display()
                ));
            }
        }
        self.arithmetic = arithmetic;
        Ok(())
    }

    /// How the reference computes on these weights.
    pub fn arithmetic(&self) -> Arithmetic {
        self.arithmetic
    }

    /// `weight` with its input rounded as llama.cpp's CPU converts it for this tensor's ggml type, under
    /// [`Arithmetic::LlamaCpp`]; unchanged otherwise.
    pub(super) fn rounded_input(&self, spec: &TensorSpec, weight: Linear) -> Result<Linear> {
        if self.arithmetic != Arithmetic::LlamaCpp {
            return Ok(weight);
        }
        let name = self.full_name(spec);
        let err = |message: String| Error::Weights {
            file: self.dir.display().to_string(),
            key: name.clone(),
            message,
        };
        let Some(ty) = self.ggml_type(spec) else {
            return Err(err(
                "not a tensor of the GGUF file, so its ggml type is unknown".into(),
            ));
        };
        let matrix = match &weight {
            Linear::Gguf(m) => Some(m),
            _ => None,
        };
        let rounding = InputRounding::of(ty, matrix).map_err(err)?;
        Ok(Linear::RoundedInput(rounding, Box::new(weight)))
    }
}
