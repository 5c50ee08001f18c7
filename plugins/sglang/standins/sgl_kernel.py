"""CPU stand-in for ``sgl_kernel`` (SGLang's compiled kernels), for tests and development on a CPU without AMX.

Off unless asked for: ``scripts/setup_sglang.sh`` puts this folder on the SGLang venv's path only when no real
``sgl_kernel`` is installed. SGLang 0.5.23 imports ``sgl_kernel`` at module load when it runs on CPU
(``SGLANG_USE_CPU_ENGINE=1``); without AMX (``cpu_has_amx_support()`` False) its layers take their pure-torch
``forward_native`` paths, so only two functions are called: :func:`assign_req_to_token_pool_cpu` on the allocation
path and :func:`copy_all_layer_kv_cache_cpu` (page moves). Every other name imports, and raises
``NotImplementedError`` naming itself when called, so an unexpected use is visible.
"""
from __future__ import annotations

from typing import Any


def assign_req_to_token_pool_cpu(req_pool_indices: Any, req_to_token: Any, start_offset: Any, end_offset: Any,
                                 out_cache_loc: Any, pool_len: int) -> None:
    """For request ``i``: ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` = its next ``end[i] - start[i]``
    entries of ``out_cache_loc`` (token slots, concatenated over the batch in order). ``pool_len`` is unused."""
    off = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = int(e) - int(s)
        req_to_token[r, s:e] = out_cache_loc[off:off + n].to(req_to_token.dtype)
        off += n


def copy_all_layer_kv_cache_cpu(data_ptrs: Any, strides: Any, tgt_loc: Any, src_loc: Any) -> None:
    """For every buffer ``i`` (host address ``data_ptrs[i]``, row of ``strides[i]`` bytes) copy row ``src_loc[j]``
    to row ``tgt_loc[j]`` (host memory only)."""
    import ctypes

    tgt, src = tgt_loc.tolist(), src_loc.tolist()
    for base, row in zip(data_ptrs.tolist(), strides.tolist()):
        for t, s in zip(tgt, src):
            ctypes.memmove(int(base) + int(t) * int(row), int(base) + int(s) * int(row), int(row))


def _missing(name: str):
    def f(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel CPU stand-in: {name} is not provided (only the pure-torch paths "
                                  "of a CPU without AMX are supported)")

    f.__name__ = name
    return f


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    f = _missing(name)
    globals()[name] = f
    return f
