//! The process's memory, from `/proc/self/status` (Linux): the peak resident set as the kernel keeps it (`VmHWM`),
//! and the anonymous part of the resident set (`RssAnon`: heap and other private memory, not the pages of
//! memory-mapped files), whose peak the kernel does not keep, so [`Sampler`] samples it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// One reading of `/proc/self/status`, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Status {
    /// `VmHWM`: the peak resident set since the process started (kept by the kernel).
    pub peak_rss: u64,
    /// `VmRSS`: the resident set now.
    pub rss: u64,
    /// `RssAnon`: the anonymous part of the resident set now.
    pub rss_anon: u64,
}

/// Reads `/proc/self/status`; `None` where it does not exist (not Linux) or lacks the fields.
pub fn status() -> Option<Status> {
    #[allow(clippy::disallowed_methods)] // the kernel's figures, not an input of the run
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_status(&text)
}

/// Parses the text of a `/proc/<pid>/status` file (sizes in kB).
pub fn parse_status(text: &str) -> Option<Status> {
    let field = |key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        let kb: u64 = line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kb * 1024)
    };
    Some(Status {
        peak_rss: field("VmHWM:")?,
        rss: field("VmRSS:")?,
        rss_anon: field("RssAnon:")?,
    })
}

/// A background thread that reads `RssAnon` every `interval` and keeps the largest value seen (and the largest
/// `VmRSS`). A peak shorter than the interval can be missed; [`Sampler::stop`] takes one last reading.
pub struct Sampler {
    /// Dropped to stop the thread, which wakes at once (not at the end of its interval).
    stop: Option<std::sync::mpsc::Sender<()>>,
    peak_anon: Arc<AtomicU64>,
    peak_rss: Arc<AtomicU64>,
    handle: Option<JoinHandle<()>>,
}

impl Sampler {
    /// Starts sampling.
    pub fn start(interval: Duration) -> Self {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let peak_anon = Arc::new(AtomicU64::new(0));
        let peak_rss = Arc::new(AtomicU64::new(0));
        let (a, r) = (peak_anon.clone(), peak_rss.clone());
        let handle = std::thread::spawn(move || {
            record(&a, &r);
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(interval)
            {
                record(&a, &r);
            }
        });
        Sampler {
            stop: Some(stop),
            peak_anon,
            peak_rss,
            handle: Some(handle),
        }
    }

    /// Takes a reading now (e.g. at the end of a phase), besides the periodic ones.
    pub fn sample(&self) {
        record(&self.peak_anon, &self.peak_rss);
    }

    /// Stops the thread; returns the peak `RssAnon` and the peak sampled `VmRSS`, in bytes (0 where
    /// `/proc/self/status` cannot be read).
    pub fn stop(mut self) -> (u64, u64) {
        drop(self.stop.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.sample();
        (
            self.peak_anon.load(Ordering::Relaxed),
            self.peak_rss.load(Ordering::Relaxed),
        )
    }
}

fn record(anon: &AtomicU64, rss: &AtomicU64) {
    if let Some(s) = status() {
        anon.fetch_max(s.rss_anon, Ordering::Relaxed);
        rss.fetch_max(s.rss, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_status_fields_in_bytes() {
        let text = "Name:\tqwen35\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nRssAnon:\t   512 kB\nRssFile:\t 512 kB\n";
        assert_eq!(
            parse_status(text),
            Some(Status {
                peak_rss: 2048 * 1024,
                rss: 1024 * 1024,
                rss_anon: 512 * 1024
            })
        );
        assert_eq!(parse_status("Name:\tx\nVmRSS:\t1 kB\n"), None);
    }

    #[test]
    fn sampler_sees_an_allocation() {
        let sampler = Sampler::start(Duration::from_millis(1));
        let before = status().map_or(0, |s| s.rss_anon);
        let block = vec![1u8; 64 << 20];
        std::hint::black_box(&block);
        sampler.sample();
        drop(block);
        let (anon, _) = sampler.stop();
        if status().is_some() {
            assert!(anon >= before + (60 << 20), "peak {anon}, before {before}");
        }
    }
}
