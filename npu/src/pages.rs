//! Handing back the resident pages of memory-mapped files (Linux): the checkpoint a graph builder has read, and the
//! `.bin` of a compiled graph whose weights the device has copied into its own layout.
//!
//! A read-only file mapping's pages count in the process's resident set (`RssFile`, and so `VmHWM`) for as long as
//! they stay mapped, although the kernel can reclaim them. `MADV_DONTNEED` on such a mapping unmaps them now; a
//! later read of the same bytes faults them in again from the file (the page cache), so the contents never change.
//! Only mappings without write permission are touched. Elsewhere than Linux nothing is done.

use std::path::Path;

/// Drops this process's resident pages of every read-only mapping of the files `paths` (which may belong to this
/// crate, the reference's weight store or OpenVINO); returns the bytes of mappings advised. Best effort: a file
/// that is not mapped, or a system without `/proc/self/maps`, gives 0.
pub fn release(paths: &[&Path]) -> usize {
    let wanted: Vec<std::path::PathBuf> = paths
        .iter()
        .map(|p| p.canonicalize().unwrap_or_else(|_| p.to_path_buf()))
        .collect();
    #[allow(clippy::disallowed_methods)] // the kernel's figures, not an input of the run
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return 0;
    };
    let mut advised = 0;
    for line in maps.lines() {
        let Some((start, end, perms, path)) = parse_line(line) else {
            continue;
        };
        if perms.as_bytes().get(1) == Some(&b'w') || !wanted.iter().any(|w| w.as_path() == path) {
            continue;
        }
        if advise_dontneed(start, end) {
            advised += end - start;
        }
    }
    advised
}

/// Bytes read from mapped files between two [`release`]s by a [`Pacer`]: the most of them left resident at once.
pub const RELEASE_EVERY_BYTES: usize = 64 << 20;

/// Counts the bytes read from mapped files and [`release`]s their pages once every [`RELEASE_EVERY_BYTES`], not after
/// every tensor or block: each release reads `/proc/self/maps` whole, and a graph built from a small checkpoint in
/// one-row blocks did that 12,000 times, spending more time in the kernel than on its tensors. Shared by threads.
#[derive(Debug, Default)]
pub struct Pacer {
    unreleased: std::sync::atomic::AtomicUsize,
}

impl Pacer {
    /// Notes `bytes` more read from `paths`; releases their pages once the bytes read since the last release reach
    /// [`RELEASE_EVERY_BYTES`]. Whether it released.
    pub fn read(&self, bytes: usize, paths: &[&Path]) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let total = self
            .unreleased
            .fetch_add(bytes, Relaxed)
            .saturating_add(bytes);
        if total >= RELEASE_EVERY_BYTES {
            self.unreleased.store(0, Relaxed);
            release(paths);
            return true;
        }
        false
    }
}

/// A background thread that [`release`]s the pages of some files every `interval` until dropped (and once more
/// then): for a phase that reads a mapped file through once, e.g. OpenVINO compiling a graph whose weights the device
/// copies into its own layout, so that the file's pages never pile up in the resident set.
pub struct Releaser {
    /// Dropped to stop the thread: it wakes at once (a sleeping thread made every compile wait up to `interval`).
    stop: Option<std::sync::mpsc::Sender<()>>,
    handle: Option<std::thread::JoinHandle<()>>,
    paths: Vec<std::path::PathBuf>,
}

impl Releaser {
    /// Starts releasing the pages of `paths` every `interval`.
    pub fn start(paths: Vec<std::path::PathBuf>, interval: std::time::Duration) -> Releaser {
        use std::sync::mpsc::RecvTimeoutError;
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let files = paths.clone();
        let handle = std::thread::spawn(move || {
            while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                let refs: Vec<&Path> = files.iter().map(|p| p.as_path()).collect();
                release(&refs);
            }
        });
        Releaser {
            stop: Some(stop),
            handle: Some(handle),
            paths,
        }
    }
}

