#!/usr/bin/env python3
"""Convert the tiny testdata models to f32 GGUF files with llama.cpp's own converter (testdata/gguf/models/).

    python scripts/make_gguf_models.py --llama-cpp LLAMA_CPP_SOURCE [--models tiny tiny-moe] [--out DIR]

LLAMA_CPP_SOURCE is a llama.cpp source tree (its `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/`; e.g. the
`vendor/llama.cpp` of the llama-cpp-python 0.3.36 sdist). The converter needs torch, numpy, safetensors,
sentencepiece and transformers in the running Python (`pip install torch --index-url <the CPU wheel index>`, then
`pip install numpy safetensors sentencepiece transformers`).

What the conversion needs besides the converter, done here without touching the repository:
- each model is copied to a temporary directory whose `tokenizer_config.json` names `Qwen2TokenizerFast`: the
  checkpoint's own `Qwen3_5Tokenizer` class is unknown to transformers 4.x, which the converter loads it through;
- the converter refuses a BPE tokenizer whose hash it does not know ("BPE pre-tokenizer was not recognized"): the
  testdata tokenizer is a small one with Qwen3.5's own split regex, so the pre-tokenizer is declared `qwen35` after
  checking that the tokenizer's regex is Qwen3.5's;
- `--no-mtp`: the tiny checkpoints have no MTP head.

The converter's version is written next to the files (`VERSION`).
"""

from __future__ import annotations

import argparse
import json
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The split regex of Qwen3.5's tokenizer (the one llama.cpp's `qwen35` pre-tokenizer applies).
QWEN35_SPLIT = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)


def check_pre_tokenizer(model: Path) -> None:
    tok = json.loads((model / "tokenizer.json").read_text())
    pre = tok.get("pre_tokenizer") or {}
    splits = [p for p in pre.get("pretokenizers", []) if p.get("type") == "Split"]
    regex = splits[0]["pattern"].get("Regex") if splits else None
    if regex != QWEN35_SPLIT:
        sys.exit(f"{model}/tokenizer.json: its split regex is not Qwen3.5's; not declaring it `qwen35`")


def convert(llama: Path, model: Path, out: Path) -> None:
    check_pre_tokenizer(model)
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / model.name
        shutil.copytree(model, staged)
        cfg = staged / "tokenizer_config.json"
        tc = json.loads(cfg.read_text())
        tc["tokenizer_class"] = "Qwen2TokenizerFast"
        cfg.write_text(json.dumps(tc))
        code = (
            "import sys, runpy\n"
            f"sys.path[:0] = [{str(llama / 'gguf-py')!r}, {str(llama)!r}]\n"
            "import conversion.base as base\n"
            "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen35'\n"
            f"sys.argv = [{str(llama / 'convert_hf_to_gguf.py')!r}, {str(staged)!r}, '--outtype', 'f32', '--no-mtp',"
            f" '--outfile', {str(out)!r}]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True)


def version(llama: Path) -> str:
    for line in (llama / "gguf-py" / "pyproject.toml").read_text().splitlines():
        if line.startswith("version"):
            return "gguf-py " + line.split("=", 1)[1].strip().strip('"')
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp source tree")
    ap.add_argument("--models", nargs="+", default=["tiny", "tiny-moe"])
    ap.add_argument("--label", default="llama.cpp of llama-cpp-python 0.3.36", help="where the source tree came from")
    ap.add_argument("--out", type=Path, default=ROOT / "testdata" / "gguf" / "models")
    args = ap.parse_args()
    if not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"--llama-cpp {args.llama_cpp}: no convert_hf_to_gguf.py there")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        convert(args.llama_cpp, ROOT / "testdata" / "models" / name, args.out / f"{name}-f32.gguf")
    (args.out / "VERSION").write_text(f"{args.label} ({version(args.llama_cpp)})\n")


if __name__ == "__main__":
    main()
