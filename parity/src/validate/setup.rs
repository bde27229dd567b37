//! What ran where: the device section of the report (runtime, device, driver, every graph's precision and
//! execution devices), and the two checks on it: nothing fell back to another device, nothing computed in another
//! precision than the one asked.
//!
//! A silent substitute is the worst kind of pass: NPUW can place a subgraph on the CPU (by configuration, or by its
//! accuracy check's failover, `NPUW_ACC_CHECK`, which moves a subgraph that fails against `NPUW_ACC_DEVICE` there at
//! run time), and the CPU plugin asked for f16 computes bf16 where it has no f16 arithmetic. Either makes a device
//! look right that is not.

use super::{Finding, GraphInfo, details};
use npu::sim::NumericModel;
use reference::backend::{Precision, RunRecord};
use serde::Serialize;
use std::collections::BTreeMap;

/// The device section of the report.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceSection {
    /// The device asked for.
    pub device: String,
    /// The runtime (OpenVINO's version, or FP16SIM's).
    pub runtime: Option<String>,
    /// The device's own name.
    pub device_name: Option<String>,
    /// The driver's version, where reported (NPU).
    pub driver: Option<String>,
    /// Every OpenVINO device present.
    pub available: Vec<String>,
    /// The precision asked (FP16SIM: the one its options give).
    pub precision_requested: Precision,
    /// The precision the deployed graphs read back.
    pub precision: Option<Precision>,
    /// Precisions accepted in place of the one asked (`--allow-precision`).
    pub allowed_precisions: Vec<String>,
    /// Every property set, as the deployed graphs read it back.
    pub properties: BTreeMap<String, String>,
    /// Every graph compiled, in the order compiled.
    pub graphs: Vec<GraphInfo>,
    /// OpenVINO's on-disk model cache directory (`--cache-dir`; on by default for NPU), if one was used (each
    /// graph's `loaded_from_cache` says whether it came from there).
    pub cache_dir: Option<String>,
}

impl DeviceSection {
    /// The section for `device` from the deployed graphs' record and every graph compiled.
    pub fn new(
        device: &str,
        record: &RunRecord,
        graphs: Vec<GraphInfo>,
        allowed: &[String],
    ) -> Self {
        // FP16SIM needs no runtime: the OpenVINO devices are listed when there is one.
        let available = npu::runtime::core()
            .ok()
            .and_then(|c| npu::devices::available(&c).ok())
            .unwrap_or_default();
        DeviceSection {
            device: device.to_string(),
            runtime: record.runtime.clone(),
            device_name: record.device_name.clone(),
            driver: record.driver.clone(),
            available,
            precision_requested: record
                .precision_requested
                .clone()
                .unwrap_or_else(|| record.judged_precision()),
            precision: record.precision.clone(),
            allowed_precisions: allowed.to_vec(),
            properties: record.properties.clone(),
            graphs,
            cache_dir: record.cache_dir.clone(),
        }
    }
}

/// The devices an `EXECUTION_DEVICES` value names that are not among the ones asked (`NPU` asked, `NPU.0` runs:
/// the same; `HETERO:NPU,CPU` asked: both allowed). FP16SIM runs on nothing else.
pub fn foreign_devices(asked: &str, execution: &str) -> Vec<String> {
    if NumericModel::is_sim(asked) {
        return if NumericModel::is_sim(execution.trim()) {
            vec![]
        } else {
            vec![execution.trim().to_string()]
        };
    }
    let base = |d: &str| d.split('.').next().unwrap_or(d).trim().to_uppercase();
    let mut allowed = vec![base(asked.split(':').next().unwrap_or(asked))];
    if let Some((_, list)) = asked.split_once(':') {
        allowed.extend(list.split(',').map(base));
    }
    let mut foreign: Vec<String> = execution
        .split(|c: char| c == ',' || c.is_whitespace() || "()[]\"'".contains(c))
        .filter(|s| !s.is_empty())
        .filter(|d| !allowed.contains(&base(d)))
        .map(str::to_string)
        .collect();
    foreign.dedup();
    foreign
}

