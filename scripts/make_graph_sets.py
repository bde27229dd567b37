#!/usr/bin/env python3
"""Graph sets made elsewhere, for `qwen35 compare-devices --ir` and `qwen35 validate --ir` (testdata/sets/).

Run with the interpreter of a venv made from scripts/requirements-graphs.txt (OpenVINO and numpy from PyPI, no torch),
after `cargo build --release -p parity` (the sets written by `qwen35 export-ir` come from that binary) and
scripts/make_optimum_export.py (the stateless sets start from testdata/ir/tiny-f32):

    scripts/.venv-graphs/bin/python scripts/make_graph_sets.py [--qwen35 target/release/qwen35]

It writes, under testdata/sets/:

- `tiny-decoder/`: `qwen35 export-ir --blocks 16` of testdata/models/tiny: the whole decoder for 1 and 16 tokens per
  call, every cache an explicit input and output, hidden outputs under the dump's names, one shared `weights.bin`,
  and the manifest that describes them.
- `tiny-layers/`: `qwen35 export-ir --blocks 16 --parts layers`: each layer's own graph for 1 and 16 tokens.
- `tiny-stateless/`: optimum-intel's stateful export of tiny (testdata/ir/tiny-f32) turned stateless by OpenVINO's
  own `openvino._offline_transformations.stateful_to_stateless_transformation`: the caches become inputs
  `past_key_values.{j}.key|value`, `cache_params.past.{conv|ssm}.{j}` and outputs `present.{j}.key|value`,
  `cache_params.present.{conv|ssm}.{j}`. No manifest: qwen35 knows this naming.
- `tiny-renamed/`: the same graph with every port renamed, and the recurrent states' ports transposed to
  `[batch, heads, value_dim, key_dim]` (a Transpose after the input and before the output, so the math is the
  same): only its manifest says what each port is.
- `tiny-embeds/`: the stateless graph taking the token embeddings (`inputs_embeds` `[batch, tokens, hidden]`) in
  place of `input_ids` and its embedding lookup, as a decoder fed by a host (or a graph) that embeds.
- `tiny-last-logits/`: the stateless graph whose logits are the call's last token's only (`[batch, 1, vocab]`).
- `broken-conv-shift/`: the stateless graph with layer 1's conv state output shifted by one step along the
  kernel (time) axis, its oldest column zero.
- `broken-kv-late/`: the stateless graph with layer 3's (the first attention layer's) new key rows written one slot
  late: after the cache's past rows a zero row, then the call's rows but the last.
- `broken-ssm-scaled/`: the stateless graph with layer 2's recurrent state output scaled by 1.01.

The renamed and broken graphs read their weights from tiny-stateless's `.bin`: every constant of theirs is pointed
at the same bytes there, and the few constants only they have (the shift's zeros, the scale, slice bounds) are
appended to it. The script checks itself on OpenVINO's CPU device before writing anything: each stateless graph
against the stateful export (the same logits), each broken graph against the stateless one (only the state it
breaks differs after a prompt), and it stops on any failure. It adds the files and a `graph_sets` section to
testdata/manifest.json. Two runs give byte-identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino._offline_transformations import stateful_to_stateless_transformation
from testdata_files import sha256

REPO = Path(__file__).resolve().parent.parent
TESTDATA = REPO / "testdata"
MODEL = TESTDATA / "models" / "tiny"
OPTIMUM = TESTDATA / "ir" / "tiny-f32"
OUT = TESTDATA / "sets"
MAX_SETS_BYTES = 8_000_000  # every set together

# tiny: layers [L L L F]; {j} counts the layers of each kind.
LAYER_KINDS = ["linear", "linear", "linear", "full"]
BROKEN = {
    "broken-conv-shift": {"layer": 1, "state": "conv_state", "port": "cache_params.present.conv.1"},
    "broken-kv-late": {"layer": 3, "state": "key_cache", "port": "present.0.key"},
    "broken-ssm-scaled": {"layer": 2, "state": "recurrent_state", "port": "cache_params.present.ssm.2"},
}
PROMPT = [508, 375, 3, 17, 101, 240, 33, 7, 90, 12, 64, 5]  # token ids of the self-check (vocab 512)
CPU = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


# --- the stateless graph and its variants ---------------------------------------------------------------------


def stateless() -> ov.Model:
    model = ov.Core().read_model(OPTIMUM / "openvino_model.xml")
    stateful_to_stateless_transformation(model)
    return model


def result_of(model: ov.Model, name: str):
    for r in model.get_results():
        if name in r.output(0).get_names() or name in r.input(0).get_source_output().get_names():
            return r
    raise SystemExit(f"no output {name}")


def replace_output(model: ov.Model, name: str, make) -> None:
    """Feeds the Result `name` from `make(old_output)` instead, the tensor name moved to the new output."""
    r = result_of(model, name)
    old = r.input(0).get_source_output()
    new = make(old)
    names = set(old.get_names())
    old.get_tensor().set_names(set())
    new.get_tensor().set_names(names)
    r.input(0).replace_source_output(new)


def conv_shift(model: ov.Model, name: str) -> None:
    # [batch, channels, kernel]: columns 0..K-2 move one step right, column 0 becomes zero.
    def make(x):
        head = ops.slice(x, np.array([0]), np.array([-1]), np.array([1]), np.array([2]))
        zero = ops.multiply(ops.slice(x, np.array([0]), np.array([1]), np.array([1]), np.array([2])), np.float32(0.0))
        return ops.concat([zero, head], 2).output(0)

    replace_output(model, name, make)


def kv_late(model: ov.Model, name: str, past_input: str) -> None:
    # [batch, kv_heads, past + tokens, head_dim]: the past rows, a zero row, then the call's rows but the last.
    past = next(p for p in model.get_parameters() if past_input in p.output(0).get_names())

    def make(x):
        p = ops.gather(ops.shape_of(past, "i64"), np.array([2]), np.array(0))
        total = ops.gather(ops.shape_of(x, "i64"), np.array([2]), np.array(0))
        head = ops.slice(x, np.array([0]), p, np.array([1]), np.array([2]))
        tail = ops.slice(x, p, ops.subtract(total, np.array([1])), np.array([1]), np.array([2]))
        one = ops.multiply(ops.slice(x, np.array([0]), np.array([1]), np.array([1]), np.array([2])), np.float32(0.0))
        return ops.concat([head, one, tail], 2).output(0)

    replace_output(model, name, make)


def embeds_input(model: ov.Model) -> None:
    """Takes the token embeddings as an input, `inputs_embeds` [batch, tokens, hidden], in place of `input_ids` and the
    embedding lookup (as a pipeline that embeds on the host, or in a graph of its own, feeds its decoder)."""
    ids = next(p for p in model.get_parameters() if "input_ids" in p.output(0).get_names())
    lookup = next(
        t.get_node()
        for c in ids.output(0).get_target_inputs()
        for t in c.get_node().output(0).get_target_inputs()
        if t.get_node().get_type_name() == "Gather"
    )
    hidden = lookup.output(0).get_partial_shape()[2]
    embeds = ops.parameter(ov.PartialShape([-1, -1, hidden]), ov.Type.f32, name="inputs_embeds")
    lookup.output(0).replace(embeds.output(0))
    model.remove_parameter(ids)
    model.add_parameters([embeds])
    embeds.output(0).get_tensor().set_names({"inputs_embeds"})
    model.validate_nodes_and_infer_types()


def last_logits(model: ov.Model) -> None:
    """Outputs the logits of the call's last token only, `[batch, 1, vocab]` (as a decoder that computes the LM head
    on the last position alone)."""
    replace_output(
        model,
        "logits",
        lambda x: ops.slice(x, np.array([-1]), np.array([2**62]), np.array([1]), np.array([1])).output(0),
    )


def ssm_scaled(model: ov.Model, name: str) -> None:
    replace_output(model, name, lambda x: ops.multiply(x, np.float32(1.01)).output(0))


def renamed(model: ov.Model) -> dict:
    """Renames every port (recurrent states also transposed to [batch, heads, value_dim, key_dim]); returns the
    manifest's decoder part."""
    names = {
        "input_ids": "tok",
        "attention_mask": "seen",
        "position_ids": "where",
        "logits": "scores",
    }
    conv_in, conv_out, ssm_in, ssm_out = {}, {}, {}, {}
    for i, kind in enumerate(LAYER_KINDS):
        if kind == "linear":
            j = LAYER_KINDS[:i].count("linear")
            conv_in[str(i)] = f"dn{i}_window"
            conv_out[str(i)] = f"dn{i}_window_next"
            ssm_in[str(i)] = f"dn{i}_S_T"
            ssm_out[str(i)] = f"dn{i}_S_T_next"
            names[f"cache_params.past.conv.{j}"] = conv_in[str(i)]
            names[f"cache_params.present.conv.{j}"] = conv_out[str(i)]
            names[f"cache_params.past.ssm.{j}"] = ssm_in[str(i)]
            names[f"cache_params.present.ssm.{j}"] = ssm_out[str(i)]
        else:
            j = LAYER_KINDS[:i].count("full")
            names[f"past_key_values.{j}.key"] = f"attn{i}_K"
            names[f"past_key_values.{j}.value"] = f"attn{i}_V"
            names[f"present.{j}.key"] = f"attn{i}_K_next"
            names[f"present.{j}.value"] = f"attn{i}_V_next"
    # The recurrent states: a Transpose after a new input and before the output.
    for i, kind in enumerate(LAYER_KINDS):
        if kind != "linear":
            continue
        j = LAYER_KINDS[:i].count("linear")
        old = next(p for p in model.get_parameters() if f"cache_params.past.ssm.{j}" in p.output(0).get_names())
        shape = old.get_partial_shape()
        new_shape = ov.PartialShape([shape[0], shape[1], shape[3], shape[2]])
        param = ops.parameter(new_shape, old.get_element_type(), name=ssm_in[str(i)])
        back = ops.transpose(param, np.array([0, 1, 3, 2]))
        old.output(0).replace(back.output(0))
        model.replace_parameter(model.get_parameter_index(old), param)
        param.output(0).get_tensor().set_names({f"cache_params.past.ssm.{j}"})
        back.output(0).get_tensor().set_names(set())
        replace_output(
            model,
            f"cache_params.present.ssm.{j}",
            lambda x: ops.transpose(x, np.array([0, 1, 3, 2])).output(0),
        )
    for port in list(model.inputs) + list(model.outputs):
        have = port.get_names()
        for old, new in names.items():
            if old in have:
                port.get_tensor().set_names({new})
    model.validate_nodes_and_infer_types()
    for port in list(model.inputs) + list(model.outputs):
        if len(port.get_names()) != 1 or port.get_any_name() not in names.values():
            raise SystemExit(f"a port kept another name: {port.get_names()}")
    return {
        "prompt": "blocks",
        "inputs": {
            "input_ids": {"name": "tok", "type": "i64", "shape": ["batch", "tokens"]},
            "attention_mask": {"name": "seen", "type": "i64", "shape": ["batch", "past+tokens"], "values": "ones"},
            "positions": {"name": "where", "type": "i64", "shape": ["batch", "tokens"]},
        },
        "outputs": {"logits": {"name": "scores", "type": "f32", "shape": ["batch", "tokens", "vocab"]}},
        "states": {
            "conv_state": {"input": conv_in, "output": conv_out, "type": "f32", "shape": ["batch", "channels", "kernel"]},
            "recurrent_state": {
                "input": ssm_in,
                "output": ssm_out,
                "type": "f32",
                "shape": ["batch", "heads", "value_dim", "key_dim"],
            },
            "key_cache": {
                "input": "attn{i}_K",
                "output": "attn{i}_K_next",
                "type": "f32",
                "shape": ["batch", "kv_heads", "past", "head_dim"],
                "output_shape": ["batch", "kv_heads", "past+tokens", "head_dim"],
            },
            "value_cache": {
                "input": "attn{i}_V",
                "output": "attn{i}_V_next",
                "type": "f32",
                "shape": ["batch", "kv_heads", "past", "head_dim"],
                "output_shape": ["batch", "kv_heads", "past+tokens", "head_dim"],
            },
        },
    }


