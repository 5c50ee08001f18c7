"""vLLM FlashInfer caches ``[B, 2, N, H, D]`` (NHD) and ``[B, 2, H, N, D]`` (HND).

Source: vLLM ``vllm/v1/attention/backends/flashinfer.py`` ``FlashInferBackend.get_kv_cache_shape``
``(num_blocks, 2, block_size, num_kv_heads, head_size)`` with the NHD ``(0, 1, 2, 3, 4)`` / HND ``(0, 1, 3, 2, 4)``
stride order; later vLLM FlashAttention releases use the same shape and stride orders
(``get_kv_cache_stride_order``), so these two also describe them.
"""

from __future__ import annotations

from typing import Any

from ..registry import Arrangement, register


@register("vllm_flashinfer_nhd")
class VllmFlashInferNHD(Arrangement):
    """``[B, 2, N, H, D]``: K = ``cache[:, 0]``, V = ``cache[:, 1]``; one block's K and V are adjacent."""

    def layer_shape(self, B: int, N: int, H: int, D: int) -> tuple[int, ...]:
        return (B, 2, N, H, D)

    def plane_views(self, cache: Any, N: int, H: int, D: int) -> tuple[Any, ...]:
        self.expect_shape(cache, self.layer_shape(self.num_blocks_of(cache), N, H, D))
        return (cache[:, 0], cache[:, 1])


@register("vllm_flashinfer_hnd")
class VllmFlashInferHND(Arrangement):
    """``[B, 2, H, N, D]``: head-major inside each plane of a block."""

    def layer_shape(self, B: int, N: int, H: int, D: int) -> tuple[int, ...]:
        return (B, 2, H, N, D)

    def plane_views(self, cache: Any, N: int, H: int, D: int) -> tuple[Any, ...]:
        self.expect_shape(cache, self.layer_shape(self.num_blocks_of(cache), N, H, D))
        return (cache[:, 0].permute(0, 2, 1, 3), cache[:, 1].permute(0, 2, 1, 3))
