"""Byte movers shared by the conversion paths: libc ``memmove`` of row runs, batched ``_foreach_copy_``,
``index_select`` gathers, reinterpretation as wide integers, scratch buffers.

Measured on the 2-core dev box with one thread: pure byte movement is fastest as int64 rows; a Python loop of
``memmove`` calls over runs of rows beats torch's per-op dispatch for blocks of 16 KiB and more.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

import torch

from .layout import KVLayout
from .plan import _merge, _SegPlan
from .views import _raw_blocks, torch_dtype


class _Work:
    """Scratch buffers reused across the chunks of one call.

    Fresh large allocations page-fault on first touch (measured on CPU: ``index_select`` into a new tensor ran at
    2.5 GB/s, into a reused one at 16-22 GB/s), so every chunk writes into these instead.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bufs: dict[str, torch.Tensor] = {}

    def get(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        isz = dtype.itemsize
        n = math.prod(shape) * isz
        buf = self.bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 64), dtype=torch.uint8, device=self.device)
            self.bufs[key] = buf
        return buf[:n].view(dtype).view(shape)

    def layer(self, key: str, layout: KVLayout, num_blocks: int) -> Any:
        """A scratch per-layer cache of ``num_blocks`` blocks in ``layout``'s arrangement and dtype."""
        shape = layout.layer_shape(num_blocks)
        dt = torch_dtype(layout)
        if layout.separate_kv:
            return (self.get(key + "k", dt, shape[0]), self.get(key + "v", dt, shape[1]))  # type: ignore[index]
        return self.get(key, dt, shape)  # type: ignore[arg-type]


