"""vLLM 0.32 unified caches ``[B, N, H, 2*D]`` (``LBNHC``) and ``[B, H, N, 2*D]`` (``LBHNC``).

Source: ``vllm/v1/kv_cache_layout.py`` ``KVCacheLayout.LBNHC`` = "NHD", ``LBHNC`` = "HND"; logical per-layer view
``[B, H, N, C]`` from ``vllm/v1/kv_cache_interface.py`` ``create_kv_cache_views``. The last axis holds K in
``[:D]`` and V in ``[D:]`` per (token, head): ``flash_attn.py`` ``FlashAttentionImpl.forward`` does
``kv_cache.transpose(1, 2).split(head_size, dim=-1)``.
"""

from __future__ import annotations

from typing import Any

from ..registry import Arrangement, register


@register("vllm_lbnhc")
class VllmLBNHC(Arrangement):
    """``[B, N, H, 2*D]``: K and V of one (token, head) side by side."""

    def layer_shape(self, B: int, N: int, H: int, D: int) -> tuple[int, ...]:
        return (B, N, H, 2 * D)

    def plane_views(self, cache: Any, N: int, H: int, D: int) -> tuple[Any, ...]:
        self.expect_shape(cache, self.layer_shape(self.num_blocks_of(cache), N, H, D))
        return (cache[..., :D], cache[..., D:])


@register("vllm_lbhnc")
class VllmLBHNC(Arrangement):
    """``[B, H, N, 2*D]``: head-major, K and V of one (token, head) side by side."""

    def layer_shape(self, B: int, N: int, H: int, D: int) -> tuple[int, ...]:
        return (B, H, N, 2 * D)

    def plane_views(self, cache: Any, N: int, H: int, D: int) -> tuple[Any, ...]:
        self.expect_shape(cache, self.layer_shape(self.num_blocks_of(cache), N, H, D))
        t = cache.permute(0, 2, 1, 3)
        return (t[..., :D], t[..., D:])
