"""LMDeploy PyTorch-engine caches: ``(K, V)`` each ``[B, N, H, D]``.

Source: LMDeploy 0.18 ``lmdeploy/pytorch/backends/cuda/op_backend.py`` ``get_k_block_shape``/``get_v_block_shape``
= ``(block_size, num_heads, head_size)`` and ``lmdeploy/pytorch/engine/cache_engine/layout.py`` (cache
``[num_layers, num_blocks, *block_shape]``, one layer = ``cache[l]``). LMDeploy shards heads like vLLM but does not
replicate them (``cache_engine/schema.py`` asserts ``num_heads % world_size == 0``).
"""

from __future__ import annotations

from typing import Any

from ..registry import Arrangement, register


@register("lmdeploy")
class LMDeploy(Arrangement):
    """``(K, V)`` each ``[B, N, H, D]``."""

    separate_kv = True

    def layer_shape(self, B: int, N: int, H: int, D: int) -> tuple[tuple[int, ...], ...]:
        return ((B, N, H, D), (B, N, H, D))

    def check_layout(self, layout: Any) -> None:
        if layout.model.attention != "mla" and layout.tp_size > layout.model.num_kv_heads:
            raise ValueError(f"LMDeploy cannot replicate {layout.model.num_kv_heads} KV heads over "
                             f"TP={layout.tp_size} (cache_engine/schema.py asserts num_heads % world_size == 0)")

    def plane_views(self, cache: Any, N: int, H: int, D: int) -> tuple[Any, ...]:
        k, v = cache
        if k.shape != v.shape:
            raise ValueError(f"K cache shape {tuple(k.shape)} != V cache shape {tuple(v.shape)}")
        if k.dim() != 4 or tuple(k.shape[1:]) != (N, H, D):
            raise ValueError(f"lmdeploy caches must be [num_blocks, {N}, {H}, {D}], got {tuple(k.shape)}")
        return (k, v)
