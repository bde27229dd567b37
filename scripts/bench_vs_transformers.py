#!/usr/bin/env python3
"""Time Hugging Face transformers and the reference (`qwen35 bench`) on the same checkpoint and prompt, alternately.

Each run is a fresh process with the same thread count (RAYON_NUM_THREADS for the reference; OMP/MKL/OpenBLAS and
torch.set_num_threads for transformers). The prompt's token ids are the ones the first `qwen35 bench` run drew, so
both engines see the same tokens; both then decode the same number of greedy tokens with their caches. Prints every
run, the medians per engine and the ratios reference / transformers (above 1: the reference is faster, except for
load time and memory, where above 1 means the reference takes more).

transformers runs `Qwen3_5ForCausalLM` (an MoE checkpoint: `Qwen3_5MoeForCausalLM`, its experts eager, a loop over
the experts the tokens chose) in f32 with eager attention, loading the decoder's weights from the checkpoint (a full
checkpoint's `model.language_model.` names mapped to `model.`; vision and MTP tensors left out; experts stored one by
one stacked into the fused tensors transformers holds), with `flash-linear-attention` hidden from the process so that
its own torch kernels run (`torch_chunk_gated_delta_rule` for the prompt, `torch_recurrent_gated_delta_rule` for
decode steps).

    scripts/.venv/bin/python scripts/bench_vs_transformers.py --model DIR --threads 2 --runs 3 \
        --prompt-tokens 439 --decode-tokens 4
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HIDDEN = ("fla", "kernels", "causal_conv1d")


def hide_kernel_packages() -> None:
    """Makes the HIDDEN packages look absent (a `None` entry in sys.modules: `import` fails and
    importlib.util.find_spec returns None), so transformers falls back to its torch kernels."""
    for name in HIDDEN:
        sys.modules[name] = None


def proc_status() -> dict:
    """VmHWM, VmRSS and RssAnon of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
    return out


