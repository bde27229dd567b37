#!/usr/bin/env python3
"""Time transformers' vision tower and ours (`qwen35 bench --image-grid`) on the same checkpoint, alternately.

One image of H x W patches with seeded pixels in [-1, 1]: transformers' `Qwen3_5ForConditionalGeneration`'s
`model.visual` in f32 with eager attention (loaded once, then timed `--runs` times per round), and in fresh processes
the reference's tower and the static vision graph on OpenVINO's CPU device. Every round times all three; prints each
median and the ratios transformers / ours (above 1: ours is faster).

    scripts/.venv/bin/python scripts/bench_vision_vs_transformers.py --model DIR --grid 32x32 --rounds 2 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ours(binary: Path, model: str, grid: str, runs: int, device: str | None, env: dict) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "b.json"
        cmd = [str(binary), "bench", "--model", model, "--image-grid", grid, "--image-runs", str(runs),
               "--json", str(out)]
        if device:
            cmd += ["--backend", "openvino", "--device", device]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["median_seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--grid", default="32x32")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--binary", default=str(ROOT / "target/release/qwen35"))
    args = ap.parse_args()
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))

    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    torch.set_num_threads(args.threads)
    h, w = (int(x) for x in args.grid.split("x"))
    start = time.time()
    model = Qwen3_5ForConditionalGeneration.from_pretrained(args.model, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    print(f"transformers: loaded in {time.time() - start:.1f} s")
    visual = model.model.visual
    dim = visual.config.in_channels * visual.config.temporal_patch_size * visual.config.patch_size ** 2
    x = torch.rand(h * w, dim, generator=torch.Generator().manual_seed(0)) * 2 - 1
    thw = torch.tensor([[1, h, w]])

    times = {"transformers": [], "reference": [], "CPU graph": []}
    for r in range(args.rounds):
        with torch.no_grad():
            visual(x, grid_thw=thw)  # warm-up
            t = []
            for _ in range(args.runs):
                s = time.time()
                visual(x, grid_thw=thw)
                t.append(time.time() - s)
        times["transformers"].append(statistics.median(t))
        times["reference"].append(ours(Path(args.binary), args.model, args.grid, args.runs, None, env))
        times["CPU graph"].append(ours(Path(args.binary), args.model, args.grid, args.runs, "CPU", env))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"one image of {args.grid} patches, {args.threads} threads, medians over {args.rounds} rounds:")
    for k, v in med.items():
        ratio = "" if k == "transformers" else f"  ({med['transformers'] / v:.2f}x transformers)"
        print(f"  {k}: {v:.2f} s{ratio}")


if __name__ == "__main__":
    main()
