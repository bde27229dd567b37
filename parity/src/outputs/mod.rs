//! The files and directories a command reads and writes, checked before any work starts: an output never overwrites
//! an input or another output, and every output can be created where it is asked for. Then how outputs are written:
//! files whole or not at all ([`write`], through [`reference::io::AtomicFile`]: a sibling renamed into place, the
//! mode from the umask), directories likewise ([`StagedDir`]).
//!
//! Paths are compared once resolved ([`resolve`]): an existing path canonicalised (symlinks, `.`, `..`), one not
//! there yet as its nearest existing ancestor canonicalised with the rest appended, so that `a`, `./a`, `d/../a` and
//! a link to `a` are one file. An output is refused when it is
//! - an input, or holds one (a directory output);
//! - something that already exists inside an input directory: a directory (`--model`, `--ir`) is read by its files,
//!   the checkpoint, the config, the tokenizer, the graphs, so everything in it counts as an input (a new file beside
//!   them is allowed: `--json m/report.json`);
//! - the same path as another output (a device such as `/dev/null` excepted: writing it twice loses nothing).
//!
//! An output file can be created when its directory exists and a file can be created (and is removed again) there,
//! so `--json /proc/x` fails before the run, not after it; a directory a command writes whole (`--out` of export-ir
//! and synth) must be new or empty, its nearest existing ancestor writable; a directory written into (`--cache-dir`)
//! is created at once.

use anyhow::{Result, bail};
use std::fmt;
use std::path::{Component, Path, PathBuf};

/// What an output is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A file, replaced whole (`--json`, `dump --out`).
    File,
    /// A directory the command writes whole: new or empty (`export-ir --out`, `synth --out`).
    NewDir,
    /// A directory the command adds files to (`--cache-dir`).
    Dir,
}

/// A path as the user gave it, with what gave it (a flag, or a positional argument's name).
#[derive(Debug, Clone)]
struct Named {
    what: String,
    path: PathBuf,
    resolved: PathBuf,
}

impl Named {
    fn new(what: &str, path: &Path) -> Self {
        Named {
            what: what.to_string(),
            path: path.to_path_buf(),
            resolved: resolve(path),
        }
    }
}

impl fmt::Display for Named {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.what, self.path.display())
    }
}

/// A command's inputs and outputs, gathered from its arguments and checked together by [`Paths::check`].
#[derive(Debug, Clone, Default)]
pub struct Paths {
    inputs: Vec<Named>,
    outputs: Vec<(Named, Kind)>,
}

/// Arguments that name files or directories: they add them to a command's [`Paths`].
pub trait DeclarePaths {
    /// `paths` with this argument's inputs and outputs added.
    fn declare(&self, paths: Paths) -> Paths;
}

impl Paths {
    /// No path yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an input (a file or a directory the command reads), if given; `what` names it in messages (`--model`,
    /// `ACTUAL`).
    pub fn input<P: AsRef<Path>>(mut self, what: &str, path: Option<P>) -> Self {
        if let Some(p) = path {
            self.inputs.push(Named::new(what, p.as_ref()));
        }
        self
    }

    /// Adds an output file written whole, if given.
    pub fn file<P: AsRef<Path>>(self, flag: &str, path: Option<P>) -> Self {
        self.output(flag, path, Kind::File)
    }

    /// Adds an output of `kind`, if given.
    pub fn output<P: AsRef<Path>>(mut self, flag: &str, path: Option<P>, kind: Kind) -> Self {
        if let Some(p) = path {
            self.outputs.push((Named::new(flag, p.as_ref()), kind));
        }
        self
    }

    /// Adds what `args` names.
    pub fn with(self, args: &impl DeclarePaths) -> Self {
        args.declare(self)
    }

