"""Host outbox: a bounded pinned host copy of held pages, for a producer whose KV cache lives in device memory
(GPU, NPU) behind a transport that can register host memory only (``tcp``, ``shm``, ``dlslime`` without RDMA).

A transport that registers device memory (``Transport.supports_device_memory``) reads the cache where it lives and
needs no outbox. Otherwise the producer's regions are the outbox's host planes, not the cache: when a consumer's
``want`` is granted, the held blocks of every layer plane are copied from the device into free outbox pages (one
device-to-host copy per plane), the grant covers those pages, and ``blocks_ready`` names them (``Ready.pages``), so
the consumer reads them exactly as it would read the cache. The pages return to the free list when the hold is
released (the same moment the engine may reuse the blocks, so a read still being served never sees reused pages).

Capacity: ``capacity_bytes`` of host memory, i.e. ``capacity_bytes // block_bytes`` pages (a page = one block of
every layer plane of this rank). A ``want`` for more pages than are free is refused with the reason; the consumer
then computes the prompt itself, nothing waits and nothing leaks.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from dlmix.kv.layout import KVLayout

from .engine import layer_planes, plane_page_bytes, region_names

__all__ = ["HostOutbox", "needs_outbox"]


def needs_outbox(transport: Any, layout: KVLayout, layers: list[Any]) -> bool:
    """Whether ``layers`` (this rank's cache) lie in device memory that ``transport`` cannot register."""
    if getattr(transport, "supports_device_memory", False) or not layers:
        return False
    return any(p.device.type != "cpu" for p in layer_planes(layout, layers[0]))


class HostOutbox:
    """Bounded host pages mirroring held blocks of a device cache (see module doc).

    Args:
      layout: this rank's KVLayout.
      layers: this rank's per-layer caches (device tensors; planes as :func:`dlmix.pd.engine.layer_planes`).
      capacity_bytes: host bytes to allocate (bytes); at least one page (``layout.block_bytes()``).
      pin: page-lock the host planes (default: when the cache is on a CUDA device), for asynchronous copies.

    Raises ValueError when ``capacity_bytes`` cannot hold one page.
    """

    def __init__(self, layout: KVLayout, layers: list[Any], capacity_bytes: int, *, pin: bool | None = None):
        self.layout = layout
        self.planes = [[p.view(torch.uint8).reshape(p.shape[0], -1) for p in layer_planes(layout, c)]
                       for c in layers]
        self.page_bytes = plane_page_bytes(layout)  # bytes of one block of one plane
        per_page = self.page_bytes * sum(len(ps) for ps in self.planes)
        self.capacity = int(capacity_bytes) // per_page
        if self.capacity < 1:
            raise ValueError(f"outbox of {capacity_bytes} B cannot hold one page ({per_page} B: one block of "
                             f"{len(self.planes)} layers)")
        device = self.planes[0][0].device
        if pin is None:
            pin = device.type == "cuda" and torch.cuda.is_available()
        self.host = [[torch.empty((self.capacity, self.page_bytes), dtype=torch.uint8, pin_memory=pin)
                      for _ in ps] for ps in self.planes]
        self.device = device
        self._free = list(range(self.capacity - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def free_pages(self) -> int:
        """Outbox pages not holding a granted request."""
        with self._lock:
            return len(self._free)

    def register(self, transport: Any) -> None:
        """Register the host planes with ``transport`` under :func:`dlmix.pd.engine.region_names` (the names the
        cache would have)."""
        for names, planes in zip(region_names(self.layout), self.host):
            for name, plane in zip(names, planes):
                transport.register(name, plane)

    def stage(self, block_ids: list[int]) -> list[int]:
        """Copy ``block_ids`` of every layer plane from the cache into free pages; returns those page ids (same
        order). Raises MemoryError (nothing taken) when fewer than ``len(block_ids)`` pages are free."""
        n = len(block_ids)
        with self._lock:
            if n > len(self._free):
                raise MemoryError(f"host outbox has {len(self._free)} of {self.capacity} pages free, the request "
                                  f"needs {n}")
            pages = [self._free.pop() for _ in range(n)]
        try:
            src = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            dst = torch.tensor(pages, dtype=torch.long)
            for dev_planes, host_planes in zip(self.planes, self.host):
                for d, h in zip(dev_planes, host_planes):
                    h.index_copy_(0, dst, d.index_select(0, src).to("cpu"))
        except BaseException:
            self.unstage(pages)
            raise
        return pages

    def unstage(self, pages: list[int]) -> None:
        """Return ``pages`` to the free list (the hold that used them is released)."""
        with self._lock:
            self._free.extend(pages)
