#!/usr/bin/env python3
"""NNCF's own integer codes and f16 scales for a set of weights, so that reference/src/quant.rs is checked against
NNCF instead of against itself.

Run with the interpreter of a venv made from scripts/requirements-nncf.txt (nncf and openvino, no torch), after
scripts/make_testdata.py (it reads testdata/models/tiny-full):

    scripts/.venv-nncf/bin/python scripts/make_nncf_goldens.py

It builds a small OpenVINO model with the opset API, one MatMul per weight (constant f32 weight [out, in],
transpose_b=True, PyTorch's Linear layout), a batched MatMul on one stacked constant [E, out, in] (transpose_b=True,
as optimum-intel exports an MoE layer's experts), a Gather embedding and a last MatMul that depends on every other
output (so that NNCF sees it as the last layer, the LM head), and compresses it twice:

- `int4_sym.*`: the call optimum-intel makes for `--weight-format int4 --sym --group-size 128 --ratio 1.0
  --backup-precision int8_sym` (nothing else set): INT4 symmetric, group 128, for the MatMuls; INT8 symmetric per
  output row (the backup) for the embedding and the last MatMul.
- `int8_sym.*`: `mode=INT8_SYM`, per output row for every weight (optimum's `--weight-format int8 --sym`).

Each compression runs twice, once as NNCF chooses (its OpenVINO-graph implementation for weights of 10 000
elements or more, numpy below that) and once with NNCF_DISABLE_OPTIMIZED_COMPRESSION set (numpy for all); the script
fails unless both give identical constants, and unless the first run used the OpenVINO implementation for exactly
the weights of 10 000 elements or more and the second for none (recorded by wrapping NNCF's entry point to it). The
codes and scales are read back from the compressed model's constants (int4 nibbles unpacked here) and saved to
testdata/goldens/nncf.safetensors: per case `{case}.weight` f32 [rows, cols] (the input), `{case}.codes` i8
[rows, cols], `{case}.scales` f16 [rows, cols / group] or [rows, 1], each with a leading [experts] for the stacked
experts (whose case has `experts`). The metadata lists every case (kind, group, shape, source, which NNCF
implementation made it), the versions and the exact calls. The manifest gets the file's entry and an `nncf_goldens`
section.

Weights: real bf16 projections of tiny-full (upcast to f32, exact) and seeded synthetic matrices whose rows are of
different kinds (see ROW_KINDS). Deterministic: fixed seed, safetensors header with sorted metadata.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import sys

import numpy as np
import openvino as ov
import openvino.opset15 as ops
from safetensors.numpy import load_file, save_file
from testdata_files import REPO, TESTDATA, add_golden, canonicalize_safetensors_header, sha256

import nncf
import nncf.openvino.optimized_functions as nncf_ov_functions
from nncf.quantization.algorithms.weight_compression.constants import MIN_INPUT_SIZE_FOR_OPTIMIZED_COMPRESSION

OUT = TESTDATA / "goldens" / "nncf.safetensors"
CHECKPOINT = TESTDATA / "models" / "tiny-full"
PREFIX = "model.language_model."
SEED = 5000
GROUP = 128
EXPERTS = (4, 10, 256)  # [E, out, in]: 10 240 elements, above NNCF's threshold; two groups of 128 per row
MAX_BYTES = 600_000

# The calls, as text for the metadata and as keyword arguments. optimum-intel's OVWeightQuantizationConfig.to_nncf_dict
# passes these for `--weight-format int4 --sym --group-size 128 --ratio 1.0 --backup-precision int8_sym` (awq,
# scale_estimation, gptq, lora_correction, sensitivity_metric and all_layers are None; no dataset; no advanced
# parameters, so group_size_fallback_mode keeps NNCF's default).
INT4_CALL = (
    "nncf.compress_weights(model, mode=CompressWeightsMode.INT4_SYM, ratio=1.0, group_size=128, ignored_scope=None, "
    "all_layers=None, sensitivity_metric=None, subset_size=128, awq=None, scale_estimation=None, gptq=None, "
    "lora_correction=None, backup_mode=BackupMode.INT8_SYM, dataset=None)"
)
INT8_CALL = "nncf.compress_weights(model, mode=CompressWeightsMode.INT8_SYM, dataset=None)"


def int4_kwargs() -> dict:
    return dict(
        mode=nncf.CompressWeightsMode.INT4_SYM, ratio=1.0, group_size=GROUP, ignored_scope=None, all_layers=None,
        sensitivity_metric=None, subset_size=128, awq=None, scale_estimation=None, gptq=None, lora_correction=None,
        backup_mode=nncf.BackupMode.INT8_SYM, dataset=None,
    )


def int8_kwargs() -> dict:
    return dict(mode=nncf.CompressWeightsMode.INT8_SYM, dataset=None)


# ------------------------------------------------------------------------------------------------------------------
# Weights
# ------------------------------------------------------------------------------------------------------------------


def read_bf16(names: list[str]) -> dict[str, np.ndarray]:
    """The named bf16 tensors of the sharded checkpoint as f32 (exact: a bf16 is the top half of an f32). numpy has
    no bfloat16, so the safetensors header and data are read directly."""
    index = json.loads((CHECKPOINT / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name in names:
        raw = (CHECKPOINT / index[name]).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        info = json.loads(raw[8 : 8 + n])[name]
        assert info["dtype"] == "BF16", (name, info["dtype"])
        start, end = info["data_offsets"]
        half = np.frombuffer(raw[8 + n + start : 8 + n + end], dtype="<u2")
        out[name] = (half.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])
    return out


def exact_halfway_f16(rng: np.random.Generator) -> float:
    """A positive f32 exactly halfway between two neighbouring normal f16 values (rounding it to f16 is a tie)."""
    mantissa = int(rng.integers(0, 1024))
    exponent = int(rng.integers(-12, 6))
    return (1.0 + (2 * mantissa + 1) / 2048.0) * 2.0**exponent


def nice_step(rng: np.random.Generator) -> float:
    """A step with a 4-bit significand, so that every (k + 1/2) · step below is exact in f32."""
    return (1.0 + int(rng.integers(0, 8)) / 8.0) * 2.0 ** int(rng.integers(-8, 4))


def extreme_group(rng, n: int, extreme: float, limit: float) -> np.ndarray:
    """n values strictly inside (-limit, limit) and `extreme` at a random position."""
    g = np.clip(rng.normal(size=n) * limit / 2.5, -0.97 * limit, 0.97 * limit)
    g[rng.integers(0, n)] = extreme
    return g


def row_of_kind(kind: str, rng: np.random.Generator, cols: int) -> np.ndarray:
    groups = cols // GROUP
    if kind == "normal":  # ordinary normals, magnitude 1e-4 .. 1e3, varying by up to 4x between groups
        magnitude = 10.0 ** rng.uniform(-4.0, 3.0)
        factors = np.repeat(2.0 ** rng.uniform(-1.0, 1.0, size=groups), GROUP)
        return rng.normal(size=cols) * magnitude * factors
    if kind == "zero":
        return np.zeros(cols)
    if kind == "negative_zero":  # -0.0 and +0.0 mixed
        return np.where(rng.random(cols) < 0.5, -0.0, 0.0)
    if kind == "below_floor":  # every int4 and int8 scale below 2^-23 (NNCF's floor)
        return rng.normal(size=cols) * 1e-7
    if kind == "below_floor_int8":  # int4 scales above the floor, the int8 scale below
        return rng.normal(size=cols) * 2e-6
    if kind == "floor_edge":  # per group, the largest magnitude at 8·eps·(1 - 2^-20, 1, 1 + 2^-20)
        eps = float(np.finfo(np.float32).eps)
        parts = []
        for f in rng.choice([1 - 2.0**-20, 1.0, 1 + 2.0**-20], size=groups):
            sign = rng.choice([-1.0, 1.0])
            parts.append(extreme_group(rng, GROUP, sign * 8 * eps * f, 8 * eps * f))
        return np.concatenate(parts)
    if kind == "positive_extreme":  # the largest magnitude positive in every group: NNCF's scale is negative
        parts = []
        for _ in range(groups):
            m = 10.0 ** rng.uniform(-3.0, 2.0)
            parts.append(extreme_group(rng, GROUP, 1.5 * m, m))
        return np.concatenate(parts)
    if kind == "equal_extremes":  # min == -max in every group: the positive one clips to 7 (int4) / 127 (int8)
        parts = []
        for _ in range(groups):
            m = 10.0 ** rng.uniform(-3.0, 2.0)
            g = extreme_group(rng, GROUP, m, 0.8 * m)
            spot = (int(np.argmax(g)) + 1 + int(rng.integers(0, GROUP - 1))) % GROUP
            g[spot] = -m
            parts.append(g)
        return np.concatenate(parts)
    if kind == "constant_positive":
        return np.full(cols, 10.0 ** rng.uniform(-3.0, 2.0))
    if kind == "constant_negative":
        return np.full(cols, -(10.0 ** rng.uniform(-3.0, 2.0)))
    if kind in ("ties_int4", "ties_int4_negative_scale"):
        # Per group: the extreme at -8·step (or +8·step, negative scale), so the int4 scale is ±step exactly, and
        # the other values at (k + 1/2)·step (x / scale is exactly a rounding tie) or k·step.
        sign = -1.0 if kind == "ties_int4" else 1.0
        parts = []
        for _ in range(groups):
            step = nice_step(rng)
            k = rng.integers(-8, 8, size=GROUP).astype(np.float64)
            g = (k + np.where(rng.random(GROUP) < 0.8, 0.5, 0.0)) * step
            g[rng.integers(0, GROUP)] = sign * 8 * step
            parts.append(g)
        return np.concatenate(parts)
    if kind == "ties_int8":  # the same for the row-wide int8 scale: extreme -128·step
        step = nice_step(rng)
        k = rng.integers(-128, 127, size=cols).astype(np.float64)
        row = (k + np.where(rng.random(cols) < 0.8, 0.5, 0.0)) * step
        row[rng.integers(0, cols)] = -128 * step
        return row
    if kind == "f16_halfway_int4":  # each int4 scale exactly halfway between two f16 values, either sign
        parts = []
        for _ in range(groups):
            s = exact_halfway_f16(rng)
            parts.append(extreme_group(rng, GROUP, rng.choice([-8.0, 8.0]) * s, 8 * s))
        return np.concatenate(parts)
    if kind == "f16_halfway_int8":  # the int8 scale exactly halfway between two f16 values
        s = exact_halfway_f16(rng)
        return extreme_group(rng, cols, rng.choice([-128.0, 128.0]) * s, 128 * s)
    if kind == "f16_subnormal":  # scales in f16's subnormal range (below 6.1e-5)
        return rng.normal(size=cols) * 10.0 ** rng.uniform(-6.0, -4.0)
    raise ValueError(kind)


ROW_KINDS = (
    "normal", "zero", "below_floor", "positive_extreme", "equal_extremes", "ties_int4", "ties_int8",
    "f16_halfway_int4", "normal", "below_floor_int8", "floor_edge", "ties_int4_negative_scale", "f16_halfway_int8",
    "f16_subnormal", "constant_positive", "constant_negative", "negative_zero", "normal",
)


def synthetic(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, list[str]]:
    kinds = [ROW_KINDS[r % len(ROW_KINDS)] for r in range(rows)]
    w = np.stack([row_of_kind(k, rng, cols) for k in kinds]).astype(np.float32)
    assert np.all(np.isfinite(w))
    return w, kinds


# ------------------------------------------------------------------------------------------------------------------
# Model, compression, extraction
# ------------------------------------------------------------------------------------------------------------------


def build_model(matmuls: dict[str, np.ndarray], embedding: tuple[str, np.ndarray] | None,
                last: tuple[str, np.ndarray] | None) -> ov.Model:
    """One Parameter and MatMul (transpose_b) per weight; optionally a Gather embedding and a last MatMul whose input
    depends on every other output. The constants are named after the cases."""
    params, results, sums = [], [], []
    for name, w in matmuls.items():
        # [1, in] for a matrix; [E, 1, in] for stacked experts [E, out, in], a batched MatMul (one token per expert).
        x = ops.parameter([*w.shape[:-2], 1, w.shape[-1]], ov.Type.f32, name=f"x:{name}")
        y = ops.matmul(x, ops.constant(w, ov.Type.f32, name=name), False, True)
        params.append(x)
        results.append(y)
        sums.append(ops.reduce_sum(y, list(range(w.ndim)), False))
    if embedding is not None:
        name, w = embedding
        ids = ops.parameter([1, 4], ov.Type.i32, name="ids")
        e = ops.gather(ops.constant(w, ov.Type.f32, name=name), ids, 0)
        params.append(ids)
        results.append(e)
        sums.append(ops.reduce_sum(e, [0, 1, 2], False))
    if last is not None:
        name, w = last
        x = ops.parameter([1, w.shape[1]], ov.Type.f32, name=f"x:{name}")
        h = x
        for s in sums:
            h = ops.add(h, s)
        params.append(x)
        results.append(ops.matmul(h, ops.constant(w, ov.Type.f32, name=name), False, True))
    return ov.Model(results, params, "nncf_goldens")


def unpack_i4(packed: np.ndarray, count: int) -> np.ndarray:
    """OpenVINO i4 constants: two per byte, element 2k in the low nibble, two's complement."""
    b = packed.view(np.uint8)
    nibbles = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(-1)[:count].astype(np.int8)
    return np.where(nibbles >= 8, nibbles - 16, nibbles).astype(np.int8)


