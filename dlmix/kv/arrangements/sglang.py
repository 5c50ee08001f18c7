"""SGLang MHA token pools: ``(K, V)`` each ``[num_slots, H, D]`` (NHD) or ``[num_pages, H, page_size, D]`` (HND).

Source: SGLang 0.5 ``sglang/srt/mem_cache/memory_pool.py`` ``MHATokenToKVPool._kv_buffer_shapes`` (``rows = size +
page_size``; page 0 is SGLang's padding page); ``SGLANG_USE_HND_KVCACHE`` selects the HND buffers. The layout's
``block_size`` is SGLang's ``page_size``; block ids are page ids and ``slot = page * page_size + offset``.
"""

from __future__ import annotations

from typing import Any

from ..registry import Arrangement, register


def _pair(name: str, cache: Any) -> tuple[Any, Any]:
    k, v = cache
    if k.shape != v.shape:
        raise ValueError(f"{name}: K cache shape {tuple(k.shape)} != V cache shape {tuple(v.shape)}")
    return k, v


@register("sglang_nhd")
class SGLangNHD(Arrangement):
    """``(K, V)`` each ``[num_slots, H, D]``; a page is ``N`` consecutive slots."""

    separate_kv = True

    def layer_shape(self, B: int, N: int, H: int, D: int) -> tuple[tuple[int, ...], ...]:
        return ((B * N, H, D), (B * N, H, D))

    def plane_views(self, cache: Any, N: int, H: int, D: int) -> tuple[Any, ...]:
        k, v = _pair(self.name, cache)
        if k.dim() != 3 or tuple(k.shape[1:]) != (H, D):
            raise ValueError(f"sglang_nhd buffers must be [num_slots, {H}, {D}], got {tuple(k.shape)}")
        npages = k.shape[0] // N
        return tuple(x[: npages * N].view(npages, N, H, D) for x in (k, v))

    def raw_blocks(self, cache: Any, N: int, H: int, D: int) -> list[Any]:
        return list(self.plane_views(cache, N, H, D))


@register("sglang_hnd")
class SGLangHND(Arrangement):
    """``(K, V)`` each ``[num_pages, H, page_size, D]``."""

    separate_kv = True

    def layer_shape(self, B: int, N: int, H: int, D: int) -> tuple[tuple[int, ...], ...]:
        return ((B, H, N, D), (B, H, N, D))

    def plane_views(self, cache: Any, N: int, H: int, D: int) -> tuple[Any, ...]:
        k, v = _pair(self.name, cache)
        if k.dim() != 4 or tuple(k.shape[1:]) != (H, N, D):
            raise ValueError(f"sglang_hnd buffers must be [num_pages, {H}, {N}, {D}], got {tuple(k.shape)}")
        return (k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
