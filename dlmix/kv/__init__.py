"""KV cache layouts and conversion.

The layout descriptor and the compatibility check (:mod:`dlmix.kv.layout`) and the registry of memory arrangements
(:mod:`dlmix.kv.registry`, one file per arrangement in :mod:`dlmix.kv.arrangements`, third-party ones through the
``dlmix.kv_arrangements`` entry-point group) are torch-free and imported eagerly. The tensor functions
(:mod:`dlmix.kv.ops`: ``convert``, ``convert_from_ranks``, ``pack``, ``unpack``, ``read_kv``, ...) need torch
(``pip install dlmix[torch]``) and are imported on first attribute access. See ``docs/kv_layouts.md``.
"""

from __future__ import annotations

from typing import Any

from .layout import ARRANGEMENTS, DTYPES, Compat, KVLayout, ModelIdentity, check_compat, heads_for_rank, wire_bytes

_TORCH_NAMES = {
    "allocate", "cast_plane", "convert", "convert_from_ranks", "pack", "plan_heads", "plane_views", "read_kv",
    "torch_dtype", "unpack", "wire_chunks", "write_kv",
}

__all__ = ["ARRANGEMENTS", "DTYPES", "Compat", "KVLayout", "ModelIdentity", "check_compat", "heads_for_rank",
           "wire_bytes", *sorted(_TORCH_NAMES)]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        import importlib

        _ops = importlib.import_module("dlmix.kv.ops")

        return getattr(_ops, name)
    raise AttributeError(f"module 'dlmix.kv' has no attribute {name!r}")
