"""LMDeploy PyTorch-engine caches, in the two physical layouts LMDeploy 0.18 allocates.

Source: LMDeploy 0.18 ``lmdeploy/pytorch/engine/cache_engine/schema.py`` (K and V block shapes
``(block_size, num_heads, head_size)``, each padded to 256 bytes) and ``cache_engine/layout.py``:

* ``lmdeploy``: ``ContiguousBlockCacheLayout``, chosen by the dlinfer backends (Ascend, MACA, CAMB;
  ``backends/dlinfer/cache.py``): one tensor per payload, ``K [L, B, N, H, D]`` and ``V [L, B, N, H, D]``, so a
  layer is ``(K[l], V[l])``, each ``[B, N, H, D]``;
* ``lmdeploy_packed``: ``PackedBlockCacheLayout``, LMDeploy's default (CUDA; ``backends/default/cache.py``): one byte
  pool ``[L, B, K bytes + V bytes]``, so a layer is ``pool[l]`` viewed as ``[B, 2, N, H, D]`` when neither payload
  needed padding (K then V of one block adjacent; the same bytes as FlashInfer NHD).

LMDeploy shards heads like vLLM but does not replicate them (``cache_engine/schema.py`` asserts
``num_heads % world_size == 0``).
"""

from __future__ import annotations

from typing import Any

from ..registry import Arrangement, register
from .vllm_flashinfer import VllmFlashInferNHD


def _no_replicated_heads(layout: Any) -> None:
    if layout.model.attention != "mla" and layout.tp_size > layout.model.num_kv_heads:
        raise ValueError(f"LMDeploy cannot replicate {layout.model.num_kv_heads} KV heads over "
                         f"TP={layout.tp_size} (cache_engine/schema.py asserts num_heads % world_size == 0)")


@register("lmdeploy")
class LMDeploy(Arrangement):
    """``(K, V)`` each ``[B, N, H, D]``."""

    separate_kv = True

    def layer_shape(self, B: int, N: int, H: int, D: int) -> tuple[tuple[int, ...], ...]:
        return ((B, N, H, D), (B, N, H, D))

    def check_layout(self, layout: Any) -> None:
        _no_replicated_heads(layout)

    def plane_views(self, cache: Any, N: int, H: int, D: int) -> tuple[Any, ...]:
        k, v = cache
        if k.shape != v.shape:
            raise ValueError(f"K cache shape {tuple(k.shape)} != V cache shape {tuple(v.shape)}")
        if k.dim() != 4 or tuple(k.shape[1:]) != (N, H, D):
            raise ValueError(f"lmdeploy caches must be [num_blocks, {N}, {H}, {D}], got {tuple(k.shape)}")
        return (k, v)


@register("lmdeploy_packed")
class LMDeployPacked(VllmFlashInferNHD):
    """One packed pool row per layer ``[B, 2, N, H, D]``: K = ``cache[:, 0]``, V = ``cache[:, 1]``."""

    def check_layout(self, layout: Any) -> None:
        _no_replicated_heads(layout)
