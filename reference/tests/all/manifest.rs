//! `testdata/manifest.json` accounts for every file under `testdata/`: each file (but the manifest) is listed in
//! `files` with its size and sha256, every listed file exists with that size and sha256, and each model's own `files`
//! list repeats the entries of the top-level one. The entries are read from the manifest (the scripts that regenerate
//! `testdata/` rewrite it), none is written here.

use crate::common::testdata;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;

fn walk(dir: &Path, root: &Path, out: &mut BTreeMap<String, u64>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            walk(&path, root, out);
        } else {
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            out.insert(rel, std::fs::metadata(&path).unwrap().len());
        }
    }
}

#[test]
fn manifest_lists_every_testdata_file_with_its_size() {
    let root = testdata();
    let repo = root.parent().unwrap().to_path_buf();
    let mut on_disk = BTreeMap::new();
    walk(&root, &repo, &mut on_disk);
    on_disk.remove("testdata/manifest.json");

    let manifest = manifest();
    let mut listed = BTreeMap::new();
    for f in manifest["files"].as_array().unwrap() {
        let path = f["path"].as_str().unwrap().to_string();
        let bytes = f["bytes"].as_u64().unwrap();
        let sha = f["sha256"].as_str().unwrap();
        assert!(
            sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()),
            "{path}: sha256 {sha}"
        );
        assert!(
            listed.insert(path.clone(), bytes).is_none(),
            "{path} listed twice"
        );
    }
    let unlisted: Vec<_> = on_disk
        .keys()
        .filter(|p| !listed.contains_key(*p))
        .collect();
    let missing: Vec<_> = listed
        .keys()
        .filter(|p| !on_disk.contains_key(*p))
        .collect();
    assert!(
        unlisted.is_empty(),
        "files under testdata/ missing from the manifest: {unlisted:?}"
    );
    assert!(
        missing.is_empty(),
        "manifest entries without a file: {missing:?}"
    );
    for (path, bytes) in &listed {
        assert_eq!(
            on_disk[path], *bytes,
            "{path}: size differs from the manifest"
        );
    }
    assert_eq!(
        manifest["total_bytes"].as_u64(),
        Some(listed.values().sum::<u64>()),
        "total_bytes"
    );
}

/// The sha256 of a file, in lower-case hex as the manifest writes it.
fn sha256(path: &Path) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    std::io::copy(&mut std::fs::File::open(path)?, &mut hasher)?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// One line for each entry of a manifest's `files` whose file under `repo` differs from it (size, sha256) or cannot
/// be read, naming the file; empty when every file is as listed.
fn mismatches(repo: &Path, files: &[serde_json::Value]) -> Vec<String> {
    let mut out = Vec::new();
    for f in files {
        let (Some(path), Some(bytes), Some(sha)) = (
            f["path"].as_str(),
            f["bytes"].as_u64(),
            f["sha256"].as_str(),
        ) else {
            out.push(format!("a malformed entry: {f}"));
            continue;
        };
        let file = repo.join(path);
        match std::fs::metadata(&file) {
            Err(e) => {
                out.push(format!("{path}: {e}"));
                continue;
            }
            Ok(m) if m.len() != bytes => {
                out.push(format!(
                    "{path}: {} bytes, the manifest lists {bytes}",
                    m.len()
                ));
            }
            Ok(_) => {}
        }
        match sha256(&file) {
            Err(e) => out.push(format!("{path}: {e}")),
            Ok(actual) if actual != sha => {
                out.push(format!("{path}: sha256 {actual}, the manifest lists {sha}"));
            }
            Ok(_) => {}
        }
    }
    out
}

/// The testdata models, as the manifest lists them (every one `scripts/make_testdata.py` made, with its goldens).
pub fn models() -> Vec<String> {
    let m = manifest();
    let models = m["models"].as_object().expect("manifest.json: no `models`");
    models.keys().cloned().collect()
}

pub fn manifest() -> serde_json::Value {
    let text = std::fs::read_to_string(testdata().join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Every file the manifest lists has the size and sha256 it lists; each model's `files` entries are the top-level
/// ones.
#[test]
fn every_listed_file_has_its_size_and_sha256() {
    let manifest = manifest();
    let files = manifest["files"].as_array().unwrap();
    let repo = testdata().parent().unwrap().to_path_buf();
    let bad = mismatches(&repo, files);
    assert!(
        bad.is_empty(),
        "files differing from testdata/manifest.json:\n{}",
        bad.join("\n")
    );
    let total: u64 = files.iter().filter_map(|f| f["bytes"].as_u64()).sum();
    println!(
        "{} files, {total} bytes: sizes and sha256 as listed",
        files.len()
    );
    for (name, model) in manifest["models"].as_object().unwrap() {
        for f in model["files"].as_array().unwrap() {
            assert!(
                files.contains(f),
                "models.{name}.files: {f} is not the top-level entry"
            );
        }
    }
}

/// The check names what differs: a copy of the manifest's two smallest files passes, then one byte flipped in the
/// first is named by its sha256, a byte appended to the second by its size, and a deleted file as missing.
#[test]
fn a_changed_byte_a_changed_size_and_a_missing_file_are_named() {
    let manifest = manifest();
    let mut files = manifest["files"].as_array().unwrap().clone();
    files.sort_by_key(|f| f["bytes"].as_u64());
    let files = &files[..2];
    let tmp = tempfile::tempdir().unwrap();
    let repo = testdata().parent().unwrap().to_path_buf();
    let path = |f: &serde_json::Value| f["path"].as_str().unwrap().to_string();
    for f in files {
        let to = tmp.path().join(path(f));
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(repo.join(path(f)), &to).unwrap();
    }
    assert_eq!(mismatches(tmp.path(), files), Vec::<String>::new());

    let first = tmp.path().join(path(&files[0]));
    let mut bytes = std::fs::read(&first).unwrap();
    bytes[0] ^= 1;
    std::fs::write(&first, &bytes).unwrap();
    let second = tmp.path().join(path(&files[1]));
    let mut more = std::fs::read(&second).unwrap();
    more.push(b'\n');
    std::fs::write(&second, &more).unwrap();
    let bad = mismatches(tmp.path(), files);
    assert_eq!(bad.len(), 3, "{bad:?}");
    assert!(
        bad[0].starts_with(&format!("{}: sha256 ", path(&files[0]))),
        "{bad:?}"
    );
    assert!(
        bad[1].starts_with(&format!("{}: {} bytes", path(&files[1]), more.len())),
        "{bad:?}"
    );
    assert!(
        bad[2].starts_with(&format!("{}: sha256 ", path(&files[1]))),
        "{bad:?}"
    );

    std::fs::remove_file(&first).unwrap();
    let bad = mismatches(tmp.path(), &files[..1]);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].starts_with(&path(&files[0])), "{bad:?}");
}
