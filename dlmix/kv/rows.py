"""The row path (accelerators): (token, head) rows moved with one gather and one scatter per layer plane.

In every arrangement whose ``D`` elements of one (token, head) are contiguous, a plane of one layer is a set of
rows of ``D`` elements, and the row of (block ``b``, token-in-block ``n``, local head ``h``) is
``b * sB + n * sN + h * sH`` (the view's strides divided by ``D``). Per chunk of tokens the source and destination
row indices are computed once, as index tensors on the device, and reused for every layer: each layer plane is then
one ``index_select`` into scratch (plus one cast when the encodings differ) and one ``index_copy_`` into the
destination. Only tokens ``skip_tokens..num_tokens`` of the destination's heads are written, so nothing else in the
destination changes. On a GPU this replaces the chunked path's block gathers, token re-ordering copies and edge
writes (about ten kernels per layer plane, most of them strided) by two or three (measured on an H200: 1.7-2.95x
the chunked path, ``benchmarks/kv_convert_device.py``; the kernels then take ~0.75 ms for 512 MiB and per-call CPU
work ~4 ms; merging a token's heads into one wider row was tried and gained nothing measurable). When every layer
plane of a side lies in one buffer (vLLM's per-layer views of one allocation, the PD consumer's staging region),
the row index adds each layer plane's first row and one gather and one scatter move every layer plane of a chunk
at once (:func:`_move_fused`).

Not applicable (the chunked path runs instead): a plane whose ``D`` elements are not contiguous (vLLM CPU's
transposed K), strides that are not whole rows, or layers whose views do not share layer 0's strides.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .cast import _copy_cast, _same_encoding
from .layout import KVLayout
from .move import _widen, _Work
from .plan import _chunk_tokens, _ranges, _Src
from .views import plane_views


def _geometry(view: torch.Tensor) -> tuple[int, int, int] | None:
    """Row strides ``(block, token, head)`` of a ``[B, N, h, D]`` view in rows of ``D`` elements, or None when its
    ``D`` elements are not contiguous or a stride is not a whole number of rows (size-1 axes count as stride 0)."""
    D = view.shape[3]
    if view.shape[3] > 1 and view.stride(3) != 1:
        return None
    st = [0 if view.shape[i] == 1 else view.stride(i) for i in range(3)]
    if any(s % D for s in st):
        return None
    return st[0] // D, st[1] // D, st[2] // D


def _rows_of(view: torch.Tensor, geo: tuple[int, int, int]) -> torch.Tensor:
    """``[R, D]`` view of the storage from the view's first element, ``R`` rows covering every element of it."""
    D = view.shape[3]
    return view.as_strided((_span(view, geo), D), (D, 1), view.storage_offset())


