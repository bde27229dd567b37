//! Directories written whole or not at all ([`StagedDir`]), the free space a writer checks first ([`free_bytes`]),
//! and the end of a run by SIGINT or SIGTERM ([`clean_up_on_signals`]).

use super::{existing_ancestor, resolve};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};

/// A directory written whole or not at all: the command writes into a hidden sibling (`.NAME.partial-PID-XXXXXX`,
/// mode `0777` less the umask), renamed onto the directory by [`StagedDir::commit`]. Dropped uncommitted (an error),
/// the sibling is removed. A sibling left by a run that was killed never blocks a new one (its name is the new run's
/// own); the next run writing the same directory removes it, once the process that made it is gone.
#[derive(Debug)]
pub struct StagedDir {
    temp: tempfile::TempDir,
    dest: PathBuf,
    flag: String,
}

impl StagedDir {
    /// Creates the sibling of `dest` (and `dest`'s missing parents), given by `flag`.
    pub fn create(flag: &str, dest: &Path) -> Result<Self> {
        let resolved = resolve(dest);
        let (Some(parent), Some(name)) = (resolved.parent(), resolved.file_name()) else {
            bail!("{flag} {}: not a directory one can create", dest.display());
        };
        std::fs::create_dir_all(parent).map_err(|e| {
            anyhow::anyhow!(
                "{flag} {}: creating {}: {e}",
                dest.display(),
                parent.display()
            )
        })?;
        reference::inputs::refuse_output(&resolved)
            .map_err(|e| anyhow::anyhow!("{flag} {}: {e}", dest.display()))?;
        let stem = format!(".{}.partial-", name.to_string_lossy());
        remove_stale(parent, &stem);
        let prefix = format!("{stem}{}-", std::process::id());
        let mut builder = tempfile::Builder::new();
        builder.prefix(&prefix);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            builder.permissions(std::fs::Permissions::from_mode(0o777));
        }
        // Registered as it is made: removed by a signal's handler if the run is ended before this is dropped or
        // committed.
        let temp =
            reference::temps::create(|| builder.tempdir_in(parent), |t| t.path()).map_err(|e| {
                anyhow::anyhow!(
                    "{flag} {}: creating a directory in {}: {e}",
                    dest.display(),
                    parent.display()
                )
            })?;
        Ok(StagedDir {
            temp,
            dest: dest.to_path_buf(),
            flag: flag.to_string(),
        })
    }

    /// The directory to write into.
    pub fn path(&self) -> &Path {
        self.temp.path()
    }

    /// Renames the finished directory onto its destination (which must not exist, or be empty).
    pub fn commit(self) -> Result<()> {
        let dest = resolve(&self.dest);
        std::fs::rename(self.temp.path(), &dest).with_context(|| {
            format!(
                "{} {}: moving the finished {} into place",
                self.flag,
                self.dest.display(),
                self.temp.path().display()
            )
        })?;
        // Renamed: nothing is left for the TempDir to remove.
        reference::temps::forget(self.temp.path());
        let _ = self.temp.keep();
        Ok(())
    }
}

/// Removes the siblings `{stem}{pid}-…` in `dir` whose process is gone, saying so.
fn remove_stale(dir: &Path, stem: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(stem))
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !process_alive(pid) && std::fs::remove_dir_all(entry.path()).is_ok() {
            crate::errln!(
                "removed {}, left by an interrupted run",
                entry.path().display()
            );
        }
    }
}

/// Whether process `pid` exists (unknown means yes: nothing is removed on a guess).
fn process_alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            return true;
        };
        // SAFETY: signal 0 only asks whether the process exists; nothing is sent.
        let r = unsafe { libc::kill(pid, 0) };
        r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Bytes free to an unprivileged writer on the file system holding `path` (its nearest existing ancestor).
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    let dir = existing_ancestor(&resolve(path));
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        // SAFETY: `c` is a NUL-terminated path and `stat` a zeroed struct statvfs for the call to fill.
        let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(c.as_ptr(), &mut stat) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(u64::MAX)
    }
}

/// The write end of the pipe [`clean_up_on_signals`]' handler writes the signal's number to (-1: none yet).
#[cfg(unix)]
static SIGNAL_PIPE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// Whether SIGINT or SIGTERM arrived under [`clean_up_on_signals`]: the run is ending with 128 + the signal,
/// whatever the command's own outcome.
static ENDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[cfg(unix)]
extern "C" fn on_ending_signal(signal: libc::c_int) {
    ENDING.store(true, std::sync::atomic::Ordering::SeqCst);
    let fd = SIGNAL_PIPE.load(std::sync::atomic::Ordering::SeqCst);
    let byte = signal as u8;
    // SAFETY: write(2) on a pipe is async-signal-safe; the byte lives for the call.
    unsafe {
        libc::write(fd, (&byte as *const u8).cast(), 1);
    }
}

