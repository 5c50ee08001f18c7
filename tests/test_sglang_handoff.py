"""The SGLang prefill's room hand-off for a decode of another engine (``POST /dlmix/handoff``,
:mod:`dlmix_sglang.handoff`), without SGLang: the relay on an aiohttp app, two stand-in prefill ranks on ZMQ that
answer ``META`` as the dlmix backend does (``READY`` with their transfer parameters and metadata row, or SGLang's
``Failed`` status), and the router's side (:func:`dlmix.router.engines.bridges.room_handoff`). The same route with
real SGLang, vLLM and LMDeploy servers is in ``tests/test_xengine_matrix.py``."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import struct
import threading
from types import SimpleNamespace

import httpx
import pytest
import zmq
from aiohttp import web

from dlmix.kv import KVLayout, ModelIdentity
from dlmix.pd.contract import ContractError, TransferParams, decode_room_handoff
from dlmix.router.engines import bridges
from dlmix.testing import LoopThread
from dlmix_sglang.frames import META, READY, STATUS_TAG, TAG
from dlmix_sglang.handoff import HandoffRelay, first_token_id

LAYOUT = KVLayout(model=ModelIdentity("LlamaForCausalLM", 30, 4, 64, "gqa", weights_fingerprint="sha256:aa"),
                  block_size=16, dtype="fp32", arrangement="sglang_nhd", tp_size=2)


def _transport(rank: int) -> dict:
    return {"kind": "tcp", "proto": "dlmix-kv/1", "name": f"sglang-p-r{rank}", "host": "127.0.0.1",
            "port": 6000 + rank, "regions": {}}


class _Rank:
    """A prefill rank's ZMQ PULL socket: answers each ``META`` with ``READY`` (or ``fail``: SGLang's Failed
    status with a reason; ``mute``: nothing)."""

    def __init__(self, rank: int, first_token: int = 42, fail: str = "", mute: bool = False):
        self.rank, self.first_token, self.fail, self.mute = rank, first_token, fail, mute
        self.ctx = zmq.Context.instance()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.metas: list[tuple[int, str, int, dict]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            if not self.pull.poll(50):
                continue
            msg = self.pull.recv_multipart()
            assert msg[0] == TAG and msg[1] == META
            room, ip, port, body = int(msg[2]), msg[3].decode(), int(msg[4]), json.loads(msg[5])
            self.metas.append((room, ip, port, body))
            if self.mute:
                continue
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(f"tcp://{ip}:{port}")
            if self.fail:
                push.send_multipart([STATUS_TAG, str(room).encode(), b"0", str(self.rank).encode(), self.fail.encode()])
            else:
                p = TransferParams.make(engine="sglang", instance_id="sglang-1", transports=[_transport(self.rank)] * 2,
                                        request_id=str(room), block_ids=[5, 9, 2], num_tokens=40,
                                        layout=dataclasses.replace(LAYOUT, tp_rank=self.rank))
                aux = [struct.pack("<16i", self.first_token, *([0] * 15)), b"\0" * 8]
                push.send_multipart([TAG, READY, str(room).encode(), json.dumps(p.to_dict()).encode(),
                                     str(self.rank).encode(), *aux])
            push.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.pull.close()  # in this thread only once the loop has stopped (a ZMQ socket is single-threaded)


class _Bootstrap:
    """The relay on an aiohttp app, with the rank table SGLang's bootstrap server keeps."""

    def __init__(self, lt: LoopThread, ranks: list[_Rank], ready: bool = True, key: str | None = None):
        self.lt = lt
        self.relay = HandoffRelay(key)
        info = lambda r: SimpleNamespace(rank_ip="127.0.0.1", rank_port=r.port)  # noqa: E731
        self.server = SimpleNamespace(attn_tp_size=len(ranks), _is_ready=lambda: ready,
                                      prefill_port_table={0: {0: {i: {0: info(r)} for i, r in enumerate(ranks)}}})
        app = web.Application()
        async def handoff(req):
            return await self.relay.handle(self.server, req)
        app.router.add_post("/dlmix/handoff", handoff)
        self.runner = web.AppRunner(app)

        async def start():
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]
        self.port = lt.run(start())

    def post(self, body, timeout: float = 20) -> httpx.Response:
        return httpx.post(f"http://127.0.0.1:{self.port}/dlmix/handoff", json=body, timeout=timeout)

    def close(self) -> None:
        self.lt.run(self.runner.cleanup())


