//! Devices, and compiling a graph with explicit options read back after compiling.
//!
//! The CPU plugin's default inference precision may be bf16 (AMX) or f16: a reference run must ask for f32, and a
//! parity report must say what actually ran, so every compile sets the precision explicitly and reads it back.
//!
//! This file lists the devices and checks that one is there; `options.rs` holds what is asked of a device,
//! `compile.rs` the compiling and what is read back, `ports.rs` an IR's inputs and outputs.

mod compile;
mod options;
mod ports;

pub use compile::{Compiled, ExecInfo, compile, compile_file, compile_ir, openvino_message};
pub(crate) use compile::{ScratchDir, compile_settings, lock_cache, lock_dir, read_back};
pub use options::{
    CompileOptions, DEVICE_CONFIG_ENV, InferencePrecision, caches_by_default, device_config,
    parse_device_config, requested_properties,
};
pub use ports::{IrPorts, PortInfo, element_type_name, read_ports};

use crate::error::{Error, Result};
use crate::runtime;
use openvino::{Core, DeviceType, PropertyKey};

/// What a device reports about itself.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    /// The device name (`CPU`, `GPU.0`, `NPU`).
    pub name: String,
    /// `FULL_DEVICE_NAME`.
    pub full_name: String,
    /// `DEVICE_ARCHITECTURE`, where reported.
    pub architecture: Option<String>,
    /// `NPU_DRIVER_VERSION` (NPU only).
    pub driver_version: Option<String>,
    /// `OPTIMIZATION_CAPABILITIES` (e.g. `FP32 FP16 INT8`).
    pub capabilities: Vec<String>,
    /// The default `INFERENCE_PRECISION_HINT`, where reported.
    pub default_precision: Option<String>,
}

fn property(core: &Core, device: &str, key: &str) -> Option<String> {
    core.get_property(
        &DeviceType::from(device),
        &PropertyKey::Other(key.to_string().into()),
    )
    .ok()
    .filter(|s| !s.is_empty())
}

/// The OpenVINO version and every available device.
pub fn list() -> Result<(String, Vec<DeviceInfo>)> {
    let rt = runtime::load()?;
    let core = runtime::core()?;
    let names = available(&core)?;
    let infos = names.iter().map(|name| describe(&core, name)).collect();
    Ok((rt.version.clone(), infos))
}

/// What `device` reports about itself.
pub fn describe(core: &Core, name: &str) -> DeviceInfo {
    DeviceInfo {
        name: name.to_string(),
        full_name: property(core, name, "FULL_DEVICE_NAME").unwrap_or_else(|| name.to_string()),
        architecture: property(core, name, "DEVICE_ARCHITECTURE"),
        driver_version: if name.starts_with("NPU") {
            property(core, name, "NPU_DRIVER_VERSION")
        } else {
            None
        },
        capabilities: property(core, name, "OPTIMIZATION_CAPABILITIES")
            .map(|s| s.split_whitespace().map(str::to_string).collect())
            .unwrap_or_default(),
        default_precision: property(core, name, "INFERENCE_PRECISION_HINT"),
    }
}

/// Names of the available devices.
pub fn available(core: &Core) -> Result<Vec<String>> {
    let devices = core
        .available_devices()
        .map_err(|e| Error::Runtime(format!("listing devices failed: {e}")))?;
    Ok(devices.iter().map(|d| d.to_string()).collect())
}

/// Fails unless `device` (or, for `GPU`, some `GPU.N`) is available, naming those that are.
pub fn require(core: &Core, device: &str) -> Result<()> {
    let names = available(core)?;
    if device.trim().is_empty() {
        return Err(Error::Device {
            device: device.to_string(),
            message: format!("no device named (available: {})", names.join(", ")),
        });
    }
    let base = device.split('.').next().unwrap_or(device);
    if names
        .iter()
        .any(|n| n == device || n.split('.').next() == Some(device) || n == base)
    {
        return Ok(());
    }
    Err(Error::Device {
        device: device.to_string(),
        message: format!(
            "not available on this machine (available: {})",
            names.join(", ")
        ),
    })
}
