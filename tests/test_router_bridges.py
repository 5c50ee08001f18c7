"""PD across engines in the router (:mod:`dlmix.router.engines.bridges`) without engines: which engines pair, the
block-id transfer id, the LMDeploy -> vLLM bridge against a stand-in for LMDeploy's DistServe routes (the same
pair on real servers is in ``tests/test_xengine_matrix.py``), and the bridges into an SGLang decode with the router's
room table (:mod:`dlmix.router.rooms`; real servers in ``tests/test_xengine_matrix.py``)."""
from __future__ import annotations

import asyncio
import json

import pytest

from dlmix.kv import KVLayout, ModelIdentity
from dlmix.pd.contract import ContractError, block_ids_session_alias, block_ids_transfer_id, decode_params
from dlmix.router.engines import can_pair, get_engine
from dlmix.router.engines import bridges
from dlmix.testing import JsonStandIn

LAYOUT = KVLayout(model=ModelIdentity("LlamaForCausalLM", 30, 3, 64, "gqa", weights_fingerprint="sha256:aa"),
                  block_size=16, dtype="bf16", arrangement="lmdeploy_packed", tp_size=1)
TRANSPORT = {"kind": "tcp", "proto": "dlmix-kv/1", "name": "lmdeploy-prefill-1", "host": "127.0.0.1", "port": 5555,
             "regions": {}}


def test_which_engines_pair():
    vllm, sglang, lmdeploy = (get_engine(n) for n in ("vllm", "sglang", "lmdeploy"))
    assert can_pair(vllm, vllm) and can_pair(sglang, sglang) and can_pair(lmdeploy, lmdeploy)
    assert can_pair(lmdeploy, vllm) and can_pair(vllm, lmdeploy)  # the bridges
    assert can_pair(sglang, vllm) and can_pair(sglang, lmdeploy)  # an SGLang prefill's room hand-off
    assert can_pair(vllm, sglang) and can_pair(lmdeploy, sglang)  # the router's rooms (dlmix.router.rooms)


def test_block_ids_transfer_id():
    a = block_ids_transfer_id([4, 9, 2])
    assert a == block_ids_transfer_id((4, 9, 2)) and a.startswith("blk-3-") and len(a) == len("blk-3-") + 24
    assert a != block_ids_transfer_id([9, 4, 2]) and a != block_ids_transfer_id([4, 9])
    # "1,23" and "12,3" must not collide: the ids are comma-separated
    assert block_ids_transfer_id([1, 23]) != block_ids_transfer_id([12, 3])
    for bad in ([-1], ["x"], [None]):
        with pytest.raises(ContractError):
            block_ids_transfer_id(bad)
        with pytest.raises(ContractError):
            block_ids_session_alias(bad)
    # the integer alias for LMDeploy's free_cache: the same hold, never an engine session (>= 0) or "none" (-1)
    al = block_ids_session_alias([4, 9, 2])
    assert al == block_ids_session_alias((4, 9, 2)) == -2 - int(a.rsplit("-", 1)[1][:12], 16)
    assert al <= -2 and al != block_ids_session_alias([9, 4, 2])


class _FakeLMDeploy(JsonStandIn):
    """LMDeploy's ``/distserve/engine_info`` and ``/distserve/p2p_initialize`` as a DLMix prefill answers them;
    ``refuse`` makes ``p2p_connect`` answer 500 as a refused pair does (a decode's routes)."""

    def __init__(self, info: dict | None = None, status: int = 200, refuse: str = ""):
        self.info = {"dlmix": 1, "role": "Prefill", "transport": TRANSPORT, "layout": LAYOUT.to_dict()} \
            if info is None else info

        def route(method, path, body):
            if method == "GET":
                return status, json.dumps({"role": 2, "block_size": 16})  # LMDeploy answers a JSON string
            if path == "/distserve/p2p_connect" and refuse:
                return 500, {"error": refuse}
            return status, {"engine_endpoint_info": {"zmq_address": "tcp://x"},
                            "kvtransfer_endpoint_info": [{"protocol": 1, "endpoint_info": json.dumps(self.info)}]}

        super().__init__(route)

    def close(self):
        super().close()
        bridges.forget(self.url)


