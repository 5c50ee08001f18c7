"""vLLM KV cache events: wire format mirror and a ZMQ subscriber feeding the prefix index.

Wire format (read from ``vllm/distributed/kv_events.py``, vLLM 0.32, ``ZmqEventPublisher``): PUB socket, multipart
``[topic, seq (8 bytes big-endian), payload]``; ``payload`` = msgpack of ``KVEventBatch``, an array-like struct
``[ts: float, events: list, data_parallel_rank?]``; each event a tagged struct encoded as a map with ``"type"`` =
class name: ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
extra_keys?, group_idx?, ...}``, ``BlockRemoved{block_hashes, medium, group_idx?, ...}``, ``AllBlocksCleared{}``.
Block hashes are 64-bit ints by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or 32-byte strings; both map
to :func:`dlmix.routing.hashing.to_key`. Engine flag: ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557"}'``. The router connects a SUB socket to the instance's endpoint.
"""
from __future__ import annotations

import asyncio
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


def apply_batch(index, slot: int, batch: KVEventBatch, media=("GPU", None)) -> int:
    """Apply a batch to a :class:`~dlmix.routing.prefix_index.PrefixIndex` for instance ``slot``.

    Only events of the listed storage media count (default: device tier ``GPU`` or unspecified; offloaded CPU/disk
    blocks are not prefix hits of the engine's own cache). Returns the number of events applied.
    """
    n = 0
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            if ev.medium in media:
                index.store(slot, [to_key(h) for h in ev.block_hashes])
                n += 1
        elif isinstance(ev, BlockRemoved):
            if ev.medium in media:
                index.remove(slot, [to_key(h) for h in ev.block_hashes])
                n += 1
        elif isinstance(ev, AllBlocksCleared):
            index.clear(slot)
            n += 1
    return n


async def subscribe(endpoint: str, index, slot_of, on_error=None, topic: bytes = b"") -> None:
    """Run forever: SUB to ``endpoint`` and apply every batch to ``index`` for ``slot_of()`` (a callable, so a
    re-slotted instance keeps working). Bad payloads are counted via ``on_error(exc)`` and skipped. Cancel to stop."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        while True:
            frames = await sock.recv_multipart()
            try:
                apply_batch(index, slot_of(), decode_batch(frames[-1]))
            except (msgspec.DecodeError, msgspec.ValidationError, IndexError) as ex:
                if on_error is not None:
                    on_error(ex)
    except asyncio.CancelledError:
        pass
    finally:
        sock.close(0)
