"""The row path (accelerators): (token, head) rows moved with one gather and one scatter per layer plane.

In every arrangement whose ``D`` elements of one (token, head) are contiguous, a plane of one layer is a set of
rows of ``D`` elements, and the row of (block ``b``, token-in-block ``n``, local head ``h``) is
``b * sB + n * sN + h * sH`` (the view's strides divided by ``D``). Per chunk of tokens the source and destination
row indices are computed once, as index tensors on the device, and reused for every layer: each layer plane is then
one ``index_select`` into scratch (plus one cast when the encodings differ) and one ``index_copy_`` into the
destination. Only tokens ``skip_tokens..num_tokens`` of the destination's heads are written, so nothing else in the
destination changes. On a GPU this replaces the chunked path's block gathers, token re-ordering copies and edge
writes (about ten kernels per layer plane, most of them strided) by two or three.

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


def _transfer_rows(srcs: Sequence[_Src], dl: KVLayout, dst_caches: Sequence[Any], db: torch.Tensor,
                   skip_tokens: int, num_tokens: int, d_slice: slice) -> bool:
    """Move tokens ``skip_tokens..num_tokens`` of every layer by row gathers (module doc). Returns False, having
    written nothing, when the row path does not apply."""
    P, Nd, L = dl.num_planes, dl.block_size, dl.model.num_layers
    D = dl.model.head_size
    dv0 = plane_views(dl, dst_caches[0])
    dgeo = [_geometry(v) for v in dv0]
    sv0 = [plane_views(s.layout, s.caches[0]) for s in srcs]
    sgeo = [[_geometry(v) for v in views] for views in sv0]
    if None in dgeo or any(None in g for g in sgeo):
        return False
    d_str = _strides(dv0)
    s_str = [_strides(v) for v in sv0]
    # the [R, D] row tensors of every layer plane, built once (every layer must share layer 0's strides; its own
    # offset is its row 0), and their widest-integer forms for planes moved without a cast
    drows: list[list[torch.Tensor]] = []
    srows: list[list[list[torch.Tensor]]] = [[] for _ in srcs]
    for layer in range(L):
        dv = dv0 if layer == 0 else plane_views(dl, dst_caches[layer])
        if _strides(dv) != d_str:
            return False
        drows.append([_rows_of(v, g) for v, g in zip(dv, dgeo)])
        for i, s in enumerate(srcs):
            sv = sv0[i] if layer == 0 else plane_views(s.layout, s.caches[layer])
            if _strides(sv) != s_str[i]:
                return False
            srows[i].append([_rows_of(v, g) for v, g in zip(sv, sgeo[i])])
    same = [[_same_encoding(s.layout, dl, p) for p in range(P)] for s in srcs]
    wide: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for i in range(len(srcs)):
        for layer in range(L):
            for p in range(P):
                if same[i][p]:
                    sr = srows[i][layer][p]
                    wide[i, layer, p] = _widen(sr, drows[layer][p].view(sr.dtype))
    device = db.device
    max_h = max(s.h_slice.stop - s.h_slice.start for s in srcs)
    # scratch per layer plane: the gathered rows plus, when casting (fp8 through float32), 4 bytes per element
    chunk = _chunk_tokens(device, max_h * D * 8, Nd, *[s.layout.block_size for s in srcs])
    work = _Work(device)
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
