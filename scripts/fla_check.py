#!/usr/bin/env python3
"""Golden for the gated delta rule from flash-linear-attention's naive (pure PyTorch) kernels.

Run by scripts/make_testdata.py in a child process: this is the only process that imports `fla` (in the
transformers process `fla` is hidden, so that transformers keeps its own torch kernels).

Writes testdata/goldens/fla.safetensors (f32):
  inputs  q, k [1,T,H,K] (already l2-normalised), v [1,T,H,V], g [1,T,H] (log-decays), beta [1,T,H],
          initial_state [1,H,K,V]          -- fla's layout, batch dim kept (size 1)
  outputs recurrent.o [1,T,H,V], recurrent.state [1,H,K,V]  (naive_recurrent_gated_delta_rule)
          chunk.o [1,T,H,V], chunk.state [1,H,K,V]          (naive_chunk_gated_delta_rule, chunk_size 16)
The last stdout line is `FLA_REPORT {json}`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path

import torch

from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule
from safetensors.torch import save_file

T, H, K, V = 100, 3, 16, 24
CHUNK_SIZE = 16
SCALE = K**-0.5  # passed explicitly to both kernels


def make_inputs(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    def rand(*shape):
        return torch.rand(shape, generator=gen, dtype=torch.float64)

    q = randn(1, T, H, K)
    k = randn(1, T, H, K)
    # make q and k share a common direction per head so the keys are correlated (as in real models)
    k = k + 1.5 * randn(1, 1, H, K)
    q = q / q.norm(dim=-1, keepdim=True)
    k = k / k.norm(dim=-1, keepdim=True)
    v = randn(1, T, H, V)
    g = torch.empty(1, T, H, dtype=torch.float64)
    g[..., 0] = -0.05 * rand(1, T)  # slow head: decays 0.95 .. 1
    g[..., 0][:, ::10] = 0.0  # ... with some exact zeros (no decay)
    g[..., 1] = -8.0 * rand(1, T)  # 0 .. -8 per token
    g[..., 2] = -6.7 + 0.6 * (rand(1, T) - 0.5)  # around -6.7, where exp(G_t - G_j) above the diagonal overflows f32
    beta = 0.02 + 0.96 * rand(1, T, H)
    h0 = 0.5 * randn(1, H, K, V)
    x = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    return {name: t.to(torch.float32).contiguous() for name, t in x.items()}


def reference_f64(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain token-by-token recurrence in f64 (SPEC step 6), for the report only."""
    q, k, v, g, beta = (x[n][0].double() for n in ("q", "k", "v", "g", "beta"))
    S = x["initial_state"][0].double().clone()  # [H, K, V]
    o = torch.zeros(T, H, V, dtype=torch.float64)
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        kv = torch.einsum("hk,hkv->hv", k[t], S)
        delta = beta[t][:, None] * (v[t] - kv)
        S = S + k[t][:, :, None] * delta[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t] * SCALE, S)
    return o[None], S[None]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", required=True, type=int)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    x = make_inputs(args.seed)
    # Keyword arguments only: the two functions take (beta, g) and (g, beta) in different positional orders.
    rec_o, rec_s = naive_recurrent_gated_delta_rule(
        q=x["q"], k=x["k"], v=x["v"], beta=x["beta"], g=x["g"], scale=SCALE,
        initial_state=x["initial_state"], output_final_state=True,
    )
    chk_o, chk_s = naive_chunk_gated_delta_rule(
        q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], chunk_size=CHUNK_SIZE, scale=SCALE,
        initial_state=x["initial_state"], output_final_state=True,
    )
    outs = {"recurrent.o": rec_o, "recurrent.state": rec_s, "chunk.o": chk_o, "chunk.state": chk_s}
    for name, t in outs.items():
        assert t.dtype == torch.float32 and torch.isfinite(t).all(), name
    ref_o, ref_s = reference_f64(x)

    report = {
        "fla_version": importlib.metadata.version("fla-core"),
        "shape": {"T": T, "H": H, "K": K, "V": V},
        "chunk_size": CHUNK_SIZE,
        "scale": SCALE,
        "g_range": [x["g"].min().item(), x["g"].max().item()],
        "recurrent_vs_chunk_o_max_abs": (rec_o - chk_o).abs().max().item(),
        "recurrent_vs_chunk_state_max_abs": (rec_s - chk_s).abs().max().item(),
        "recurrent_vs_f64_o_max_abs": (rec_o.double() - ref_o).abs().max().item(),
        "chunk_vs_f64_o_max_abs": (chk_o.double() - ref_o).abs().max().item(),
        "recurrent_vs_f64_state_max_abs": (rec_s.double() - ref_s).abs().max().item(),
        "chunk_vs_f64_state_max_abs": (chk_s.double() - ref_s).abs().max().item(),
    }
    for key in ("recurrent_vs_chunk_o_max_abs", "recurrent_vs_f64_o_max_abs", "chunk_vs_f64_o_max_abs"):
        assert report[key] < 1e-3, (key, report[key])

    metadata = {
        "producer": f"fla-core {report['fla_version']} fla.ops.gated_delta_rule.naive, torch {torch.__version__}",
        "seed": str(args.seed),
        "dtype": "float32",
        "batch_dim": "kept (size 1)",
        "layout": "q,k [1,T,H,K]; v [1,T,H,V]; g,beta [1,T,H]; initial_state [1,H,K,V]; *.o [1,T,H,V]; "
        "*.state [1,H,K,V]",
        "T": str(T),
        "H": str(H),
        "K": str(K),
        "V": str(V),
        "scale": repr(SCALE),
        "chunk_size": str(CHUNK_SIZE),
        "q_k": "already l2-normalised per head (x / ||x||); the kernels do no l2norm and no head repeat",
        "g": "log-decay per token (<= 0); head 0 in [-0.05, 0] with exact zeros every 10th token, head 1 in "
        "[-8, 0], head 2 in [-7.0, -6.4]",
        "recurrent_call": "naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale, initial_state, "
        "output_final_state=True)",
        "chunk_call": "naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, scale, initial_state, "
        "output_final_state=True)",
    }
    tensors = dict(x)
    tensors.update(outs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, args.out, metadata=metadata)
    for key, val in report.items():
        print(f"[fla] {key}: {val}")
    print("FLA_REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
