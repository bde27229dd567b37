//! Compiling a graph for a device with its options set explicitly first, and reading back what took effect (the
//! precision, every requested property, the execution devices, whether the model cache served it, the ports).

use super::{CompileOptions, requested_properties, require};
use crate::error::{Error, Result};
use crate::ir::Graph;
use openvino::{CompiledModel, Core, DeviceType, PropertyKey, RwPropertyKey};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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
    let settings = compile_settings(device, &requested, opts)?;
    let _lock = lock_cache(opts)?;
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

/// What is set on `device` before compiling: the `requested` properties and the model cache (its directory made):
/// the folder of [`cache_folder`] inside the cache directory.
pub(crate) fn compile_settings(
    device: &str,
    requested: &BTreeMap<String, String>,
    opts: &CompileOptions,
) -> Result<Vec<(String, String)>> {
    let mut settings: Vec<(String, String)> = requested.clone().into_iter().collect();
    if let Some(dir) = &opts.cache_dir {
        let dir = dir.join(cache_folder(device, requested));
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        settings.push((CACHE_DIR.to_string(), dir.to_string_lossy().into_owned()));
    }
    Ok(settings)
}

/// The folder of a model cache that holds the graphs compiled for `device` with `requested` properties, e.g.
/// `CPU-5d0c…`: OpenVINO keys a cached graph by the graph and the device, not by the properties set on the device
/// beforehand, so a shared folder served the graphs compiled at f32 to a run that asked for f16 (all 16 loaded
/// from the cache, figures those of f32) and would serve any device setting's graphs to another's.
pub(crate) fn cache_folder(device: &str, requested: &BTreeMap<String, String>) -> String {
    let identity: String = std::iter::once(device.to_string())
        .chain(requested.iter().map(|(k, v)| format!("{k}={v}")))
        .collect::<Vec<_>>()
        .join("\n");
    let name: String = device
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!(
        "{name}-{:016x}",
        crate::engine::ir_cache::fnv1a(identity.as_bytes())
    )
}

/// An exclusive lock on a model cache directory, held while a graph is compiled into it (released on drop): OpenVINO
/// writes its `.blob` files without a lock of its own, and two runs storing the same blob at once fail one of them
/// ("cannot set permissions … .blob"). `None` without a cache.
pub(crate) struct CacheLock(#[allow(dead_code)] std::fs::File);

/// Takes the lock of `opts`'s model cache directory (a `.qwen35.lock` file in it), waiting for another run
/// compiling into it to finish.
pub(crate) fn lock_cache(opts: &CompileOptions) -> Result<Option<CacheLock>> {
    opts.cache_dir
        .as_deref()
        .map(|dir| lock_dir(dir).map(CacheLock))
        .transpose()
}

/// An exclusive lock on `{dir}/.qwen35.lock` (the directory made), waited for.
pub(crate) fn lock_dir(dir: &Path) -> Result<std::fs::File> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let path = dir.join(".qwen35.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io(&path, e))?;
    file.lock().map_err(|e| Error::io(&path, e))?;
    Ok(file)
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
        // Removed by a signal's handler too ([`reference::temps`]).
        reference::temps::register(&dir);
        Ok(ScratchDir(dir))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        reference::temps::forget(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_device_and_property_set_has_a_cache_folder_of_its_own() {
        let props = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let f32 = props(&[("INFERENCE_PRECISION_HINT", "f32")]);
        let f16 = props(&[("INFERENCE_PRECISION_HINT", "f16")]);
        let more = props(&[("INFERENCE_PRECISION_HINT", "f32"), ("NUM_STREAMS", "1")]);
        let a = cache_folder("CPU", &f32);
        assert_eq!(a, cache_folder("CPU", &f32), "not stable");
        assert!(a.starts_with("CPU-"), "{a}");
        let others = [
            cache_folder("CPU", &f16),
            cache_folder("CPU", &more),
            cache_folder("NPU", &f32),
            cache_folder("GPU.1", &f32),
        ];
        for o in &others {
            assert_ne!(&a, o);
            assert!(
                o.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
                "{o}"
            );
        }
        assert!(cache_folder("HETERO:NPU,CPU", &f32).starts_with("HETERO_NPU_CPU-"));
    }
}
