//! A pure-Rust CPU reference of the Qwen3.5 hybrid decoder (Gated DeltaNet + gated full attention), built on
//! candle, computing in f32 (or f64 on request) and exposing every intermediate a parity harness needs.
//!
//! Layout: [`config`] reads `config.json`; [`schema`] lists every decoder tensor (name, shape, role) once;
//! [`weights`] opens safetensors checkpoints and [`quant`] compresses their weights as the OpenVINO exports do;
//! [`deltanet`] holds the delta rule in all its forms as pure functions; [`linear_attn`], [`attention`], [`mlp`],
//! [`moe`] (the MoE decoder's sparse block) and [`rope`] are the blocks, their weights [`linear`] layers read in
//! place; [`model`] assembles the decoder with a separate [`model::State`], handing back the checkpoint pages it
//! reads as [`pages`] says; [`taps`] records intermediates under the dump's names; [`backend`] is the interface
//! every backend implements, with the one greedy loop; [`masks`] are the causal masks and bands the reference and the
//! OpenVINO graphs share; [`io`] writes safetensors files; [`tokenizer`] encodes prompts through the checkpoint's
//! chat template; [`vision`] is the vision tower and a multimodal prompt's positions.
#![deny(missing_docs)]
// Unit tests read their own fixtures with std::fs; the library itself opens inputs only through reference::inputs.
#![cfg_attr(test, allow(clippy::disallowed_methods))]
pub mod attention;
pub mod backend;
pub mod compare;
pub mod config;
pub mod deltanet;
pub mod error;
pub mod gguf;
pub mod inputs;
pub mod io;
pub mod linear;
pub mod linear_attn;
pub mod masks;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod ops;
pub mod pages;
pub mod quant;
pub mod rope;
pub mod schema;
pub mod synth;
pub mod synthetic;
pub mod taps;
pub mod temps;
pub mod tokenizer;
pub mod vision;
pub mod weights;

pub use config::{Config, LayerKind};
pub use error::{Error, Result};
pub use model::{LayerState, Model, RunOptions, State};
pub use taps::Taps;
