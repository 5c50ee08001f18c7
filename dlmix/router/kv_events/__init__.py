"""Engine KV-cache events feeding the router's exact prefix index: engine-neutral updates and the ZMQ subscriber.

An engine publishes which KV blocks it stored or evicted; the router keeps a
:class:`~dlmix.routing.prefix_index.PrefixIndex` per instance slot from them. The router core only knows three
engine-neutral updates (:class:`Stored`, :class:`Removed`, :class:`Cleared`, block keys as 64-bit ints, see
:func:`dlmix.routing.hashing.to_key`). Each engine's wire format lives in its own decoder module in this package
(``vllm.py``, ``sglang.py``, ``lmdeploy.py``), registered in :data:`DECODERS` by engine name; a decoder module exposes
``decode(payload: bytes) -> list`` of updates (stateless: the engine publishes the router's own block hashes, as
vLLM does) or ``make(hasher, block_size) -> callable(payload) -> list`` (stateful, one per instance: the router
re-hashes published token ids, as for SGLang), and raises ``ValueError`` (or msgspec's errors) on a bad payload.

Adding an engine: write ``dlmix/router/kv_events/<engine>.py`` with ``decode`` or ``make`` and add it to
:data:`DECODERS`.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Iterable, List, Optional, Sequence

import msgspec

from dlmix.router.kv_events import lmdeploy, sglang, vllm

__all__ = ["Stored", "Removed", "Cleared", "apply", "DECODERS", "get_decoder", "decode_fn", "subscribe"]


class Stored(msgspec.Struct, frozen=True):
    """Blocks now cached on the instance: block keys (ints) in chain order."""

    keys: Sequence[int]


class Removed(msgspec.Struct, frozen=True):
    """Blocks evicted on the instance: block keys (ints)."""

    keys: Sequence[int]


class Cleared(msgspec.Struct, frozen=True):
    """The instance dropped its whole prefix cache."""


def apply(index, slot: int, updates: Iterable) -> int:
    """Apply engine-neutral updates to ``index`` (a :class:`~dlmix.routing.prefix_index.PrefixIndex`) for instance
    ``slot``. Returns the number of updates applied; other objects are skipped."""
    n = 0
    for u in updates:
        if isinstance(u, Stored):
            index.store(slot, list(u.keys))
        elif isinstance(u, Removed):
            index.remove(slot, list(u.keys))
        elif isinstance(u, Cleared):
            index.clear(slot)
        else:
            continue
        n += 1
    return n


#: engine name -> decoder module (``decode(payload) -> list`` of updates, or ``make(hasher, block_size)``)
DECODERS = {"vllm": vllm, "sglang": sglang, "lmdeploy": lmdeploy}


def get_decoder(engine: str):
    """The KV-event decoder module of ``engine``. Raises ValueError naming the engines that have one."""
    try:
        return DECODERS[engine]
    except KeyError:
        raise ValueError(f"no KV-event decoder for engine {engine!r}; known: {', '.join(DECODERS)}") from None


def decode_fn(engine: str, hasher, block_size: int) -> Callable[[bytes], list]:
    """The payload decoder for one instance of ``engine``: the module's ``decode``, or a fresh stateful decoder from
    its ``make(hasher, block_size)``. Raises ValueError for an engine without a decoder."""
    mod = get_decoder(engine)
    make = getattr(mod, "make", None)
    return make(hasher, block_size) if make is not None else mod.decode


async def subscribe(endpoint: str, index, slot_of: Callable[[], int], on_error: Optional[Callable] = None,
                    topic: bytes = b"", decoder=vllm) -> None:
    """Run forever: SUB to the ZMQ ``endpoint`` and apply every message's last frame, decoded by ``decoder`` (a
    module from :data:`DECODERS` with ``decode``, or a callable ``payload -> list``, see :func:`decode_fn`), to
    ``index`` for slot ``slot_of()`` (a callable, so a re-slotted instance keeps working). Bad payloads are reported
    to ``on_error(exc)`` and skipped. A sequence number (the 8-byte big-endian frame before the payload) lower than
    the last one means a new publisher process (the engine restarted with an empty cache): the slot's entries are
    cleared first (and a stateful decoder's ``reset()`` called). Cancel the task to stop."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    decode = decoder if callable(decoder) else decoder.decode
    last_seq = -1
    try:
        while True:
            frames: List[bytes] = await sock.recv_multipart()
            if len(frames) >= 3 and len(frames[-2]) == 8:
                seq = int.from_bytes(frames[-2], "big")
                if seq < last_seq:  # the publisher restarted: what the old process stored is gone
                    apply(index, slot_of(), [Cleared()])
                    reset = getattr(decode, "reset", None)
                    if reset is not None:
                        reset()
                last_seq = seq
            try:
                apply(index, slot_of(), decode(frames[-1]))
            except Exception as ex:  # noqa: BLE001 - a bad payload must not stop this instance's events for good
                if on_error is not None:
                    on_error(ex)
    except asyncio.CancelledError:
        pass
    finally:
        sock.close(0)
