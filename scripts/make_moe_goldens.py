#!/usr/bin/env python3
"""The tiny MoE models (`tiny-moe`, `tiny-moe-gguf`) and their goldens from transformers' Qwen3_5MoeForCausalLM (f32
eager and a true float64 run).

    python scripts/make_moe_goldens.py [--models tiny-moe tiny-moe-gguf]   (default: both)

Writes, from nothing but the testdata tokenizer (run scripts/make_testdata.py first):

- `testdata/models/tiny-moe/`: a flat `qwen3_5_moe_text` config, f32 `model.safetensors` with the experts stored one
  by one as a real checkpoint stores them (`mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.gate.weight`,
  `mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`), the testdata tokenizer. Layers [L L L F], 8 experts, 3 per
  token, expert width 16, shared expert width 24.
- `testdata/goldens/tiny-moe.safetensors` (f32) and `tiny-moe.f64.safetensors` (float64, every float32 cast of the
  modeling code redirected as make_testdata.py's true_float64 does, the router's softmax included).

Tensors (batch dim removed; T prompt tokens, H hidden, E experts, k per token): `token_ids` i64 [T], `embeddings`,
per layer `layers.{i}.output`, `mixer_output`, `mlp_output` [T, H], `layers.{i}.mlp.router_logits` [T, E],
`layers.{i}.mlp.experts_chosen` i64 [T, k] (torch.topk's order: descending probability),
`layers.{i}.mlp.expert_weights` [T, k] (renormalised), `layers.{i}.mlp.shared_output` [T, H] (the shared expert
times its sigmoid gate); `final_norm`, `logits` [T, V]; `generated` i64 [16] (greedy, eos disabled). The f64 file has
the same names but `embeddings` and `mixer_output`.

`tiny-moe-gguf` (MODELS) is tiny-moe made for llama.cpp (scripts/make_gguf_fixtures.py): linear value heads as wide
as its key heads (16 and 16, where tiny-moe has 16 and 8), the one shape llama.cpp's Qwen3.5 graph loads (it takes
both dims from one GGUF key, `ssm.state_size`), and expert widths that are whole 32-value blocks (32 and 64 for the
shared expert, where tiny-moe has 16 and 24), so that `llama-quantize` quantizes every expert matrix instead of
keeping the down projections in F16; everything else is tiny-moe's (8 experts, 3 per token, the shared expert and
its gate, the init, the near tie, the checks), with its own seed. It gets the f32 golden
`testdata/goldens/tiny-moe-gguf.safetensors` only (its f64 run is made and checked, routing included, but not
written: the f64 path is held by tiny-moe's), and its manifest section `moe_gguf_goldens`.

The near tie: one router row (layer NEAR_TIE["layer"], the expert ranked k+1 at prompt token NEAR_TIE["token"]) is
moved along that token's router input so that its probability comes within NEAR_TIE["gap"] of the k-th expert's
(below it, so the chosen set stays). The metadata and the manifest name the layer, the token, the two experts and the
gap measured in f32 and f64.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_testdata as mt  # noqa: E402  (hides fla before transformers is imported)
from testdata_files import add_golden, write_json  # noqa: E402

import numpy as np  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoTokenizer, GenerationConfig  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe_modeling  # noqa: E402
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig  # noqa: E402

# make_testdata's kernel check and true_float64 act on the module in `mt.modeling`: point it at the MoE one.
mt.modeling = moe_modeling

MAX_ATTEMPTS = 64
TEXT = dict(
    hidden_size=32,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                         mrope_section=[2, 1, 1], mrope_interleaved=True),
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
)
# name -> its base seed, its config (TEXT with changes), whether its f64 golden is written, its manifest section.
MODELS = {
    "tiny-moe": dict(seed=9000, text=TEXT, f64_golden=True, section="moe_goldens"),
    "tiny-moe-gguf": dict(seed=9100, text=dict(TEXT, linear_value_head_dim=16, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=64),
                          f64_golden=False, section="moe_gguf_goldens"),
}
PROMPT = {
    "messages": [
        {"role": "system", "content": "You are a ferry pilot."},
        {"role": "user", "content": "The fog is thick over the harbour this morning. Do we sail at nine?"},
    ],
    "chat_template_kwargs": {"enable_thinking": False},
}
# Gains of the re-initialisation beyond make_testdata's INIT: the router's (logits of a few units, so that the
# probabilities spread over the experts) and the shared expert gate's.
MOE_INIT = dict(router_gain=3.0, expert_gain=1.0, expert_down_gain=1.0, shared_gate_gain=1.0)
NEAR_TIE = dict(layer=2, token=20, gap=3e-5)
MIN_ROUTING_GAP = 1e-5  # k-th minus (k+1)-th probability everywhere else in the prompt, f32 and f64


@torch.no_grad()
def reinit_moe(model, config, seed: int) -> dict:
    """make_testdata's reinit (INIT for the embeddings, norms, mixers and head, the same draws in the same order, and
    the decays), the MoE blocks drawn where a dense MLP's are: router, experts (fused in memory: gate rows then up
    rows), shared expert and its gate."""
    H = config.hidden_size

    def moe_init(mlp, normal_, linear_, init):
        normal_(mlp.gate.weight, MOE_INIT["router_gain"] / math.sqrt(H))
        normal_(mlp.experts.gate_up_proj, MOE_INIT["expert_gain"] / math.sqrt(H))
        normal_(mlp.experts.down_proj, MOE_INIT["expert_down_gain"] / math.sqrt(config.moe_intermediate_size))
        linear_(mlp.shared_expert.gate_proj, init["in_gain"])
        linear_(mlp.shared_expert.up_proj, init["in_gain"])
        linear_(mlp.shared_expert.down_proj, init["down_gain"])
        linear_(mlp.shared_expert_gate, MOE_INIT["shared_gate_gain"])

    return mt.reinit(model, config, seed, mlp_init=moe_init)


class MoeRecorder:
    """Forward hooks: embeddings, every layer's output, mixer output, MLP output, router logits and choice, shared
    expert output, the final norm; and the router's input at every layer."""

    def __init__(self, model, config):
        self.dec = model.model
        self.config = config
        self.t = {}
        self.handles = []

    def _save(self, name, x):
        assert name not in self.t, f"{name} recorded twice"
        x = x.detach()
        self.t[name] = (x[0] if x.dim() == 3 else x).clone().contiguous()

    def __enter__(self):
        dec, h = self.dec, self.handles
        h.append(dec.embed_tokens.register_forward_hook(lambda m, a, o: self._save("embeddings", o)))
        h.append(dec.norm.register_forward_hook(lambda m, a, o: self._save("final_norm", o)))
        for i, layer in enumerate(dec.layers):
            p = f"layers.{i}."
            h.append(layer.register_forward_hook(lambda m, a, o, p=p: self._save(p + "output", o)))
            h.append(layer.mlp.register_forward_hook(lambda m, a, o, p=p: self._save(p + "mlp_output", o)))
            mixer = layer.linear_attn if self.config.layer_types[i] == "linear_attention" else layer.self_attn
            h.append(mixer.register_forward_hook(
                lambda m, a, o, p=p: self._save(p + "mixer_output", o[0] if isinstance(o, tuple) else o)))

            def router(m, a, o, p=p):
                logits, scores, indices = o
                self._save(p + "mlp.router_input", a[0])
                self._save(p + "mlp.router_logits", logits)
                self._save(p + "mlp.expert_weights", scores)
                self._save(p + "mlp.experts_chosen", indices)

            h.append(layer.mlp.gate.register_forward_hook(router))
            mlp = layer.mlp
            h.append(mlp.shared_expert.register_forward_hook(lambda m, a, o, p=p: self._save(p + "mlp.shared_raw", o)))
            h.append(mlp.shared_expert_gate.register_forward_hook(
                lambda m, a, o, p=p: self._save(p + "mlp.shared_gate", o)))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return False


