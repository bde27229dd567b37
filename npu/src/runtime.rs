//! Finding and loading the OpenVINO runtime without a system install.
//!
//! Search order: `OPENVINO_LIB` (the path of `libopenvino_c.so*`) if set; else the project-local copy that
//! `scripts/fetch-openvino.sh` unpacks from the pinned PyPI wheel into `third_party/openvino/`; else the usual system
//! locations. The library is loaded once per process.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The project-local runtime directory filled by `scripts/fetch-openvino.sh`.
pub fn project_local_dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../third_party/openvino"
    ))
}

const SYSTEM_DIRS: [&str; 5] = [
    "/opt/intel/openvino/runtime/lib/intel64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/local/lib",
    "/usr/lib",
    "/usr/local/runtime/lib/intel64",
];

/// The loaded runtime.
#[derive(Debug, Clone)]
pub struct Runtime {
    /// The `libopenvino_c` file that was loaded.
    pub library: PathBuf,
    /// OpenVINO's build number (e.g. `2026.4.1-22982-…`).
    pub version: String,
}

/// `libopenvino_c.so` or the highest versioned `libopenvino_c.so.N` in `dir`.
fn library_in(dir: &Path) -> Option<PathBuf> {
    let plain = dir.join("libopenvino_c.so");
    if plain.is_file() {
        return Some(plain);
    }
    let mut versioned: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libopenvino_c.so."))
        })
        .collect();
    versioned.sort();
    versioned.pop()
}

/// Where the runtime would be loaded from, without loading it.
pub fn locate() -> Result<PathBuf> {
    if let Some(value) = std::env::var_os("OPENVINO_LIB") {
        let path = PathBuf::from(&value);
        if path.is_file() {
            return Ok(path);
        }
        if path.is_dir()
            && let Some(lib) = library_in(&path)
        {
            return Ok(lib);
        }
        return Err(Error::Runtime(format!(
            "OPENVINO_LIB={} is not libopenvino_c.so* (nor a directory holding it)",
            path.display()
        )));
    }
    let mut looked = vec![project_local_dir()];
    if let Some(lib) = library_in(&project_local_dir()) {
        return Ok(lib);
    }
    let mut candidates: Vec<PathBuf> = SYSTEM_DIRS.iter().map(PathBuf::from).collect();
    if let Ok(entries) = std::fs::read_dir("/opt/intel") {
        for e in entries.flatten() {
            candidates.push(e.path().join("runtime/lib/intel64"));
        }
    }
    for dir in candidates {
        if let Some(lib) = library_in(&dir) {
            return Ok(lib);
        }
        looked.push(dir);
    }
    Err(Error::Runtime(format!(
        "libopenvino_c.so not found (OPENVINO_LIB is unset; looked in {}). Run scripts/fetch-openvino.sh to fetch \
         the pinned runtime into third_party/openvino/, or set OPENVINO_LIB to the path of libopenvino_c.so.*",
        looked
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

static RUNTIME: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();

/// Loads the runtime (once per process) and reports what was loaded.
pub fn load() -> Result<&'static Runtime> {
    RUNTIME
        .get_or_init(|| {
            let library = locate().map_err(|e| e.to_string())?;
            openvino_sys::library::load_from(&library).map_err(|e| {
                format!(
                    "OpenVINO runtime: loading {} failed: {e}",
                    library.display()
                )
            })?;
            let version = openvino::version().build_number;
            Ok(Runtime { library, version })
        })
        .as_ref()
        .map_err(|e| Error::Runtime(e.trim_start_matches("OpenVINO runtime: ").to_string()))
}

/// A new OpenVINO core, the runtime loaded first.
pub fn core() -> Result<openvino::Core> {
    load()?;
    openvino::Core::new().map_err(|e| Error::Runtime(format!("creating the core failed: {e}")))
}
