"""Planning a transfer (torch for index tensors only): block tables, head plans, token segments, source ranks.

A request's block table maps token ``t`` to block ``block_ids[t // N]`` at offset ``t % N``. The token range
``skip_tokens..num_tokens`` is split at every source and destination block edge into *segments*
(:func:`_segments`), each inside one source block and one destination block; the copy paths
(:mod:`dlmix.kv.direct`, :mod:`dlmix.kv.chunked`) move segments, runs of them, or whole blocks. The tunables
:data:`CHUNK_BYTES` and :data:`DIRECT_MIN_BYTES` choose between those paths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .layout import KVLayout, check_compat
from .views import _num_blocks, plane_views


#: Target bytes of one scratch buffer (per plane and chunk): small on CPU so it stays in cache; on CUDA large enough
#: for few kernel launches but bounded, since a handful of such buffers live on the device during a call.
CHUNK_BYTES = {"cpu": 4 << 20, "cuda": 32 << 20}


#: Take the row path (:mod:`dlmix.kv.rows`) on accelerators where it applies (False: the chunked path, the
#: baseline ``benchmarks/kv_convert_device.py`` compares it with).
ROWS_ON_DEVICE = True

#: Take the row path on CPU too: tests set it to check that path against the oracle on machines without a GPU.
ROWS_ON_CPU = False


#: On CPU, segments of at least this many bytes are moved directly, one ``memmove`` or ``_foreach_copy_`` entry
#: each (one pass), instead of the two-pass gather/scatter through scratch buffers (measured on the 2-core dev
#: box, one thread, 64 KiB blocks, shuffled ids: ``memmove`` 0.8-0.98x of a flat copy, ``index_select`` +
#: ``index_copy_`` 0.4-0.6x). Below it the per-call overhead of the direct path dominates.
DIRECT_MIN_BYTES = 32 << 10


def _block_tensor(layout: KVLayout, block_ids: Any, num_tokens: int, num_blocks: int, device: torch.device,
                  what: str, distinct: bool) -> torch.Tensor:
    need = math.ceil(num_tokens / layout.block_size)
    ids = torch.as_tensor(block_ids, dtype=torch.int64).flatten()
    if ids.numel() < need:
        raise ValueError(f"{what} block table has {ids.numel()} blocks; {num_tokens} tokens at block size "
                         f"{layout.block_size} need {need}")
    ids = ids[:need].cpu()
    if need:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_blocks:
            raise ValueError(f"{what} block ids must lie in 0..{num_blocks - 1}, got {lo}..{hi}")
        if distinct and torch.unique(ids).numel() != need:
            raise ValueError(f"{what} block table repeats a block id")
    return ids.to(device)


def plan_heads(sources: Sequence[KVLayout], destination: KVLayout) -> list[tuple[int, tuple[int, ...]]]:
    """Which source rank provides which of the destination rank's KV heads.

    Returns ``[(source_index, heads), ...]``, ``heads`` a run of consecutive global head ids, covering every head of
    ``destination.heads_for_rank()`` exactly once (the first source holding a head provides it, so replicated heads
    are read once). Raises ValueError naming the heads that no source holds.
    """
    want = destination.heads_for_rank()
    owner: dict[int, int] = {}
    for i, s in enumerate(sources):
        for h in s.heads_for_rank():
            owner.setdefault(h, i)
    missing = [h for h in want if h not in owner]
    if missing:
        raise ValueError(f"destination rank {destination.tp_rank} needs KV heads {missing} that no source rank holds")
    plan: list[tuple[int, tuple[int, ...]]] = []
    for h in want:
        if plan and plan[-1][0] == owner[h] and plan[-1][1][-1] == h - 1:
            plan[-1] = (plan[-1][0], plan[-1][1] + (h,))
        else:
            plan.append((owner[h], (h,)))
    return plan


def _head_slice(layout: KVLayout, heads: Sequence[int], what: str) -> slice:
    local = layout.heads_for_rank()
    try:
        i0 = local.index(heads[0])
    except ValueError:
        raise ValueError(f"{what} rank {layout.tp_rank} does not hold KV head {heads[0]} (holds {list(local)})") \
            from None
    sl = slice(i0, i0 + len(heads))
    if tuple(local[sl]) != tuple(heads):
        raise ValueError(f"{what} rank {layout.tp_rank} does not hold KV heads {list(heads)} as one run "
                         f"(holds {list(local)})")
    return sl


def _resolve_heads(src: KVLayout | None, dst: KVLayout, heads: Sequence[int] | None) -> tuple[int, ...]:
    if heads is None:
        d = dst.heads_for_rank()
        if src is None:
            return tuple(d)
        s = set(src.heads_for_rank())
        heads = [h for h in d if h in s]
        if not heads:
            raise ValueError(f"source rank {src.tp_rank} holds none of destination rank {dst.tp_rank}'s KV heads "
                             f"{list(d)}")
    heads = tuple(int(h) for h in heads)
    if not heads:
        raise ValueError("heads must name at least one KV head")
    if list(heads) != list(range(heads[0], heads[0] + len(heads))):
        raise ValueError(f"heads must be consecutive ascending global ids, got {list(heads)}")
    return heads


def _require_compat(src: KVLayout, dst: KVLayout, relax_fingerprint: bool) -> None:
    c = check_compat(src, dst, relax_fingerprint=relax_fingerprint)
    if not c.ok:
        raise ValueError("incompatible KV layouts: " + "; ".join(c.reasons))


def _chunk_tokens(device: torch.device, bytes_per_token: int, *block_sizes: int) -> int:
    target = CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"])
    step = 1
    for n in block_sizes:
        step = step * n // math.gcd(step, n)
    if step > 4096:
        step = max(block_sizes)
    per = max(1, target // max(1, bytes_per_token))
    return max(step, per // step * step)


def _ranges(a: int, b: int, chunk: int) -> list[tuple[int, int]]:
    """Split ``a..b`` at absolute multiples of ``chunk`` (so chunk edges are block edges)."""
    out = []
    t = a
    while t < b:
        e = min(b, (t // chunk + 1) * chunk)
        out.append((t, e))
        t = e
    return out


def _segments(sb: list[int], db: list[int], Ns: int, Nd: int, a: int, b: int) -> list[tuple[int, int, int]]:
    """Split tokens ``a..b`` at every source and destination block edge.

    Returns ``(src_slot, dst_slot, length)`` per segment, slots being ``block_id * block_size + offset``; each
    segment lies inside one source block and one destination block.
    """
    out = []
    t = a
    while t < b:
        e = min(b, (t // Ns + 1) * Ns, (t // Nd + 1) * Nd)
        out.append((sb[t // Ns] * Ns + t % Ns, db[t // Nd] * Nd + t % Nd, e - t))
        t = e
    return out


def _merge(segs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Join segments whose source and destination slots both continue (valid for token-row views only)."""
    out: list[tuple[int, int, int]] = []
    for s, d, n in segs:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, d, n))
    return out


