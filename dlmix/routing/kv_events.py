"""KV cache event wire format: the batches an engine publishes when blocks enter or leave its prefix cache.

The format SGLang publishes (read from SGLang 0.5 ``sglang/srt/disaggregation/kv_events.py`` and
``sglang/srt/mem_cache/events.py``), itself vLLM's: ZMQ PUB multipart ``[topic, seq, payload]``, ``payload`` a
msgpack array ``[ts, events, attn_dp_rank]`` whose events are tagged maps. dlmix's LMDeploy adapter publishes in this
format too (LMDeploy publishes no events). Publishers encode with :func:`encode_batch`; the router's decoders
(:mod:`dlmix.router.kv_events`) turn batches into its own block keys.
"""
from __future__ import annotations

from typing import Any, List, Optional, Union

import msgspec

__all__ = ["Hash", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch", "encode_batch", "decode_batch"]

Hash = Union[int, bytes]


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    """Pages now cached on the publisher (one page per hash, usually one)."""

    block_hashes: List[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: List[Any]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    """Pages evicted on the publisher."""

    block_hashes: List[Hash]
    medium: Optional[str] = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    """The publisher dropped its whole prefix cache."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """One published batch: timestamp (s), events, attention-DP rank."""

    ts: float
    events: List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    attn_dp_rank: Optional[int] = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of ``batch`` (the third frame of a published message)."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload. Raises msgspec.DecodeError / ValidationError on a malformed one."""
    return _decoder.decode(payload)
