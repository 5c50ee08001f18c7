"""KV-event ingestion against broken or hostile publishers and engine restarts, and prefix state of removed
instances: a malformed event skips only itself, a full SGLang page table leaves no key it can no longer remove,
a restarted publisher (its sequence numbers start again) drops the old process's blocks, and a slot given to a
new instance inherits no prefix."""
from __future__ import annotations

import asyncio
import os
import tempfile

import zmq
import zmq.asyncio

from dlmix.router import kv_events
from dlmix.router.config import RouterConfig
from dlmix.router.kv_events import sglang as S
from dlmix.router.kv_events import vllm as V
from dlmix.router.server import Router
from dlmix.routing.hashing import BlockHasher
from dlmix.routing.policies.base import ClusterView
from dlmix.routing.prefix_index import PrefixIndex
from dlmix.routing.state import RouteRequest


def _batch(*events) -> bytes:
    return S.encode_batch(S.KVEventBatch(ts=0.0, events=list(events)))


def test_decoder_mixed_token_types_is_a_value_error_not_a_crash():
    """A BlockStored whose token_ids mix ints and other values must be reported as a bad payload (ValueError, what
    subscribe() skips) or ignored, never TypeError."""
    dec = S.Decoder(BlockHasher("sha256_cbor", None), 4)
    bad = S.BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[1, "x", 3, 4], block_size=4)
    try:
        out = dec(_batch(bad))
    except ValueError:
        return
    assert out == []


def test_subscriber_survives_a_malformed_event():
    """End to end through subscribe() over ZMQ (ipc): after one malformed event, a later BlockRemoved is still
    applied (index empty again) and the subscriber task is still running."""
    async def main():
        path = os.path.join(tempfile.mkdtemp(prefix="r1"), "kv.ipc")
        ep = "ipc://" + path
        ctx = zmq.asyncio.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(ep)
        idx, errs = PrefixIndex(), []
        dec = kv_events.decode_fn("sglang", BlockHasher("sha256_cbor", None), 4)
        task = asyncio.get_running_loop().create_task(kv_events.subscribe(ep, idx, lambda: 0, errs.append,
                                                                          decoder=dec))
        good = S.BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4)
        seq = 0
        for _ in range(300):  # slow joiner: resend until the subscription is up (re-storing is idempotent)
            seq += 1
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), _batch(good)])
            await asyncio.sleep(0.01)
            if len(idx):
                break
        assert len(idx) == 1
        bad = S.BlockStored(block_hashes=[2], parent_block_hash=None, token_ids=[1, "x", 3, 4], block_size=4)
        seq += 1
        await pub.send_multipart([b"", seq.to_bytes(8, "big"), _batch(bad)])
        seq += 1
        await pub.send_multipart([b"", seq.to_bytes(8, "big"), _batch(S.BlockRemoved(block_hashes=[1]))])
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not len(idx) or task.done():
                break
        await asyncio.sleep(0.05)
        alive = not task.done()
        crashed = task.exception() if task.done() and not task.cancelled() else None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close(0)
        return len(idx), alive, crashed

    n, alive, crashed = asyncio.run(main())
    assert crashed is None, f"subscriber task died: {crashed!r}"
    assert alive
    assert n == 0, "the eviction after the malformed event was never applied"


def test_malformed_event_does_not_swallow_the_batchs_evictions():
    """A batch [BlockRemoved(page 1), malformed BlockStored]: the eviction must still come out of the decoder."""
    hasher = BlockHasher("sha256_cbor", None)
    dec = S.Decoder(hasher, 4)
    (st,) = dec(_batch(S.BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4)))
    bad = S.BlockStored(block_hashes=[2], parent_block_hash=None, token_ids=[5, None, 7, 8], block_size=4)
    try:
        out = dec(_batch(S.BlockRemoved(block_hashes=[1]), bad))
    except Exception as ex:  # noqa: BLE001
        raise AssertionError(f"the eviction of page 1 was lost with the batch: {ex!r}")
    assert out == [kv_events.Removed(list(st.keys))]


def _page(h, parent, toks):
    return S.BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=list(toks), block_size=len(toks))


