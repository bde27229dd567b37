//! `qwen35 devices`: the OpenVINO runtime and its devices: names, architecture, NPU driver, precisions.

use crate::commands::Outcome;
use anyhow::Result;

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
        let out = serde_json::json!({
            "openvino": version, "library": runtime.library.display().to_string(), "devices": list
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(Outcome::Pass);
    }
    println!("OpenVINO {version} ({})", runtime.library.display());
    for d in devices {
        println!("{}: {}", d.name, d.full_name);
        if let Some(a) = &d.architecture {
            println!("  architecture: {a}");
        }
        if let Some(v) = &d.driver_version {
            println!("  NPU driver: {v}");
        }
        println!("  capabilities: {}", d.capabilities.join(" "));
        if let Some(p) = &d.default_precision {
            println!("  default inference precision: {p} (reference runs ask for f32 explicitly)");
        }
    }
    Ok(Outcome::Pass)
}
