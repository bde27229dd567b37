"""A safetensors writer whose header is byte-stable: the `safetensors` package serializes `__metadata__` from a hash
map, so two runs order its keys differently. `save_sorted` writes the same file with every JSON key sorted."""

from __future__ import annotations

import json
import pathlib
import struct

import numpy as np
from safetensors.numpy import save


def save_sorted(tensors: dict[str, np.ndarray], path: pathlib.Path | str, metadata: dict[str, str]) -> None:
    raw = save(tensors, metadata=metadata)
    (n,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8:8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * ((-len(text)) % 8)
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
