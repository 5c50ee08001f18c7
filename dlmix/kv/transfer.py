"""Public conversion entry points :func:`convert` and :func:`convert_from_ranks`, and the choice of path.

Validation and planning are in :mod:`dlmix.kv.plan`; the one-pass CPU paths in :mod:`dlmix.kv.direct`; the general
path through scratch buffers in :mod:`dlmix.kv.chunked`. In every path no slot outside ``[skip_tokens, num_tokens)``
of the requested heads is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import plan as _plan
from .cast import _same_encoding
from .cells import _transfer_cells
from .chunked import _transfer_chunked
from .direct import _transfer_blocks, _transfer_direct, _transfer_lookup
from .layout import KVLayout
from .move import _flat2d, _token_rows
from .rows import _transfer_rows
from .plan import (
    _block_tensor,
    _check_layers,
    _head_slice,
    _prepare_sources,
    _require_compat,
    _resolve_heads,
    plan_heads,
)
from .views import _num_blocks, plane_views


def _transfer(sources: Sequence[tuple[KVLayout, Sequence[Any], Any, tuple[int, ...]]], dl: KVLayout,
              dst_caches: Sequence[Any], dst_block_ids: Any, num_tokens: int, skip_tokens: int,
              relax_fingerprint: bool) -> int:
    """Validate, then move tokens ``skip_tokens..num_tokens`` by the first path that applies: on CPU with segments
    of at least :data:`~dlmix.kv.plan.DIRECT_MIN_BYTES`, (1) one source, same encoding, a side without dense token
    rows: the cell gather (:mod:`dlmix.kv.cells`); (2) equal block sizes, same encoding: a compiled block
    copy (:mod:`dlmix.kv.kernels`), or without numba one ``index_select`` per run of destination blocks
    (:func:`~dlmix.kv.direct._transfer_blocks`); (3) one source, fp8
    re-encoding: the lookup table (:func:`~dlmix.kv.direct._transfer_lookup`); (4) no fp8 re-scaling: segment
    copies (:func:`~dlmix.kv.direct._transfer_direct`); otherwise (small blocks, fp8 from fp32) the chunked
    path through scratch (:mod:`dlmix.kv.chunked`). On an accelerator (CUDA, NPU), layouts that are not identical
    take the row path (:mod:`dlmix.kv.rows`: one gather and one scatter per layer plane) where it applies, else the
    chunked path. Returns the destination bytes written."""
    if not 0 <= skip_tokens <= num_tokens:
        raise ValueError(f"need 0 <= skip_tokens ({skip_tokens}) <= num_tokens ({num_tokens})")
    srcs, heads, device = _prepare_sources(sources, dl, num_tokens, relax_fingerprint)
    L = dl.model.num_layers
    if len(dst_caches) != L:
        raise ValueError(f"expected {L} per-layer destination caches, got {len(dst_caches)}")
    d_slice = _head_slice(dl, heads, "destination")
    dv0 = plane_views(dl, dst_caches[0])
    if dv0[0].device != device:
        raise ValueError(f"source caches are on {device}, destination on {dv0[0].device}")
    db = _block_tensor(dl, dst_block_ids, num_tokens, _num_blocks(dv0), device, "destination", True)
    if num_tokens == skip_tokens:
        return 0
    _check_layers(dl, dst_caches, db, "destination")
    for s in srcs:
        _check_layers(s.layout, s.caches, s.bids, "source")
    P, D, Nd = dl.num_planes, dl.model.head_size, dl.block_size
    s0 = srcs[0]
    sl = s0.layout
    identical = (len(srcs) == 1 and sl.arrangement == dl.arrangement and sl.block_size == Nd
                 and all(_same_encoding(sl, dl, p) for p in range(P))
                 and sl.heads_for_rank() == dl.heads_for_rank() == heads)
    fp8 = dl.is_fp8 or any(s.layout.is_fp8 for s in srcs)
    min_block = min([Nd] + [s.layout.block_size for s in srcs])
    min_heads = min(len(s.heads) for s in srcs)
    seg_bytes = min_block * min_heads * D * dl.itemsize * (P if identical else 1)
    same_blocks = all(s.layout.block_size == Nd and all(_same_encoding(s.layout, dl, p) for p in range(P))
                      for s in srcs)
    if (_plan.ROWS_ON_CPU if device.type == "cpu" else _plan.ROWS_ON_DEVICE) and not identical \
            and _transfer_rows(srcs, dl, dst_caches, db, skip_tokens, num_tokens, d_slice):
        return dl.wire_bytes(num_tokens - skip_tokens, heads)
    if device.type == "cpu" and len(srcs) == 1 and not identical \
            and seg_bytes >= _plan.DIRECT_MIN_BYTES and all(_same_encoding(sl, dl, p) for p in range(P)) \
            and not _rows_both(sl, s0.caches[0], dl, dst_caches[0]) \
            and _transfer_cells(s0, dl, dst_caches, db, skip_tokens, num_tokens, d_slice):
        return dl.wire_bytes(num_tokens - skip_tokens, heads)
    if device.type == "cpu" and same_blocks and not identical and seg_bytes >= _plan.DIRECT_MIN_BYTES:
        _transfer_blocks(srcs, dl, dst_caches, db, skip_tokens, num_tokens, d_slice)
        return dl.wire_bytes(num_tokens - skip_tokens, heads)
    if device.type == "cpu" and fp8 and len(srcs) == 1 and seg_bytes >= _plan.DIRECT_MIN_BYTES \
            and not identical and _transfer_lookup(s0, dl, dst_caches, db, skip_tokens, num_tokens, d_slice):
        return dl.wire_bytes(num_tokens - skip_tokens, heads)
    if device.type == "cpu" and (identical or not fp8) and seg_bytes >= _plan.DIRECT_MIN_BYTES:
        _transfer_direct(srcs, dl, dst_caches, db, skip_tokens, num_tokens, d_slice, identical)
        return dl.wire_bytes(num_tokens - skip_tokens, heads)
    _transfer_chunked(srcs, dl, dst_caches, db, skip_tokens, num_tokens, heads, d_slice, identical)
    return dl.wire_bytes(num_tokens - skip_tokens, heads)


def convert(src_layout: KVLayout, src_caches: Sequence[Any], src_block_ids: Any,
            dst_layout: KVLayout, dst_caches: Sequence[Any], dst_block_ids: Any,
            num_tokens: int, skip_tokens: int = 0, *, heads: Sequence[int] | None = None,
            relax_fingerprint: bool = False) -> int:
    """Copy one request's KV from one source rank into one destination rank, converting on the way.

    Writes tokens ``skip_tokens .. num_tokens - 1`` of every layer, for ``heads`` (consecutive global KV head ids,
    default: every destination head this source rank holds), into the destination blocks ``dst_block_ids``;
    nothing else in ``dst_caches`` changes (tokens below ``skip_tokens`` are the destination's own prefix-cache
    hit). Block sizes, arrangements, dtypes/scales and TP shardings may differ. For TP re-sharding prefer
    :func:`convert_from_ranks` (one pass writing whole destination blocks); calling this once per source rank
    is also correct. Source and destination tensors must be on one device and must not share memory.

    Returns the number of destination bytes written. Raises ValueError when the layouts are incompatible (the
    message lists :func:`check_compat`'s reasons), caches do not match their layouts, block tables are too short,
    out of range or (destination) repeat ids, or a rank does not hold the requested heads.
    """
    _require_compat(src_layout, dst_layout, relax_fingerprint)
    hs = _resolve_heads(src_layout, dst_layout, heads)
    return _transfer([(src_layout, src_caches, src_block_ids, hs)], dst_layout, dst_caches, dst_block_ids,
                     num_tokens, skip_tokens, relax_fingerprint)


def convert_from_ranks(sources: Sequence[tuple[KVLayout, Sequence[Any], Any]], dst_layout: KVLayout,
                       dst_caches: Sequence[Any], dst_block_ids: Any, num_tokens: int, skip_tokens: int = 0, *,
                       relax_fingerprint: bool = False) -> int:
    """Fill one destination rank from several source ranks (TP re-sharding), in one pass.

    ``sources`` holds ``(layout, per-layer caches, block_ids)`` for each source rank (any subset of ranks that
    together hold every destination head). :func:`plan_heads` picks which rank provides which heads; each head is
    written exactly once, and whole destination blocks are assembled before they are written. Returns destination
    bytes written. Raises ValueError as :func:`convert` and when a destination head is held by no source.
    """
    if not sources:
        raise ValueError("no source ranks given")
    plan = plan_heads([s[0] for s in sources], dst_layout)
    spec = [(sources[i][0], sources[i][1], sources[i][2], hs) for i, hs in plan]
    return _transfer(spec, dst_layout, dst_caches, dst_block_ids, num_tokens, skip_tokens, relax_fingerprint)


def _rows_both(sl: KVLayout, s_cache: Any, dl: KVLayout, d_cache: Any) -> bool:
    """True when every plane of both sides is dense token rows (``[slots, h*D]``): the ``memmove`` and
    ``index_select`` paths move those best, whole rows at a time."""
    for v in (*plane_views(sl, s_cache), *plane_views(dl, d_cache)):
        r = _token_rows(v)
        if r is None or _flat2d(r) is None:
            return False
    return True
