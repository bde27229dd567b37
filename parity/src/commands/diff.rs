//! `qwen35 diff A.safetensors B.safetensors`: two dumps in the documented format (from any backend or program)
//! compared with the metrics and reports of compare-devices, `B` being the reference.

use crate::commands::Outcome;
use crate::commands::compare_devices::ThresholdArgs;
use crate::compare::{DeviceReport, Row, Side, compare_runs};
use crate::dump::Dump;
use crate::metrics::TensorError;
use crate::report::{CompareReport, Inputs, Machine, ReportArgs};
use anyhow::{Context, Result, bail};
use reference::backend::RunRecord;
use reference::config::LayerKind;
use reference::taps::names;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Arguments of `qwen35 diff`.
#[derive(clap::Args)]
pub struct DiffArgs {
    /// The dump under test.
    actual: PathBuf,
    /// The reference dump.
    reference: PathBuf,
    #[command(flatten)]
    thresholds: ThresholdArgs,
    #[command(flatten)]
    report: ReportArgs,
}

/// The token ids of a dump's i64 tensor.
fn ids(d: &Dump, name: &str, path: &std::path::Path) -> Result<Vec<u32>> {
    let t = d.get(name).with_context(|| path.display().to_string())?;
    Ok(t.to_dtype(candle_core::DType::I64)?
        .to_vec1::<i64>()?
        .into_iter()
        .map(|x| x as u32)
        .collect())
}

/// The layer kinds a dump's names imply: a layer with `linear_attn` taps or a conv state is linear attention, one
/// with `self_attn` taps or a KV cache full attention.
fn kinds(d: &Dump) -> Result<Vec<LayerKind>> {
    let mut out = Vec::new();
    for layer in 0.. {
        if !d.tensors.contains_key(&names::layer(layer, names::OUTPUT)) {
            break;
        }
        let has = |part: &str| {
            let prefix = names::layer(layer, part);
            d.tensors.keys().any(|k| k.starts_with(&prefix))
        };
        out.push(if has(names::LINEAR_ATTN) || has(names::CONV_STATE) {
            LayerKind::Linear
        } else if has(names::SELF_ATTN) || has(names::KEY_CACHE) {
            LayerKind::Full
        } else {
            bail!(
                "cannot tell layer {layer}'s kind: it has neither linear_attn nor self_attn tensors"
            );
        });
    }
    Ok(out)
}

/// What ran, from a dump's metadata (absent keys stay empty).
pub fn record_of(d: &Dump) -> RunRecord {
    let m = &d.metadata;
    let get = |k: &str| m.get(k).cloned();
    let num = |k: &str| m.get(k).and_then(|v| v.parse::<f64>().ok());
    let int = |k: &str| m.get(k).and_then(|v| v.parse::<usize>().ok());
    RunRecord {
        backend: get("backend").unwrap_or_else(|| "unknown".into()),
        device: get("device"),
        runtime: get("openvino"),
        device_name: get("device_name"),
        driver: get("driver"),
        dtype: get("dtype").unwrap_or_else(|| "f32".into()),
        precision_requested: get("precision_requested"),
        precision: get("precision").or_else(|| get("dtype")),
        execution_devices: get("execution_devices"),
        properties: m
            .iter()
            .filter_map(|(k, v)| {
                k.strip_prefix("property.")
                    .map(|p| (p.to_string(), v.clone()))
            })
            .collect(),
        weights: get("weights").unwrap_or_default(),
        deltanet_prefill: get("deltanet_prefill").unwrap_or_default(),
        deltanet_decode: get("deltanet_decode").unwrap_or_default(),
        output_scale: num("output_scale").unwrap_or(1.0),
        prefill_block: int("prefill_block"),
        block: int("block"),
        context: int("context"),
        taps: true,
        compile_seconds: num("compile_seconds"),
        cache_dir: get("cache_dir"),
        from_cache: m
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("from_cache.")?.to_string(), v == "true")))
            .collect(),
    }
}

