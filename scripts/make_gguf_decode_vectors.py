#!/usr/bin/env python3
"""Reference vectors for the decoders of every ggml tensor type (`reference/src/gguf/decode.rs`).

For each type: a few random-but-valid blocks (finite f16 scales, with edge values: +-0, the smallest and largest
subnormal, +-65504, negative scales; one block of all-zero code bytes, one of all-ones; every other code byte
random, so every sign pattern and grid index is drawn) and their values as ggml itself decodes them, written to
`testdata/gguf/decode/<type>.safetensors`:

- `blocks` u8 [n_blocks, block_bytes], `values` f32 [n_blocks * block_elems];
- metadata: `type` (ggml's name), `type_id`, `block_elems`, `block_bytes`, `decoder` (which decoder made `values`),
  `gguf_py` (whether the `gguf` package's numpy decoder gives the same bits: `equal`, `absent`, or where it differs),
  the versions.

Two references, compared value by value (f32 bits):

1. ggml's own C decoder, called through ctypes in a built `libggml-base.so` (`--ggml-lib`): the type traits'
   `to_float` (`ggml_get_type_traits`), and `dequantize_row_q8_K` for Q8_K (ggml's traits leave its `to_float` empty).
   This is what `values` holds, where ggml has a decoder.
2. The `gguf` Python package's numpy decoders (`gguf.quants.dequantize`), where it has one.

F32 is ggml's own layout (ggml copies it; `decoder: copy`). Q8_1 has no decoder in ggml nor in `gguf` (an activation type llama.cpp never writes to a file): its `values` are
`d * q` by the block's layout (`decoder: layout`), as the inverse of ggml's `quantize_row_q8_1_ref`. F64 and the
integer types are not weights' types and get no vectors.

Q2_0 (id 42) is newer than `gguf` 0.19.0, which does not name it: its id is written here. The block sizes are
ggml's own (its type traits); the `gguf` package's table is checked against them and any difference printed.

Usage (a built llama.cpp, see scripts/make_gguf_fixtures.sh; `pip install gguf==0.19.0 numpy safetensors`):

    python scripts/make_gguf_decode_vectors.py \
        --ggml-lib /tmp/llama.cpp/build/bin/libggml-base.so --llama-commit <sha>

Deterministic (fixed seed); the script stops on any disagreement it cannot record.
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import sys

import numpy as np

from gguf_fixture_io import save_sorted

import gguf
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

OUT = pathlib.Path(__file__).resolve().parent.parent / "testdata" / "gguf" / "decode"
SEED = 33

# Byte offsets of the f16 scale fields of one block (ggml-common.h), per type.
F16_FIELDS = {
    "Q1_0": [0], "Q2_0": [0],
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q8_1": [0, 2],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0],
    "IQ4_NL": [0], "IQ4_XS": [0], "TQ1_0": [52], "TQ2_0": [64],
    "IQ1_M": [], "Q8_K": [], "MXFP4": [], "NVFP4": [],
}

# Edge values of the first scale of the even blocks, as f16 bit patterns: +0, -0, smallest subnormal, largest
# subnormal, 65504, -65504, -1, smallest normal.
EDGE_F16 = [0x0000, 0x8000, 0x0001, 0x03FF, 0x7BFF, 0xFBFF, 0xBC00, 0x0400]

# Element types: the count of values drawn, and special patterns put first.
ELEMENT_SPECIALS = {
    "F32": [0x00000000, 0x80000000, 0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000,
            0xFF800000, 0x3F800000],
    "F16": [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x3C00, 0x7E00, 0x7C01,
            0xFE01, 0x7FFF],
    "BF16": [0x0000, 0x8000, 0x0001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x3F80, 0x7FC0, 0x7F81,
             0xFF81, 0x7FFF],
}
ELEMENT_COUNT = 1024


def random_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 bit patterns: random sign, exponent field 0..30 (subnormals included), random mantissa."""
    sign = rng.integers(0, 2, n, dtype=np.uint16) << 15
    exp = rng.integers(0, 31, n, dtype=np.uint16) << 10
    man = rng.integers(0, 1024, n, dtype=np.uint16)
    return sign | exp | man


# Types newer than the `gguf` package: their ids (the sizes come from ggml, below).
NEWER = {"Q2_0": 42}

