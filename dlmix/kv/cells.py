"""One-pass CPU path for re-arrangements that no token-row copy can do: a gather of *cells* with ``numpy.take``.

When source and destination store the same bytes (one source rank holding every destination head, same dtype and
scales) but order them differently inside a block (NHD <-> HND, a vLLM CPU page with K transposed, a block size
change between two K-transposed caches), the conversion is a permutation of *cells*: the longest byte runs that are
contiguous on both sides. A plane whose element axis ``d`` is dense on both sides has cells along ``d`` (one
``(token, head)`` vector, or a part of it); a plane whose token axis is dense on both sides (vLLM CPU's K^T rows)
has cells along the tokens, ``min(Ns, Nd)`` long. All planes use one cell size (the gcd in bytes).

The plan (built once per call, reused for every layer, since the block tables, shapes and strides are the same):
the source cell index of every destination cell of the request's whole destination blocks, sorted in destination
memory order and cut into runs of consecutive destination cells of one destination and one source tensor. Each
layer is then one ``numpy.take(source_cells, index_run, out=destination_cells[run], mode="clip")`` per run: numpy's
take moves each cell with one ``memmove`` in C (measured on the 2-core dev box, one thread, shuffled 64 KiB
blocks: NHD -> HND 0.6-0.7x a flat copy against 0.35-0.45x for torch's ``index_select`` or strided ``copy_``;
vLLM CPU 32 -> 64 blocks 0.8x against 0.33x). Tokens outside whole destination blocks are left to the caller.

Indices come from block tables validated by :mod:`dlmix.kv.plan`, so every cell lies inside its tensor; the path
declines (returns None) when a tensor is not contiguous, a cell would be smaller than :data:`MIN_CELL_BYTES`, or a
cell offset is not a multiple of the cell size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .layout import KVLayout
from .move import _copy_segments
from .plan import _SegPlan, _segments, _Src
from .views import _checked, plane_views

#: Smallest cell worth a ``memmove`` each; below it numpy's per-item cost beats the copy.
MIN_CELL_BYTES = 32


def _raw_tensors(layout: KVLayout, cache: Any) -> list[torch.Tensor]:
    """The engine tensor(s) of one layer after the dtype check: ``[t]`` or ``[K, V]``."""
    c = _checked(layout, cache)
    return list(c) if isinstance(c, tuple) else [c]


def _plane_geometry(layout: KVLayout, cache: Any) -> list[tuple[int, int, tuple[int, int, int, int]]] | None:
    """Per plane: (index of its raw tensor, element offset in it, strides (block, token, head, element)); None when
    a plane view does not alias one of the raw tensors."""
    raws = _raw_tensors(layout, cache)
    views = layout.arrangement_spec.plane_views(_checked(layout, cache), layout.block_size,
                                                layout.num_local_heads, layout.model.head_size)
    out = []
    for v in views:
        for i, r in enumerate(raws):
            # same storage is not enough: K and V may be views of one buffer (``allocate(one_buffer=True)``, an
            # engine's pool), so the plane belongs to the raw tensor whose elements hold its first element
            off = v.storage_offset() - r.storage_offset()
            if (v.untyped_storage().data_ptr() == r.untyped_storage().data_ptr() and 0 <= off < r.numel()):
                out.append((i, off, tuple(v.stride())))
                break
        else:
            return None
    return out


class CellPlan:
    """Runs of ``numpy.take`` for whole destination blocks of one request (see the module docstring).

    ``runs``: ``(dst tensor, first dst cell, src tensor, index array)``; ``cell``: bytes per cell.
    """

    def __init__(self, cell: int, runs: list[tuple[int, int, int, np.ndarray]]) -> None:
        self.cell, self.runs = cell, runs

    def apply(self, src_raws: Sequence[torch.Tensor], dst_raws: Sequence[torch.Tensor]) -> None:
        """Move the cells of one layer: ``src_raws``/``dst_raws`` are that layer's engine tensors, shaped and
        strided like the ones the plan was built from."""
        c = self.cell
        srcs = [r.view(torch.uint8).reshape(-1).numpy() for r in src_raws]
        dsts = [r.view(torch.uint8).reshape(-1).numpy() for r in dst_raws]
        srcs = [a[: a.size // c * c].reshape(-1, c) for a in srcs]
        dsts = [a[: a.size // c * c].reshape(-1, c) for a in dsts]
        take = np.take
        for dt, d0, st, idx in self.runs:
            take(srcs[st], idx, axis=0, out=dsts[dt][d0:d0 + idx.size], mode="clip")


def plan_cells(sl: KVLayout, s_cache: Any, sbl: list[int], dl: KVLayout, d_cache: Any, dbl: list[int],
               f0: int, f1: int, h0: int = 0) -> CellPlan | None:
    """Plan the cells of destination blocks ``f0..f1`` (request block positions) from one source rank holding every
    destination head in the same encoding, or None when the cell path does not apply (see the module docstring).

    ``s_cache``/``d_cache``: layer 0's caches (every layer must share their shapes and strides); ``sbl``/``dbl``:
    the validated block tables as lists; ``h0``: the source's local index of the first destination head.
    """
    if f1 <= f0:
        return None
    src_raws, dst_raws = _raw_tensors(sl, s_cache), _raw_tensors(dl, d_cache)
    if not all(r.is_contiguous() for r in (*src_raws, *dst_raws)):
        return None
    sg, dg = _plane_geometry(sl, s_cache), _plane_geometry(dl, d_cache)
    if sg is None or dg is None:
        return None
    isz = dst_raws[0].element_size()
    if src_raws[0].element_size() != isz:
        return None
    Ns, Nd, H, D = sl.block_size, dl.block_size, dl.num_local_heads, dl.model.head_size
    if max(Ns, Nd) % min(Ns, Nd):
        return None
    # per plane: cell axis and its maximal length in elements
    axes = []
    for (_, _, ss), (_, _, ds) in zip(sg, dg):
        if ss[3] == 1 and ds[3] == 1:
            axes.append(("d", D))
        elif ss[1] == 1 and ds[1] == 1:
            axes.append(("n", min(Ns, Nd)))
        else:
            return None
    cell = 0
    for _, length in axes:
        cell = math.gcd(cell, length * isz)
    if cell < MIN_CELL_BYTES:
        return None
    ce = cell // isz  # elements per cell
    tok = np.arange(f0 * Nd, f1 * Nd, dtype=np.int64)
    s_blk = np.asarray(sbl, dtype=np.int64)[tok // Ns]
    d_blk = np.asarray(dbl, dtype=np.int64)[tok // Nd]
    s_n, d_n = tok % Ns, tok % Nd
    heads = np.arange(H, dtype=np.int64)
    s_heads = heads + h0
    parts = []  # (dst tensor, dst element offsets, src tensor, src element offsets) per plane
    for (axis, _), (si, so, ss), (di, do, ds) in zip(axes, sg, dg):
        if axis == "d":
            dd = np.arange(0, D, ce, dtype=np.int64)
            t_s, t_d = (s_blk * ss[0] + s_n * ss[1]), (d_blk * ds[0] + d_n * ds[1])
            src = so + t_s[:, None, None] + s_heads[None, :, None] * ss[2] + dd[None, None, :] * ss[3]
            dst = do + t_d[:, None, None] + heads[None, :, None] * ds[2] + dd[None, None, :] * ds[3]
        else:
            first = tok[::ce]  # cell starts: aligned, inside one source and one destination block
            ii = np.searchsorted(tok, first)
            dd = np.arange(D, dtype=np.int64)
            t_s = s_blk[ii] * ss[0] + s_n[ii] * ss[1]
            t_d = d_blk[ii] * ds[0] + d_n[ii] * ds[1]
            src = so + t_s[:, None, None] + s_heads[None, :, None] * ss[2] + dd[None, None, :] * ss[3]
            dst = do + t_d[:, None, None] + heads[None, :, None] * ds[2] + dd[None, None, :] * ds[3]
        parts.append((di, dst.reshape(-1), si, src.reshape(-1)))
    d_t = np.concatenate([np.full(p[1].size, p[0], dtype=np.int64) for p in parts])
    d_off = np.concatenate([p[1] for p in parts])
    s_t = np.concatenate([np.full(p[3].size, p[2], dtype=np.int64) for p in parts])
    s_off = np.concatenate([p[3] for p in parts])
    if np.any(d_off % ce) or np.any(s_off % ce):
        return None
    d_off //= ce
    s_off //= ce
    order = np.lexsort((d_off, d_t))
    d_t, d_off, s_t, s_off = d_t[order], d_off[order], s_t[order], s_off[order]
    if d_off.size > 1 and np.any((d_t[1:] == d_t[:-1]) & (d_off[1:] == d_off[:-1])):
        return None  # two cells for one destination cell: not a permutation (should not happen)
    brk = np.flatnonzero((d_t[1:] != d_t[:-1]) | (d_off[1:] != d_off[:-1] + 1) | (s_t[1:] != s_t[:-1])) + 1
    bounds = [0, *brk.tolist(), d_off.size]
    runs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        runs.append((int(d_t[a]), int(d_off[a]), int(s_t[a]), np.ascontiguousarray(s_off[a:b], dtype=np.intp)))
    return CellPlan(cell, runs)


def _sigs(layout: KVLayout, caches: Sequence[Any]) -> list | None:
    """The (shape, strides) of every layer's engine tensors when all layers match and are contiguous, else None."""
    first = None
    for c in caches:
        sig = [(tuple(t.shape), t.stride()) for t in _raw_tensors(layout, c)]
        if first is None:
            if not all(t.is_contiguous() for t in _raw_tensors(layout, c)):
                return None
            first = sig
        elif sig != first:
            return None
    return first


