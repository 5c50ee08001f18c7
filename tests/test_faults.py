"""Fault cases that run fast (no real engine): PD with ``n > 1`` (one prefill hold shared by the ``n`` decode pulls,
released after the last), and the mock-engine classes of the fault campaign (``benchmarks/faults.py``): hostile
clients and fuzzed requests against ``dlmix router`` in front of mock engines. Values are asserted, never timings.
"""
from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch

from dlmix.kv import KVLayout, ModelIdentity
from dlmix.kv.ops import allocate, read_kv, torch_dtype, write_kv
from dlmix.pd.contract import Abort, Consumed, ContractError, TransferParams, Want, decode_message, prompt_digest
from dlmix.pd.endpoint import KVEndpoint
from dlmix.pd.producer import MAX_CONSUMERS, Producer
from dlmix.router.engines import vllm as vllm_adapter
from dlmix.testing import poll

SECRET = "faults-test"


def _layout(bs: int = 32, dtype: str = "bf16") -> KVLayout:
    return KVLayout(model=ModelIdentity("LlamaForCausalLM", 2, 2, 16, "gqa", weights_fingerprint="sha256:aa"),
                    block_size=bs, dtype=dtype, arrangement="vllm_cpu")


# ------------------------------------------------------------------------------------------------ PD with n > 1
def test_prefill_body_prefills_once():
    """The prefill leg of an ``n > 1`` request asks for one choice and names no consumer count: the decode leg does
    (a decode of another engine may pull once; a count named here would keep that hold until its timeout)."""
    one = msgspec.json.decode(vllm_adapter.prefill_body({"prompt": "hi", "n": 1}, False))
    assert one["n"] == 1 and "dlmix_consumers" not in one["kv_transfer_params"]
    assert one["return_token_ids"] is True  # the first token's id, for a decode of another engine
    three = msgspec.json.decode(vllm_adapter.prefill_body({"prompt": "hi", "n": 3, "stream": True}, False))
    assert three["n"] == 1 and three["max_tokens"] == 1 and three["stream"] is False
    assert three["kv_transfer_params"] == vllm_adapter.PREFILL_KV_PARAMS
    # a bad n is left for the engine to reject with its own 400
    bad = msgspec.json.decode(vllm_adapter.prefill_body({"prompt": "hi", "n": "2"}, False))
    assert bad["n"] == "2" and "dlmix_consumers" not in bad["kv_transfer_params"]


