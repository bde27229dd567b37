//! The OpenVINO side's integration tests: one binary (one link, and tests of different topics run side by side),
//! a module per topic.
#![allow(clippy::disallowed_methods)] // tests read their fixtures with std::fs; inputs::open is the library's rule

mod common;
mod decoder;
mod deltanet_graph;
mod external;
mod fp16sim;
mod fp16sim_kernels;
mod fp16sim_oracle;
mod graph_sets;
mod ir_cache;
mod ir_ops;
mod layers;
mod manifest_props;
mod moe;
mod shared_bin;
mod vision;
