#!/usr/bin/env python3
"""The optimum-intel exports of two tiny testdata models: the OpenVINO IR that people deploy Qwen3.5 with, made by the
exporter itself, so that `qwen35 compare-devices --ir` is tested on graphs this project did not write.

Run with the interpreter of a venv made from scripts/requirements-optimum.txt (optimum-intel, transformers 5.2, torch,
OpenVINO, NNCF), after scripts/make_testdata.py and scripts/make_moe_goldens.py (it reads testdata/models/tiny and
testdata/models/tiny-moe, and their goldens' prompts):

    scripts/.venv-optimum/bin/python scripts/make_optimum_export.py

It runs `optimum-cli export openvino` twice on each model, as a stateful text-generation model with its cache:

- `testdata/ir/tiny-f32/`, `testdata/ir/tiny-moe-f32/`: `--weight-format fp32` (every constant f32).
- `testdata/ir/tiny-int4/`: the port's INT4 flags (`--weight-format int4 --sym --ratio 1.0 --backup-precision
  int8_sym`) with `--group-size 32 --group-size-fallback ignore`. The port's group of 128 does not divide tiny's
  widths (64 and 96): with the default fallback NNCF refuses the export (InvalidGroupSizeError); 32 divides every
  projection's input width. `ignore` matters for one MatMul only, RoPE's `inv_freq` product (its "input width" is
  1): it stays float. With `--group-size-fallback adjust` NNCF would store `inv_freq` as INT8 instead.
- `testdata/ir/tiny-moe-int4/`: the same flags with `--group-size 8`, the largest group that divides every input
  width of tiny-moe (hidden 32, the attention output 64, the expert width 16, the shared expert width 24).
  optimum-intel's Qwen3_5MoeModelPatcher traces the MoE block as every expert on every token: the experts' gate and
  up projections are two constants `[E, I, H]` (the halves of `gate_up_proj`, folded from a VariadicSplit) and
  `down_proj` one `[E, H, I]`, each the weight of a batched MatMul (transpose_b), which NNCF compresses along the
  last axis per expert and row; the script records what it did to each tensor (`holds.compression_rule`) and
  stops unless the MoE tensors are all INT4 in groups along that axis.

Each directory gets `openvino_model.xml` and `.bin` (the tokenizer IRs the exporter also writes are not kept) and a
`manifest.json` that `qwen35` reads (`npu::external`): the files, the reference weight format that holds the same
weights, the interface (every input and output by role, name, element type and shape, and what it means), the
exact command and versions, and what the export holds (ops, state variables, every compressed weight, the
compression each weight tensor got). The script then checks each IR on OpenVINO's CPU device (f32 inference, f32 KV
cache) against transformers (f32, eager attention and experts) on the golden prompt of the model's
testdata/goldens/{model}.safetensors, greedy for NUM_GENERATED tokens, and stops unless each f32 export matches
within F32_MAX_NMSE with the same tokens. The figures go to the manifests. The manifest of testdata/ gets the files
and an `optimum_exports` section.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from testdata_files import sha256

REPO = Path(__file__).resolve().parent.parent
TESTDATA = REPO / "testdata"
OUT = TESTDATA / "ir"

NUM_GENERATED = 8
F32_MAX_NMSE = 1e-8  # the f32 exports against transformers, prompt and decode logits
MAX_IR_BYTES = 5_000_000  # the four exports together

# The models exported: their checkpoint and the golden whose prompt the check runs. `moe`: a sparse MoE decoder,
# whose transformers run uses the eager experts (as scripts/make_moe_goldens.py does).
MODELS = {
    "tiny": {"dir": TESTDATA / "models" / "tiny", "golden": TESTDATA / "goldens" / "tiny.safetensors", "moe": False},
    "tiny-moe": {
        "dir": TESTDATA / "models" / "tiny-moe",
        "golden": TESTDATA / "goldens" / "tiny-moe.safetensors",
        "moe": True,
    },
}

COMMON_FLAGS = ["--task", "text-generation-with-past"]


def int4_flags(group: int) -> list[str]:
    """The port's INT4 flags at `group` (the port's own is 128, which divides no width of the tiny models)."""
    return [
        "--weight-format", "int4", "--sym", "--group-size", str(group), "--group-size-fallback", "ignore",
        "--ratio", "1.0", "--backup-precision", "int8_sym",
    ]


EXPORTS = {
    "tiny-f32": {"model": "tiny", "flags": ["--weight-format", "fp32"], "reference_weights": "f32"},
    "tiny-int4": {"model": "tiny", "flags": int4_flags(32), "reference_weights": "int4-nncf:32"},
    "tiny-moe-f32": {"model": "tiny-moe", "flags": ["--weight-format", "fp32"], "reference_weights": "f32"},
    "tiny-moe-int4": {"model": "tiny-moe", "flags": int4_flags(8), "reference_weights": "int4-nncf:8"},
}

# The interface of optimum-intel's stateful decoder export, by the roles `npu::external` knows. Shapes are symbolic:
# `batch` (1 here), `tokens` (this call's), `past+tokens` (every token so far), `vocab`.
INTERFACE = {
    "inputs": {
        "input_ids": {"shape": ["batch", "tokens"], "meaning": "the token ids of this call"},
        "attention_mask": {
            "shape": ["batch", "past+tokens"],
            "meaning": "1 for every token so far (the past ones and this call's), 0 for padding",
        },
        "position_ids": {
            "shape": ["batch", "tokens"],
            "meaning": "the text positions of this call's tokens (past .. past+tokens-1); for qwen3_5_text and "
            "qwen3_5_moe_text the export declares it but no op reads it: positions come from the KV-cache length",
        },
        "beam_idx": {
            "shape": ["batch"],
            "meaning": "which beam's cache each row continues (0 for a single sequence); the export gathers every "
            "state variable by it",
        },
    },
    "outputs": {"logits": {"shape": ["batch", "tokens", "vocab"], "meaning": "the logits of every token of the call"}},
}

OV_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}


def log(msg: str) -> None:
    print(f"[make_optimum_export] {msg}", flush=True)


def versions() -> dict:
    names = ["optimum-intel", "optimum", "transformers", "torch", "openvino", "nncf", "openvino-tokenizers",
             "numpy", "safetensors"]
    out = {"python": platform.python_version()}
    for n in names:
        out[n] = importlib.metadata.version(n)
    import openvino

    out["openvino_build"] = openvino.get_version()
    return out


def export(name: str, spec: dict) -> tuple[Path, list[str]]:
    cli = Path(sys.executable).parent / "optimum-cli"
    tmp = Path(tempfile.mkdtemp(prefix=f"optimum-{name}-"))
    model = MODELS[spec["model"]]["dir"].relative_to(REPO).as_posix()
    args = ["export", "openvino", "--model", model, *COMMON_FLAGS, *spec["flags"]]
    log(f"{name}: optimum-cli {' '.join(args)} OUT")
    r = subprocess.run([str(cli), *args, str(tmp)], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        raise SystemExit(f"{name}: optimum-cli failed ({r.returncode})")
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for f in ("openvino_model.xml", "openvino_model.bin"):
        shutil.copyfile(tmp / f, out / f)
    shutil.rmtree(tmp)
    return out, ["optimum-cli", *args, f"testdata/ir/{name}"]


def describe(xml: Path) -> dict:
    """What the export holds: ports, state variables, op counts, which parameters nothing reads, and every
    compressed weight with its decompression chain and consumer."""
    import openvino as ov

    model = ov.Core().read_model(xml)
    ports = lambda ps: [  # noqa: E731
        {"name": p.get_any_name(), "type": p.get_element_type().get_type_name(), "shape": str(p.get_partial_shape())}
        for p in ps
    ]
    variables = sorted(
        (
            {
                "id": v.get_info().variable_id,
                "type": v.get_info().data_type.get_type_name(),
                "shape": str(v.get_info().data_shape),
            }
            for v in model.get_variables()
        ),
        key=lambda v: v["id"],
    )
    ops = Counter(op.get_type_name() for op in model.get_ordered_ops())
    unread = [p.get_friendly_name() for p in model.get_parameters() if not p.output(0).get_target_inputs()]
    compressed = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Constant" or op.get_element_type().get_type_name() not in ("i4", "u4", "i8", "u8"):
            continue
        chain, node, last = [], op, op
        consumer = None
        for _ in range(6):
            targets = list(node.output(0).get_target_inputs())
            if len(targets) != 1:
                break
            node = targets[0].get_node()
            if node.get_type_name() in WEIGHT_CONSUMERS:
                consumer = node
                break
            chain.append(node.get_type_name())
            last = node
        scale = None
        for n in [t.get_node() for t in op.output(0).get_target_inputs()]:
            for t in n.output(0).get_target_inputs():
                mul = t.get_node()
                if mul.get_type_name() == "Multiply":
                    s = mul.input_value(1).get_node()
                    scale = {"type": s.get_element_type().get_type_name(), "shape": list(s.get_output_shape(0))}
        entry = {
            "type": op.get_element_type().get_type_name(),
            "shape": list(op.get_output_shape(0)),
            "scale": scale,
            "chain": chain,
            "consumer": f"{consumer.get_type_name()} {consumer.get_friendly_name()}" if consumer else None,
        }
        if consumer is not None and consumer.get_type_name() == "MatMul":
            entry["transpose_b"] = bool(consumer.get_attributes()["transpose_b"])
        entry.update(lowering(entry["type"], entry["shape"], scale["shape"], list(last.get_output_shape(0))))
        compressed[op.get_friendly_name()] = entry
    kinds = Counter(
        ("int4" if c["type"] in ("i4", "u4") else "int8") + " " + (c["consumer"] or "?").split(" ")[0]
        for c in compressed.values()
    )
    held = {
        "inputs": ports(model.inputs),
        "outputs": ports(model.outputs),
        "state_variables": variables,
        "ops": dict(sorted(ops.items())),
        "parameters_nothing_reads": unread,
        "compressed_weights": dict(sorted(compressed.items())),
        "compressed_summary": dict(sorted(kinds.items())),
    }
    if compressed:
        held["compression_rule"] = compression_rule(compressed)
        held["weights_left_float"] = float_weights(model)
    return held


# The ops whose constant input is a weight NNCF compresses, and the ports such a weight may be on.
WEIGHT_CONSUMERS = {"MatMul": (0, 1), "Gather": (0,), "GroupConvolution": (1,), "Convolution": (1,)}


def lowering(ty: str, shape: list[int], scale: list[int], weight: list[int]) -> dict:
    """What NNCF did to one weight, read from the shapes of its codes (`shape`), its scales and the decompressed
    weight its consumer reads: the mode, the group (-1: one scale per channel) and the axis of `weight` the scales
    reduce over. Grouped codes hold that axis split in two, [.., groups, group, ..]; per-channel scales keep the
    weight's rank with 1 on the reduced axes."""
    mode = ("int4" if ty in ("i4", "u4") else "int8") + ("_sym" if ty.startswith("i") else "_asym")
    if len(shape) == len(weight) + 1:
        axis = next(a for a in range(len(weight)) if shape[a] != weight[a])
        assert shape[a := axis] * shape[a + 1] == weight[a] and scale[a + 1] == 1, (shape, scale, weight)
        return {"mode": mode, "group": shape[axis + 1], "weight_shape": weight, "reduction_axes": [axis]}
    assert shape == weight and len(scale) == len(weight), (shape, scale, weight)
    axes = [a for a in range(len(weight)) if scale[a] == 1 and weight[a] > 1]
    return {"mode": mode, "group": -1, "weight_shape": weight, "reduction_axes": axes}


