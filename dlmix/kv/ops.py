"""KV cache conversion between any two :class:`~dlmix.kv.layout.KVLayout` (torch; CPU or CUDA tensors).

Terms used below: ``N`` = block size (tokens), ``H`` = KV heads on a rank, ``D`` = head size, ``L`` = layers,
``P`` = planes (2 = K, V; 1 for an MLA latent). Per-layer caches are a ``list`` with one entry per layer: a tensor,
or a ``(K, V)`` tuple for separate-K/V arrangements (see :mod:`dlmix.kv.layout`). fp8 caches may be given as the
torch fp8 dtype or as ``uint8`` storage. Block ids are the request's block table (``list[int]`` or an int tensor):
token ``t`` lives in block ``block_ids[t // N]`` at offset ``t % N``.

How data moves (Python loops only over layers, planes, bounded chunks and block-sized segments, never over
heads, and over single tokens only in ``memmove`` of non-adjacent rows of at least 16 KiB each): every arrangement exposes per plane a strided *view* ``[num_blocks, N, H, D]`` of the engine tensor, so
any pair of arrangements is one copy between two views. The token range ``skip_tokens..num_tokens`` is split at
every source and destination block edge into *segments* (each inside one source block and one destination block;
``_segments``). Three paths move them:

* CPU, equal block sizes, no re-encoding, not identical (TP re-sharding, arrangement changes), segments of at
  least :data:`DIRECT_MIN_BYTES`: whole blocks with one ``index_select(..., out=destination run)`` per run of
  consecutive destination ids and source rank, K and V together where they stack (:func:`_transfer_blocks`);
  partial blocks as below.
* CPU, segments of at least :data:`DIRECT_MIN_BYTES`: each segment (or run of segments whose slots continue on
  both sides) is copied directly, with libc ``memmove`` when both sides are dense rows of one dtype, else with one
  ``torch._foreach_copy_`` per layer and plane (``copy_`` also casts bf16/fp16/fp32). One pass, no scratch.
* otherwise (CUDA, fp8 re-scaling, tiny segments): per chunk of at most :data:`CHUNK_BYTES`, the source blocks are
  gathered whole (2-D ``index_select`` or ``memmove``) into a reused scratch cache, re-ordered and cast into a
  token-major buffer ``[T, h, D]``, assembled into whole destination blocks in scratch and written with one 2-D
  ``index_copy_`` (or ``memmove``); tokens of partially covered destination blocks (below ``skip_tokens``, the last
  block, chunk edges) are written per token slot with ``index_copy_``/``index_put_``.

Identical layouts copy raw blocks (K and V together). In every path no slot outside ``[skip_tokens, num_tokens)``
of the requested heads is written, and fp8 re-scaling goes through float32 (:func:`cast_plane`).

Wire form (:func:`pack` / :func:`unpack`): a contiguous buffer ordered ``[L, P, T, h, D]`` (layers, planes K then
V, tokens ``start..end`` in order, the destination heads given as ``heads`` in ascending global id, head size) in
the destination dtype (fp8 already divided by the destination scale), raw little-endian element bytes, no header.
Its size is :meth:`KVLayout.wire_bytes`.
"""

from __future__ import annotations

import ctypes
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

