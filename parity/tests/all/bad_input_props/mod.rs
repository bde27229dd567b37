//! The generated bad-input suite: invalid arguments, model configs, graph-set manifests, dumps and images made from
//! valid ones by changing ONE thing (a flag's value, a JSON key, a dump tensor, an image's bytes), each run against
//! the built binary and held to the promise of `bad_input.rs`, for inputs no one listed:
//!
//! - exit 2 (an error) or 1 (a finding), never 0 unless the change is harmless (a count of zero where zero means
//!   nothing to do, a manifest key the format makes optional), never a panic, an abort or a signal, never a hang;
//! - the culprit (the flag, the key, the tensor or the file) named in the message;
//! - no input changed (every file a case names is hashed before and after, and the shared fixtures around the run);
//! - nothing left at the outputs (the output folder listed, hidden files included: empty after an error, only the
//!   named outputs after a run).
//!
//! The cases are drawn by proptest from a fixed seed, [`CASES`] of them, and run a few at a time.

use candle_core::{DType, Tensor};
use parity::dump::Dump;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common;
use common::{copy_dir, testdata};

mod bases;
mod cases;
mod fixtures;

use bases::*;
use cases::*;
use fixtures::*;

/// Cases per run.
const CASES: usize = 420;
/// Runs at a time.
const THREADS: usize = 3;
/// Longer than any case takes: past it the case hung.
const TIMEOUT: Duration = Duration::from_secs(15);

/// Mutation classes whose promise is not kept yet (issue 32): a failure in one of these is printed, not counted, so
/// the rest of the promise holds meanwhile. Each entry: the class (a prefix of the case's label) and why. Remove an
/// entry when its mechanism lands.
const PENDING: &[(&str, &str)] = &[];

/// A hash of every file under `dir` (by relative path; fifos and folders by name only).
fn hash_tree(dir: &Path) -> BTreeMap<PathBuf, u64> {
    use std::hash::{Hash, Hasher};
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            let t = e.file_type().unwrap();
            let mut h = std::collections::hash_map::DefaultHasher::new();
            if t.is_dir() {
                stack.push(path.clone());
            } else if t.is_file() {
                std::fs::read(&path).unwrap_or_default().hash(&mut h);
            }
            out.insert(path.strip_prefix(dir).unwrap().to_path_buf(), h.finish());
        }
    }
    out
}

/// Runs `case`; what went wrong, if anything.
fn check(case: &Case) -> Option<String> {
    let before = hash_tree(&case.inputs);
    let stdout = std::fs::File::create(case.logs.join("stdout")).unwrap();
    let stderr = std::fs::File::create(case.logs.join("stderr")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_qwen35"))
        .args(&case.args)
        .env_remove("QWEN35_DEVICE_CONFIG")
        .env_remove("OPENVINO_LIB")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let err = std::fs::read_to_string(case.logs.join("stderr")).unwrap_or_default();
    let text = err.clone() + &std::fs::read_to_string(case.logs.join("stdout")).unwrap_or_default();
    let mut wrong = Vec::new();
    let code = status.and_then(|s| s.code());
    match (status, code) {
        (None, _) => wrong.push(format!("no exit after {TIMEOUT:?}")),
        (Some(s), None) => wrong.push(format!("killed by a signal ({s})")),
        (_, Some(1 | 2)) => {}
        (_, Some(0)) if case.harmless => {}
        (_, Some(c)) => wrong.push(format!("exit {c}")),
    }
    if text.contains("panicked") {
        wrong.push("panicked".into());
    }
    if code.is_some_and(|c| c != 0) && !case.culprits.iter().any(|c| text.contains(c.as_str())) {
        wrong.push(format!("none of {:?} named", case.culprits));
    }
    if hash_tree(&case.inputs) != before {
        wrong.push("an input changed".into());
    }
    let left: Vec<String> = std::fs::read_dir(&case.out)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let allowed = |n: &String| code.is_some_and(|c| c < 2) && case.outputs.contains(n);
    let litter: Vec<&String> = left.iter().filter(|n| !allowed(n)).collect();
    if !litter.is_empty() {
        wrong.push(format!("left at the output: {litter:?}"));
    }
    (!wrong.is_empty()).then(|| {
        let last = err
            .lines()
            .last()
            .unwrap_or("")
            .chars()
            .take(200)
            .collect::<String>();
        format!("{}: {} — {last}", case.label, wrong.join(", "))
    })
}

#[test]
fn generated_bad_inputs_keep_the_promise() {
    let f = fixtures();
    let shared = hash_tree(&f.root.path().join("fixtures"));
    let bases = bases();
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[32; 32]),
    );
    let drawn = proptest::collection::vec(mutation(), CASES)
        .new_tree(&mut runner)
        .unwrap()
        .current();
    let cases: Vec<Case> = drawn
        .iter()
        .enumerate()
        .map(|(n, m)| make(n, m, &f, &bases))
        .collect();
    let start = Instant::now();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..THREADS {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(case) = cases.get(i) else { break };
                    let t = Instant::now();
                    let r = check(case);
                    results
                        .lock()
                        .unwrap()
                        .push((i, r, t.elapsed().as_secs_f64()));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|r| r.0);
    let mut failed = Vec::new();
    let mut pending = Vec::new();
    for (i, r, _) in &results {
        if let Some(r) = r {
            match PENDING
                .iter()
                .find(|(class, _)| cases[*i].label.starts_with(class))
            {
                Some((_, why)) => pending.push(format!("{r} [pending: {why}]")),
                None => failed.push(r.clone()),
            }
        }
    }
    let mut classes: BTreeMap<&str, usize> = BTreeMap::new();
    for c in &cases {
        *classes
            .entry(c.label.split(' ').next().unwrap_or(""))
            .or_default() += 1;
    }
    println!("cases per class: {classes:?}");
    let mut slow: Vec<_> = results.iter().map(|r| (r.2, &cases[r.0].label)).collect();
    slow.sort_by(|a, b| b.0.total_cmp(&a.0));
    println!(
        "{} generated bad-input cases in {:.1} s ({} threads); slowest: {:?}",
        cases.len(),
        start.elapsed().as_secs_f64(),
        THREADS,
        &slow[..5.min(slow.len())]
    );
    if !pending.is_empty() {
        println!(
            "{} failures in pending classes (kept by other mechanisms of issue 32):\n{}",
            pending.len(),
            pending.join("\n")
        );
    }
    if hash_tree(&f.root.path().join("fixtures")) != shared {
        failed.push("a shared input (fixtures/) changed".into());
    }
    assert!(
        failed.is_empty(),
        "{} of {} generated cases broke the promise:\n{}",
        failed.len(),
        cases.len(),
        failed.join("\n")
    );
}
