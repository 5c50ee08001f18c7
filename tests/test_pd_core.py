"""The engine-neutral PD pull path (dlmix.pd producer/consumer/endpoint): hold bookkeeping (released on consumed,
timeout, abort; engine aborts wait out reads that may be in flight; no block left held), the consumer's claim (prefix
hit, pair, prompt digest) and real pulls over the built-in TCP transport between layouts vLLM CPU never produces
(separate K/V planes, two-plane flash layout), with exact values checked."""
from __future__ import annotations

import random
import time

import pytest
import torch

from dlmix.kv import KVLayout, ModelIdentity
from dlmix.kv.ops import allocate, read_kv, torch_dtype
from dlmix.pd.consumer import claim, failed_blocks
from dlmix.pd.contract import Abort, Consumed, Extend, TransferParams, Want, encode, prompt_digest
from dlmix.pd.endpoint import KVEndpoint
from dlmix.pd.producer import Producer, block_ranges
from dlmix.testing import fill_tokens, hold_and_pull, poll, wait_until

SECRET = "pd-core-test"


def _layout(bs: int = 32, dtype: str = "bf16", arrangement: str = "vllm_cpu", fp: str = "sha256:aa",
            layers: int = 2) -> KVLayout:
    return KVLayout(model=ModelIdentity("LlamaForCausalLM", layers, 2, 16, "gqa", weights_fingerprint=fp),
                    block_size=bs, dtype=dtype, arrangement=arrangement)


class FakeTransport:
    """Records grants/revokes/notifications (the producer's only transport calls)."""

    def __init__(self):
        self.grants: dict[str, tuple[str, list]] = {}
        self.sent: list[tuple[str, dict]] = []

    def grant(self, peer, tid, ranges, mode="r", expires_s=None):
        old = self.grants.get(tid, (peer, []))[1]
        self.grants[tid] = (peer, old + list(ranges))

    def revoke(self, tid):
        return self.grants.pop(tid, None) is not None

    def notify(self, peer, msg):
        self.sent.append((peer, msg))


def _producer(**kw) -> tuple[Producer, FakeTransport]:
    t = FakeTransport()
    args = dict(hold_timeout_s=30.0, registration_wait_s=0.0, io_timeout_s=5.0)
    args.update(kw)
    return Producer(t, _layout(), num_blocks=16, **args), t


class FakeClock:
    """Stands in for ``time`` in :mod:`dlmix.pd.producer` (its deadlines use ``time.monotonic()``): hold expiry is
    checked against seconds that the test advances, not wall time, so a loaded machine cannot shift it."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.fixture
def clock(monkeypatch):
    import dlmix.pd.producer as producer

    c = FakeClock()
    monkeypatch.setattr(producer, "time", c)
    return c


def _want(req="r", blocks=(3, 4), **kw) -> Want:
    return Want(req=req, block_ids=list(blocks), layout=_layout(128, "fp32").to_dict(), **kw)


def test_block_ranges_merge_runs_per_plane():
    lay = _layout()
    page = lay.block_bytes(per_layer=True)
    assert block_ranges(lay, [3, 4, 9]) == [("L0", 3 * page, 2 * page), ("L0", 9 * page, page),
                                            ("L1", 3 * page, 2 * page), ("L1", 9 * page, page)]
    sep = _layout(arrangement="lmdeploy")
    half = sep.block_bytes(per_layer=True) // 2
    assert block_ranges(sep, [0]) == [("L0.k", 0, half), ("L0.v", 0, half), ("L1.k", 0, half), ("L1.v", 0, half)]


def test_hold_granted_exactly_and_released_on_consumed():
    p, t = _producer()
    released = []
    p.on_released = lambda rid, why: released.append((rid, why))
    p.add_hold("r", [3, 4], 40, digest=prompt_digest(range(40)))
    p.handle("d", _want(digest=prompt_digest(range(40))))
    assert t.sent[-1] == ("d", encode(__import__("dlmix.pd.contract", fromlist=["Ready"]).Ready(req="r")))
    assert t.grants["r"] == ("d", block_ranges(_layout(), [3, 4]))
    p.handle("d", Extend(req="r"))
    assert p.take_finished() == set()
    p.handle("d", Consumed(req="r"))
    assert "r" not in t.grants and released == [("r", "consumed")]
    assert p.take_finished() == {"r"} and p.held_count() == 0


def test_a_release_naming_no_hold_is_logged_and_counted_a_late_one_is_not(caplog):
    """A consumer that releases under its own request id instead of the producer's (TransferParams.request_id) ended
    nothing, silently: the hold it meant stays until hold_timeout_s. Such a release is now a counted bad message with
    a warning saying which id to use; a second release of a hold that already ended stays quiet."""
    p, t = _producer()
    p.add_hold("r", [3, 4], 40)
    p.handle("d", _want())
    with caplog.at_level("WARNING", logger="dlmix.pd.producer"):
        p.handle("d", Consumed(req="decode-own-id"))
    assert p.is_held("r") and p.stats["bad_messages"] == 1
    assert "names no hold here" in caplog.text and "request_id" in caplog.text
    p.handle("d", Consumed(req="r"))
    assert p.take_finished() == {"r"} and not p.is_held("r")
    caplog.clear()
    with caplog.at_level("WARNING", logger="dlmix.pd.producer"):
        p.handle("d", Consumed(req="r"))  # late duplicate of a release that ended the hold
    assert p.stats["bad_messages"] == 1 and caplog.text == ""


def test_the_abort_after_a_refused_want_for_a_name_never_held_is_no_bad_message(caplog):
    """A decode's pull is refused because the prefill never held the request (its engine dropped it before the hold,
    or the hold came after ``registration_wait_s``); the decode then sends its Abort under the right, producer's id,
    as after every failed pull. That Abort is not a consumer naming its own id: no warning telling it to use the
    transfer parameters' request_id, no bad message. Before, every such pull logged that warning."""
    p, t = _producer(registration_wait_s=0.01)
    p.handle("d", _want(req="never-held"))
    assert p.stats["refused"] == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="dlmix.pd.producer"):
        p.handle("d", Abort(req="never-held"))
    assert p.stats["bad_messages"] == 0 and "names no hold here" not in caplog.text
    with caplog.at_level("WARNING", logger="dlmix.pd.producer"):
        p.handle("d", Abort(req="decode-own-id"))  # no want named it: still the mistake the warning is for
    assert p.stats["bad_messages"] == 1 and "names no hold here" in caplog.text