def pattern(name: str) -> tuple[str, int | None]:
    """A constant's name with its layer index replaced by `{i}`, and the index."""
    m = re.search(r"layers\.(\d+)([./])", name)
    if not m:
        return name, None
    return name[: m.start(1)] + "{i}" + name[m.end(1) :], int(m.group(1))


def compression_rule(compressed: dict) -> dict:
    """What NNCF did to each weight tensor of the decoder, once per tensor kind (the layers it is in listed): mode,
    group, the decompressed weight's shape, the axes the scales reduce over, the scales' shape and the consumer."""
    rule: dict = {}
    for name, c in compressed.items():
        key, layer = pattern(name)
        what = {k: c[k] for k in ("mode", "group", "weight_shape", "reduction_axes")}
        what["scale_shape"] = c["scale"]["shape"]
        what["consumer"] = c["consumer"].split(" ")[0] + (
            f" (transpose_b {str(c['transpose_b']).lower()})" if "transpose_b" in c else ""
        )
        entry = rule.setdefault(key, {**what, "layers": []})
        assert {k: entry[k] for k in what} == what, f"{name}: compressed unlike the other layers' {key}"
        if layer is not None:
            entry["layers"].append(layer)
    return {k: v if v["layers"] else {x: y for x, y in v.items() if x != "layers"} for k, v in sorted(rule.items())}


