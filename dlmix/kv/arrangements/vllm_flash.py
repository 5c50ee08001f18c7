"""vLLM <= 0.11 FlashAttention caches ``[2, B, N, H, D]`` (NHD) and ``[2, B, H, N, D]`` (HND).

Source: vLLM <= 0.11 ``vllm/v1/attention/backends/flash_attn.py`` ``FlashAttentionBackend.get_kv_cache_shape``
``(2, num_blocks, block_size, num_kv_heads, head_size)``; with ``VLLM_KV_CACHE_LAYOUT=HND``
``get_kv_cache_stride_order`` permutes it to the physical order ``[2, B, H, N, D]``. K = ``[0]``, V = ``[1]``.
"""

from __future__ import annotations

from typing import Any

from ..registry import Arrangement, register


@register("vllm_flash_nhd")
class VllmFlashNHD(Arrangement):
    """``[2, B, N, H, D]``: K = ``cache[0]``, V = ``cache[1]``, token-major inside a block."""

    block_dim = 1

    def layer_shape(self, B: int, N: int, H: int, D: int) -> tuple[int, ...]:
        return (2, B, N, H, D)

    def plane_views(self, cache: Any, N: int, H: int, D: int) -> tuple[Any, ...]:
        self.expect_shape(cache, self.layer_shape(self.num_blocks_of(cache), N, H, D))
        return (cache[0], cache[1])

    def raw_blocks(self, cache: Any, N: int, H: int, D: int) -> list[Any]:
        return [cache[0], cache[1]]


@register("vllm_flash_hnd")
class VllmFlashHND(VllmFlashNHD):
    """``[2, B, H, N, D]``: head-major inside a block."""

    def layer_shape(self, B: int, N: int, H: int, D: int) -> tuple[int, ...]:
        return (2, B, H, N, D)

    def plane_views(self, cache: Any, N: int, H: int, D: int) -> tuple[Any, ...]:
        self.expect_shape(cache, self.layer_shape(self.num_blocks_of(cache), N, H, D))
        return (cache[0].permute(0, 2, 1, 3), cache[1].permute(0, 2, 1, 3))