def test_a_hold_is_also_named_by_its_block_ids():
    """A consumer that knows the blocks but not the request id (an LMDeploy decode fed by a vLLM prefill) names the
    hold by ``block_ids_transfer_id``: granted under that name, extended, released, and the alias goes with the
    hold; the engine still sees its own request id."""
    from dlmix.pd.contract import block_ids_transfer_id

    p, t = _producer()
    released = []
    p.on_released = lambda rid, why: released.append((rid, why))
    p.add_hold("vllm-req-1", [3, 4], 40, digest=prompt_digest(range(40)))
    alias = block_ids_transfer_id([3, 4])
    p.handle("d", _want(req=alias, digest=prompt_digest(range(1, 41))))  # the prompt check still applies
    assert t.sent[-1][1]["type"] == "refused" and "differs" in t.sent[-1][1]["reasons"][0] and t.grants == {}
    p.handle("d", _want(req=alias, digest=prompt_digest(range(40))))
    assert t.sent[-1] == ("d", encode(__import__("dlmix.pd.contract", fromlist=["Ready"]).Ready(req=alias)))
    assert t.grants == {alias: ("d", block_ranges(_layout(), [3, 4]))}
    p.handle("d", _want(req="vllm-req-1"))  # the same blocks under the other name: not a second grant
    assert t.sent[-1][1]["type"] == "refused" and "another consumer" in t.sent[-1][1]["reasons"][0]
    p.handle("d", Consumed(req=alias))
    assert t.grants == {} and released == [("vllm-req-1", "consumed")]
    assert p.take_finished() == {"vllm-req-1"} and p.aliases == {}
    p.handle("d", _want(req=alias))  # gone with the hold
    assert t.sent[-1][1]["type"] == "refused" and "not held" in t.sent[-1][1]["reasons"][0]


def test_a_want_by_block_ids_waits_for_the_next_hold_on_the_same_blocks():
    """Freed blocks are reused (and a prefix-cache hit gives a new request the very same ones), so a name made of
    block ids is not stale once its hold is freed: a want by ``block_ids_transfer_id`` that overtakes the next hold on
    those blocks (the prefill's HTTP answer came before the engine's hold) waits for it. Before, the alias was
    remembered as ended and the want was refused at once (the decode then recomputed the prompt)."""
    import threading

    from dlmix.pd.contract import block_ids_transfer_id

    p, t = _producer(registration_wait_s=10.0)
    alias = block_ids_transfer_id([3, 4])
    for rid in ("req-1", alias):  # a vLLM hold named by its blocks, then a hold keyed by its blocks (LMDeploy)
        p.add_hold(rid, [3, 4], 40)
        p.handle("d", _want(req=alias))
        p.handle("d", Consumed(req=alias))
        assert p.take_finished() == {rid}
        th = threading.Thread(target=lambda: (time.sleep(0.2), p.add_hold("req-2", [3, 4], 40)))
        th.start()
        p.handle("d2", _want(req=alias))
        th.join()
        assert t.sent[-1][1]["type"] in ("ready", "blocks_ready"), t.sent[-1]
        p.handle("d2", Consumed(req=alias))
        assert p.take_finished() == {"req-2"}
    t0 = time.monotonic()
    p.handle("d", _want(req="req-1"))  # a request id freed is still refused at once
    assert t.sent[-1][1]["type"] == "refused" and time.monotonic() - t0 < 5