@torch.no_grad()
def prompt_forward(model, config, ids) -> dict:
    """One forward pass of the prompt with the hooks; the shared output as the block computes it."""
    with MoeRecorder(model, config) as rec:
        out = model(input_ids=ids, use_cache=False)
    t = rec.t
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}.mlp."
        t[p + "shared_output"] = torch.nn.functional.sigmoid(t.pop(p + "shared_gate")) * t.pop(p + "shared_raw")
    t["logits"] = out.logits[0].clone()
    return t


def routing_gaps(config, t: dict) -> torch.Tensor:
    """[layers, T]: the k-th minus the (k+1)-th router probability, computed from the recorded logits in float64."""
    k = config.num_experts_per_tok
    rows = []
    for i in range(config.num_hidden_layers):
        p = torch.softmax(t[f"layers.{i}.mlp.router_logits"].double(), dim=-1)
        top = p.topk(k + 1, dim=-1).values
        rows.append(top[:, k - 1] - top[:, k])
    return torch.stack(rows)


@torch.no_grad()
def make_near_tie(model, config, ids) -> dict:
    """Moves the router row of the expert ranked k+1 at (layer, token) along that token's router input x, so that
    its probability lands NEAR_TIE["gap"] below the k-th expert's: its logit changes by exactly the wanted amount at
    that token (row += d·x/|x|²), solved by bisection in float64 on the softmax."""
    layer, tok, gap = NEAR_TIE["layer"], NEAR_TIE["token"], NEAR_TIE["gap"]
    k = config.num_experts_per_tok
    t = prompt_forward(model, config, ids)
    x = t[f"layers.{layer}.mlp.router_input"][tok].double()
    w = model.model.layers[layer].mlp.gate.weight
    logits = (w.double() @ x).clone()
    order = torch.argsort(torch.softmax(logits, -1), descending=True)
    a, b = int(order[k - 1]), int(order[k])

    def gap_for(lb: float) -> float:
        z = logits.clone()
        z[b] = lb
        p = torch.softmax(z, -1)
        return float(p[a] - p[b])

    lo, hi = float(logits[b]), float(logits[a])  # gap_for(lo) > gap > gap_for(hi) = 0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gap_for(mid) > gap:
            lo = mid
        else:
            hi = mid
    d = lo - float(logits[b])
    w[b] += (d * x / x.dot(x)).to(w.dtype)
    return {"layer": layer, "token": tok, "kth_expert": a, "next_expert": b, "logit_shift": d}