def stateless_part() -> dict:
    """The manifest's decoder part of OpenVINO's stateless naming (what qwen35 assumes without a manifest)."""
    return {
        "prompt": "blocks",
        "inputs": {
            "input_ids": {"name": "input_ids", "type": "i64", "shape": ["batch", "tokens"]},
            "attention_mask": {
                "name": "attention_mask",
                "type": "i64",
                "shape": ["batch", "past+tokens"],
                "values": "ones",
            },
            "positions": {"name": "position_ids", "type": "i64", "shape": ["batch", "tokens"]},
        },
        "outputs": {"logits": {"name": "logits", "type": "f32", "shape": ["batch", "tokens", "vocab"]}},
        "states": {
            "conv_state": {
                "input": "cache_params.past.conv.{j}",
                "output": "cache_params.present.conv.{j}",
                "type": "f32",
                "shape": ["batch", "channels", "kernel"],
            },
            "recurrent_state": {
                "input": "cache_params.past.ssm.{j}",
                "output": "cache_params.present.ssm.{j}",
                "type": "f32",
                "shape": ["batch", "heads", "key_dim", "value_dim"],
            },
            "key_cache": {
                "input": "past_key_values.{j}.key",
                "output": "present.{j}.key",
                "type": "f32",
                "shape": ["batch", "kv_heads", "past", "head_dim"],
                "output_shape": ["batch", "kv_heads", "past+tokens", "head_dim"],
            },
            "value_cache": {
                "input": "past_key_values.{j}.value",
                "output": "present.{j}.value",
                "type": "f32",
                "shape": ["batch", "kv_heads", "past", "head_dim"],
                "output_shape": ["batch", "kv_heads", "past+tokens", "head_dim"],
            },
        },
    }


