"""The router's admin API and state under bad input: schema-validated bodies (400 with a reason, never 500, no partial
change), self-registration refused, registration cost flat in the fleet (counted, not timed), bounded and
key-protected ``/metrics``."""
from __future__ import annotations

import asyncio
import json
import sys

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlmix.router import proxy
from dlmix.router.config import RouterConfig
from dlmix.router.server import Router
from dlmix.testing import LoopThread
from dlmix.testing.mock_engine import MockEngine


class FakeConn:
    """Records what the router answers; a loopback peer."""

    def __init__(self):
        self.peer = ("127.0.0.1", 5555)
        self.closed = False
        self.sent = []

    def send(self, status, body, content_type=b"application/json", keep_alive=True, extra=b""):
        self.sent.append((status, body))
        self.extra = extra


def call(router: Router, method: str, path: str, body=None, headers=(), raw: bytes = None):
    """One request through the router's dispatcher; an exception escaping it is what the server turns into 500."""
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    req = proxy.Request(method.encode(), path.encode(), [(k.encode(), v.encode()) for k, v in headers], data, True)
    conn = FakeConn()
    try:
        asyncio.run(router.handle(conn, req))
    except Exception as ex:  # noqa: BLE001 - the server would answer 500 with this text
        return 500, {"error": f"{type(ex).__name__}: {ex}"}
    status, out = conn.sent[-1]
    return status, json.loads(out) if out.startswith(b"{") else out


def _router(**kw) -> Router:
    kw.setdefault("port", 18999)
    return Router(RouterConfig(**kw))


GOOD = {"url": "http://127.0.0.1:9101", "id": "p0", "role": "prefill", "model": "m", "chip": "H100", "num_chips": 2}


@pytest.mark.parametrize("patch, reason", [
    ({"num_chips": 0}, "num_chips"), ({"num_chips": -3}, "num_chips"), ({"num_chips": "2"}, "num_chips"),
    ({"num_chips": 1.5}, "num_chips"), ({"num_chips": True}, "num_chips"), ({"block_size": 0}, "block_size"),
    ({"role": "boss"}, "role"), ({"role": None}, "role"), ({"url": "ftp://h:1"}, "url"), ({"url": "http://h"}, "url"),
    ({"url": "http://h:99999"}, "url"), ({"url": "http://a b:1"}, "host"), ({"url": "http://h:1/x"}, "path"),
    ({"url": 5}, "url"), ({"model": [1, 2]}, "model"), ({"chip": "X9"}, "X9"), ({"engine": "nope"}, "nope"),
    ({"heartbeat_ttl_s": -1}, "heartbeat_ttl_s"), ({"heartbeat_ttl_s": "x"}, "heartbeat_ttl_s"),
    ({"transport": "rdma"}, "transport"), ({"kv_events": "http://x:1"}, "kv_events"),
    ({"kv_layout": {"model": 1}}, "kv_layout"), ({"api_key": 7}, "api_key"), ({"api_key": "k\r\nx-evil: 1"}, "api_key"), ({"id": 3}, "id"),
])
def test_bad_registration_fields_are_400_with_the_field_named(patch, reason):
    r = _router()
    status, out = call(r, "POST", "/admin/instances", dict(GOOD, **patch))
    assert status == 400, out
    assert reason in out["error"]["message"], out
    assert r.instances == [] and r.rt == {}


def _err(status, message, type_="invalid_request_error", **extra):
    """The OpenAI error object every router error answer carries."""
    return {"error": {"message": message, "type": type_, "param": None, "code": status, **extra}}


