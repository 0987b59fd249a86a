"""A model's fingerprint: what archived KV blocks are tied to, so another model's are never reused.

sha256 over config.json and, for each weight file, its size, its safetensors header (tensor names,
shapes, dtypes, offsets) and 64 evenly spaced 4 KiB samples of its bytes. Reading every byte of a
multi-GB checkpoint at each start would cost seconds; the samples tell fine-tunes of one
architecture apart (their headers are identical), at about 256 KiB read per file.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

SAMPLES = 64
SAMPLE_BYTES = 4096


def model_fingerprint(model_dir: str | Path) -> str:
    path = Path(model_dir)
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        h.update(weights.name.encode() + struct.pack("<Q", size))
        with open(weights, "rb") as f:
            header_len = struct.unpack("<Q", f.read(8))[0]
            h.update(f.read(min(header_len, size)))
            for i in range(SAMPLES):
                f.seek(i * max(size - SAMPLE_BYTES, 0) // max(SAMPLES - 1, 1), os.SEEK_SET)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:32]
