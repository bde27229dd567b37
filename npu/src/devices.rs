//! Devices, and compiling a graph with explicit options read back after compiling.
//!
//! The CPU plugin's default inference precision may be bf16 (AMX) or f16: a reference run must ask for f32, and a
//! parity report must say what actually ran, so every compile sets the precision explicitly and reads it back.

use crate::error::{Error, Result};
use crate::ir::Graph;
use crate::runtime;
use openvino::{CompiledModel, Core, DeviceType, PropertyKey, RwPropertyKey};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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

/// The inference precision asked of a device (`INFERENCE_PRECISION_HINT`); what actually ran is read back from the
/// compiled model. (Not the reference's dtype, which is f32 or f64.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InferencePrecision {
    /// Full f32 arithmetic (reference runs).
    F32,
    /// Half precision, as an NPU computes.
    F16,
}

impl InferencePrecision {
    /// The property value.
    pub fn hint(self) -> &'static str {
        match self {
            InferencePrecision::F32 => "f32",
            InferencePrecision::F16 => "f16",
        }
    }

    /// Parses a property value (`f32`, `f16`).
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(InferencePrecision::F32),
            "f16" => Ok(InferencePrecision::F16),
            other => Err(Error::Config(format!(
                "inference precision `{other}`: expected f32 or f16"
            ))),
        }
    }
}

/// Everything set on a device before compiling.
#[derive(Debug, Clone, PartialEq)]
pub struct CompileOptions {
    /// `INFERENCE_PRECISION_HINT`.
    pub precision: InferencePrecision,
    /// Further device properties (e.g. NPUW settings), from `--device-config` or `QWEN35_DEVICE_CONFIG`.
    pub device_config: BTreeMap<String, String>,
    /// OpenVINO's on-disk model cache (`CACHE_DIR`): a compiled graph is stored there, keyed by the graph (topology
    /// and weights), the device and the properties, and a later compile of the same graph loads it instead of
    /// compiling. `None`: no cache.
    pub cache_dir: Option<PathBuf>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            precision: InferencePrecision::F32,
            device_config: BTreeMap::new(),
            cache_dir: None,
        }
    }
}

/// Whether `device` caches compiled graphs unless told otherwise: NPUs, whose first compile of a decoder takes
/// minutes (the port measured 187 s on NPU 4000 and up to 40 minutes on NPU 3720, 15-21 s from the cache).
pub fn caches_by_default(device: &str) -> bool {
    device.starts_with("NPU")
}

/// The environment variable holding device configuration as a JSON object.
pub const DEVICE_CONFIG_ENV: &str = "QWEN35_DEVICE_CONFIG";

/// Parses device configuration JSON: a flat object of property names to strings, numbers or booleans.
pub fn parse_device_config(json: &str, source: &str) -> Result<BTreeMap<String, String>> {
    let value: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| Error::Config(format!("{source}: device config is not valid JSON: {e}")))?;
    let obj = value.as_object().ok_or_else(|| {
        Error::Config(format!(
            "{source}: device config must be a JSON object of properties"
        ))
    })?;
    obj.iter()
        .map(|(k, v)| {
            let s = match v {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Number(n) => n.to_string(),
                serde_json::Value::Bool(b) => if *b { "YES" } else { "NO" }.to_string(),
                other => {
                    return Err(Error::Config(format!(
                        "{source}: property `{k}` must be a string, number or boolean, found {other}"
                    )));
                }
            };
            Ok((k.clone(), s))
        })
        .collect()
}

/// Device configuration from a file if given, else from `QWEN35_DEVICE_CONFIG` if set (a JSON object, or the path
/// of a file holding one), else empty.
pub fn device_config(file: Option<&Path>) -> Result<BTreeMap<String, String>> {
    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        return parse_device_config(&text, &path.display().to_string());
    }
    match std::env::var(DEVICE_CONFIG_ENV) {
        Ok(text) if text.trim_start().starts_with('{') => {
            parse_device_config(&text, DEVICE_CONFIG_ENV)
        }
        Ok(path) => {
            let source = format!("{DEVICE_CONFIG_ENV}={path}");
            let text = std::fs::read_to_string(&path).map_err(|e| {
                Error::Config(format!(
                    "{source}: takes a JSON object of device properties or the path of a file holding one; \
                     reading it as a path failed: {e}"
                ))
            })?;
            parse_device_config(&text, &source)
        }
        Err(_) => Ok(BTreeMap::new()),
    }
}

/// A graph compiled for a device by OpenVINO, with the settings that actually took effect.
pub struct Compiled {
    /// The compiled model.
    pub model: CompiledModel,
    /// What took effect.
    pub info: ExecInfo,
}