/// Whether a property value read back means "on".
fn on(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_uppercase().as_str(),
        "YES" | "TRUE" | "1" | "ON"
    )
}

/// The two setup checks, from what every graph compiled read back: where it ran, and in what precision.
pub fn checks(section: &DeviceSection) -> [super::Check; 2] {
    use super::{Check, CheckId};
    [
        Check::of(CheckId::ExecutionDevices, execution_devices(section), 0.0),
        Check::of(CheckId::Precision, precision(section), 0.0),
    ]
}

/// Every graph ran on the device asked: `EXECUTION_DEVICES` of each names no other device, and NPUW's accuracy
/// check (whose failover would move a failing subgraph at run time, after EXECUTION_DEVICES was read) is off.
pub fn execution_devices(section: &DeviceSection) -> Finding {
    let mut failures = Vec::new();
    let mut notes = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    for g in &section.graphs {
        match &g.execution_devices {
            None => notes.push(format!(
                "graph {} ({}): EXECUTION_DEVICES not reported",
                g.graph, g.purpose
            )),
            Some(list) => {
                if !seen.contains(list) {
                    seen.push(list.clone());
                }
                let foreign = foreign_devices(&section.device, list);
                if !foreign.is_empty() {
                    failures.push(format!(
                        "graph {} ({}) ran on {list}: {} is not {}",
                        g.graph,
                        g.purpose,
                        foreign.join(", "),
                        section.device
                    ));
                }
            }
        }
    }
    if let Some(v) = section.properties.get("NPUW_ACC_CHECK")
        && on(v)
    {
        failures.push(format!(
            "NPUW_ACC_CHECK is {v}: a subgraph that fails NPUW's accuracy check moves to NPUW_ACC_DEVICE at run \
             time, unseen here; validate with it off"
        ));
    }
    let figure = if failures.is_empty() {
        format!(
            "{} graph(s) on {}",
            section.graphs.len(),
            if seen.is_empty() {
                "an unreported device".to_string()
            } else {
                seen.join(" / ")
            }
        )
    } else {
        format!("{} finding(s): see below", failures.len())
    };
    #[derive(Serialize)]
    struct Detail<'a> {
        device: &'a str,
        execution_devices: Vec<String>,
    }
    Finding {
        figure,
        failures,
        notes,
        details: details(&Detail {
            device: &section.device,
            execution_devices: seen,
        }),
        ..Finding::default()
    }
}

