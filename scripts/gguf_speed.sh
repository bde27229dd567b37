#!/usr/bin/env bash
# Decode speed of a 9B-shaped GGUF converted to Q4_K_M by llama.cpp, against the time to read the file, and the
# reference on its matrices kept packed (docs/speed.md, "GGUF weights kept packed"). Not run by CI: it needs
# llama.cpp's converter and quantizer and about 45 GB of disk.
#
#   LLAMA=/path/to/llama.cpp PY=/path/to/venv/bin/python WORK=/tmp/gguf-speed scripts/gguf_speed.sh
#
# LLAMA: a llama.cpp tree (the one scripts/make_gguf_fixtures.py describes: llama-cpp-python 0.3.36's vendored
# llama.cpp 0c1e570) with `llama-quantize` built in build/bin (cmake -G Ninja -DCMAKE_BUILD_TYPE=Release
# -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF -DBUILD_SHARED_LIBS=ON; ninja -j2 llama-quantize). PY: a Python with torch,
# transformers 4.57.6, gguf, sentencepiece, safetensors, numpy (for the converter). LAYERS: decoder layers (32,
# the real 9B's).
#
# SYNTH=1: no llama.cpp, no model: examples/gguf_synth.rs writes one 9B-shaped MLP matrix of random blocks (valid
# scales, random codes) per type (F16, BF16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K) and gguf_speed --matrix runs on each: the
# decoders' throughput and one matrix's product packed vs expanded (about 400 MB of disk).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/tmp/gguf-speed}
mkdir -p "$WORK"
cd "$ROOT"
if [ "${SYNTH:-0}" = 1 ]; then
    cargo build --release -p reference --example gguf_speed --example gguf_synth
    target/release/examples/gguf_synth "$WORK/matrices"
    lscpu | grep -E 'Model name|^CPU\(s\)'
    uptime
    for f in "$WORK"/matrices/*.gguf; do
        target/release/examples/gguf_speed "$f" --matrix
    done
    exit 0
fi
LLAMA=${LLAMA:?a llama.cpp tree with build/bin/llama-quantize}
PY=${PY:-python3}
LAYERS=${LAYERS:-32}
cargo build --release -p parity -p reference --bins --example gguf_speed

# 1. A random checkpoint of the real 9B's shapes (bf16, the real layout), with the testdata tokenizer staged beside
#    it (the converter needs one; its vocabulary is padded to the config's 248320 rows).
if [ ! -d "$WORK/synth" ]; then
    target/release/qwen35 synth --out "$WORK/synth" --layers "$LAYERS" --arch qwen3.5-9b
fi
cp testdata/models/tiny/tokenizer.json "$WORK/synth/"
"$PY" - "$WORK/synth" <<'EOF'
import json, sys
c = json.load(open("testdata/models/tiny/tokenizer_config.json"))
c["tokenizer_class"] = "Qwen2TokenizerFast"  # the converter's transformers has no Qwen3_5Tokenizer
json.dump(c, open(sys.argv[1] + "/tokenizer_config.json", "w"), indent=2)
EOF

# 2. llama.cpp's converter (bf16, no MTP head) and quantizer (Q4_K_M), as scripts/make_gguf_fixtures.py runs them
#    (the same pre-tokenizer work-around).
if [ ! -f "$WORK/qwen35-9b-shape.bf16.gguf" ] && [ ! -f "$WORK/qwen35-9b-shape.Q4_K_M.gguf" ]; then
    "$PY" - "$LLAMA" "$WORK/synth" --outtype bf16 --no-mtp --outfile "$WORK/qwen35-9b-shape.bf16.gguf" <<'EOF'
import runpy, sys
tree = sys.argv[1]
sys.path.insert(0, tree)
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
sys.argv = [tree + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
EOF
fi
# (llama-quantize reads an output name starting with a digit as the type's number: keep names as they are here.)
if [ ! -f "$WORK/qwen35-9b-shape.Q4_K_M.gguf" ]; then
    "$LLAMA/build/bin/llama-quantize" "$WORK/qwen35-9b-shape.bf16.gguf" "$WORK/qwen35-9b-shape.Q4_K_M.gguf" Q4_K_M 2
fi
FILE="$WORK/qwen35-9b-shape.Q4_K_M.gguf"

# 3. The machine, then the time to read the file: cold when the page cache can be dropped, else said to be warm.
lscpu | grep -E 'Model name|^CPU\(s\)'
uptime
ls -l "$FILE"
sync
if (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null; then echo "page cache dropped: cold read"; else echo "page cache not droppable: warm read"; fi
/usr/bin/time -f "cat FILE > /dev/null: %e s wall, %U s user, %S s sys" cat "$FILE" > /dev/null

# 4. Decode throughput per type (1 and 2 threads), one Q4_K matrix packed vs expanded, and the reference on the
#    file with its matrices packed (a prompt of 64 tokens, decode steps, what it holds).
/usr/bin/time -f "gguf_speed: %e s wall, %M KB peak resident" \
    target/release/examples/gguf_speed "$FILE" --matrix --model