def extract(model: ov.Model, names: list[str]) -> dict[str, dict]:
    consts = {op.get_friendly_name(): op for op in model.get_ordered_ops() if op.get_type_name() == "Constant"}
    out = {}
    for name in names:
        assert f"{name}/zero_point" not in consts, f"{name}: symmetric modes must have no zero point"
        codes_op, scale_op = consts[name], consts[f"{name}/scale"]
        etype = codes_op.get_element_type()
        shape = tuple(codes_op.get_output_shape(0))
        count = int(np.prod(shape))
        if etype == ov.Type.i4:
            codes = unpack_i4(codes_op.get_data(), count).reshape(shape)
            kind = "int4_sym"
        elif etype == ov.Type.i8:
            codes = codes_op.get_data().astype(np.int8).reshape(shape)
            kind = "int8_sym"
        else:
            raise AssertionError(f"{name}: unexpected compressed type {etype}")
        assert scale_op.get_element_type() == ov.Type.f16, (name, scale_op.get_element_type())
        scales = scale_op.get_data().astype(np.float16)
        # `lead` is (rows,) for a matrix, (experts, rows) for stacked experts.
        if kind == "int4_sym":  # [*lead, groups, group] and [*lead, groups, 1]
            *lead, groups, group = shape
            assert tuple(scale_op.get_output_shape(0)) == (*lead, groups, 1), (name, scale_op.get_output_shape(0))
            codes = codes.reshape(*lead, groups * group)
            scales = scales.reshape(*lead, groups)
        else:  # [*lead, cols] and [*lead, 1]
            *lead, cols = shape
            assert tuple(scale_op.get_output_shape(0)) == (*lead, 1), (name, scale_op.get_output_shape(0))
            group = cols
            scales = scales.reshape(*lead, 1)
        out[name] = {"kind": kind, "group": group, "codes": np.ascontiguousarray(codes),
                     "scales": np.ascontiguousarray(scales), "stored_shape": shape}
    return out