# --- one .bin for the stateless graph and its variants ------------------------------------------------------------


def consts(xml: Path):
    tree = ET.parse(xml)
    for layer in tree.getroot().iter("layer"):
        if layer.get("type") == "Const":
            data = layer.find("data")
            yield tree, data


def share_bin(xml: Path, own_bin: Path, shared: Path) -> None:
    """Points every constant of `xml` (stored in `own_bin`) at the same bytes in `shared`, appending the ones it
    lacks, and rewrites `xml`."""
    blob = bytearray(shared.read_bytes())
    index: dict[bytes, int] = {}
    base_xml = shared.with_suffix(".xml")
    for _, data in consts(base_xml):
        off, size = int(data.get("offset")), int(data.get("size"))
        index.setdefault(hashlib.sha256(blob[off : off + size]).digest(), off)
    own = own_bin.read_bytes()
    tree = ET.parse(xml)
    appended = 0
    for layer in tree.getroot().iter("layer"):
        if layer.get("type") != "Const":
            continue
        data = layer.find("data")
        off, size = int(data.get("offset")), int(data.get("size"))
        piece = own[off : off + size]
        key = hashlib.sha256(piece).digest()
        if key not in index:
            index[key] = len(blob)
            blob.extend(piece)
            appended += size
        data.set("offset", str(index[key]))
    tree.write(xml, encoding="utf-8", xml_declaration=True)
    shared.write_bytes(bytes(blob))
    own_bin.unlink()
    print(f"  {xml.parent.name}: {appended} bytes of its own constants appended to {shared.parent.name}'s .bin")


