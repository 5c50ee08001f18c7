"""Per-token debug reader and writer (the tests' oracle): slow, one token and layer at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .cast import _scale
from .layout import KVLayout
from .views import plane_views, torch_dtype


def read_kv(layout: KVLayout, caches: Sequence[Any], block_ids: Any, token: int, layer: int,
            dequantize: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K and V of one token and layer, ``([H, D], [H, D])`` over this rank's heads in local order (a copy).

    MLA returns ``(latent [1, kv_lora_rank + rope_dim], None)``. Values are in the layout's torch dtype, or with
    ``dequantize=True`` float32 times the fp8 scale. A slow per-token debug reader and the tests' oracle.
    Raises IndexError when the token is beyond the block table.
    """
    N = layout.block_size
    ids = list(torch.as_tensor(block_ids).flatten().tolist())
    if not 0 <= token < len(ids) * N:
        raise IndexError(f"token {token} is outside the {len(ids)}-block table")
    blk, off = int(ids[token // N]), token % N
    views = plane_views(layout, caches[layer])
    res: list[torch.Tensor | None] = []
    for p, v in enumerate(views):
        x = v[blk, off].clone().view(torch_dtype(layout))
        if dequantize:
            x = x.to(torch.float32) * (_scale(layout, p) if layout.is_fp8 else 1.0)
        res.append(x)
    if len(res) == 1:
        res.append(None)
    return res[0], res[1]  # type: ignore[return-value]


def write_kv(layout: KVLayout, caches: Sequence[Any], block_ids: Any, token: int, layer: int,
             k: torch.Tensor, v: torch.Tensor | None) -> None:
    """Store one token's ``k``/``v`` (``[H, D]`` in the layout's torch dtype, local head order) into the cache.

    MLA: ``k`` is the latent ``[1, D]`` and ``v`` is ignored. Debug helper for tests (one token at a time).
    """
    N = layout.block_size
    ids = list(torch.as_tensor(block_ids).flatten().tolist())
    blk, off = int(ids[token // N]), token % N
    views = plane_views(layout, caches[layer])
    for p, val in enumerate((k, v)[: len(views)]):
        dst = views[p][blk, off]
        dst.copy_(val.to(torch_dtype(layout)).view(dst.dtype))