/// What a graph was prepared with on a device (an OpenVINO device or FP16SIM): the settings that actually took
/// effect and the graph's interface.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecInfo {
    /// The graph's name.
    pub graph: String,
    /// The device it was compiled for.
    pub device: String,
    /// `INFERENCE_PRECISION_HINT` read back from the compiled model (FP16SIM: its storage format).
    pub precision: String,
    /// `EXECUTION_DEVICES` read back, where reported.
    pub execution_devices: Option<String>,
    /// Every requested property as read back from the compiled model.
    pub properties: BTreeMap<String, String>,
    /// Seconds spent reading and compiling (or loading from the cache).
    pub compile_seconds: f64,
    /// The model cache directory used, if any.
    pub cache_dir: Option<PathBuf>,
    /// Whether the compiled graph came from the model cache (`LOADED_FROM_CACHE` read back; `None`: no cache, or
    /// the device does not report it).
    pub loaded_from_cache: Option<bool>,
    /// The graph's input names, in order, as the compiled model reports them.
    pub inputs: Vec<String>,
    /// The graph's output names, in order, as the compiled model reports them.
    pub outputs: Vec<String>,
}

impl ExecInfo {
    /// An error of running this graph: OpenVINO's `message`, with the graph and the device.
    pub fn inference_error(&self, message: String) -> Error {
        Error::OpenVino {
            stage: "inference",
            graph: self.graph.clone(),
            device: self.device.clone(),
            message,
        }
    }
}

/// Compiles one of this project's graphs for `device` with `opts` set explicitly first.
///
/// The graph is consumed: it is written to a private temporary directory and dropped before OpenVINO reads it back
/// (memory-mapping the weights), so the weights are not held twice while compiling.
pub fn compile(
    core: &mut Core,
    graph: Graph,
    device: &str,
    opts: &CompileOptions,
) -> Result<Compiled> {
    require(core, device)?;
    let name = graph.name().to_string();
    let scratch = ScratchDir::new()?;
    let xml_path = scratch.0.join("graph.xml");
    graph.save(&xml_path)?;
    let bin_path = graph.bin_path(&xml_path)?;
    drop(graph);
    // The device copies the weights into its own layout: the `.bin`'s pages are handed back as it reads them.
    let releaser = crate::pages::Releaser::start(
        vec![bin_path.clone()],
        std::time::Duration::from_millis(250),
    );
    let compiled = compile_ir(core, &xml_path, &bin_path, &name, device, opts);
    drop(releaser);
    compiled
}

/// Reads an IR file (`.xml` with its `.bin` beside it) and compiles it for `device` with `opts` set explicitly
/// first; `name` names the graph in errors and reports.
pub fn compile_file(
    core: &mut Core,
    xml_path: &Path,
    name: &str,
    device: &str,
    opts: &CompileOptions,
) -> Result<Compiled> {
    compile_ir(
        core,
        xml_path,
        &xml_path.with_extension("bin"),
        name,
        device,
        opts,
    )
}

/// [`compile_file`] with the weights in `bin_path` (e.g. a `.bin` several graphs share, see
/// [`crate::ir::SharedBin`]).
pub fn compile_ir(
    core: &mut Core,
    xml_path: &Path,
    bin_path: &Path,
    name: &str,
    device: &str,
    opts: &CompileOptions,
) -> Result<Compiled> {
    let start = std::time::Instant::now();
    require(core, device)?;
    let graph_name = name.to_string();
    let ov_err = |stage: &'static str, e: &dyn std::fmt::Display| Error::OpenVino {
        stage,
        graph: graph_name.clone(),
        device: device.to_string(),
        message: openvino_message(e),
    };
    let model = core
        .read_model_from_file(&xml_path.to_string_lossy(), &bin_path.to_string_lossy())
        .map_err(|e| ov_err("reading", &e))?;
    let dev = DeviceType::from(device);
    let requested = requested_properties(device, opts);
    let settings = compile_settings(&requested, opts)?;
    for (k, v) in &settings {
        core.set_property(&dev, &RwPropertyKey::Other(k.clone().into()), v)
            .map_err(|e| Error::Device {
                device: device.to_string(),
                message: format!("refused {k}={v}: {}", openvino_message(&e)),
            })?;
    }
    let compiled = core
        .compile_model(&model, dev)
        .map_err(|e| ov_err("compiling", &e))?;
    let mut info = read_back(name, device, opts, &requested, |key| {
        compiled
            .get_property(&PropertyKey::Other(key.to_string().into()))
            .ok()
            .map(|s| s.into_owned())
    });
    let port_names =
        |count: std::result::Result<usize, openvino::InferenceError>,
         port: &dyn Fn(usize) -> std::result::Result<openvino::Node, openvino::InferenceError>|
         -> Result<Vec<String>> {
            let count = count.map_err(|e| ov_err("compiling", &e))?;
            (0..count)
                .map(|i| {
                    port(i)
                        .and_then(|n| n.get_name())
                        .map_err(|e| ov_err("compiling", &e))
                })
                .collect()
        };
    info.inputs = port_names(compiled.get_input_size(), &|i| {
        compiled.get_input_by_index(i)
    })?;
    info.outputs = port_names(compiled.get_output_size(), &|i| {
        compiled.get_output_by_index(i)
    })?;
    info.compile_seconds = start.elapsed().as_secs_f64();
    Ok(Compiled {
        model: compiled,
        info,
    })
}