# --- self-checks ---------------------------------------------------------------------------------------------------


def embedding_rows() -> np.ndarray:
    """The tiny model's embeddings of PROMPT `[1, T, H]`, read from its checkpoint."""
    from safetensors.numpy import load_file

    table = load_file(MODEL / "model.safetensors")["model.embed_tokens.weight"]
    return table[PROMPT][None].astype(np.float32)


def run_stateless(
    xml: Path, bin_: Path, names: dict | None = None, ssm_transposed: bool = False, embeds: bool = False
) -> dict:
    """Runs PROMPT in one call from zero states; returns every output under the stateless names."""
    core = ov.Core()
    model = core.read_model(xml, bin_)
    c = core.compile_model(model, "CPU", CPU)
    n = names or {}
    t = len(PROMPT)
    tokens = {"inputs_embeds": embedding_rows()} if embeds else {n.get("input_ids", "input_ids"): np.array([PROMPT], np.int64)}
    feed = {
        **tokens,
        n.get("attention_mask", "attention_mask"): np.ones((1, t), np.int64),
        n.get("position_ids", "position_ids"): np.arange(t, dtype=np.int64)[None],
        n.get("past_key_values.0.key", "past_key_values.0.key"): np.zeros((1, 2, 0, 32), np.float32),
        n.get("past_key_values.0.value", "past_key_values.0.value"): np.zeros((1, 2, 0, 32), np.float32),
    }
    for j in range(3):
        feed[n.get(f"cache_params.past.conv.{j}", f"cache_params.past.conv.{j}")] = np.zeros((1, 160, 4), np.float32)
        ssm = (1, 4, 24, 16) if ssm_transposed else (1, 4, 16, 24)
        feed[n.get(f"cache_params.past.ssm.{j}", f"cache_params.past.ssm.{j}")] = np.zeros(ssm, np.float32)
    out = c.create_infer_request().infer(feed)
    back = {v: k for k, v in n.items()}
    res = {}
    for port, value in out.items():
        name = port.get_any_name()
        name = back.get(name, name)
        if ssm_transposed and name.startswith("cache_params.present.ssm."):
            value = np.transpose(value, (0, 1, 3, 2))
        res[name] = np.array(value)
    return res


