"""Re-encoding KV values between dtypes and fp8 scales (the dtype part of a conversion).

fp8 scale convention (``per_tensor``): the cache stores ``q = fp8(x / scale)`` and a reader computes
``x = float(q) * scale`` (vLLM ``reshape_and_cache_flash`` with ``layer._k_scale``; SGLang
``MHATokenToKVPool.set_kv_buffer`` divides by ``k_scale`` before the cast). Re-scaling goes through float32.
"""

from __future__ import annotations

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
    else:
        y = cast_plane(src, sl, dl, plane)
        dst.copy_(y.view(dst.dtype) if dl.is_fp8 else y)
