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

import functools
from dataclasses import replace
from typing import Any, Protocol, Sequence, runtime_checkable

from dlmix.kv.layout import KVLayout

__all__ = ["EngineKV", "LifecycleHooks", "plane_count", "plane_page_bytes", "region_names", "layer_planes",
           "check_caches", "head_subset", "page_runs"]

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


def head_subset(layout: KVLayout, heads: Sequence[int]) -> KVLayout:
    """The layout of a rank that holds exactly the KV heads ``heads`` (global ids, consecutive ascending) in
    ``layout``'s arrangement, block size and dtype: ``layout`` re-ranked to the equal split of the model's heads
    whose rank ``heads`` is. The intersection of two ranks of equal splits (prefill and decode TP) is often, not
    always, such a run (15 heads, TP 3 and TP 5: heads 3..4 are not; :func:`page_runs` then returns None). Raises
    ValueError when ``heads`` is not a rank of an equal split or ``layout`` does not hold it."""
    heads = tuple(int(h) for h in heads)
    have = layout.heads_for_rank()
    if heads == tuple(have):
        return layout
    if not heads or not set(heads) <= set(have):
        raise ValueError(f"rank {layout.tp_rank} of TP {layout.tp_size} holds KV heads {list(have)}, not "
                         f"{list(heads)}")
    H, n = layout.model.num_kv_heads, len(heads)
    if H % n or heads[0] % n:
        raise ValueError(f"KV heads {list(heads)} are not one rank of an equal split of {H} heads")
    sub = replace(layout, tp_size=H // n, tp_rank=heads[0] // n)
    if tuple(sub.heads_for_rank()) != heads:
        raise ValueError(f"KV heads {list(heads)} are not one rank of an equal split of {H} heads")
    return sub


def page_runs(layout: KVLayout, heads: Sequence[int]) -> list[list[tuple[int, int]]] | None:
    """Byte runs ``(offset, length)`` inside one block of each region plane (:func:`region_names` order) that hold
    the KV heads ``heads`` of ``layout``'s rank, such that the runs read in order and laid end to end form one block
    of :func:`head_subset` ``(layout, heads)``'s planes. A consumer rank reads exactly these runs, so it receives
    only the heads it owns. None when the arrangement interleaves heads so that no such reading exists (then the
    whole block is read and the heads are picked out during conversion). All heads: one run per plane, the page."""
    return _page_runs(layout.to_json(), tuple(int(h) for h in heads))


@functools.lru_cache(maxsize=256)
def _page_runs(layout_json: str, heads: tuple[int, ...]) -> list[list[tuple[int, int]]] | None:
    import torch

    src = KVLayout.from_json(layout_json)
    try:
        sub = head_subset(src, heads)
    except ValueError:
        if not heads or not set(heads) <= set(src.heads_for_rank()):
            raise  # heads this rank does not hold: a caller error
        # a run that is no rank of an equal split (e.g. heads 3..4 of 15 between TP 3 and TP 5): read whole pages,
        # the conversion picks the heads out
        return None
    P = plane_count(src)
    if sub is src:
        return [[(0, plane_page_bytes(src))] for _ in range(P)]

    def element_views(lay: KVLayout) -> list[list[torch.Tensor]]:
        """Per region plane: the ``[N, H, D]`` views (K and/or V) of one block whose values are element offsets
        inside that plane's page."""
        shape = lay.layer_shape(1)
        cache: Any = tuple(torch.empty(s, dtype=torch.int64) for s in shape) if lay.separate_kv \
            else torch.empty(shape, dtype=torch.int64)
        planes = layer_planes(lay, cache)
        for pl in planes:
            pl.view(-1).copy_(torch.arange(pl.numel()))
        views = lay.arrangement_spec.plane_views(cache, lay.block_size, lay.num_local_heads, lay.model.head_size)
        if len(planes) == 1:
            return [[v[0] for v in views]]
        return [[v[0]] for v in views]  # two planes: K in the first, V in the second

    src_views, sub_views = element_views(src), element_views(sub)
    local = src.heads_for_rank()
    h0 = local.index(heads[0])
    item = src.itemsize
    out: list[list[tuple[int, int]]] = []
    for sv, dv in zip(src_views, sub_views):
        picked = [v[:, h0:h0 + len(heads), :].reshape(-1) for v in sv]
        allsel, _ = torch.sort(torch.cat(picked))
        for p, d in zip(picked, dv):  # the n-th selected element (in page order) must be the sub page's element n
            if not torch.equal(torch.searchsorted(allsel, p), d.reshape(-1)):
                return None
        runs: list[tuple[int, int]] = []
        for off in allsel.tolist():
            if runs and runs[-1][0] + runs[-1][1] == off:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((off, 1))
        out.append([(o * item, n * item) for o, n in runs])
    return out