def run_stateful(t: int) -> np.ndarray:
    core = ov.Core()
    c = core.compile_model(core.read_model(OPTIMUM / "openvino_model.xml"), "CPU", {**CPU, "KV_CACHE_PRECISION": "f32"})
    r = c.create_infer_request()
    out = r.infer(
        {
            "input_ids": np.array([PROMPT], np.int64),
            "attention_mask": np.ones((1, t), np.int64),
            "position_ids": np.arange(t, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, np.int32),
        }
    )
    return np.array(out[c.output("logits")])


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# --- main ----------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qwen35", default=str(REPO / "target" / "release" / "qwen35"))
    args = ap.parse_args()
    qwen35 = Path(args.qwen35)
    if not qwen35.is_file():
        raise SystemExit(f"{qwen35}: build it first (cargo build --release -p parity)")
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    model_rel = str(MODEL.relative_to(REPO))

    run([str(qwen35), "export-ir", "--model", model_rel, "--out", "testdata/sets/tiny-decoder", "--blocks", "16"])
    run([str(qwen35), "export-ir", "--model", model_rel, "--out", "testdata/sets/tiny-layers", "--blocks", "16",
         "--parts", "layers"])

    base = OUT / "tiny-stateless"
    base.mkdir()
    ov.save_model(stateless(), base / "openvino_model.xml", compress_to_fp16=False)
    figures = {}
    want = run_stateful(len(PROMPT))
    got = run_stateless(base / "openvino_model.xml", base / "openvino_model.bin")
    figures["tiny-stateless"] = {"logits_rel_vs_stateful": rel(got["logits"], want)}
    if figures["tiny-stateless"]["logits_rel_vs_stateful"] > 1e-6:
        raise SystemExit(f"the stateless graph moved the logits: {figures['tiny-stateless']}")
    reference = got

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # Renamed (and the recurrent states transposed).
        m = stateless()
        part = renamed(m)
        d = OUT / "tiny-renamed"
        d.mkdir()
        ov.save_model(m, d / "openvino_model.xml", compress_to_fp16=False)
        share_bin(d / "openvino_model.xml", d / "openvino_model.bin", base / "openvino_model.bin")
        rename = {
            "input_ids": "tok", "attention_mask": "seen", "position_ids": "where", "logits": "scores",
            "past_key_values.0.key": "attn3_K", "past_key_values.0.value": "attn3_V",
            "present.0.key": "attn3_K_next", "present.0.value": "attn3_V_next",
        }
        for j, i in enumerate([0, 1, 2]):
            rename[f"cache_params.past.conv.{j}"] = f"dn{i}_window"
            rename[f"cache_params.present.conv.{j}"] = f"dn{i}_window_next"
            rename[f"cache_params.past.ssm.{j}"] = f"dn{i}_S_T"
            rename[f"cache_params.present.ssm.{j}"] = f"dn{i}_S_T_next"
        out = run_stateless(d / "openvino_model.xml", base / "openvino_model.bin", rename, ssm_transposed=True)
        worst = max(rel(out[k], reference[k]) for k in reference)
        figures["tiny-renamed"] = {"worst_rel_vs_stateless": worst}
        if worst > 1e-6:
            raise SystemExit(f"the renamed graph computes something else: {worst}")
        write_manifest(d, part, "../tiny-stateless/openvino_model.bin", "the stateless graph, every port renamed and "
                       "the recurrent states' ports transposed to [batch, heads, value_dim, key_dim]")

        # Embeddings in place of token ids.
        m = stateless()
        embeds_input(m)
        d = OUT / "tiny-embeds"
        d.mkdir()
        ov.save_model(m, d / "openvino_model.xml", compress_to_fp16=False)
        share_bin(d / "openvino_model.xml", d / "openvino_model.bin", base / "openvino_model.bin")
        names = sorted(n for p in ov.Core().read_model(d / "openvino_model.xml", base / "openvino_model.bin").inputs
                       for n in p.get_names())
        if "inputs_embeds" not in names or "input_ids" in names:
            raise SystemExit(f"tiny-embeds: its inputs are {names}")
        out = run_stateless(d / "openvino_model.xml", base / "openvino_model.bin", embeds=True)
        worst = max(rel(out[k], reference[k]) for k in reference)
        figures["tiny-embeds"] = {"worst_rel_vs_stateless": worst}
        if worst > 1e-6:
            raise SystemExit(f"the graph taking embeddings computes something else: {worst}")
        part = stateless_part()
        del part["inputs"]["input_ids"]
        part["inputs"]["embeddings"] = {
            "name": "inputs_embeds",
            "type": "f32",
            "shape": ["batch", "tokens", "hidden"],
        }
        write_manifest(d, part, "../tiny-stateless/openvino_model.bin", "the stateless graph taking the token "
                       "embeddings (inputs_embeds) in place of input_ids and its embedding lookup")

        # The last token's logits only.
        m = stateless()
        last_logits(m)
        m.validate_nodes_and_infer_types()
        d = OUT / "tiny-last-logits"
        d.mkdir()
        ov.save_model(m, d / "openvino_model.xml", compress_to_fp16=False)
        share_bin(d / "openvino_model.xml", d / "openvino_model.bin", base / "openvino_model.bin")
        out = run_stateless(d / "openvino_model.xml", base / "openvino_model.bin")
        worst = max(rel(out[k], reference[k]) for k in reference if k != "logits")
        last = rel(out["logits"][:, -1:], reference["logits"][:, -1:])
        figures["tiny-last-logits"] = {"worst_state_rel_vs_stateless": worst, "last_logits_rel": last}
        if worst > 1e-6 or last > 1e-6 or out["logits"].shape[1] != 1:
            raise SystemExit(f"the last-logits graph computes something else: {figures['tiny-last-logits']}")
        part = stateless_part()
        part["outputs"]["logits"]["shape"] = ["batch", 1, "vocab"]
        part["outputs"]["logits"]["rows"] = "last"
        write_manifest(d, part, "../tiny-stateless/openvino_model.bin", "the stateless graph giving the logits of "
                       "the call's last token only")

        for name, spec in BROKEN.items():
            m = stateless()
            if name == "broken-conv-shift":
                conv_shift(m, spec["port"])
            elif name == "broken-kv-late":
                kv_late(m, spec["port"], "past_key_values.0.key")
            else:
                ssm_scaled(m, spec["port"])
            m.validate_nodes_and_infer_types()
            d = OUT / name
            d.mkdir()
            ov.save_model(m, d / "openvino_model.xml", compress_to_fp16=False)
            share_bin(d / "openvino_model.xml", d / "openvino_model.bin", base / "openvino_model.bin")
            out = run_stateless(d / "openvino_model.xml", base / "openvino_model.bin")
            diffs = {k: rel(out[k], reference[k]) for k in reference if not k.startswith("logits")}
            moved = sorted(k for k, v in diffs.items() if v > 0)
            figures[name] = {"broken": spec, "state_rel_error": diffs[spec["port"]], "moved_after_one_call": moved}
            if moved != [spec["port"]]:
                raise SystemExit(f"{name}: after one call the states that moved are {moved}, not {spec['port']}")
            write_manifest(d, stateless_part(), "../tiny-stateless/openvino_model.bin",
                           f"the stateless graph with layer {spec['layer']}'s {spec['state']} broken on purpose "
                           f"({spec['port']})")

    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    if total > MAX_SETS_BYTES:
        raise SystemExit(f"testdata/sets holds {total} bytes, more than {MAX_SETS_BYTES}")
    record(figures, total)
    print(json.dumps(figures, indent=2))


