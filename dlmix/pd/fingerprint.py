"""Weights identity of a model folder (engine-free, torch-free): the ``weights_fingerprint`` every engine adapter
states in its :class:`~dlmix.kv.layout.ModelIdentity`, so a prefill and a decode loaded from different weights are
refused by the pair check (:func:`dlmix.pd.pair.check_pair`) instead of decoding from someone else's KV.

One function for every engine: two sides loaded from the same folder (or copies of it) compute the same string.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

__all__ = ["weights_fingerprint"]


def weights_fingerprint(model: str | Path, sample_bytes: int = 64 * 1024, samples_per_file: int = 32) -> str:
    """Identity of a model's weights: ``"sha256:<32 hex>"`` over ``config.json`` (canonical JSON, so key order and
    whitespace do not matter) and, for every ``*.safetensors`` file in name order, its name, size, header (tensor
    names, dtypes, shapes, offsets) and ``samples_per_file`` evenly spaced windows of ``sample_bytes`` of its data
    section. Cost: ~2 MiB read per file whatever its size. The safetensors header format (8-byte little-endian
    header length, JSON header, data) is the one documented by huggingface/safetensors.

    ``model`` that is not a local folder (a hub id) yields ``"name:<model>"``: only names can be compared then.
    Limitation: a change confined to bytes outside the sampled windows is not seen (a perturbation of all
    weights, another checkpoint or another dtype is). Raises OSError when a file cannot be read and ValueError
    when a ``*.safetensors`` file is shorter than its stated header.
    """
    p = Path(model)
    if not p.is_dir():
        return f"name:{model}"
    h = hashlib.sha256()
    cfg = p / "config.json"
    if cfg.exists():
        try:
            h.update(json.dumps(json.loads(cfg.read_text()), sort_keys=True).encode())
        except ValueError:
            h.update(cfg.read_bytes())
    for f in sorted(p.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + struct.pack("<Q", size))
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise ValueError(f"{f} is not a safetensors file: {size} bytes, no header length")
            (hlen,) = struct.unpack("<Q", head)
            if 8 + hlen > size:
                raise ValueError(f"{f} is not a safetensors file: header of {hlen} bytes in a {size}-byte file")
            h.update(fh.read(hlen))
            data0 = 8 + hlen
            span = max(0, size - data0 - sample_bytes)
            for i in range(samples_per_file):
                fh.seek(data0 + (span * i) // max(1, samples_per_file - 1))
                h.update(fh.read(sample_bytes))
    return "sha256:" + h.hexdigest()[:32]
