"""One-pass CPU conversion paths for segments of at least :data:`~dlmix.kv.plan.DIRECT_MIN_BYTES`.

* identical layouts: whole blocks (K and V together) with one libc ``memmove`` per run of blocks;
* equal block sizes, no re-encoding (TP re-sharding, arrangement changes): whole blocks with one
  ``index_select(..., out=destination run)`` per run of consecutive destination ids (:func:`_transfer_blocks`);
* block size changes and casts: each segment (or run of segments whose slots continue on both sides) copied
  directly, ``memmove`` when both sides are dense rows of one dtype, else one ``torch._foreach_copy_`` per layer
  and plane (``copy_`` also casts bf16/fp16/fp32) (:func:`_transfer_direct`);
* several source ranks with block size changes or casts: assembled per chunk (:func:`_transfer_assembled`);
* fp8 re-encoding from a 1- or 2-byte source: each run of token rows through the lookup table of
  :mod:`dlmix.kv.cast` with one ``numpy.take`` (:func:`_transfer_lookup`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from .cast import _copy_cast, _same_encoding
from .layout import KVLayout
from .move import _copy_many, _copy_segments, _memmove_rows, _rows, _stack_planes, _token_rows, _widen, _widen_last, _Work
from .plan import _block_runs, _chunk_tokens, _merge, _ranges, _SegPlan, _segments, _sig, _Src
from .views import _raw_blocks, _storage_dtype, plane_views


def _transfer_assembled(srcs: Sequence[_Src], dl: KVLayout, dst_caches: Sequence[Any], db: torch.Tensor,
                        skip: int, n: int, d_slice: slice) -> None:
    """CPU path for several source ranks (TP re-sharding) when block sizes differ or values are cast: per chunk,
    each rank's token rows are ``memmove``d into its own token-major scratch ``[T, h_rank, D]``, interleaved into
    ``[T, H, D]`` with one strided ``copy_`` per rank (in cache), and the assembled rows are ``memmove``d into the
    destination blocks. Per-segment strided copies straight into the destination measured ~0.3x of a flat copy;
    this keeps the many small moves as ``memmove``."""
    Nd, D, P = dl.block_size, dl.model.head_size, dl.num_planes
    H = d_slice.stop - d_slice.start
    dbl = db.tolist()
    device = db.device
    work = _Work(device)
    sdt = _storage_dtype(dl)
    chunk = _chunk_tokens(device, H * D * dl.itemsize, Nd, *[s.layout.block_size for s in srcs])
    plans = []
    for a, b in _ranges(skip, n, chunk):
        ins = []
        for s in srcs:
            Ns = s.layout.block_size
            segs = [(x, d - a, k) for x, d, k in _segments(s.bids.tolist(), [0], Ns, b, a, b)]
            ins.append(_SegPlan(segs, Ns, b - a))
        out = _SegPlan([(x - a, d, k) for x, d, k in _segments([0], dbl, b, Nd, a, b)], b - a, Nd)
        plans.append((a, b, ins, out))
    for layer in range(dl.model.num_layers):
        dviews = plane_views(dl, dst_caches[layer])
        sviews = [plane_views(s.layout, s.caches[layer]) for s in srcs]
        for p in range(P):
            for a, b, ins, out in plans:
                y = work.get("y", sdt, (b - a, H, D))
                for i, (s, plan) in enumerate(zip(srcs, ins)):
                    sv = sviews[i][p][:, :, s.h_slice]
                    x = work.get(f"x{i}", sdt, (b - a, len(s.heads), D))
                    _copy_segments(x.unsqueeze(0), sv.view(sdt) if _same_encoding(s.layout, dl, p) else sv, plan)
                    y[:, s.x_slice].copy_(x)
                _copy_segments(dviews[p][:, :, d_slice], y.unsqueeze(0), out)


def _transfer_blocks(srcs: Sequence[_Src], dl: KVLayout, dst_caches: Sequence[Any], db: torch.Tensor,
                     skip: int, n: int, d_slice: slice) -> None:
    """CPU path for equal block sizes without re-encoding (TP re-sharding, arrangement changes): per layer and
    source rank, one ``index_select(src_view, block_dim, src_ids, out=dst_view[d0:d0 + k])`` per run of
    consecutive destination block ids, K and V together when both sides stack them (:func:`_stack_planes`). The
    source blocks are gathered straight into the strided head slice of the destination blocks (one pass, torch's
    C loop over blocks, no scratch). Partial blocks (below ``skip`` and the last one) go per segment.

    Measured on the 2-core dev box (one thread, Llama-3-8B KV, TP 2 -> 1, shuffled ids): ~0.5x of a flat copy
    against 0.35x for assembling blocks in scratch (two passes) and 0.3x for one strided ``copy_`` per block."""
    N = dl.block_size
    dbl = db.tolist()
    f0, f1 = (skip + N - 1) // N, n // N
    runs = _block_runs(dbl, f0, f1) if f1 > f0 else []
    edges = [(skip, f0 * N), (f1 * N, n)] if f1 > f0 else [(skip, n)]
    plans = []
    for s in srcs:
        sbl = s.bids.tolist()
        idx = [torch.tensor([sbl[i] for i in pos], dtype=torch.int64) for _, pos in runs]
        segs = [x for e0, e1 in edges if e1 > e0 for x in _segments(sbl, dbl, N, N, e0, e1)]
        plans.append((idx, _SegPlan(segs, N, N) if segs else None))
    # destination ids where runs start and end, for one tensor_split per view (cheaper than a slice per run)
    cuts = sorted({c for d0, pos in runs for c in (d0, d0 + len(pos))})
    piece = [cuts.index(d0) + 1 for d0, _ in runs]
    for layer in range(dl.model.num_layers):
        dviews = plane_views(dl, dst_caches[layer])
        jobs = []  # (source view, its pieces of the destination view, block dim, run index tensors)
        for s, (idx, plan) in zip(srcs, plans):
            svs, dvs = [], []
            for p, sv in enumerate(plane_views(s.layout, s.caches[layer])):
                dv = dviews[p][:, :, d_slice][:, :, s.x_slice]
                svs.append(sv[:, :, s.h_slice].view(dv.dtype) if sv.dtype != dv.dtype else sv[:, :, s.h_slice])
                dvs.append(dv)
            if plan is not None:
                for sv, dv in zip(svs, dvs):
                    _copy_segments(dv, sv, plan)
            if runs:
                sf, df = _stack_planes(svs), _stack_planes(dvs)
                pairs = [(sf, df, 1)] if sf is not None and df is not None else [(a, b, 0) for a, b in zip(svs, dvs)]
                for sv, dv, dim in pairs:
                    sv, dv = _widen_last(sv, dv)
                    jobs.append((sv, dv.tensor_split(cuts, dim), dim, idx))
        for j in range(len(runs)):  # both halves of a destination run while its lines are still in cache
            for sv, pieces, dim, idx in jobs:
                torch.index_select(sv, dim, idx[j], out=pieces[piece[j]])


def _transfer_direct(srcs: Sequence[_Src], dl: KVLayout, dst_caches: Sequence[Any], db: torch.Tensor,
                     skip: int, n: int, d_slice: slice, identical: bool) -> None:
    """CPU path: one ``copy_`` per segment (see :data:`DIRECT_MIN_BYTES`); no scratch buffers."""
    if len(srcs) > 1:
        _transfer_assembled(srcs, dl, dst_caches, db, skip, n, d_slice)
        return
    Nd = dl.block_size
    dbl = db.tolist()
    plans = []
    for s in srcs:
        Ns = s.layout.block_size
        sbl = s.bids.tolist()
        runs: list[tuple[int, int, int]] = []
        edges = [(skip, n)]
        if identical:  # whole blocks, all planes at once, in source order, consecutive block runs merged
            f0, f1 = (skip + Nd - 1) // Nd, n // Nd
            if f1 > f0:
                # ascending source addresses keep the reads streaming (measured ~+4 % with shuffled ids)
                runs = _merge(sorted((sbl[p], dbl[p], 1) for p in range(f0, f1)))
                edges = [(skip, f0 * Nd), (f1 * Nd, n)]
        segs = [x for e0, e1 in edges if e1 > e0 for x in _segments(sbl, dbl, Ns, Nd, e0, e1)]
        plans.append((runs, _SegPlan(segs, Ns, Nd) if segs else None))
    memo: dict = {}
    # identical layouts, whole blocks: layers whose engine tensors match layer 0's (shape, strides, dtype) reuse its
    # raw-block pointer offsets and byte offsets (per-layer view building measured ~5 % of the copy time)
    fast: tuple[Any, list[tuple[int, int, list[tuple[int, int, int]]]]] | None = None
    for layer in range(dl.model.num_layers):
        dviews = None
        for s, (runs, plan) in zip(srcs, plans):
            sl = s.layout
            if runs:
                sc, dc = s.caches[layer], dst_caches[layer]
                sig = (_sig(sc), _sig(dc))
                if fast is not None and sig == fast[0]:
                    sp0, dp0 = sc.data_ptr(), dc.data_ptr()
                    move = ctypes.memmove
                    for so_, do_, offs in fast[1]:
                        sp, dp = sp0 + so_, dp0 + do_
                        for do, so, nb in offs:
                            move(dp + do, sp + so, nb)
                else:
                    ptrs: list[tuple[int, int, list[tuple[int, int, int]]]] | None = []
                    for sr, dr in zip(_raw_blocks(sl, sc), _raw_blocks(dl, dc)):
                        s2, d2 = _widen(_rows(sr), _rows(dr.view(sr.dtype)))
                        if _memmove_rows(d2, s2, runs, memo):
                            if ptrs is not None and sig[0] is not None and sig[1] is not None:
                                isz = d2.element_size()
                                ptrs.append((s2.data_ptr() - sc.data_ptr(), d2.data_ptr() - dc.data_ptr(),
                                             memo[(d2.stride(0) * isz, s2.stride(0) * isz, d2.shape[1] * isz)]))
                        else:
                            ptrs = None
                            _copy_many([d2[d0:d0 + k] for _, d0, k in runs], [s2[b0:b0 + k] for b0, _, k in runs])
                    if fast is None and ptrs and sig[0] is not None and sig[1] is not None:
                        fast = (sig, ptrs)
            if plan is None:
                continue
            if dviews is None:
                dviews = plane_views(dl, dst_caches[layer])
            for p, sv in enumerate(plane_views(sl, s.caches[layer])):
                svp, dvp = sv[:, :, s.h_slice], dviews[p][:, :, d_slice][:, :, s.x_slice]
                if svp.dtype != dvp.dtype and _same_encoding(sl, dl, p):
                    svp = svp.view(dvp.dtype)
                _copy_segments(dvp, svp, plan)


def _transfer_lookup(s: _Src, dl: KVLayout, dst_caches: Sequence[Any], db: torch.Tensor, skip: int, n: int,
                     d_slice: slice) -> bool:
    """CPU path for fp8 re-encoding from a source of at most 2 bytes per element (one source rank): each run of
    token rows goes through the lookup table of :mod:`dlmix.kv.cast` with one ``numpy.take`` straight into the
    destination rows (one pass, no float32 scratch). Returns False, having written nothing, unless both sides are
    dense token rows."""
    sl = s.layout
    sv0, dv0 = plane_views(sl, s.caches[0]), plane_views(dl, dst_caches[0])
    if sl.itemsize > 2 or any(_token_rows(v) is None for v in (*sv0, *dv0)):
        return False
    runs = _merge(_segments(s.bids.tolist(), db.tolist(), sl.block_size, dl.block_size, skip, n))
    for layer in range(dl.model.num_layers):
        svs, dvs = plane_views(sl, s.caches[layer]), plane_views(dl, dst_caches[layer])
        for p, (sv, dv) in enumerate(zip(svs, dvs)):
            sr, dr = _token_rows(sv[:, :, s.h_slice]), _token_rows(dv[:, :, d_slice][:, :, s.x_slice])
            assert sr is not None and dr is not None
            for a, d, k in runs:
                _copy_cast(dr[d:d + k], sr[a:a + k], sl, dl, p)
    return True
