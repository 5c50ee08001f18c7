"""KV cache conversion between any two :class:`~dlmix.kv.layout.KVLayout` (torch; CPU or CUDA tensors).

Terms used below: ``N`` = block size (tokens), ``H`` = KV heads on a rank, ``D`` = head size, ``L`` = layers,
``P`` = planes (2 = K, V; 1 for an MLA latent). Per-layer caches are a ``list`` with one entry per layer: a tensor,
or a ``(K, V)`` tuple for separate-K/V arrangements (see :mod:`dlmix.kv.layout`). fp8 caches may be given as the
torch fp8 dtype or as ``uint8`` storage. Block ids are the request's block table (``list[int]`` or an int tensor):
token ``t`` lives in block ``block_ids[t // N]`` at offset ``t % N``.

How data moves (vectorized, a Python loop only over layers, planes and bounded chunks, never over tokens or
heads): every arrangement exposes per plane a strided *view* ``[num_blocks, N, H, D]`` of the engine tensor. A
chunk of tokens is gathered from whole source blocks with ``index_select`` into a token-major temporary
``[T, h, D]``, cast if the dtypes differ, and written with ``index_copy_`` into whole destination blocks; tokens in
partially covered destination blocks (prefix ``skip_tokens``, the last partial block, chunk edges) go through
``index_copy_`` on a token-major view or ``index_put_`` with (block, offset) pairs, so no slot outside
``[skip_tokens, num_tokens)`` is ever written. Identical layouts copy raw blocks (K and V together).
Chunks are bounded (:data:`CHUNK_BYTES`) so temporaries stay cache-resident on CPU.

Wire form (:func:`pack` / :func:`unpack`): a contiguous buffer ordered ``[L, P, T, h, D]`` (layers, planes K then
V, tokens ``start..end`` in order, the destination heads given as ``heads`` in ascending global id, head size) in
the destination dtype (fp8 already divided by the destination scale), raw little-endian element bytes, no header.
Its size is :meth:`KVLayout.wire_bytes`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .layout import KVLayout, check_compat

__all__ = [
    "CHUNK_BYTES",
    "allocate",
    "cast_plane",
    "convert",
    "convert_from_ranks",
    "pack",
    "plan_heads",
    "plane_views",
    "read_kv",
    "torch_dtype",
    "unpack",
    "wire_chunks",
    "write_kv",
]

#: Target bytes of one temporary (per plane and chunk): small on CPU so it stays in cache, large on CUDA.
CHUNK_BYTES = {"cpu": 4 << 20, "cuda": 256 << 20}

_TORCH_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype of ``layout.dtype`` (``fp8_e4m3`` -> ``torch.float8_e4m3fn``)."""
    return _TORCH_DTYPES[layout.dtype]