# The block sizes ggml's own type traits give (`blck_size`, `type_size`), filled in by main() from the library; the
# `gguf` package's GGML_QUANT_SIZES is checked against them (0.19.0 has Q8_1 as 40 bytes, ggml's block_q8_1 is 36).
GGML_SIZES: dict[int, tuple[int, int]] = {}
SIZE_FINDINGS: list[str] = []


def type_info(name: str) -> tuple[int, int, int]:
    type_id = NEWER[name] if name in NEWER else int(T[name])
    block_elems, block_bytes = GGML_SIZES[type_id]
    return type_id, block_elems, block_bytes


def make_blocks(name: str, rng: np.random.Generator) -> np.ndarray:
    _, block_elems, block_bytes = type_info(name)
    n_blocks = max(8, 1024 // block_elems)
    blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    fields = F16_FIELDS[name]
    # All-zero and all-ones code bytes in blocks 0 and 1 (the scales are set below).
    blocks[0, :] = 0x00
    blocks[1, :] = 0xFF
    for b in range(n_blocks):
        scales = random_f16(rng, len(fields))
        if b % 2 == 0 and fields:
            scales[0] = EDGE_F16[(b // 2) % len(EDGE_F16)]
        for off, bits in zip(fields, scales):
            blocks[b, off:off + 2] = np.array([bits], dtype="<u2").view(np.uint8)
    if name == "IQ1_M":
        # The f16 scale is the top nibbles of the four u16 scale words (bytes 48..56), low nibble first.
        for b in range(n_blocks):
            bits = int(random_f16(rng, 1)[0]) if b % 2 else EDGE_F16[(b // 2) % len(EDGE_F16)]
            words = blocks[b, 48:56].copy().view("<u2")
            for k in range(4):
                words[k] = (int(words[k]) & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
            blocks[b, 48:56] = words.view(np.uint8)
    if name == "Q8_K":
        # An f32 scale: finite, random sign and magnitude, with +-0 and a subnormal among them.
        d = (rng.standard_normal(n_blocks) * np.exp2(rng.integers(-20, 20, n_blocks))).astype(np.float32)
        d[0], d[2], d[4] = 0.0, -0.0, np.float32(1e-40)
        blocks[:, 0:4] = d.astype("<f4").view(np.uint8).reshape(n_blocks, 4)
    if name == "MXFP4":
        # E8M0 exponents: the two subnormal patterns, 2, 127, 254 and 255 among random ones.
        blocks[:6, 0] = [0, 1, 2, 127, 254, 255]
    if name == "NVFP4":
        # UE4M3 scales: 0, 0x7F (both zero), subnormals, the largest, and the sign bit set.
        blocks[0, 0:4] = [0x00, 0x7F, 0x01, 0x07]
        blocks[1, 0:4] = [0x08, 0x7E, 0x80, 0xFF]
    return blocks


def make_elements(name: str, rng: np.random.Generator) -> np.ndarray:
    specials = ELEMENT_SPECIALS[name]
    if name == "F32":
        bits = rng.integers(0, 2**32, ELEMENT_COUNT, dtype=np.uint64).astype("<u4")
    else:
        bits = rng.integers(0, 2**16, ELEMENT_COUNT, dtype=np.uint32).astype("<u2")
    bits[: len(specials)] = specials
    return bits.view(np.uint8).reshape(ELEMENT_COUNT, -1)


class Ggml:
    """ggml's decoders in a built libggml-base.so, through ctypes."""

    class Traits(ctypes.Structure):
        _fields_ = [
            ("type_name", ctypes.c_char_p),
            ("blck_size", ctypes.c_int64),
            ("blck_size_interleave", ctypes.c_int64),
            ("type_size", ctypes.c_size_t),
            ("is_quantized", ctypes.c_bool),
            ("to_float", ctypes.c_void_p),
            ("from_float_ref", ctypes.c_void_p),
        ]

    TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        self.lib.ggml_get_type_traits.restype = ctypes.POINTER(Ggml.Traits)
        self.lib.ggml_get_type_traits.argtypes = [ctypes.c_int]

    def sizes(self, type_id: int) -> tuple[int, int]:
        traits = self.lib.ggml_get_type_traits(type_id).contents
        return int(traits.blck_size), int(traits.type_size)

    def decode(self, type_id: int, blocks: np.ndarray, n: int) -> np.ndarray | None:
        traits = self.lib.ggml_get_type_traits(type_id).contents
        src = np.ascontiguousarray(blocks)
        out = np.zeros(n, dtype=np.float32)
        if traits.to_float:
            fn = Ggml.TO_FLOAT(traits.to_float)
        elif type_id == T.Q8_K:
            fn = self.lib.dequantize_row_q8_K
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
            fn.restype = None
        else:
            return None
        fn(src.ctypes.data, out.ctypes.data, n)
        return out


def gguf_py_decode(qtype: T, blocks: np.ndarray, n: int) -> np.ndarray | None:
    try:
        return gguf.quants.dequantize(blocks.reshape(-1).copy(), qtype).reshape(n).astype(np.float32, copy=False)
    except NotImplementedError:
        return None


def layout_q8_1(blocks: np.ndarray) -> np.ndarray:
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)
    q = blocks[:, 4:36].copy().view(np.int8).astype(np.float32)
    return (q * d).reshape(-1)


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    diff = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    return int(diff[0]) if diff.size else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ggml-lib", required=True, help="a built libggml-base.so (llama.cpp's build/bin)")
    parser.add_argument("--llama-commit", required=True, help="the llama.cpp commit the library was built from")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    ggml = Ggml(args.ggml_lib)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    names = ["F32", "F16", "BF16"] + [n for n in F16_FIELDS]
    for name in names:
        type_id = NEWER[name] if name in NEWER else int(T[name])
        GGML_SIZES[type_id] = ggml.sizes(type_id)
        if name not in NEWER and tuple(GGML_QUANT_SIZES[T[name]]) != GGML_SIZES[type_id]:
            SIZE_FINDINGS.append(f"{name}: gguf's GGML_QUANT_SIZES {tuple(GGML_QUANT_SIZES[T[name]])} but ggml's "
                                 f"(blck_size, type_size) {GGML_SIZES[type_id]}")
    report = []
    for name in names:
        type_id, block_elems, block_bytes = type_info(name)
        blocks = make_elements(name, rng) if name in ELEMENT_SPECIALS else make_blocks(name, rng)
        n = blocks.shape[0] * block_elems
        ref = ggml.decode(type_id, blocks, n)
        py = None if name in NEWER or any(f.startswith(name + ":") for f in SIZE_FINDINGS) else \
            gguf_py_decode(T[name], blocks, n)
        if ref is not None:
            decoder = "ggml"
            values = ref
        elif name == "F32":
            decoder = "copy"
            values = blocks.reshape(-1).copy().view("<f4").astype(np.float32)
        elif name == "Q8_1":
            decoder = "layout"
            values = layout_q8_1(blocks)
        else:
            raise SystemExit(f"{name}: ggml has no decoder and no layout rule is written here")
        if py is None:
            gguf_py = "absent"
        else:
            at = first_difference(values, py)
            gguf_py = "equal" if at is None else (
                f"differs from index {at}: ggml {values[at]!r} ({values.view(np.uint32)[at]:#010x}), "
                f"gguf {py[at]!r} ({py.view(np.uint32)[at]:#010x}); "
                f"{int(np.count_nonzero(values.view(np.uint32) != py.view(np.uint32)))} of {n} values differ")
        meta = {
            "type": name, "type_id": str(type_id), "block_elems": str(block_elems),
            "block_bytes": str(block_bytes), "decoder": decoder, "gguf_py": gguf_py, "seed": str(SEED),
            "llama_cpp_commit": args.llama_commit, "gguf_py_version": gguf_version(),
            "numpy_version": np.__version__,
        }
        save_sorted({"blocks": np.ascontiguousarray(blocks), "values": values}, str(out / f"{name}.safetensors"),
                  metadata=meta)
        report.append(f"{name:8} {blocks.shape[0]:4} blocks {n:6} values  decoder {decoder:6}  gguf-py {gguf_py}")
    print("\n".join(report + SIZE_FINDINGS))
    return 0


def gguf_version() -> str:
    from importlib.metadata import version
    return version("gguf")


if __name__ == "__main__":
    sys.exit(main())
