#!/usr/bin/env python3
"""Goldens for positions the chat prompts never reach: text far into the context, and an image-like MRoPE grid.

Writes testdata/goldens/tiny.positions.safetensors from testdata/models/tiny (run scripts/make_testdata.py first),
with transformers in f32 eager and fla hidden exactly as make_testdata.py does:

- `offset.*`: the first 40 prompt tokens at text positions 250000.. (three equal rows): RoPE angles in f32 lose
  precision there, so the reference must use transformers' f32 convention to match.
- `image.*`: 10 text tokens, a 4x4 "image" whose temporal row stays at 10 while the height and width rows walk the
  grid (10 + r, 10 + c), then text continuing at the largest position + 1, as Qwen's get_rope_index lays them out.

Tensors per case: `positions` i64 [3, T], `token_ids` i64 [T], `logits` [T, V], `layers.{i}.output` [T, H],
`final_norm` [T, H].

The file's own metadata records only the model, the producer, the cases and T; the versions it ran with go to
testdata/manifest.json with the file's size and sha256 (its entry in `files` and a `position_goldens` section).
make_testdata.py rewrites the manifest without them (it deletes testdata/goldens/ too), so run this script after it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_testdata as mt  # noqa: E402  (hides fla before transformers is imported)
from testdata_files import add_golden  # noqa: E402

import platform  # noqa: E402

import numpy as np  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

T = 40


def positions_offset() -> torch.Tensor:
    row = torch.arange(250000, 250000 + T, dtype=torch.int64)
    return torch.stack([row, row, row])


def positions_image() -> torch.Tensor:
    t, h, w = [], [], []
    for i in range(10):
        t.append(i), h.append(i), w.append(i)
    for r in range(4):
        for c in range(4):
            t.append(10), h.append(10 + r), w.append(10 + c)
    nxt = max(max(t), max(h), max(w)) + 1
    for i in range(T - 26):
        t.append(nxt + i), h.append(nxt + i), w.append(nxt + i)
    return torch.tensor([t, h, w], dtype=torch.int64)


@torch.no_grad()
def run(model, config, ids: torch.Tensor, pos: torch.Tensor) -> dict:
    with mt.Recorder(model, config) as rec:
        rec.active = True
        out = model(input_ids=ids[None], position_ids=pos[:, None, :], use_cache=False)
        rec.active = False
    keep = {k: v for k, v in rec.t.items() if k.endswith(".output") or k == "final_norm"}
    keep = {k: v for k, v in keep.items() if k.startswith("layers.") or k == "final_norm"}
    keep["logits"] = out.logits[0].clone()
    keep["positions"] = pos.clone()
    keep["token_ids"] = ids.clone()
    return keep


def main() -> None:
    mt.set_determinism()
    root = Path(__file__).resolve().parent.parent
    model_dir = root / "testdata" / "models" / "tiny"
    golden = load_file(str(root / "testdata" / "goldens" / "tiny.safetensors"))
    ids = golden["token_ids"][:T].clone()
    model = mt.load_checkpoint({"format": "text"}, model_dir)
    config = model.config
    tensors = {}
    for case, pos in (("offset", positions_offset()), ("image", positions_image())):
        for k, v in run(model, config, ids, pos).items():
            tensors[f"{case}.{k}"] = v.contiguous()
    out = root / "testdata" / "goldens" / "tiny.positions.safetensors"
    mt.save_file(tensors, out, metadata={"model": "tiny", "producer": "scripts/make_position_goldens.py",
                                         "cases": "offset, image", "tokens": str(T)})
    mt.canonicalize_safetensors_header(out)
    add_golden(out, "position_goldens", {
        "generator": "scripts/make_position_goldens.py",
        "requirements": "scripts/requirements.txt",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": mt.dist_version("safetensors"),
            "numpy": np.__version__,
        },
        "model": "testdata/models/tiny",
        "token_ids": f"the first {T} of goldens/tiny.safetensors `token_ids`",
        "settings": {"torch_threads": 1, "attn_implementation": "eager", "dtype": "float32", "use_cache": False},
        "cases": {
            "offset": "text positions 250000.. (three equal rows)",
            "image": "10 text tokens, a 4x4 grid at t=10, h=10+r, w=10+c, then text from the largest position + 1",
        },
    })
    print(f"wrote {out.relative_to(root)} ({out.stat().st_size} bytes, sha256 {mt.sha256(out)})")


if __name__ == "__main__":
    main()