def test_want_refused_with_reasons_and_nothing_granted():
    p, t = _producer()
    p.add_hold("r", [3, 4], 40, digest=prompt_digest(range(40)))
    cases = [
        (_want(blocks=(3, 5)), "block ids"),
        (_want(req="unknown"), "not held"),
        (_want(digest=prompt_digest(range(1, 41))), "prompt of r differs"),
        (Want(req="r", block_ids=[3, 4], layout=_layout(fp="sha256:zz").to_dict()), "fingerprint"),
    ]
    for msg, reason in cases:
        p.handle("d", msg)
        peer, reply = t.sent[-1]
        assert reply["type"] == "refused" and any(reason in r for r in reply["reasons"]), reply
    assert t.grants == {} and p.is_held("r")
    p.handle("d", _want())
    p.handle("e", _want())  # a second consumer cannot take over a granted hold
    assert t.sent[-1][1]["type"] == "refused" and "another consumer" in t.sent[-1][1]["reasons"][0]
    assert t.grants["r"][0] == "d"


def test_hold_expires_unless_a_read_extends_it(clock):
    released = []
    p, t = _producer(hold_timeout_s=0.05, io_timeout_s=0.3, on_released=lambda rid, why: released.append((rid, why)))
    p.add_hold("idle", [1], 10)
    p.add_hold("read", [2], 10)
    p.handle("d", _want(req="read", blocks=(2,)))
    clock.sleep(0.1)
    assert p.take_finished() == {"idle"}  # the one being read lives io_timeout_s from its want
    p.handle("d", Extend(req="read"))
    clock.sleep(0.2)
    assert p.take_finished() == set()
    clock.sleep(0.25)
    # granted: revoked at its deadline, but freed only io_timeout_s later (a read being served may still touch it)
    assert p.take_finished() == set() and t.grants == {} and p.stats["expired"] == 2
    p.handle("d", Extend(req="read"))  # too late: no new grant, no new deadline
    assert t.grants == {}
    clock.sleep(0.29)
    assert p.take_finished() == set()
    clock.sleep(0.02)
    assert p.take_finished() == {"read"} and released == [("idle", "expired"), ("read", "expired")]


def test_an_expired_granted_hold_is_freed_at_once_when_its_consumer_reports(clock):
    p, t = _producer(hold_timeout_s=0.05, io_timeout_s=0.3)
    p.add_hold("r", [2], 10)
    p.handle("d", _want(req="r", blocks=(2,)))
    clock.sleep(0.31)
    assert p.take_finished() == set() and t.grants == {}
    p.handle("d", Abort(req="r"))  # the consumer gave up its read: nothing can touch the blocks any more
    assert p.take_finished() == {"r"}


def test_engine_abort_frees_ungranted_at_once_and_granted_after_reads_can_end(clock):
    p, t = _producer(io_timeout_s=0.2)
    p.add_hold("a", [1], 10)
    p.add_hold("b", [2], 10)
    p.handle("d", _want(req="b", blocks=(2,)))
    p.engine_abort("a")
    p.engine_abort("b")
    assert "b" not in t.grants  # revoked at once: no new op may start
    assert p.take_finished() == {"a"}  # b's blocks may still be under a served read
    p.handle("d", Extend(req="b"))  # cannot revive an aborted hold
    clock.sleep(0.25)
    assert p.take_finished() == {"b"} and p.held_count() == 0


def test_abort_from_consumer_releases_and_late_messages_are_harmless():
    p, t = _producer()
    p.add_hold("r", [1], 10)
    p.handle("d", Abort(req="r"))
    p.handle("d", Consumed(req="r"))
    p.handle("d", Extend(req="r"))
    assert p.take_finished() == {"r"} and p.stats["aborted"] == 1 and p.stats["consumed"] == 0
    with pytest.raises(ValueError, match="outside"):
        p.add_hold("x", [99], 10)
    with pytest.raises(ValueError, match="need more"):
        p.add_hold("x", [1], 100)


def test_a_refused_consumers_abort_leaves_the_grantees_hold_alone():
    """A second decode that names the held blocks with another prompt is refused; the abort it then sends (every
    adapter aborts after a failed pull) must not release the hold under the granted decode's read: the grant stays,
    the engine is not told to free the blocks, and the grantee's own consumed notice releases them."""
    p, t = _producer()
    p.add_hold("r", [3, 4], 40, digest=prompt_digest(range(40)))
    want = dict(req="r", block_ids=[3, 4], layout=_layout(128, "fp32").to_dict())
    p.handle("decodeA", Want(digest=prompt_digest(range(40)), **want))
    assert t.sent[-1][1]["type"] == "blocks_ready" and "r" in t.grants
    p.handle("decodeB", Want(digest=prompt_digest(range(1, 41)), **want))
    assert t.sent[-1][1]["type"] == "refused" and "prompt of r differs" in t.sent[-1][1]["reasons"][0]
    p.handle("decodeB", Abort(req="r"))
    assert "r" in t.grants and p.take_finished() == set() and p.stats["aborted"] == 0
    p.handle("decodeA", Consumed(req="r"))
    assert "r" not in t.grants and p.take_finished() == {"r"} and p.stats["consumed"] == 1


