//! What a set's graphs ran, as a run record: the device, the precision that took effect, every property, the graph
//! options and the model cache.

use super::SET_BACKEND;
use crate::devices::{CompileOptions, ExecInfo};
use crate::error::{Error, Result};
use crate::graphs::Builder;
use crate::graphset::GraphSet;
use reference::backend::{Precision, RunRecord};

/// What a set read from files ran: the device, the precision that took effect, every property, the model cache.
pub(crate) fn set_record(
    set: &GraphSet,
    infos: &[&ExecInfo],
    device: &str,
    opts: &CompileOptions,
    seconds: f64,
) -> Result<RunRecord> {
    let info = *infos
        .first()
        .ok_or_else(|| Error::Interface("no compiled graph to describe".into()))?;
    let d = crate::devices::describe(&crate::runtime::core()?, device);
    Ok(RunRecord {
        backend: SET_BACKEND.into(),
        device: Some(device.to_string()),
        runtime: Some(crate::runtime::load()?.version.clone()),
        device_name: Some(d.full_name),
        driver: d.driver_version,
        dtype: "f32".into(),
        precision_requested: Some(Precision::parse(opts.precision.hint())),
        precision: Some(Precision::parse(&info.precision)),
        execution_devices: info.execution_devices.clone(),
        properties: info.properties.clone(),
        weights: set
            .reference_weights
            .clone()
            .unwrap_or_else(|| "as exported".into()),
        deltanet_prefill: "as exported".into(),
        deltanet_decode: "as exported".into(),
        output_scale: 1.0,
        prefill_block: None,
        block: set.decoder_blocks().last().copied(),
        context: set.context,
        taps: false,
        compile_seconds: Some(seconds),
        cache_dir: info.cache_dir.as_ref().map(|d| d.display().to_string()),
        from_cache: infos
            .iter()
            .filter_map(|i| Some((i.graph.clone(), i.loaded_from_cache?)))
            .collect(),
        ir_reused: None,
    })
}

/// What a device ran, from what its graphs were prepared with (`infos`, the first one standing for all but the
/// model cache, which is recorded per graph): the device's own name and driver (OpenVINO devices), the precision
/// that took effect, every property, the graph options, the weight format and the model cache.
pub fn record_of(
    infos: &[&ExecInfo],
    builder: &Builder,
    block: usize,
    opts: &CompileOptions,
) -> Result<RunRecord> {
    let info = *infos
        .first()
        .ok_or_else(|| Error::Interface("no compiled graph to describe".into()))?;
    let sim = crate::sim::NumericModel::is_sim(&info.device);
    let (runtime, device_name, driver) = if sim {
        (
            Some(format!("FP16SIM (qwen35 {})", env!("CARGO_PKG_VERSION"))),
            info.execution_devices.clone(),
            None,
        )
    } else {
        let d = crate::devices::describe(&crate::runtime::core()?, &info.device);
        (
            Some(crate::runtime::load()?.version.clone()),
            Some(d.full_name),
            d.driver_version,
        )
    };
    let graph = builder.options();
    Ok(RunRecord {
        backend: if sim { "fp16sim" } else { "openvino" }.into(),
        device: Some(info.device.clone()),
        runtime,
        device_name,
        driver,
        dtype: "f32".into(),
        precision_requested: Some(Precision::parse(if sim {
            &info.precision
        } else {
            opts.precision.hint()
        })),
        precision: Some(Precision::parse(&info.precision)),
        execution_devices: info.execution_devices.clone(),
        properties: info.properties.clone(),
        weights: builder.weight_format().name(),
        deltanet_prefill: graph.form.describe_block(block),
        deltanet_decode: "matrix".into(),
        output_scale: graph.output_scale as f64,
        prefill_block: None,
        block: Some(block),
        context: Some(graph.context),
        taps: graph.taps,
        compile_seconds: Some(info.compile_seconds),
        cache_dir: info.cache_dir.as_ref().map(|d| d.display().to_string()),
        from_cache: infos
            .iter()
            .filter_map(|i| Some((i.graph.clone(), i.loaded_from_cache?)))
            .collect(),
        ir_reused: None,
    })
}