# ---------------------------------------------------------------------------------------------------------------
# allocation and views
# ---------------------------------------------------------------------------------------------------------------
def allocate(layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu",
             fill: float | None = 0.0, storage_uint8: bool = False) -> list[Any]:
    """Allocate per-layer caches of ``num_blocks`` blocks shaped as the engine would (:meth:`KVLayout.layer_shape`).

    ``fill`` sets every element (``None`` leaves memory uninitialized). ``storage_uint8`` stores fp8 as ``uint8``
    like vLLM. Returns a list of ``L`` tensors or ``(K, V)`` tuples. Used by tests and benchmarks.
    """
    dt = torch_dtype(layout)

    def one(shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.empty(shape, dtype=dt, device=device)
        if fill is not None:
            if layout.is_fp8:
                t.copy_(torch.full(shape, float(fill), dtype=torch.float32, device=device).to(dt))
            else:
                t.fill_(fill)
        return t.view(torch.uint8) if (storage_uint8 and layout.is_fp8) else t

    shape = layout.layer_shape(num_blocks)
    out: list[Any] = []
    for _ in range(layout.model.num_layers):
        out.append((one(shape[0]), one(shape[1])) if layout.separate_kv else one(shape))  # type: ignore[arg-type]
    return out


def _check_tensor(layout: KVLayout, t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    dt = torch_dtype(layout)
    ok = t.dtype == dt or (layout.is_fp8 and t.dtype in (torch.uint8, torch.int8))
    if not ok:
        raise ValueError(f"{what} has dtype {t.dtype}, layout says {layout.dtype}")
    # fp8 is moved as uint8: index_select/index_copy_ have no fp8 kernels on CPU
    return t.view(torch.uint8) if layout.is_fp8 else t


def plane_views(layout: KVLayout, layer_cache: Any) -> tuple[torch.Tensor, ...]:
    """Strided views ``[num_blocks, N, H, D]`` (token-in-block, local head, element) of one layer's cache.

    Returns ``(K, V)`` for MHA/GQA and ``(latent,)`` for MLA (``H = 1``). The views alias the engine memory: writing
    into them writes the cache. Raises ValueError when the tensor(s) do not match the layout's shape or dtype.
    """
    N, H, D = layout.block_size, layout.num_local_heads, layout.model.head_size
    a = layout.arrangement
    if layout.separate_kv:
        if not (isinstance(layer_cache, (tuple, list)) and len(layer_cache) == 2):
            raise ValueError(f"arrangement {a} needs a (K, V) tuple per layer")
        k = _check_tensor(layout, layer_cache[0], "K cache")
        v = _check_tensor(layout, layer_cache[1], "V cache")
        if k.shape != v.shape:
            raise ValueError(f"K cache shape {tuple(k.shape)} != V cache shape {tuple(v.shape)}")
        if a == "sglang_nhd":
            if k.dim() != 3 or tuple(k.shape[1:]) != (H, D):
                raise ValueError(f"sglang_nhd buffers must be [num_slots, {H}, {D}], got {tuple(k.shape)}")
            npages = k.shape[0] // N
            return tuple(x[: npages * N].view(npages, N, H, D) for x in (k, v))
        if a == "sglang_hnd":
            if k.dim() != 4 or tuple(k.shape[1:]) != (H, N, D):
                raise ValueError(f"sglang_hnd buffers must be [num_pages, {H}, {N}, {D}], got {tuple(k.shape)}")
            return (k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
        # lmdeploy
        if k.dim() != 4 or tuple(k.shape[1:]) != (N, H, D):
            raise ValueError(f"lmdeploy caches must be [num_blocks, {N}, {H}, {D}], got {tuple(k.shape)}")
        return (k, v)
    t = _check_tensor(layout, layer_cache, "layer cache")
    B = t.shape[0] if a not in ("vllm_flash_nhd", "vllm_flash_hnd") else (t.shape[1] if t.dim() > 1 else -1)
    want = layout.layer_shape(B)
    if tuple(t.shape) != tuple(want):  # type: ignore[arg-type]
        raise ValueError(f"{a} layer cache must be {list(want)} (num_blocks first), got {list(t.shape)}")
    if a == "vllm_flash_nhd":
        return (t[0], t[1])
    if a == "vllm_flash_hnd":
        return (t[0].permute(0, 2, 1, 3), t[1].permute(0, 2, 1, 3))
    if a == "vllm_flashinfer_nhd":
        return (t[:, 0], t[:, 1])
    if a == "vllm_flashinfer_hnd":
        return (t[:, 0].permute(0, 2, 1, 3), t[:, 1].permute(0, 2, 1, 3))
    if a == "vllm_lbnhc":
        return (t[..., :D], t[..., D:])
    if a == "vllm_lbhnc":
        tt = t.permute(0, 2, 1, 3)
        return (tt[..., :D], tt[..., D:])
    if a == "vllm_cpu":
        if t.stride(3) != 1 or t.stride(2) != 2 * D:
            raise ValueError("vllm_cpu pages must be dense: [..., N, 2*D] with strides (2*D, 1)")
        s0, s1, off = t.stride(0), t.stride(1), t.storage_offset()
        # K^T inside the (block, head) page: element (b, h, d, n) at b*s0 + h*s1 + d*N + n
        k = t.as_strided((B, N, H, D), (s0, 1, s1, N), off)
        # V row-major after K: element (b, h, n, d) at b*s0 + h*s1 + N*D + n*D + d
        v = t.as_strided((B, N, H, D), (s0, D, s1, 1), off + N * D)
        return (k, v)
    if a == "mla":
        return (t.unsqueeze(2),)
    raise AssertionError(a)


def _raw_blocks(layout: KVLayout, layer_cache: Any) -> list[torch.Tensor]:
    """Tensors whose dim 0 is the block id and whose rest is one block's bytes (K and V together if possible)."""
    a = layout.arrangement
    if a == "sglang_nhd":
        return list(plane_views(layout, layer_cache))
    if layout.separate_kv:
        return [_check_tensor(layout, layer_cache[0], "K cache"), _check_tensor(layout, layer_cache[1], "V cache")]
    t = _check_tensor(layout, layer_cache, "layer cache")
    if a in ("vllm_flash_nhd", "vllm_flash_hnd"):
        return [t[0], t[1]]
    return [t]


def _num_blocks(views: Sequence[torch.Tensor]) -> int:
    return int(views[0].shape[0])


# ---------------------------------------------------------------------------------------------------------------
# casting
# ---------------------------------------------------------------------------------------------------------------
def _scale(layout: KVLayout, plane: int) -> float:
    return layout.k_scale if plane == 0 else layout.v_scale


def _same_encoding(src: KVLayout, dst: KVLayout, plane: int) -> bool:
    return src.dtype == dst.dtype and (not src.is_fp8 or _scale(src, plane) == _scale(dst, plane))


def cast_plane(x: torch.Tensor, src: KVLayout, dst: KVLayout, plane: int) -> torch.Tensor:
    """Re-encode values of plane ``plane`` (0 = K / latent, 1 = V) from ``src``'s dtype to ``dst``'s.

    ``x`` is in ``src`` storage (fp8 may be ``uint8``); the result is in ``dst``'s torch dtype. Non-fp8 pairs use
    one ``Tensor.to``; fp8 is decoded as ``float32(q) * src_scale`` and encoded as
    ``fp8(clamp(x / dst_scale, -max, max))`` (saturating, like vLLM's fp8 cache writes). Same dtype and scale:
    returned unchanged (reinterpreted, no copy).
    """
    sdt, ddt = torch_dtype(src), torch_dtype(dst)
    if x.dtype != sdt:
        x = x.view(sdt)
    if _same_encoding(src, dst, plane):
        return x
    if not src.is_fp8 and not dst.is_fp8:
        return x.to(ddt)
    y = x.to(torch.float32)
    if src.is_fp8 and _scale(src, plane) != 1.0:
        y = y * _scale(src, plane)
    if dst.is_fp8:
        if _scale(dst, plane) != 1.0:
            y = y / _scale(dst, plane)
        fmax = torch.finfo(ddt).max
        y = y.clamp_(-fmax, fmax)
    return y.to(ddt)


# ---------------------------------------------------------------------------------------------------------------
# block tables and head plans
# ---------------------------------------------------------------------------------------------------------------
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
    if list(heads) != list(range(heads[0], heads[0] + len(heads))):
        raise ValueError(f"heads must be consecutive ascending global ids, got {list(heads)}")
    return heads


def _require_compat(src: KVLayout, dst: KVLayout, relax_fingerprint: bool) -> None:
    c = check_compat(src, dst, relax_fingerprint=relax_fingerprint)
    if not c.ok:
        raise ValueError("incompatible KV layouts: " + "; ".join(c.reasons))


# ---------------------------------------------------------------------------------------------------------------
# token-major gather / scatter over a strided [B, N, h, D] view
# ---------------------------------------------------------------------------------------------------------------
def _token_rows(view: torch.Tensor) -> torch.Tensor | None:
    """``[B*N, h, D]`` view of ``[B, N, h, D]`` when blocks and offsets merge into one axis, else None."""
    B, N, h, D = view.shape
    if B > 1 and view.stride(0) != N * view.stride(1):
        return None
    return view.as_strided((B * N, h, D), (view.stride(1), view.stride(2), view.stride(3)), view.storage_offset())


def _gather(view: torch.Tensor, bids: torch.Tensor, N: int, a: int, b: int) -> torch.Tensor:
    """Token-major ``[b - a, h, D]`` copy of tokens ``a..b`` (absolute) from the request's blocks ``bids``."""
    p0, p1 = a // N, (b + N - 1) // N
    blocks = view.index_select(0, bids[p0:p1])  # [nb, N, h, D] contiguous
    return blocks.flatten(0, 1)[a - p0 * N: b - p0 * N]


def _scatter(view: torch.Tensor, bids: torch.Tensor, N: int, a: int, b: int, data: torch.Tensor) -> None:
    """Write token-major ``data [b - a, h, D]`` for tokens ``a..b`` (absolute) into blocks ``bids``; nothing else."""
    f0, f1 = (a + N - 1) // N, b // N  # fully covered block positions f0..f1-1
    if f1 > f0:
        rows = data[f0 * N - a: f1 * N - a]
        view.index_copy_(0, bids[f0:f1], rows.reshape(f1 - f0, N, *data.shape[1:]))
        parts = [(a, f0 * N), (f1 * N, b)]
    else:
        parts = [(a, b)]
    for t0, t1 in parts:
        if t1 <= t0:
            continue
        t = torch.arange(t0, t1, device=bids.device)
        blk = bids[t // N]
        off = t % N
        piece = data[t0 - a: t1 - a]
        flat = _token_rows(view)
        if flat is not None:
            flat.index_copy_(0, blk * N + off, piece)
        else:
            view.index_put_((blk, off), piece)


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


# ---------------------------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------------------------
def convert(src_layout: KVLayout, src_caches: Sequence[Any], src_block_ids: Any,
            dst_layout: KVLayout, dst_caches: Sequence[Any], dst_block_ids: Any,
            num_tokens: int, skip_tokens: int = 0, *, heads: Sequence[int] | None = None,
            relax_fingerprint: bool = False) -> int:
    """Copy one request's KV from one source rank into one destination rank, converting on the way.

    Writes tokens ``skip_tokens .. num_tokens - 1`` of every layer, for ``heads`` (consecutive global KV head ids,
    default: every destination head this source rank holds), into the destination blocks ``dst_block_ids``;
    nothing else in ``dst_caches`` changes (tokens below ``skip_tokens`` are the destination's own prefix-cache
    hit). Block sizes, arrangements, dtypes/scales and TP shardings may differ. For re-sharding call it once per
    source rank or use :func:`convert_from_ranks`. Source and destination tensors must be on one device.

    Returns the number of destination bytes written. Raises ValueError when the layouts are incompatible (the
    message lists :func:`check_compat`'s reasons), caches do not match their layouts, block tables are too short,
    out of range or (destination) repeat ids, or a rank does not hold the requested heads.
    """
    _require_compat(src_layout, dst_layout, relax_fingerprint)
    if not 0 <= skip_tokens <= num_tokens:
        raise ValueError(f"need 0 <= skip_tokens ({skip_tokens}) <= num_tokens ({num_tokens})")
    heads = _resolve_heads(src_layout, dst_layout, heads)
    L = src_layout.model.num_layers
    if len(src_caches) != L or len(dst_caches) != L:
        raise ValueError(f"expected {L} per-layer caches, got {len(src_caches)} source / {len(dst_caches)} "
                         "destination")
    sh = _head_slice(src_layout, heads, "source")
    dh = _head_slice(dst_layout, heads, "destination")
    if num_tokens == skip_tokens:
        return 0
    Ns, Nd = src_layout.block_size, dst_layout.block_size
    sv0, dv0 = plane_views(src_layout, src_caches[0]), plane_views(dst_layout, dst_caches[0])
    device = sv0[0].device
    if dv0[0].device != device:
        raise ValueError(f"source caches are on {device}, destination on {dv0[0].device}")
    sb = _block_tensor(src_layout, src_block_ids, num_tokens, _num_blocks(sv0), device, "source", False)
    db = _block_tensor(dst_layout, dst_block_ids, num_tokens, _num_blocks(dv0), device, "destination", True)
    D = src_layout.model.head_size
    P = src_layout.num_planes
    raw = (src_layout.arrangement == dst_layout.arrangement and Ns == Nd
           and all(_same_encoding(src_layout, dst_layout, p) for p in range(P))
           and src_layout.heads_for_rank() == dst_layout.heads_for_rank() == heads)
    row_bytes = len(heads) * D * max(src_layout.itemsize, dst_layout.itemsize) * (P if raw else 1)
    chunk = _chunk_tokens(device, row_bytes, Ns, Nd)
    ranges = _ranges(skip_tokens, num_tokens, chunk)
    for layer in range(L):
        sv = plane_views(src_layout, src_caches[layer])
        dv = plane_views(dst_layout, dst_caches[layer])
        if raw:
            _copy_raw(src_layout, src_caches[layer], dst_layout, dst_caches[layer], sb, db, Ns, ranges, sv, dv)
            continue
        for p in range(P):
            s_view, d_view = sv[p][:, :, sh], dv[p][:, :, dh]
            for a, b in ranges:
                x = _gather(s_view, sb, Ns, a, b)
                _scatter(d_view, db, Nd, a, b, cast_plane(x, src_layout, dst_layout, p).view(d_view.dtype))
    return dst_layout.wire_bytes(num_tokens - skip_tokens, heads)


def _copy_raw(src_layout: KVLayout, src_cache: Any, dst_layout: KVLayout, dst_cache: Any, sb: torch.Tensor,
              db: torch.Tensor, N: int, ranges: list[tuple[int, int]], sv: tuple[torch.Tensor, ...],
              dv: tuple[torch.Tensor, ...]) -> None:
    """Identical layouts: whole blocks copied raw (all planes at once); partial blocks through the plane views."""
    s_raw, d_raw = _raw_blocks(src_layout, src_cache), _raw_blocks(dst_layout, dst_cache)
    for a, b in ranges:
        f0, f1 = (a + N - 1) // N, b // N
        if f1 > f0:
            for s, d in zip(s_raw, d_raw):
                d.index_copy_(0, db[f0:f1], s.index_select(0, sb[f0:f1]).view(d.dtype))
            parts = [(a, f0 * N), (f1 * N, b)]
        else:
            parts = [(a, b)]
        for t0, t1 in parts:
            if t1 > t0:
                for s, d in zip(sv, dv):
                    _scatter(d, db, N, t0, t1, _gather(s, sb, N, t0, t1).view(d.dtype))


def convert_from_ranks(sources: Sequence[tuple[KVLayout, Sequence[Any], Any]], dst_layout: KVLayout,
                       dst_caches: Sequence[Any], dst_block_ids: Any, num_tokens: int, skip_tokens: int = 0, *,
                       relax_fingerprint: bool = False) -> int:
    """Fill one destination rank from several source ranks (TP re-sharding).

    ``sources`` holds ``(layout, per-layer caches, block_ids)`` for each source rank (any subset of ranks that
    together hold every destination head). :func:`plan_heads` picks which rank provides which heads; each head is
    written exactly once. Returns destination bytes written. Raises ValueError as :func:`convert` and when a
    destination head is held by no source.
    """
    if not sources:
        raise ValueError("no source ranks given")
    plan = plan_heads([s[0] for s in sources], dst_layout)
    total = 0
    for i, hs in plan:
        lay, caches, bids = sources[i]
        total += convert(lay, caches, bids, dst_layout, dst_caches, dst_block_ids, num_tokens, skip_tokens,
                         heads=hs, relax_fingerprint=relax_fingerprint)
    return total


def wire_chunks(dst_layout: KVLayout, start: int, end: int, max_bytes: int,
                heads: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Split tokens ``start..end`` into ranges whose wire form fits ``max_bytes`` (e.g. a 64 MiB staging buffer).

    Ranges end on destination block boundaries where the budget allows. Raises ValueError when even one token
    does not fit.
    """
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
    of at least that many bytes, on any device, e.g. a pinned staging buffer) receives the bytes and its leading
    slice is returned. Raises ValueError as :func:`convert`, or when ``out`` is too small or not contiguous.
    """
    _require_compat(src_layout, dst_layout, relax_fingerprint)
    heads = _resolve_heads(src_layout, dst_layout, heads)
    _head_slice(dst_layout, heads, "destination")
    sh = _head_slice(src_layout, heads, "source")
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start ({start}) <= end ({end})")
    L, P, D, T = src_layout.model.num_layers, src_layout.num_planes, src_layout.model.head_size, end - start
    if len(src_caches) != L:
        raise ValueError(f"expected {L} per-layer source caches, got {len(src_caches)}")
    nbytes = dst_layout.wire_bytes(T, heads)
    sv0 = plane_views(src_layout, src_caches[0])
    device = sv0[0].device
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() < nbytes:
        raise ValueError(f"out must be a contiguous uint8 tensor of at least {nbytes} bytes")
    buf = out[:nbytes]
    if T == 0:
        return buf
    sb = _block_tensor(src_layout, src_block_ids, end, _num_blocks(sv0), device, "source", False)
    wire = buf.view(torch_dtype(dst_layout)).view(L, P, T, len(heads), D)
    N = src_layout.block_size
    chunk = _chunk_tokens(device, len(heads) * D * max(src_layout.itemsize, dst_layout.itemsize), N)
    for layer in range(L):
        sv = plane_views(src_layout, src_caches[layer])
        for p in range(P):
            s_view = sv[p][:, :, sh]
            for a, b in _ranges(start, end, chunk):
                x = cast_plane(_gather(s_view, sb, N, a, b), src_layout, dst_layout, p)
                wire[layer, p, a - start: b - start].copy_(x)
    return buf


def unpack(dst_layout: KVLayout, dst_caches: Sequence[Any], dst_block_ids: Any, wire: Any, start: int, end: int,
           *, heads: Sequence[int] | None = None) -> int:
    """Write a :func:`pack` buffer for tokens ``start..end`` into the destination blocks ``dst_block_ids``.

    ``wire``: ``uint8`` tensor (any device) or a bytes-like object, exactly :meth:`KVLayout.wire_bytes`
    ``(end - start, heads)`` bytes; ``heads`` defaults to all destination heads and must match what was packed.
    Only tokens ``start..end`` of those heads are written. Returns bytes consumed. Raises ValueError on a size
    mismatch, a bad block table or heads the destination rank does not hold.
    """
    heads = _resolve_heads(None, dst_layout, heads)
    dh = _head_slice(dst_layout, heads, "destination")
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start ({start}) <= end ({end})")
    L, P, D, T = dst_layout.model.num_layers, dst_layout.num_planes, dst_layout.model.head_size, end - start
    if len(dst_caches) != L:
        raise ValueError(f"expected {L} per-layer destination caches, got {len(dst_caches)}")
    nbytes = dst_layout.wire_bytes(T, heads)
    if not isinstance(wire, torch.Tensor):
        wire = torch.frombuffer(bytearray(wire) if isinstance(wire, bytes) else wire, dtype=torch.uint8)
    if wire.dtype != torch.uint8 or wire.numel() != nbytes:
        raise ValueError(f"wire buffer must be {nbytes} uint8 bytes for tokens {start}..{end} and heads "
                         f"{list(heads)}, got {wire.numel()} {wire.dtype}")
    if T == 0:
        return 0
    dv0 = plane_views(dst_layout, dst_caches[0])
    device = dv0[0].device
    db = _block_tensor(dst_layout, dst_block_ids, end, _num_blocks(dv0), device, "destination", True)
    w = wire.to(device).contiguous().view(torch_dtype(dst_layout)).view(L, P, T, len(heads), D)
    N = dst_layout.block_size
    for layer in range(L):
        dv = plane_views(dst_layout, dst_caches[layer])
        for p in range(P):
            d_view = dv[p][:, :, dh]
            _scatter(d_view, db, N, start, end, w[layer, p].view(d_view.dtype))
    return nbytes


# ---------------------------------------------------------------------------------------------------------------
# debug helpers (test oracle): one token at a time
# ---------------------------------------------------------------------------------------------------------------
def read_kv(layout: KVLayout, caches: Sequence[Any], block_ids: Any, token: int, layer: int,
            dequantize: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K and V of one token and layer, ``([H, D], [H, D])`` over this rank's heads in local order (a copy).

    MLA returns ``(latent [1, kv_lora_rank + rope_dim], None)``. Values are in the layout's torch dtype, or with
    ``dequantize=True`` float32 times the fp8 scale. A slow per-token debug reader and the tests' oracle.
    Raises IndexError when the token is beyond the block table.
    """
    N = layout.block_size
    ids = list(torch.as_tensor(block_ids).flatten().tolist())
    if not 0 <= token < len(ids) * N:
        raise IndexError(f"token {token} is outside the {len(ids)}-block table")
    blk, off = int(ids[token // N]), token % N
    views = plane_views(layout, caches[layer])
    res: list[torch.Tensor | None] = []
    for p, v in enumerate(views):
        x = v[blk, off].clone().view(torch_dtype(layout))
        if dequantize:
            x = x.to(torch.float32) * (_scale(layout, p) if layout.is_fp8 else 1.0)
        res.append(x)
    if len(res) == 1:
        res.append(None)
    return res[0], res[1]  # type: ignore[return-value]


def write_kv(layout: KVLayout, caches: Sequence[Any], block_ids: Any, token: int, layer: int,
             k: torch.Tensor, v: torch.Tensor | None) -> None:
    """Store one token's ``k``/``v`` (``[H, D]`` in the layout's torch dtype, local head order) into the cache.

    MLA: ``k`` is the latent ``[1, D]`` and ``v`` is ignored. Debug helper for tests (one token at a time).
    """
    N = layout.block_size
    ids = list(torch.as_tensor(block_ids).flatten().tolist())
    blk, off = int(ids[token // N]), token % N
    views = plane_views(layout, caches[layer])
    for p, val in enumerate((k, v)[: len(views)]):
        dst = views[p][blk, off]
        dst.copy_(val.to(torch_dtype(layout)).view(dst.dtype))