@pytest.fixture(scope="module")
def lt():
    t = LoopThread(use_uvloop=False)
    yield t
    t.close()


def test_first_token_is_element_zero_of_output_ids():
    assert first_token_id([struct.pack("<16i", 1234, *range(15))]) == 1234
    assert first_token_id([]) is None and first_token_id([b"\1\2"]) is None


def test_every_rank_gets_meta_and_the_answer_merges_their_transports(lt):
    ranks = [_Rank(0, first_token=77), _Rank(1, first_token=77)]
    bs = _Bootstrap(lt, ranks)
    try:
        r = bs.post({"room": 123456789012345, "timeout_s": 10})
        assert r.status_code == 200, r.text
        params, tok = decode_room_handoff(r.content)
        assert tok == 77
        assert params.transports == [_transport(0), _transport(1)]  # rank order, each rank's own
        assert params.request_id == "123456789012345" and params.block_ids == [5, 9, 2] and params.num_tokens == 40
        assert params.engine == "sglang" and params.kv_layout.tp_rank == 0
        for rk in ranks:  # one META each, no decode pages, no aux row: the prefill writes nothing anywhere
            (room, ip, port, body), = rk.metas
            assert room == 123456789012345 and ip == "127.0.0.1" and port > 0
            assert body["required_dst_info_num"] == 1 and body["aux_index"] is None and body["num_pages"] == 0
            assert body["decode_prefix_len"] == 0 and not body["is_dummy"]
        # the room is done with: asking again waits again (no stale answer)
        r2 = bs.post({"room": 123456789012345, "timeout_s": 10})
        assert r2.status_code == 200 and len(ranks[0].metas) == 2
    finally:
        bs.close()
        for rk in ranks:
            rk.close()


def test_a_room_the_prefill_failed_answers_502_with_its_reason(lt):
    ranks = [_Rank(0, fail="KV hold of room 7 ended: expired")]
    bs = _Bootstrap(lt, ranks)
    try:
        r = bs.post({"room": 7, "timeout_s": 10})
        assert r.status_code == 502 and "failed room 7" in r.text and "expired" in r.text, r.text
    finally:
        bs.close()
        ranks[0].close()


def test_timeouts_bad_requests_duplicates_and_unready_prefills_are_readable(lt):
    ranks = [_Rank(0, mute=True)]
    bs = _Bootstrap(lt, ranks)
    try:
        r = bs.post({"room": 8, "timeout_s": 0.5})
        assert r.status_code == 504 and "no KV held within 0.5 s" in r.text, r.text
        for bad in ({"room": -1}, {"room": "8"}, {"room": 8, "timeout_s": 0}, {"room": 8, "extra": 1}, [8],
                    {"room": 1 << 63}):
            r = bs.post(bad)
            assert r.status_code == 400 and "invalid hand-off request" in r.text, (bad, r.text)
        # a second ask for a room already waited on
        async def both():
            async with httpx.AsyncClient(timeout=20) as ac:
                u = f"http://127.0.0.1:{bs.port}/dlmix/handoff"
                first = asyncio.ensure_future(ac.post(u, json={"room": 9, "timeout_s": 2}))
                await asyncio.sleep(0.5)
                second = await ac.post(u, json={"room": 9, "timeout_s": 2})
                return (await first).status_code, second
        s1, second = asyncio.run(both())
        assert s1 == 504 and second.status_code == 409 and "already being handed off" in second.text
    finally:
        bs.close()
        ranks[0].close()
    bs = _Bootstrap(lt, [], ready=False)
    try:
        r = bs.post({"room": 1})
        assert r.status_code == 503 and "not fully registered" in r.text
    finally:
        bs.close()