def near_tie_gap(config, t: dict, tie: dict) -> float:
    p = torch.softmax(t[f"layers.{tie['layer']}.mlp.router_logits"][tie["token"]].double(), -1)
    return float(p[tie["kth_expert"]] - p[tie["next_expert"]])


def check_seed(config, t: dict, gen: torch.Tensor, step_logits: torch.Tensor, tie: dict) -> list[str]:
    bad = []
    if float(mt.margins(t["logits"]).min()) <= mt.MIN_MARGIN:
        bad.append("prompt margin")
    if float(mt.margins(step_logits).min()) <= mt.MIN_MARGIN:
        bad.append("greedy margin")
    if len(set(gen.tolist())) < mt.MIN_DISTINCT_GENERATED:
        bad.append("repetitive greedy continuation")
    gaps = routing_gaps(config, t)
    gaps[tie["layer"], tie["token"]] = float("inf")
    if float(gaps.min()) < MIN_ROUTING_GAP:
        bad.append(f"another routing near tie ({float(gaps.min()):.1e})")
    for i in range(config.num_hidden_layers):
        res_in = t["embeddings"] if i == 0 else t[f"layers.{i - 1}.output"]
        for part in ("mixer_output", "mlp_output"):
            r = float(t[f"layers.{i}.{part}"].norm() / res_in.norm())
            if not mt.RATIO_RANGE[0] <= r <= mt.RATIO_RANGE[1]:
                bad.append(f"layer {i} {part} ratio {r:.2f}")
    used = {int(e) for i in range(config.num_hidden_layers) for e in t[f"layers.{i}.mlp.experts_chosen"].flatten()}
    if len(used) < config.num_experts:
        bad.append(f"only {len(used)} experts ever chosen")
    return bad


def golden_tensors(config, t: dict, f64: bool) -> dict:
    out = {}
    for k, v in t.items():
        if k.endswith("router_input"):
            continue
        if f64 and (k == "embeddings" or k.endswith("mixer_output")):
            continue
        out[k] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    args = ap.parse_args()
    mt.set_determinism()
    kernels = mt.assert_torch_kernels_and_count_calls()
    for name in args.models:
        make(name, MODELS[name], kernels)


