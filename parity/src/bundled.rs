//! The bundled tiny model, compiled into the binary so that `qwen35` works wherever it is installed (`cargo install`
//! copies the binary, not the source tree).
//!
//! On first use the files are written to a cache directory named after their content, `qwen35-parity/tiny-{hash}`
//! under `$XDG_CACHE_HOME`, else `$HOME/.cache`, else the system's temporary directory; later runs reuse them.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// The files of `testdata/models/tiny`, by name.
const FILES: [(&str, &[u8]); 5] = [
    (
        "config.json",
        include_bytes!("../../testdata/models/tiny/config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../../testdata/models/tiny/generation_config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../testdata/models/tiny/model.safetensors"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../../testdata/models/tiny/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../testdata/models/tiny/tokenizer_config.json"),
    ),
];

/// 64-bit FNV-1a over every file's name and bytes: a name that changes whenever the content does.
fn fingerprint() -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (name, bytes) in FILES {
        for &b in name.as_bytes().iter().chain(bytes) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The cache root: `$XDG_CACHE_HOME`, else `$HOME/.cache`, else the temporary directory.
pub(crate) fn cache_root() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("XDG_CACHE_HOME")
        .or_else(|| var("HOME").map(|h| h.join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
}

/// Whether `dir` holds every file with its full length.
fn complete(dir: &Path) -> bool {
    FILES.iter().all(|(name, bytes)| {
        std::fs::metadata(dir.join(name)).is_ok_and(|m| m.len() == bytes.len() as u64)
    })
}

/// The directory holding the bundled model, written there first if needed.
pub fn model_dir() -> Result<PathBuf> {
    let dir = cache_root()
        .join("qwen35-parity")
        .join(format!("tiny-{:016x}", fingerprint()));
    if !complete(&dir) {
        write_to(&dir).with_context(|| {
            format!(
                "writing the bundled tiny model to {} (pass --model DIR to use a checkpoint directory instead)",
                dir.display()
            )
        })?;
    }
    Ok(dir)
}

/// Writes the files into a fresh sibling directory and renames it into place, so a reader never sees a partial copy.
fn write_to(dir: &Path) -> Result<()> {
    let parent = dir.parent().context("the cache directory has no parent")?;
    std::fs::create_dir_all(parent)?;
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("tiny");
    let staging = parent.join(format!(".{name}.{}", std::process::id()));
    std::fs::create_dir_all(&staging)?;
    // Removed on an error (a full disk: dropped) and by a signal's handler ([`reference::temps`]).
    let staging = reference::temps::TempDir::new(&staging);
    for (file, bytes) in FILES {
        std::fs::write(staging.path().join(file), bytes)?;
    }
    if std::fs::rename(staging.path(), dir).is_err() {
        // Another process won the race, or an incomplete copy is in the way.
        if complete(dir) {
            return Ok(());
        }
        std::fs::remove_dir_all(dir)?;
        std::fs::rename(staging.path(), dir)?;
    }
    staging.keep();
    Ok(())
}
