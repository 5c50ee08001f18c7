"""The general conversion path (any device; fp8 re-scaling; tiny segments): through scratch buffers per chunk.

Per chunk of at most :data:`~dlmix.kv.plan.CHUNK_BYTES`, the source blocks are gathered whole (2-D
``index_select`` or ``memmove``) into a reused scratch cache, re-ordered and cast into a token-major buffer
``[T, h, D]``, assembled into whole destination blocks in scratch and written with one 2-D ``index_copy_`` (or
``memmove``); tokens of partially covered destination blocks (below ``skip_tokens``, the last block, chunk edges)
are written per token slot with ``index_copy_``/``index_put_``. The wire form (:mod:`dlmix.kv.wire`) reuses
:func:`_fill_chunk` and :func:`_flush_chunk`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .cast import _copy, _copy_cast
from .layout import KVLayout
from .move import _gather_raw, _scatter_raw, _scatter_tokens, _token_rows, _Work
from .plan import _chunk_tokens, _ranges, _Src
from .views import _storage_dtype, plane_views


def _fill_chunk(srcs: Sequence[_Src], layer: int, a: int, b: int, dl: KVLayout, xs: Sequence[torch.Tensor],
                work: _Work) -> None:
    """Token-major chunk buffers ``xs[p] [b - a, Hx, D]`` (destination storage dtype) from the source ranks."""
    for s in srcs:
        sl, Ns = s.layout, s.layout.block_size
        p0, p1 = a // Ns, (b + Ns - 1) // Ns
        temp = _gather_raw(sl, s.caches[layer], s.bids[p0:p1], work, "s")
        for p, v in enumerate(plane_views(sl, temp)):
            v = v[:, :, s.h_slice]
            target = xs[p][:, s.x_slice]
            rows = _token_rows(v)
            lo, hi = a - p0 * Ns, b - p0 * Ns
            if rows is not None:
                _copy_cast(target, rows[lo:hi], sl, dl, p)
            else:  # block-major inside (HND, CPU K^T): one strided copy into token order first
                z = work.get("z", xs[p].dtype, tuple(v.shape))
                _copy_cast(z, v, sl, dl, p)
                _copy(target, z.flatten(0, 1)[lo:hi])


def _flush_chunk(dl: KVLayout, dst_cache: Any, db: torch.Tensor, a: int, b: int, xs: Sequence[torch.Tensor],
                 d_slice: slice, work: _Work) -> None:
    """Write the chunk buffers ``xs[p]`` (tokens ``a..b``, heads ``d_slice``) into the destination blocks."""
    Nd = dl.block_size
    f0, f1 = (a + Nd - 1) // Nd, b // Nd
    views = plane_views(dl, dst_cache)
    full_heads = (d_slice.stop - d_slice.start) == dl.num_local_heads
    if f1 > f0:
        nb = f1 - f0
        if full_heads:  # rebuild whole destination blocks in scratch, then one 2-D index_copy_ per raw tensor
            temp = work.layer("d", dl, nb)
            for p, tv in enumerate(plane_views(dl, temp)):
                src = xs[p][f0 * Nd - a: f1 * Nd - a]
                rows = _token_rows(tv)
                if rows is not None:
                    _copy(rows, src.view(rows.dtype))
                else:
                    _copy(tv, src.view(tv.dtype).view(nb, Nd, *src.shape[1:]))
            _scatter_raw(dl, dst_cache, temp, db[f0:f1])
        else:  # a subset of the heads: write only those (strided index_copy_)
            for p, v in enumerate(views):
                src = xs[p][f0 * Nd - a: f1 * Nd - a]
                vv = v[:, :, d_slice]
                vv.index_copy_(0, db[f0:f1], src.view(vv.dtype).view(nb, Nd, *src.shape[1:]))
        parts = [(a, f0 * Nd), (f1 * Nd, b)]
    else:
        parts = [(a, b)]
    for t0, t1 in parts:
        if t1 > t0:
            for p, v in enumerate(views):
                _scatter_tokens(v[:, :, d_slice], db, Nd, t0, t1, xs[p][t0 - a: t1 - a])


def _transfer_chunked(srcs: Sequence[_Src], dl: KVLayout, dst_caches: Sequence[Any], db: torch.Tensor,
                      skip_tokens: int, num_tokens: int, heads: tuple[int, ...], d_slice: slice,
                      identical: bool) -> None:
    """The general path (any device, fp8 re-scaling, tiny segments): per layer and chunk of at most
    :data:`~dlmix.kv.plan.CHUNK_BYTES`, source blocks gathered whole into scratch, re-ordered and cast into a
    token-major buffer ``[T, h, D]`` (:func:`_fill_chunk`), written back as whole destination blocks plus per-token
    edges (:func:`_flush_chunk`). Identical layouts move whole blocks raw, straight from scratch to destination."""
    P, D, Nd = dl.num_planes, dl.model.head_size, dl.block_size
    s0 = srcs[0]
    sl = s0.layout
    L = dl.model.num_layers
    device = db.device
    itemsize = max([s.layout.itemsize for s in srcs] + [dl.itemsize])
    chunk = _chunk_tokens(device, len(heads) * D * itemsize * P, Nd, *[s.layout.block_size for s in srcs])
    work = _Work(device)
    sdt = _storage_dtype(dl)
    for layer in range(L):
        for a, b in _ranges(skip_tokens, num_tokens, chunk):
            if identical:  # same bytes: whole blocks move raw, straight from scratch to destination
                f0, f1 = (a + Nd - 1) // Nd, b // Nd
                if f1 > f0:
                    temp = _gather_raw(sl, s0.caches[layer], s0.bids[f0:f1], work, "s")
                    _scatter_raw(dl, dst_caches[layer], temp, db[f0:f1])
                    edges = [(a, f0 * Nd), (f1 * Nd, b)]
                else:
                    edges = [(a, b)]
            else:
                edges = [(a, b)]
            for x0, x1 in edges:
                if x1 <= x0:
                    continue
                xs = [work.get(f"x{p}", sdt, (x1 - x0, len(heads), D)) for p in range(P)]
                _fill_chunk(srcs, layer, x0, x1, dl, xs, work)
                _flush_chunk(dl, dst_caches[layer], db, x0, x1, xs, d_slice, work)
