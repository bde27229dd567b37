//! Outputs onto files only a loader reads (no flag names them): the loader that opens one refuses it as soon as it
//! does, before any work, naming the output's flag (`reference::inputs::plan_output`, planned by
//! `parity::outputs::Paths::check`).

use crate::common;

use common::{entries, stderr, testdata};
use std::path::Path;

#[test]
fn an_output_onto_a_file_only_a_loader_reads_is_refused_when_it_is_opened() {
    // Files no flag names: a set's `.bin` that the manifest reads from outside the set's folder, the config of the
    // model the manifest names (no --model), a device config named by the environment. The loader that opens one
    // refuses it as soon as it does, before any work, for every command and output flag.
    let tmp = tempfile::tempdir().unwrap();
    let (set, m, w) = (
        tmp.path().join("set"),
        tmp.path().join("m"),
        tmp.path().join("w"),
    );
    common::copy_dir(&testdata().join("sets/tiny-decoder"), &set);
    common::copy_dir(&testdata().join("models/tiny"), &m);
    std::fs::create_dir(&w).unwrap();
    std::fs::rename(set.join("weights.bin"), w.join("weights.bin")).unwrap();
    let manifest = set.join("manifest.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    json["model"] = "../m".into();
    for g in json["decoder"]["graphs"].as_array_mut().unwrap() {
        g["bin"] = "../w/weights.bin".into();
    }
    std::fs::write(&manifest, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    let dc = tmp.path().join("dc.json");
    std::fs::write(&dc, "{}\n").unwrap();
    let link = tmp.path().join("link.bin");
    std::os::unix::fs::symlink(w.join("weights.bin"), &link).unwrap();
    let inputs = [
        (w.join("weights.bin"), "weights.bin"),
        (link.clone(), "weights.bin"),
        (m.join("config.json"), "config.json"),
        (dc.clone(), "dc.json"),
    ];
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let runs: [(&str, &[&str]); 4] = [
        ("validate", &["--json", "--report", "--plot"]),
        ("compare-devices", &["--json", "--report", "--plot"]),
        ("probe", &["--json", "--report", "--plot"]),
        ("dump", &["--out"]),
    ];
    let mut cases = 0;
    for (command, flags) in runs {
        for flag in flags {
            for (out, name) in &inputs {
                let target = std::fs::canonicalize(out).unwrap();
                let before = std::fs::read(&target).unwrap();
                let mut args = vec![command.to_string(), "--ir".into(), s(&set)];
                if command == "dump" {
                    args.extend([
                        "--backend".into(),
                        "openvino".into(),
                        "--token-ids".into(),
                        "1,2,3".into(),
                    ]);
                }
                args.extend([flag.to_string(), s(out)]);
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                let o = common::qwen35_env(&args, &[("QWEN35_DEVICE_CONFIG", &s(&dc))]);
                let err = stderr(&o);
                assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
                assert!(
                    err.contains(flag) && err.contains(name) && err.contains("before any work"),
                    "{args:?}: {err}"
                );
                assert_eq!(std::fs::read(&target).unwrap(), before, "{args:?}");
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 40);
    assert_eq!(entries(&w), ["weights.bin"]);
    assert_eq!(entries(&m), entries(&testdata().join("models/tiny")));
}
