"""Tensor side of a :class:`~dlmix.kv.layout.KVLayout`: torch dtypes, allocation, per-plane views, raw blocks.

Every arrangement (:mod:`dlmix.kv.arrangements`) exposes per plane a strided view ``[num_blocks, N, H, D]`` of the
engine tensor; the conversion paths only ever see those views (and, for identical layouts, the raw blocks).
fp8 caches may be given as the torch fp8 dtype or as ``uint8`` storage; they are moved as ``uint8``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .layout import KVLayout

_TORCH_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype of ``layout.dtype`` (``fp8_e4m3`` -> ``torch.float8_e4m3fn``)."""
    return _TORCH_DTYPES[layout.dtype]


def _storage_dtype(layout: KVLayout) -> torch.dtype:
    return torch.uint8 if layout.is_fp8 else torch_dtype(layout)


def allocate(layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu",
             fill: float | None = 0.0, storage_uint8: bool = False, one_buffer: bool = False) -> list[Any]:
    """Allocate per-layer caches of ``num_blocks`` blocks shaped as the engine would (:meth:`KVLayout.layer_shape`).

    ``fill`` sets every element (``None`` leaves memory uninitialized). ``storage_uint8`` stores fp8 as ``uint8``
    like vLLM. ``one_buffer``: every layer's tensors are views of one buffer (``[L, ...]``, or ``[L, 2, ...]`` for
    separate K/V), as vLLM's workers view one raw allocation per KV cache group. Returns a list of ``L`` tensors or
    ``(K, V)`` tuples. Used by tests and benchmarks.
    """
    dt = torch_dtype(layout)
    L = layout.model.num_layers

    def one(shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.empty(shape, dtype=dt, device=device)
        if fill is not None:
            if layout.is_fp8:
                t.copy_(torch.full(shape, float(fill), dtype=torch.float32, device=device).to(dt))
            else:
                t.fill_(fill)
        return t.view(torch.uint8) if (storage_uint8 and layout.is_fp8) else t

    shape = layout.layer_shape(num_blocks)
    for part in (shape if layout.separate_kv else (shape,)):
        if not all(isinstance(d, int) and not isinstance(d, bool) and (d > 0 or (d == 0 and num_blocks == 0))
                   for d in part):
            raise ValueError(f"arrangement {layout.arrangement!r}: layer_shape must be positive integers, got "
                             f"{list(part)} for {num_blocks} blocks")
    if one_buffer:
        if layout.separate_kv:
            big = one((L, 2, *shape[0]))  # type: ignore[misc]
            return [(big[i, 0], big[i, 1]) for i in range(L)]
        big = one((L, *shape))  # type: ignore[misc]
        return [big[i] for i in range(L)]
    out: list[Any] = []
    for _ in range(L):
        out.append((one(shape[0]), one(shape[1])) if layout.separate_kv else one(shape))  # type: ignore[arg-type]
    return out


def _check_tensor(layout: KVLayout, t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    dt = torch_dtype(layout)
    ok = t.dtype == dt or (layout.is_fp8 and t.dtype in (torch.uint8, torch.int8))
    if not ok:
        raise ValueError(f"{what} has dtype {t.dtype}, layout says {layout.dtype}")
    # fp8 is moved as uint8: index_select/index_copy_ have no fp8 kernels on CPU
    return t.view(torch.uint8) if layout.is_fp8 else t


def _checked(layout: KVLayout, layer_cache: Any) -> Any:
    """``layer_cache`` with its dtype checked (fp8 reinterpreted as ``uint8``): one tensor, or a ``(K, V)`` tuple
    for separate-K/V arrangements. Raises ValueError on the wrong type, structure or dtype."""
    if layout.separate_kv:
        if not (isinstance(layer_cache, (tuple, list)) and len(layer_cache) == 2):
            raise ValueError(f"arrangement {layout.arrangement} needs a (K, V) tuple per layer")
        return (_check_tensor(layout, layer_cache[0], "K cache"), _check_tensor(layout, layer_cache[1], "V cache"))
    return _check_tensor(layout, layer_cache, "layer cache")


def plane_views(layout: KVLayout, layer_cache: Any) -> tuple[torch.Tensor, ...]:
    """Strided views ``[num_blocks, N, H, D]`` (token-in-block, local head, element) of one layer's cache.

    Returns ``(K, V)`` for MHA/GQA and ``(latent,)`` for MLA (``H = 1``), as the layout's registered arrangement
    (:meth:`dlmix.kv.registry.Arrangement.plane_views`) defines them. The views alias the engine memory: writing
    into them writes the cache. Raises ValueError when the tensor(s) do not match the layout's shape or dtype.
    """
    arr = layout.arrangement_spec
    N, H, D = layout.block_size, layout.num_local_heads, layout.model.head_size
    views = tuple(arr.plane_views(_checked(layout, layer_cache), N, H, D))
    want = 1 if layout.model.attention == "mla" else 2
    # an arrangement (possibly a third party's) that returns too few planes or views of the wrong shape would
    # otherwise convert silently wrong (a missing V plane is never written) or fail deep in torch
    if len(views) != want or any(getattr(v, "ndim", 0) != 4 or tuple(v.shape[1:3]) != (N, H)
                                 or (want == 2 and v.shape[3] != D) or v.shape[0] != views[0].shape[0]
                                 for v in views):
        raise ValueError(f"arrangement {arr.name!r}: plane_views must return {want} view(s) [blocks, {N}, {H}, "
                         f"{D if want == 2 else 'D'}] ({'K, V' if want == 2 else 'the latent'}), got "
                         f"{[list(getattr(v, 'shape', [])) for v in views]}")
    return views


def _raw_blocks(layout: KVLayout, layer_cache: Any) -> list[torch.Tensor]:
    """Tensors whose dim 0 is the block id and whose rest is one block's bytes (K and V together if possible);
    :meth:`dlmix.kv.registry.Arrangement.raw_blocks` after the dtype check."""
    arr = layout.arrangement_spec
    return arr.raw_blocks(_checked(layout, layer_cache), layout.block_size, layout.num_local_heads,
                          layout.model.head_size)


def _num_blocks(views: Sequence[torch.Tensor]) -> int:
    return int(views[0].shape[0])
