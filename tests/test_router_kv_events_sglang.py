"""SGLang's KV events (one ``BlockStored`` per page, SGLang's own page hashes) decoded into the router's keys: the
index then holds exactly the keys the router computes for a request's prompt, at any ratio of router block size to
SGLang page size, with ``cache_salt``; evictions and clears; chains whose start was missed are skipped."""
from __future__ import annotations

import random

import pytest

from dlmix.router import kv_events
from dlmix.router.kv_events import Cleared, Removed, Stored
from dlmix.router.kv_events import sglang as S
from dlmix.routing.hashing import BlockHasher
from dlmix.routing.prefix_index import PrefixIndex


def _pages(tokens, page, salt=None, base=1000, parent=None):
    """SGLang-like events for one radix node: one BlockStored per page, chained by (fake) page hashes."""
    evs, hashes = [], []
    for i in range(0, len(tokens), page):
        h = base + i
        evs.append(S.BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=list(tokens[i:i + page]),
                                 block_size=len(tokens[i:i + page]), medium="GPU", cache_salt=salt))
        parent = h
        hashes.append(h)
    return evs, hashes


def _stored(updates) -> list:
    assert all(isinstance(u, Stored) for u in updates)
    return [k for u in updates for k in u.keys]


@pytest.mark.parametrize("page,block", [(1, 16), (16, 16), (64, 16), (16, 64), (4, 6)])
def test_keys_equal_the_routers_request_keys(page, block):
    hasher = BlockHasher("sha256_cbor", None)
    rng = random.Random(page * 100 + block)
    tokens = [rng.randrange(50000) for _ in range(200)]
    want = hasher.block_keys(tokens, block)
    dec = kv_events.decode_fn("sglang", hasher, block)
    evs, _ = _pages(tokens[:96], page)
    evs2, _ = _pages(tokens[96:], page, base=5000, parent=evs[-1].block_hashes[0])  # a child radix node
    got = []
    for batch in (S.KVEventBatch(ts=0.0, events=evs), S.KVEventBatch(ts=1.0, events=evs2)):
        for u in dec(S.encode_batch(batch)):
            assert isinstance(u, Stored)
            got.extend(u.keys)
    assert got == want and len(want) == 200 // block
    idx = PrefixIndex()
    idx.store(3, got)
    assert idx.match(want) == {3: len(want)}


def test_cache_salt_separates_and_matches():
    hasher = BlockHasher("sha256_cbor", None)
    tokens = list(range(100, 164))
    dec = S.Decoder(hasher, 16)
    evs, _ = _pages(tokens, 16, salt="tenant-a")
    keys = _stored(dec.updates(S.KVEventBatch(ts=0.0, events=evs)))
    assert keys == hasher.block_keys(tokens, 16, "tenant-a")
    assert set(keys).isdisjoint(hasher.block_keys(tokens, 16))


def test_removal_clear_unknown_parent_and_skipped_events():
    hasher = BlockHasher("sha256_cbor", None)
    tokens = list(range(64))
    dec = S.Decoder(hasher, 16)
    evs, hashes = _pages(tokens, 8)
    keys = _stored(dec.updates(S.KVEventBatch(ts=0.0, events=evs)))
    assert keys == hasher.block_keys(tokens, 16)
    # evicting the last two pages (leaf first) removes the router block they completed
    (rm,) = dec.updates(S.KVEventBatch(ts=1.0, events=[S.BlockRemoved(block_hashes=hashes[-2:])]))
    assert isinstance(rm, Removed) and list(rm.keys) == keys[-1:]
    # a page whose parent the decoder never saw (subscribed late) is skipped, not mis-keyed
    orphan = S.BlockStored(block_hashes=[9], parent_block_hash=424242, token_ids=list(range(16)), block_size=16)
    lora = S.BlockStored(block_hashes=[10], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
                         lora_name="adapter")
    cpu = S.BlockStored(block_hashes=[11], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
                        medium="CPU_PINNED")
    assert dec.updates(S.KVEventBatch(ts=2.0, events=[orphan, lora, cpu])) == []
    assert dec.updates(S.KVEventBatch(ts=3.0, events=[S.AllBlocksCleared()])) == [Cleared()]
    assert dec.pages == {}


def test_registration_accepts_sglang_kv_events():
    from dlmix.router.config import RouterConfig
    from dlmix.router.server import Router

    r = Router(RouterConfig(port=0, instances=[{"url": "http://127.0.0.1:9", "engine": "sglang",
                                                "kv_events": "tcp://127.0.0.1:5557", "block_size": 32}]))
    assert r.instances[0].kv_events == "tcp://127.0.0.1:5557"