@contextlib.contextmanager
def openvino_implementation_calls():
    """The shapes of the weights that NNCF's OpenVINO-graph implementation quantises meanwhile (nncf 3.4.0's
    weight_lowering imports `do_integer_quantization` from nncf.openvino.optimized_functions at each call, so it
    meets the wrapper). A grouped weight arrives as NNCF stores its codes, [*lead, groups, group]."""
    original = nncf_ov_functions.do_integer_quantization
    shapes = []

    def recorded(weight, *args, **kwargs):
        shapes.append(tuple(weight.shape))
        return original(weight, *args, **kwargs)

    nncf_ov_functions.do_integer_quantization = recorded
    try:
        yield shapes
    finally:
        nncf_ov_functions.do_integer_quantization = original


def compress(build, kwargs: dict, names: list[str]) -> dict[str, dict]:
    """Compress a fresh model as NNCF chooses and again with its optimised (OpenVINO-graph) implementation
    disabled; the two must agree exactly. The first run must have used the OpenVINO implementation for exactly the
    weights of MIN_INPUT_SIZE_FOR_OPTIMIZED_COMPRESSION elements or more, the second for none."""
    key = "NNCF_DISABLE_OPTIMIZED_COMPRESSION"
    assert key not in os.environ, f"unset {key}: the goldens must come from NNCF's default path"
    with openvino_implementation_calls() as chosen_calls:
        chosen = extract(nncf.compress_weights(build(), **kwargs), names)
    os.environ[key] = "1"
    try:
        with openvino_implementation_calls() as reference_calls:
            reference = extract(nncf.compress_weights(build(), **kwargs), names)
    finally:
        del os.environ[key]
    large = sorted(chosen[n]["stored_shape"] for n in names
                   if np.prod(chosen[n]["stored_shape"]) >= MIN_INPUT_SIZE_FOR_OPTIMIZED_COMPRESSION)
    assert sorted(chosen_calls) == large, (chosen_calls, large)
    assert reference_calls == [], reference_calls
    for name in names:
        a, b = chosen[name], reference[name]
        for part in ("codes", "scales"):
            same = a[part].shape == b[part].shape and a[part].tobytes() == b[part].tobytes()
            assert same, f"{name}: NNCF's OpenVINO and numpy implementations give different {part}"
    return chosen


