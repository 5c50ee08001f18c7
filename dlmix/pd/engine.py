"""What an engine adapter supplies to the PD core, and how the core addresses its KV blocks over a transport.

An adapter gives (:class:`EngineKV`): this rank's :class:`~dlmix.kv.KVLayout` and its per-layer KV caches in
:mod:`dlmix.kv` form (one tensor per layer, or a ``(K, V)`` pair for separate-K/V arrangements), plus block ids per
request, plus optional lifecycle hooks (:class:`LifecycleHooks`). Everything else (regions, grants, reads, staging,
conversion, holds) is the core's.

Regions. Each layer's cache is split into *planes*, each block-major (block ``b`` occupies bytes
``[b * page, (b + 1) * page)`` of the plane):

* one plane ``L{i}`` for single-tensor arrangements whose first axis is the block (``vllm_cpu``, ``vllm_lbnhc``,
  ``vllm_lbhnc``, ``vllm_flashinfer_*``, ``mla``): page = :meth:`KVLayout.block_bytes` ``(per_layer=True)``;
* two planes ``L{i}.k`` / ``L{i}.v`` for ``vllm_flash_*`` (``[2, B, ...]``: ``t[0]``, ``t[1]``) and for separate
  K/V arrangements (``sglang_*``, ``lmdeploy``; ``sglang_nhd`` slot rows ``p*N .. p*N+N-1`` are page ``p``):
  page = half of the per-layer block bytes.

A consumer derives the producer's region names and page sizes from the producer's layout (which travels in the
transfer parameters), so nothing else is exchanged.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from dlmix.kv.layout import KVLayout

__all__ = ["EngineKV", "LifecycleHooks", "plane_count", "plane_page_bytes", "region_names", "layer_planes",
           "check_caches"]

_TWO_PLANE_SINGLE = ("vllm_flash_nhd", "vllm_flash_hnd")


@runtime_checkable
class EngineKV(Protocol):
    """An engine rank's KV cache as the core needs it.

    Attributes:
      layout: this rank's KVLayout (its ``tp_rank`` is the rank).
      layers: per-layer caches in model layer order, in :mod:`dlmix.kv` form (see :func:`dlmix.kv.ops.convert`).
    """

    layout: KVLayout
    layers: Sequence[Any]


class LifecycleHooks(Protocol):
    """Callbacks from the core to the engine adapter (called from core threads; must not block).

    * ``hold_released(request_id, why)``: producer side; the request's blocks are no longer readable and the
      engine may free them (``why``: ``consumed``, ``aborted``, ``expired``, ``engine_abort``). An adapter whose
      engine polls instead (vLLM's ``get_finished``) uses :meth:`dlmix.pd.endpoint.KVEndpoint.take_finished`.

    The engine calls into the core at its own lifecycle points: ``add_hold`` (a finished prefill keeps its blocks),
    ``engine_abort`` (it drops one), :func:`dlmix.pd.consumer.claim` (a decode request arrives), ``pull`` /
    ``pull_params`` (its blocks are allocated; the result's ``failed_block_ids`` are recomputed by the engine) and
    ``release`` (tell the producer).
    """

    def hold_released(self, request_id: str, why: str) -> None: ...


def plane_count(layout: KVLayout) -> int:
    """Planes per layer in the region scheme (module doc): 1 or 2."""
    return 2 if layout.separate_kv or layout.arrangement in _TWO_PLANE_SINGLE else 1


def plane_page_bytes(layout: KVLayout) -> int:
    """Bytes of one block of one plane of one layer on this rank."""
    return layout.block_bytes(per_layer=True) // plane_count(layout)


def region_names(layout: KVLayout) -> list[list[str]]:
    """Region names per layer: ``[["L0"], ["L1"], ...]`` or ``[["L0.k", "L0.v"], ...]``."""
    if plane_count(layout) == 1:
        return [[f"L{i}"] for i in range(layout.model.num_layers)]
    return [[f"L{i}.k", f"L{i}.v"] for i in range(layout.model.num_layers)]


def layer_planes(layout: KVLayout, cache: Any) -> list[Any]:
    """The plane tensors of one layer's cache (module doc)."""
    if layout.separate_kv:
        k, v = cache
        return [k, v]
    if layout.arrangement in _TWO_PLANE_SINGLE:
        return [cache[0], cache[1]]
    return [cache]


def check_caches(layout: KVLayout, layers: Sequence[Any]) -> int:
    """Check per-layer caches against ``layout`` (count, shapes, dtype, contiguity of every plane); return the
    number of blocks. Raises ValueError naming the first mismatch."""
    from dlmix.kv.ops import torch_dtype

    if len(layers) != layout.model.num_layers:
        raise ValueError(f"registered {len(layers)} KV layers, the layout says {layout.model.num_layers}")
    want_dt = torch_dtype(layout)
    nb = None
    page = plane_page_bytes(layout)
    for i, cache in enumerate(layers):
        planes = layer_planes(layout, cache)
        for p in planes:
            if p.dtype != want_dt and not (layout.is_fp8 and str(p.dtype) == "torch.uint8"):
                raise ValueError(f"layer {i}: KV dtype {p.dtype} != layout dtype {layout.dtype}")
            if not p.is_contiguous():
                raise ValueError(f"layer {i}: KV tensor is not contiguous (strides {tuple(p.stride())})")
            nbytes = p.numel() * p.element_size()
            if nbytes % page:
                raise ValueError(f"layer {i}: {nbytes} B is not a whole number of {page}-byte blocks")
        first = planes[0]
        shape = layout.layer_shape(first.shape[0] if layout.arrangement not in _TWO_PLANE_SINGLE + ("sglang_nhd",)
                                   else (cache.shape[1] if layout.arrangement in _TWO_PLANE_SINGLE
                                         else first.shape[0] // layout.block_size))
        got = tuple(tuple(t.shape) for t in cache) if layout.separate_kv else tuple(cache.shape)
        if got != tuple(shape):
            raise ValueError(f"layer {i}: KV tensor shape {got} is not {layout.arrangement} {shape}")
        n = (first.numel() * first.element_size()) // page
        if nb is not None and n != nb:
            raise ValueError(f"layer {i}: {n} blocks, layer 0 has {nb}")
        nb = n
    return int(nb or 0)