impl Drop for Releaser {
    fn drop(&mut self) {
        // Disconnects the channel: the thread's wait ends now, not at the end of its interval.
        drop(self.stop.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        let refs: Vec<&Path> = self.paths.iter().map(|p| p.as_path()).collect();
        release(&refs);
    }
}

/// `(start, end, permissions, path)` of a `/proc/self/maps` line naming a file.
fn parse_line(line: &str) -> Option<(usize, usize, &str, &Path)> {
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?;
    let _offset = fields.next()?;
    let _device = fields.next()?;
    let _inode = fields.next()?;
    let path = fields.next()?.trim_start();
    if !path.starts_with('/') {
        return None;
    }
    let (start, end) = range.split_once('-')?;
    let start = usize::from_str_radix(start, 16).ok()?;
    let end = usize::from_str_radix(end, 16).ok()?;
    Some((start, end, perms, Path::new(path)))
}

#[cfg(target_os = "linux")]
fn advise_dontneed(start: usize, end: usize) -> bool {
    // SAFETY: the range is a whole mapping of this process as the kernel lists it, of a file without write
    // permission: dropping its pages changes no value any reader sees (they are faulted in again from the file).
    unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn advise_dontneed(_start: usize, _end: usize) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_released_mapping_reads_the_same_and_leaves_the_resident_set() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        let data: Vec<u8> = (0..(8u32 << 20)).map(|i| (i % 251) as u8).collect();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&data)
            .unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a private file of this test, not modified while mapped.
        let map = unsafe { memmap(&file, data.len()) };
        let sum = |m: &[u8]| m.iter().map(|&b| b as u64).sum::<u64>();
        let expected = sum(&data);
        assert_eq!(sum(map), expected);
        let resident = || resident_kb(map);
        assert!(resident() > 0);
        let advised = release(&[&path]);
        assert!(advised >= data.len(), "{advised} bytes advised");
        assert_eq!(resident(), 0);
        assert_eq!(sum(map), expected, "the contents after release");
        assert_eq!(release(&[&dir.path().join("absent.bin")]), 0);
        let releaser = Releaser::start(vec![path.clone()], std::time::Duration::from_millis(5));
        assert_eq!(sum(map), expected);
        drop(releaser);
        assert_eq!(resident(), 0, "after a releaser");
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(map.as_ptr() as *mut libc::c_void, data.len()) };
    }

    #[test]
    fn a_pacer_releases_once_its_bytes_add_up_and_not_before() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        let data = vec![7u8; 4 << 20];
        std::fs::write(&path, &data).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a private file of this test, not modified while mapped.
        let map = unsafe { memmap(&file, data.len()) };
        let touch = |m: &[u8]| m.iter().map(|&b| b as u64).sum::<u64>();
        let pacer = Pacer::default();
        assert_eq!(touch(map), 7 * data.len() as u64);
        // Many reads short of the budget leave the pages where they are.
        let step = RELEASE_EVERY_BYTES / 1000;
        for _ in 0..999 {
            assert!(!pacer.read(step, &[&path]));
        }
        assert!(resident_kb(map) > 0, "released before its budget");
        assert!(pacer.read(RELEASE_EVERY_BYTES - 999 * step, &[&path]));
        assert_eq!(resident_kb(map), 0, "not released at its budget");
        // The count starts again.
        assert_eq!(touch(map), 7 * data.len() as u64);
        assert!(!pacer.read(step, &[&path]));
        assert!(resident_kb(map) > 0);
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(map.as_ptr() as *mut libc::c_void, data.len()) };
    }

    /// Maps `len` bytes of `file` read-only.
    unsafe fn memmap(file: &std::fs::File, len: usize) -> &'static [u8] {
        use std::os::fd::AsRawFd;
        // SAFETY: see the callers.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            std::slice::from_raw_parts(p as *const u8, len)
        }
    }

    /// kB of `m` resident in this process (`mincore` reports the page cache, so count by `/proc/self/smaps`).
    fn resident_kb(m: &[u8]) -> usize {
        let start = m.as_ptr() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((a, _)) = range.split_once('-')
                && let Ok(a) = usize::from_str_radix(a, 16)
                && range.contains('-')
                && !line.starts_with("Rss")
            {
                inside = a == start;
                continue;
            }
            if inside && let Some(kb) = line.strip_prefix("Rss:") {
                return kb.trim().trim_end_matches("kB").trim().parse().unwrap();
            }
        }
        panic!("mapping not found in smaps")
    }
}
