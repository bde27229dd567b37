//! `qwen35 dump` writes its file as the run goes: the streamed dump equals the one collected in memory, a
//! generation stopped by NaN logits reads back, an error leaves nothing at `--out`, and the file has the
//! permissions of any new file.

use candle_core::DType;
use parity::dump::{Dump, Written, run_dump, write_dump};
use reference::backend::{Backend, Forward, ReferenceBackend, RunRecord, Snapshot};
use reference::config::Config;
use reference::model::{Model, RunOptions};
use reference::taps::SharedTapSink;
use std::collections::BTreeMap;
use std::path::Path;

use crate::common;
use common::{qwen35, same_dump, stderr, testdata};

/// The reference on the tiny model, with taps, feeding prompts in calls of `block` tokens.
fn tiny(block: Option<usize>) -> ReferenceBackend {
    let model = Model::load(&testdata().join("models/tiny"), DType::F32).unwrap();
    let opts = RunOptions {
        prefill_block: block,
        ..RunOptions::default()
    };
    ReferenceBackend::new(model, opts, true, "f32").unwrap()
}

const IDS: [u32; 11] = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122];

fn streamed(backend: &mut dyn Backend, generate: usize, out: &Path) -> (Written, Dump) {
    let w = write_dump(backend, &IDS, generate, BTreeMap::new(), out).unwrap();
    (w, Dump::read(out).unwrap())
}

#[test]
fn the_streamed_dump_equals_the_one_collected_in_memory() {
    let tmp = tempfile::tempdir().unwrap();
    for block in [None, Some(3), Some(1)] {
        let out = tmp.path().join(format!("{block:?}.safetensors"));
        let (w, d) = streamed(&mut tiny(block), 5, &out);
        assert!(w.streamed, "{block:?}: the reference streams its taps");
        assert_eq!((w.tensors, w.generated), (d.tensors.len(), 5));
        let memory = run_dump(&mut tiny(block), &IDS, 5).unwrap();
        same_dump(&format!("prefill block {block:?}"), &d, &memory);
        assert_eq!(d.get("logits").unwrap().dims(), &[IDS.len(), 512]);
    }
}

/// The reference, but the logits of every position from `from` on are NaN, and (if `fail_at` is set) the forward
/// call of that index fails.
struct Faulty {
    inner: ReferenceBackend,
    from: usize,
    fail_at: Option<usize>,
    calls: usize,
}

impl Faulty {
    fn new(from: usize, fail_at: Option<usize>) -> Self {
        Faulty {
            inner: tiny(Some(4)),
            from,
            fail_at,
            calls: 0,
        }
    }
}

impl Backend for Faulty {
    fn config(&self) -> &Config {
        self.inner.config()
    }
    fn record(&self) -> &RunRecord {
        self.inner.record()
    }
    fn reset(&mut self) -> reference::Result<()> {
        self.calls = 0;
        self.inner.reset()
    }
    fn forward(&mut self, ids: &[u32], all_logits: bool) -> reference::Result<Forward> {
        if Some(self.calls) == self.fail_at {
            return Err(reference::Error::Backend("the device fell over".into()));
        }
        self.calls += 1;
        let mut f = self.inner.forward(ids, all_logits)?;
        if self.inner.position()? > self.from {
            f.logits = (f.logits.ones_like()? * f64::NAN)?;
        }
        Ok(f)
    }
    fn snapshot(&self) -> reference::Result<Snapshot> {
        self.inner.snapshot()
    }
    fn restore(&mut self, snapshot: &Snapshot) -> reference::Result<()> {
        self.inner.restore(snapshot)
    }
    fn stream_taps(&mut self, sink: Option<SharedTapSink>) -> bool {
        self.inner.stream_taps(sink)
    }
}

#[test]
fn a_dump_whose_generation_stops_at_a_nan_reads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("nan.safetensors");
    // Positions 0..=13 are fine: the prompt and the first 3 generated tokens; the 4th's logits are NaN.
    let (w, d) = streamed(&mut Faulty::new(IDS.len() + 2, None), 8, &out);
    assert_eq!(w.generated, 3);
    assert_eq!(d.get("generated").unwrap().dims(), &[3]);
    assert_eq!(d.metadata["nan_at"], "3");
    let memory = run_dump(&mut Faulty::new(IDS.len() + 2, None), &IDS, 8).unwrap();
    same_dump("nan", &d, &memory);
    // Stopped before the first token.
    let (w, d) = streamed(&mut Faulty::new(0, None), 8, &out);
    assert_eq!(
        (w.generated, d.get("generated").unwrap().dims()),
        (0, &[0][..])
    );
    assert_eq!(d.metadata["nan_at"], "0");
    // The file is what Python's safetensors reads too: safetensors' own parser checks the header against it.
    let bytes = std::fs::read(&out).unwrap();
    safetensors::SafeTensors::deserialize(&bytes).unwrap();
}

#[test]
fn an_error_mid_run_leaves_nothing_at_out() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("d.safetensors");
    // The third single-token call fails, long after the prompt's taps were written.
    let err = write_dump(
        &mut Faulty::new(usize::MAX, Some(3)),
        &IDS,
        8,
        BTreeMap::new(),
        &out,
    )
    .unwrap_err();
    assert!(
        format!("{err:#}").contains("the device fell over"),
        "{err:#}"
    );
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    // A dump already there stays as it was.
    std::fs::write(&out, b"an earlier dump").unwrap();
    write_dump(
        &mut Faulty::new(usize::MAX, Some(1)),
        &IDS,
        8,
        BTreeMap::new(),
        &out,
    )
    .unwrap_err();
    assert_eq!(std::fs::read(&out).unwrap(), b"an earlier dump");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
}

/// The command's dump has the permissions any new file of the user gets (`0666` less the umask), not a temporary
/// file's `0600`, and holds what the library's in-memory dump holds.
#[test]
fn the_command_writes_a_dump_with_normal_permissions() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("d.safetensors");
    let ids: Vec<String> = IDS.iter().map(u32::to_string).collect();
    let model = testdata().join("models/tiny");
    let o = qwen35(&[
        "dump",
        "--model",
        model.to_str().unwrap(),
        "--token-ids",
        &ids.join(","),
        "--generate",
        "4",
        "--prefill-block",
        "3",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let memory = run_dump(&mut tiny(Some(3)), &IDS, 4).unwrap();
    same_dump("command", &Dump::read(&out).unwrap(), &memory);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let plain = tmp.path().join("plain");
        std::fs::File::create(&plain).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&out), mode(&plain));
    }
}