def float_weights(model) -> list[str]:
    """The constant weights (f32, maybe through a Convert) of the MatMuls, Gathers and convolutions that NNCF left
    float."""
    out = []
    for op in model.get_ordered_ops():
        for port in WEIGHT_CONSUMERS.get(op.get_type_name(), ()):
            src = op.input_value(port).get_node()
            while src.get_type_name() == "Convert":
                src = src.input_value(0).get_node()
            if src.get_type_name() == "Constant" and src.get_element_type().is_real():
                shape = list(src.get_output_shape(0))
                out.append(f"{src.get_friendly_name()} {shape} -> {op.get_type_name()} {op.get_friendly_name()}")
    return out


def golden_prompt(model: dict) -> list[int]:
    from safetensors.numpy import load_file

    return [int(x) for x in load_file(model["golden"])["token_ids"]]


def transformers_run(model: dict, prompt: list[int]) -> tuple[list, list[int]]:
    """transformers f32 eager: the prompt's logits, then greedy tokens with the cache (each step's logits)."""
    import torch
    import transformers

    torch.set_num_threads(1)
    eager = {"attn_implementation": "eager", **({"experts_implementation": "eager"} if model["moe"] else {})}
    model = transformers.AutoModelForCausalLM.from_pretrained(model["dir"], dtype=torch.float32, **eager).eval()
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        logits = [out.logits[0].numpy()]
        cache = out.past_key_values
        tokens = []
        for _ in range(NUM_GENERATED):
            nxt = int(logits[-1][-1].argmax())
            tokens.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0].numpy())
    return logits, tokens