def write_manifest(d: Path, part: dict, bin_: str, meaning: str) -> None:
    part = {"graphs": [{"tokens": "any", "xml": "openvino_model.xml", "bin": bin_}], **part}
    manifest = {
        "format": "qwen35-graph-set",
        "version": 2,
        "meaning": meaning,
        "model": "../../models/tiny",
        "reference_weights": "f32",
        "decoder": part,
        "export": {"script": "scripts/make_graph_sets.py", "from": "testdata/ir/tiny-f32"},
    }
    (d / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def record(figures: dict, total: int) -> None:
    path = TESTDATA / "manifest.json"
    m = json.loads(path.read_text(encoding="utf-8"))
    m["files"] = [f for f in m["files"] if not f["path"].startswith("testdata/sets/")]
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            m["files"].append({"path": str(p.relative_to(REPO)), "bytes": p.stat().st_size, "sha256": sha256(p)})
    m["files"].sort(key=lambda f: f["path"].split("/"))
    m["total_bytes"] = sum(f["bytes"] for f in m["files"])
    m["graph_sets"] = {
        "generator": "scripts/make_graph_sets.py",
        "requirements": "scripts/requirements-graphs.txt",
        "versions": {
            "python": platform.python_version(),
            "openvino": importlib.metadata.version("openvino"),
            "numpy": importlib.metadata.version("numpy"),
        },
        "bytes": total,
        "self_check": figures,
    }
    path.write_text(json.dumps(m, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
