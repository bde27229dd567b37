//! The `qwen35` tool's integration tests: one binary (one link, and tests of different topics run side by side), a
//! module per topic. Most run the built binary as a user would.
#![allow(clippy::disallowed_methods)] // tests read their fixtures with std::fs; inputs::open is the library's rule

mod bad_input;
mod bad_input_props;
mod belonging;
mod bench;
mod cli;
#[path = "../common/mod.rs"]
mod common;
mod dump_props;
mod dump_stream;
mod external_ir;
mod faults;
mod fp16_story;
mod full_streams;
mod gguf_faults;
mod gguf_quant_cost;
mod graph_sets;
mod harness;
mod images;
mod llamacpp_device;
mod llamacpp_diff;
mod loader_outputs;
mod low_precision;
mod memory;
mod moe_devices;
mod moe_nan;
mod non_finite;
mod non_finite_props;
mod openvino;
mod outputs;
mod probe_moe;
mod routing;
mod set_images;
mod signals;
mod sizes;
mod thresholds;
mod undefined_null;
mod validate;
mod validate_ir;
mod videos;
