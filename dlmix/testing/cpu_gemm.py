"""16-bit matrix products on a CPU without a native kernel for them: the engines' CPU test and development aids
(:mod:`dlmix_lmdeploy.cpu_ops`, ``DLMIX_SGLANG_CPU_AIDS`` in :mod:`dlmix_sglang`, ``DLMIX_VLLM_CPU_AIDS`` in
:mod:`dlmix_vllm`) compute them in fp32 instead.

torch multiplies fp16 natively on a CPU only with AVX512-FP16 or AMX-FP16, and bf16 only with AVX-512 BF16 or AMX;
elsewhere it takes a scalar path. Measured with torch 2.13, one thread, ``x [256, 576] @ w.T [576, 1536]``
(SmolLM2-135M's MLP shapes): on an AVX2-only AMD EPYC 101 ms in bf16 and 84 ms in fp16 against 17 ms converted to fp32
and back; on an AMD EPYC with AVX-512 BF16 (``[1000, 576]``) 72 ms in fp16, 13 ms in fp32, 5 ms in bf16. Both paths
accumulate in fp32 and round once, so the results differ only in summation order (about 0.2 % of fp16 outputs by one
ulp), as a GPU's 16-bit GEMM also accumulates in fp32. Products of few rows (decode steps) keep the native path: there
converting the weight costs more than it saves.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["UPCAST_MIN_ROWS", "slow_gemm_dtypes", "wants_fp32", "linear", "linear_fp32"]

#: 16-bit products with at least this many rows (tokens) run in fp32 where the CPU has no native GEMM for them.
UPCAST_MIN_ROWS = 16


@functools.lru_cache(maxsize=1)
def slow_gemm_dtypes() -> frozenset:
    """The 16-bit dtypes this CPU has no native matrix product for, as torch's oneDNN reports it: ``torch.float16``
    unless ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``, ``torch.bfloat16`` unless
    ``_is_mkldnn_bf16_supported()`` (both, when torch cannot tell)."""
    slow = {torch.float16, torch.bfloat16}
    try:
        if torch.backends.mkldnn.is_available():
            if torch.ops.mkldnn._is_mkldnn_fp16_supported():
                slow.discard(torch.float16)
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                slow.discard(torch.bfloat16)
    except (AttributeError, RuntimeError):
        pass
    return frozenset(slow)


def wants_fp32(x: torch.Tensor, upcast: frozenset | None = None) -> bool:
    """Whether a product with input ``x`` (``[..., in_features]``) should run in fp32: its dtype is in ``upcast``
    (default :func:`slow_gemm_dtypes`) and it has at least :data:`UPCAST_MIN_ROWS` rows."""
    dtypes = slow_gemm_dtypes() if upcast is None else upcast
    return x.dtype in dtypes and x.numel() >= UPCAST_MIN_ROWS * x.shape[-1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           upcast: frozenset | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed in fp32 and rounded to ``x``'s dtype once when :func:`wants_fp32`.

    Shapes: ``x`` ``[..., in_features]``, ``weight`` ``[out_features, in_features]``, ``bias`` ``[out_features]``;
    returns ``[..., out_features]`` in ``x``'s dtype."""
    return linear_fp32(x, weight, bias) if wants_fp32(x, upcast) else F.linear(x, weight, bias)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` computed in fp32 and rounded to ``x``'s dtype once (shapes as :func:`linear`)."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