def test_evicted_blocks_leave_the_index_after_a_page_table_overflow():
    """Chain A (2 pages) stored, a new root page overflows the table (max_pages=2), then the engine evicts chain A:
    A's keys must not remain in the index."""
    hasher = BlockHasher("sha256_cbor", None)
    dec = S.Decoder(hasher, 4, max_pages=2)
    idx = PrefixIndex()
    a = list(range(100, 108))
    a_keys = hasher.block_keys(a, 4)
    kv_events.apply(idx, 0, dec.updates(S.KVEventBatch(ts=0.0, events=[_page(1, None, a[:4]), _page(2, 1, a[4:])])))
    assert idx.match(a_keys) == {0: 2}
    b = list(range(200, 204))
    kv_events.apply(idx, 0, dec.updates(S.KVEventBatch(ts=1.0, events=[_page(3, None, b)])))
    assert idx.match(hasher.block_keys(b, 4)) == {0: 1}
    # the engine evicts chain A (leaf first)
    kv_events.apply(idx, 0, dec.updates(S.KVEventBatch(ts=2.0, events=[S.BlockRemoved(block_hashes=[2]),
                                                                       S.BlockRemoved(block_hashes=[1])])))
    assert idx.match(a_keys) == {}, "evicted blocks still advertised on slot 0"


def test_index_does_not_grow_past_the_decoder_state():
    """An engine that stores and evicts distinct root pages forever: index size must stay bounded (here by
    max_pages), not grow by one key per overflow."""
    hasher = BlockHasher("sha256_cbor", None)
    dec = S.Decoder(hasher, 4, max_pages=8)
    idx = PrefixIndex()
    for i in range(200):
        toks = [1000 + 4 * i + j for j in range(4)]
        kv_events.apply(idx, 0, dec.updates(S.KVEventBatch(ts=float(i), events=[_page(10_000 + i, None, toks)])))
        if i >= 8:  # the engine keeps 8 pages: it evicts the oldest
            kv_events.apply(idx, 0, dec.updates(S.KVEventBatch(
                ts=float(i), events=[S.BlockRemoved(block_hashes=[10_000 + i - 8])])))
    assert len(idx) <= 8, f"index holds {len(idx)} keys for an engine that caches 8 pages"


def _stored(*keys) -> bytes:
    return V.encode_batch(V.KVEventBatch(ts=0.0, events=[V.BlockStored(
        block_hashes=list(keys), parent_block_hash=None, token_ids=list(range(16 * len(keys))), block_size=16,
        medium="GPU")]))


async def _publish_until(pub, seq, payload, idx, key, tries=300):
    """Send (re-sending: slow joiner / reconnect) until ``key`` is in the index. Returns the next seq."""
    for _ in range(tries):
        await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1
        await asyncio.sleep(0.01)
        if idx.match([key]):
            return seq
    raise AssertionError(f"key {key} never reached the index")


def test_restarted_publisher_drops_the_old_processes_blocks():
    """Engine process 1 stores block 111 (seq up to ~N), dies; process 2 binds the same endpoint, numbers from 0
    and stores block 222. Block 111 must no longer be matched on the instance."""
    async def main():
        ep = "ipc://" + os.path.join(tempfile.mkdtemp(prefix="r3"), "kv.ipc")
        ctx = zmq.asyncio.Context.instance()
        idx, errs = PrefixIndex(), []
        task = asyncio.get_running_loop().create_task(kv_events.subscribe(ep, idx, lambda: 0, errs.append,
                                                                          decoder=V))
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(ep)
        await _publish_until(pub, 100, _stored(111), idx, 111)
        pub.close(0)  # engine process 1 dies
        await asyncio.sleep(0.05)
        pub = ctx.socket(zmq.PUB)  # engine process 2: same endpoint, empty cache, sequence restarts
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(ep)
        await _publish_until(pub, 0, _stored(222), idx, 222)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close(0)
        return idx.match([111]), idx.match([222]), errs

    old, new, errs = asyncio.run(main())
    assert new == {0: 1}
    assert old == {}, "block of the dead engine process still routed to the instance"


def test_new_instance_in_a_reused_slot_does_not_inherit_the_removed_ones_prefixes():
    """A gets prompt P; A is removed; C registers (gets A's slot 0). With C busier than B, P must go to B (a miss:
    least in flight), not to C."""
    r = Router(RouterConfig(port=0, policy="dlrouter_prefix_cache", instances=[
        {"url": "http://127.0.0.1:9001", "id": "A"}, {"url": "http://127.0.0.1:9002", "id": "B"}]))
    reg = r.registry
    a, b = reg.instances
    assert (a.slot, b.slot) == (0, 1)
    req = RouteRequest(key="tenant-42 long shared system prompt")
    b.load.inflight = 5  # A idle: P goes to A
    assert r.policy.choose(req, ClusterView(reg.instances)).decode is a
    assert reg.remove("A")
    c = reg.register({"url": "http://127.0.0.1:9003", "id": "C"})
    assert c.slot == 0
    b.load.inflight = 0
    c.load.inflight = 5
    got = r.policy.choose(req, ClusterView(reg.instances)).decode
    assert got is b, f"routed to {got.id}, which never saw the prefix (inherited slot {c.slot})"
