//! The reference's integration tests: one binary, a module per topic.
#![allow(clippy::disallowed_methods)] // tests read their fixtures with std::fs; inputs::open is the library's rule

mod common;
mod conventions;
mod deltanet;
mod deltanet_kernel;
mod fp16_output;
mod gguf;
mod gguf_decode;
mod gguf_packed;
mod goldens;
mod long_prompt;
mod manifest;
mod model;
mod moe;
mod nncf;
mod packed;
mod precision;
mod prompt_kernel;
mod quant;
mod quant_kernels;
mod record;
mod rope;
mod store;
mod strong_decay;
mod synth;
mod synth_moe;
mod vision;
