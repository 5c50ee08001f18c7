"""vLLM's KV cache events: wire format mirror and decoder to the router's engine-neutral updates.

Wire format (read from ``vllm/distributed/kv_events.py``, vLLM 0.32, ``ZmqEventPublisher``): PUB socket, multipart
``[topic, seq (8 bytes big-endian), payload]``; ``payload`` = msgpack of ``KVEventBatch``, an array-like struct
``[ts: float, events: list, data_parallel_rank?]``; each event a tagged struct encoded as a map with ``"type"`` =
class name: ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
extra_keys?, group_idx?, ...}``, ``BlockRemoved{block_hashes, medium, group_idx?, ...}``, ``AllBlocksCleared{}``.
Block hashes are 64-bit ints by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or 32-byte strings; both map
to :func:`dlmix.routing.hashing.to_key`. Engine flag: ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557"}'``. The router connects a SUB socket to the instance's endpoint
(:func:`dlmix.router.kv_events.subscribe`) and applies :func:`decode`'s updates.
"""
from __future__ import annotations

from typing import Any, List, Optional, Union

import msgspec

from dlmix.routing.hashing import to_key

Hash = Union[int, bytes]


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    """Blocks now cached on the publisher (hashes in chain order; parent = hash before the first)."""

    block_hashes: List[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None
    extra_keys: Optional[List[Any]] = None
    group_idx: Optional[int] = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    """Blocks evicted on the publisher."""

    block_hashes: List[Hash]
    medium: Optional[str] = None
    group_idx: Optional[int] = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    """The publisher dropped its whole prefix cache."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """One published batch: timestamp (s), events, DP rank."""

    ts: float
    events: List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload frame. Raises msgspec.DecodeError / ValidationError on bad input."""
    return _decoder.decode(payload)


def encode_batch(batch: KVEventBatch) -> bytes:
    """Encode a batch as vLLM does (used by the mock engine)."""
    return _encoder.encode(batch)


def updates(batch: KVEventBatch, media=("GPU", None)) -> list:
    """The batch as engine-neutral updates (:mod:`dlmix.router.kv_events`). Only events of the listed storage media
    count (default: device tier ``GPU`` or unspecified; offloaded CPU/disk blocks are not prefix hits of the
    engine's own cache)."""
    from dlmix.router.kv_events import Cleared, Removed, Stored

    out: list = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            if ev.medium in media:
                out.append(Stored([to_key(h) for h in ev.block_hashes]))
        elif isinstance(ev, BlockRemoved):
            if ev.medium in media:
                out.append(Removed([to_key(h) for h in ev.block_hashes]))
        elif isinstance(ev, AllBlocksCleared):
            out.append(Cleared())
    return out


def decode(payload: bytes) -> list:
    """Engine-neutral updates of one payload frame (the decoder interface of :mod:`dlmix.router.kv_events`).
    Raises msgspec.DecodeError / ValidationError on bad input."""
    return updates(decode_batch(payload))


def apply_batch(index, slot: int, batch: KVEventBatch, media=("GPU", None)) -> int:
    """Apply a batch to a :class:`~dlmix.routing.prefix_index.PrefixIndex` for instance ``slot`` (device-tier events
    only, see :func:`updates`). Returns the number of events applied."""
    from dlmix.router.kv_events import apply

    return apply(index, slot, updates(batch, media))