class AnonSampler:
    """The largest RssAnon seen, sampled every 10 ms on a background thread (the kernel keeps no peak of it)."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            time.sleep(0.01)

    def sample(self):
        self.peak = max(self.peak, proc_status().get("RssAnon", 0))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peak


EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(state: dict, experts: dict, torch) -> None:
    """Stacks experts stored one by one ({prefix: {e: {proj: tensor}}}) into the tensors transformers holds:
    `{prefix}.gate_up_proj` [E, 2·Im, H] (each expert's gate rows, then its up rows) and `{prefix}.down_proj`
    [E, H, Im]."""
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        if order != list(range(len(order))):
            raise SystemExit(f"{prefix}: experts {order} are not 0..E-1")
        state[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in order])
        state[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in order])


def is_moe(config_json: dict) -> bool:
    text = config_json.get("text_config", config_json)
    return config_json.get("model_type") == "qwen3_5_moe" or text.get("model_type") == "qwen3_5_moe_text"


def worker(args) -> None:
    """One transformers run (in its own process): load, prompt, greedy decode; writes a JSON like qwen35 bench's."""
    hide_kernel_packages()
    sampler = AnonSampler()
    import torch
    import transformers
    from safetensors import safe_open
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    torch.set_num_threads(args.threads)
    start = time.perf_counter()  # after the imports: load time is reading the config and the weights
    model_dir = Path(args.model)
    config_json = json.loads((model_dir / "config.json").read_text())
    moe = is_moe(config_json)
    text = config_json.get("text_config", config_json)
    text = {k: v for k, v in text.items() if k not in ("model_type", "dtype")}
    if moe:
        modeling, config = modeling_qwen3_5_moe, transformers.Qwen3_5MoeTextConfig(**text)
        causal_lm, rotary = modeling.Qwen3_5MoeForCausalLM, modeling.Qwen3_5MoeTextRotaryEmbedding
        config._experts_implementation = args.experts
    else:
        modeling, config = modeling_qwen3_5, transformers.Qwen3_5TextConfig(**text)
        causal_lm, rotary = modeling.Qwen3_5ForCausalLM, modeling.Qwen3_5TextRotaryEmbedding
    config._attn_implementation = "eager"

    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
    else:
        weight_map = {None: "model.safetensors"}
    files = sorted(set(weight_map.values()))
    with torch.device("meta"):
        model = causal_lm(config)
    state, experts = {}, {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():
                if key.startswith("model.language_model."):
                    target = "model." + key[len("model.language_model.") :]
                elif key.startswith("model.") and not key.startswith("model.visual."):
                    target = key
                elif key == "lm_head.weight":
                    target = key
                else:
                    continue  # vision tower, MTP head
                tensor = f.get_tensor(key).to(torch.float32)
                one = EXPERT.match(target)
                if one:
                    experts.setdefault(one[1], {}).setdefault(int(one[2]), {})[one[3]] = tensor
                else:
                    state[target] = tensor
    fuse_experts(state, experts, torch)
    del experts
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or missing:
        raise SystemExit(f"{model_dir}: tensors missing {missing[:5]}, unexpected {unexpected[:5]}")
    del state
    # Buffers that are not in the checkpoint (the rotary frequencies) were created on the meta device: rebuild them.
    model.model.rotary_emb = rotary(config=config)
    model.eval()
    for name, buf in model.named_buffers():
        if buf.is_meta:
            raise SystemExit(f"buffer {name} is still on the meta device")
    for name, param in model.named_parameters():
        if param.is_meta:
            raise SystemExit(f"parameter {name} was not loaded")
    for name in HIDDEN:
        if importlib.util.find_spec(name) is not None:
            raise SystemExit(f"{name} is visible: transformers could use its kernels")
    load_seconds = time.perf_counter() - start
    sampler.sample()

    ids = json.loads(Path(args.ids).read_text())
    input_ids = torch.tensor([ids], dtype=torch.long)
    generated = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        prompt_seconds = time.perf_counter() - t0
        generated.append(int(out.logits[0, -1].argmax()))
        cache = out.past_key_values
        t0 = time.perf_counter()
        for _ in range(args.decode_tokens):
            out = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            generated.append(int(out.logits[0, -1].argmax()))
        decode_seconds = time.perf_counter() - t0
    peak_anon = sampler.stop()
    report = {
        "engine": "transformers",
        "experts_implementation": args.experts if moe else None,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(ids),
        "decode_tokens": args.decode_tokens,
        "load_seconds": load_seconds,
        "prompt_seconds": prompt_seconds,
        "decode_seconds": decode_seconds,
        "prompt_tokens_per_s": len(ids) / prompt_seconds,
        "decode_tokens_per_s": args.decode_tokens / decode_seconds,
        "peak_rss_bytes": proc_status()["VmHWM"],
        "peak_anon_bytes": peak_anon,
        "generated_ids": generated,
    }
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


def thread_env(threads: int) -> dict:
    env = dict(os.environ)
    for key in ("RAYON_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[key] = str(threads)
    return env


def warm_page_cache(model: Path) -> float:
    """Reads every safetensors file of the checkpoint once (16 MB at a time), so that the reference, which maps the
    checkpoint and reads its pages on first use, starts from the page cache as transformers starts from the weights
    its load read; returns the seconds it took."""
    start = time.perf_counter()
    for path in sorted(model.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
    return time.perf_counter() - start


def run_reference(args, out: Path, machine: bool) -> dict:
    warm = warm_page_cache(args.model) if args.warm_cache else None
    cmd = [
        str(args.qwen35), "bench", "--model", str(args.model),
        "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens),
        "--seed", str(args.seed), "--json", str(out),
    ]
    if args.weights:
        cmd += ["--weights", args.weights]
    if not machine:
        cmd.append("--no-machine")
    result = subprocess.run(cmd, env=thread_env(args.threads), capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"qwen35 bench failed ({result.returncode}):\n{result.stderr}")
    if machine:
        sys.stdout.write(result.stdout)
    report = json.loads(out.read_text())
    report["warm_seconds"] = warm
    return report


def run_transformers(args, ids_file: Path, out: Path) -> dict:
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(args.model),
        "--ids", str(ids_file), "--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads),
        "--experts", args.experts, "--json", str(out),
    ]
    result = subprocess.run(cmd, env=thread_env(args.threads), capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"transformers run failed ({result.returncode}):\n{result.stderr}")
    return json.loads(out.read_text())


KEYS = [
    ("load_seconds", "load s", "{:.2f}"),
    ("prompt_tokens_per_s", "prompt tok/s", "{:.2f}"),
    ("decode_tokens_per_s", "decode tok/s", "{:.3f}"),
    ("peak_rss_bytes", "peak RSS GB", "{:.2f}"),
    ("peak_anon_bytes", "peak anon GB", "{:.2f}"),
]


def shown(key: str, value: float) -> float:
    return value / 1e9 if key.endswith("_bytes") else value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, type=Path, help="checkpoint directory (e.g. from `qwen35 synth`)")
    p.add_argument("--qwen35", type=Path, default=ROOT / "target" / "release" / "qwen35", help="the qwen35 binary")
    p.add_argument("--threads", type=int, default=2, help="threads for both engines")
    p.add_argument("--runs", type=int, default=3, help="runs of each engine, alternating")
    p.add_argument("--prompt-tokens", type=int, default=439)
    p.add_argument("--decode-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt's token ids (qwen35 bench --seed)")
    p.add_argument("--json", type=Path, help="write every run and the medians to this file")
    p.add_argument("--warm-cache", action="store_true",
                   help="read the checkpoint's files before each reference run (untimed by qwen35 bench), so that its "
                        "prompt is not timed reading the disk where the transformers run before it pushed the "
                        "checkpoint out of the page cache")
    p.add_argument("--weights", help="the reference's weight format (qwen35 bench --weights; default: as stored)")
    p.add_argument("--experts", default="eager",
                   help="an MoE checkpoint's experts implementation in transformers (eager: a loop over the chosen "
                        "experts; grouped_mm or batched_mm, transformers' batched forms)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ids", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    for flag, value in (("--threads", args.threads), ("--runs", args.runs), ("--prompt-tokens", args.prompt_tokens),
                        ("--decode-tokens", args.decode_tokens)):
        if value < 1:
            p.error(f"{flag} must be at least 1")
    if not (args.model / "config.json").exists():
        p.error(f"--model {args.model}: no config.json there")
    if not args.qwen35.exists():
        p.error(f"--qwen35 {args.qwen35}: not found (cargo build --release -p parity)")

    runs = {"reference": [], "transformers": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ids_file = tmp / "ids.json"
        for i in range(args.runs):
            order = ["reference", "transformers"] if i % 2 == 0 else ["transformers", "reference"]
            for engine in order:
                out = tmp / f"{engine}-{i}.json"
                if engine == "reference":
                    r = run_reference(args, out, machine=(i == 0))
                    if i == 0:
                        ids_file.write_text(json.dumps(r["prompt_ids"]))
                else:
                    r = run_transformers(args, ids_file, out)
                runs[engine].append(r)
                warm = f" (page cache warmed in {r['warm_seconds']:.1f} s)" if r.get("warm_seconds") else ""
                print(f"run {i + 1} {engine:>12}: " + ", ".join(
                    f"{label} " + fmt.format(shown(k, r[k])) for k, label, fmt in KEYS) + warm, flush=True)

    ref0, hf0 = runs["reference"][0], runs["transformers"][0]
    print(f"\n{args.model}: {args.prompt_tokens} prompt tokens, {args.decode_tokens} decode tokens, "
          f"{args.threads} threads, {args.runs} alternating runs each; transformers {hf0['versions']['transformers']}, "
          f"torch {hf0['versions']['torch']} (f32, eager attention"
          + (f", {hf0['experts_implementation']} experts" if hf0.get("experts_implementation") else "")
          + f"); reference {ref0['record']['dtype']}, weights {ref0['record']['weights']}, "
          f"{ref0['record']['deltanet_prefill']} / {ref0['record']['deltanet_decode']}")
    if ref0.get("machine"):
        m = ref0["machine"]
        print(f"machine: f32 GEMM {m['gemm_gflops_per_s']:.1f} GFLOP/s (candle, {m['gemm_size']}^3), "
              f"read {m['read_gb_per_s']:.1f} GB/s, copy {m['copy_gb_per_s']:.1f} GB/s (read + write)")
    medians = {}
    print(f"{'median':<14}{'reference':>12}{'transformers':>14}{'ratio ref/hf':>14}")
    for key, label, fmt in KEYS:
        a = statistics.median(r[key] for r in runs["reference"])
        b = statistics.median(r[key] for r in runs["transformers"])
        medians[key] = {"reference": a, "transformers": b, "ratio": a / b}
        print(f"{label:<14}{fmt.format(shown(key, a)):>12}{fmt.format(shown(key, b)):>14}{a / b:>14.2f}")
    m = ref0.get("machine")
    if m:
        gflops = statistics.median(r["prompt_gflops_per_s"] for r in runs["reference"])
        print(f"reference prompt: {gflops:.1f} GFLOP/s = {100 * gflops / m['gemm_gflops_per_s']:.0f}% of the "
              f"machine's GEMM rate")
        weights = ref0.get("decode_weight_bytes_per_token")
        if weights:
            step = 1 / medians["decode_tokens_per_s"]["reference"]
            read = weights / (m["read_gb_per_s"] * 1e9)
            print(f"reference decode step: {1e3 * step:.1f} ms = {step / read:.2f}x the time to read its "
                  f"{weights / 1e9:.2f} GB of weights once ({1e3 * read:.1f} ms at {m['read_gb_per_s']:.1f} GB/s)")
    same = [r["generated_ids"] == h["generated_ids"] for r, h in zip(runs["reference"], runs["transformers"])]
    print(f"greedy tokens identical in {sum(same)}/{len(same)} run pairs "
          f"(reference {ref0['generated_ids']}, transformers {hf0['generated_ids']})")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "medians": medians}, indent=2) + "\n")


if __name__ == "__main__":
    main()
