//! What a run reads: every file a loader opens (a config, a checkpoint's shards, a tokenizer, an image, a pixel file,
//! a prompt file, a graph set's manifest and the files it names, a device config, a dump) is recorded here by the
//! loader itself ([`record`]), by its canonical path (symlinks, `.` and `..` resolved). Every output is checked
//! against that set when it is created and again when it is put in place ([`refuse_output`]), so that no output
//! ever overwrites a file the run read, whatever flag, manifest entry or environment variable led to it.
//!
//! Loaders open their files only through [`open`], [`read`] and [`read_to_string`] (clippy's `disallowed-methods`
//! refuses `std::fs::read`, `read_to_string` and `File::open` elsewhere), which record the file and refuse what is
//! not a regular file: a FIFO or a terminal would block the run forever, a directory or a device is never a
//! config, a checkpoint or an image.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// The files read so far: canonical path, and the path as the loader was given it (for messages).
static READ: Mutex<BTreeMap<PathBuf, PathBuf>> = Mutex::new(BTreeMap::new());

/// The outputs this run will write, planned before any work ([`plan_output`]): canonical path, how the user named
/// it (`--json r.json`), and whether the command writes it as a whole directory.
static PLANNED: Mutex<Vec<(PathBuf, String, bool)>> = Mutex::new(Vec::new());

/// Whether this process is one run (see [`watch`]).
static WATCHING: AtomicBool = AtomicBool::new(false);

/// Makes this process one run: from now on every file a loader opens is an input that no output may overwrite. The
/// `qwen35` binary calls it first thing. A process that runs many jobs (a test suite, a program using the library)
/// does not: one job's output may be the next job's input, and a set that only grows would refuse it.
pub fn watch() {
    WATCHING.store(true, Ordering::SeqCst);
}

/// Records that the run reads `path` (a file or a directory); nothing unless the process [`watch`]es its inputs. An
/// error when a planned output ([`plan_output`]) would overwrite it: the loader opening its file is the moment a run
/// learns what it reads (a manifest's graphs, the model a manifest names, a device config from the environment),
/// and it comes before the work, so the run stops there rather than when it writes.
fn record(path: &Path) -> std::io::Result<()> {
    if !WATCHING.load(Ordering::SeqCst) {
        return Ok(());
    }
    let canonical = canonical(path);
    if let Some(named) = planned_over(&canonical) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!(
                "the output {named} would overwrite it, and this run reads it: an output must not overwrite an \
                 input (refused before any work)"
            ),
        ));
    }
    if let Ok(mut read) = READ.lock() {
        read.entry(canonical).or_insert_with(|| path.to_path_buf());
    }
    Ok(())
}

/// The planned output that would overwrite the input `canonical`: the same path, or a directory written whole that
/// holds it.
fn planned_over(canonical: &Path) -> Option<String> {
    let planned = PLANNED.lock().ok()?;
    planned
        .iter()
        .find(|(out, _, whole_dir)| out == canonical || (*whole_dir && canonical.starts_with(out)))
        .map(|(_, named, _)| named.clone())
}

/// Plans an output of this run, before any work: from now on a loader that opens `path` (or, for a directory the
/// command writes whole, a file in it) fails, naming the output as `named` (the flag and the path as given). An
/// error when a file already read is that output. Nothing unless the process [`watch`]es its inputs.
pub fn plan_output(path: &Path, named: &str, whole_dir: bool) -> std::io::Result<()> {
    if !WATCHING.load(Ordering::SeqCst) {
        return Ok(());
    }
    let out = canonical(path);
    if let Some(input) = overwritten_by(path) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!(
                "{named}: it is {}, which this run reads: an output must not overwrite an input (refused before \
                 any work)",
                input.display()
            ),
        ));
    }
    if let Ok(mut planned) = PLANNED.lock() {
        planned.push((out, named.to_string(), whole_dir));
    }
    Ok(())
}

/// An error unless `path` (followed through links) is a regular file.
fn regular(path: &Path) -> std::io::Result<()> {
    let kind = std::fs::metadata(path)?.file_type();
    if kind.is_file() {
        return Ok(());
    }
    let what = if kind.is_dir() {
        "a directory"
    } else {
        kind_of_special(&kind)
    };
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("not a regular file but {what}: an input is read from a file"),
    ))
}

/// Names a file type that is neither a regular file nor a directory.
fn kind_of_special(kind: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return "a FIFO (named pipe), which would block the run until something writes to it";
        }
        if kind.is_socket() {
            return "a socket";
        }
        if kind.is_char_device() {
            return "a character device";
        }
        if kind.is_block_device() {
            return "a block device";
        }
    }
    let _ = kind;
    "a special file"
}

/// Records `path`, an input another library opens (a graph's `.xml` and `.bin` read by OpenVINO), refused unless
/// a regular file.
pub fn declare(path: &Path) -> std::io::Result<()> {
    record(path)?;
    regular(path)
}

/// Opens `path`, an input, for reading: recorded (see [`record`]) and refused unless a regular file.
#[allow(clippy::disallowed_methods)] // the one place inputs are opened
pub fn open(path: &Path) -> std::io::Result<std::fs::File> {
    record(path)?;
    regular(path)?;
    std::fs::File::open(path)
}

/// The bytes of `path`, an input (see [`open`]).
pub fn read(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut open(path)?, &mut bytes)?;
    Ok(bytes)
}

/// The text of `path`, an input (see [`open`]); an error when it is not UTF-8.
pub fn read_to_string(path: &Path) -> std::io::Result<String> {
    let mut text = String::new();
    std::io::Read::read_to_string(&mut open(path)?, &mut text)?;
    Ok(text)
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
        record(&d.join("./in.png")).unwrap();
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

    #[test]
    fn only_a_regular_file_is_opened_as_an_input() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("f.json");
        std::fs::write(&f, "{}").unwrap();
        std::os::unix::fs::symlink(&f, tmp.path().join("link.json")).unwrap();
        assert_eq!(read_to_string(&tmp.path().join("link.json")).unwrap(), "{}");
        let fifo = tmp.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.unwrap().success());
        std::os::unix::fs::symlink(&fifo, tmp.path().join("to-fifo")).unwrap();
        for (path, says) in [
            (fifo.clone(), "FIFO"),
            (tmp.path().join("to-fifo"), "FIFO"),
            (tmp.path().to_path_buf(), "directory"),
            (std::path::PathBuf::from("/dev/null"), "character device"),
        ] {
            // Would block forever on the FIFO if it were opened.
            let e = read(&path).unwrap_err().to_string();
            assert!(e.contains(says), "{}: {e}", path.display());
        }
    }
}
