//! FP16SIM: an accelerator's arithmetic applied to this project's own graphs, for everyone without an NPU.
//!
//! The graphs an NPU gets are evaluated by [`eval::Evaluator`] under a [`NumericModel`] (by default: values stored
//! in fp16, subnormals flushed to zero, matrix-product terms rounded to fp16 and summed in f32, states kept in fp16),
//! wherever a device is named: `--device FP16SIM`, or `FP16SIM:store=bf16,ftz=off,acc=f16,state=f32`. With
//! `store=f32,ftz=off` nothing is rounded and it is a second executor of the graphs, independent of OpenVINO.

pub mod eval;
mod norms;
pub mod numeric;
mod ops;

pub use numeric::{DEVICE, NumericModel};
