//! `testdata/manifest.json` accounts for every file under `testdata/`: each file (but the manifest) is listed in
//! `files` with its size, and every listed file exists. (The sha256 sums are for people and scripts; checking them
//! here would need a hash crate.)

use crate::common::testdata;
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

    let text = std::fs::read_to_string(root.join("manifest.json")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
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
