//! `qwen35 devices`: the OpenVINO runtime and its devices: names, architecture, NPU driver, precisions.

use super::Outcome;
use anyhow::Result;
use npu::sim::NumericModel;

#[derive(clap::Args)]
/// Arguments of `qwen35 devices`.
pub struct DevicesArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs `qwen35 devices`.
pub fn exec(args: DevicesArgs) -> Result<Outcome> {
    let (version, devices) = npu::devices::list()?;
    let runtime = npu::runtime::load()?;
    if args.json {
        let list: Vec<serde_json::Value> = devices
            .iter()
            .map(|d| {
                serde_json::json!({
                    "name": d.name, "full_name": d.full_name, "architecture": d.architecture,
                    "driver_version": d.driver_version, "capabilities": d.capabilities,
                    "default_precision": d.default_precision,
                })
            })
            .collect();
        let sim = NumericModel::default();
        let out = serde_json::json!({
            "openvino": version, "library": runtime.library.display().to_string(), "devices": list,
            "pseudo_devices": [{"name": npu::sim::DEVICE, "default": sim.to_string(),
                                "options": {"store": "f16|bf16|f32", "ftz": "on|off", "acc": "f32|f16", "state": "f16|f32"}}],
        });
        crate::outln!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(Outcome::Pass);
    }
    crate::outln!("OpenVINO {version} ({})", runtime.library.display());
    for d in devices {
        crate::outln!("{}: {}", d.name, d.full_name);
        if let Some(a) = &d.architecture {
            crate::outln!("  architecture: {a}");
        }
        if let Some(v) = &d.driver_version {
            crate::outln!("  NPU driver: {v}");
        }
        crate::outln!("  capabilities: {}", d.capabilities.join(" "));
        if let Some(p) = &d.default_precision {
            crate::outln!(
                "  default inference precision: {p} (reference runs ask for f32 explicitly)"
            );
        }
    }
    crate::outln!(
        "{}: pseudo-device, an fp16 accelerator's arithmetic applied to the same graphs (no runtime needed)\n  \
         default {}; options store=f16|bf16|f32, ftz=on|off, acc=f32|f16, state=f16|f32, norm=ops|fused",
        npu::sim::DEVICE,
        NumericModel::default()
    );
    Ok(Outcome::Pass)
}