ANSWER = json.dumps({"id": "-1", "choices": [{"text": "x"}], "cache_block_ids": [7, 3, 11],
                     "remote_token_ids": [5, 42], "usage": {"prompt_tokens": 40, "completion_tokens": 1}}).encode()


def _kvp():
    return get_engine("lmdeploy").kv_transfer_params(ANSWER)


def test_lmdeploy_answer_becomes_vllm_transfer_params_and_the_endpoint_is_learnt_once():
    fake = _FakeLMDeploy()
    try:
        async def run():
            return [await bridges.lmdeploy_to_vllm(fake.url, "http://d:1", _kvp(), ANSWER) for _ in range(3)]

        outs = asyncio.run(run())
        out = outs[0]
        assert outs[1] == outs[2] == out
        assert out["do_remote_prefill"] is True and out["do_remote_decode"] is False
        p = decode_params(out)  # a valid TransferParams: what vLLM's DLMixConnector decodes
        assert (p.engine, p.instance_id, p.request_id) == ("lmdeploy", fake.url, block_ids_transfer_id([7, 3, 11]))
        assert p.block_ids == [7, 3, 11] and p.num_tokens == 40 and p.digest is None
        assert p.transports == [TRANSPORT] and p.kv_layout == LAYOUT
        # one engine_info and one p2p_initialize for the three requests, the prefill's config standing in for the
        # remote's
        assert [c[0] for c in fake.calls] == ["/distserve/engine_info", "/distserve/p2p_initialize"]
        init = fake.calls[1][1]
        assert init["local_engine_id"] == fake.url and init["remote_engine_id"] == "http://d:1"
        assert init["local_engine_config"] == init["remote_engine_config"] == {"role": 2, "block_size": 16}
    finally:
        fake.close()


@pytest.mark.parametrize("info,status,answer,reason", [
    (None, 200, ANSWER.replace(b'"usage"', b'"nousage"'), "no usage.prompt_tokens"),
    (None, 200, b"not json", "LMDeploy prefill answer"),
    ({"role": "Prefill"}, 200, ANSWER, "not a DLMix endpoint"),
    ({"dlmix": 1, "role": "Decode", "transport": TRANSPORT, "layout": LAYOUT.to_dict()}, 200, ANSWER,
     "not --role Prefill"),
    ({"dlmix": 1, "role": "Prefill", "transport": TRANSPORT, "layout": {"block_size": "x"}}, 200, ANSWER,
     "does not make transfer parameters"),
    (None, 500, ANSWER, "answered 500"),
])
def test_a_prefill_that_cannot_feed_vllm_is_a_readable_error(info, status, answer, reason):
    fake = _FakeLMDeploy(info, status)
    try:
        with pytest.raises(ValueError, match=reason):
            asyncio.run(bridges.lmdeploy_to_vllm(fake.url, "http://d:1", _kvp(), answer))
    finally:
        fake.close()


def test_an_unreachable_prefill_is_a_readable_error_and_is_asked_again_next_time():
    url = "http://127.0.0.1:9"
    for _ in range(2):
        with pytest.raises(ValueError, match="ConnectError|ConnectTimeout"):
            asyncio.run(bridges.lmdeploy_to_vllm(url, "http://d:1", _kvp(), ANSWER))
    bridges.forget(url)


def _FakeLMDeployDecode(refuse: str = "") -> _FakeLMDeploy:
    """An LMDeploy decode's DistServe routes (see :class:`_FakeLMDeploy`)."""
    return _FakeLMDeploy(refuse=refuse)


