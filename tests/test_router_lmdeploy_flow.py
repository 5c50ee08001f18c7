"""The router's LMDeploy DistServe adapter and LMDeploy's registration route, without LMDeploy (the same flow on real
LMDeploy servers is in ``tests/test_lmdeploy_pd.py``)."""
from __future__ import annotations

import contextlib
import json

import httpx
import pytest

from dlmix.hw.cost import CostModel
from dlmix.router.admin import lmdeploy_registration
from dlmix.router.config import RouterConfig
from dlmix.router.engines import lmdeploy as lmd
from dlmix.routing.policies import ClusterView, make_policy
from dlmix.routing.state import InstanceState, RouteRequest
from dlmix.testing import JsonStandIn, RouterThread


def test_prefill_leg_keeps_the_cache_and_answers_one_token():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}
    out = json.loads(lmd.prefill_body(body, chat=True))
    assert out == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                   "max_completion_tokens": 1, "stream": False, "with_cache": True, "preserve_cache": True}
    assert body["max_tokens"] == 50 and body["stream"] is True  # the client's body is not modified


def test_prefill_leg_of_n_choices_prefills_once():
    """LMDeploy refuses ``n > 1`` with ``with_cache``: the prefill leg asks for one choice (a vLLM decode fans out
    into the ``n``; for an LMDeploy decode the router sends one request per choice, ``PD_CHOICES``)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 3}
    assert json.loads(lmd.prefill_body(body, chat=True))["n"] == 1 and body["n"] == 3
    assert json.loads(lmd.prefill_body(dict(body, n=1), chat=True))["n"] == 1
    assert "n" not in json.loads(lmd.prefill_body({"model": "m", "prompt": "hi"}, chat=False))
    assert lmd.PD_CHOICES == "fan_out"


def test_migration_request_from_the_prefill_answer():
    resp = {"id": "7", "choices": [{"text": " Paris"}], "cache_block_ids": [4, 9, 2], "remote_token_ids": [3, 12]}
    kvp = lmd.kv_transfer_params(json.dumps(resp).encode())
    assert kvp == {"protocol": 1, "remote_engine_id": None, "remote_session_id": 7, "remote_token_id": 12,
                   "remote_block_ids": [4, 9, 2], "is_dummy_prefill": False}
    chat = dict(resp, id="chatcmpl-abc")  # a chat answer's id is no session id
    assert lmd.kv_transfer_params(json.dumps(chat).encode())["remote_session_id"] == 0
    for bad in (b"{}", b'{"cache_block_ids": [1]}', b"not json", json.dumps(dict(resp, cache_block_ids=[])).encode()):
        with pytest.raises(ValueError):
            lmd.kv_transfer_params(bad)


def test_decode_leg_is_the_client_bytes_plus_the_migration_request():
    raw = b'{"model": "m", "prompt": "x", "max_tokens": 5}'
    kvp = {"remote_engine_id": "http://p:1", "remote_block_ids": [1]}
    out = lmd.decode_body(raw, kvp)
    assert out.startswith(b'{"model": "m", "prompt": "x", "max_tokens": 5')
    assert json.loads(out) == {"model": "m", "prompt": "x", "max_tokens": 5, "migration_request": kvp}


def test_lmdeploy_node_body_becomes_a_registration():
    assert lmdeploy_registration({"url": "http://h:1", "status": {"models": ["m"], "role": 2}}) == {
        "url": "http://h:1", "engine": "lmdeploy", "role": "prefill", "heartbeat_ttl_s": 0, "model": ["m"]}
    assert lmdeploy_registration({"url": "http://h:1", "status": {"role": 3}})["role"] == "decode"
    assert lmdeploy_registration({"url": "http://h:1"})["role"] == "both"
    assert "unknown LMDeploy role" in lmdeploy_registration({"url": "http://h:1", "status": {"role": 9}})
    assert "url" in lmdeploy_registration({"status": {}})


def test_nodes_add_and_remove_on_the_router():
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0))
    try:
        with httpx.Client(base_url=rt.url, timeout=10) as c:
            r = c.post("/nodes/add", json={"url": "http://127.0.0.1:9", "status": {"models": ["m"], "role": 3}})
            assert r.status_code == 200, r.text  # LMDeploy's register_to_proxy logs an error for anything else
            got = c.get("/admin/instances").json()["instances"]
            assert [(i["url"], i["engine"], i["role"], i["model"]) for i in got] == [
                ("http://127.0.0.1:9", "lmdeploy", "decode", ["m"])]
            assert c.post("/nodes/add", json={"url": "http://127.0.0.1:9", "status": {"role": 7}}).status_code == 400
            assert c.post("/nodes/remove", json={"url": "http://127.0.0.1:9"}).status_code == 200
            assert c.get("/admin/instances").json()["instances"] == []
            assert c.post("/nodes/remove", json={"url": "http://127.0.0.1:9"}).status_code == 404
    finally:
        rt.close()


def test_cost_policy_disaggregates_short_prompts_for_a_decode_that_cannot_prefill():
    """A short prompt goes to a decode instance alone only when it can prefill; an LMDeploy/SGLang decode-role
    engine (``extra["needs_prefill"]``, set by the router) always gets a prefill instance."""
    def inst(i, role, **extra):
        return InstanceState(id=f"i{i}", url=f"http://h:{i}", role=role, chip="H100", slot=i, model=("m",),
                             transport={"link": "rdma-100g"}, extra=extra)

    req = RouteRequest(model="m", prompt_len=20, block_hashes=lambda bs: [])
    pol = make_policy("cost")
    cost = CostModel("llama-3.1-8b")
    free = pol.choose(req, ClusterView([inst(0, "prefill"), inst(1, "decode")], cost=cost))
    assert free.prefill is None and free.decode.id == "i1"
    needy = pol.choose(req, ClusterView([inst(0, "prefill"), inst(1, "decode", needs_prefill=True)], cost=cost))
    assert needy.prefill is not None and needy.prefill.id == "i0" and needy.reason == "cost:pd"


def test_lmdeploy_pairs_with_vllm_both_ways_and_feeds_sglang():
    """vLLM and LMDeploy both run a sequential flow, but their decode legs carry different things
    (``kv_transfer_params`` vs ``migration_request``): bridges join them in both directions
    (:mod:`dlmix.router.engines.bridges`), and an SGLang decode through the router's rooms. Without that bridge an
    SGLang decode next to an LMDeploy prefill of the same model is refused (409) with the reason."""
    from dlmix.router.engines import bridges

    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0))
    try:
        with httpx.Client(base_url=rt.url, timeout=10) as c:
            def add(port, role, engine, model="m"):
                return c.post("/admin/instances", json={"url": f"http://127.0.0.1:{port}", "role": role,
                                                        "engine": engine, "model": model, "heartbeat_ttl_s": 0})

            assert add(9, "prefill", "vllm").status_code in (200, 201)
            r = c.post("/nodes/add", json={"url": "http://127.0.0.1:10", "status": {"models": ["m"], "role": 3}})
            assert r.status_code == 200, r.text
            assert add(11, "decode", "vllm").status_code in (200, 201)
            r = c.post("/nodes/add", json={"url": "http://127.0.0.1:12", "status": {"models": ["m"], "role": 2}})
            assert r.status_code == 200, r.text
            assert sorted((i["engine"], i["role"]) for i in c.get("/admin/instances").json()["instances"]) == [
                ("lmdeploy", "decode"), ("lmdeploy", "prefill"), ("vllm", "decode"), ("vllm", "prefill")]
            saved = bridges.BRIDGES.pop(("lmdeploy", "sglang"))
            try:
                r = add(13, "decode", "sglang")
            finally:
                bridges.BRIDGES[("lmdeploy", "sglang")] = saved
            assert r.status_code == 409, r.text
            assert "concurrent/bootstrap" in r.text and "lmdeploy (sequential/migration_request)" in r.text
            assert add(13, "decode", "sglang").status_code in (200, 201)
    finally:
        rt.close()


class _FakeEngine(JsonStandIn):
    """An LMDeploy api_server stand-in: ``/health``, ``/v1/models``, the DistServe handshake routes, ``free_cache``
    (recorded), and ``/v1/completions`` answering a prefill's hand-off (role prefill) or ``decode_status``."""

    def __init__(self, role: str, decode_status: int = 200):
        self.freed: list[dict] = []
        self.calls: list[str] = []

        def route(method, path, body):
            self.calls.append(path)
            if method == "GET":
                return 200, {"data": [{"id": "m"}]} if path == "/v1/models" else {}
            if path == "/distserve/free_cache":
                self.freed.append(body)
                return 200, {"status": "SUCCESS"}
            if path.startswith("/distserve/"):
                return 200, {"engine_endpoint_info": {}, "kvtransfer_endpoint_info": []}
            if role == "prefill":
                return 200, {"id": "-1", "choices": [{"text": "x"}], "cache_block_ids": [7, 3, 11],
                             "remote_token_ids": [42], "usage": {"prompt_tokens": 40}}
            return decode_status, ({"object": "error", "message": "decode failed", "code": 500}
                                   if decode_status != 200 else {"choices": [{"text": "answer"}]})

        super().__init__(route)

    def close(self):
        super().close()
        lmd.forget(self.url)