    /// Fails, naming the flags and the paths, when an output would overwrite an input or another output, or cannot
    /// be created; a `--cache-dir` is created here.
    pub fn check(&self) -> Result<()> {
        if let Ok(mut flags) = FLAGS.lock() {
            flags.extend(
                self.outputs
                    .iter()
                    .map(|(o, _)| (o.resolved.clone(), o.what.clone())),
            );
        }
        for (i, (out, kind)) in self.outputs.iter().enumerate() {
            for input in &self.inputs {
                refuse_overlap(out, *kind, input)?;
            }
            for (earlier, _) in &self.outputs[..i] {
                if earlier.resolved == out.resolved && !is_device(&out.resolved) {
                    bail!(
                        "{earlier} and {out} are the same file: one output would overwrite the other"
                    );
                }
            }
        }
        for (out, kind) in &self.outputs {
            creatable(out, *kind)?;
        }
        // From here on, a loader that opens one of these outputs as an input (a file a manifest names, the model it
        // names, a device config from the environment) fails when it opens it, before the work.
        for (out, kind) in &self.outputs {
            if *kind != Kind::Dir && !is_device(&out.resolved) {
                reference::inputs::plan_output(&out.path, &out.to_string(), *kind == Kind::NewDir)?;
            }
        }
        Ok(())
    }
}

/// The outputs checked so far ([`Paths::check`]), resolved, with their flags: an output refused later, when it is
/// written (it would overwrite a file the run read, see [`reference::inputs`]), is named by its flag.
static FLAGS: std::sync::Mutex<Vec<(PathBuf, String)>> = std::sync::Mutex::new(Vec::new());

/// `path` as the user gave it with the flag that gave it (`--json r.json`), or `writing r.json` for an output no
/// flag named.
pub fn named(path: &Path) -> String {
    let resolved = resolve(path);
    let flag = FLAGS.lock().ok().and_then(|flags| {
        flags
            .iter()
            .find(|(p, _)| *p == resolved)
            .map(|(_, f)| f.clone())
    });
    match flag {
        Some(flag) => format!("{flag} {}", path.display()),
        None => format!("writing {}", path.display()),
    }
}

/// Fails when the output `out` is, holds, or lies among the files of the input `input`.
fn refuse_overlap(out: &Named, kind: Kind, input: &Named) -> Result<()> {
    let (o, i) = (&out.resolved, &input.resolved);
    if o == i {
        bail!(
            "{out}: the same path as {input}, which the command reads: an output must not overwrite an input"
        );
    }
    if kind == Kind::NewDir && i.starts_with(o) {
        bail!("{out}: holds {input}, which the command reads: write the output elsewhere");
    }
    if kind != Kind::Dir && i.is_dir() && o.starts_with(i) && o.exists() {
        bail!(
            "{out}: already there in {input}, a directory the command reads: an output must not overwrite an \
             input (write it elsewhere, or under a new name)"
        );
    }
    Ok(())
}

/// Whether `path` exists and is neither a regular file nor a directory (`/dev/null`, a terminal, a pipe).
fn is_device(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir())
}

/// Fails when the output cannot be created where it is asked for.
fn creatable(out: &Named, kind: Kind) -> Result<()> {
    let path = &out.resolved;
    match kind {
        Kind::File => {
            if let Ok(m) = std::fs::metadata(&out.path) {
                if m.is_dir() {
                    bail!("{out}: is a directory, not a file");
                }
                if !m.is_file() {
                    // A device is written in place.
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open(&out.path)
                        .map_err(|e| anyhow::anyhow!("{out}: cannot be written: {e}"))?;
                    return Ok(());
                }
            }
            // A bare file name lies in the working directory, which may have been removed under the run.
            let dir = match path.parent() {
                Some(d) if d.as_os_str().is_empty() => Path::new("."),
                Some(d) => d,
                None => Path::new("/"),
            };
            if !dir.is_dir() {
                if dir == Path::new(".") {
                    bail!("{out}: the working directory no longer exists (was it removed?)");
                }
                bail!("{out}: the directory {} does not exist", dir.display());
            }
            // The very partial file the output is written through (its name is the output's and more) is created
            // and removed: a name too long for the file system fails here, before any work, not when the result
            // is written.
            reference::io::AtomicFile::create(path)
                .map(reference::io::AtomicFile::discard)
                .map_err(|e| {
                    anyhow::anyhow!("{out}: cannot create a file in {}: {e}", dir.display())
                })
        }
        Kind::NewDir => {
            if path.exists() {
                if !path.is_dir() {
                    bail!("{out}: exists and is not a directory");
                }
                let mut entries = std::fs::read_dir(path)
                    .map_err(|e| anyhow::anyhow!("{out}: cannot be read: {e}"))?;
                if entries.next().is_some() {
                    bail!(
                        "{out}: the directory is not empty (the command writes into a new or empty directory)"
                    );
                }
            }
            // Named as the staged directory will be (`.NAME.partial-PID-XXXXXX`), so a name too long for the file
            // system fails here.
            let name = path
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
            probe(
                out,
                &existing_ancestor(path.parent().unwrap_or(path)),
                &format!(".{name}.partial-{}-", std::process::id()),
            )
        }
        Kind::Dir => {
            std::fs::create_dir_all(path)
                .map_err(|e| anyhow::anyhow!("{out}: cannot create the directory: {e}"))?;
            probe(out, path, ".qwen35-check-")
        }
    }
}

