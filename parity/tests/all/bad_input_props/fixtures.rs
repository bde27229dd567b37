//! The shared valid inputs every case starts from, and the small file helpers the cases use.

use super::*;

/// The shared valid inputs every case starts from (copies: a bug that writes to an input cannot touch testdata/).
pub(super) struct Fixtures {
    pub(super) root: tempfile::TempDir,
    pub(super) model: PathBuf,
    pub(super) vl_model: PathBuf,
    pub(super) clean: PathBuf,
    pub(super) set: PathBuf,
    pub(super) image: PathBuf,
    pub(super) tensors: Vec<String>,
    pub(super) config_keys: Vec<Vec<String>>,
    pub(super) manifest_keys: Vec<Vec<String>>,
}

/// The leaves of a JSON document, as key paths (array indices as numbers).
pub(super) fn leaves(v: &serde_json::Value, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                path.push(k.clone());
                leaves(x, path, out);
                path.pop();
            }
        }
        serde_json::Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                path.push(i.to_string());
                leaves(x, path, out);
                path.pop();
            }
        }
        _ => out.push(path.clone()),
    }
}

pub(super) fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

pub(super) fn fixtures() -> Fixtures {
    let root = tempfile::tempdir().unwrap();
    let r = root.path().join("fixtures");
    let model = r.join("tiny");
    copy_dir(&testdata().join("models/tiny"), &model);
    let vl_model = r.join("tiny-vl");
    copy_dir(&testdata().join("models/tiny-vl"), &vl_model);
    let set = r.join("set");
    copy_dir(&testdata().join("sets/tiny-decoder"), &set);
    let mut m = read_json(&set.join("manifest.json"));
    m["model"] = model.to_str().unwrap().into();
    std::fs::write(
        set.join("manifest.json"),
        serde_json::to_string_pretty(&m).unwrap(),
    )
    .unwrap();
    let image = r.join("small.png");
    std::fs::copy(testdata().join("images/small.png"), &image).unwrap();
    let clean = r.join("clean.safetensors");
    let o = Command::new(env!("CARGO_BIN_EXE_qwen35"))
        .args([
            "dump",
            "--token-ids",
            "11,22,33,44,55,66",
            "--generate",
            "2",
        ])
        .arg("--model")
        .arg(&model)
        .arg("--out")
        .arg(&clean)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tensors = Dump::read(&clean).unwrap().tensors.into_keys().collect();
    let mut config_keys = Vec::new();
    leaves(
        &read_json(&model.join("config.json")),
        &mut Vec::new(),
        &mut config_keys,
    );
    let mut manifest_keys = Vec::new();
    leaves(&m, &mut Vec::new(), &mut manifest_keys);
    Fixtures {
        root,
        model,
        vl_model,
        clean,
        set,
        image,
        tensors,
        config_keys,
        manifest_keys,
    }
}

pub(super) fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

pub(super) fn p(x: &Path) -> String {
    x.to_str().unwrap().to_string()
}

/// Makes a FIFO (named pipe) at `path`.
pub(super) fn mkfifo(path: &Path) {
    let made = Command::new("mkfifo").arg(path).status().unwrap();
    assert!(made.success(), "mkfifo {}", path.display());
}

/// A copy of the folder `src` at `dst`: `edit` is copied, the rest hard-linked (hashed all the same).
pub(super) fn link_dir(src: &Path, dst: &Path, edit: &str) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        if e.file_name() == edit {
            std::fs::copy(e.path(), &to).unwrap();
        } else {
            std::fs::hard_link(e.path(), &to).unwrap();
        }
    }
}