def test_claim_decides_tokens_pair_and_prompt_identity():
    lay = _layout(128, "fp32")
    params = TransferParams.make(engine="ref", instance_id="p", transports=[{"kind": "tcp", "name": "w"}],
                                 request_id="r", block_ids=list(range(10)), num_tokens=300, layout=_layout(),
                                 token_ids=list(range(300)))
    c = claim(params.to_dict(), lay, 301, 128, prompt_token_ids=list(range(301)))
    assert (c.start, c.end, c.count, c.refused) == (128, 300, 172, None)
    c = claim(params, lay, 301, 128, prompt_token_ids=[7] + list(range(1, 301)))
    assert c.count == 0 and "prompt differs" in c.refused
    c = claim(params, _layout(fp="sha256:other"), 301, 0)
    assert c.count == 0 and "fingerprint" in c.refused
    c = claim({**params.to_dict(), "contract_version": 7}, lay, 301, 0)
    assert c.params is None and "unsupported contract version 7" in c.refused
    assert claim(params, lay, 301, 300).count == 0  # everything is a local hit
    assert failed_blocks(32, [9, 3, 5, 7], 40, 120) == [3, 5, 7] and failed_blocks(32, [1], 32, 32) == []


@pytest.mark.parametrize("src, dst", [
    (_layout(64, "bf16", "lmdeploy"), _layout(32, "fp32", "vllm_cpu")),
    (_layout(16, "fp16", "vllm_flash_hnd"), _layout(64, "bf16", "sglang_nhd")),
    (_layout(32, "bf16", "vllm_cpu"), _layout(32, "bf16", "vllm_cpu")),
])
def test_pull_between_arrangements_over_tcp(src, dst):
    """A producer in a non-vLLM-CPU arrangement serves a consumer; the layout travels with the parameters only."""
    n, start = 150, 40
    sblocks = list(range(11, 11 + -(-n // src.block_size)))[::-1]  # reversed: no merged runs
    dblocks = [5, 2, 7, 1, 3, 6, 4, 8, 9, 10][:-(-n // dst.block_size)]
    sc, dc = allocate(src, 24), allocate(dst, 12)
    ref = fill_tokens(src, sc, sblocks, n)
    page = src.block_bytes()
    p = KVEndpoint("tcp", "prod", SECRET, "127.0.0.1", 0, src, sc, 0, registration_wait_s=1.0, io_timeout_s=10.0)
    d = KVEndpoint("tcp", "cons", SECRET, "127.0.0.1", 0, dst, dc, 2 * page, registration_wait_s=1.0,
                   io_timeout_s=10.0)
    try:
        res = hold_and_pull(p, d, src, dst, sblocks, dblocks, n, start)
        assert res.error is None, res.error
        assert res.loaded_upto == n and res.failed_block_ids == [] and res.rounds >= 2
        assert res.peak_staging_bytes <= 2 * page
        for t in (0, start - 1):
            k, _ = read_kv(dst, dc, dblocks, t, 0)
            assert torch.count_nonzero(k) == 0  # the consumer's own prefix is untouched
        for t in (start, 77, n - 1):
            for layer in range(src.model.num_layers):
                k, v = read_kv(dst, dc, dblocks, t, layer)
                rk, rv = ref[(t, layer)]
                assert torch.equal(k, rk.to(torch_dtype(dst))) and torch.equal(v, rv.to(torch_dtype(dst)))
        d.release(p.descriptor(), "req", consumed=True)
        done = poll(p.take_finished, timeout_s=60)
        assert done == {"req"} and p.held_count() == 0
    finally:
        p.close()
        d.close()


def _endpoints(lay: KVLayout, tag: str, registration_wait_s: float) -> tuple[KVEndpoint, KVEndpoint]:
    """A producer (``p<tag>``, 8 blocks, its want wait ``registration_wait_s``) and a consumer (``d<tag>``, 8 blocks,
    1 MiB staging) of layout ``lay`` over tcp on loopback."""
    p = KVEndpoint("tcp", f"p{tag}", SECRET, "127.0.0.1", 0, lay, allocate(lay, 8), 0,
                   registration_wait_s=registration_wait_s, io_timeout_s=5.0)
    d = KVEndpoint("tcp", f"d{tag}", SECRET, "127.0.0.1", 0, lay, allocate(lay, 8), 1 << 20, registration_wait_s=1.0,
                   io_timeout_s=5.0)
    return p, d


def _wait_freed(p: KVEndpoint, req: str) -> None:
    """Take the producer's finished requests (as an engine's step does) until ``req`` is no longer held."""
    wait_until(lambda: (p.take_finished(), not p.is_held(req))[1], timeout_s=60, what=f"{req} freed")


def test_pull_with_other_prompt_is_refused_by_producer_and_reports_failed_blocks():
    lay = _layout()
    p, d = _endpoints(lay, "2", 1.0)
    try:
        p.add_hold("r", [0, 1], 40, prompt_digest(range(40)))
        res = d.pull(p.descriptor(), "r", [0, 1], 0, 40, [4, 5], src_layout=lay, digest=prompt_digest(range(1, 41)))
        assert res.loaded_upto == 0 and "prompt of r differs" in res.error and res.failed_block_ids == [4, 5]
        assert p.is_held("r")  # a refused want changes nothing; the consumer's abort frees it
        d.release(p.descriptor(), "r", consumed=False)
        _wait_freed(p, "r")
    finally:
        p.close()
        d.close()


def test_a_want_for_a_hold_already_freed_is_refused_at_once():
    """Transfer parameters used again after their hold was consumed and freed (a replayed or duplicated decode leg):
    the producer refuses the want at once with the reason. Before, it waited ``registration_wait_s`` (here 600 s,
    default 10 s) for a hold that would not come, and the consumer gave up on silence instead (its own 5 s)."""
    lay = _layout()
    p, d = _endpoints(lay, "4", 600.0)
    try:
        p.add_hold("r", [0, 1], 40, prompt_digest(range(40)))
        res = d.pull(p.descriptor(), "r", [0, 1], 0, 40, [4, 5], src_layout=lay, digest=prompt_digest(range(40)))
        assert res.error is None and res.loaded_upto == 40
        d.release(p.descriptor(), "r", consumed=True)
        _wait_freed(p, "r")  # consumed: the engine frees it
        res = d.pull(p.descriptor(), "r", [0, 1], 0, 40, [6, 7], src_layout=lay, digest=prompt_digest(range(40)))
        assert res.loaded_upto == 0 and "request r is not held here" in (res.error or ""), res.error
        p.add_hold("r", [2, 3], 40, prompt_digest(range(40)))  # the id held again (a new request) is served
        res = d.pull(p.descriptor(), "r", [2, 3], 0, 40, [6, 7], src_layout=lay, digest=prompt_digest(range(40)))
        assert res.error is None and res.loaded_upto == 40
    finally:
        p.close()
        d.close()


def test_fuzzed_control_messages_never_change_holds():
    """Random garbage on the control channel is refused; holds stay exactly as they were; a valid consumed then
    releases; nothing stays held."""
    lay = _layout()
    p = KVEndpoint("tcp", "p3", SECRET, "127.0.0.1", 0, lay, allocate(lay, 8), 0, registration_wait_s=0.0)
    try:
        p.add_hold("r", [0, 1], 40)
        rnd = random.Random(7)
        vals = [None, 1, -1, 2 ** 40, "r", "", [], [1], {}, {"a": 1}, True, 1.5, "x" * 600]
        keys = ["type", "req", "v", "block_ids", "layout", "digest", "send_layout", "reasons", "zz"]
        types = ["want", "extend", "blocks_ready", "refused", "nope", 3, None]
        for _ in range(2000):
            m = {k: rnd.choice(vals) for k in rnd.sample(keys, rnd.randint(0, 5))}
            if rnd.random() < 0.7:
                m["type"] = rnd.choice(types)
            if m.get("type") in ("want", "extend") and rnd.random() < 0.5:
                m["req"] = "r"
            p._handle("attacker", m)
        assert p.is_held("r") and p.take_finished() == set() and p.holds["r"].granted_to is None
        assert p.stats["bad_messages"] > 1000
        p._handle("d", {"type": "blocks_consumed", "req": "r"})
        assert p.take_finished() == {"r"} and p.held_count() == 0
    finally:
        p.close()


def test_endpoint_for_engine_calls_the_release_hook():
    from types import SimpleNamespace

    from dlmix.pd.engine import EngineKV

    lay = _layout(16, "bf16", "sglang_hnd")
    eng = SimpleNamespace(layout=lay, layers=allocate(lay, 4))
    assert isinstance(eng, EngineKV)
    got = []
    e = KVEndpoint.for_engine(eng, name="hooked", secret=SECRET,
                              hooks=SimpleNamespace(hold_released=lambda r, why: got.append((r, why))))
    try:
        e.add_hold("r", [1], 5)
        e._handle("peer", {"type": "abort", "req": "r"})
        assert got == [("r", "aborted")] and e.take_finished() == {"r"}
        with pytest.raises(ValueError, match="layers"):
            KVEndpoint.for_engine(SimpleNamespace(layout=lay, layers=allocate(lay, 4)[:1]), name="bad",
                                  secret=SECRET)
    finally:
        e.close()


def test_router_client_backs_off_when_fresh_registrations_keep_getting_404():
    """A router that accepts each registration but answers every heartbeat 404 (e.g. replicas that do not share their
    instances): the client registers again at once after the first 404, then only once per ``heartbeat_s``, instead
    of looping on the router as fast as it answers."""
    import time

    from dlmix.pd.router_client import RouterClient
    from dlmix.testing import JsonStandIn

    router = JsonStandIn(lambda method, path, body: (201, {"id": "i"}) if path == "/admin/instances" else (404, {}))
    rc = RouterClient(router.url, lambda: {"url": "http://e", "role": "both"}, lambda: {"waiting": 0, "running": 0},
                      heartbeat_s=0.5, first_wait_s=0)
    rc.start()
    try:
        assert rc.registered.wait(30)
        time.sleep(3)
    finally:
        rc.stop()
        router.close()
    regs = [p for p, _ in router.calls].count("/admin/instances")
    # 3 s at one try per 0.5 s: ~6 registrations (a slow machine makes fewer); a tight loop made hundreds
    assert 2 <= regs <= 10, (regs, len(router.calls))
    assert "404" in (rc.last_error or "")


@pytest.mark.parametrize("src,dst", [("lmdeploy", "vllm_flash_hnd"), ("sglang_nhd", "sglang_hnd"),
                                     ("sglang_hnd", "vllm_flash_nhd")])
def test_pull_from_a_separate_kv_producer_is_exact(src, dst):
    """A producer that keeps K and V apart (LMDeploy, SGLang) is staged as views of the one staging buffer
    (``dlmix.pd.consumer`` ``_staged_layer``); the CPU cell path (``dlmix.kv.cells``) took the V plane for a part of K:
    the pull reported success and the decode's V held K's bytes (86 of 86 checked tokens wrong for 128 tokens of an
    8-head, head-size-128 model, lmdeploy -> vllm_flash_hnd; found by a new-user review)."""
    m = ModelIdentity("LlamaForCausalLM", num_layers=2, num_kv_heads=8, head_size=128)
    pl, dl = KVLayout(m, 16, "bf16", src), KVLayout(m, 32, "bf16", dst)
    ntok = 128
    pc, dc = allocate(pl, ntok // 16 + 1), allocate(dl, ntok // 32 + 1)
    g = torch.Generator().manual_seed(0)
    for c in pc:
        for t in c:
            t.copy_(torch.randn(t.shape, generator=g))
    p = KVEndpoint("tcp", "prod", "s", "127.0.0.1", 0, pl, pc, 0)
    d = KVEndpoint("tcp", "cons", "s", "127.0.0.1", 0, dl, dc, 16 << 20)
    try:
        ids = list(range(ntok))
        blocks, dblocks = [8, 3, 5, 0, 7, 1, 6, 2], [4, 0, 2, 1]
        p.add_hold("r", blocks, ntok, prompt_digest(ids))
        params = TransferParams.make(engine="x", instance_id="p0", transports=[p.descriptor()], request_id="r",
                                     block_ids=blocks, num_tokens=ntok, layout=pl, token_ids=ids).to_dict()
        cl = claim(params, dl, ntok, 0, prompt_token_ids=ids)
        res = d.pull_params(cl.params, cl.start, cl.end, dblocks, digest=prompt_digest(ids))
        assert res.error is None and res.loaded_upto == ntok
        for tok in range(ntok):
            for layer in range(2):
                for a, b in zip(read_kv(pl, pc, blocks, tok, layer), read_kv(dl, dc, dblocks, tok, layer)):
                    assert torch.equal(a, b), (tok, layer)
        d.release(list(cl.params.transports), "r", consumed=True)
    finally:
        p.close()
        d.close()


def test_a_silent_prefill_fails_the_pull_and_the_release_after_the_connect_timeout():
    """A producer descriptor (from a request's transfer parameters) that points at a listener which accepts and
    never answers fails that pull, and its release notice, after ``connect_timeout_s`` (1 s here), not after
    ``io_timeout_s`` (30 s): the connect, handshake included, is bounded by the connect timeout."""
    import socket

    lay = _layout()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    d = KVEndpoint("tcp", "d-silent", SECRET, "127.0.0.1", 0, lay, allocate(lay, 8), 1 << 20, io_timeout_s=30.0,
                   connect_timeout_s=1.0)
    try:
        desc = dict(d.descriptor(), name="p-silent", port=silent.getsockname()[1], pid=1)
        res = d.pull(desc, "r", [0, 1], 0, 40, [4, 5], src_layout=lay, digest=prompt_digest(range(40)))
        assert res.loaded_upto == 0 and res.failed_block_ids == [4, 5], res
        assert "within 1.0 s" in res.error, res.error
        with pytest.raises(Exception, match=r"within 1\.0 s"):
            d.release(desc, "r", consumed=False)
    finally:
        d.close()
        silent.close()


def test_pulls_from_several_threads_overlap_asking_and_take_turns_in_staging():
    """One consumer, three threads: a pull from a prefill that accepts and never answers (connect timeout 3 s) and two
    pulls of 4 blocks each from a live producer through a staging region of 1 block (4 rounds each). The two live
    pulls finish while the silent one is still connecting, each with exactly its own bytes (they took turns in the
    one staging region), and the silent one fails alone after its connect timeout."""
    import socket
    import threading

    lay = _layout(bs=32, dtype="fp32")
    n = 128
    pc, dc = allocate(lay, 16), allocate(lay, 16)
    src = {"r1": [0, 1, 2, 3], "r2": [8, 9, 10, 11]}
    dst = {"r1": [4, 5, 6, 7], "r2": [12, 13, 14, 15]}
    refs = {rid: fill_tokens(lay, pc, blocks, n, seed=i) for i, (rid, blocks) in enumerate(src.items())}
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    p = KVEndpoint("tcp", "p-turns", SECRET, "127.0.0.1", 0, lay, pc, 0, io_timeout_s=10.0)
    d = KVEndpoint("tcp", "d-turns", SECRET, "127.0.0.1", 0, lay, dc, lay.block_bytes(), io_timeout_s=10.0,
                   connect_timeout_s=3.0)
    out: dict[str, object] = {}
    try:
        for rid in src:
            p.add_hold(rid, src[rid], n, prompt_digest(range(n)))
        silent_desc = dict(d.descriptor(), name="p-silent", port=silent.getsockname()[1], pid=1)

        def pull(rid, desc):
            out[rid] = d.pull(desc, rid, src.get(rid, [0, 1, 2, 3]), 0, n, dst.get(rid, [0, 1, 2, 3]),
                              src_layout=lay, digest=prompt_digest(range(n)))
            out[rid + "_at"] = time.monotonic()

        t0 = time.monotonic()
        threads = [threading.Thread(target=pull, args=("silent", silent_desc))]
        threads[0].start()
        time.sleep(0.2)  # the silent pull is connecting first
        threads += [threading.Thread(target=pull, args=(rid, p.descriptor())) for rid in src]
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join(60)
        for rid in src:
            res = out[rid]
            assert res.error is None and res.loaded_upto == n and res.rounds == 4, res
            assert res.peak_staging_bytes <= lay.block_bytes()
            assert out[rid + "_at"] < out["silent_at"], "a live pull waited for the silent prefill"
            for t in range(n):
                for layer in range(lay.model.num_layers):
                    k, v = read_kv(lay, dc, dst[rid], t, layer)
                    assert torch.equal(k, refs[rid][(t, layer)][0]) and torch.equal(v, refs[rid][(t, layer)][1])
        assert out["silent"].loaded_upto == 0 and "within 3.0 s" in out["silent"].error, out["silent"]
        assert out["silent_at"] - t0 >= 3.0
        assert max(out["r1"].staging_wait_s, out["r2"].staging_wait_s) > 0  # one waited for the other's turn
        for rid in src:
            d.release(p.descriptor(), rid, consumed=True)
        wait_until(lambda: (p.take_finished(), p.held_count() == 0)[1], timeout_s=60, what="holds freed")
    finally:
        p.close()
        d.close()
        silent.close()


def test_a_pull_waiting_its_staging_turn_keeps_its_grant():
    """A pull that has its grant and waits for the staging region longer than the producer's ``io_timeout_s``
    (another pull of the rank holds it for 3 s) keeps its hold and grant alive with extends while it waits, then
    reads exact bytes. Before, its extend came only after the wait: the grant had expired (GrantError) and the
    engine recomputed the prompt."""
    import threading

    lay = _layout(bs=32, dtype="fp32")
    n = 64
    pc, dc = allocate(lay, 8), allocate(lay, 8)
    ref = fill_tokens(lay, pc, [0, 1], n, seed=3)
    p = KVEndpoint("tcp", "p-wait", SECRET, "127.0.0.1", 0, lay, pc, 0, io_timeout_s=1.0, hold_timeout_s=1.0)
    d = KVEndpoint("tcp", "d-wait", SECRET, "127.0.0.1", 0, lay, dc, 4 * lay.block_bytes(), io_timeout_s=1.0)
    try:
        p.add_hold("r", [0, 1], n, prompt_digest(range(n)))
        out = {}
        lock = d.consumer._pull_lock
        lock.acquire()  # another pull of this rank has a long staging turn (3 s, > io_timeout_s)
        t = threading.Thread(target=lambda: out.update(r=d.pull(p.descriptor(), "r", [0, 1], 0, n, [4, 5],
                                                                  src_layout=lay, digest=prompt_digest(range(n)))))
        t.start()
        stop = time.monotonic() + 3.0
        while time.monotonic() < stop:  # the prefill engine's poll loop
            p.take_finished()
            time.sleep(0.1)
        lock.release()
        t.join(30)
        res = out["r"]
        assert res.error is None and res.loaded_upto == n, res
        for tok in range(n):
            k, v = read_kv(lay, dc, [4, 5], tok, 0)
            assert torch.equal(k, ref[(tok, 0)][0]) and torch.equal(v, ref[(tok, 0)][1])
    finally:
        p.close()
        d.close()


def test_a_want_waiting_for_its_hold_does_not_hold_up_other_requests():
    """A decode's pull threads ask one prefill for two requests: the first want overtook its hold (the prefill's
    engine has not added it yet) and waits ``registration_wait_s`` (20 s here) for it; the second request is held.
    The second pull is done while the first want still waits, and the first want is still answered when its hold
    comes. Before, the producer's one control thread waited on the first want, so the second request's grant (and
    every extend and release behind it) came 20 s late: past the pull's own wait for it (6 s), it failed; with
    ``io_timeout_s`` below ``registration_wait_s`` another pull's grant expired under it."""
    lay = _layout()
    n = 40
    p, d = _endpoints(lay, "-hol", 20.0)
    try:
        p.add_hold("r", [0, 1], n, prompt_digest(range(n)))
        peer = d.t.connect(p.descriptor())
        ev, box = d._slots.open(peer, "early")  # the first pull's answer slot, as Consumer.pull opens it
        d.t.notify(peer, encode(Want(req="early", block_ids=[2, 3], layout=lay.to_dict())))
        res = d.pull(p.descriptor(), "r", [0, 1], 0, n, [4, 5], src_layout=lay, digest=prompt_digest(range(n)))
        assert res.error is None and res.loaded_upto == n, res
        assert not ev.is_set()  # the early want still waits for its hold
        p.add_hold("early", [2, 3], n)
        assert ev.wait(10) and box[0].__class__.__name__ == "Ready", box
        for rid in ("r", "early"):
            d.release(p.descriptor(), rid, consumed=True)
        wait_until(lambda: (p.take_finished(), p.held_count() == 0)[1], timeout_s=30, what="holds freed")
    finally:
        p.close()
        d.close()


def test_an_abort_sent_while_its_want_waits_for_the_hold_releases_the_hold_once_granted():
    """A consumer gives up while its want waits on a thread of its own for the hold, and sends ``abort``. The abort
    is handled after the want, as when every message waited on the control thread: the want is granted when the hold
    comes, then the abort frees the hold at once, not ``hold_timeout_s`` (120 s) later. An abort handled before the
    want would find no hold and be dropped."""
    lay = _layout()
    p, d = _endpoints(lay, "-ab", 6.0)
    try:
        peer = d.t.connect(p.descriptor())
        ev, box = d._slots.open(peer, "late")
        d.t.notify(peer, encode(Want(req="late", block_ids=[2, 3], layout=lay.to_dict())))
        d.t.notify(peer, encode(Abort(req="late")))
        time.sleep(0.5)  # both arrive while the hold is not there yet
        assert not ev.is_set()
        p.add_hold("late", [2, 3], 40)
        assert ev.wait(10) and type(box[0]).__name__ == "Ready", box
        wait_until(lambda: (p.take_finished(), p.held_count() == 0)[1], timeout_s=10, what="hold freed by the abort")
        assert p.producer.stats["aborted"] == 1
    finally:
        p.close()
        d.close()


def test_a_pull_cancelled_while_its_want_waits_for_the_hold_ends_at_once():
    """The decode request finishes while its pull's want waits at the prefill for a hold that has not come: the pull
    ends with the cancel error and its blocks reported failed, and the pull thread is free again. Before, the
    cancel was looked at only from the staging turn on, so the thread waited for the prefill's answer (its refusal
    after ``registration_wait_s``, 6 s here) and the pull failed as "prefill refused"."""
    lay = _layout()
    p, d = _endpoints(lay, "-cw", 6.0)
    try:
        res = d.pull(p.descriptor(), "never", [0, 1], 0, 40, [4, 5], lambda: "never" in p._behind, src_layout=lay,
                     digest=prompt_digest(range(40)))
        assert res.error == "RuntimeError: cancelled: the decode request finished before its KV arrived", res
        assert res.loaded_upto == 0 and res.failed_block_ids == [4, 5]
        d.release(p.descriptor(), "never", consumed=False)
        assert p.held_count() == 0
    finally:
        p.close()
        d.close()


def test_a_want_whose_thread_cannot_start_is_handled_on_the_control_thread(monkeypatch):
    """The want thread of a want that overtook its hold cannot be started (``RuntimeError: can't start new thread``
    on a host out of threads): the want waits on the control thread as before, its slot and its place in the queue
    of its request are given back, and the control thread keeps serving. Before, the error ended the control
    thread: the want was never answered and no later message (of any request) was handled."""
    import threading

    import dlmix.pd.endpoint as endpoint_mod

    class _NoThread(threading.Thread):  # only the want threads fail to start
        def start(self):
            if self.name == "dlmix-kv-want":
                raise RuntimeError("can't start new thread")
            super().start()

    lay = _layout()
    n = 40
    p, d = _endpoints(lay, "-nt", 3.0)
    try:
        monkeypatch.setattr(endpoint_mod.threading, "Thread", _NoThread)
        peer = d.t.connect(p.descriptor())
        ev, box = d._slots.open(peer, "early")
        d.t.notify(peer, encode(Want(req="early", block_ids=[2, 3], layout=lay.to_dict())))
        time.sleep(0.5)
        p.add_hold("early", [2, 3], n)
        assert ev.wait(10) and type(box[0]).__name__ == "Ready", box
        monkeypatch.undo()
        assert not p._behind and p._worker.is_alive()
        p.add_hold("r", [0, 1], n, prompt_digest(range(n)))
        res = d.pull(p.descriptor(), "r", [0, 1], 0, n, [4, 5], src_layout=lay, digest=prompt_digest(range(n)))
        assert res.error is None and res.loaded_upto == n, res
    finally:
        monkeypatch.undo()
        p.close()
        d.close()