def _transfer_cells(s: _Src, dl: KVLayout, dst_caches: Sequence[Any], db: torch.Tensor, skip: int, n: int,
                    d_slice: slice) -> bool:
    """Convert with the cell gather (whole destination blocks) plus per-segment copies for the partial blocks at
    the edges. Returns False, having written nothing, when the cell path does not apply."""
    sl, Nd, Ns = s.layout, dl.block_size, s.layout.block_size
    if d_slice.stop - d_slice.start != dl.num_local_heads:
        return False
    f0, f1 = (skip + Nd - 1) // Nd, n // Nd
    if f1 <= f0 or _sigs(sl, s.caches) is None or _sigs(dl, dst_caches) is None:
        return False
    sbl, dbl = s.bids.tolist(), db.tolist()
    plan = plan_cells(sl, s.caches[0], sbl, dl, dst_caches[0], dbl, f0, f1, s.h_slice.start)
    if plan is None:
        return False
    segs = [x for e0, e1 in ((skip, f0 * Nd), (f1 * Nd, n)) if e1 > e0 for x in _segments(sbl, dbl, Ns, Nd, e0, e1)]
    edge = _SegPlan(segs, Ns, Nd) if segs else None
    for layer in range(dl.model.num_layers):
        plan.apply(_raw_tensors(sl, s.caches[layer]), _raw_tensors(dl, dst_caches[layer]))
        if edge is not None:
            for sv, dv in zip(plane_views(sl, s.caches[layer]), plane_views(dl, dst_caches[layer])):
                sv = sv[:, :, s.h_slice]
                _copy_segments(dv, sv.view(dv.dtype) if sv.dtype != dv.dtype else sv, edge)
    return True
