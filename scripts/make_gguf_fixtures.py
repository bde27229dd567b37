#!/usr/bin/env python3
"""GGUF fixtures made by llama.cpp itself: its converter, its quantizer, and the tensors its CPU back end computes.

Given a llama.cpp source tree (outside this repository), this script

1. builds llama.cpp (`--build`: CMake + Ninja, CPU back end only, targets `llama-quantize` and `libllama`) and
   compiles `scripts/llama_dump.cpp` against it (a small program of ours that runs a GGUF on given token ids and
   writes every tensor of llama.cpp's graph through its evaluation callback `cb_eval`, and the logits);
2. converts each testdata model of MODELS with llama.cpp's `convert_hf_to_gguf.py` (`--outtype f32 --no-mtp`) from a
   staged copy in the work directory, with two work-arounds applied there, outside the repository (see "Converter"
   below). `tiny` and `tiny-moe` are converted but refused at load (their linear key and value head dims differ,
   which llama.cpp's Qwen3.5 graph cannot hold); `tiny-moe-gguf` (scripts/make_moe_goldens.py) is the MoE model made
   for it: tiny-moe with equal head dims and 32-wide experts;
3. quantizes each f32 GGUF with `llama-quantize` into Q8_0, Q4_0, Q4_K_M (a mixed-type file), Q6_K and IQ4_NL
   (an IQ type that needs no importance matrix);
4. runs every GGUF (the f32 one and each quantized one) in llama.cpp on the first 8 token ids of the model's golden
   prompt (`testdata/goldens/<model>.safetensors`, `token_ids`) and writes what llama.cpp computed.

Outputs, in `testdata/gguf/llamacpp/` (`--out`):

- `<model>.f32.gguf` and `<model>.<type>.gguf`: the converter's and the quantizer's files, unchanged;
- `<model>.<type>.dump.safetensors`: f32 tensors under llama.cpp's own names (`l_out-3`, `attn_norm-0`, ...; a name
  that occurs again in the graph gets `#1`, `#2`, ... in graph order), each with llama.cpp's shape reversed to
  row-major (`ne[0]` last); `logits` [T, V] for every position. The f32 file's dump and the Q4_K_M file's dump of
  the small models hold every named tensor of the graph (not the caches' views, `cache_*`, nor unnamed nodes,
  `node_*`); the others hold the per-layer outputs (`l_out-*`, `attn_output-*`, `linear_attn_out-*`, `ffn_out-*`),
  the embeddings (`model.input_embed`), the final norm (`result_norm`) and the logits, to keep the fixtures small
  (see TYPES_FOR, F32_GGUF_KEPT). Metadata: the llama.cpp commit, the model, the type, the token ids, which tensors;
- `fixtures.json`: the llama.cpp commit, the tools' versions, the token ids, each file's size, sha256 and (for the
  GGUFs) the count of tensors of each ggml type and every tensor's type (`tensor_types_by_name`: `blk.*.<name>`
  lists the blocks' types in block order, the MoE's stacked experts `ffn_{gate,up,down}_exps` included), and every
  model llama.cpp refused with its message (the work directory's path left out);
- `testdata/manifest.json`: when the output is `testdata/gguf/llamacpp/`, its entries of `testdata/gguf/` (size,
  sha256) and the file list of its section `gguf_goldens` are rewritten from the files on disk (`--manifest-only`
  does only that, after a README there is edited).

Converter: llama.cpp's converter (a) asks transformers for the tokenizer class the testdata's tokenizer_config.json
names, `Qwen3_5Tokenizer`, which the transformers version it pins (4.57.6) does not have: the staged copy names
`Qwen2TokenizerFast` instead (the same byte-level BPE read from the same tokenizer.json); (b) refuses a
pre-tokenizer whose hash it does not know (the testdata tokenizer's vocabulary is its own): the pre-tokenizer is set
to `qwen35`, whose regex is the one of the testdata tokenizer.json (checked below), by replacing
`TextModel.get_vocab_base_pre` in the converter's process. Nothing else is changed.

Run (about 30 min on 2 cores, most of it the build; the conversions, quantizations and runs of the five models
take about 4 min):

    python -m venv /tmp/gguf-venv && /tmp/gguf-venv/bin/pip install torch==2.15.0 transformers==4.57.6 \\
        sentencepiece protobuf gguf==0.19.0 numpy==2.4.6 safetensors==0.8.0 cmake ninja
    /tmp/gguf-venv/bin/python scripts/make_gguf_fixtures.py --llama-cpp /tmp/llama.cpp --build \\
        --llama-commit <sha>

torch is PyPI's wheel (2.15.0, the CUDA 13.2 build, run on the CPU; the CPU-only wheel's index is not reachable
from every machine). The llama.cpp tree: the `llama-cpp-python` 0.3.36 sdist (`pip download --no-deps --no-binary
llama-cpp-python llama-cpp-python==0.3.36`) vendors llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f in
`vendor/llama.cpp` (the sdist's `.git/modules/vendor/llama.cpp/HEAD` names that commit); copy it to /tmp/llama.cpp.
CI needs none of this: the outputs are committed. The script is deterministic: a second run, on another machine
(an AMD EPYC of CPU family 26, Zen 5; the README names Zen 4 for the first), rewrote the files of tiny-tied and tiny-h128 byte for byte (sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import platform
import shutil
import struct
import subprocess
import sys
from collections import Counter

import numpy as np
from safetensors.numpy import load_file

from gguf_fixture_io import save_sorted

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ["tiny", "tiny-moe", "tiny-tied", "tiny-h128", "tiny-moe-gguf"]
TYPES = ["q8_0", "q4_0", "q4_k_m", "q6_k", "iq4_nl"]
# Kept small (a few MB in all): tiny-h128 (head dim 128, 2.6 times tiny-tied's bytes) gets four types and no
# committed f32 GGUF (1.7 MB; this script remakes it); every graph tensor is kept for the f32 and Q4_K_M runs of the
# smaller models only.
TYPES_FOR = {"tiny-h128": ["q8_0", "q4_k_m", "q6_k", "iq4_nl"]}
F32_GGUF_KEPT = {"tiny", "tiny-moe", "tiny-tied", "tiny-moe-gguf"}
FULL_DUMPS = {"f32", "q4_k_m"}
FULL_DUMP_MODELS = {"tiny", "tiny-moe", "tiny-tied", "tiny-moe-gguf"}
N_TOKENS = 8
QWEN35_REGEX = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)

CONVERT_WRAPPER = """
import runpy, sys
tree = sys.argv[1]
sys.path.insert(0, tree)
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
sys.argv = [tree + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    shown = ["<converter wrapper>" if "\n" in str(c) else str(c) for c in cmd]
    print("+", " ".join(shown), flush=True)
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


def build(tree: pathlib.Path, work: pathlib.Path) -> None:
    b = tree / "build"
    cfg = run(["cmake", "-S", str(tree), "-B", str(b), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
               "-DLLAMA_CURL=OFF", "-DGGML_OPENMP=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DBUILD_SHARED_LIBS=ON"])
    if cfg.returncode != 0:
        raise SystemExit(f"cmake configure failed:\n{cfg.stderr[-3000:]}")
    made = run(["ninja", "-C", str(b), "-j2", "llama-quantize", "llama"])
    if made.returncode != 0:
        raise SystemExit(f"llama.cpp build failed:\n{made.stdout[-3000:]}")


def compile_dump(tree: pathlib.Path, work: pathlib.Path) -> pathlib.Path:
    exe = work / "llama_dump"
    lib = tree / "build" / "bin"
    made = run(["g++", "-O2", "-std=c++17", f"-I{tree / 'include'}", f"-I{tree / 'ggml' / 'include'}",
                str(ROOT / "scripts" / "llama_dump.cpp"), f"-L{lib}", "-lllama", "-lggml", "-lggml-base",
                f"-Wl,-rpath,{lib}", "-o", str(exe)])
    if made.returncode != 0:
        raise SystemExit(f"scripts/llama_dump.cpp did not compile:\n{made.stderr[-3000:]}")
    return exe


def stage(model: str, work: pathlib.Path) -> pathlib.Path:
    src = ROOT / "testdata" / "models" / model
    dst = work / "stage" / model
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2TokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    tok = json.loads((dst / "tokenizer.json").read_text())
    regexes = [p["pattern"]["Regex"] for p in tok["pre_tokenizer"]["pretokenizers"] if p["type"] == "Split"]
    if regexes != [QWEN35_REGEX]:
        raise SystemExit(f"{model}: the tokenizer's pre-tokenizer is not Qwen3.5's; `qwen35` would be wrong")
    return dst


def read_dump(path: pathlib.Path) -> list[tuple[int, str, int, tuple[int, ...], np.ndarray]]:
    b = path.read_bytes()
    out, i = [], 0
    while i < len(b):
        kind, ln = struct.unpack_from("<II", b, i)
        i += 8
        name = b[i:i + ln].decode()
        i += ln
        ty, nd = struct.unpack_from("<II", b, i)
        i += 8
        ne = struct.unpack_from("<4q", b, i)
        i += 32
        n = int(np.prod(ne))
        data = np.frombuffer(b, dtype="<f4", count=n, offset=i).copy()
        i += 4 * n
        if n == 0:  # an empty view (a cache slice no token fills): nothing was computed
            continue
        shape = tuple(reversed(ne[:max(nd, 1)]))
        out.append((kind, name, ty, shape, data.reshape(shape)))
    return out


def keep_subset(name: str) -> bool:
    """The per-layer outputs: each layer's output, its mixer's and its MLP's, the embeddings, the final norm."""
    layer = ("l_out-", "attn_output-", "linear_attn_out-", "ffn_out-", "ffn_moe_out-")
    return name.startswith(layer) or name in ("model.input_embed", "result_norm")


def keep_full(name: str) -> bool:
    """Every named tensor of the graph but the caches' views and copies (`cache_*`) and unnamed nodes (`node_*`)."""
    return not name.startswith(("cache_", "node_"))


def gguf_types(path: pathlib.Path) -> dict[str, int]:
    from gguf import GGUFReader
    reader = GGUFReader(str(path))
    return dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items()))


