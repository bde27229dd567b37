//! The OpenVINO side of qwen35-parity: finding the runtime, querying devices, compiling with explicit options, the
//! static NPU-style graphs of the Qwen3.5 decoder written as OpenVINO IR, and graphs made elsewhere (an external
//! stateful IR such as optimum-intel's export) as a backend.
#![deny(missing_docs)]

pub mod devices;
pub mod engine;
pub mod error;
pub mod external;
pub mod graphs;
pub mod infer;
pub mod ir;
pub mod pages;
pub mod runtime;
pub mod sim;

pub use error::{Error, Result};
