"""DeepSeek-style MLA latent cache ``[B, N, kv_lora_rank + rope_dim]`` (no heads; every TP rank holds it all).

Source: vLLM 0.32 ``vllm/v1/attention/backends/mla/cpu_mla.py`` ``do_kv_cache_update`` views it as
``kv_cache.view(-1, kv_lora_rank + pe_dim)``; ``flashinfer_mla_sparse_sm90.py`` ``get_kv_cache_shape`` =
``(num_blocks, block_size, head_size)``.
"""

from __future__ import annotations

from typing import Any

from ..registry import Arrangement, register


@register("mla")
class MLALatent(Arrangement):
    """``[B, N, D]``: one plane (the latent), viewed with one head."""

    latent = True

    def layer_shape(self, B: int, N: int, H: int, D: int) -> tuple[int, ...]:
        return (B, N, D)

    def plane_views(self, cache: Any, N: int, H: int, D: int) -> tuple[Any, ...]:
        self.expect_shape(cache, self.layer_shape(self.num_blocks_of(cache), N, H, D))
        return (cache.unsqueeze(2),)