/// Fails when no file named `prefix` and six more characters (as a temporary's) can be created in `dir` (one is
/// created and removed).
fn probe(out: &Named, dir: &Path, prefix: &str) -> Result<()> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let path = dir.join(format!("{prefix}{:06}", nanos % 1_000_000));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| anyhow::anyhow!("{out}: cannot create a file in {}: {e}", dir.display()))?;
    let _ = std::fs::remove_file(&path);
    Ok(())
}

/// The nearest ancestor of `path` (itself included) that exists.
pub(crate) fn existing_ancestor(path: &Path) -> PathBuf {
    path.ancestors()
        .find(|a| a.exists())
        .unwrap_or(Path::new("/"))
        .to_path_buf()
}

/// `path` made absolute and canonical as far as it exists: its nearest existing ancestor canonicalised (symlinks,
/// `.` and `..` resolved by the file system), the components after it appended (`.` dropped, `..` taken
/// lexically: what follows does not exist, so it holds no link).
pub fn resolve(path: &Path) -> PathBuf {
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

/// Writes `text` to `path` whole or not at all, with the umask's mode (see [`reference::io::AtomicFile`]).
pub fn write(path: &Path, text: &[u8]) -> Result<()> {
    reference::io::write_atomic(path, text).map_err(|e| anyhow::anyhow!("{}: {e}", named(path)))
}

mod staged;

pub use staged::{StagedDir, clean_up_on_signals, free_bytes, yield_to_ending_signal};

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn err(paths: &Paths) -> String {
        format!("{:#}", paths.check().unwrap_err())
    }

    #[test]
    fn spellings_of_one_path_resolve_alike() {
        // Not there: the working directory joined lexically.
        let here = std::env::current_dir().unwrap();
        let new = "no-such-output-7f3a.json";
        assert_eq!(resolve(Path::new(new)), resolve(&Path::new(".").join(new)));
        assert_eq!(
            resolve(Path::new(new)),
            here.canonicalize().unwrap().join(new)
        );
        assert_eq!(
            resolve(&Path::new("no-such-dir-7f3a/..").join(new)),
            resolve(Path::new(new))
        );
        // Symlinks: to a file, and to the directory of a file not there yet.
        let tmp = tempfile::tempdir().unwrap();
        let (d, f) = (tmp.path().join("d"), tmp.path().join("d/f"));
        std::fs::create_dir(&d).unwrap();
        std::fs::write(&f, "x").unwrap();
        symlink(&f, tmp.path().join("link")).unwrap();
        symlink(&d, tmp.path().join("dlink")).unwrap();
        assert_eq!(resolve(&tmp.path().join("link")), f.canonicalize().unwrap());
        assert_eq!(
            resolve(&tmp.path().join("dlink/new/../g")),
            d.canonicalize().unwrap().join("g")
        );
        assert_eq!(resolve(&d.join("./f")), resolve(&f));
    }

    #[test]
    fn an_output_never_overwrites_an_input() {
        let tmp = tempfile::tempdir().unwrap();
        let m = tmp.path().join("m");
        std::fs::create_dir(&m).unwrap();
        std::fs::write(m.join("model.safetensors"), "w").unwrap();
        std::fs::write(tmp.path().join("a.st"), "a").unwrap();
        symlink(tmp.path().join("a.st"), tmp.path().join("alias.st")).unwrap();
        let base = || {
            Paths::new()
                .input("--model", Some(&m))
                .input("ACTUAL", Some(tmp.path().join("a.st")))
        };
        // The checkpoint, by any spelling.
        let e = err(&base().file("--out", Some(m.join("./model.safetensors"))));
        assert!(e.contains("--out") && e.contains("model.safetensors") && e.contains("--model"));
        // A file input, through a link; the input directory itself.
        let e = err(&base().file("--json", Some(tmp.path().join("alias.st"))));
        assert!(e.contains("--json") && e.contains("ACTUAL"), "{e}");
        let e = err(&base().output("--out", Some(&m), Kind::NewDir));
        assert!(e.contains("--out") && e.contains("--model"), "{e}");
        // A directory output holding an input; the same directory as a cache.
        let e = err(&base().output("--out", Some(tmp.path()), Kind::NewDir));
        assert!(e.contains("holds"), "{e}");
        assert!(
            base()
                .output("--cache-dir", Some(&m), Kind::Dir)
                .check()
                .is_err()
        );
        // A new file beside the checkpoint is no input.
        base()
            .file("--json", Some(m.join("report.json")))
            .check()
            .unwrap();
    }

    #[test]
    fn two_outputs_never_share_a_file() {
        let tmp = tempfile::tempdir().unwrap();
        let r = tmp.path().join("r");
        let e = err(&Paths::new()
            .file("--json", Some(&r))
            .file("--report", Some(tmp.path().join(".").join("r"))));
        assert!(e.contains("--json") && e.contains("--report"), "{e}");
        // A device may take both.
        Paths::new()
            .file("--json", Some("/dev/null"))
            .file("--report", Some("/dev/null"))
            .check()
            .unwrap();
    }

    #[test]
    fn an_output_that_cannot_be_created_fails_at_once() {
        let tmp = tempfile::tempdir().unwrap();
        let e = err(&Paths::new().file("--json", Some("/proc/qwen35-x.json")));
        assert!(e.contains("--json /proc/qwen35-x.json"), "{e}");
        let e = err(&Paths::new().file("--json", Some(tmp.path().join("no/x.json"))));
        assert!(e.contains("does not exist"), "{e}");
        let e = err(&Paths::new().file("--plot", Some(tmp.path())));
        assert!(e.contains("is a directory"), "{e}");
        // Nothing is left behind by the probe.
        Paths::new()
            .file("--json", Some(tmp.path().join("x.json")))
            .check()
            .unwrap();
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
        // A directory written whole: new (its parents may be missing) or empty.
        let full = tmp.path().join("full");
        std::fs::create_dir(&full).unwrap();
        std::fs::write(full.join("old.xml"), "").unwrap();
        let e = err(&Paths::new().output("--out", Some(&full), Kind::NewDir));
        assert!(e.contains("not empty"), "{e}");
        Paths::new()
            .output("--out", Some(tmp.path().join("a/b")), Kind::NewDir)
            .check()
            .unwrap();
        // A cache directory is created.
        let cache = tmp.path().join("cache/ov");
        Paths::new()
            .output("--cache-dir", Some(&cache), Kind::Dir)
            .check()
            .unwrap();
        assert!(cache.is_dir());
    }

    #[test]
    fn a_file_is_replaced_whole_with_the_umask_mode() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let (target, link) = (tmp.path().join("t.json"), tmp.path().join("l.json"));
        std::fs::write(&target, "old").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
        symlink(&target, &link).unwrap();
        write(&link, b"new").unwrap();
        // Through the link: the target replaced, the link kept, no sibling left.
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "new");
        assert!(
            std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 2);
        // The mode a new file gets from open(2) (0666 less the umask), not tempfile's 0600.
        let plain = tmp.path().join("plain");
        std::fs::File::create(&plain).unwrap();
        let want = std::fs::metadata(&plain).unwrap().permissions().mode() & 0o777;
        assert_eq!(
            std::fs::metadata(&target).unwrap().permissions().mode() & 0o777,
            want
        );
        assert!(write(&tmp.path().join("no/x"), b"x").is_err());
    }
}