def test_the_routers_bridges_use_the_hand_off(lt):
    ranks = [_Rank(0, first_token=11), _Rank(1, first_token=11)]
    bs = _Bootstrap(lt, ranks)
    kvp = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bs.port, "bootstrap_room": 5, "timeout_s": 10}
    try:
        out = asyncio.run(bridges.sglang_to_vllm("http://p", "http://d", kvp, b""))
        assert out["do_remote_prefill"] is True and out["do_remote_decode"] is False
        p = TransferParams.make(**{k: v for k, v in {
            "engine": out["remote_engine"], "instance_id": out["remote_engine_id"],
            "transports": out["remote_transports"], "request_id": out["remote_request_id"],
            "block_ids": out["remote_block_ids"], "num_tokens": out["remote_num_tokens"],
            "layout": out["remote_layout"]}.items()})
        assert p.request_id == "5" and p.transports == [_transport(0), _transport(1)]
        # an LMDeploy decode takes TP size 1 only: refused with the reason, before any call to the decode
        with pytest.raises(ValueError, match="2 TP ranks"):
            asyncio.run(bridges.sglang_to_lmdeploy("http://p", "http://d", dict(kvp, bootstrap_room=6), b""))
    finally:
        bs.close()
        for rk in ranks:
            rk.close()


def test_a_prefill_with_a_router_key_answers_only_that_key(lt):
    """With ``router_admin_key`` set on the prefill the route answers 401 without that bearer key; the router's
    bridge sends its ``admin_key`` and gets the hand-off."""
    ranks = [_Rank(0, first_token=11), _Rank(1, first_token=11)]
    bs = _Bootstrap(lt, ranks, key="adm")
    kvp = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bs.port, "bootstrap_room": 7, "timeout_s": 10}
    try:
        r = bs.post({"room": 7, "timeout_s": 1})
        assert r.status_code == 401 and "admin key" in r.text
        with pytest.raises(ValueError, match="answered 401"):
            asyncio.run(bridges.room_handoff(dict(kvp, admin_key="other")))
        p, tok = asyncio.run(bridges.room_handoff(dict(kvp, admin_key="adm")))
        assert tok == 11 and p.request_id == "7"
    finally:
        bs.close()
        for rk in ranks:
            rk.close()


def test_room_handoff_errors_are_readable():
    from dlmix.testing import JsonStandIn

    kvp = {"bootstrap_host": "127.0.0.1", "bootstrap_room": 1, "timeout_s": 5}
    for status, answer, reason in ((404, {"detail": "nope"}, "does not run the dlmix transfer backend"),
                                   (502, {"error": "the SGLang prefill failed room 1: x"}, "answered 502"),
                                   (200, {"params": {"contract_version": 9}}, "unsupported contract version"),
                                   (200, {"first_token_id": 3}, "invalid room hand-off")):
        s = JsonStandIn(lambda m, p, b, st=status, a=answer: (st, a))
        try:
            with pytest.raises(ValueError, match=reason):
                asyncio.run(bridges.room_handoff(dict(kvp, bootstrap_port=int(s.url.rsplit(":", 1)[1]))))
        finally:
            s.close()
    with pytest.raises(ValueError, match="ConnectError"):
        asyncio.run(bridges.room_handoff(dict(kvp, bootstrap_port=1)))
    with pytest.raises(ContractError, match="not JSON"):
        decode_room_handoff(b"{")


def test_without_a_router_key_only_loopback_callers_get_the_route():
    """No ``router_admin_key`` on the prefill: a caller from another host is refused with 403 and the reason before
    anything is read; a loopback caller gets past the check (here to the body validation: 400)."""
    async def body():
        return b"{not json"

    relay = HandoffRelay(None)
    server = SimpleNamespace(attn_tp_size=1, _is_ready=lambda: True, prefill_port_table={})
    far = SimpleNamespace(remote="10.1.2.3", headers={}, read=body)
    r = asyncio.run(relay.handle(server, far))
    assert r.status == 403 and "router_admin_key" in r.text and "loopback" in r.text
    near = SimpleNamespace(remote="127.0.0.1", headers={}, read=body)
    assert asyncio.run(relay.handle(server, near)).status == 400
    keyed = HandoffRelay("adm")  # with a key, the key decides, from any host
    r = asyncio.run(keyed.handle(server, SimpleNamespace(remote="10.1.2.3", headers={"Authorization": "Bearer adm"},
                                                          read=body)))
    assert r.status == 400