def test_router_prefills_an_n2_request_once_on_mock_engines():
    """Through the router (cost policy forced to disaggregate): the prefill leg of an ``n=2`` request asks for one
    choice; the decode leg keeps the client's ``n`` and names 2 consumers."""
    import json

    import httpx

    from dlmix.router.config import RouterConfig
    from dlmix.router.server import Router
    from dlmix.testing import LoopThread
    from dlmix.testing.mock_engine import MockEngine

    lt = LoopThread()
    p, d = MockEngine(name="p"), MockEngine(name="d")
    urls = [lt.run(e.start()) for e in (p, d)]
    insts = [{"id": n, "url": u, "role": r, "model": "mock", "chip": "cpu-x86"}
             for n, u, r in zip("PD", urls, ("prefill", "decode"))]
    router = Router(RouterConfig(port=0, policy="cost", policy_params={"local_max_uncached": 0}, instances=insts))
    lt.run(router.start())
    try:
        body = {"model": "mock", "prompt": list(range(100, 400)), "max_tokens": 4, "n": 2}
        r = httpx.post(f"http://127.0.0.1:{router.cfg.port}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        leg = json.loads(p.received[0])
        assert p.prefill_legs == 1 and leg["n"] == 1 and "dlmix_consumers" not in leg["kv_transfer_params"]
        dec = json.loads(d.received[0])
        assert dec["n"] == 2 and dec["kv_transfer_params"]["remote_engine_id"] == "p"
        assert dec["kv_transfer_params"]["dlmix_consumers"] == 2  # for a producer that could not know n
    finally:
        lt.run(router.stop())
        for e in (p, d):
            lt.run(e.stop())
        lt.close()


class _T:
    def __init__(self):
        self.grants: dict = {}
        self.sent: list = []

    def grant(self, peer, tid, ranges, mode="r", expires_s=None):
        self.grants[tid] = (peer, list(ranges))

    def revoke(self, tid):
        return self.grants.pop(tid, None) is not None

    def notify(self, peer, msg):
        self.sent.append((peer, msg))


def test_hold_with_n_consumers_is_released_after_the_last():
    t = _T()
    p = Producer(t, _layout(), 16, registration_wait_s=0.0)
    p.add_hold("r", [3, 4], 20, consumers=3)
    want = Want(req="r", block_ids=[3, 4], layout=_layout().to_dict())
    for _ in range(3):
        p.handle("d", want)
    assert [m["type"] for _, m in t.sent] == ["blocks_ready"] * 3 and p.stats["refused"] == 0
    p.handle("d", Consumed(req="r"))
    p.handle("d", Abort(req="r"))  # a choice that found the prompt in its own prefix cache
    assert "r" in t.grants and p.take_finished() == set()
    p.handle("d", Consumed(req="r"))
    assert "r" not in t.grants and p.take_finished() == {"r"} and p.held_count() == 0
    for bad in (0, -1, MAX_CONSUMERS + 1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="consumers"):
            p.add_hold("x", [1], 5, consumers=bad)


def test_decode_body_names_the_consumers_only_for_n_above_one():
    kvp = {"remote_engine_id": "p", "contract_version": 1}
    for n, want in ((None, None), (1, None), (3, 3), ("2", None), (True, None)):
        body = {"prompt": "hi"} if n is None else {"prompt": "hi", "n": n}
        raw = msgspec.json.encode(body)
        got = msgspec.json.decode(vllm_adapter.decode_body(raw, kvp, body))["kv_transfer_params"]
        assert got.get("dlmix_consumers") == want and got["remote_engine_id"] == "p", (n, got)
    assert kvp == {"remote_engine_id": "p", "contract_version": 1}  # not modified


def test_a_want_naming_n_consumers_keeps_a_one_consumer_hold_for_all_of_them():
    """A hold its producer took for one consumer (a bridged LMDeploy or SGLang prefill knows no ``n``): the decode's
    wants say 2, so the first ``blocks_consumed`` does not free it and the second choice is granted, not refused.
    Out-of-range counts are refused by the contract with the reason."""
    t = _T()
    p = Producer(t, _layout(), 16, registration_wait_s=0.0)
    p.add_hold("r", [3, 4], 20)
    want = Want(req="r", block_ids=[3, 4], layout=_layout().to_dict(), consumers=2)
    p.handle("d", want)
    p.handle("d", Consumed(req="r"))
    assert "r" in t.grants and p.take_finished() == set() and p.is_held("r")
    p.handle("d", want)
    assert [m["type"] for _, m in t.sent] == ["blocks_ready"] * 2 and p.stats["refused"] == 0
    p.handle("d", Consumed(req="r"))
    assert "r" not in t.grants and p.take_finished() == {"r"} and p.held_count() == 0
    # without the count, the same hold is freed by the first notice (the behaviour a one-choice request keeps)
    p.add_hold("s", [5], 10)
    p.handle("d", Want(req="s", block_ids=[5], layout=_layout().to_dict()))
    p.handle("d", Consumed(req="s"))
    assert p.take_finished() == {"s"}
    for bad in (0, MAX_CONSUMERS + 1, "2", True, 1.5):
        with pytest.raises(ContractError, match="consumers"):
            decode_message({"type": "want", "v": 1, "req": "r", "block_ids": [3], "layout": _layout().to_dict(),
                            "consumers": bad})


def test_n_concurrent_pulls_of_one_hold_over_tcp_read_exact_values():
    """Two pulls of the same remote request from one consumer endpoint at once (vLLM's two choices): each gets its
    own answer, both read the exact values, the producer frees the hold after both consumed notices."""
    lay = _layout()
    n = 40
    sblocks = [5, 2]
    sc = allocate(lay, 8)
    g = torch.Generator().manual_seed(3)
    ref = {}
    for tok in range(n):
        for layer in range(2):
            k = torch.randn(2, 16, generator=g).to(torch_dtype(lay))
            v = torch.randn(2, 16, generator=g).to(torch_dtype(lay))
            write_kv(lay, sc, sblocks, tok, layer, k, v)
            ref[(tok, layer)] = (k, v)
    p = KVEndpoint("tcp", "fp", SECRET, "127.0.0.1", 0, lay, sc, 0, registration_wait_s=1.0, io_timeout_s=10.0)
    dc = allocate(lay, 8)
    d = KVEndpoint("tcp", "fd", SECRET, "127.0.0.1", 0, lay, dc, 1 << 20, registration_wait_s=1.0,
                   io_timeout_s=10.0)
    try:
        digest = prompt_digest(range(n))
        p.add_hold("req", sblocks, n, digest, consumers=2)
        params = TransferParams.make(engine="reference", instance_id="p0", transports=[p.descriptor()],
                                     request_id="req", block_ids=sblocks, num_tokens=n, layout=lay, digest=digest)
        dst = {0: [0, 3], 1: [6, 7]}
        res: dict = {}

        def pull(i):
            res[i] = d.pull_params(params, 0, n, dst[i], digest=digest)

        ths = [threading.Thread(target=pull, args=(i,)) for i in (0, 1)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(30)
        for i in (0, 1):
            assert res[i].error is None and res[i].loaded_upto == n, res[i]
            for tok in (0, 17, n - 1):
                for layer in range(2):
                    k, v = read_kv(lay, dc, dst[i], tok, layer)
                    assert torch.equal(k, ref[(tok, layer)][0]) and torch.equal(v, ref[(tok, layer)][1])
        d.release(p.descriptor(), "req", consumed=True)
        time.sleep(0.2)
        assert p.take_finished() == set() and p.is_held("req")  # one choice still to go
        d.release(p.descriptor(), "req", consumed=True)
        done = poll(p.take_finished, timeout_s=60)
        assert done == {"req"} and p.held_count() == 0 and p.stats["refused"] == 0
    finally:
        p.close()
        d.close()


# ------------------------------------------------------------------------ mock engines behind `dlmix router`
@pytest.fixture(scope="module")
def mock_dep(tmp_path_factory):
    from dlmix.testing.faults import MockDeployment

    with MockDeployment(str(tmp_path_factory.mktemp("faults"))) as dep:
        yield dep


def _invariants(t) -> None:
    """What must hold whatever the class: no wrong answer, no crashed process, nothing left running on the
    engines, and the healthy client running beside the hostile ones got every answer right."""
    d = t.to_dict()
    assert t.wrong == 0 and t.crashes == 0 and t.held_after == 0, d
    assert not any(n.startswith("healthy client") for n in t.notes), d
    assert t.tried == t.ok + t.clear_error + t.unclear + t.wrong + t.unchecked, d


def test_judge_classifies_answers():
    from dlmix.testing.faults import Answer, judge

    ok = Answer(200, {"content-type": "application/json"}, b'{"choices": [1]}')
    assert judge(ok, lambda: Answer(200, {}, b'{"choices":[1]}')) == "ok"
    assert judge(ok, lambda: Answer(200, {}, b'{"choices":[2]}')) == "wrong"
    assert judge(ok, lambda: Answer(500, {}, b"{}")) == "unchecked" and judge(ok) == "unchecked"
    assert judge(Answer(400, {}, b'{"error": {"message": "max_tokens must be at least 1"}}')) == "clear_error"
    assert judge(Answer(400, {}, b'{"error": "request body is not valid JSON"}')) == "clear_error"
    assert judge(Answer(413, {}, b"")) == "clear_error"
    assert judge(Answer(400, {}, b"malformed HTTP request")) == "unclear"
    assert judge(Answer(200, {}, b"{", error="truncated body")) == "unclear"
    assert judge(Answer(error="reset (ConnectionResetError)")) == "unclear"


def test_fuzzed_requests_never_give_a_wrong_answer(mock_dep):
    from dlmix.testing.faults import fuzzed_requests

    t = fuzzed_requests(mock_dep, n=400, seed=3, workers=4)
    _invariants(t)
    # valid ones answered, invalid ones refused (the router type-checks known fields, dlmix.router.bodies: a
    # wrongly typed seed/n/stop/... is a 400 there, where the mock engine ignored it)
    assert t.tried == 400 and t.ok > 5 and t.clear_error > 100


def test_malformed_json_and_one_byte_chunks(mock_dep):
    from dlmix.testing.faults import malformed_bodies, malformed_json, one_byte_chunks

    t = malformed_json(mock_dep)
    _invariants(t)
    assert t.tried == len(malformed_bodies()) and t.unclear == 0
    t = one_byte_chunks(mock_dep, kib=4)
    _invariants(t)
    assert t.ok == 1  # the slow body still gets the engine's exact answer


def test_oversized_slowloris_and_idle_connections_leave_the_router_serving(mock_dep):
    from dlmix.testing.faults import idle_connections, oversized, slowloris

    t = oversized(mock_dep, body_mb=65)
    _invariants(t)
    assert t.tried == 4
    t = slowloris(mock_dep, clients=5, seconds=2.0)
    _invariants(t)
    assert t.tried == 5
    t = idle_connections(mock_dep, n=50, seconds=1.0)
    _invariants(t)
    assert t.tried == 50


def test_link_proxy_forwards_and_drops_on_cue():
    """The KV-link proxy of the PD fault classes: bytes pass both ways unchanged; an armed drop closes the link
    after the given number of producer->consumer bytes; the next dial gets a fresh link."""
    import socket

    from dlmix.testing.faults import LinkProxy

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                while (b := c.recv(65536)):
                    c.sendall(b * 4)  # 4x the bytes back: a "producer" answering reads

    threading.Thread(target=serve, daemon=True).start()
    px = LinkProxy()
    px.upstream = srv.getsockname()
    try:
        with socket.create_connection(("127.0.0.1", px.port), timeout=10) as c:
            c.sendall(b"abc")
            got = b""
            while len(got) < 12:
                got += c.recv(100)
            assert got == b"abc" * 4 and px.down_bytes == 12
            px.arm(1000, px.drop)
            c.sendall(b"x" * 1000)  # 4000 bytes back: the drop fires after the first 1000 or more
            rest = b""
            while (b := c.recv(65536)):
                rest += b
            assert 1000 <= len(rest) <= 4000 and set(rest) == {ord("x")}
        with socket.create_connection(("127.0.0.1", px.port), timeout=10) as c:
            c.sendall(b"z")
            got = b""
            while len(got) < 4:
                got += c.recv(10)
            assert got == b"zzzz"
    finally:
        px.close()
        srv.close()
