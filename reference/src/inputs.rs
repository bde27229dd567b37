//! What a run reads: every file a loader opens (a config, a checkpoint's shards, a tokenizer, an image, a pixel file,
//! a prompt file, a graph set's manifest and the files it names, a device config, a dump) is recorded here by the
//! loader itself ([`record`]), by its canonical path (symlinks, `.` and `..` resolved). Every output is checked
//! against that set when it is created and again when it is put in place ([`refuse_output`]), so that no output
//! ever overwrites a file the run read, whatever flag, manifest entry or environment variable led to it.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// The files read so far: canonical path, and the path as the loader was given it (for messages).
static READ: Mutex<BTreeMap<PathBuf, PathBuf>> = Mutex::new(BTreeMap::new());

/// Whether this process is one run (see [`watch`]).
static WATCHING: AtomicBool = AtomicBool::new(false);

/// Makes this process one run: from now on every file a loader opens is an input that no output may overwrite. The
/// `qwen35` binary calls it first thing. A process that runs many jobs (a test suite, a program using the library)
/// does not: one job's output may be the next job's input, and a set that only grows would refuse it.
pub fn watch() {
    WATCHING.store(true, Ordering::SeqCst);
}

/// Records that the run reads `path` (a file or a directory); nothing unless the process [`watch`]es its inputs.
pub fn record(path: &Path) {
    if !WATCHING.load(Ordering::SeqCst) {
        return;
    }
    let canonical = canonical(path);
    if let Ok(mut read) = READ.lock() {
        read.entry(canonical).or_insert_with(|| path.to_path_buf());
    }
}

/// Every file recorded so far, canonical.
pub fn recorded() -> Vec<PathBuf> {
    READ.lock()
        .map(|r| r.keys().cloned().collect())
        .unwrap_or_default()
}

/// The input an output at `path` would overwrite (`path` itself read, or, for a directory output, a file read
/// inside it), as the loader named it; `None` when writing there touches no input.
pub fn overwritten_by(path: &Path) -> Option<PathBuf> {
    let out = canonical(path);
    let read = READ.lock().ok()?;
    read.iter()
        .find(|(input, _)| **input == out || input.starts_with(&out))
        .map(|(_, given)| given.clone())
}

/// An error when an output at `path` would overwrite an input of this run (see [`overwritten_by`]), naming the
/// input (the caller names the output).
pub fn refuse_output(path: &Path) -> std::io::Result<()> {
    match overwritten_by(path) {
        Some(input) => Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!(
                "it is {}, which this run reads: an output must not overwrite an input",
                input.display()
            ),
        )),
        None => Ok(()),
    }
}

/// `path` absolute and canonical as far as it exists: its nearest existing ancestor canonicalised, the rest
/// appended (`..` taken lexically).
pub fn canonical(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let parts: Vec<Component> = absolute.components().collect();
    for cut in (1..=parts.len()).rev() {
        let head: PathBuf = parts[..cut].iter().collect();
        if let Ok(mut out) = head.canonicalize() {
            for part in &parts[cut..] {
                match part {
                    Component::ParentDir => {
                        out.pop();
                    }
                    Component::Normal(name) => out.push(name),
                    _ => {}
                }
            }
            return out;
        }
    }
    absolute
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_input_is_found_by_any_spelling_and_through_links() {
        let tmp = tempfile::tempdir().unwrap();
        let (d, f) = (tmp.path().join("d"), tmp.path().join("d/in.png"));
        std::fs::create_dir(&d).unwrap();
        std::fs::write(&f, "x").unwrap();
        std::os::unix::fs::symlink(&f, tmp.path().join("link.png")).unwrap();
        watch();
        record(&d.join("./in.png"));
        for out in [
            f.clone(),
            tmp.path().join("link.png"),
            tmp.path().join("d/../d/in.png"),
            d.clone(),
        ] {
            let e = refuse_output(&out).unwrap_err().to_string();
            assert!(e.contains("in.png"), "{e}");
        }
        assert!(refuse_output(&d.join("new.png")).is_ok());
    }
}
