//! Finding and loading the OpenVINO runtime without a system install.
//!
//! Search order: `OPENVINO_LIB` (the path of `libopenvino_c.so*`, or a directory holding it) if set; else a
//! `third_party/openvino/` directory (where `scripts/fetch-openvino.sh` unpacks the pinned PyPI wheel) beside the
//! running executable or in one of its parent directories (a checkout's `target/release/qwen35` finds its own copy);
//! else the checkout this crate was built from; else the usual system locations. An error lists every place looked
//! at. The library is loaded once per process.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Where `scripts/fetch-openvino.sh` puts the runtime, relative to a checkout's root.
const PROJECT_LOCAL: &str = "third_party/openvino";

/// The project-local runtime directory of the checkout this crate was built from.
pub fn project_local_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(PROJECT_LOCAL)
}

/// `third_party/openvino` beside the running executable and in each of its parent directories.
fn beside_executable() -> Vec<PathBuf> {
    let Ok(exe) = std::env::current_exe() else {
        return vec![];
    };
    exe.ancestors()
        .skip(1)
        .map(|dir| dir.join(PROJECT_LOCAL))
        .collect()
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
    let exe_dirs = beside_executable();
    let mut looked: Vec<String> = match std::env::current_exe() {
        Ok(exe) => vec![format!(
            "{PROJECT_LOCAL} beside {} and in its parent directories",
            exe.display()
        )],
        Err(_) => vec![],
    };
    let mut others: Vec<PathBuf> = vec![project_local_dir()];
    others.extend(SYSTEM_DIRS.iter().map(PathBuf::from));
    if let Ok(entries) = std::fs::read_dir("/opt/intel") {
        for e in entries.flatten() {
            others.push(e.path().join("runtime/lib/intel64"));
        }
    }
    if let Some(lib) = exe_dirs.iter().find_map(|dir| library_in(dir)) {
        return Ok(lib);
    }
    for dir in others {
        if let Some(lib) = library_in(&dir) {
            return Ok(lib);
        }
        looked.push(dir.display().to_string());
    }
    Err(Error::Runtime(format!(
        "libopenvino_c.so not found (OPENVINO_LIB is unset; looked in {}). Run scripts/fetch-openvino.sh to fetch \
         the pinned runtime into third_party/openvino/, or set OPENVINO_LIB to the path of libopenvino_c.so.*",
        looked.join(", ")
    )))
}

/// Functions of OpenVINO's C API every run calls: a library without them is not `libopenvino_c` (the C++
/// `libopenvino.so` beside it, or another library), and openvino-sys would panic at the first call.
const REQUIRED_SYMBOLS: [&str; 5] = [
    "ov_get_openvino_version",
    "ov_core_create",
    "ov_core_read_model",
    "ov_core_compile_model",
    "ov_infer_request_infer",
];

/// Fails unless `library` loads and exports [`REQUIRED_SYMBOLS`], naming where the path came from.
fn check_symbols(library: &Path) -> std::result::Result<(), String> {
    let origin = if std::env::var_os("OPENVINO_LIB").is_some() {
        "OPENVINO_LIB"
    } else {
        "the runtime found"
    };
    // SAFETY: loading runs the library's initialisers; the file is the one the user (or the search) chose as the
    // OpenVINO runtime, which is then loaded anyway.
    let lib = unsafe { libloading::Library::new(library) }
        .map_err(|e| format!("{origin}: {} cannot be loaded: {e}", library.display()))?;
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .iter()
        .copied()
        .filter(|name| {
            // SAFETY: only the symbol's presence is checked; it is never called through this pointer.
            unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err()
        })
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "{origin}: {} is not OpenVINO's C API library (it has no {}); point OPENVINO_LIB at \
             libopenvino_c.so.* (not the C++ libopenvino.so beside it), or unset it to use \
             scripts/fetch-openvino.sh's copy",
            library.display(),
            missing.join(", ")
        ));
    }
    Ok(())
}

static RUNTIME: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();

/// Loads the runtime (once per process) and reports what was loaded.
pub fn load() -> Result<&'static Runtime> {
    RUNTIME
        .get_or_init(|| {
            let library = locate().map_err(|e| e.to_string())?;
            check_symbols(&library)?;
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