def test_every_404_405_401_answer_is_the_openai_error_object():
    r = _router(api_keys=["k1"], admin_key="adm")
    key, adm = [("authorization", "Bearer k1")], [("authorization", "Bearer adm")]
    bad_key = _err(401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error")
    # client API
    assert call(r, "GET", "/nowhere", headers=key) == (
        404, _err(404, "not found: GET /nowhere is not an endpoint of this router"))
    assert call(r, "GET", "/v1/completions", headers=key) == (
        405, _err(405, "method not allowed: GET /v1/completions; use POST"))
    assert call(r, "DELETE", "/health") == (405, _err(405, "method not allowed: DELETE /health; use GET"))
    assert call(r, "POST", "/v1/completions", {"model": "m", "prompt": "x"}) == (401, bad_key)
    assert call(r, "POST", "/v1/chat/completions", {"model": "m", "messages": []},
                headers=[("authorization", "Bearer nope")]) == (401, bad_key)
    assert call(r, "GET", "/v1/models") == (401, bad_key)
    assert call(r, "GET", "/metrics") == (401, bad_key)
    assert call(_router(metrics=False), "GET", "/metrics") == (
        404, _err(404, "metrics disabled (router option metrics: false)"))
    # admin API and the instance-facing hand-off
    need_admin = _err(401, "admin key required (Authorization: Bearer ADMIN_KEY)", "authentication_error")
    assert call(r, "GET", "/admin/instances") == (401, need_admin)
    assert call(r, "GET", "/admin/instances", headers=key) == (401, need_admin)
    assert call(r, "POST", "/dlmix/handoff", {"room": 1}) == (401, need_admin)
    assert call(r, "GET", "/admin/nothing", headers=adm) == (
        404, _err(404, "not found: GET /admin/nothing is not an endpoint of this router"))
    assert call(r, "GET", "/admin/instances/nobody", headers=adm) == (404, _err(404, "unknown instance 'nobody'"))
    assert call(r, "PUT", "/admin/instances", headers=adm) == (
        405, _err(405, "method not allowed: PUT /admin/instances; use GET or POST"))
    assert call(r, "POST", "/admin/instances", raw=b"{nope", headers=adm)[1]["error"]["message"].startswith(
        "request body is not valid JSON: ")
    # a refused registration keeps its reasons, inside the error object
    status, out = call(r, "POST", "/admin/instances", dict(GOOD, num_chips=0), headers=adm)
    assert status == 400 and out == _err(400, "invalid registration: Expected `int` >= 1 - at `$.num_chips`",
                                         reasons=[])


def test_admin_401_without_an_admin_key_says_loopback_only():
    r = _router()  # no admin_key: loopback peers only
    conn = FakeConn()
    conn.peer = ("10.0.0.5", 40000)
    asyncio.run(r.handle(conn, proxy.Request(b"GET", b"/admin/instances", [], b"", True)))
    assert conn.sent[-1][0] == 401 and json.loads(conn.sent[-1][1]) == _err(
        401, "admin API open to loopback peers only (the router has no admin_key)", "authentication_error")


def test_405_names_the_allowed_methods_in_an_allow_header():
    r = _router()
    req = proxy.Request(b"PUT", b"/admin/instances", [], b"", True)
    conn = FakeConn()
    asyncio.run(r.handle(conn, req))
    assert conn.sent[-1][0] == 405 and conn.extra == b"allow: GET, POST\r\n"
    req = proxy.Request(b"GET", b"/v1/chat/completions", [], b"", True)
    asyncio.run(r.handle(conn, req))
    assert conn.sent[-1][0] == 405 and conn.extra == b"allow: POST\r\n"


def test_num_chips_zero_no_longer_breaks_routing():
    r = _router(policy="cost", model_spec="llama-3.1-8b")
    assert call(r, "POST", "/admin/instances", dict(GOOD, role="both", num_chips=0))[0] == 400
    assert call(r, "POST", "/admin/instances", dict(GOOD, role="both"))[0] == 201
    assert r.instances[0].num_chips == 2


def test_bad_reregistration_leaves_the_live_instance_registered_and_unchanged():
    r = _router()
    assert call(r, "POST", "/admin/instances", GOOD)[0] == 201
    before = r.describe(r.instances[0])
    backend = r.rt["p0"]
    for bad in ({"num_chips": 0}, {"heartbeat_ttl_s": "soon"}, {"kv_events": 5}, {"chip": "X9"},
                {"transport": [1]}, {"role": "x"}, {"block_size": -1}, {"kv_layout": {"model": 1}}):
        status, out = call(r, "POST", "/admin/instances", dict(GOOD, **bad))
        assert status == 400, (bad, out)
        assert [i.id for i in r.instances] == ["p0"] and r.rt["p0"] is backend
        assert r.describe(r.instances[0]) == before
    # the same body again is a real re-registration: same slot, same place
    assert call(r, "POST", "/admin/instances", dict(GOOD, num_chips=4)) == (201, {"id": "p0", "slot": 0})
    assert r.instances[0].num_chips == 4 and len(r.instances) == 1


def test_heartbeat_bodies_validated():
    r = _router()
    call(r, "POST", "/admin/instances", GOOD)
    for bad in ({"waiting": -1}, {"waiting": "3"}, {"kv_usage": 2.0}, {"running": 1.5}, {"nonsense": 1}, [1], "x"):
        status, out = call(r, "POST", "/admin/instances/p0/heartbeat", bad)
        assert status == 400 and "heartbeat" in out["error"]["message"], (bad, out)
    assert call(r, "POST", "/admin/instances/p0/heartbeat", {"waiting": 3, "kv_usage": 0})[0] == 200
    ld = r.instances[0].load
    assert (ld.waiting, ld.running, ld.kv_usage) == (3, 0, 0.0)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=12), ch, max_size=4), max_leaves=12)