def openvino_run(xml: Path, prompt: list[int]) -> tuple[list, list[int]]:
    """The IR on CPU (f32): the prompt in one call, then greedy single-token calls on the same request."""
    import numpy as np
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(core.read_model(xml), "CPU", OV_CONFIG)
    request = compiled.create_infer_request()
    past = 0

    def call(ids: list[int]):
        nonlocal past
        t = len(ids)
        feed = {
            "input_ids": np.array([ids], dtype=np.int64),
            "attention_mask": np.ones((1, past + t), dtype=np.int64),
            "position_ids": np.arange(past, past + t, dtype=np.int64)[None, :],
            "beam_idx": np.zeros(1, dtype=np.int32),
        }
        request.infer(feed)
        past += t
        return request.get_tensor("logits").data[0].copy()

    logits = [call(prompt)]
    tokens = []
    for _ in range(NUM_GENERATED):
        nxt = int(logits[-1][-1].argmax())
        tokens.append(nxt)
        logits.append(call([nxt]))
    return logits, tokens


def nmse(a, b) -> float:
    import numpy as np

    a, b = np.concatenate(a).astype(np.float64), np.concatenate(b).astype(np.float64)
    return float(((a - b) ** 2).sum() / (b**2).sum())


def update_manifest(section: dict, paths: list[Path]) -> None:
    manifest_path = TESTDATA / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    rels = {p.relative_to(REPO).as_posix() for p in paths}
    files = [f for f in manifest["files"] if f["path"] not in rels and not f["path"].startswith("testdata/ir/")]
    for p in paths:
        files.append({"path": p.relative_to(REPO).as_posix(), "bytes": p.stat().st_size, "sha256": sha256(p)})
    manifest["files"] = sorted(files, key=lambda f: f["path"].split("/"))
    manifest["total_bytes"] = sum(f["bytes"] for f in manifest["files"])
    manifest["optimum_exports"] = section  # where it stood, if it did: the `*_goldens` sections follow, sorted
    later = sorted(k for k in manifest if k.endswith("_goldens"))
    manifest = {**{k: v for k, v in manifest.items() if k not in later}, **{k: manifest[k] for k in later}}
    manifest_path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def check_moe_rule(name: str, held: dict) -> None:
    """Stops unless NNCF gave every MoE tensor of an INT4 export (router, experts, shared expert and its gate) INT4
    symmetric in groups along its last axis (the MatMul's input axis, transpose_b), as the reference's rule has it."""
    rule = held["compression_rule"]
    moe = {k: v for k, v in rule.items() if ".mlp" in k}
    assert moe, f"{name}: no MoE weight among the compressed ones"
    for key, r in moe.items():
        last = len(r["weight_shape"]) - 1
        assert r["mode"] == "int4_sym" and r["reduction_axes"] == [last], f"{name}: {key} compressed as {r}"
        assert "transpose_b true" in r["consumer"], f"{name}: {key} is read by {r['consumer']}"
    stacked = [k for k, r in moe.items() if len(r["weight_shape"]) == 3]
    assert len(stacked) == 3, f"{name}: the stacked expert weights are {stacked}"