/// What is set on the device before compiling: the `requested` properties and the model cache (its directory made).
pub(crate) fn compile_settings(
    requested: &BTreeMap<String, String>,
    opts: &CompileOptions,
) -> Result<Vec<(String, String)>> {
    let mut settings: Vec<(String, String)> = requested.clone().into_iter().collect();
    if let Some(dir) = &opts.cache_dir {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        settings.push((CACHE_DIR.to_string(), dir.to_string_lossy().into_owned()));
    }
    Ok(settings)
}

/// What took effect on graph `name` compiled for `device`, read back through `property` (the compiled model's
/// property by key; `None` where it is not reported): the precision, every `requested` property, the execution
/// devices and whether the model cache served it. Its ports and compile time are the caller's to fill.
pub(crate) fn read_back(
    name: &str,
    device: &str,
    opts: &CompileOptions,
    requested: &BTreeMap<String, String>,
    property: impl Fn(&str) -> Option<String>,
) -> ExecInfo {
    ExecInfo {
        graph: name.to_string(),
        device: device.to_string(),
        precision: property("INFERENCE_PRECISION_HINT").unwrap_or_else(|| "unknown".into()),
        execution_devices: property("EXECUTION_DEVICES"),
        properties: requested
            .keys()
            .map(|k| {
                let v = property(k).unwrap_or_else(|| "(not reported)".into());
                (k.clone(), v)
            })
            .collect(),
        compile_seconds: 0.0,
        cache_dir: opts.cache_dir.clone(),
        loaded_from_cache: opts
            .cache_dir
            .as_ref()
            .and_then(|_| property("LOADED_FROM_CACHE").and_then(|s| parse_flag(&s))),
        inputs: Vec::new(),
        outputs: Vec::new(),
    }
}

/// The properties set on `device` before compiling: the precision, this project's defaults for the device, then
/// the user's device config (which overrides both).
///
/// CPU defaults, both needed for exact reference runs on OpenVINO 2026.4:
/// - `DYNAMIC_QUANTIZATION_GROUP_SIZE=0`: by default the CPU plugin quantizes activations to int8 on the fly when
///   the weights are int4/int8 (moving the tiny model's activations by ~0.5%); an NPU does not.
/// - `SNIPPETS_MODE=DISABLE`: the plugin's snippets tokenization crashes (SIGSEGV) compiling a residual add whose
///   MLP output is also a graph output, at 4 and 8 tokens.
pub fn requested_properties(device: &str, opts: &CompileOptions) -> BTreeMap<String, String> {
    let mut p = BTreeMap::new();
    p.insert(
        "INFERENCE_PRECISION_HINT".to_string(),
        opts.precision.hint().to_string(),
    );
    if device.starts_with("CPU") {
        p.insert(
            "DYNAMIC_QUANTIZATION_GROUP_SIZE".to_string(),
            "0".to_string(),
        );
        p.insert("SNIPPETS_MODE".to_string(), "DISABLE".to_string());
    }
    p.extend(opts.device_config.clone());
    p
}

/// The core property naming the model cache directory.
const CACHE_DIR: &str = "CACHE_DIR";

/// A boolean property as OpenVINO prints it (`YES`/`NO`, `true`/`false`).
fn parse_flag(s: &str) -> Option<bool> {
    match s.trim().to_ascii_uppercase().as_str() {
        "YES" | "TRUE" | "1" => Some(true),
        "NO" | "FALSE" | "0" => Some(false),
        _ => None,
    }
}

