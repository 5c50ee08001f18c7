"""KV cache events of an LMDeploy engine's prefix cache, published for the dlmix router (LMDeploy 0.18 has none).

With ``kv_events_endpoint`` in ``DLMIX_LMDEPLOY_CONFIG`` (e.g. ``tcp://127.0.0.1:5557``) and LMDeploy's
``--enable-prefix-caching``, the engine process binds a ZMQ PUB socket there (started by the patched
``Engine.__init__``), and the patched trie nodes (``pytorch/paging/block_trie/node.py``, :mod:`dlmix_lmdeploy.patches`)
report each block attached to the trie (``Node.attach_to``: the block is cached and can be reused by a later prompt)
and each evicted leaf (``Node.detach_leaf``). Events are queued without blocking the scheduler and sent in batches
from a daemon thread every ``FLUSH_S`` seconds, in the core's KV event wire format
(:mod:`dlmix.routing.kv_events`, which the router decodes for LMDeploy in :mod:`dlmix.router.kv_events.lmdeploy`). Blocks of LoRA adapters and of multimodal spans are not published (the
router keys prompts by their token ids only). With ``router_url`` the endpoint goes into the router registration.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from dlmix.routing.kv_events import BlockRemoved, BlockStored, KVEventBatch, encode_batch

log = logging.getLogger("dlmix_lmdeploy.kv_events")

__all__ = ["Publisher", "current", "start", "FLUSH_S"]

#: seconds between two batches
FLUSH_S = 0.02

_publisher: "Publisher | None" = None


def current() -> "Publisher | None":
    """This process's publisher, or None when KV events are off."""
    return _publisher


def _hash(h: Any) -> int:
    return int(h) & ((1 << 64) - 1)


class Publisher:
    """ZMQ PUB of block stored/removed events (see module doc).

    Args: endpoint: where to bind (``tcp://host:port`` or ``ipc://path``); block_size: tokens per block.
    Raises zmq.ZMQError when the endpoint cannot be bound.
    """

    def __init__(self, endpoint: str, block_size: int):
        import zmq

        self.endpoint = endpoint
        self.block_size = int(block_size)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._seq = 0
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="dlmix-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _published(node: Any) -> bool:
        return not getattr(node, "adapter_name", None) and not getattr(node, "extra_identity", ())

    def stored(self, node: Any) -> None:
        """``node`` (an LMDeploy trie ``Node``) was attached to its parent: its block is cached."""
        if not self._published(node):
            return
        parent = node.parent
        ph = _hash(parent.block_hash) if parent is not None and parent.block_id >= 0 else None
        self._q.put(BlockStored(block_hashes=[_hash(node.block_hash)], parent_block_hash=ph,
                                token_ids=[int(t) for t in node.token_ids], block_size=self.block_size,
                                medium="GPU"))

    def removed(self, node: Any) -> None:
        """``node`` was evicted (detached leaf)."""
        if self._published(node):
            self._q.put(BlockRemoved(block_hashes=[_hash(node.block_hash)], medium="GPU"))

    def _run(self) -> None:
        while True:
            events = [self._q.get()]
            time.sleep(FLUSH_S)
            try:
                while True:
                    events.append(self._q.get_nowait())
            except queue.Empty:
                pass
            try:
                self._seq += 1
                self._sock.send_multipart([b"", self._seq.to_bytes(8, "big"),
                                           encode_batch(KVEventBatch(ts=time.time(), events=events))])
                self.sent += len(events)
            except Exception as e:  # never let the publisher die; the router's index only goes stale
                log.warning("dlmix: KV events not sent: %s", e)


def start(endpoint: str | None, block_size: int) -> Publisher | None:
    """Start this process's publisher on ``endpoint`` (once); None when ``endpoint`` is None."""
    global _publisher
    if endpoint is None:
        return None
    if _publisher is None:
        _publisher = Publisher(endpoint, block_size)
        log.info("dlmix: publishing LMDeploy KV events on %s", endpoint)
    return _publisher
