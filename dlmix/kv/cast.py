"""Re-encoding KV values between dtypes and fp8 scales (the dtype part of a conversion).

fp8 scale convention (``per_tensor``): the cache stores ``q = fp8(x / scale)`` and a reader computes
``x = float(q) * scale`` (vLLM ``reshape_and_cache_flash`` with ``layer._k_scale``; SGLang
``MHATokenToKVPool.set_kv_buffer`` divides by ``k_scale`` before the cast). Re-scaling goes through float32.

On CPU, an fp8 re-encoding from a source of at most 2 bytes per element is a table lookup: :func:`cast_plane`
applied once to each of the 65,536 (or 256) source bit patterns gives a table, and the conversion is one
``numpy.take`` into it (bit-identical to :func:`cast_plane`, since each output depends only on its input; measured
~3x faster than the float32 passes on the 2-core dev box).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .layout import KVLayout
from .views import torch_dtype


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
    elif src.device.type == "cpu" and dst.device.type == "cpu" and src.element_size() <= 2:
        _lookup(dst, src, _table(sl.dtype, _scale(sl, plane) if sl.is_fp8 else 1.0, dl.dtype,
                                 _scale(dl, plane) if dl.is_fp8 else 1.0))
    else:
        y = cast_plane(src, sl, dl, plane)
        dst.copy_(y.view(dst.dtype) if dl.is_fp8 else y)


_BITS = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32)}


@functools.lru_cache(maxsize=32)
def _table(src_dtype: str, src_scale: float, dst_dtype: str, dst_scale: float) -> np.ndarray:
    """Destination bit pattern for every source bit pattern (65,536 or 256 entries), computed by
    :func:`cast_plane` for a K plane whose scales are the given ones."""
    from .layout import ModelIdentity

    m = ModelIdentity("table", 1, 1, 1)
    sl = KVLayout(m, 1, src_dtype, "lmdeploy", k_scale=src_scale)
    dl = KVLayout(m, 1, dst_dtype, "lmdeploy", k_scale=dst_scale)
    isz = sl.itemsize
    # every source bit pattern once, in order (int32 -> int16 keeps the low 16 bits)
    codes = torch.arange(1 << (8 * isz), dtype=torch.int32).to(_BITS[isz][0])
    y = cast_plane(codes, sl, dl, 0)
    osz = y.element_size()
    return y.view(_BITS[osz][0]).numpy().view(_BITS[osz][1]).copy()


def _lookup(dst: torch.Tensor, src: torch.Tensor, table: np.ndarray) -> None:
    """``dst = table[bits(src)]`` elementwise (CPU; shapes equal; ``dst`` may be strided)."""
    idx = src.view(_BITS[src.element_size()][0]).numpy().view(_BITS[src.element_size()][1])
    out_t = dst.view(_BITS[dst.element_size()][0])
    if out_t.is_contiguous():
        np.take(table, idx, out=out_t.numpy().view(table.dtype), mode="clip")
    else:
        out_t.copy_(torch.from_numpy(np.take(table, idx, mode="clip").view(_BITS[dst.element_size()][1]))
                    .view(out_t.dtype))
