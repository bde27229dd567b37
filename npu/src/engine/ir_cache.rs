//! The decoder graphs' IR on disk: written once per checkpoint and option set, read back on the next start.
//!
//! Building the decoder graphs of a large checkpoint means reading and compressing every weight and writing the
//! `.bin` the graphs point into (at the 9B's scale, most of a device run's start). With a model cache in use
//! ([`CompileOptions::cache_dir`]), the written IR (`decoder_t{n}.xml` and the one `weights.bin` they share) is kept
//! in `{cache_dir}/ir/{key}/` and the next run with the same key reads it back instead of building; OpenVINO's model
//! cache then serves the compile. The key hashes everything the bytes depend on:
//! - the checkpoint: its config, and each weight file's canonical path, size and modification time (a file
//!   rewritten in place gets a new entry);
//! - the graphs' options (form, context, taps, output scale, weight format) and the prompt block sizes;
//! - the program that builds them: this executable's path, size and modification time, so that a rebuilt binary,
//!   whose graph builder may write other bytes, never reads an entry an older one wrote.
//!
//! An entry appears whole or not at all: it is written into a hidden sibling that is renamed into place once every
//! file is flushed, and read back only if its `identity` file (the text the key hashes) matches. The last
//! [`KEEP`] entries used are kept; older ones are removed when a new one is stored.
//!
//! Because an entry's path names its contents, its graphs are compiled from their paths ([`crate::ov_path`]), which
//! OpenVINO's model cache keys by the path, not by hashing every weight: a cached start never reads `weights.bin`.
//! Each `decoder_t{n}.xml` has a `decoder_t{n}.bin` beside it, a link to `weights.bin`, for OpenVINO's reader.

use crate::devices::{IrPorts, ScratchDir, lock_dir, read_ports};
use crate::error::{Error, Result};
use crate::graphs::Builder;
use crate::ir::SharedBin;
use std::path::{Path, PathBuf};

/// Entries kept in an IR cache (the most recently used): enough for every graph set one `validate` of two block
/// sizes compiles (the deployed graphs, the other block size's, the graphs with taps), so that its next run reads
/// them all back. An entry rebuilt after it was removed is new to OpenVINO's model cache, which knows a graph
/// compiled from its path by the path and the file's time (`crate::ov_path`).
pub const KEEP: usize = 4;

/// One decoder graph's IR on disk.
pub(super) struct IrFile {
    /// Tokens per call.
    pub tokens: usize,
    pub xml: PathBuf,
    pub bin: PathBuf,
    /// Its ports, as the builder made them or as OpenVINO reads them back.
    pub ports: IrPorts,
}

/// The decoder graphs' IR for one run: in the cache, or in a scratch directory removed when this is dropped.
pub(super) struct DecoderIr {
    pub graphs: Vec<IrFile>,
    /// `Some(true)`: read back from the cache; `Some(false)`: built and stored in it; `None`: no cache.
    pub reused: Option<bool>,
    _scratch: Option<ScratchDir>,
}