def gguf_types_by_tensor(path: pathlib.Path) -> dict[str, str]:
    """The ggml type of every tensor: `blk.{i}.<name>` as one entry `blk.*.<name>` whose value lists the blocks'
    types in block order (`"Q5_0 Q8_0 Q5_0 Q5_0"`), the others by name."""
    from gguf import GGUFReader
    per_block: dict[str, dict[int, str]] = {}
    out: dict[str, str] = {}
    for t in GGUFReader(str(path)).tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
            per_block.setdefault("blk.*." + ".".join(parts[2:]), {})[int(parts[1])] = t.tensor_type.name
        else:
            out[t.name] = t.tensor_type.name
    for name, blocks in per_block.items():
        out[name] = " ".join(blocks[i] for i in sorted(blocks))
    return dict(sorted(out.items()))


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def update_manifest() -> None:
    """testdata/manifest.json lists every file under testdata/ with its size and sha256: its entries under
    testdata/gguf/ and the file list of its section `gguf_goldens` are rewritten from the files on disk."""
    from testdata_files import TESTDATA, rel, write_json
    from testdata_files import sha256 as file_sha256
    path = TESTDATA / "manifest.json"
    manifest = json.loads(path.read_text(encoding="utf-8"))
    on_disk = sorted((p for p in (TESTDATA / "gguf").rglob("*") if p.is_file()), key=lambda p: rel(p).split("/"))
    files = [f for f in manifest["files"] if not f["path"].startswith("testdata/gguf/")]
    files += [{"path": rel(p), "bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in on_disk]
    manifest["files"] = sorted(files, key=lambda f: f["path"].split("/"))
    manifest["total_bytes"] = sum(f["bytes"] for f in manifest["files"])
    manifest["gguf_goldens"]["files"] = [rel(p) for p in on_disk]
    write_json(path, manifest)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", type=pathlib.Path, help="a llama.cpp source tree")
    parser.add_argument("--llama-commit", help="the commit of that tree")
    parser.add_argument("--manifest-only", action="store_true",
                        help="only list testdata/gguf/'s files in testdata/manifest.json (after editing one by hand)")
    parser.add_argument("--build", action="store_true", help="build llama.cpp first (else use its build/)")
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/gguf-fixtures-work"))
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "testdata" / "gguf" / "llamacpp")
    args = parser.parse_args()
    if args.manifest_only:
        update_manifest()
        return 0
    if args.llama_cpp is None or args.llama_commit is None:
        parser.error("--llama-cpp and --llama-commit are needed (but with --manifest-only)")
    tree = args.llama_cpp.resolve()
    if ROOT in tree.parents or tree == ROOT:
        raise SystemExit("--llama-cpp: keep the llama.cpp tree outside this repository")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.build:
        build(tree, args.work)
    dump_exe = compile_dump(tree, args.work)
    quantize = tree / "build" / "bin" / "llama-quantize"
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    record: dict = {
        "llama_cpp_commit": args.llama_commit,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "versions": {},
        "n_tokens": N_TOKENS,
        "models": {},
        "refused": {},
    }
    from importlib.metadata import version
    for pkg in ("torch", "transformers", "gguf", "numpy", "safetensors"):
        record["versions"][pkg] = version(pkg)

    for model in MODELS:
        golden = load_file(str(ROOT / "testdata" / "goldens" / f"{model}.safetensors"))
        tokens = [int(t) for t in golden["token_ids"].reshape(-1)[:N_TOKENS]]
        staged = stage(model, args.work)
        f32 = args.work / f"{model}.f32.gguf"
        conv = run([sys.executable, "-c", CONVERT_WRAPPER, str(tree), str(staged), "--outfile", str(f32),
                    "--outtype", "f32", "--no-mtp"])
        if conv.returncode != 0:
            record["refused"][model] = {"step": "convert", "message": conv.stderr.strip().splitlines()[-1]}
            continue
        # Does llama.cpp load and run its own conversion?
        probe = run([str(dump_exe), str(f32), str(args.work / "probe.bin"), *map(str, tokens)])
        if probe.returncode != 0:
            # The work directory's path is not recorded: the file's own name says which.
            stderr = probe.stderr.replace(f"{args.work}/", "")
            lines = [ln for ln in stderr.splitlines() if "error" in ln or "could not" in ln]
            record["refused"][model] = {"step": "load", "exit": probe.returncode,
                                        "message": " | ".join(lines[-3:]) or stderr[-500:]}
            continue
        entry = {"token_ids": tokens, "files": {}}
        files = {"f32": f32}
        for ty in TYPES_FOR.get(model, TYPES):
            q = args.work / f"{model}.{ty}.gguf"
            done = run([str(quantize), str(f32), str(q), ty.upper()])
            if done.returncode != 0:
                entry.setdefault("quantize_refused", {})[ty] = done.stderr.strip().splitlines()[-1:]
                continue
            files[ty] = q
        for ty, gguf_path in files.items():
            full = ty in FULL_DUMPS and model in FULL_DUMP_MODELS
            kept = ty != "f32" or model in F32_GGUF_KEPT
            dst = out / f"{model}.{ty}.gguf" if kept else gguf_path
            if kept:
                shutil.copyfile(gguf_path, dst)
            raw = args.work / f"{model}.{ty}.bin"
            ran = run([str(dump_exe), str(gguf_path), str(raw), *map(str, tokens)])
            info = {"gguf": {"bytes": dst.stat().st_size, "sha256": sha256(dst), "tensor_types": gguf_types(dst),
                             "tensor_types_by_name": gguf_types_by_tensor(dst), "committed": kept}}
            if ran.returncode != 0:
                info["dump_failed"] = {"exit": ran.returncode, "stderr": ran.stderr.replace(f"{args.work}/", "")[-800:]}
                entry["files"][ty] = info
                continue
            tensors, seen = {}, Counter()
            for kind, name, _, shape, data in read_dump(raw):
                if kind == 1:
                    tensors["logits"] = data
                    continue
                if not (keep_full(name) if full else keep_subset(name)):
                    continue
                key = name if seen[name] == 0 else f"{name}#{seen[name]}"
                seen[name] += 1
                tensors[key] = data
            dump = out / f"{model}.{ty}.dump.safetensors"
            save_sorted(tensors, str(dump), metadata={
                "llama_cpp_commit": args.llama_commit, "model": model, "type": ty,
                "token_ids": json.dumps(tokens), "tensors": "all named" if full else "layer outputs",
            })
            dump.chmod(0o644)
            info["dump"] = {"bytes": dump.stat().st_size, "sha256": sha256(dump), "tensors": len(tensors),
                            "all_named": full}
            entry["files"][ty] = info
        record["models"][model] = entry
    (out / "fixtures.json").write_text(json.dumps(record, indent=2) + "\n")
    total = sum(p.stat().st_size for p in out.iterdir())
    print(json.dumps(record["refused"], indent=2))
    print(f"{out}: {total / 1e6:.2f} MB")
    if out.resolve() == (ROOT / "testdata" / "gguf" / "llamacpp").resolve():
        update_manifest()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
