"""The row path (accelerators): (token, head) rows moved with one gather and one scatter per layer plane.

In every arrangement whose ``D`` elements of one (token, head) are contiguous, a plane of one layer is a set of
rows of ``D`` elements, and the row of (block ``b``, token-in-block ``n``, local head ``h``) is
``b * sB + n * sN + h * sH`` (the view's strides divided by ``D``). Per chunk of tokens the source and destination
row indices are computed once, as index tensors on the device, and reused for every layer: each layer plane is then
one ``index_select`` into scratch (plus one cast when the encodings differ) and one ``index_copy_`` into the
destination. Only tokens ``skip_tokens..num_tokens`` of the destination's heads are written, so nothing else in the
destination changes. On a GPU this replaces the chunked path's block gathers, token re-ordering copies and edge
writes (about ten kernels per layer plane, most of them strided) by two or three (measured on an H200: 1.6-2.5x the
chunked path, ``benchmarks/kv_convert_device.py``). When every layer plane of a side lies in one buffer (vLLM's
per-layer views of one allocation, the PD consumer's staging region), the row index adds each layer plane's first
row and one gather and one scatter move every layer plane of a chunk at once (:func:`_move_fused`).

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
    B, N, h, D = view.shape
    R = (B - 1) * geo[0] + (N - 1) * geo[1] + (h - 1) * geo[2] + 1
    return view.as_strided((R, D), (D, 1), view.storage_offset())


def _strides(views: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    return [tuple(v.stride()) for v in views]


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
    B, N, h, _ = v0.shape
    R = max(base) + (B - 1) * geo[0] + (N - 1) * geo[1] + (h - 1) * geo[2] + 1
    return v0.as_strided((R, D), (D, 1), o0), base


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
    # one side whose every (layer, plane) view shares a storage and one geometry is gathered/scattered in one op for
    # all of them (the segment's first row added to the row index), else per layer plane
    dflat = [v for layer in dviews for v in layer]
    dfused = _fused(dflat, dgeo[0]) if all(g == dgeo[0] for g in dgeo) else None
    sfused = [_fused([v for layer in sv for v in layer], sg[0]) if all(g == sg[0] for g in sg) else None
              for sv, sg in zip(sviews, sgeo)]
    fused = [dfused is not None and f is not None for f in sfused]
    # per layer plane row tensors (and their widest-integer forms for planes moved without a cast), for the
    # source ranks that are not fused with the destination
    drows = [[_rows_of(v, g) for v, g in zip(layer, dgeo)] for layer in dviews] if not all(fused) else []
    srows = [[[_rows_of(v, g) for v, g in zip(layer, sg)] for layer in sv] if not f else []
             for sv, sg, f in zip(sviews, sgeo, fused)]
    same = [[_same_encoding(s.layout, dl, p) for p in range(P)] for s in srcs]
    wide: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for i in range(len(srcs)):
        for layer in range(L if not fused[i] else 0):
            for p in range(P):
                if same[i][p]:
                    sr = srows[i][layer][p]
                    wide[i, layer, p] = _widen(sr, drows[layer][p].view(sr.dtype))
    max_h = max(s.h_slice.stop - s.h_slice.start for s in srcs)
    fused_any = any(fused)
    # scratch: per layer plane the gathered rows plus, when casting (fp8 through float32), 4 bytes per element; a
    # fused pair gathers every layer plane at once, with a scratch of CHUNK_BYTES per 16 layer planes
    per_token = max_h * D * 8 * (max(1, L * P // 16) if fused_any else 1)
    chunk = _chunk_tokens(device, per_token, Nd, *[s.layout.block_size for s in srcs])
    work = _Work(device)
    if fused_any:
        assert dfused is not None
        d_base = torch.tensor(dfused[1], dtype=torch.long, device=device)
    for a, b in _ranges(skip_tokens, num_tokens, chunk):
        t = torch.arange(a, b, device=device)
        dbase = [db[t // Nd] * g[0] + (t % Nd) * g[1] for g in dgeo]
        for i, (s, sg) in enumerate(zip(srcs, sgeo)):
            Ns = s.layout.block_size
            sblk, soff = s.bids[t // Ns], t % Ns
            nh = s.h_slice.stop - s.h_slice.start
            hs = torch.arange(s.h_slice.start, s.h_slice.stop, device=device)
            hd = torch.arange(nh, device=device) + (d_slice.start + s.x_slice.start)
            sidx = [((sblk * g[0] + soff * g[1])[:, None] + hs[None, :] * g[2]).reshape(-1) for g in sg]
            didx = [(dbase[p][:, None] + hd[None, :] * dgeo[p][2]).reshape(-1) for p in range(P)]
            n = sidx[0].numel()
            if fused[i]:
                _move_fused(sfused[i], dfused, d_base, sidx[0], didx[0], n, s.layout, dl, work)
                continue
            for layer in range(L):
                for p in range(P):
                    if same[i][p]:
                        sw, dw = wide[i, layer, p]
                        g = work.get("g", sw.dtype, (n, sw.shape[1]))
                        torch.index_select(sw, 0, sidx[p], out=g)
                        dw.index_copy_(0, didx[p], g)
                    else:
                        src_rows, dst_rows = srows[i][layer][p], drows[layer][p]
                        g = work.get("g", src_rows.dtype, (n, D))
                        torch.index_select(src_rows, 0, sidx[p], out=g)
                        y = work.get("y", dst_rows.dtype, (n, D))
                        _copy_cast(y, g, s.layout, dl, p)
                        dst_rows.index_copy_(0, didx[p], y)
    return True


def _move_fused(src: tuple[torch.Tensor, list[int]], dst: tuple[torch.Tensor, list[int]], d_base: torch.Tensor,
                sidx: torch.Tensor, didx: torch.Tensor, n: int, sl: KVLayout, dl: KVLayout, work: _Work) -> None:
    """Every (layer, plane) segment of one chunk in one gather and one scatter: row ``base[seg] + idx``, segments
    in (layer, plane) order on both sides; one cast per plane in between when the encodings differ."""
    srows, sbase = src
    drows, _ = dst
    P = dl.num_planes
    S = len(sbase)
    s_base = torch.tensor(sbase, dtype=torch.long, device=sidx.device)
    s_all = (s_base[:, None] + sidx[None, :]).reshape(-1)
    d_all = (d_base[:, None] + didx[None, :]).reshape(-1)
    D = srows.shape[1]
    if all(_same_encoding(sl, dl, p) for p in range(P)):
        sw, dw = _widen(srows, drows.view(srows.dtype))
        g = work.get("g", sw.dtype, (S * n, sw.shape[1]))
        torch.index_select(sw, 0, s_all, out=g)
        dw.index_copy_(0, d_all, g)
        return
    g = work.get("g", srows.dtype, (S * n, D))
    torch.index_select(srows, 0, s_all, out=g)
    y = work.get("y", drows.dtype, (S * n, D))
    if not sl.is_fp8 and not dl.is_fp8:
        _copy_cast(y, g, sl, dl, 0)  # one dtype cast for every plane
    else:  # the K and V scales differ: one cast per plane over its segments
        gv, yv = g.view(S // P, P, n, D), y.view(S // P, P, n, D)
        for p in range(P):
            _copy_cast(yv[:, p], gv[:, p], sl, dl, p)
    drows.index_copy_(0, d_all, y)