def main() -> None:
    v = versions()
    log("versions: " + ", ".join(f"{k} {x}" for k, x in v.items()))
    runs = {}
    for model in dict.fromkeys(spec["model"] for spec in EXPORTS.values()):
        prompt = golden_prompt(MODELS[model])
        runs[model] = (prompt, *transformers_run(MODELS[model], prompt))
        log(f"transformers, {model}: {len(prompt)} prompt tokens, greedy {runs[model][2]}")
    shutil.rmtree(OUT, ignore_errors=True)
    written: list[Path] = []
    section = {
        "generator": "scripts/make_optimum_export.py",
        "requirements": "scripts/requirements-optimum.txt",
        "versions": v,
        "exports": {},
    }
    for name, spec in EXPORTS.items():
        model = MODELS[spec["model"]]
        prompt, hf_logits, hf_tokens = runs[spec["model"]]
        out, command = export(name, spec)
        xml = out / "openvino_model.xml"
        held = describe(xml)
        if model["moe"] and held["compressed_weights"]:
            check_moe_rule(name, held)
        ov_logits, ov_tokens = openvino_run(xml, prompt)
        check = {
            "prompt": f"goldens/{model['golden'].name} token_ids",
            "prompt_tokens": len(prompt),
            "generated": NUM_GENERATED,
            "openvino_config": OV_CONFIG,
            "device": "CPU",
            "transformers_tokens": hf_tokens,
            "openvino_tokens": ov_tokens,
            "logits_nmse_vs_transformers_f32": nmse(ov_logits, hf_logits),
        }
        log(f"{name}: tokens {ov_tokens}, logits NMSE vs transformers f32 {check['logits_nmse_vs_transformers_f32']:.3e}")
        if spec["reference_weights"] == "f32":
            assert ov_tokens == hf_tokens, f"{name}: greedy tokens differ from transformers"
            assert check["logits_nmse_vs_transformers_f32"] < F32_MAX_NMSE, f"{name}: logits differ"
        manifest = {
            "format": "qwen35-external-ir",
            "version": 1,
            "xml": "openvino_model.xml",
            "bin": "openvino_model.bin",
            "model": f"../../models/{spec['model']}",
            "reference_weights": spec["reference_weights"],
            "stateful": True,
            "inputs": {
                role: {
                    "name": role,
                    "type": next(p["type"] for p in held["inputs"] if p["name"] == role),
                    **port,
                }
                for role, port in INTERFACE["inputs"].items()
            },
            "outputs": {
                role: {
                    "name": role,
                    "type": next(p["type"] for p in held["outputs"] if p["name"] == role),
                    **port,
                }
                for role, port in INTERFACE["outputs"].items()
            },
            "export": {"command": command, "versions": v},
            "holds": held,
            "check": check,
        }
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        files = sorted(out.iterdir())
        written.extend(files)
        section["exports"][name] = {
            "model": model["dir"].relative_to(REPO).as_posix(),
            "command": " ".join(command),
            "reference_weights": spec["reference_weights"],
            "compressed_summary": held["compressed_summary"],
            "logits_nmse_vs_transformers_f32": check["logits_nmse_vs_transformers_f32"],
            "tokens_equal_transformers": ov_tokens == hf_tokens,
        }
    total = sum(p.stat().st_size for p in written)
    assert total < MAX_IR_BYTES, f"the exports take {total} bytes"
    update_manifest(section, written)
    log(f"wrote {len(written)} files, {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