/// Runs `qwen35 diff`.
pub fn exec(args: DiffArgs) -> Result<Outcome> {
    args.thresholds.validate()?;
    args.report.check()?;
    let a = Dump::read(&args.actual)?;
    let b = Dump::read(&args.reference)?;
    let (ids_a, ids_b) = (
        ids(&a, "token_ids", &args.actual)?,
        ids(&b, "token_ids", &args.reference)?,
    );
    if ids_a != ids_b {
        bail!(
            "{} and {} ran different prompts ({} and {} tokens, first difference at {})",
            args.actual.display(),
            args.reference.display(),
            ids_a.len(),
            ids_b.len(),
            ids_a
                .iter()
                .zip(&ids_b)
                .position(|(x, y)| x != y)
                .unwrap_or(ids_a.len().min(ids_b.len()))
        );
    }
    let kinds_a = kinds(&a).with_context(|| args.actual.display().to_string())?;
    let kinds_b = kinds(&b).with_context(|| args.reference.display().to_string())?;
    if kinds_a != kinds_b {
        bail!(
            "the two dumps are of different models ({} and {} layers, or other layer kinds)",
            kinds_a.len(),
            kinds_b.len()
        );
    }
    let generated = |d: &Dump, p: &std::path::Path| -> Result<Vec<u32>> {
        if d.tensors.contains_key("generated") {
            ids(d, "generated", p)
        } else {
            Ok(vec![])
        }
    };
    let (gen_a, gen_b) = (
        generated(&a, &args.actual)?,
        generated(&b, &args.reference)?,
    );
    let split = |d: &Dump| -> (
        BTreeMap<String, candle_core::Tensor>,
        BTreeMap<String, candle_core::Tensor>,
    ) {
        d.tensors
            .iter()
            .filter(|(k, _)| {
                k.as_str() != "token_ids"
                    && k.as_str() != "generated"
                    && k.as_str() != names::LOGITS
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .partition(|(k, _)| {
                !(k.ends_with(names::CONV_STATE)
                    || k.ends_with(names::RECURRENT_STATE)
                    || k.ends_with(names::KEY_CACHE)
                    || k.ends_with(names::VALUE_CACHE))
            })
    };
    let ((taps_a, states_a), (taps_b, states_b)) = (split(&a), split(&b));
    let label = args
        .actual
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("actual")
        .to_string();
    let comparison = compare_runs(
        &label,
        &kinds_b,
        Side {
            prompt_tokens: ids_b.len(),
            tokens: &gen_b,
            logits: b.get(names::LOGITS)?,
            taps: &taps_b,
            states: &states_b,
        },
        Side {
            prompt_tokens: ids_a.len(),
            tokens: &gen_a,
            logits: a.get(names::LOGITS)?,
            taps: &taps_a,
            states: &states_a,
        },
        &[],
    )?;
    let record = record_of(&a);
    let precision = record.precision.clone().unwrap_or_else(|| "f32".into());
    let thresholds = args.thresholds.resolve(&precision);
    let mut device = DeviceReport::new(&label, record, thresholds, vec![comparison]);
    // Every tensor both dumps hold, and those only one has.
    for (name, ta) in &a.tensors {
        if let Some(tb) = b.tensors.get(name)
            && name != "token_ids"
            && name != "generated"
        {
            device.tensors.push(Row {
                name: name.clone(),
                layer: None,
                error: TensorError::of(ta, tb).with_context(|| format!("`{name}`"))?,
            });
        }
    }
    device.only_in_actual = a
        .tensors
        .keys()
        .filter(|k| !b.tensors.contains_key(*k))
        .cloned()
        .collect();
    device.only_in_reference = b
        .tensors
        .keys()
        .filter(|k| !a.tensors.contains_key(*k))
        .cloned()
        .collect();
    let report = CompareReport {
        command: "diff".into(),
        machine: Machine::detect(),
        inputs: Inputs {
            model: b
                .metadata
                .get("model")
                .cloned()
                .unwrap_or_else(|| args.reference.display().to_string()),
            weights: b.metadata.get("weights").cloned().unwrap_or_default(),
            prompts: vec![(label, ids_a.len())],
            tokens: gen_b.len(),
            reference: record_of(&b),
        },
        quantization: None,
        devices: vec![device],
    };
    report.emit(&args.report)?;
    Ok(if report.passed() {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}
