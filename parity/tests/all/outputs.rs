//! What the commands write, through the binary: no output overwrites an input or another output, each is checked
//! to be writable before any work, files are replaced whole with the umask's mode, directories are written whole
//! (export-ir, synth) and synth checks the free space first; OS errors name the flag and the path once.

use crate::common;

use common::{entries, expect_error, qwen35, stderr, testdata};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// A copy of the tiny model in `dir/m`, so that a failure cannot touch `testdata/`.
fn tiny_copy(dir: &Path) -> std::path::PathBuf {
    let m = dir.join("m");
    common::copy_dir(&testdata().join("models/tiny"), &m);
    m
}

#[test]
fn dump_never_overwrites_the_checkpoint_it_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_copy(tmp.path());
    let checkpoint = m.join("model.safetensors");
    let before = std::fs::read(&checkpoint).unwrap();
    let ms = m.to_str().unwrap();
    for out in [
        checkpoint.clone(),
        m.join("./model.safetensors"),
        m.join("../m/config.json"),
    ] {
        expect_error(
            &[
                "dump",
                "--model",
                ms,
                "--token-ids",
                "1,2,3",
                "--out",
                out.to_str().unwrap(),
            ],
            &[
                "--out",
                out.file_name().unwrap().to_str().unwrap(),
                "--model",
            ],
        );
    }
    // Through a link to the model's directory too.
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&m, &link).unwrap();
    let via = link.join("model.safetensors");
    expect_error(
        &[
            "dump",
            "--model",
            ms,
            "--token-ids",
            "1,2,3",
            "--out",
            via.to_str().unwrap(),
        ],
        &["--out", "model.safetensors"],
    );
    assert_eq!(std::fs::read(&checkpoint).unwrap(), before);
    assert_eq!(
        entries(&m),
        entries(&testdata().join("models/tiny")),
        "nothing left in the model's directory"
    );
}

#[test]
fn diff_never_overwrites_its_inputs_nor_one_report_another() {
    let tmp = tempfile::tempdir().unwrap();
    // The check comes before the dumps are read: any bytes do.
    let (a, b) = (
        tmp.path().join("a.safetensors"),
        tmp.path().join("b.safetensors"),
    );
    std::fs::write(&a, "not read").unwrap();
    std::fs::write(&b, "not read either").unwrap();
    let (a_s, b_s) = (a.to_str().unwrap(), b.to_str().unwrap());
    expect_error(&["diff", a_s, b_s, "--json", a_s], &["--json", "ACTUAL"]);
    let b_again = tmp.path().join(".").join("b.safetensors");
    expect_error(
        &["diff", a_s, b_s, "--report", b_again.to_str().unwrap()],
        &["--report", "REFERENCE"],
    );
    let r = tmp.path().join("r.out");
    let r = r.to_str().unwrap();
    expect_error(
        &["diff", a_s, b_s, "--json", r, "--report", r],
        &["--json", "--report", "same file"],
    );
    expect_error(
        &["diff", a_s, b_s, "--json", r, "--plot", r],
        &["--json", "--plot"],
    );
    assert_eq!(std::fs::read_to_string(&a).unwrap(), "not read");
    assert_eq!(entries(tmp.path()), ["a.safetensors", "b.safetensors"]);
}

