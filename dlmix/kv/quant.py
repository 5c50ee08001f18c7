"""Asymmetric integer KV quantization per (token, head): the encodings of LMDeploy's ``--quant-policy 8`` (uint8)
and ``--quant-policy 4`` (two 4-bit values per byte) caches.

A K or V vector ``x`` of one token and one head (``head_dim`` values) is stored as integers ``q`` in ``0..levels``
(``levels`` = 255 for int8, 15 for int4) plus a ``(scale, zero)`` pair in the model dtype:

    scale = (max(x) - min(x)) / levels,  zero = -min(x) / scale,  q = floor(x / scale + zero + 0.5),
    x' = (q - zero) * scale

int4 packs value ``d`` of the first half of the vector into the low nibble of byte ``d`` and value ``d + D/2`` into
its high nibble (``q = q[:D/2] + 16 * q[D/2:]``), so a cache row holds ``D/2`` bytes.

Source: LMDeploy 0.18 ``pytorch/kernels/cuda/fill_kv_cache.py`` (``_quant_int8``, ``_quant_int4``: the writes) and
``pytorch/kernels/cuda/pagedattention.py`` (``(k >> shift) & 0x0F`` with ``shift = d // (D/2) * 4`` and
``(k - kz) * ks``: the reads). A vector whose values are all equal (``max == min``; LMDeploy's kernels divide by zero
there) is stored with ``scale = 1``, ``zero = -min`` and ``q = 0``, so it reads back exactly. The arithmetic runs in
float32; ``scale`` and ``zero`` are rounded to the cache's scale dtype when stored, and ``q`` is computed from the
values as stored, so a reader gets the same ``x'`` however the pair was rounded.

Used where a cache of these encodings is written or read outside LMDeploy's kernels: a PD transfer into such a cache
(quantized on arrival) or out of one (dequantized while held), :mod:`dlmix_lmdeploy.layout`, and the CPU test aid's
attention (:mod:`dlmix_lmdeploy.cpu_ops`). All quantize with :func:`quantize_asym`, so a migrated prompt's cache
holds the bytes the engine's own prefill would have written from the same K/V values.
"""
from __future__ import annotations

from typing import Any

__all__ = ["quantize_asym", "dequantize_asym", "BITS"]

#: the integer widths LMDeploy's ``--quant-policy`` names (4 and 8) and their top level: the scale maps
#: ``max - min`` onto ``0..level``
BITS = {8: 255, 4: 15}


def quantize_asym(x: Any, scale_dtype: Any, bits: int = 8) -> tuple[Any, Any]:
    """Quantize ``x`` (float tensor ``[..., D]``) per vector of its last dimension to ``bits`` (8 or 4) bits.

    Returns ``(q, scales_zeros)``: ``q`` uint8 ``[..., D]`` (int8) or ``[..., D/2]`` (int4, two values per byte,
    module doc) and ``scales_zeros`` ``[..., 2]`` in ``scale_dtype`` (``[..., 0]`` the scale, ``[..., 1]`` the zero
    point; LMDeploy's ``k_scales_zeros``/``v_scales_zeros`` order).
    Raises ValueError for a non-float input, another width, or an odd ``D`` with int4.
    """
    import torch

    if bits not in BITS:
        raise ValueError(f"asymmetric KV quantization has 8 or 4 bits, not {bits}")
    if not x.is_floating_point():
        raise ValueError(f"quantize_asym needs a float tensor, got {x.dtype}")
    levels = BITS[bits]
    if bits == 4 and x.shape[-1] % 2:
        raise ValueError(f"int4 packs two values per byte: head size {x.shape[-1]} is odd")
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True)
    hi = xf.amax(dim=-1, keepdim=True)
    span = hi - lo
    flat = span == 0
    scale = torch.where(flat, torch.ones_like(span), span / levels)
    zero = -lo / scale
    sz = torch.cat([scale, zero], dim=-1).to(scale_dtype)
    s, z = sz[..., :1].float(), sz[..., 1:].float()  # as stored
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.floor(xf / s + z + 0.5).clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        half = q.shape[-1] // 2
        q = q[..., :half] | (q[..., half:] << 4)
    return q, sz


def dequantize_asym(q: Any, scales_zeros: Any, bits: int = 8) -> Any:
    """Float32 values ``[..., D]`` of ``q`` (uint8 ``[..., D]`` for int8, ``[..., D/2]`` packed for int4) with their
    ``scales_zeros`` (``[..., 2]``): ``(q - zero) * scale``. Raises ValueError for another width."""
    import torch

    if bits not in BITS:
        raise ValueError(f"asymmetric KV quantization has 8 or 4 bits, not {bits}")
    if bits == 4:
        q = torch.cat([q & 0x0F, q >> 4], dim=-1)
    sz = scales_zeros.float()
    return (q.float() - sz[..., 1:]) * sz[..., :1]