_fields = st.sampled_from(["url", "id", "role", "engine", "model", "cluster", "chip", "num_chips", "block_size",
                           "kv_layout", "transport", "kv_events", "api_key", "heartbeat_ttl_s", "contract_version",
                           "lora_adapters", "waiting", "running", "kv_usage", "extra"])
_bodies = st.one_of(
    _json_values,
    st.dictionaries(_fields, _json_values, max_size=6),
    st.dictionaries(_fields, _json_values, max_size=6).map(lambda d: dict(GOOD, **d)),
    st.fixed_dictionaries({"url": st.sampled_from(["http://127.0.0.1:9101", "http://[::1]:9102", "http://h:0",
                                                   "http://127.0.0.1:18999", "http://localhost:18999", "http://:1"]),
                           "num_chips": st.integers(-2, 3), "role": st.sampled_from(["prefill", "decode", "both", ""]),
                           "block_size": st.integers(-1, 64), "kv_events": st.sampled_from([None, "tcp://h:1", "x"]),
                           "transport": st.sampled_from([None, {"link": "rdma-100g"}, {"link": "??"}, {"bandwidth_gbps": "x"},
                                                         {"bandwidth_gbps": -1}, {}])}))
_paths = st.sampled_from([("POST", "/admin/instances"), ("POST", "/admin/instances/p0/heartbeat"),
                          ("POST", "/admin/instances/p0/drain"), ("DELETE", "/admin/instances/nobody"),
                          ("POST", "/admin/instances/%ZZ/heartbeat"), ("GET", "/admin/instances/p0")])


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_bodies, where=_paths, raw=st.one_of(st.none(), st.binary(max_size=40)))
def test_fuzzed_admin_bodies_never_answer_500(body, where, raw):
    r = _fuzz_router()
    method, path = where
    status, out = call(r, method, path, body, raw=raw)
    assert 200 <= status < 500, (body, out)
    if status >= 400:  # refused: the live instance is still there and unchanged
        assert [i.id for i in r.instances] == ["p0"] and r.describe(r.rt["p0"].state) == _P0_VIEW[0], (body, out)


_FUZZ = []
_P0_VIEW = []