/// From now on, SIGINT (Ctrl-C) and SIGTERM end the run cleanly: the handler only writes the signal's number to a
/// pipe (async-signal-safe); a thread reading it removes every partial file and directory the run registered
/// ([`reference::temps`]: dumps and reports being written, staged directories, IR cache entries being stored) and
/// ends the process with 128 + the signal (130, 143), as the shell reports a process the signal killed.
pub fn clean_up_on_signals() {
    #[cfg(unix)]
    {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` has room for the two descriptors pipe(2) fills.
        if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
            return;
        }
        SIGNAL_PIPE.store(fds[1], std::sync::atomic::Ordering::SeqCst);
        let read_end = fds[0];
        let spawned = std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                let mut byte = 0u8;
                loop {
                    // SAFETY: reads one byte into `byte`, which outlives the call.
                    let n = unsafe { libc::read(read_end, (&mut byte as *mut u8).cast(), 1) };
                    if n == 1 {
                        break;
                    }
                    if n == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR)
                    {
                        return;
                    }
                }
                // Held until the process ends: no partial is made after the removal.
                let _held = reference::temps::remove_all();
                // SAFETY: ends the process at once, as the signal would have, without running other threads'
                // destructors (a device's runtime may be mid-call).
                unsafe { libc::_exit(128 + libc::c_int::from(byte)) }
            });
        if spawned.is_err() {
            return;
        }
        for signal in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: a zeroed sigaction with an empty mask and a handler that only calls write(2).
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction =
                    on_ending_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
                action.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut action.sa_mask);
                libc::sigaction(signal, &action, std::ptr::null_mut());
            }
        }
    }
}

/// Called with the command's outcome in hand, before it is reported: when an ending signal arrived, the signal's
/// thread is removing the partials and will end the process with 128 + the signal, so this waits for it. The
/// command's own outcome (often an error caused by the removal itself: a partial directory gone under a writer) is
/// never reported nor returned as the exit code in its place. Returns at once when no signal arrived, and after
/// 30 s if the thread never ends the process.
pub fn yield_to_ending_signal() {
    let start = std::time::Instant::now();
    while ENDING.load(std::sync::atomic::Ordering::SeqCst)
        && start.elapsed() < std::time::Duration::from_secs(30)
    {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_staged_directory_appears_whole_or_not_at_all() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("sub/out");
        let staged = StagedDir::create("--out", &dest).unwrap();
        std::fs::write(staged.path().join("f"), "x").unwrap();
        assert!(!dest.exists());
        staged.commit().unwrap();
        assert_eq!(std::fs::read_to_string(dest.join("f")).unwrap(), "x");
        assert_eq!(
            std::fs::read_dir(tmp.path().join("sub")).unwrap().count(),
            1
        );
        // Dropped uncommitted (an error on the way): nothing left.
        let other = tmp.path().join("sub/other");
        let staged = StagedDir::create("--out", &other).unwrap();
        std::fs::write(staged.path().join("f"), "x").unwrap();
        drop(staged);
        assert!(!other.exists());
        assert_eq!(
            std::fs::read_dir(tmp.path().join("sub")).unwrap().count(),
            1
        );
        // Onto an empty directory.
        let empty = tmp.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let staged = StagedDir::create("--out", &empty).unwrap();
        std::fs::write(staged.path().join("f"), "x").unwrap();
        staged.commit().unwrap();
        assert!(empty.join("f").exists());
    }

    #[test]
    fn a_killed_runs_sibling_is_removed_by_the_next() {
        let tmp = tempfile::tempdir().unwrap();
        // A process that has exited: its pid names no process now.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let stale = tmp.path().join(format!(".out.partial-{dead}-abc123"));
        let live = tmp
            .path()
            .join(format!(".out.partial-{}-def456", std::process::id()));
        let unrelated = tmp.path().join(format!(".other.partial-{dead}-abc123"));
        for d in [&stale, &live, &unrelated] {
            std::fs::create_dir(d).unwrap();
            std::fs::write(d.join("model-00001.safetensors"), "partial").unwrap();
        }
        let staged = StagedDir::create("--out", &tmp.path().join("out")).unwrap();
        assert!(!stale.exists(), "the dead run's sibling is removed");
        assert!(live.exists() && unrelated.exists());
        staged.commit().unwrap();
    }

    #[test]
    fn free_space_is_read_from_the_nearest_existing_ancestor() {
        let tmp = tempfile::tempdir().unwrap();
        let free = free_bytes(&tmp.path().join("not/yet")).unwrap();
        assert!(free > 0 && free < u64::MAX);
    }
}
