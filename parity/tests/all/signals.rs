//! Ctrl-C (SIGINT) and SIGTERM in the middle of writing: the run ends with 130 or 143, as a shell reports a process
//! the signal ended, and leaves nothing behind, no hidden partial file or directory.

use crate::common;

use common::stderr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The names in `dir`.
fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn a_signal_during_a_dump_an_export_or_a_synth_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    // The tiny architecture with 160 layers: a dump and an export long enough (seconds) to be caught writing. Each
    // command is ended by SIGINT once and SIGTERM once; the exit code is the signal's even when the removal of the
    // partial made the command itself fail (a writer finding its directory gone).
    let model = tmp.path().join("m");
    let o = common::qwen35(&[
        "synth",
        "--arch",
        "tiny",
        "--layers",
        "160",
        "--out",
        model.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = model.to_str().unwrap();
    for (n, (signal, code)) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)]
        .into_iter()
        .cycle()
        .take(6)
        .enumerate()
    {
        let dir = tmp.path().join(format!("out{n}"));
        std::fs::create_dir(&dir).unwrap();
        let args: Vec<String> = if n < 2 {
            let out = dir.join("d.safetensors");
            [
                "dump",
                "--model",
                m,
                "--token-ids",
                "1,2,3",
                "--generate",
                "300",
                "--out",
            ]
            .iter()
            .map(|s| s.to_string())
            .chain([out.to_str().unwrap().to_string()])
            .collect()
        } else if n >= 4 {
            let out = dir.join("m");
            ["synth", "--arch", "tiny", "--layers", "400", "--out"]
                .iter()
                .map(|s| s.to_string())
                .chain([out.to_str().unwrap().to_string()])
                .collect()
        } else {
            let out = dir.join("ir");
            ["export-ir", "--model", m, "--layers", "--out"]
                .iter()
                .map(|s| s.to_string())
                .chain([out.to_str().unwrap().to_string()])
                .collect()
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_qwen35"))
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Wait until the partial is there.
        let start = Instant::now();
        loop {
            if entries(&dir).iter().any(|e| e.starts_with('.')) {
                break;
            }
            assert!(
                child.try_wait().unwrap().is_none(),
                "{args:?} ended before a partial was seen"
            );
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{args:?}: no partial"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        // SAFETY: sends a signal to the child this test started.
        unsafe {
            libc::kill(child.id() as libc::pid_t, signal);
        }
        let o = child.wait_with_output().unwrap();
        assert_eq!(
            o.status.code(),
            Some(code),
            "{args:?} {signal}: {}",
            stderr(&o)
        );
        assert!(
            entries(&dir).is_empty(),
            "{args:?}: left {:?}",
            entries(&dir)
        );
    }
}