def _fuzz_router() -> Router:
    if not _FUZZ:
        _FUZZ.append(_router())
    r = _FUZZ[0]
    for iid in [i.id for i in r.instances]:
        r.remove(iid)
    assert call(r, "POST", "/admin/instances", GOOD)[0] == 201
    _P0_VIEW[:] = [r.describe(r.rt["p0"].state)]
    return r


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_registering_the_router_itself_is_refused(host):
    r = _router(host=host, port=18999, allow_open=True)
    forms = ["http://127.0.0.1:18999", "http://localhost:18999", "http://127.0.0.1:18999/", "http://[::1]:18999",
             "http://LOCALHOST:18999"]
    if host == "0.0.0.0":
        import socket

        forms += [f"http://{socket.gethostname()}:18999", "http://0.0.0.0:18999"]
    for url in forms:
        status, out = call(r, "POST", "/admin/instances", {"url": url})
        assert status == 400 and "own listening address" in out["error"]["message"], (url, out)
    assert r.instances == []
    assert call(r, "POST", "/admin/instances", {"url": "http://127.0.0.1:18998"})[0] == 201  # another port is fine


def test_self_registration_refused_on_a_started_router_with_port_0():
    lt = LoopThread()
    try:
        r = Router(RouterConfig(port=0, policy="round_robin"))
        lt.run(r.start())
        port = r.cfg.port
        res = httpx.post(f"http://127.0.0.1:{port}/admin/instances", json={"url": f"http://localhost:{port}"})
        assert res.status_code == 400 and "own listening address" in res.json()["error"]["message"]
        assert r.instances == []
        lt.run(r.stop())
    finally:
        lt.close()


# ---------------------------------------------------------------------------------------------- cost in the fleet
def _lines_executed(fn) -> int:
    """Python lines executed by ``fn()`` (sys.settrace): an operation-count measure, independent of time."""
    n = [0]

    def tracer(frame, event, arg):
        if event == "line":
            n[0] += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return n[0]


def _layout():
    from dlmix.kv.layout import KVLayout, ModelIdentity

    return KVLayout(model=ModelIdentity(architecture="LlamaForCausalLM", num_layers=4, num_kv_heads=2, head_size=64),
                    block_size=16, dtype="bfloat16", arrangement="vllm_lbnhc").to_dict()


def _fleet(n: int, checks: list):
    import dlmix.router.registry as reg

    r = _router(policy="round_robin", metrics_instance_series=8)
    lay = _layout()
    real = reg.layout_reasons

    def counted(*a, **k):
        checks.append(1)
        return real(*a, **k)

    reg.layout_reasons = counted
    try:
        for i in range(n):
            r.register({"url": f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000", "id": f"i{i}",
                        "role": ("prefill", "decode")[i % 2], "model": "m", "kv_layout": lay, "chip": "H100"})
    finally:
        reg.layout_reasons = real
    return r


def test_registration_work_does_not_grow_with_the_fleet():
    import dlmix.router.registry as reg

    counts = {}
    for n in (100, 2000):
        checks: list = []
        r = _fleet(n, checks)
        assert len(r.instances) == n and len({i.slot for i in r.instances}) == n
        lay = _layout()
        body = {"url": "http://10.200.0.1:8000", "id": "new", "role": "decode", "model": "m", "kv_layout": lay}
        reg_checks: list = []
        real = reg.layout_reasons
        reg.layout_reasons = lambda *a, **k: reg_checks.append(1) or real(*a, **k)
        try:
            lines_new = _lines_executed(lambda: r.register(dict(body)))
            lines_re = _lines_executed(lambda: r.register(dict(body, num_chips=2)))  # re-registration
            r.rt["i7"].heartbeat({"waiting": 1})  # first use of the schema type: msgspec inspects it once
            lines_hb = _lines_executed(lambda: r.rt["i7"].heartbeat({"waiting": 2}))
        finally:
            reg.layout_reasons = real
        counts[n] = (len(checks), len(reg_checks), lines_new, lines_re, lines_hb)
        assert r.instances[-1].id == "new" and r.instances[-1].num_chips == 2 and len(r.instances) == n + 1
    small, big = counts[100], counts[2000]
    assert big[0] == small[0] <= 2, counts        # pair checks over the whole fleet: one per distinct layout pair
    assert big[1] == small[1] == 0, counts        # and none more for a newcomer with a known layout
    # Python lines executed per registration / re-registration / heartbeat: 20x the fleet, the same work (a few
    # lines of slack for caches warmed differently by earlier tests; one scan of the fleet would add thousands)
    assert all(b <= s + 40 for b, s in zip(big[2:], small[2:])), counts