#[test]
fn an_unwritable_output_fails_before_any_work() {
    // validate runs every check on the tiny model (seconds); a /proc path fails before the first.
    let start = Instant::now();
    let o = qwen35(&[
        "validate",
        "--device",
        "FP16SIM",
        "--json",
        "/proc/qwen35-x.json",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--json /proc/qwen35-x.json"),
        "{}",
        stderr(&o)
    );
    assert!(o.stdout.is_empty(), "nothing ran");
    assert!(start.elapsed() < Duration::from_secs(5));
    expect_error(
        &[
            "ranges",
            "--token-ids",
            "1,2",
            "--json",
            "/no-such-dir-qwen35/r.json",
        ],
        &["--json", "does not exist"],
    );
}

/// Runs `qwen35 args` under `umask`.
fn with_umask(umask: &str, args: &[&str]) -> std::process::Output {
    Command::new("sh")
        .arg("-c")
        .arg(format!("umask {umask}; exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_qwen35"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn dumps_and_reports_take_the_umask_mode() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    for (umask, want) in [("022", 0o644), ("027", 0o640)] {
        let out = tmp.path().join(format!("d{umask}.safetensors"));
        let o = with_umask(
            umask,
            &[
                "dump",
                "--token-ids",
                "1,2,3",
                "--out",
                out.to_str().unwrap(),
            ],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(mode(&out), want, "dump under umask {umask}");
        // Replacing a file gives the new file the same mode, and a report is made alike.
        let json = tmp.path().join(format!("r{umask}.json"));
        let o = with_umask(
            umask,
            &[
                "diff",
                out.to_str().unwrap(),
                out.to_str().unwrap(),
                "--json",
                json.to_str().unwrap(),
            ],
        );
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        assert_eq!(mode(&json), want, "report under umask {umask}");
    }
    // No temporary sibling left.
    assert_eq!(entries(tmp.path()).len(), 4, "{:?}", entries(tmp.path()));
}

#[test]
fn export_ir_refuses_repeated_blocks_and_a_used_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let fresh = tmp.path().join("fresh");
    let f = fresh.to_str().unwrap();
    expect_error(
        &["export-ir", "--out", f, "--blocks", "16,16"],
        &["--blocks", "16", "twice"],
    );
    expect_error(
        &["export-ir", "--out", f, "--parts", "decoder,decoder"],
        &["--parts", "twice"],
    );
    assert!(!fresh.exists());
    let used = tmp.path().join("used");
    std::fs::create_dir(&used).unwrap();
    std::fs::write(used.join("old.xml"), "<net/>").unwrap();
    expect_error(
        &["export-ir", "--out", used.to_str().unwrap()],
        &["--out", "not empty"],
    );
    assert_eq!(entries(&used), ["old.xml"]);
    // The model's own directory is an input.
    let m = tiny_copy(tmp.path());
    expect_error(
        &[
            "export-ir",
            "--model",
            m.to_str().unwrap(),
            "--out",
            m.to_str().unwrap(),
        ],
        &["--out", "--model"],
    );
}

#[test]
fn synth_checks_the_free_space_before_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("big");
    // 10000 layers of Qwen3.5-9B: about 4.3 TB.
    let o = qwen35(&["synth", "--out", out.to_str().unwrap(), "--layers", "10000"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    for needle in ["--out", "GB", "free", "10000 layers"] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
    assert!(entries(tmp.path()).is_empty(), "{:?}", entries(tmp.path()));
}

#[test]
fn synth_writes_its_directory_whole_and_a_stale_sibling_blocks_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ckpt");
    // What a killed run leaves: a sibling named after a process that is gone.
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let stale = tmp.path().join(format!(".ckpt.partial-{dead}-x1y2z3"));
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("config.json"), "{}").unwrap();
    let o = qwen35(&[
        "synth",
        "--out",
        out.to_str().unwrap(),
        "--layers",
        "2",
        "--arch",
        "tiny",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        entries(tmp.path()),
        ["ckpt"],
        "the stale sibling is removed"
    );
    assert!(out.join("config.json").exists() && out.join("model.safetensors.index.json").exists());
}

#[test]
fn os_errors_name_the_flag_and_the_path_once() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("d.safetensors");
    let out = out.to_str().unwrap();
    let cases: [(&[&str], &str, &str); 3] = [
        (
            &[
                "dump",
                "--backend",
                "openvino",
                "--device-config",
                "/no-such-qwen35.json",
                "--token-ids",
                "1,2",
                "--out",
                out,
            ],
            "--device-config",
            "/no-such-qwen35.json",
        ),
        (
            &[
                "dump",
                "--backend",
                "openvino",
                "--cache-dir",
                "/proc/qwen35-cache",
                "--token-ids",
                "1,2",
                "--out",
                out,
            ],
            "--cache-dir",
            "/proc/qwen35-cache",
        ),
        (
            &[
                "synth",
                "--out",
                "/proc/qwen35-synth",
                "--layers",
                "1",
                "--arch",
                "tiny",
            ],
            "--out",
            "/proc/qwen35-synth",
        ),
    ];
    for (args, flag, path) in cases {
        let o = qwen35(args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?}: {err}");
        assert_eq!(err.matches(path).count(), 1, "{args:?}: {err}");
        assert_eq!(err.matches("(os error").count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn a_file_size_limit_is_an_error_naming_the_output() {
    // `ulimit -f 64`: 32 or 64 KiB (the shell's block), far below a dump of the tiny model; without SIGXFSZ ignored
    // the process is killed by the signal with no word.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("out");
    std::fs::create_dir(&dir).unwrap();
    let out = dir.join("d.safetensors");
    let model = testdata().join("models/tiny");
    let o = Command::new("sh")
        .arg("-c")
        .arg("ulimit -f 64; exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_qwen35"))
        .args([
            "dump",
            "--model",
            model.to_str().unwrap(),
            "--token-ids",
            "1,2,3,4,5,6,7,8",
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{:?}: {err}", o.status);
    assert!(err.contains("d.safetensors"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(entries(&dir).is_empty(), "{:?}", entries(&dir));
}

/// A run for [`no_output_overwrites_a_file_the_run_reads`]: a command's arguments, its environment, the flags that
/// take an output file, and the files it reads, each with what may name it in the error (its file name, or the flag
/// of the directory that holds it).
struct Reads {
    args: Vec<String>,
    env: Vec<(String, String)>,
    flags: &'static [&'static str],
    inputs: Vec<(std::path::PathBuf, &'static str)>,
}

#[test]
fn no_output_overwrites_a_file_the_run_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    common::copy_dir(&testdata().join("models/tiny-vl"), &m);
    let inputs = tmp.path().join("in");
    std::fs::create_dir(&inputs).unwrap();
    let img = inputs.join("img.png");
    std::fs::copy(testdata().join("images/small.png"), &img).unwrap();
    // transformers' own pixel values for the goldens' images, and the ids that hold their placeholders.
    let g = candle_core::safetensors::load(
        testdata().join("goldens/tiny-vl.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let pv = inputs.join("pv.safetensors");
    let pixels: std::collections::HashMap<String, candle_core::Tensor> = [
        ("pixel_values", "images.pixel_values"),
        ("image_grid_thw", "images.image_grid_thw"),
    ]
    .into_iter()
    .map(|(k, from)| (k.to_string(), g[from].clone()))
    .collect();
    candle_core::safetensors::save(&pixels, &pv).unwrap();
    let ids = common::ids_arg(&g["images.token_ids"]);
    let dc = inputs.join("dc.json");
    std::fs::write(&dc, "{}\n").unwrap();
    let (a, b) = (inputs.join("a.safetensors"), inputs.join("b.safetensors"));
    for d in [&a, &b] {
        let o = qwen35(&["dump", "--token-ids", "1,2,3", "--out", d.to_str().unwrap()]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let strings = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let model_files = |names: &[&'static str]| {
        names
            .iter()
            .map(|n| (m.join(n), "--model"))
            .collect::<Vec<_>>()
    };
    let image = strings(&["--model", &s(&m), "--image", &s(&img), "--prompt", "hi"]);
    let pixel = strings(&[
        "--model",
        &s(&m),
        "--pixel-values",
        &s(&pv),
        "--token-ids",
        &ids,
    ]);
    let mut runs = Vec::new();
    for command in ["dump", "ranges"] {
        let flags: &'static [&'static str] = if command == "dump" {
            &["--out"]
        } else {
            &["--json"]
        };
        let mut with_image = vec![(img.clone(), "img.png")];
        with_image.extend(model_files(&[
            "config.json",
            "model.safetensors.index.json",
            "model-00002-of-00002.safetensors",
            "tokenizer.json",
            "preprocessor_config.json",
        ]));
        runs.push(Reads {
            args: [vec![command.to_string()], image.clone()].concat(),
            env: vec![],
            flags,
            inputs: with_image,
        });
        runs.push(Reads {
            args: [vec![command.to_string()], pixel.clone()].concat(),
            env: vec![],
            flags,
            inputs: vec![(pv.clone(), "pv.safetensors")],
        });
    }
    runs.push(Reads {
        args: strings(&["diff", &s(&a), &s(&b)]),
        env: vec![],
        flags: &["--json", "--report", "--plot"],
        inputs: vec![(a.clone(), "a.safetensors"), (b.clone(), "b.safetensors")],
    });
    // A device config named by the environment, not by a flag.
    runs.push(Reads {
        args: strings(&["dump", "--backend", "openvino", "--token-ids", "1,2"]),
        env: vec![("QWEN35_DEVICE_CONFIG".to_string(), s(&dc))],
        flags: &["--out"],
        inputs: vec![(dc.clone(), "dc.json")],
    });
    let links = tmp.path().join("links");
    std::fs::create_dir(&links).unwrap();
    let mut cases = 0;
    for run in &runs {
        for flag in run.flags {
            for (n, (input, names)) in run.inputs.iter().enumerate() {
                // The input itself, and a link to it elsewhere.
                let link = links.join(format!(
                    "{}-{n}-{}",
                    run.args[0],
                    flag.trim_start_matches('-')
                ));
                let _ = std::fs::remove_file(&link);
                std::os::unix::fs::symlink(input, &link).unwrap();
                for out in [input, &link] {
                    let before = std::fs::read(input).unwrap();
                    let mut args = run.args.clone();
                    args.extend([flag.to_string(), s(out)]);
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    let env: Vec<(&str, &str)> = run
                        .env
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    let o = common::qwen35_env(&args, &env);
                    let err = stderr(&o);
                    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
                    assert!(err.contains(flag), "{args:?}: {err}");
                    let input_named = err.contains(input.file_name().unwrap().to_str().unwrap())
                        || err.contains(names);
                    assert!(input_named, "{args:?}: the input is not named: {err}");
                    assert_eq!(
                        std::fs::read(input).unwrap(),
                        before,
                        "{args:?} changed {input:?}"
                    );
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 42);
    // Nothing left beside the inputs.
    assert_eq!(
        entries(&inputs),
        [
            "a.safetensors",
            "b.safetensors",
            "dc.json",
            "img.png",
            "pv.safetensors"
        ]
    );
}

#[test]
fn an_output_name_too_long_for_its_partial_fails_before_any_work() {
    // Every length around the file system's 255-byte limit, for a file written through a hidden partial
    // (`.NAME.XXXXXX.partial`: 16 bytes more) and a directory written through a staged sibling
    // (`.NAME.partial-PID-XXXXXX`): either the run goes through and the output is there, or the before-work check
    // refuses it naming the flag, before anything ran. Never a refusal after the work.
    let tmp = tempfile::tempdir().unwrap();
    let (mut refused, mut written) = (0, 0);
    for len in (225..=255).step_by(3) {
        for (command, flag) in [("ranges", "--json"), ("export-ir", "--out")] {
            let dir = tmp.path().join(format!("{command}-{len}"));
            std::fs::create_dir(&dir).unwrap();
            let out = dir.join("x".repeat(len));
            let out = out.to_str().unwrap();
            let o = match command {
                "ranges" => qwen35(&["ranges", "--token-ids", "1,2", flag, out]),
                _ => qwen35(&["export-ir", flag, out]),
            };
            let err = stderr(&o);
            assert!(!err.contains("panicked"), "{command} {len}: {err}");
            match o.status.code() {
                Some(0) => {
                    assert!(Path::new(out).exists(), "{command} {len}: no output");
                    written += 1;
                }
                Some(2) => {
                    assert!(
                        err.contains(flag) && err.contains("cannot create"),
                        "{command} {len}: not the before-work check: {err}"
                    );
                    assert!(o.stdout.is_empty(), "{command} {len}: it ran first");
                    assert!(
                        entries(&dir).is_empty(),
                        "{command} {len}: left {:?}",
                        entries(&dir)
                    );
                    refused += 1;
                }
                c => panic!("{command} {len}: exit {c:?}: {err}"),
            }
        }
    }
    assert!(
        refused > 0 && written > 0,
        "{refused} refused, {written} written"
    );
}
