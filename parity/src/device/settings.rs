//! The settings this project's graphs are built and compiled with, resolved from the command line before any work.

use npu::devices::CompileOptions;
use npu::graphs::GraphOptions;

/// How this project's graphs are built and compiled for one device.
#[derive(Debug, Clone)]
pub struct DeviceSettings {
    /// Device name (an OpenVINO device, or `FP16SIM[:options]`).
    pub device: String,
    /// Tokens per prompt block.
    pub block: usize,
    /// Graph options (the DeltaNet form, the output rescaling, the static context; taps are set per use).
    pub graph: GraphOptions,
    /// Compile options (precision, device config, model cache).
    pub compile: CompileOptions,
}