#: Target bytes of one scratch buffer (per plane and chunk): small on CPU so it stays in cache; on CUDA large enough
#: for few kernel launches but bounded, since a handful of such buffers live on the device during a call.
CHUNK_BYTES = {"cpu": 4 << 20, "cuda": 32 << 20}

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
# data movement
# ---------------------------------------------------------------------------------------------------------------
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


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; 1-byte dtypes (fp8 storage) are copied as uint8."""
    if dst.dtype == src.dtype and dst.element_size() == 1:
        dst.view(torch.uint8).copy_(src.view(torch.uint8))
    else:
        dst.copy_(src)


def _copy_cast(dst: torch.Tensor, src: torch.Tensor, sl: KVLayout, dl: KVLayout, plane: int) -> None:
    """Copy plane values from ``src`` (``sl`` storage) into ``dst`` (``dl`` storage), re-encoding as needed."""
    if _same_encoding(sl, dl, plane):
        _copy(dst, src.view(dst.dtype))
    elif not sl.is_fp8 and not dl.is_fp8:
        dst.copy_(src)  # one pass, copy_ converts the dtype
    else:
        y = cast_plane(src, sl, dl, plane)
        dst.copy_(y.view(dst.dtype) if dl.is_fp8 else y)


def _gather_raw(layout: KVLayout, layer_cache: Any, bids: torch.Tensor, work: _Work, key: str) -> Any:
    """Whole blocks ``bids`` of one layer copied (2-D ``index_select``) into a scratch layer cache, in order."""
    temp = work.layer(key, layout, int(bids.numel()))
    runs = _merge([(b, i, 1) for i, b in enumerate(bids.tolist())]) if bids.device.type == "cpu" else None
    for s, d in zip(_raw_blocks(layout, layer_cache), _raw_blocks(layout, temp)):
        s2, d2 = _widen(_rows(s), _rows(d))
        if runs is None or not _memmove_rows(d2, s2, runs):
            torch.index_select(s2, 0, bids, out=d2)
    return temp


def _scatter_raw(layout: KVLayout, layer_cache: Any, temp: Any, bids: torch.Tensor) -> None:
    """Scratch layer cache blocks ``0..len(bids)-1`` written (2-D ``index_copy_``) into blocks ``bids``."""
    runs = _merge([(i, b, 1) for i, b in enumerate(bids.tolist())]) if bids.device.type == "cpu" else None
    for d, s in zip(_raw_blocks(layout, layer_cache), _raw_blocks(layout, temp)):
        d2, s2 = _widen(_rows(d), _rows(s))
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


class _Src:
    """One source rank in a transfer: its layout, per-layer caches, block table tensor and the heads it gives."""

    def __init__(self, layout: KVLayout, caches: Sequence[Any], bids: torch.Tensor, heads: tuple[int, ...],
                 x_slice: slice) -> None:
        self.layout, self.caches, self.bids, self.heads = layout, caches, bids, heads
        self.h_slice = _head_slice(layout, heads, "source")
        self.x_slice = x_slice  # where its heads go in the token-major chunk buffer


def _fill_chunk(srcs: Sequence[_Src], layer: int, a: int, b: int, dl: KVLayout, xs: Sequence[torch.Tensor],
                work: _Work) -> None:
    """Token-major chunk buffers ``xs[p] [b - a, Hx, D]`` (destination storage dtype) from the source ranks."""
    for s in srcs:
        sl, Ns = s.layout, s.layout.block_size
        p0, p1 = a // Ns, (b + Ns - 1) // Ns
        temp = _gather_raw(sl, s.caches[layer], s.bids[p0:p1], work, "s")
        for p, v in enumerate(plane_views(sl, temp)):
            v = v[:, :, s.h_slice]
            target = xs[p][:, s.x_slice]
            rows = _token_rows(v)
            lo, hi = a - p0 * Ns, b - p0 * Ns
            if rows is not None:
                _copy_cast(target, rows[lo:hi], sl, dl, p)
            else:  # block-major inside (HND, CPU K^T): one strided copy into token order first
                z = work.get("z", xs[p].dtype, tuple(v.shape))
                _copy_cast(z, v, sl, dl, p)
                _copy(target, z.flatten(0, 1)[lo:hi])


def _flush_chunk(dl: KVLayout, dst_cache: Any, db: torch.Tensor, a: int, b: int, xs: Sequence[torch.Tensor],
                 d_slice: slice, work: _Work) -> None:
    """Write the chunk buffers ``xs[p]`` (tokens ``a..b``, heads ``d_slice``) into the destination blocks."""
    Nd = dl.block_size
    f0, f1 = (a + Nd - 1) // Nd, b // Nd
    views = plane_views(dl, dst_cache)
    full_heads = (d_slice.stop - d_slice.start) == dl.num_local_heads
    if f1 > f0:
        nb = f1 - f0
        if full_heads:  # rebuild whole destination blocks in scratch, then one 2-D index_copy_ per raw tensor
            temp = work.layer("d", dl, nb)
            for p, tv in enumerate(plane_views(dl, temp)):
                src = xs[p][f0 * Nd - a: f1 * Nd - a]
                rows = _token_rows(tv)
                if rows is not None:
                    _copy(rows, src.view(rows.dtype))
                else:
                    _copy(tv, src.view(tv.dtype).view(nb, Nd, *src.shape[1:]))
            _scatter_raw(dl, dst_cache, temp, db[f0:f1])
        else:  # a subset of the heads: write only those (strided index_copy_)
            for p, v in enumerate(views):
                src = xs[p][f0 * Nd - a: f1 * Nd - a]
                vv = v[:, :, d_slice]
                vv.index_copy_(0, db[f0:f1], src.view(vv.dtype).view(nb, Nd, *src.shape[1:]))
        parts = [(a, f0 * Nd), (f1 * Nd, b)]
    else:
        parts = [(a, b)]
    for t0, t1 in parts:
        if t1 > t0:
            for p, v in enumerate(views):
                _scatter_tokens(v[:, :, d_slice], db, Nd, t0, t1, xs[p][t0 - a: t1 - a])


def _storage_dtype(layout: KVLayout) -> torch.dtype:
    return torch.uint8 if layout.is_fp8 else torch_dtype(layout)


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


def _transfer(sources: Sequence[tuple[KVLayout, Sequence[Any], Any, tuple[int, ...]]], dl: KVLayout,
              dst_caches: Sequence[Any], dst_block_ids: Any, num_tokens: int, skip_tokens: int,
              relax_fingerprint: bool) -> int:
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
    if device.type == "cpu" and same_blocks and not identical and seg_bytes >= DIRECT_MIN_BYTES:
        _transfer_blocks(srcs, dl, dst_caches, db, skip_tokens, num_tokens, d_slice)
        return dl.wire_bytes(num_tokens - skip_tokens, heads)
    if device.type == "cpu" and (identical or not fp8) and seg_bytes >= DIRECT_MIN_BYTES:
        _transfer_direct(srcs, dl, dst_caches, db, skip_tokens, num_tokens, d_slice, identical)
        return dl.wire_bytes(num_tokens - skip_tokens, heads)
    itemsize = max([s.layout.itemsize for s in srcs] + [dl.itemsize])
    chunk = _chunk_tokens(device, len(heads) * D * itemsize * P, Nd, *[s.layout.block_size for s in srcs])
    work = _Work(device)
    sdt = _storage_dtype(dl)
    for layer in range(L):
        for a, b in _ranges(skip_tokens, num_tokens, chunk):
            if identical:  # same bytes: whole blocks move raw, straight from scratch to destination
                f0, f1 = (a + Nd - 1) // Nd, b // Nd
                if f1 > f0:
                    temp = _gather_raw(sl, s0.caches[layer], s0.bids[f0:f1], work, "s")
                    _scatter_raw(dl, dst_caches[layer], temp, db[f0:f1])
                    edges = [(a, f0 * Nd), (f1 * Nd, b)]
                else:
                    edges = [(a, b)]
            else:
                edges = [(a, b)]
            for x0, x1 in edges:
                if x1 <= x0:
                    continue
                xs = [work.get(f"x{p}", sdt, (x1 - x0, len(heads), D)) for p in range(P)]
                _fill_chunk(srcs, layer, x0, x1, dl, xs, work)
                _flush_chunk(dl, dst_caches[layer], db, x0, x1, xs, d_slice, work)
    return dl.wire_bytes(num_tokens - skip_tokens, heads)


#: On CPU, segments of at least this many bytes are moved directly, one ``memmove`` or ``_foreach_copy_`` entry
#: each (one pass), instead of the two-pass gather/scatter through scratch buffers (measured on the 2-core dev
#: box, one thread, 64 KiB blocks, shuffled ids: ``memmove`` 0.8-0.98x of a flat copy, ``index_select`` +
#: ``index_copy_`` 0.4-0.6x). Below it the per-call overhead of the direct path dominates.
DIRECT_MIN_BYTES = 32 << 10


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


def _transfer_blocks(srcs: Sequence[_Src], dl: KVLayout, dst_caches: Sequence[Any], db: torch.Tensor,
                     skip: int, n: int, d_slice: slice) -> None:
    """CPU path for equal block sizes without re-encoding (TP re-sharding, arrangement changes): per layer and
    source rank, one ``index_select(src_view, block_dim, src_ids, out=dst_view[d0:d0 + k])`` per run of
    consecutive destination block ids, K and V together when both sides stack them (:func:`_stack_planes`). The
    source blocks are gathered straight into the strided head slice of the destination blocks (one pass, torch's
    C loop over blocks, no scratch). Partial blocks (below ``skip`` and the last one) go per segment.

    Measured on the 2-core dev box (one thread, Llama-3-8B KV, TP 2 -> 1, shuffled ids): ~0.5x of a flat copy
    against 0.35x for assembling blocks in scratch (two passes) and 0.3x for one strided ``copy_`` per block."""
    N, P = dl.block_size, dl.num_planes
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
            and seg_bytes >= DIRECT_MIN_BYTES:
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
    if device.type == "cpu" and min(Nd, T) * len(hs) * D * dst_layout.itemsize >= DIRECT_MIN_BYTES:
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
