"""Writing testdata/ files the same way from every script: their sha256, JSON, safetensors headers that do not change
from run to run, and a golden's entry in testdata/manifest.json. Standard library only, so each script's own venv
(torch, NNCF, OpenVINO, numpy) can import it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTDATA = REPO / "testdata"


def rel(path: Path) -> str:
    """`path` relative to the repository, with `/`."""
    return path.resolve().relative_to(REPO).as_posix()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def canonicalize_safetensors_header(path: Path) -> None:
    """safetensors serialises `__metadata__` from a hash map, so with more than one key the header's byte order
    changes from run to run. Rewrite the header with the metadata keys sorted (tensor entries, offsets and data are
    left exactly as written), so that regenerating gives byte-identical files."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    if "__metadata__" in header:
        header = {"__metadata__": dict(sorted(header["__metadata__"].items())),
                  **{k: v for k, v in header.items() if k != "__metadata__"}}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def add_golden(path: Path, key: str, section: dict) -> None:
    """Add (or replace) the file's entry in testdata/manifest.json's `files` and the section `key` (`*_goldens`) of
    the script that wrote it. The sections of the scripts that run after make_testdata.py (`*_goldens`) follow its
    keys, in sorted order, so the manifest does not depend on the order those scripts ran in."""
    manifest_path = TESTDATA / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    name = rel(path)
    files = [f for f in manifest["files"] if f["path"] != name]
    files.append({"path": name, "bytes": path.stat().st_size, "sha256": sha256(path)})
    manifest["files"] = sorted(files, key=lambda f: f["path"].split("/"))  # as sorted(Path.rglob)
    manifest["total_bytes"] = sum(f["bytes"] for f in manifest["files"])
    manifest[key] = section
    later = sorted(k for k in manifest if k.endswith("_goldens"))
    manifest = {**{k: v for k, v in manifest.items() if k not in later}, **{k: manifest[k] for k in later}}
    write_json(manifest_path, manifest)
