//! The OpenVINO side of qwen35-parity: finding the runtime, querying devices, compiling with explicit options, the
//! static NPU-style graphs of the Qwen3.5 decoder written as OpenVINO IR, and graph sets (this project's own, or
//! made elsewhere: a porter's explicit-cache graphs, optimum-intel's stateful export, it made stateless) run through
//! one engine as a backend.
#![deny(missing_docs)]
// Unit tests read their own fixtures with std::fs; the library itself opens inputs only through reference::inputs.
#![cfg_attr(test, allow(clippy::disallowed_methods))]
pub mod devices;
pub mod engine;
pub mod error;
pub mod external;
pub mod graphs;
pub mod graphset;
pub mod infer;
pub mod ir;
pub mod memory;
pub mod ov_path;
pub mod pages;
pub mod runtime;
pub mod sim;

pub use error::{Error, Result};
