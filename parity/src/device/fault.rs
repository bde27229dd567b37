//! Faults injected into the device under test (`qwen35 validate --inject-fault`, a hidden flag for tests): a device
//! wrong in one known way must make the check that looks for that kind of fault fail. The wrapper changes what the
//! backend does, never what the checks compute.

use anyhow::{Result, bail};
use candle_core::Tensor;
use reference::backend::{Backend, Forward, RunRecord, Snapshot};
use reference::config::Config;

/// A fault of the device under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `reset` keeps every DeltaNet recurrent state (a stateful model not reset between sequences): the next
    /// sequence starts from the last one's state.
    LeakState,
    /// `restore` does nothing: a snapshot cannot be gone back to.
    IgnoreRestore,
    /// The logits of every position from this one on are negated (a device that breaks past a length).
    LogitsFrom(usize),
    /// The logits of every position from this one on are NaN (a device whose fp16 values overflow past a length).
    NanFrom(usize),
}

impl Fault {
    /// Parses `leak-state`, `ignore-restore`, `logits-from=P` or `nan-from=P`.
    pub fn parse(s: &str) -> Result<Self> {
        let from = |prefix: &str| s.strip_prefix(prefix)?.parse::<usize>().ok();
        Ok(match s {
            "leak-state" => Fault::LeakState,
            "ignore-restore" => Fault::IgnoreRestore,
            _ => match (from("logits-from="), from("nan-from=")) {
                (Some(p), _) => Fault::LogitsFrom(p),
                (_, Some(p)) => Fault::NanFrom(p),
                _ => bail!(
                    "--inject-fault {s}: expected leak-state, ignore-restore, logits-from=POSITION or \
                     nan-from=POSITION"
                ),
            },
        })
    }
}

/// A backend with an optional fault: without one it is the backend itself.
pub struct Faulty<B> {
    inner: B,
    fault: Option<Fault>,
    position: usize,
}

impl<B: Backend> Faulty<B> {
    /// `inner`, misbehaving as `fault` says.
    pub fn new(inner: B, fault: Option<Fault>) -> Self {
        Faulty {
            inner,
            fault,
            position: 0,
        }
    }

    /// The backend underneath.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// The backend underneath, to change how it runs (not what the fault does).
    pub fn inner_mut(&mut self) -> &mut B {
        &mut self.inner
    }
}

impl<B: Backend> Backend for Faulty<B> {
    fn config(&self) -> &Config {
        self.inner.config()
    }

    fn record(&self) -> &RunRecord {
        self.inner.record()
    }

    fn reset(&mut self) -> reference::Result<()> {
        self.position = 0;
        if self.fault != Some(Fault::LeakState) {
            return self.inner.reset();
        }
        let old = self.inner.snapshot()?;
        self.inner.reset()?;
        let mut fresh = self.inner.snapshot()?;
        for (name, t) in old.tensors {
            if name.ends_with("recurrent_state") {
                fresh.tensors.insert(name, t);
            }
        }
        self.inner.restore(&fresh)
    }

    fn forward(&mut self, ids: &[u32], all_logits: bool) -> reference::Result<Forward> {
        let mut out = self.inner.forward(ids, all_logits)?;
        self.position += ids.len();
        let (from, nan) = match self.fault {
            Some(Fault::LogitsFrom(from)) => (from, false),
            Some(Fault::NanFrom(from)) => (from, true),
            _ => return Ok(out),
        };
        let rows = out.logits.dim(0)?;
        // Row r holds the position `first + r`.
        let first = self.position - rows;
        let changed = (0..rows)
            .map(|r| {
                let row = out.logits.narrow(0, r, 1)?;
                match (first + r >= from, nan) {
                    (false, _) => Ok(row),
                    (true, false) => row.neg(),
                    (true, true) => row.affine(0.0, f64::NAN),
                }
            })
            .collect::<candle_core::Result<Vec<Tensor>>>()?;
        out.logits = Tensor::cat(&changed, 0)?;
        Ok(out)
    }

    fn exposes_state(&self) -> bool {
        self.inner.exposes_state()
    }

    fn position(&self) -> reference::Result<usize> {
        self.inner.position()
    }

    fn snapshot(&self) -> reference::Result<Snapshot> {
        self.inner.snapshot()
    }

    fn restore(&mut self, snapshot: &Snapshot) -> reference::Result<()> {
        if self.fault == Some(Fault::IgnoreRestore) {
            return Ok(());
        }
        self.position = snapshot.position;
        self.inner.restore(snapshot)
    }
}
