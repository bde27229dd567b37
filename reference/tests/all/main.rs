//! The reference's integration tests: one binary, a module per topic.

mod common;
mod conventions;
mod deltanet;
mod goldens;
mod model;
mod precision;
mod quant;
mod rope;