def test_incompatible_layout_still_refused_in_a_large_fleet():
    from dlmix.kv.layout import KVLayout

    r = _fleet(300, [])
    other = KVLayout.from_dict(_layout())
    import dataclasses

    bad = dataclasses.replace(other, model=dataclasses.replace(other.model, num_layers=5)).to_dict()
    from dlmix.router.registry import RegistrationError

    with pytest.raises(RegistrationError) as ei:
        r.register({"url": "http://10.201.0.1:8000", "id": "bad", "role": "decode", "model": "m", "kv_layout": bad})
    assert ei.value.status == 409 and any("149 more" in s and "layers" in s for s in ei.value.reasons), ei.value.reasons
    assert "bad" not in r.rt and len(r.instances) == 300


def test_metrics_bounded_in_the_fleet():
    sizes = {}
    for n in (50, 1000):
        r = _fleet(n, [])
        for b in list(r.rt.values())[:20]:
            r.metrics.hit(b, 16)
            r.metrics.backend_error(b)
        body, _ = r.metrics.render()
        text = body.decode()
        sizes[n] = sum(1 for ln in text.splitlines() if ln and not ln.startswith("#"))
        assert 'instance="_other"' in text
        assert f"dlmix_router_instances_registered {float(n)}" in text
    assert sizes[50] == sizes[1000], sizes


def test_metrics_need_a_key_when_client_keys_are_set():
    open_r = _router()
    assert call(open_r, "GET", "/metrics")[0] == 200
    r = _router(api_keys=["k1"], admin_key="adm")
    assert call(r, "GET", "/metrics")[0] == 401
    assert call(r, "GET", "/metrics", headers=[("authorization", "Bearer nope")])[0] == 401
    assert call(r, "GET", "/metrics", headers=[("authorization", "Bearer k1")])[0] == 200
    assert call(r, "GET", "/metrics", headers=[("authorization", "Bearer adm")])[0] == 200


# ---------------------------------------------------------------------------------------------- metrics count
def _sample(router, name, **labels):
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


