//! Measuring speed and memory: FLOP counts from the config, the weights a token reads, the process's memory, the
//! machine's own limits.

pub mod flops;
pub mod machine;
pub mod memory;
pub mod vision;
pub mod weights;
