"""Wire form of KV for transports: :func:`pack`, :func:`unpack`, :func:`wire_chunks`.

A contiguous buffer ordered ``[L, P, T, h, D]`` (layers, planes K then V, tokens ``start..end`` in order, the
destination heads given as ``heads`` in ascending global id, head size) in the destination dtype (fp8 already
divided by the destination scale), raw little-endian element bytes, no header. Its size is
:meth:`~dlmix.kv.layout.KVLayout.wire_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import plan as _plan
from .cast import _same_encoding
from .chunked import _fill_chunk, _flush_chunk
from .layout import KVLayout
from .move import _copy_segments, _Work
from .plan import (
    _block_tensor,
    _check_layers,
    _chunk_tokens,
    _head_slice,
    _prepare_sources,
    _ranges,
    _require_compat,
    _resolve_heads,
    _SegPlan,
    _segments,
)
from .views import _num_blocks, _storage_dtype, plane_views


def wire_chunks(dst_layout: KVLayout, start: int, end: int, max_bytes: int,
                heads: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Split tokens ``start..end`` into ranges whose wire form fits ``max_bytes`` (e.g. a 64 MiB staging buffer).

    Ranges end on destination block boundaries where the budget allows. Raises ValueError when even one token
    does not fit.
    """
    if heads is not None and not len(heads):
        raise ValueError("heads must name at least one KV head")
    per = dst_layout.wire_bytes(1, heads)
    if per > max_bytes:
        raise ValueError(f"one token needs {per} wire bytes, more than the {max_bytes}-byte budget")
    n = max_bytes // per
    if n >= dst_layout.block_size:
        n -= n % dst_layout.block_size
    return _ranges(start, end, n) if end > start else []


def pack(src_layout: KVLayout, src_caches: Sequence[Any], src_block_ids: Any, dst_layout: KVLayout,
         start: int, end: int, *, heads: Sequence[int] | None = None, out: torch.Tensor | None = None,
         relax_fingerprint: bool = False) -> torch.Tensor:
    """Wire form of tokens ``start..end`` for one destination rank, read from one source rank.

    ``heads`` (consecutive global ids) defaults to the destination heads this source holds. The result is a
    ``uint8`` tensor of :meth:`KVLayout.wire_bytes` ``(end - start, heads)`` bytes ordered
    ``[layers, planes, tokens, heads, head_size]`` in the destination dtype. ``out`` (a contiguous ``uint8`` tensor
    of at least that many bytes on the source device, e.g. a staging buffer) receives the bytes and its leading
    slice is returned. Raises ValueError as :func:`convert`, or when ``out`` is too small or not contiguous.
    """
    _require_compat(src_layout, dst_layout, relax_fingerprint)
    hs = _resolve_heads(src_layout, dst_layout, heads)
    _head_slice(dst_layout, hs, "destination")
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start ({start}) <= end ({end})")
    srcs, _, device = _prepare_sources([(src_layout, src_caches, src_block_ids, hs)], dst_layout, end,
                                       relax_fingerprint)
    L, P, D, T = dst_layout.model.num_layers, dst_layout.num_planes, dst_layout.model.head_size, end - start
    nbytes = dst_layout.wire_bytes(T, hs)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() < nbytes:
        raise ValueError(f"out must be a contiguous uint8 tensor of at least {nbytes} bytes")
    if out.device != device:
        raise ValueError(f"out is on {out.device}, the source caches on {device}")
    buf = out[:nbytes]
    if T == 0:
        return buf
    wire = buf.view(_storage_dtype(dst_layout)).view(L, P, T, len(hs), D)
    s0 = srcs[0]
    _check_layers(src_layout, src_caches, s0.bids, "source")
    same = all(_same_encoding(src_layout, dst_layout, p) for p in range(P))
    seg_bytes = min(src_layout.block_size, T) * len(hs) * D * dst_layout.itemsize
    if device.type == "cpu" and (same or not (src_layout.is_fp8 or dst_layout.is_fp8)) \
            and seg_bytes >= _plan.DIRECT_MIN_BYTES:
        Ns = src_layout.block_size
        segs = [(a, d - start, k) for a, d, k in _segments(s0.bids.tolist(), [0], Ns, end, start, end)]
        plan = _SegPlan(segs, Ns, T)
        for layer in range(L):
            for p, sv in enumerate(plane_views(src_layout, src_caches[layer])):
                svp, dvp = sv[:, :, s0.h_slice], wire[layer, p].unsqueeze(0)
                _copy_segments(dvp, svp.view(dvp.dtype) if _same_encoding(src_layout, dst_layout, p) else svp,
                               plan)
        return buf
    chunk = _chunk_tokens(device, len(hs) * D * max(src_layout.itemsize, dst_layout.itemsize) * P,
                          src_layout.block_size)
    work = _Work(device)
    for layer in range(L):
        for a, b in _ranges(start, end, chunk):
            _fill_chunk(srcs, layer, a, b, dst_layout, [wire[layer, p, a - start: b - start] for p in range(P)],
                        work)
    return buf


