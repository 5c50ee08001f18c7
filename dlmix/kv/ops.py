"""KV cache conversion between any two :class:`~dlmix.kv.layout.KVLayout` (torch; CPU or CUDA tensors).

This module gathers the tensor API in one import (``from dlmix.kv.ops import pack``); the code lives in:

* :mod:`dlmix.kv.registry` and :mod:`dlmix.kv.arrangements`: one file per engine arrangement (shapes, per-plane
  views, raw blocks, constraints), registered by decorator or the ``dlmix.kv_arrangements`` entry-point group;
* :mod:`dlmix.kv.views`: torch dtypes, :func:`allocate`, :func:`plane_views` (every arrangement as strided
  ``[num_blocks, N, H, D]`` views per plane);
* :mod:`dlmix.kv.cast`: dtype and fp8 scale re-encoding (:func:`cast_plane`);
* :mod:`dlmix.kv.plan`: block tables, TP head plans (:func:`plan_heads`), token segments, tunables;
* :mod:`dlmix.kv.move`: byte movers (``memmove`` runs, batched copies, gathers, scratch buffers);
* :mod:`dlmix.kv.direct`: one-pass CPU paths (identity ``memmove``, equal-block re-arrangement and TP re-shard,
  re-blocking and casts segment by segment, fp8 by lookup table);
* :mod:`dlmix.kv.kernels`: compiled CPU loops (numba, optional): fp8 table lookup, block copies, K^T transposes;
* :mod:`dlmix.kv.cells`: one-pass CPU cell gather (``numpy.take``) for re-arrangements between layouts without
  dense token rows (NHD <-> HND, vLLM CPU re-blocking);
* :mod:`dlmix.kv.chunked`: the general path through scratch (CUDA, fp8 re-scaling, tiny segments);
* :mod:`dlmix.kv.transfer`: :func:`convert` and :func:`convert_from_ranks` and the choice of path;
* :mod:`dlmix.kv.wire`: :func:`pack`, :func:`unpack`, :func:`wire_chunks` (the transport's wire form);
* :mod:`dlmix.kv.debug`: :func:`read_kv`, :func:`write_kv` (per-token oracle).

Terms: ``N`` = block size (tokens), ``H`` = KV heads on a rank, ``D`` = head size, ``L`` = layers, ``P`` = planes
(2 = K, V; 1 for an MLA latent). Per-layer caches are a ``list`` with one entry per layer: a tensor, or a
``(K, V)`` tuple for separate-K/V arrangements. Block ids are the request's block table (``list[int]`` or an int
tensor): token ``t`` lives in block ``block_ids[t // N]`` at offset ``t % N``. The tunables
:data:`~dlmix.kv.plan.CHUNK_BYTES` and :data:`~dlmix.kv.plan.DIRECT_MIN_BYTES` live in :mod:`dlmix.kv.plan`
(patch them there).
"""

from __future__ import annotations

from .cast import cast_plane
from .debug import read_kv, write_kv
from .plan import CHUNK_BYTES, plan_heads
from .transfer import convert, convert_from_ranks
from .views import allocate, plane_views, torch_dtype
from .wire import pack, unpack, wire_chunks

__all__ = [
    "CHUNK_BYTES",
    "allocate",
    "cast_plane",
    "convert",
    "convert_from_ranks",
    "pack",
    "plan_heads",
    "plane_views",
    "read_kv",
    "torch_dtype",
    "unpack",
    "wire_chunks",
    "write_kv",
]