/// OpenVINO's error text without its source locations (`Exception from src/….cpp:N:`), on one line.
pub fn openvino_message(e: &dyn std::fmt::Display) -> String {
    let mut text = e.to_string();
    while let Some(start) = text.find("Exception from ") {
        let rest = &text[start..];
        // The location ends at the first `:<digits>:` after the file name.
        let end = rest
            .match_indices(':')
            .find(|(i, _)| {
                let tail = &rest[i + 1..];
                let digits = tail.chars().take_while(char::is_ascii_digit).count();
                digits > 0 && tail[digits..].starts_with(':')
            })
            .map(|(i, _)| {
                let tail = &rest[i + 1..];
                i + 1 + tail.chars().take_while(char::is_ascii_digit).count() + 1
            });
        match end {
            Some(end) => text.replace_range(start..start + end, ""),
            None => break,
        }
    }
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A private temporary directory, removed on drop.
pub(crate) struct ScratchDir(pub(crate) std::path::PathBuf);

impl ScratchDir {
    pub(crate) fn new() -> Result<Self> {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("qwen35-ir-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        Ok(ScratchDir(dir))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One port of an IR as OpenVINO (or the graph builder) reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Its name.
    pub name: String,
    /// Its element type, in OpenVINO's IR names (`f32`, `f16`, `i64`, `i32`, `boolean`, …).
    pub ty: String,
    /// Its dims (`None`: a dynamic dim), or `None` for a dynamic rank.
    pub shape: Option<Vec<Option<usize>>>,
}

/// The inputs and outputs of an IR.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IrPorts {
    /// Inputs, in order.
    pub inputs: Vec<PortInfo>,
    /// Outputs, in order.
    pub outputs: Vec<PortInfo>,
}

impl IrPorts {
    /// The ports of one of this project's graphs, as built.
    pub fn of_graph(graph: &Graph) -> Self {
        let info = |list: Vec<(String, crate::ir::ElemType, Vec<usize>)>| {
            list.into_iter()
                .map(|(name, ty, dims)| PortInfo {
                    name,
                    ty: ty.ir_name().to_string(),
                    shape: Some(dims.into_iter().map(Some).collect()),
                })
                .collect()
        };
        IrPorts {
            inputs: info(graph.inputs()),
            outputs: info(graph.outputs()),
        }
    }

    /// The input called `name`.
    pub fn input(&self, name: &str) -> Option<&PortInfo> {
        self.inputs.iter().find(|p| p.name == name)
    }

    /// The output called `name`.
    pub fn output(&self, name: &str) -> Option<&PortInfo> {
        self.outputs.iter().find(|p| p.name == name)
    }
}

/// OpenVINO's IR name of an element type.
pub fn element_type_name(t: openvino::ElementType) -> String {
    use openvino::ElementType as E;
    match t {
        E::F32 => "f32".into(),
        E::F16 => "f16".into(),
        E::Bf16 => "bf16".into(),
        E::F64 => "f64".into(),
        E::I64 => "i64".into(),
        E::I32 => "i32".into(),
        E::I8 => "i8".into(),
        E::U8 => "u8".into(),
        E::Boolean => "boolean".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// The ports of the IR `xml` (weights `bin`), read without compiling it.
pub fn read_ports(xml: &Path, bin: &Path) -> Result<IrPorts> {
    runtime::load()?;
    let mut core = runtime::core()?;
    let name = xml.display().to_string();
    let err = |e: &dyn std::fmt::Display| Error::OpenVino {
        stage: "reading",
        graph: name.clone(),
        device: "(none)".into(),
        message: openvino_message(e),
    };
    let model = core
        .read_model_from_file(&xml.to_string_lossy(), &bin.to_string_lossy())
        .map_err(|e| err(&e))?;
    let port = |node: openvino::Node| -> Result<PortInfo> {
        let shape = node.get_partial_shape().map_err(|e| err(&e))?;
        let shape = if shape.get_rank().is_dynamic() {
            None
        } else {
            Some(
                shape
                    .get_dimensions()
                    .iter()
                    .map(|d| (!d.is_dynamic()).then_some(d.get_min() as usize))
                    .collect(),
            )
        };
        Ok(PortInfo {
            name: node.get_name().map_err(|e| err(&e))?,
            ty: element_type_name(node.get_element_type().map_err(|e| err(&e))?),
            shape,
        })
    };
    let inputs = (0..model.get_inputs_len().map_err(|e| err(&e))?)
        .map(|i| port(model.get_input_by_index(i).map_err(|e| err(&e))?))
        .collect::<Result<_>>()?;
    let outputs = (0..model.get_outputs_len().map_err(|e| err(&e))?)
        .map(|i| port(model.get_output_by_index(i).map_err(|e| err(&e))?))
        .collect::<Result<_>>()?;
    Ok(IrPorts { inputs, outputs })
}