class _SegPlan:
    """Per-source segment lists, computed once and reused for every layer and plane.

    ``druns``: maximal token runs whose destination slots are consecutive, as ``(seg_lo, seg_hi, tok_lo, tok_hi,
    dst_slot)``: segments ``seg_lo..seg_hi`` of ``segs`` and their tokens relative to the first one. A run whose
    source slots are scattered is moved with one ``index_select(..., out=destination rows)`` (one pass).
    """

    def __init__(self, segs: list[tuple[int, int, int]], Ns: int, Nd: int) -> None:
        self.merged = _merge(segs)
        self.blockwise = [(s // Ns, s % Ns, s % Ns + n, d // Nd, d % Nd, d % Nd + n) for s, d, n in segs]
        self.druns: list[tuple[int, int, int, int, int]] = []
        tok = 0
        for i, (s, d, n) in enumerate(self.merged):
            r = self.druns[-1] if self.druns else None
            if r is not None and r[4] + (r[3] - r[2]) == d:
                self.druns[-1] = (r[0], i + 1, r[2], tok + n, r[4])
            else:
                self.druns.append((i, i + 1, tok, tok + n, d))
            tok += n
        self.s_slots = torch.cat([torch.arange(s, s + n) for s, _, n in self.merged]) if segs else None
        self._dev: dict[torch.device, torch.Tensor] = {}

    def slots_on(self, device: torch.device) -> torch.Tensor:
        assert self.s_slots is not None
        if device not in self._dev:
            self._dev[device] = self.s_slots.to(device)
        return self._dev[device]


def _block_runs(db: list[int], f0: int, f1: int) -> list[tuple[int, list[int]]]:
    """Full request blocks ``f0..f1`` grouped by runs of consecutive destination ids (ascending):
    ``(first_dst_id, [block positions in the request])``."""
    runs: list[tuple[int, list[int]]] = []
    for i in sorted(range(f0, f1), key=db.__getitem__):
        if runs and runs[-1][0] + len(runs[-1][1]) == db[i]:
            runs[-1][1].append(i)
        else:
            runs.append((db[i], [i]))
    return runs


class _Src:
    """One source rank in a transfer: its layout, per-layer caches, block table tensor and the heads it gives."""

    def __init__(self, layout: KVLayout, caches: Sequence[Any], bids: torch.Tensor, heads: tuple[int, ...],
                 x_slice: slice) -> None:
        self.layout, self.caches, self.bids, self.heads = layout, caches, bids, heads
        self.h_slice = _head_slice(layout, heads, "source")
        self.x_slice = x_slice  # where its heads go in the token-major chunk buffer


def _prepare_sources(sources: Sequence[tuple[KVLayout, Sequence[Any], Any, tuple[int, ...]]], dl: KVLayout,
                     end: int, relax_fingerprint: bool) -> tuple[list[_Src], tuple[int, ...], torch.device]:
    """Validate source ranks; returns them, the union of their heads (consecutive) and the device."""
    out: list[_Src] = []
    union: list[int] = []
    device = None
    for lay, caches, bids, heads in sources:
        _require_compat(lay, dl, relax_fingerprint)
        L = lay.model.num_layers
        if len(caches) != L:
            raise ValueError(f"expected {L} per-layer source caches, got {len(caches)}")
        v0 = plane_views(lay, caches[0])
        if device is None:
            device = v0[0].device
        elif v0[0].device != device:
            raise ValueError(f"source caches are on {v0[0].device} and {device}")
        sb = _block_tensor(lay, bids, end, _num_blocks(v0), device, "source", False)
        union.extend(heads)
        out.append((lay, caches, sb, heads))  # type: ignore[arg-type]
    union_t = tuple(sorted(union))
    if len(set(union_t)) != len(union_t) or list(union_t) != list(range(union_t[0], union_t[0] + len(union_t))):
        raise ValueError(f"source heads {union_t} must be distinct and consecutive")
    srcs = []
    for lay, caches, sb, heads in out:  # type: ignore[misc]
        i0 = union_t.index(heads[0])
        srcs.append(_Src(lay, caches, sb, heads, slice(i0, i0 + len(heads))))
    assert device is not None
    return srcs, union_t, device


def _sig(t: Any) -> tuple | None:
    """``(shape, strides, dtype)`` of a per-layer cache tensor (None for ``(K, V)`` tuples)."""
    return (tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else None


def _check_layers(layout: KVLayout, caches: Sequence[Any], bids: torch.Tensor, what: str) -> None:
    """Every layer's cache matches ``layout`` and holds every block id in ``bids`` (ids were checked against
    layer 0 only; the CPU paths move raw memory). Layers shaped and strided like the previous checked one are
    not re-checked. Raises ValueError."""
    need = int(bids.max()) + 1 if bids.numel() else 0
    last: Any = ()
    for layer, c in enumerate(caches):
        sig = tuple(_sig(x) for x in c) if isinstance(c, (tuple, list)) else _sig(c)
        if sig == last:
            continue
        nb = _num_blocks(plane_views(layout, c))
        if nb < need:
            raise ValueError(f"{what} layer {layer} cache holds {nb} blocks; the block table uses id {need - 1}")
        last = sig
