"""The reference producer's paged KV cache: per-layer tensors in any :class:`dlmix.kv.KVLayout` arrangement, a
free list of block ids, and :meth:`PagedKVCache.store` that writes one prompt's K/V into fresh blocks.

Writing goes through :func:`dlmix.kv.convert`: the forward pass's ``[T, H, D]`` K and V of each layer are viewed as
a one-block cache of the ``lmdeploy`` arrangement (``(K, V)`` each ``[1, T, H, D]``, block size ``T``) in the compute
dtype, and converted into this cache's arrangement, block size and dtype. No layout-specific code lives here.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

from dlmix.kv import KVLayout

__all__ = ["PagedKVCache", "CacheFullError"]


class CacheFullError(RuntimeError):
    """Not enough free blocks for a prompt (the message gives needed, free and total blocks)."""


class PagedKVCache:
    """Per-layer paged KV tensors (``dlmix.kv.allocate(layout, num_blocks)``) and a block allocator.

    Args:
      layout: this cache's layout (arrangement, block size in tokens, dtype, model identity; TP size 1).
      num_blocks: blocks per layer. Memory: ``num_blocks * layout.block_bytes()`` bytes.
    Thread-safe: allocation and freeing take one lock.
    """

    def __init__(self, layout: KVLayout, num_blocks: int):
        from dlmix.kv import allocate

        if layout.tp_size != 1:
            raise ValueError("the reference producer runs one rank (tp_size 1)")
        if int(num_blocks) <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.layout = layout
        self.num_blocks = int(num_blocks)
        self.caches: list[Any] = allocate(layout, self.num_blocks, fill=0.0)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def tensors(self) -> list[Any]:
        """The per-layer cache objects in layer order (tensors, or ``(K, V)`` tuples for separate-K/V layouts)."""
        return self.caches

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def used_blocks(self) -> int:
        with self._lock:
            return len(self._used)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed for ``num_tokens`` tokens (ceil division by the block size)."""
        return -(-int(num_tokens) // self.layout.block_size)

    def allocate(self, num_tokens: int) -> list[int]:
        """Take the blocks for ``num_tokens`` tokens off the free list. Raises :class:`CacheFullError`."""
        n = self.blocks_for(num_tokens)
        with self._lock:
            if n > len(self._free):
                raise CacheFullError(f"KV cache full: {n} blocks needed, {len(self._free)} of {self.num_blocks} "
                                     "free (the others are held for decode instances)")
            out = [self._free.pop() for _ in range(n)]
            self._used.update(out)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the free list. Raises ValueError for a block that is not in use (a double free)."""
        with self._lock:
            bad = [b for b in block_ids if b not in self._used]
            if bad:
                raise ValueError(f"blocks {bad} are not allocated (double free?)")
            for b in reversed(block_ids):  # pop() hands them out again in ascending order
                self._used.discard(b)
                self._free.append(b)

    def store(self, keys: list[Any], values: list[Any], block_ids: list[int]) -> int:
        """Write one prompt's K/V (``keys[l]``, ``values[l]``: ``[T, H, D]`` tensors of one float dtype) into
        ``block_ids`` (token ``t`` -> block ``block_ids[t // block_size]``). Returns bytes written.
        Raises ValueError on shape mismatch or a block table too short for ``T`` tokens."""
        from dlmix.kv import convert

        L = self.layout.model.num_layers
        if len(keys) != L or len(values) != L:
            raise ValueError(f"need K and V for {L} layers, got {len(keys)} and {len(values)}")
        T = int(keys[0].shape[0])
        dtype = str(keys[0].dtype).replace("torch.", "")
        src = replace(self.layout, block_size=T, dtype=dtype, arrangement="lmdeploy", engine="transformers")
        src_caches = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in zip(keys, values)]
        return convert(src, src_caches, [0], self.layout, self.caches, block_ids, T)