/// Every graph computed in the precision asked, or one `--allow-precision` accepts (then noted).
pub fn precision(section: &DeviceSection) -> Finding {
    let requested = section.precision_requested.clone();
    let mut failures = Vec::new();
    let mut notes = Vec::new();
    let mut read_back: Vec<String> = Vec::new();
    for g in &section.graphs {
        if !read_back.contains(&g.precision) {
            read_back.push(g.precision.clone());
        }
    }
    for p in &read_back {
        if Precision::parse(p) == requested
            || section
                .allowed_precisions
                .iter()
                .any(|a| Precision::parse(a) == Precision::parse(p))
        {
            continue;
        }
        let graphs: Vec<String> = section
            .graphs
            .iter()
            .filter(|g| &g.precision == p)
            .map(|g| format!("{} ({})", g.graph, g.purpose))
            .collect();
        let which = if graphs.len() == section.graphs.len() {
            format!("all {} graphs", graphs.len())
        } else if graphs.len() > 3 {
            format!("{}, … ({} graphs)", graphs[..3].join(", "), graphs.len())
        } else {
            graphs.join(", ")
        };
        failures.push(format!(
            "{which} computed in {p}, {requested} was asked (--allow-precision {p} accepts it)"
        ));
    }
    let accepted: Vec<&String> = read_back
        .iter()
        .filter(|p| Precision::parse(p) != requested)
        .collect();
    if failures.is_empty() && !accepted.is_empty() {
        notes.push(format!(
            "{} computed instead of {requested}: accepted by --allow-precision",
            accepted
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if NumericModel::is_sim(&section.device) {
        notes.push(format!(
            "FP16SIM computes what its options say ({}); --precision does not apply",
            section
                .graphs
                .first()
                .and_then(|g| g.execution_devices.clone())
                .unwrap_or_default()
        ));
    }
    let figure = format!(
        "{requested} asked, {} read back on {} graph(s){}",
        read_back.join("/"),
        section.graphs.len(),
        if !accepted.is_empty() && failures.is_empty() {
            " (allowed)"
        } else {
            ""
        }
    );
    #[derive(Serialize)]
    struct Detail {
        requested: Precision,
        read_back: Vec<String>,
        allowed: Vec<String>,
    }
    Finding {
        figure,
        failures,
        notes,
        details: details(&Detail {
            requested,
            read_back,
            allowed: section.allowed_precisions.clone(),
        }),
        ..Finding::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(precision: &str, execution: Option<&str>) -> GraphInfo {
        GraphInfo {
            purpose: "deployed".into(),
            graph: "decoder".into(),
            precision: precision.into(),
            execution_devices: execution.map(str::to_string),
            compile_seconds: 0.0,
            loaded_from_cache: None,
        }
    }

    fn section(device: &str, requested: &str, graphs: Vec<GraphInfo>) -> DeviceSection {
        DeviceSection {
            device: device.into(),
            runtime: None,
            device_name: None,
            driver: None,
            available: vec![],
            precision_requested: Precision::parse(requested),
            precision: None,
            allowed_precisions: vec![],
            properties: BTreeMap::new(),
            graphs,
            cache_dir: None,
        }
    }

    #[test]
    fn a_subgraph_on_another_device_is_named() {
        assert!(foreign_devices("NPU", "NPU").is_empty());
        assert!(foreign_devices("NPU", "NPU.0").is_empty());
        assert_eq!(foreign_devices("NPU", "NPU CPU"), vec!["CPU"]);
        assert_eq!(foreign_devices("NPU", "(NPU, CPU)"), vec!["CPU"]);
        assert!(foreign_devices("HETERO:NPU,CPU", "NPU CPU").is_empty());
        assert_eq!(foreign_devices("GPU", "GPU.1 CPU"), vec!["CPU"]);
        assert!(
            foreign_devices(
                "FP16SIM:ftz=off",
                "FP16SIM:store=f16,ftz=off,acc=f32,state=f16"
            )
            .is_empty()
        );
        assert_eq!(foreign_devices("FP16SIM", "CPU"), vec!["CPU"]);

        let s = section(
            "NPU",
            "f16",
            vec![graph("f16", Some("NPU")), graph("f16", Some("NPU CPU"))],
        );
        let f = execution_devices(&s);
        assert_eq!(f.failures.len(), 1, "{:?}", f.failures);
        assert!(f.failures[0].contains("CPU is not NPU"));
        let mut s = section("NPU", "f16", vec![graph("f16", Some("NPU"))]);
        assert!(execution_devices(&s).failures.is_empty());
        s.properties.insert("NPUW_ACC_CHECK".into(), "YES".into());
        assert!(execution_devices(&s).failures[0].contains("NPUW_ACC_CHECK"));
    }

    #[test]
    fn another_precision_fails_unless_allowed() {
        let mut s = section("CPU", "f16", vec![graph("bf16", Some("CPU"))]);
        let f = precision(&s);
        assert_eq!(f.failures.len(), 1);
        assert!(f.failures[0].contains("bf16") && f.failures[0].contains("--allow-precision"));
        s.allowed_precisions = vec!["bf16".into()];
        let f = precision(&s);
        assert!(f.failures.is_empty());
        assert!(f.notes[0].contains("accepted"));
        assert!(
            precision(&section("CPU", "f32", vec![graph("f32", Some("CPU"))]))
                .failures
                .is_empty()
        );
    }
}