def _vllm_params(port: int = 5555) -> dict:
    from dlmix.pd.contract import TransferParams

    lay = KVLayout(model=LAYOUT.model, block_size=32, dtype="fp32", arrangement="vllm_cpu", tp_size=1)
    tp = TransferParams.make(engine="vllm", instance_id="P", transports=[dict(TRANSPORT, port=port)],
                             request_id="cmpl-1-0", block_ids=[8, 2], num_tokens=40, layout=lay,
                             token_ids=range(40))
    return {"do_remote_prefill": True, "do_remote_decode": False, **tp.to_dict()}


VLLM_ANSWER = json.dumps({"choices": [{"text": " the", "token_ids": [271]}], "usage": {"prompt_tokens": 40}}).encode()


def test_vllm_answer_becomes_a_migration_request_and_the_decode_is_connected_once_per_prefill_endpoint():
    fake = _FakeLMDeployDecode()
    try:
        async def run(port):
            return await bridges.vllm_to_lmdeploy("http://p:1", fake.url, _vllm_params(port), VLLM_ANSWER)

        async def both():
            return [await run(5555), await run(5555), await run(6666)]  # 6666: the prefill restarted elsewhere

        a, b, c = asyncio.run(both())
        assert a == b == c == {"protocol": 1, "remote_engine_id": "http://p:1", "remote_session_id": 0,
                               "remote_token_id": 271, "remote_block_ids": [8, 2], "is_dummy_prefill": False}
        paths = [c[0] for c in fake.calls]
        assert paths == ["/distserve/engine_info", "/distserve/p2p_initialize", "/distserve/p2p_connect"] * 2
        conn = fake.calls[2][1]
        assert conn["remote_engine_id"] == "http://p:1"
        assert conn["remote_engine_endpoint_info"] == {"zmq_address": "tcp://x"}  # the decode's own, a stand-in
        info = json.loads(conn["remote_kvtransfer_endpoint_info"][0]["endpoint_info"])
        params = _vllm_params()
        assert info == {"dlmix": 1, "role": "Prefill", "transport": params["remote_transports"][0],
                        "layout": params["remote_layout"]}
        assert json.loads(fake.calls[5][1]["remote_kvtransfer_endpoint_info"][0]["endpoint_info"])["transport"][
            "port"] == 6666
    finally:
        fake.close()
        bridges.forget("http://p:1")


def test_vllm_to_lmdeploy_errors_are_readable_and_a_refused_pair_is_tried_again():
    fake = _FakeLMDeployDecode(refuse="DLMix: prefill cannot feed decode: weights fingerprint differs")
    try:
        for _ in range(2):
            with pytest.raises(ValueError, match="weights fingerprint differs"):
                asyncio.run(bridges.vllm_to_lmdeploy("http://p:1", fake.url, _vllm_params(), VLLM_ANSWER))
        assert [c[0] for c in fake.calls].count("/distserve/p2p_connect") == 2
        with pytest.raises(ValueError, match="no choices\\[0\\].token_ids"):
            asyncio.run(bridges.vllm_to_lmdeploy("http://p:1", fake.url, _vllm_params(),
                                                 b'{"choices": [{"text": "x"}]}'))
        with pytest.raises(ValueError, match="is it DLMixConnector"):
            asyncio.run(bridges.vllm_to_lmdeploy("http://p:1", fake.url, {"do_remote_prefill": True,
                                                                          "remote_block_ids": [1]}, VLLM_ANSWER))
        two = _vllm_params()
        two["remote_transports"] = two["remote_transports"] * 2
        two["remote_layout"] = dict(two["remote_layout"], tp_size=2)
        with pytest.raises(ValueError, match="TP"):
            asyncio.run(bridges.vllm_to_lmdeploy("http://p:1", fake.url, two, VLLM_ANSWER))
    finally:
        fake.close()
        bridges.forget("http://p:1")