@contextlib.contextmanager
def _pair(decode_status: int = 200):
    """A fake LMDeploy prefill and decode registered through ``/nodes/add`` on a router (round robin, no retries):
    yields ``(prefill, decode, client of the router)``."""
    p, d = _FakeEngine("prefill"), _FakeEngine("decode", decode_status)
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="round_robin", retries=0))
    try:
        with httpx.Client(base_url=rt.url, timeout=30) as c:
            for url, role in ((p.url, 2), (d.url, 3)):
                r = c.post("/nodes/add", json={"url": url, "status": {"models": ["m"], "role": role}})
                assert r.status_code == 200, r.text
            yield p, d, c
    finally:
        rt.close()
        p.close()
        d.close()


@pytest.mark.parametrize("decode_status", [500, 200])
def test_prefill_hold_is_freed_when_the_decode_leg_does_not_take_it(decode_status):
    """A decode leg that fails (HTTP 500) makes the router ask the prefill to free what it holds for that request
    at once: ``/distserve/free_cache`` naming the hold by the alias of its block ids (LMDeploy's api_server answers
    the user's session id, not the engine's); a decode leg that succeeds frees nothing (its decode took the KV)."""
    from dlmix.pd.contract import block_ids_session_alias
    from dlmix.testing import poll

    with _pair(decode_status) as (p, d, c):
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4})
        assert r.status_code == decode_status, r.text
        if decode_status == 200:
            assert not poll(lambda: p.freed, 1.0) and not d.freed
        else:
            alias = block_ids_session_alias([7, 3, 11])
            assert poll(lambda: p.freed, 10) == [{"remote_engine_id": p.url, "remote_session_id": alias}]
            assert alias <= -2 and not d.freed


def test_n_choices_for_an_lmdeploy_decode_run_one_migration_each():
    """Requests for 2 (chat) and 3 (completion) choices placed on an LMDeploy prefill/decode pair (LMDeploy refuses a
    chat ``n > 1`` with cache migration and answers one choice to a completion's): one prefill leg and one decode
    leg per choice, one answer with every choice, ``index`` 0..n-1."""
    with _pair() as (p, d, c):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"] == [{"text": "answer", "index": 0}, {"text": "answer", "index": 1}]
        assert p.calls.count("/v1/chat/completions") == 2 and d.calls.count("/v1/chat/completions") == 2
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4, "n": 3})
        assert r.status_code == 200, r.text
        assert [ch["index"] for ch in r.json()["choices"]] == [0, 1, 2]
        assert p.calls.count("/v1/completions") == 3 and d.calls.count("/v1/completions") == 3