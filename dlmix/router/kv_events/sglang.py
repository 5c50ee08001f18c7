"""SGLang's KV cache events: a stateful decoder to the router's own block keys.

Wire format: :mod:`dlmix.routing.kv_events` (SGLang 0.5's, the same ZMQ PUB multipart ``[topic, seq, payload]``
and msgpack encoding as vLLM's). The radix cache publishes one ``BlockStored`` per KV page
(``block_hashes`` = ``[page hash]``, ``parent_block_hash`` = the previous page's hash or None at the root,
``token_ids`` = the page's tokens, ``block_size`` = their count, ``cache_salt``, ``lora_name``) and one
``BlockRemoved`` per evicted radix node. Engine flag: ``--kv-events-config '{"publisher": "zmq", "endpoint":
"tcp://*:5557"}'``.

SGLang's page hashes are its own, so the router cannot look them up with the keys it computes for a request. This
decoder re-hashes the published token ids with the router's :class:`~dlmix.routing.hashing.BlockHasher` in blocks of
the instance's registered ``block_size`` (any multiple or fraction of SGLang's ``--page-size``; a page's tokens that
do not fill a router block wait in the page's state for the child page), so the index holds exactly the keys a
request's prompt produces (``cache_salt`` included). It keeps, per cached page, the router chain state after it
(bounded: ``max_pages``; when full, it is cleared, the instance's index entries with it (a ``Cleared``
update), and the chains restart with the next root page). Events of
LoRA adapters (``lora_name``) and of offloaded tiers (``medium`` other than ``GPU``) are skipped.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from dlmix.routing.hashing import BlockHasher, to_key
from dlmix.routing.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch", "encode_batch", "Decoder", "make"]

#: per page: (router chain hash after the page's full router blocks or None at the root, tokens waiting for the next
#: router block, cache_salt of the chain, router keys completed by this page)
_PageState = Tuple[Optional[bytes], Tuple[int, ...], Optional[str], Tuple[int, ...]]


class Decoder:
    """Stateful SGLang decoder for one instance: ``decoder(payload) -> list`` of engine-neutral updates
    (:mod:`dlmix.router.kv_events`) in the router's keys.

    Args:
        hasher: the router's block hasher (the one that hashes requests).
        block_size: the instance's registered block size in tokens (the router's block for its prefix keys).
        max_pages: most pages whose chain state is kept (memory bound).
    Raises msgspec.DecodeError / ValidationError (from a call) on a malformed payload.
    """

    def __init__(self, hasher: BlockHasher, block_size: int, max_pages: int = 1 << 20):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.hasher = hasher
        self.block_size = block_size
        self.max_pages = max_pages
        self.pages: Dict[Any, _PageState] = {}

    def reset(self) -> None:
        """Forget every page's chain state (the publisher restarted)."""
        self.pages.clear()

    def __call__(self, payload: bytes) -> list:
        return self.updates(decode_batch(payload))

    def updates(self, batch: KVEventBatch) -> list:
        """The batch as engine-neutral updates."""
        from dlmix.router.kv_events import Cleared, Removed, Stored

        out: list = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.medium not in ("GPU", None) or ev.lora_name is not None:
                    continue
                n = len(ev.block_hashes)
                if n > self.max_pages:
                    continue  # more pages than the state table holds: not tracked
                if len(self.pages) + n > self.max_pages:
                    # the chain states go, so must the keys they produced: their evictions could no longer be
                    # mapped to keys and would stay in the index for ever
                    self.reset()
                    out.append(Cleared())
                keys = self._store(ev)
                if keys:
                    out.append(Stored(keys))
            elif isinstance(ev, BlockRemoved):
                if ev.medium not in ("GPU", None):
                    continue
                gone: List[int] = []
                for h in ev.block_hashes:
                    st = self.pages.pop(h, None)
                    if st is not None:
                        gone.extend(st[3])
                if gone:
                    out.append(Removed(gone))
            elif isinstance(ev, AllBlocksCleared):
                self.reset()
                out.append(Cleared())
        return out

    def _store(self, ev: BlockStored) -> List[int]:
        n = len(ev.block_hashes)
        if not n:
            return []
        if ev.parent_block_hash is None:
            state: Optional[_PageState] = (None, (), ev.cache_salt, ())
        else:
            state = self.pages.get(ev.parent_block_hash)
            if state is None:  # the parent's chain is unknown (evicted state, or events before we subscribed)
                return []
        toks = ev.token_ids
        if not all(type(t) is int for t in toks):  # bigram keys (EAGLE), or malformed: not a prompt's token ids
            return []  # skipped, not raised: the batch's other events (evictions) must still be applied
        per = max(len(toks) // n, 1)
        B = self.block_size
        out: List[int] = []
        parent, pending, salt, _ = state
        for j, h in enumerate(ev.block_hashes):
            page = toks[j * per: (j + 1) * per] if j < n - 1 else toks[j * per:]
            pending = pending + tuple(page)
            done: List[int] = []
            while len(pending) >= B:
                extra = (("cache_salt", salt),) if (salt and parent is None) else None
                parent = self.hasher.hash_block(parent, pending[:B], extra)
                done.append(to_key(parent))
                pending = pending[B:]
            self.pages[h] = (parent, pending, salt, tuple(done))
            out.extend(done)
        return out


def make(hasher: BlockHasher, block_size: int):
    """A :class:`Decoder` for one instance (the stateful-decoder hook of :mod:`dlmix.router.kv_events`)."""
    return Decoder(hasher, block_size)