@pytest.mark.parametrize("case", ["decode leg fails", "bridge fails"])
def test_an_lmdeploy_prefill_hold_is_freed_when_a_vllm_decode_does_not_take_it(case):
    """Across engines too, a decode leg that does not take the KV (the vLLM decode answers 500; or the bridge cannot
    build its parameters: the prefill's endpoint info is not a DLMix one, answered 502) makes the router free the
    LMDeploy prefill's hold at once: ``/distserve/free_cache`` naming it by the alias of the block ids in the
    prefill's own answer, not by anything in the vLLM decode's parameters."""
    import httpx

    from dlmix.router.config import RouterConfig
    from dlmix.testing import RouterThread, poll

    info = {"dlmix": 1, "role": "Prefill", "transport": TRANSPORT, "layout": LAYOUT.to_dict()} \
        if case == "decode leg fails" else {"dlmix": 99}
    freed: list = []
    decoded: list = []

    def prefill(method, path, body):
        if method == "GET":
            return 200, {"data": [{"id": "m"}]} if path == "/v1/models" else json.dumps({"role": 2, "block_size": 16})
        if path == "/v1/completions":
            return 200, json.loads(ANSWER)
        if path == "/distserve/free_cache":
            freed.append(body)
            return 200, {"status": "SUCCESS"}
        return 200, {"engine_endpoint_info": {"zmq_address": "tcp://x"},
                     "kvtransfer_endpoint_info": [{"protocol": 1, "endpoint_info": json.dumps(info)}]}

    def decode(method, path, body):
        if method == "GET":
            return 200, {"data": [{"id": "m"}]}
        decoded.append(body)
        return 500, {"error": "decode failed"}

    p, d = JsonStandIn(prefill), JsonStandIn(decode)
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="round_robin", retries=0))
    try:
        with httpx.Client(base_url=rt.url, timeout=30) as c:
            r = c.post("/nodes/add", json={"url": p.url, "status": {"models": ["m"], "role": 2}})
            assert r.status_code == 200, r.text
            r = c.post("/admin/instances", json={"url": d.url, "role": "decode", "engine": "vllm", "model": "m",
                                                 "heartbeat_ttl_s": 0})
            assert r.status_code == 201, r.text
            r = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4})
        if case == "decode leg fails":
            assert r.status_code == 500 and len(decoded) == 1, r.text
            assert decoded[0]["kv_transfer_params"]["remote_request_id"] == block_ids_transfer_id([7, 3, 11])
        else:
            assert r.status_code == 502 and "cannot feed" in r.text and not decoded, r.text
        assert poll(lambda: freed, 10) == [{"remote_engine_id": p.url,
                                            "remote_session_id": block_ids_session_alias([7, 3, 11])}]
    finally:
        rt.close()
        p.close()
        d.close()
        bridges.forget(p.url)


class _Cfg:
    host, port, handoff_host = "127.0.0.1", 8123, None


def test_vllm_and_lmdeploy_answers_become_an_sglang_room_filed_with_the_router():
    from dlmix.router.rooms import RoomTable

    rooms = RoomTable(_Cfg())
    out = asyncio.run(bridges.vllm_to_sglang("http://p:1", "http://d:2", _vllm_params(), VLLM_ANSWER, rooms=rooms))
    assert set(out) == {"bootstrap_host", "bootstrap_port", "bootstrap_room"}
    assert (out["bootstrap_host"], out["bootstrap_port"]) == ("127.0.0.1", 8123)
    h = rooms.get(out["bootstrap_room"])
    assert h.first_token_id == 271 and decode_params(h.params) == decode_params(_vllm_params())
    assert len(rooms) == 1
    out2 = asyncio.run(bridges.vllm_to_sglang("http://p:1", "http://d:2", _vllm_params(), VLLM_ANSWER, rooms=rooms))
    assert out2["bootstrap_room"] != out["bootstrap_room"] and len(rooms) == 2
    with pytest.raises(ValueError, match="room table"):
        asyncio.run(bridges.vllm_to_sglang("http://p:1", "http://d:2", _vllm_params(), VLLM_ANSWER))
    with pytest.raises(ValueError, match="no choices\\[0\\].token_ids"):
        asyncio.run(bridges.vllm_to_sglang("http://p:1", "http://d:2", _vllm_params(), b'{"choices": []}',
                                           rooms=rooms))
    fake = _FakeLMDeploy()
    try:
        out = asyncio.run(bridges.lmdeploy_to_sglang(fake.url, "http://d:2", _kvp(), ANSWER, rooms=rooms))
        h = rooms.get(out["bootstrap_room"])
        p = decode_params(h.params)
        assert h.first_token_id == 42 and p.block_ids == [7, 3, 11] and p.num_tokens == 40
        assert p.request_id == block_ids_transfer_id([7, 3, 11]) and p.transports == [TRANSPORT]
    finally:
        fake.close()