def _strides(views: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    return [tuple(v.stride()) for v in views]


def _span(view: torch.Tensor, geo: tuple[int, int, int]) -> int:
    B, N, h, _ = view.shape
    return (B - 1) * geo[0] + (N - 1) * geo[1] + (h - 1) * geo[2] + 1


def _fused(views: list[torch.Tensor], geo: tuple[int, int, int]) -> tuple[torch.Tensor, list[int]] | None:
    """When every (layer, plane) view of one side lies in one storage with equal strides and row-aligned offsets
    (vLLM's per-layer views of one buffer, a transport's staging region): an ``[R, D]`` row tensor over all of them
    and each view's first row in it; else None."""
    v0 = views[0]
    D = v0.shape[3]
    ptr = v0.untyped_storage().data_ptr()
    if any(v.untyped_storage().data_ptr() != ptr or v.stride() != v0.stride() for v in views):
        return None
    offs = [v.storage_offset() for v in views]
    o0 = min(offs)
    if any((o - o0) % D for o in offs):
        return None
    base = [(o - o0) // D for o in offs]
    return v0.as_strided((max(base) + _span(v0, geo), D), (D, 1), o0), base


def _transfer_rows(srcs: Sequence[_Src], dl: KVLayout, dst_caches: Sequence[Any], db: torch.Tensor,
                   skip_tokens: int, num_tokens: int, d_slice: slice) -> bool:
    """Move tokens ``skip_tokens..num_tokens`` of every layer by row gathers (module doc). Returns False, having
    written nothing, when the row path does not apply."""
    P, Nd, L = dl.num_planes, dl.block_size, dl.model.num_layers
    D = dl.model.head_size
    dviews = [plane_views(dl, dst_caches[layer]) for layer in range(L)]
    sviews = [[plane_views(s.layout, s.caches[layer]) for layer in range(L)] for s in srcs]
    dgeo = [_geometry(v) for v in dviews[0]]
    sgeo = [[_geometry(v) for v in views[0]] for views in sviews]
    if None in dgeo or any(None in g for g in sgeo):
        return False
    # every layer must share layer 0's strides (its own offset is its row 0)
    if any(_strides(v) != _strides(dviews[0]) for v in dviews[1:]):
        return False
    if any(_strides(v) != _strides(sv[0]) for sv in sviews for v in sv[1:]):
        return False
    device = db.device
    dflat = [v for layer in dviews for v in layer]
    plans = []  # per source rank: (fused pair or None, per-layer-plane (src, dst) rows or None)
    for sv, sg in zip(sviews, sgeo):
        pair = None
        if all(g == sg[0] for g in sg) and all(g == dgeo[0] for g in dgeo):
            sf = _fused([v for layer in sv for v in layer], sg[0])
            df = _fused(dflat, dgeo[0]) if sf is not None else None
            pair = (sf, df) if df is not None else None
        per = None
        if pair is None:
            per = [[(_rows_of(sv[layer][p], sg[p]), _rows_of(dviews[layer][p], dgeo[p])) for p in range(P)]
                   for layer in range(L)]
        plans.append((pair, per))
    same = [[_same_encoding(s.layout, dl, p) for p in range(P)] for s in srcs]
    max_h = max(s.h_slice.stop - s.h_slice.start for s in srcs)
    fused_any = any(pair is not None for pair, _ in plans)
    # scratch: per layer plane the gathered rows plus, when casting (fp8 through float32), 4 bytes per element; a
    # fused pair gathers every layer plane at once, with a scratch of CHUNK_BYTES per 16 layer planes
    per_token = max_h * D * 8 * (max(1, L * P // 16) if fused_any else 1)
    chunk = _chunk_tokens(device, per_token, Nd, *[s.layout.block_size for s in srcs])
    work = _Work(device)
    for a, b in _ranges(skip_tokens, num_tokens, chunk):
        t = torch.arange(a, b, device=device)
        dtok = [db[t // Nd] * g[0] + (t % Nd) * g[1] for g in dgeo]
        for i, (s, sg, (pair, per)) in enumerate(zip(srcs, sgeo, plans)):
            Ns = s.layout.block_size
            sblk, soff = s.bids[t // Ns], t % Ns
            nh = s.h_slice.stop - s.h_slice.start
            dh0 = d_slice.start + s.x_slice.start
            hs = torch.arange(s.h_slice.start, s.h_slice.stop, device=device)
            hd = torch.arange(nh, device=device) + dh0
            sidx = [((sblk * g[0] + soff * g[1])[:, None] + hs[None, :] * g[2]).reshape(-1) for g in sg]
            didx = [(dtok[p][:, None] + hd[None, :] * dgeo[p][2]).reshape(-1) for p in range(P)]
            n = sidx[0].numel()
            if pair is not None:
                _move_fused(pair[0], pair[1], sidx[0], didx[0], n, s.layout, dl, work)
                continue
            for layer in range(L):
                for p in range(P):
                    src_rows, dst_rows = per[layer][p]
                    if same[i][p]:
                        sw, dw = _widen(src_rows, dst_rows.view(src_rows.dtype))
                        g = work.get("g", sw.dtype, (n, sw.shape[1]))
                        torch.index_select(sw, 0, sidx[p], out=g)
                        dw.index_copy_(0, didx[p], g)
                    else:
                        g = work.get("g", src_rows.dtype, (n, src_rows.shape[1]))
                        torch.index_select(src_rows, 0, sidx[p], out=g)
                        y = work.get("y", dst_rows.dtype, (n, dst_rows.shape[1]))
                        _copy_cast(y, g, s.layout, dl, p)
                        dst_rows.index_copy_(0, didx[p], y)
    return True


def _move_fused(src: tuple[torch.Tensor, list[int]], dst: tuple[torch.Tensor, list[int]], sidx: torch.Tensor,
                didx: torch.Tensor, n: int, sl: KVLayout, dl: KVLayout, work: _Work) -> None:
    """Every (layer, plane) segment of one chunk in one gather and one scatter: row ``base[seg] + idx``, segments
    in (layer, plane) order on both sides; one cast per plane in between when the encodings differ."""
    srows, sbase = src
    drows, dbase = dst
    P = dl.num_planes
    S = len(sbase)
    s_all = (torch.tensor(sbase, dtype=torch.long, device=sidx.device)[:, None] + sidx[None, :]).reshape(-1)
    d_all = (torch.tensor(dbase, dtype=torch.long, device=didx.device)[:, None] + didx[None, :]).reshape(-1)
    W = srows.shape[1]
    if all(_same_encoding(sl, dl, p) for p in range(P)):
        sw, dw = _widen(srows, drows.view(srows.dtype))
        g = work.get("g", sw.dtype, (S * n, sw.shape[1]))
        torch.index_select(sw, 0, s_all, out=g)
        dw.index_copy_(0, d_all, g)
        return
    g = work.get("g", srows.dtype, (S * n, W))
    torch.index_select(srows, 0, s_all, out=g)
    y = work.get("y", drows.dtype, (S * n, W))
    if not sl.is_fp8 and not dl.is_fp8:
        _copy_cast(y, g, sl, dl, 0)  # one dtype cast for every plane
    else:  # the K and V scales differ: one cast per plane over its segments
        gv, yv = g.view(S // P, P, n, W), y.view(S // P, P, n, W)
        for p in range(P):
            _copy_cast(yv[:, p], gv[:, p], sl, dl, p)
    drows.index_copy_(0, d_all, y)