# ------------------------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------------------------


def main() -> None:
    rng = np.random.default_rng(SEED)
    real_names = {
        "layers.0.mlp.down_proj": [64, 128],
        "layers.0.linear_attn.out_proj": [64, 128],
        "layers.3.self_attn.o_proj": [64, 128],
        "layers.0.linear_attn.in_proj_qkv": [192, 64],
        "embed_tokens": [512, 64],
    }
    real = read_bf16([f"{PREFIX}{n}.weight" for n in real_names] + ["lm_head.weight"])
    real = {k.removeprefix(PREFIX).removesuffix(".weight"): v for k, v in real.items()}
    for n, shape in real_names.items():
        assert list(real[n].shape) == shape, (n, real[n].shape)

    # Synthetic: one below NNCF's size threshold for its OpenVINO implementation, one above it.
    small, small_kinds = synthetic(rng, 16, 256)
    large, large_kinds = synthetic(rng, 20, 512)
    assert small.size < MIN_INPUT_SIZE_FOR_OPTIMIZED_COMPRESSION <= large.size
    # Stacked MoE experts [E, out, in] as optimum-intel exports them (drawn after the matrices, which thus stay as
    # they were): the row kinds run on across the experts, so every expert holds several of them.
    experts_flat, experts_kinds = synthetic(rng, EXPERTS[0] * EXPERTS[1], EXPERTS[2])
    experts = experts_flat.reshape(EXPERTS)
    assert experts.size >= MIN_INPUT_SIZE_FOR_OPTIMIZED_COMPRESSION
    experts_source = (f"synthetic, seed {SEED}, stacked experts {list(EXPERTS)}, row kinds (expert by expert) "
                      f"{experts_kinds}")

    cases = []  # (case, weight, source)
    int4_matmuls = {
        "int4_sym.synthetic.small": (small, f"synthetic, seed {SEED}, row kinds {small_kinds}"),
        "int4_sym.synthetic.large": (large, f"synthetic, seed {SEED}, row kinds {large_kinds}"),
        "int4_sym.synthetic.experts": (experts, experts_source),
    }
    for n in ("layers.0.mlp.down_proj", "layers.0.linear_attn.out_proj", "layers.3.self_attn.o_proj"):
        int4_matmuls[f"int4_sym.tiny-full.{n}"] = (real[n], f"tiny-full {PREFIX}{n}.weight (bf16)")
    # Sliced (the quantisation is per row, so a row slice is quantised as in the whole matrix) to keep the file small:
    # the embedding above NNCF's threshold (OpenVINO implementation), the LM head below it (numpy).
    embedding = ("int4_sym.tiny-full.embed_tokens", real["embed_tokens"][:160],
                 f"tiny-full {PREFIX}embed_tokens.weight rows 0..160 (bf16), a Gather: backup precision")
    last = ("int4_sym.tiny-full.lm_head", real["lm_head"][:144],
            "tiny-full lm_head.weight rows 0..144 (bf16), the last MatMul: backup precision")
    int8_matmuls = {
        "int8_sym.synthetic.small": (small, int4_matmuls["int4_sym.synthetic.small"][1]),
        "int8_sym.synthetic.large": (large, int4_matmuls["int4_sym.synthetic.large"][1]),
        "int8_sym.synthetic.experts": (experts, experts_source),
        "int8_sym.tiny-full.layers.0.linear_attn.in_proj_qkv": (
            real["layers.0.linear_attn.in_proj_qkv"][:160],
            f"tiny-full {PREFIX}layers.0.linear_attn.in_proj_qkv.weight rows 0..160 (bf16)"),
    }

    def build_int4():
        return build_model({k: v[0] for k, v in int4_matmuls.items()}, embedding[:2], last[:2])

    def build_int8():
        return build_model({k: v[0] for k, v in int8_matmuls.items()}, None, None)

    int4_names = list(int4_matmuls) + [embedding[0], last[0]]
    got = compress(build_int4, int4_kwargs(), int4_names)
    got.update(compress(build_int8, int8_kwargs(), list(int8_matmuls)))
    weights = {k: v for k, v in int4_matmuls.items()} | {k: v for k, v in int8_matmuls.items()}
    weights[embedding[0]] = (embedding[1], embedding[2])
    weights[last[0]] = (last[1], last[2])

    expected_kind = {n: ("int8_sym" if n.startswith("int8_sym.") or n in (embedding[0], last[0]) else "int4_sym")
                     for n in weights}
    tensors = {}
    for case in sorted(weights):
        w, source = weights[case]
        g = got[case]
        assert g["kind"] == expected_kind[case], (case, g["kind"])
        assert g["codes"].shape == w.shape, (case, g["codes"].shape, w.shape)
        role = ("embedding (Gather), backup precision" if case == embedding[0] else
                "last MatMul, backup precision" if case == last[0] else
                "batched MatMul on stacked experts, primary precision" if w.ndim == 3 else
                "MatMul, primary precision")
        entry = {
            "case": case, "kind": g["kind"], "group": g["group"] if g["kind"] == "int4_sym" else -1,
            "rows": int(w.shape[-2]), "cols": int(w.shape[-1]), "role": role, "source": source,
            "nncf_implementation": ("openvino" if w.size >= MIN_INPUT_SIZE_FOR_OPTIMIZED_COMPRESSION else "numpy"),
        }
        if w.ndim == 3:  # [experts, rows, cols]; the matrices' entries stay as they were
            entry["experts"] = int(w.shape[0])
        cases.append(entry)
        tensors[f"{case}.weight"] = np.ascontiguousarray(w, dtype=np.float32)
        tensors[f"{case}.codes"] = g["codes"]
        tensors[f"{case}.scales"] = g["scales"]

    versions = {
        "python": platform.python_version(),
        "nncf": nncf.__version__,
        "openvino": importlib.metadata.version("openvino"),
        "openvino_build": ov.get_version(),
        "numpy": np.__version__,
        "safetensors": importlib.metadata.version("safetensors"),
    }
    metadata = {
        "producer": "scripts/make_nncf_goldens.py",
        "seed": str(SEED),
        "cases": json.dumps(cases),
        "versions": json.dumps(versions, sort_keys=True),
        "int4_call": INT4_CALL,
        "int8_call": INT8_CALL,
        "optimum_flags": "--weight-format int4 --sym --group-size 128 --ratio 1.0 --backup-precision int8_sym",
        "case_names": ("int4_sym.* come from int4_call (the embedding and the last MatMul among them get the int8_sym "
                       "backup), int8_sym.* from int8_call; `kind` says what NNCF stored"),
        "codes": ("i8 [rows, cols], or [experts, rows, cols] for a case with `experts`; int4 nibbles unpacked (two's "
                  "complement, element 2k in the low nibble)"),
        "scales": ("f16 [rows, cols / group] (int4_sym) or [rows, 1] (int8_sym), with a leading [experts] for a case "
                   "with `experts`, as stored in the IR (without its last axis of 1 for int4)"),
        "experts": (f"cases with `experts` are one stacked constant {list(EXPERTS)} = [experts, out, in] read by a "
                    "batched MatMul with transpose_b, as optimum-intel exports an MoE layer's experts; NNCF reduces "
                    "over the last axis, per expert and row"),
        "nncf_implementations": (
            f"NNCF quantises weights of {MIN_INPUT_SIZE_FOR_OPTIMIZED_COMPRESSION} elements or more with an OpenVINO "
            "graph, smaller ones with numpy; each compression was repeated with NNCF_DISABLE_OPTIMIZED_COMPRESSION=1 "
            "(numpy for all) and gave identical codes and scales; which weights the OpenVINO implementation took was "
            "recorded and checked"),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata=metadata)
    canonicalize_safetensors_header(OUT)
    back = load_file(str(OUT))
    assert back.keys() == tensors.keys() and all(np.array_equal(back[k], tensors[k]) for k in tensors)
    size = OUT.stat().st_size
    assert size < MAX_BYTES, f"{OUT} is {size} bytes"

    add_golden(OUT, "nncf_goldens", {
        "generator": "scripts/make_nncf_goldens.py",
        "requirements": "scripts/requirements-nncf.txt",
        "versions": versions,
        "seed": SEED,
        "int4_call": INT4_CALL,
        "int8_call": INT8_CALL,
        "optimum_flags": metadata["optimum_flags"],
        "case_names": metadata["case_names"],
        "cases": {c["case"]: {k: v for k, v in c.items() if k not in ("case", "source")} for c in cases},
        "paths_agree": ("NNCF's OpenVINO-graph and numpy implementations gave identical codes and scales, the stacked "
                        "experts included"),
        "experts": metadata["experts"],
    })
    counts = {k: sum(c["kind"] == k for c in cases) for k in ("int4_sym", "int8_sym")}
    print(f"wrote {OUT.relative_to(REPO)} ({size} bytes, sha256 {sha256(OUT)}): {len(cases)} cases {counts}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
