//! Checks shared by the graph tests: every tensor against the reference, per head where it has heads.
#![allow(dead_code)]

use candle_core::Tensor;
use reference::backend::{Backend, greedy};
use reference::compare::{WorstByFamily, diff, diff_sliced};
use reference::config::Config;
use reference::taps::names;
use std::collections::BTreeMap;

/// The testdata models, as `testdata/manifest.json` lists them (every one `scripts/make_testdata.py` made).
pub fn models() -> Vec<String> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/manifest.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    let models = manifest["models"]
        .as_object()
        .expect("manifest.json: no `models`");
    models.keys().cloned().collect()
}

/// Token ids from an i64 tensor (a golden's `token_ids` or `generated`).
pub fn ids_of(t: &Tensor) -> Vec<u32> {
    t.to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect()
}

/// What a run of a prompt produced, under the dump's names.
pub struct Run {
    /// Token-major taps over the prompt, the logits of every position included.
    pub taps: BTreeMap<String, Tensor>,
    /// The states after the prompt.
    pub states: BTreeMap<String, Tensor>,
    /// The greedy continuation (exactly `generate` tokens).
    pub generated: Vec<u32>,
}

/// Runs `ids` on a backend from a fresh state with every logit and tap, then `generate` greedy tokens.
pub fn run(backend: &mut dyn Backend, ids: &[u32], generate: usize) -> reference::Result<Run> {
    let g = greedy(backend, ids, generate, &[], true, |_| Ok(()))?;
    let mut taps = g.prompt.taps;
    taps.insert(names::LOGITS.into(), g.prompt.logits);
    Ok(Run {
        taps,
        states: g.after_prompt.tensors,
        generated: g.tokens,
    })
}

/// Layer outputs, taps and states: within 1e-4 of the tensor's max and, for tensors with heads, of each head's own
/// max (see `reference::compare::slicing`).
pub const RTOL: f64 = 1e-4;
/// Logits: absolute.
pub const LOGITS_ATOL: f64 = 1e-3;

/// Checks tensors against the reference and keeps the worst figure per tensor family, for the test output.
#[derive(Default)]
pub struct Worst(WorstByFamily);

impl Worst {
    /// Fails unless `actual` is within tolerance of `expected` (see [`RTOL`], [`LOGITS_ATOL`]); `name` is the
    /// tensor's dump name (`layers.{i}.` may be left off) and decides how it is sliced.
    pub fn check(
        &mut self,
        label: &str,
        name: &str,
        actual: &Tensor,
        expected: &Tensor,
        config: &Config,
    ) {
        let whole = diff(actual, expected).unwrap_or_else(|e| panic!("{label} {name}: {e}"));
        if name == "logits" {
            assert!(whole.within(LOGITS_ATOL, 0.0), "{label} {name}: {whole}");
            self.0.record(name, whole.max_abs, label, "abs");
            return;
        }
        assert!(whole.within(0.0, RTOL), "{label} {name}: {whole}");
        match diff_sliced(name, actual, expected, config)
            .unwrap_or_else(|e| panic!("{label} {name}: {e}"))
        {
            Some(s) => {
                assert!(s.within(RTOL), "{label} {name}: {s}");
                let at = format!("{name} {} {}", s.what, s.worst().unwrap_or(0));
                self.0.record(name, s.relative(), &at, s.what);
            }
            None => self.0.record(name, whole.relative(), name, "tensor"),
        }
    }

    /// The worst relative figure (per head where sliced) of any family but the logits.
    pub fn overall(&self) -> f64 {
        self.0.overall()
    }

    /// One line per family.
    pub fn report(&self) -> String {
        self.0.report()
    }
}
