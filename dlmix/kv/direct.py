"""One-pass CPU conversion paths for segments of at least :data:`~dlmix.kv.plan.DIRECT_MIN_BYTES`.

* identical layouts: whole blocks (K and V together) with one libc ``memmove`` per run of blocks;
* equal block sizes, no re-encoding (TP re-sharding, arrangement changes): whole blocks in one compiled loop per
  layer and plane over every source rank (:func:`_transfer_compiled`, :mod:`dlmix.kv.kernels`), or without numba
  one ``index_select(..., out=destination run)`` per run of consecutive destination ids (:func:`_transfer_blocks`);
* block size changes and casts: each segment (or run of segments whose slots continue on both sides) copied
  directly, ``memmove`` when both sides are dense rows of one dtype, else one ``torch._foreach_copy_`` per layer
  and plane (``copy_`` also casts bf16/fp16/fp32) (:func:`_transfer_direct`);
* several source ranks with block size changes or casts: assembled per chunk (:func:`_transfer_assembled`);
* fp8 re-encoding from a 1- or 2-byte source: every run of token rows of a layer's plane through the lookup table
  of :mod:`dlmix.kv.cast` in one compiled loop (:func:`dlmix.kv.kernels.lookup_runs`; ``numpy.take`` per run
  without numba) (:func:`_transfer_lookup`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import kernels as _kernels
from .cast import _BITS, _copy_cast, _same_encoding, _scale, _table
from .layout import KVLayout
from .move import _copy_many, _copy_segments, _memmove_rows, _rows, _stack_planes, _token_rows, _widen, _widen_last, _Work
from .plan import _block_runs, _chunk_tokens, _merge, _ranges, _SegPlan, _segments, _sig, _Src
from .views import _checked, _raw_blocks, _storage_dtype, plane_views


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
    if _kernels.AVAILABLE and f1 > f0 and _transfer_compiled(srcs, dl, dst_caches, dbl, skip, n, d_slice, f0, f1):
        return
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


def _flat(t: torch.Tensor, wide: bool) -> np.ndarray:
    """1-D numpy array over the whole storage of ``t`` (element 0 = storage element 0), as unsigned integers of
    the element width (8 bytes when ``wide``), so storage offsets and strides index it."""
    isz = t.element_size()
    whole = t.as_strided((t.untyped_storage().nbytes() // isz,), (1,), 0)
    a = _bits(whole)
    return a.view(np.uint64) if wide else a


class _Geo:
    """Layer-independent arguments of :func:`dlmix.kv.kernels.copy_blocks` for one source view and its destination
    view (``[B, N, h, D]``, one element width): the inner axes ordered so the last is the source's dense one (else
    the destination's), axes dense on both sides merged into it; offsets relative to the engine tensors."""

    def __init__(self, sv: torch.Tensor, dv: torch.Tensor, s_raw: torch.Tensor, d_raw: torch.Tensor) -> None:
        ss, ds = list(sv.stride()), list(dv.stride())
        shape = list(sv.shape)
        inner = [1, 2, 3]
        last = next((a for a in inner if ss[a] == 1 and shape[a] > 1), None) or \
            next((a for a in inner if ds[a] == 1 and shape[a] > 1), 3)
        # the others by descending source stride (reads stream), except that an axis dense in the destination
        # goes next to the last one (a transpose: :func:`dlmix.kv.kernels.transpose_blocks`)
        rest = sorted((a for a in inner if a != last), key=lambda a: (ds[a] == 1 and ss[last] == 1, -ss[a]))
        order = [*rest, last]
        A = [shape[a] for a in order]
        S = [ss[0], *(ss[a] for a in order)]
        Dd = [ds[0], *(ds[a] for a in order)]
        for _ in range(2):  # merge the axis outside the last one into it while both sides stay dense
            if S[3] == 1 and Dd[3] == 1 and S[2] == A[2] and Dd[2] == A[2]:
                A, S, Dd = [1, A[0], A[1] * A[2]], [S[0], 0, S[1], 1], [Dd[0], 0, Dd[1], 1]
        self.shape, self.S, self.D = A, S, Dd
        self.s_rel = sv.storage_offset() - s_raw.storage_offset()
        self.d_rel = dv.storage_offset() - d_raw.storage_offset()
        w = 8 // sv.element_size() if 8 % sv.element_size() == 0 else 1
        self.w = w if (w > 1 and S[3] == 1 and Dd[3] == 1 and A[2] % w == 0
                       and all(x % w == 0 for x in (*S[:3], *Dd[:3], self.s_rel, self.d_rel))) else 1

    def args(self, s_raw: torch.Tensor, d_raw: torch.Tensor, w: int) -> tuple[int, int, tuple[int, int, int],
                                                                            tuple[int, ...], tuple[int, ...]]:
        """(source offset, destination offset, shape, source strides, destination strides) in ``w``-element
        words for this layer's engine tensors."""
        so, do = s_raw.storage_offset() + self.s_rel, d_raw.storage_offset() + self.d_rel
        A = self.shape
        if w == 1:
            return so, do, (A[0], A[1], A[2]), tuple(self.S), tuple(self.D)
        return (so // w, do // w, (A[0], A[1], A[2] // w), (*(x // w for x in self.S[:3]), 1),
                (*(x // w for x in self.D[:3]), 1))


def _transposable(args: tuple, itemsize: int) -> bool:
    """Whether :func:`dlmix.kv.kernels.transpose_blocks` applies: 2- or 4-byte elements, source dense along ``k``,
    destination dense along ``j``, both extents, offsets and strides whole 8-byte words."""
    so, do, shape, st_s, st_d = args
    if itemsize not in (2, 4):
        return False
    per = 8 // itemsize
    return (st_s[3] == 1 and st_d[2] == 1 and st_d[3] != 1 and shape[1] % per == 0 and shape[2] % per == 0
            and all(x % per == 0 for x in (so, do, *st_s[:3], st_d[0], st_d[1], st_d[3])))


def _plane_raws(layout: KVLayout, cache: Any) -> list[torch.Tensor]:
    """The engine tensor holding each plane of one layer (dtype-checked; fp8 as ``uint8``)."""
    c = _checked(layout, cache)
    return list(c) if isinstance(c, tuple) else [c] * layout.num_planes


def _layer_sig(layout: KVLayout, cache: Any) -> tuple:
    return tuple((tuple(t.shape), t.stride(), t.dtype) for t in _plane_raws(layout, cache))


def _transfer_compiled(srcs: Sequence[_Src], dl: KVLayout, dst_caches: Sequence[Any], dbl: list[int], skip: int,
                       n: int, d_slice: slice, f0: int, f1: int) -> bool:
    """Equal block sizes, no re-encoding (TP re-sharding, arrangement changes incl. vLLM CPU's K^T pages): whole
    destination blocks ``f0..f1`` in one compiled loop per layer and plane over every source rank
    (:func:`dlmix.kv.kernels.copy_blocks`), straight from the sources' strided views into the destination's, each
    destination row written in one sweep; the partial blocks at the edges per segment. The loop arguments are
    planned on layer 0 and reused for every layer shaped like it. Returns False, having written nothing, when a
    source's element width differs from the destination's.

    Measured on the 2-core dev box (one thread, shuffled ids): vLLM CPU K^T pages ~4 GB/s against ~1.6 GB/s for
    torch's strided ``copy_``; TP 2 -> 1 one sweep per destination row ~0.6-0.7x of a flat copy against ~0.45x for
    one pass per rank."""
    if any(v.element_size() != dl.itemsize for s in srcs for v in plane_views(s.layout, s.caches[0])):
        return False
    N, P = dl.block_size, dl.num_planes
    edges = [(skip, f0 * N), (f1 * N, n)]
    sbls = [s.bids.tolist() for s in srcs]
    pairs = np.array([[sbl[i] for sbl in sbls] + [dbl[i]] for i in range(f0, f1)], dtype=np.int64)
    plans = []
    for sbl in sbls:
        segs = [x for e0, e1 in edges if e1 > e0 for x in _segments(sbl, dbl, N, N, e0, e1)]
        plans.append(_SegPlan(segs, N, N) if segs else None)
    planned: dict = {}
    for layer in range(dl.model.num_layers):
        dcache, scaches = dst_caches[layer], [s.caches[layer] for s in srcs]
        key = (_layer_sig(dl, dcache), *(_layer_sig(s.layout, c) for s, c in zip(srcs, scaches)))
        d_raws = _plane_raws(dl, dcache)
        s_raws = [_plane_raws(s.layout, c) for s, c in zip(srcs, scaches)]
        geos = planned.get(key)
        views = None
        if geos is None or any(pl is not None for pl in plans):
            dviews = plane_views(dl, dcache)
            views = [[(sv[:, :, s.h_slice], dviews[p][:, :, d_slice][:, :, s.x_slice])
                      for p, sv in enumerate(plane_views(s.layout, c))] for s, c in zip(srcs, scaches)]
        if geos is None:
            assert views is not None
            geos = planned[key] = [[_Geo(views[r][p][0], views[r][p][1], s_raws[r][p], d_raws[p])
                                    for r in range(len(srcs))] for p in range(P)]
        for p in range(P):
            if views is not None:
                for r, plan in enumerate(plans):
                    if plan is not None:
                        sv, dv = views[r][p]
                        _copy_segments(dv, sv.view(dv.dtype) if sv.dtype != dv.dtype else sv, plan)
            w = min(g.w for g in geos[p])
            if w > 1 and any((t.untyped_storage().nbytes() // dl.itemsize) % w or t.storage_offset() % w
                             for t in (d_raws[p], *(sr[p] for sr in s_raws))):
                w = 1
            args = [g.args(s_raws[r][p], d_raws[p], w) for r, g in enumerate(geos[p])]
            groups = [list(range(len(srcs)))]
            if any(a[2][:2] != args[0][2][:2] for a in args):
                groups = [[r] for r in range(len(srcs))]
            if len(srcs) == 1 and w == 1 and _transposable(args[0], dl.itemsize) and all(
                    t.untyped_storage().nbytes() % 8 == 0 and (t.storage_offset() * dl.itemsize) % 8 == 0
                    for t in (d_raws[p], s_raws[0][p])):
                so, do, shape, st_s, st_d = args[0]
                _kernels.transpose_blocks(_flat(s_raws[0][p], True), _flat(d_raws[p], True), so, do, pairs, shape,
                                          st_s, st_d, dl.itemsize)
                continue
            fd = _flat(d_raws[p], w > 1)
            for g in groups:
                _kernels.copy_blocks(tuple(_flat(s_raws[r][p], w > 1) for r in g), fd, [args[r][0] for r in g],
                                     [args[r][1] for r in g], pairs[:, [*g, len(srcs)]], [args[r][2] for r in g],
                                     [args[r][3] for r in g], [args[r][4] for r in g])
    return True


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
    token rows goes through the lookup table of :mod:`dlmix.kv.cast` straight into the destination rows (one pass,
    no float32 scratch): one compiled loop per layer and plane over all runs (:func:`dlmix.kv.kernels.lookup_runs`,
    measured ~0.16x -> see ``benchmarks/kv_convert.py`` ``fp8``), or ``numpy.take`` per run without numba. Returns False, having written nothing, unless both sides are
    dense token rows."""
    sl = s.layout
    sv0, dv0 = plane_views(sl, s.caches[0]), plane_views(dl, dst_caches[0])
    if sl.itemsize > 2 or any(_token_rows(v) is None for v in (*sv0, *dv0)):
        return False
    runs = _merge(_segments(s.bids.tolist(), db.tolist(), sl.block_size, dl.block_size, skip, n))
    tables: list[Any] = [None] * dl.num_planes
    if _kernels.AVAILABLE and runs:
        for p in range(dl.num_planes):
            if not _same_encoding(sl, dl, p):
                tables[p] = _table(sl.dtype, _scale(sl, p) if sl.is_fp8 else 1.0, dl.dtype,
                                   _scale(dl, p) if dl.is_fp8 else 1.0)
    runs_np = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    for layer in range(dl.model.num_layers):
        svs, dvs = plane_views(sl, s.caches[layer]), plane_views(dl, dst_caches[layer])
        for p, (sv, dv) in enumerate(zip(svs, dvs)):
            sr, dr = _token_rows(sv[:, :, s.h_slice]), _token_rows(dv[:, :, d_slice][:, :, s.x_slice])
            assert sr is not None and dr is not None
            if tables[p] is not None:  # one compiled loop over every run of the layer's plane
                _kernels.lookup_runs(tables[p], _bits(sr), _bits(dr), runs_np)
                continue
            for a, d, k in runs:
                _copy_cast(dr[d:d + k], sr[a:a + k], sl, dl, p)
    return True


def _bits(t: torch.Tensor) -> np.ndarray:
    """numpy view of ``t``'s elements as unsigned integers of the same width (aliasing ``t``)."""
    tdt, ndt = _BITS[t.element_size()]
    return t.view(tdt).numpy().view(ndt)