def make(NAME: str, spec: dict, kernels: dict) -> None:
    TEXT, SEED = spec["text"], spec["seed"]
    model_dir = mt.TESTDATA / "models" / NAME
    shutil.rmtree(model_dir, ignore_errors=True)
    model_dir.mkdir(parents=True)
    hf_tok = AutoTokenizer.from_pretrained(mt.TESTDATA)
    kwargs = PROMPT["chat_template_kwargs"]
    prompt_text = hf_tok.apply_chat_template(PROMPT["messages"], tokenize=False, add_generation_prompt=True, **kwargs)
    ids_list = hf_tok(prompt_text, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([ids_list])
    special = {t: hf_tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    pad_id = special["<|endoftext|>"]

    for attempt in range(MAX_ATTEMPTS):
        seed = SEED + attempt
        torch.manual_seed(seed)
        config = Qwen3_5MoeTextConfig(**mt.COMMON_TEXT, **TEXT, vocab_size=len(hf_tok), bos_token_id=None,
                                      eos_token_id=pad_id, pad_token_id=pad_id)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = transformers.Qwen3_5MoeForCausalLM(config).eval()
        init_info = reinit_moe(model, config, seed)
        tie = make_near_tie(model, config, ids)
        t = prompt_forward(model, config, ids)
        gen, step_logits = mt.greedy(model, ids, pad_id)
        bad = check_seed(config, t, gen, step_logits, tie)
        gap = near_tie_gap(config, t, tie)
        if not 0 < gap < 1e-4:
            bad.append(f"near tie gap {gap:.2e}")
        if not bad:
            break
        mt.log(f"[{NAME}] seed {seed} rejected: {', '.join(bad)}")
    else:
        raise RuntimeError(f"{NAME}: no acceptable seed in {MAX_ATTEMPTS} attempts")
    mt.log(f"[{NAME}] seed {seed} accepted (attempt {attempt + 1}); near tie {tie}, f32 gap {gap:.3e}")

    model.generation_config = GenerationConfig(eos_token_id=[special["<|im_end|>"], pad_id], pad_token_id=pad_id,
                                               do_sample=False)
    model.save_pretrained(model_dir, safe_serialization=True)
    mt.copy_tokenizer(model_dir)
    names = sorted(mt.load_file(model_dir / "model.safetensors").keys())
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names, names[:20]
    assert not any(n.endswith("gate_up_proj") for n in names), "the experts were saved fused"
    assert all(n.startswith("model.") or n == "lm_head.weight" for n in names), names
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe_text", cfg["model_type"]

    loaded = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    loaded.config._experts_implementation = "eager"
    assert type(loaded) is transformers.Qwen3_5MoeForCausalLM, type(loaded)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), f"{n1} does not round-trip"
    t32 = prompt_forward(loaded, loaded.config, ids)
    assert torch.equal(t32["logits"], t["logits"]), "the checkpoint does not round-trip"
    gen32, step32 = mt.greedy(loaded, ids, pad_id)
    assert torch.equal(gen32, gen)
    calls = dict(mt.KERNEL_CALLS)
    assert calls["torch_chunk_gated_delta_rule"] > 0, calls

    loaded64 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                attn_implementation="eager").eval().double()
    loaded64.config._experts_implementation = "eager"
    with mt.true_float64():
        t64 = prompt_forward(loaded64, loaded64.config, ids)
        gen64, _ = mt.greedy(loaded64, ids, pad_id)
    dtypes = {str(v.dtype) for k, v in t64.items() if v.is_floating_point()}
    assert dtypes == {"torch.float64"}, dtypes
    assert torch.equal(gen64, gen32), "f32 and f64 greedy continuations differ"
    for i in range(config.num_hidden_layers):
        key = f"layers.{i}.mlp.experts_chosen"
        assert torch.equal(t32[key], t64[key]), f"{key}: f32 and f64 routing differ"
    gap64 = near_tie_gap(config, t64, tie)
    gaps32 = routing_gaps(config, t32)
    gaps32[tie["layer"], tie["token"]] = float("inf")
    logit_diff = float((t32["logits"].double() - t64["logits"]).abs().max())
    hidden_diff = max(float((t32[f"layers.{i}.output"].double() - t64[f"layers.{i}.output"]).abs().max())
                      for i in range(config.num_hidden_layers))
    mt.log(f"[{NAME}] f32 vs f64: logits {logit_diff:.2e}, layer outputs {hidden_diff:.2e}; near tie gap f32 "
           f"{gap:.3e} f64 {gap64:.3e}; smallest other routing gap {float(gaps32.min()):.2e}")
    mt.log(f"[{NAME}] generated: {gen32.tolist()}")

    T = len(ids_list)
    t32["token_ids"] = ids[0].clone()
    t32["generated"] = gen32.clone()
    t64["token_ids"] = ids[0].clone()
    t64["generated"] = gen64.clone()
    near = dict(tie, gap_f32=gap, gap_f64=gap64)
    meta = {
        "model": NAME,
        "model_dir": f"testdata/models/{NAME}",
        "prompt_text": prompt_text,
        "messages": json.dumps(PROMPT["messages"], ensure_ascii=False),
        "enable_thinking": "false",
        "chat_template_kwargs": json.dumps(kwargs),
        "add_generation_prompt": "true",
        "prompt_len": str(T),
        "num_generated": str(mt.NUM_GENERATED),
        "layer_types": json.dumps(list(config.layer_types)),
        "near_tie": json.dumps(near),
        "producer": f"scripts/make_moe_goldens.py: transformers {transformers.__version__}, torch {torch.__version__}, "
                    "Qwen3_5MoeForCausalLM, eager attention and experts, no fla",
        "batch_dim": "removed",
    }
    gdir = mt.TESTDATA / "goldens"
    outs = []
    written = (("", t32, torch.float32), (".f64", t64, torch.float64))
    for suffix, tensors, dtype in written if spec["f64_golden"] else written[:1]:
        out = gdir / f"{NAME}{suffix}.safetensors"
        g = golden_tensors(config, tensors, suffix == ".f64")
        for k, v in g.items():
            want = torch.int64 if (k in ("token_ids", "generated") or k.endswith("experts_chosen")) else dtype
            assert v.dtype == want, (k, v.dtype)
        mt.save_file({k: v.contiguous() for k, v in sorted(g.items())}, out,
                     metadata=dict(meta, dtype=str(dtype).removeprefix("torch.")))
        mt.canonicalize_safetensors_header(out)
        outs.append(out)

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                "safetensors": mt.dist_version("safetensors"), "numpy": np.__version__}
    section = {
        "generator": "scripts/make_moe_goldens.py",
        "requirements": "scripts/requirements.txt",
        "versions": versions,
        "model": f"testdata/models/{NAME}",
        "class": "Qwen3_5MoeForCausalLM",
        "seed": seed,
        "attempts": attempt + 1,
        "config": {k: v for k, v in TEXT.items()},
        "moe_init": MOE_INIT,
        "decay_centres": init_info["decay_centres"],
        "settings": {"torch_threads": 1, "attn_implementation": "eager", "experts_implementation": "eager",
                     "dtype": "float32 and float64", "generated": mt.NUM_GENERATED, "kernels": kernels},
        "prompt_len": T,
        "near_tie": near,
        "min_other_routing_gap_f32": float(gaps32.min()),
        "f32_vs_f64_logits_max_abs_diff": logit_diff,
        "f32_vs_f64_layer_outputs_max_abs_diff": hidden_diff,
        "generated": gen32.tolist(),
    }
    if not spec["f64_golden"]:
        section["f64_golden"] = "run and checked (the same experts and greedy tokens as f32), not written"
    for path in sorted(model_dir.iterdir()):
        add_golden(path, spec["section"], section)
    for out in outs:
        add_golden(out, spec["section"], section)
        print(f"wrote {out.relative_to(mt.REPO)} ({out.stat().st_size} bytes, sha256 {mt.sha256(out)})")


if __name__ == "__main__":
    main()