def test_room_table_expiry_capacity_and_address():
    from dlmix.pd.contract import RoomHandoff
    from dlmix.router.rooms import RoomTable

    h = RoomHandoff(params={"x": 1}, first_token_id=1)
    t = RoomTable(_Cfg(), ttl_s=10, capacity=3)
    a = t.put(h, now=0.0)
    assert 0 < a < 1 << 63 and t.get(a, now=9.9) is h and t.get(a, now=10.0) is None and len(t) == 0
    rooms = [t.put(h, now=20.0) for _ in range(4)]  # capacity 3: the oldest goes
    assert t.get(rooms[0], now=20.0) is None and all(t.get(r, now=20.0) is h for r in rooms[1:])
    cfg = _Cfg()
    assert RoomTable(cfg).address("http://10.1.2.3:8000") == ("127.0.0.1", 8123)
    cfg.host = "0.0.0.0"
    assert RoomTable(cfg).address("http://127.0.0.1:8000") == ("127.0.0.1", 8123)  # the route to the decode
    cfg.handoff_host = "router.example"
    assert RoomTable(cfg).address("http://127.0.0.1:8000") == ("router.example", 8123)


def test_router_answers_an_sglang_decode_for_its_rooms():
    """``GET /dlmix/layout`` marks the router as a room source; ``POST /dlmix/handoff`` answers a filed room, 404
    for another, 400 for a malformed body; it takes the admin key (not a client key), and from a loopback peer
    nothing while no admin key is set."""
    import httpx

    from dlmix.pd.contract import RoomHandoff, decode_room_handoff
    from dlmix.router.config import RouterConfig
    from dlmix.testing import RouterThread

    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, api_keys=["k"]))
    try:
        room = rt.router.rooms.put(RoomHandoff(params=_vllm_params(), first_token_id=271))
        with httpx.Client(base_url=rt.url, timeout=10, trust_env=False) as c:
            assert c.get("/dlmix/layout").json() == {"dlmix_router": True, "layouts": []}
            r = c.post("/dlmix/handoff", json={"room": room, "timeout_s": 5})
            assert r.status_code == 200
            p, tok = decode_room_handoff(r.content)
            assert tok == 271 and p == decode_params(_vllm_params())
            r = c.post("/dlmix/handoff", json={"room": room + 1})
            assert r.status_code == 404 and "unknown" in r.json()["error"]["message"]
            for bad in (b"{", b'{"room": -1}', b'{"room": 1, "extra": 2}'):
                r = c.post("/dlmix/handoff", content=bad)
                assert r.status_code == 400 and "invalid hand-off request" in r.json()["error"]["message"]
            assert c.post("/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 401
    finally:
        rt.close()
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, admin_key="adm"))
    try:
        room = rt.router.rooms.put(RoomHandoff(params=_vllm_params(), first_token_id=271))
        with httpx.Client(base_url=rt.url, timeout=10, trust_env=False) as c:
            for hdr in ({}, {"Authorization": "Bearer other"}):
                r = c.post("/dlmix/handoff", json={"room": room}, headers=hdr)
                assert r.status_code == 401 and "admin key" in r.text
            r = c.post("/dlmix/handoff", json={"room": room}, headers={"Authorization": "Bearer adm"})
            assert r.status_code == 200 and r.json()["first_token_id"] == 271
    finally:
        rt.close()
