"""Asymmetric uint8 KV quantization per (token, head): the encoding of LMDeploy's ``--quant-policy 8`` caches.

A K or V vector ``x`` of one token and one head (``head_dim`` values) is stored as ``head_dim`` bytes ``q`` plus a
``(scale, zero)`` pair in the model dtype:

    scale = (max(x) - min(x)) / 255,  zero = -min(x) / scale,  q = floor(x / scale + zero + 0.5),
    x' = (q - zero) * scale

Source: LMDeploy 0.18 ``pytorch/kernels/cuda/fill_kv_cache.py`` (``_quant_int8``: the write) and
``pytorch/kernels/cuda/pagedattention.py`` (``(k - kz) * ks``: the read). A vector whose values are all equal
(``max == min``; LMDeploy's kernel divides by zero there) is stored with ``scale = 1``, ``zero = -min`` and ``q = 0``,
so it reads back exactly. The arithmetic runs in float32; ``scale`` and ``zero`` are rounded to the cache's
scale dtype when stored, and ``q`` is computed from the values as stored, so a reader gets the same ``x'`` however
the pair was rounded.

Used where a cache of this encoding is written: the receiving side of a PD transfer into such a cache
(:mod:`dlmix_lmdeploy.backend`) and the CPU test aid's attention (:mod:`dlmix_lmdeploy.cpu_ops`). Both quantize
with :func:`quantize_int8_asym`, so a migrated prompt's cache holds the bytes the engine's own prefill would have
written from the same K/V values.
"""
from __future__ import annotations

from typing import Any

__all__ = ["quantize_int8_asym", "dequantize_int8_asym", "LEVELS"]

#: uint8 levels above zero: the scale maps ``max - min`` onto 0..255
LEVELS = 255


def quantize_int8_asym(x: Any, scale_dtype: Any) -> tuple[Any, Any]:
    """Quantize ``x`` (float tensor ``[..., D]``) per vector of its last dimension.

    Returns ``(q, scales_zeros)``: ``q`` uint8 ``[..., D]`` and ``scales_zeros`` ``[..., 2]`` in ``scale_dtype``
    (``[..., 0]`` the scale, ``[..., 1]`` the zero point; LMDeploy's ``k_scales_zeros``/``v_scales_zeros`` order).
    Raises ValueError for a non-float input.
    """
    import torch

    if not x.is_floating_point():
        raise ValueError(f"quantize_int8_asym needs a float tensor, got {x.dtype}")
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True)
    hi = xf.amax(dim=-1, keepdim=True)
    span = hi - lo
    flat = span == 0
    scale = torch.where(flat, torch.ones_like(span), span / LEVELS)
    zero = -lo / scale
    sz = torch.cat([scale, zero], dim=-1).to(scale_dtype)
    s, z = sz[..., :1].float(), sz[..., 1:].float()  # as stored
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.floor(xf / s + z + 0.5).clamp_(0, LEVELS).to(torch.uint8)
    return q, sz


def dequantize_int8_asym(q: Any, scales_zeros: Any) -> Any:
    """Float32 values of ``q`` (uint8 ``[..., D]``) with their ``scales_zeros`` (``[..., 2]``):
    ``(q - zero) * scale``."""
    sz = scales_zeros.float()
    return (q.float() - sz[..., 1:]) * sz[..., :1]