_WIDE = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _widen(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Reinterpret tensors as the widest integer type all of them allow (pure byte movement is fastest on int64:
    ``index_copy_`` measured 18.9 GB/s on int64 vs 3.7 GB/s on uint8). Falls back to the tensors unchanged."""
    for w in _WIDE:
        try:
            return tuple(t.view(w) for t in ts)
        except RuntimeError:
            continue
    return ts


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[B, bytes-of-one-block]`` 2-D view (torch's CPU ``index_select``/``index_copy_`` are ~10x faster on 2-D
    tensors than on 4-D ones, measured), or ``t`` itself when a block is not one dense run."""
    try:
        return t.view(t.shape[0], -1)
    except RuntimeError:
        return t


def _token_rows(view: torch.Tensor) -> torch.Tensor | None:
    """``[B*N, h, D]`` view of ``[B, N, h, D]`` when blocks and offsets merge into one axis, else None."""
    B, N, h, D = view.shape
    if B > 1 and view.stride(0) != N * view.stride(1):
        return None
    return view.as_strided((B * N, h, D), (view.stride(1), view.stride(2), view.stride(3)), view.storage_offset())


def _gather_raw(layout: KVLayout, layer_cache: Any, bids: torch.Tensor, work: _Work, key: str) -> Any:
    """Whole blocks ``bids`` of one layer copied (2-D ``index_select``) into a scratch layer cache, in order."""
    temp = work.layer(key, layout, int(bids.numel()))
    runs = _merge([(b, i, 1) for i, b in enumerate(bids.tolist())]) if bids.device.type == "cpu" else None
    for s, d in zip(_raw_blocks(layout, layer_cache), _raw_blocks(layout, temp)):
        s2, d2 = _widen(_rows(s), _rows(d))
        if d2.dim() != s2.dim():  # source blocks are not one dense run: gather into the scratch in their shape
            d2 = d2.view(d2.shape[0], *s2.shape[1:])
        if runs is None or not _memmove_rows(d2, s2, runs):
            torch.index_select(s2, 0, bids, out=d2)
    return temp


def _scatter_raw(layout: KVLayout, layer_cache: Any, temp: Any, bids: torch.Tensor) -> None:
    """Scratch layer cache blocks ``0..len(bids)-1`` written (2-D ``index_copy_``) into blocks ``bids``."""
    runs = _merge([(i, b, 1) for i, b in enumerate(bids.tolist())]) if bids.device.type == "cpu" else None
    for d, s in zip(_raw_blocks(layout, layer_cache), _raw_blocks(layout, temp)):
        d2, s2 = _widen(_rows(d), _rows(s))
        if d2.dim() != s2.dim():  # destination blocks are not one dense run: scatter the scratch in their shape
            s2 = s2.view(s2.shape[0], *d2.shape[1:])
        if runs is None or not _memmove_rows(d2, s2, runs):
            d2.index_copy_(0, bids, s2)


def _scatter_tokens(view: torch.Tensor, bids: torch.Tensor, N: int, t0: int, t1: int, piece: torch.Tensor) -> None:
    """Write token-major ``piece [t1 - t0, h, D]`` into tokens ``t0..t1`` of the strided ``[B, N, h, D]`` view."""
    t = torch.arange(t0, t1, device=bids.device)
    blk = bids[t // N]
    off = t % N
    piece = piece.view(view.dtype)
    flat = _token_rows(view)
    if flat is not None:
        wf, wp = _widen(flat, piece)
        wf.index_copy_(0, blk * N + off, wp)
    else:
        view.index_put_((blk, off), piece)


def _memmove_rows(d2: torch.Tensor, s2: torch.Tensor, runs: Sequence[tuple[int, int, int]],
                  memo: dict | None = None) -> bool:
    """Byte-copy row runs ``(src_row, dst_row, count)`` between two CPU 2-D tensors of one dtype with libc
    ``memmove`` (one call per run, or per row when rows are not adjacent). Returns False (nothing done) when not
    applicable: other device, different dtype or row width, or rows that are not dense.

    Measured on the 2-core dev box (one thread, 64 KiB blocks, shuffled ids): 0.8-0.98x of a flat ``copy_``,
    against 0.5x for ``_foreach_copy_`` and 0.4x for ``index_select`` + ``index_copy_`` (per-op dispatch cost).
    Row indices come from validated block tables, so every address lies inside the tensors. ``memo`` (a dict
    reused across the layers of one call) keeps the byte offsets, so each later call only adds base pointers.
    """
    if (d2.device.type != "cpu" or s2.device.type != "cpu" or d2.dtype != s2.dtype or d2.dim() != 2
            or s2.dim() != 2 or d2.shape[1] != s2.shape[1] or d2.stride(1) != 1 or s2.stride(1) != 1):
        return False
    isz = d2.element_size()
    width = d2.shape[1] * isz
    ds, ss = d2.stride(0) * isz, s2.stride(0) * isz
    dp, sp = d2.data_ptr(), s2.data_ptr()
    dense = ds == width and ss == width
    if not dense and width < (16 << 10):  # one call per short row costs more than torch's strided copy
        return False
    key = (ds, ss, width)
    offs = memo.get(key) if memo is not None else None
    if offs is None:
        if dense:
            offs = [(dr * ds, sr * ss, k * width) for sr, dr, k in runs]
        else:
            offs = [((dr + i) * ds, (sr + i) * ss, width) for sr, dr, k in runs for i in range(k)]
        if memo is not None:
            memo[key] = offs
    move = ctypes.memmove
    for do, so, nb in offs:
        move(dp + do, sp + so, nb)
    return True


def _copy_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, in one C++ loop (``torch._foreach_copy_``) when this torch has it."""
    if not dsts:
        return
    fe = getattr(torch, "_foreach_copy_", None)
    if fe is not None:
        fe(dsts, srcs)
    else:  # pragma: no cover - torch < 2.1
        for d, s in zip(dsts, srcs):
            d.copy_(s)


def _flat2d(rows: torch.Tensor) -> torch.Tensor | None:
    """``[R, h*D]`` view of token rows ``[R, h, D]`` whose rows are dense, else None."""
    R, h, D = rows.shape
    if rows.stride(2) != 1 or (h > 1 and rows.stride(1) != D):
        return None
    return rows.as_strided((R, h * D), (rows.stride(0), 1), rows.storage_offset())


def _copy_segments(dv: torch.Tensor, sv: torch.Tensor, plan: _SegPlan) -> None:
    """Move every segment from the ``[B, N, h, D]`` view ``sv`` into ``dv`` (``copy_`` also casts)."""
    s_rows, d_rows = _token_rows(sv), _token_rows(dv)
    if s_rows is not None and d_rows is not None:
        m = plan.merged
        s2, d2 = _flat2d(s_rows), _flat2d(d_rows)
        if s2 is not None and d2 is not None and _memmove_rows(d2, s2, m):
            return
        if (s2 is not None and d2 is not None and s2.dtype == d2.dtype and d2.stride(0) == d2.shape[1]
                and len(plan.druns) < len(m)):
            s2, d2 = _widen(s2, d2)
            slots = plan.slots_on(s2.device)
            dsts, srcs = [], []
            for i0, i1, t0, t1, d in plan.druns:
                if i1 - i0 == 1:
                    s = m[i0][0]
                    dsts.append(d2[d:d + t1 - t0])
                    srcs.append(s2[s:s + t1 - t0])
                else:  # destination rows consecutive, source rows scattered: one gather straight into place
                    torch.index_select(s2, 0, slots[t0:t1], out=d2[d:d + t1 - t0])
            _copy_many(dsts, srcs)
            return
        _copy_many([d_rows[d:d + n] for _, d, n in m], [s_rows[s:s + n] for s, _, n in m])
        return
    bw = plan.blockwise
    _copy_many([dv[db, d0:d1] for _, _, _, db, d0, d1 in bw], [sv[sb, s0:s1] for sb, s0, s1, _, _, _ in bw])


def _stack_planes(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One ``[P, B, N, h, D]`` view of the plane views ``[B, N, h, D]`` when they differ only by a fixed storage
    offset (K and V of one engine tensor: vLLM flash ``[2, B, ...]``, flashinfer, BLNHC), else None."""
    v0 = views[0]
    if len(views) == 1:
        return v0.unsqueeze(0)
    step = views[1].storage_offset() - v0.storage_offset()
    for i, v in enumerate(views[1:], 1):
        if (v.shape != v0.shape or v.stride() != v0.stride() or v.dtype != v0.dtype
                or v.untyped_storage().data_ptr() != v0.untyped_storage().data_ptr()
                or v.storage_offset() - v0.storage_offset() != i * step):
            return None
    if step <= 0:
        return None
    return v0.as_strided((len(views), *v0.shape), (step, *v0.stride()), v0.storage_offset())


def _widen_last(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Reinterpret views as int64 along their dense last dim when all allow it (torch's copy loop then moves
    8 bytes per element), else unchanged."""
    try:
        return tuple(t.view(torch.int64) for t in ts)
    except RuntimeError:
        return ts
