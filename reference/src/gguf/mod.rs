//! GGUF checkpoints, as llama.cpp writes them: [`types`] names every ggml tensor type with its block size. The
//! container reader, the decoders of each type (`decode`), and the mapping of a GGUF's metadata, tensors and
//! vocabulary onto the reference's config, checkpoint names and tokenizer join this module as they land.

pub mod decode;
pub mod file;
pub mod types;

pub use types::GgmlType;