def test_metrics_count_4xx_prefill_legs_decode_hits_and_reported_kv_bytes():
    lt = LoopThread()
    p = MockEngine(name="p", role="prefill")
    d = MockEngine(name="d", role="decode", kv_events=True, record=False)
    lay = _layout()
    try:
        urls = [lt.run(e.start()) for e in (p, d)]
        insts = [{"url": urls[0], "id": "p", "role": "prefill", "model": "mock", "kv_layout": lay},
                 {"url": urls[1], "id": "d", "role": "decode", "model": "mock", "kv_layout": lay,
                  "kv_events": d.kv_endpoint}]
        r = Router(RouterConfig(port=0, instances=insts, policy="cost", tokenizer="bytes",
                                policy_params={"local_max_uncached": 0}, model_spec="llama-3.1-8b",
                                health_interval_s=60))
        lt.run(r.start())
        base = f"http://127.0.0.1:{r.cfg.port}"
        import time

        time.sleep(0.3)  # the KV-event SUB socket connects
        shared = "a shared system prompt. " * 16  # 384 bytes = 24 blocks of 16 byte-tokens
        with httpx.Client(timeout=10) as h:
            assert h.post(base + "/v1/completions", content=b"{nope").status_code == 400
            assert h.post(base + "/v1/completions", json=[1]).status_code == 400
            assert h.get(base + "/nowhere").status_code == 404
            # the decode instance computes the shared prefix itself (its KV events tell the router)
            assert h.post(d.url + "/v1/completions", json={"model": "mock", "prompt": shared, "max_tokens": 1}
                          ).status_code == 200
            deadline = time.time() + 5
            while len(r.index) < 24 and time.time() < deadline:
                time.sleep(0.05)
            prompt = shared + "and then a long new question " * 20
            res = h.post(base + "/v1/completions", json={"model": "mock", "prompt": prompt, "max_tokens": 4})
            assert res.status_code == 200
        deadline = time.time() + 5  # the answer reaches the client just before the router's bookkeeping runs
        while _sample(r, "dlmix_router_client_responses_total", status="200") < 1 and time.time() < deadline:
            time.sleep(0.02)
        assert p.prefill_legs == 1
        assert _sample(r, "dlmix_router_client_responses_total", status="400") == 2
        assert _sample(r, "dlmix_router_client_responses_total", status="404") == 1
        assert _sample(r, "dlmix_router_client_responses_total", status="200") == 1
        assert _sample(r, "dlmix_router_prefill_responses_total", instance="p", status="2xx") == 1
        assert _sample(r, "dlmix_router_decode_prefix_hit_tokens_total", instance="d") == 24 * 16
        from dlmix.kv.layout import KVLayout

        n_blocks = -(-len(prompt.encode()) // 16)
        assert _sample(r, "dlmix_router_kv_bytes_handed_off_total") == n_blocks * KVLayout.from_dict(lay).block_bytes()
        assert _sample(r, "dlmix_router_kv_bytes_estimated_total") > 0
        lt.run(r.stop())
    finally:
        for e in (p, d):
            lt.run(e.stop())
        lt.close()


def test_removed_instances_take_their_lora_adapters_and_layouts_with_them():
    """The router's LoRA table (adapter name -> path, which goes into every prefix key) and its KV layout table keep
    only what registered instances serve: an adapter or a layout whose last instance left is forgotten (before, both
    only grew, and a request naming a gone adapter was still keyed with its old path). An adapter two instances serve
    from two paths keeps the path of the one still there."""
    from dlmix.router.tokenize import lora_of

    r = _router(policy="prefix")
    reg = r.registry
    lay = _layout()
    r.register({"url": "http://127.0.0.1:9301", "id": "a", "role": "decode", "model": "base", "kv_layout": lay,
                "lora_adapters": {"sql": "/l/sql"}})
    r.register({"url": "http://127.0.0.1:9302", "id": "b", "role": "decode", "model": "base", "kv_layout": lay,
                "lora_adapters": {"sql": "/l/sql-v2", "chat": "/l/chat"}})
    assert reg.loras == {"sql": "/l/sql-v2", "chat": "/l/chat"} and len(reg._layouts) == 1
    assert r.remove("b")
    assert reg.loras == {"sql": "/l/sql"} and len(reg._layouts) == 1
    assert lora_of("chat", reg.loras, reg.model_names) == ("chat", None)  # nobody serves it: no path
    r.register({"url": "http://127.0.0.1:9301", "id": "a", "role": "decode", "model": "base", "kv_layout": lay})
    assert reg.loras == {} and len(reg._layouts) == 1  # re-registered without adapters
    assert r.remove("a")
    assert reg.loras == {} and reg._layouts == {} and reg._lora_refs == {} and reg._layout_refs == {}


# ---------------------------------------------------------------------------------------------- prefix keys
@pytest.mark.parametrize("tokenizer", [None, "bytes"])
@pytest.mark.parametrize("chat", [False, True])
def test_cache_salt_and_lora_in_every_prefix_key(tokenizer, chat):
    from dlmix.routing.policies import ClusterView
    from dlmix.routing.state import Decision

    r = _router(policy="prefix", tokenizer=tokenizer)
    r.register({"url": "http://127.0.0.1:9201", "id": "a", "model": "base", "lora_adapters": {"sql": "/l/sql"}})
    inst = r.instances[0]
    assert inst.model == ("base", "sql")  # an adapter is served under its name
    text = "a long shared document about nothing in particular. " * 12

    def rr(**kw):
        body = {"model": "base", **kw}
        body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
        return r._request_from(body, chat)

    def hits(req):
        return ClusterView(r.instances, r.index, r.cost, r.approx).hit_tokens(req, inst)

    seen = rr(cache_salt="tenant-a")
    r.approx.record_decision(seen, Decision(decode=inst))
    assert hits(rr(cache_salt="tenant-a")) > 0.9 * seen.prompt_len  # same salt: a hit
    assert hits(rr(cache_salt="tenant-b")) == 0                       # another salt: none
    assert hits(rr()) == 0                                            # no salt: none
    assert hits(rr(cache_salt="tenant-a", model="sql")) == 0          # a LoRA adapter: none
    other = rr(model="sql")
    r.approx.record_decision(other, Decision(decode=inst))
    assert hits(rr(model="sql")) > 0 and hits(rr(model="other-adapter")) == 0 and hits(rr()) == 0


# ---------------------------------------------------------------------------------------------- loops
def test_routers_registered_in_each_other_loop_once_then_leave_rotation():
    """A and B each registered as the other's instance (different ports: no address check can see it). A request
    comes back to A once, marked by A's x-dlmix-via header, and is refused with 508 instead of circling; the next
    health checks see a dlmix router's /health and take both out of rotation."""
    lt = LoopThread()
    try:
        a = Router(RouterConfig(port=0, policy="round_robin", health_interval_s=3600, retries=0))
        b = Router(RouterConfig(port=0, policy="round_robin", health_interval_s=3600, retries=0))
        lt.run(a.start())
        lt.run(b.start())
        ua, ub = f"http://127.0.0.1:{a.cfg.port}", f"http://127.0.0.1:{b.cfg.port}"
        assert httpx.post(ua + "/admin/instances", json={"url": ub, "id": "B"}).status_code == 201
        assert httpx.post(ub + "/admin/instances", json={"url": ua, "id": "A"}).status_code == 201
        body = {"model": "m", "prompt": "hello", "max_tokens": 1}
        for _ in range(2):
            res = httpx.post(ua + "/v1/completions", json=body, timeout=20)
            assert res.status_code == 508 and "routing loop" in res.json()["error"]["message"], res.text
        assert httpx.post(ua + "/v1/completions", json=body, headers={"x-dlmix-via": a.router_id}).status_code == 508
        lt.run(a.registry.check(a.rt["B"]))
        lt.run(b.registry.check(b.rt["A"]))
        assert not a.rt["B"].state.healthy and "another dlmix router" in a.rt["B"].loop
        assert not b.rt["A"].state.healthy
        listed = httpx.get(ua + "/admin/instances").json()["instances"][0]
        assert listed["loop"].startswith("another dlmix router") and listed["healthy"] is False
        assert httpx.post(ua + "/v1/completions", json=body).status_code == 503  # out of rotation: nothing to loop
        for r in (a, b):
            lt.run(r.stop())
    finally:
        lt.close()


class _EqCounter(bytes):
    used_eq = 0

    def __eq__(self, other):
        _EqCounter.used_eq += 1
        return bytes.__eq__(self, other)

    __hash__ = bytes.__hash__


def _auth_req(value):
    from types import SimpleNamespace

    return SimpleNamespace(header=lambda name: value if name == b"authorization" else None)


def test_admin_key_is_compared_in_constant_time():
    """The admin key check never uses ``==`` (which stops at the first differing byte: a timing oracle); it uses
    ``hmac.compare_digest``. A header value that counts ``__eq__`` calls shows it; no time is measured."""
    from types import SimpleNamespace

    from dlmix.router.admin import AdminAPI

    api = AdminAPI(registry=SimpleNamespace(backends={}), admin_key="s3cret")
    conn = SimpleNamespace(peer=("10.0.0.9", 1234))
    _EqCounter.used_eq = 0
    assert api.allowed(conn, _auth_req(_EqCounter(b"Bearer s3creX"))) is False
    assert api.key_ok(_auth_req(_EqCounter(b"Bearer s3creX"))) is False
    assert api.allowed(conn, _auth_req(_EqCounter(b"Bearer s3cret"))) is True
    assert api.key_ok(_auth_req(_EqCounter(b"Bearer s3cret"))) is True
    assert api.allowed(conn, _auth_req(None)) is False and api.key_ok(_auth_req(None)) is False
    assert _EqCounter.used_eq == 0, f"admin key compared with == ({_EqCounter.used_eq} times), not hmac.compare_digest"


# ---- review 4: other spellings of a loopback address passed the self-registration check (the README: "any loopback
# form (127.x, ::1, localhost) when it listens on loopback or on all addresses"): 127.0.0.2, 127.1, 2130706433,
# 0x7f000001, ::ffff:127.0.0.1, localhost. were registered (201) and the router forwarded to itself
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_every_loopback_spelling_of_the_router_itself_is_refused(host):
    r = _router(host=host, port=18999, allow_open=True)
    for url in ["http://127.0.0.2:18999", "http://127.1:18999", "http://2130706433:18999",
                "http://0x7f000001:18999", "http://[::ffff:127.0.0.1]:18999", "http://localhost.:18999",
                "http://0:18999", "http://[::]:18999"]:
        status, out = call(r, "POST", "/admin/instances", {"url": url})
        assert status == 400 and "own listening address" in out["error"]["message"], (url, out)
    assert r.instances == []
    for url in ["http://127.1:18998", "http://10.1.2.3:18999", "http://deadbeef:18999"]:  # other port / host
        assert call(r, "POST", "/admin/instances", {"url": url})[0] == 201, url


def test_loopback_spellings_are_not_self_for_a_router_on_another_address():
    r = _router(host="10.9.8.7", port=18999, allow_open=True)
    assert call(r, "POST", "/admin/instances", {"url": "http://127.1:18999"})[0] == 201
    status, out = call(r, "POST", "/admin/instances", {"url": "http://[::ffff:10.9.8.7]:18999"})
    assert status == 400 and "own listening address" in out["error"]["message"], out


# ---- review 4: heartbeat_ttl_s had no upper bound. With router replicas, 1e308 was written to etcd, then etcd
# refused the lease grant: the client got 503 "etcd is unavailable" while the instance stayed registered on every
# replica (for good: no lease). The schema now bounds it by etcd's longest lease (9e9 s): a 400 naming the field.
@pytest.mark.parametrize("ttl", [1e308, 9.5e9])
def test_heartbeat_ttl_beyond_etcds_longest_lease_is_400(ttl):
    r = _router()
    status, out = call(r, "POST", "/admin/instances", dict(GOOD, heartbeat_ttl_s=ttl))
    assert status == 400 and "heartbeat_ttl_s" in out["error"]["message"], out
    assert r.instances == []
    assert call(r, "POST", "/admin/instances", dict(GOOD, heartbeat_ttl_s=9e9))[0] == 201


# ---- review 4: an unknown transport link ({"link": "nope"}, a typo such as "rdma-100G") was accepted and priced as
# the default link without a word anywhere (the warning the registry recorded was never shown), and {"link": 5} gave
# "bad transport: argument of type 'int' is not iterable"
def test_unknown_transport_link_is_shown_and_a_non_string_link_is_400_naming_it():
    r = _router()
    assert call(r, "POST", "/admin/instances", dict(GOOD, transport={"link": "rdma-100G"}))[0] == 201
    status, out = call(r, "GET", "/admin/instances")
    (inst,) = out["instances"]
    assert "unknown link 'rdma-100G'" in inst.get("transport_warning", ""), inst
    status, out = call(r, "POST", "/admin/instances", dict(GOOD, url="http://127.0.0.1:9102", id="p1",
                                                           transport={"link": 5}))
    assert status == 400 and "transport link must be a link name" in out["error"]["message"], out
    assert call(r, "POST", "/admin/instances", dict(GOOD, url="http://127.0.0.1:9103", id="p2",
                                                    transport={"link": "rdma-100g"}))[0] == 201
    status, out = call(r, "GET", "/admin/instances")
    assert "transport_warning" not in [i for i in out["instances"] if i["id"] == "p2"][0]