def unpack(dst_layout: KVLayout, dst_caches: Sequence[Any], dst_block_ids: Any, wire: Any, start: int, end: int,
           *, heads: Sequence[int] | None = None) -> int:
    """Write a :func:`pack` buffer for tokens ``start..end`` into the destination blocks ``dst_block_ids``.

    ``wire``: ``uint8`` tensor (any device) or a bytes-like object, exactly :meth:`KVLayout.wire_bytes`
    ``(end - start, heads)`` bytes; ``heads`` defaults to all destination heads and must match what was packed.
    Only tokens ``start..end`` of those heads are written. Returns bytes consumed. Raises ValueError on a size
    mismatch, a bad block table or heads the destination rank does not hold.
    """
    hs = _resolve_heads(None, dst_layout, heads)
    d_slice = _head_slice(dst_layout, hs, "destination")
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start ({start}) <= end ({end})")
    L, P, D, T = dst_layout.model.num_layers, dst_layout.num_planes, dst_layout.model.head_size, end - start
    if len(dst_caches) != L:
        raise ValueError(f"expected {L} per-layer destination caches, got {len(dst_caches)}")
    nbytes = dst_layout.wire_bytes(T, hs)
    if not isinstance(wire, torch.Tensor):
        wire = torch.frombuffer(bytearray(wire), dtype=torch.uint8) if len(wire) else torch.empty(0, dtype=torch.uint8)
    if wire.dtype != torch.uint8 or wire.numel() != nbytes:
        raise ValueError(f"wire buffer must be {nbytes} uint8 bytes for tokens {start}..{end} and heads "
                         f"{list(hs)}, got {wire.numel()} {wire.dtype}")
    if T == 0:
        return 0
    dv0 = plane_views(dst_layout, dst_caches[0])
    device = dv0[0].device
    db = _block_tensor(dst_layout, dst_block_ids, end, _num_blocks(dv0), device, "destination", True)
    _check_layers(dst_layout, dst_caches, db, "destination")
    w = wire.to(device).contiguous().view(_storage_dtype(dst_layout)).view(L, P, T, len(hs), D)
    Nd = dst_layout.block_size
    if device.type == "cpu" and min(Nd, T) * len(hs) * D * dst_layout.itemsize >= _plan.DIRECT_MIN_BYTES:
        segs = [(a - start, d, k) for a, d, k in _segments([0], db.tolist(), end, Nd, start, end)]
        plan = _SegPlan(segs, T, Nd)
        for layer in range(L):
            for p, dv in enumerate(plane_views(dst_layout, dst_caches[layer])):
                _copy_segments(dv[:, :, d_slice], w[layer, p].unsqueeze(0), plan)
        return nbytes
    chunk = _chunk_tokens(device, len(hs) * D * dst_layout.itemsize * P, dst_layout.block_size)
    work = _Work(device)
    for layer in range(L):
        for a, b in _ranges(start, end, chunk):
            _flush_chunk(dst_layout, dst_caches[layer], db, a, b,
                         [w[layer, p, a - start: b - start] for p in range(P)], d_slice, work)
    return nbytes