/// The IR of the decoder graphs for calls of `sizes` tokens: read back from `{cache}/ir/` when an entry for this
/// checkpoint and these options is there, else built (into that cache, or into a scratch directory without one).
pub(super) fn decoder_ir(
    builder: &Builder,
    sizes: &[usize],
    cache: Option<&Path>,
) -> Result<DecoderIr> {
    let Some(cache) = cache else {
        let scratch = ScratchDir::new()?;
        let graphs = build(builder, sizes, &scratch.0)?;
        return Ok(DecoderIr {
            graphs,
            reused: None,
            _scratch: Some(scratch),
        });
    };
    let root = cache.join("ir");
    std::fs::create_dir_all(&root).map_err(|e| Error::io(&root, e))?;
    // One run at a time reads, builds and stores entries: a second run of the same key waits, then reads back what
    // the first stored, instead of removing the entry the first is renaming into place.
    let _lock = lock_dir(&root)?;
    let identity = identity(builder, sizes)?;
    let entry = root.join(format!("{:016x}", fnv1a(identity.as_bytes())));
    if let Some(graphs) = read_back(&entry, &identity, sizes)? {
        touch(&entry);
        return Ok(DecoderIr {
            graphs,
            reused: Some(true),
            _scratch: None,
        });
    }
    let staging = root.join(format!(
        ".{}.partial-{}",
        entry.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(|e| Error::io(&staging, e))?;
    // Removed on an error (dropped) and by a signal's handler ([`reference::temps`]).
    let staging = reference::temps::TempDir::new(&staging);
    let graphs = build(builder, sizes, staging.path())?;
    let id = staging.path().join("identity");
    std::fs::write(&id, &identity).map_err(|e| Error::io(&id, e))?;
    let _ = std::fs::remove_dir_all(&entry);
    std::fs::rename(staging.path(), &entry).map_err(|e| Error::io(&entry, e))?;
    staging.keep();
    prune(&root, &entry);
    // The files now lie in the entry, under the names they were written with.
    let graphs = graphs
        .into_iter()
        .map(|g| IrFile {
            xml: entry.join(g.xml.file_name().unwrap_or_default()),
            bin: entry.join(g.bin.file_name().unwrap_or_default()),
            ..g
        })
        .collect();
    Ok(DecoderIr {
        graphs,
        reused: Some(false),
        _scratch: None,
    })
}

/// Builds the graphs into `dir`: one `weights.bin` every graph streams its constants to, and an `.xml` per size.
fn build(builder: &Builder, sizes: &[usize], dir: &Path) -> Result<Vec<IrFile>> {
    let bin_path = dir.join("weights.bin");
    let bin = SharedBin::create(&bin_path)?;
    let mut graphs = Vec::new();
    for &tokens in sizes {
        let graph = builder.decoder_graph_on(tokens, Some(&bin))?;
        let xml = dir.join(format!("{}.xml", graph.name()));
        let ports = IrPorts::of_graph(&graph);
        graph.save(&xml)?;
        graphs.push(IrFile {
            tokens,
            xml,
            bin: bin_path.clone(),
            ports,
        });
    }
    bin.flush()?;
    for g in &graphs {
        link_stem_bin(&g.xml, &g.bin);
    }
    Ok(graphs)
}

/// Links the `.bin` OpenVINO's IR reader looks for beside `xml` (the same stem: `decoder_t16.bin`) to the shared
/// `bin` of the same directory, so that the graph can be compiled from its path ([`crate::ov_path`]); whether the
/// link is there. A relative link, which moves with its directory. Where links cannot be made (not a Unix
/// system), the graph is compiled from a read model instead.
pub(super) fn link_stem_bin(xml: &Path, bin: &Path) -> bool {
    let stem = xml.with_extension("bin");
    if stem == bin {
        return true;
    }
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if std::fs::symlink_metadata(&stem).is_ok() {
        return same(&stem, bin);
    }
    #[cfg(unix)]
    {
        let Some(target) = bin.file_name() else {
            return false;
        };
        std::os::unix::fs::symlink(target, &stem).is_ok() && same(&stem, bin)
    }
    #[cfg(not(unix))]
    false
}

/// The entry's graphs if it is complete and was written for `identity`.
fn read_back(entry: &Path, identity: &str, sizes: &[usize]) -> Result<Option<Vec<IrFile>>> {
    // The cache's own entry, written by this program (a cache entry is not an input a user names).
    #[allow(clippy::disallowed_methods)]
    let identity_read = std::fs::read_to_string(entry.join("identity"));
    match identity_read {
        Ok(text) if text == identity => {}
        _ => return Ok(None),
    }
    let bin = entry.join("weights.bin");
    let mut graphs = Vec::new();
    for &tokens in sizes {
        let xml = entry.join(format!("decoder_t{tokens}.xml"));
        if !xml.is_file() || !bin.is_file() {
            return Ok(None);
        }
        let ports = read_ports(&xml, &bin)?;
        graphs.push(IrFile {
            tokens,
            xml,
            bin: bin.clone(),
            ports,
        });
    }
    Ok(Some(graphs))
}

/// Everything the IR's bytes depend on, as text (see the module's list).
fn identity(builder: &Builder, sizes: &[usize]) -> Result<String> {
    let mut lines = vec![
        format!("qwen35-parity {} decoder IR", env!("CARGO_PKG_VERSION")),
        format!(
            "program {}",
            file_stamp(
                &std::env::current_exe().map_err(|e| Error::io("the running executable", e))?
            )?
        ),
        format!("config {:?}", builder.config()),
        format!("options {:?}", builder.options()),
        format!("weights {}", builder.weight_format().name()),
        format!("sizes {sizes:?}"),
    ];
    for path in builder.weight_paths() {
        lines.push(format!("file {}", file_stamp(path)?));
    }
    Ok(lines.join("\n") + "\n")
}

/// `path` (canonical), its size and its modification time in nanoseconds.
fn file_stamp(path: &Path) -> Result<String> {
    let canonical = path.canonicalize().map_err(|e| Error::io(path, e))?;
    let meta = std::fs::metadata(&canonical).map_err(|e| Error::io(path, e))?;
    let modified = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Ok(format!("{} {} {modified}", canonical.display(), meta.len()))
}

/// 64-bit FNV-1a: the entry's name (the `identity` file inside it is what is compared), and a model cache's folder
/// name ([`crate::devices::compile`]).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Marks `entry` as just used (its `identity` file's modification time), for [`prune`].
fn touch(entry: &Path) {
    let id = entry.join("identity");
    if let Ok(f) = std::fs::File::options().append(true).open(&id) {
        let _ = f.set_modified(std::time::SystemTime::now());
    }
}

/// Removes all but the [`KEEP`] most recently used entries of `root` (never `keep`, the one just stored).
fn prune(root: &Path, keep: &Path) {
    let Ok(dir) = std::fs::read_dir(root) else {
        return;
    };
    let mut entries: Vec<(std::time::SystemTime, PathBuf)> = dir
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .is_some_and(|n| !n.to_string_lossy().starts_with('.'))
        })
        .filter(|p| p != keep)
        .map(|p| {
            let used = std::fs::metadata(p.join("identity"))
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH);
            (used, p)
        })
        .collect();
    entries.sort_by_key(|e| std::cmp::Reverse(e.0));
    for (_, old) in entries.into_iter().skip(KEEP.saturating_sub(1)) {
        let _ = std::fs::remove_dir_all(old);
    }
}
