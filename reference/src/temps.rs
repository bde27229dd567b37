//! The hidden partial files and directories a run is writing (an [`crate::io::AtomicFile`]'s sibling, a staged
//! directory, an IR cache entry being stored, the bundled model being unpacked), registered while they exist so that
//! whatever ends the run early removes them: an error (their owners remove them on drop), or a signal, whose handler
//! calls [`remove_all`] before the process exits.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The partials registered and not yet put in place or removed.
static TEMPS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The registry, even if a panicking thread poisoned its lock.
fn lock() -> MutexGuard<'static, Vec<PathBuf>> {
    TEMPS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Registers `path`, a partial file or directory this run is writing.
pub fn register(path: &Path) {
    lock().push(path.to_path_buf());
}

/// Creates a partial with `make` and registers it (its path by `path`) under the registry's lock: a signal's
/// [`remove_all`] either finds it registered or runs before it exists (it then holds the lock until the process
/// ends, so that `make` never runs), never sees it made and not yet registered.
pub fn create<T, E>(
    make: impl FnOnce() -> Result<T, E>,
    path: impl Fn(&T) -> &Path,
) -> Result<T, E> {
    let mut temps = lock();
    let made = make()?;
    temps.push(path(&made).to_path_buf());
    Ok(made)
}

/// Forgets `path`: renamed into place, or removed by its owner.
pub fn forget(path: &Path) {
    lock().retain(|p| p != path);
}

/// Removes every registered partial (a file, or a directory with what it holds), for a signal handler's thread just
/// before the process exits. The registry's lock is returned held: the caller keeps it until the process ends, so
/// that no other thread registers (or, through [`create`], makes) a partial after the removal. The removal is
/// repeated after a pause, for a writer that reopened a partial by its path meanwhile.
pub fn remove_all() -> MutexGuard<'static, Vec<PathBuf>> {
    let temps = lock();
    for pass in 0..3 {
        if pass > 0 {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        for path in temps.iter() {
            // A writer may still add a file to a directory being removed: try again.
            for _ in 0..5 {
                let removed = match std::fs::symlink_metadata(path) {
                    Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
                    Ok(_) => std::fs::remove_file(path),
                    Err(_) => Ok(()),
                };
                if removed.is_ok() {
                    break;
                }
            }
        }
    }
    temps
}

/// A registered partial directory removed on drop unless [`TempDir::keep`] (renamed into place) was called.
#[derive(Debug)]
pub struct TempDir(Option<PathBuf>);

impl TempDir {
    /// Registers `path`, a directory the caller has created.
    pub fn new(path: &Path) -> Self {
        register(path);
        TempDir(Some(path.to_path_buf()))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        self.0.as_deref().unwrap_or(Path::new(""))
    }

    /// Forgets the directory without removing it (it has been renamed into place).
    pub fn keep(mut self) {
        if let Some(p) = self.0.take() {
            forget(&p);
        }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_dir_all(&p);
            forget(&p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_partials_are_removed_and_kept_ones_are_not() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b, c) = (
            tmp.path().join(".a.partial"),
            tmp.path().join(".b.partial"),
            tmp.path().join("c"),
        );
        std::fs::create_dir(&a).unwrap();
        std::fs::write(a.join("x"), "x").unwrap();
        std::fs::write(&b, "b").unwrap();
        std::fs::create_dir(&c).unwrap();
        register(&a);
        register(&b);
        TempDir::new(&c).keep();
        drop(remove_all());
        assert!(!a.exists() && !b.exists());
        assert!(c.exists());
    }
}
