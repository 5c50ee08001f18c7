"""The router's parts on their own: route tables, the PD orchestrator's policy-driven prefill retry, the admin API's
id handling, engine-neutral KV events, the error hierarchy."""
from __future__ import annotations

import urllib.parse

import httpx
import pytest

from dlmix.router.config import RouterConfig
from dlmix.router.orchestrator import PDOrchestrator
from dlmix.router.routes import Route, RouteTable
from dlmix.router.server import Router
from dlmix.routing.policies import ClusterView, begin
from dlmix.routing.policies.base import Policy
from dlmix.routing.state import Decision, InstanceState, RouteRequest
from dlmix.testing import LoopThread
from dlmix.testing.mock_engine import MockEngine


@pytest.fixture(scope="module")
def lt():
    t = LoopThread()
    yield t
    t.close()


def test_route_table_matches_methods_params_and_answers_404_405():
    def h():
        return None

    t = RouteTable([Route("GET", "/a", h), Route("POST", "/a", h), Route("POST", "/x/{id:path}/beat", h),
                    Route("GET", "/x/{id:path}", h), Route("DELETE", "/y/{name}", h)])
    assert t.match(b"GET", b"/a")[0].method == b"GET"
    assert t.match(b"PUT", b"/a") == (None, {"allow": ["GET", "POST"]}, 405)
    r, p, s = t.match(b"POST", b"/x/http%3A%2F%2Fh%3A1/beat")
    assert r.pattern == "/x/{id:path}/beat" and p == {"id": "http://h:1"} and s == 0
    assert t.match(b"GET", b"/x/a/b/c")[1] == {"id": "a/b/c"}
    assert t.match(b"DELETE", b"/y/one")[1] == {"name": "one"}
    assert t.match(b"DELETE", b"/y/one/two") == (None, {}, 404)
    assert t.match(b"GET", b"/nope") == (None, {}, 404)
    with pytest.raises(ValueError, match="bad route pattern"):
        Route("GET", "/a/{bad", h)


class _PickLastPrefill(Policy):
    """Test policy: records the instances it was asked about; PD with the prefill-role instance of highest id."""

    name = "pick_last"

    def __init__(self):
        self.seen = []

    def choose(self, req, view):
        self.seen.append(sorted(i.id for i in view.instances))
        d = view.decode_candidates(req)[0]
        p = max(view.prefill_candidates(req), key=lambda i: i.id, default=None)
        return Decision(decode=d, prefill=p, hit_tokens=32 if p else 0, reason="test")


def _inst(iid, role):
    return InstanceState(id=iid, url=f"http://127.0.0.1:{len(iid)}", role=role)


def test_failed_prefill_is_replaced_by_the_policy_and_load_moves_with_it():
    p1, p2, p3, d = _inst("p1", "prefill"), _inst("p2", "prefill"), _inst("p3", "prefill"), _inst("d", "decode")

    class Reg:
        instances = [p1, p2, p3, d]

    pol = _PickLastPrefill()
    orch = PDOrchestrator(Reg(), pol, RouterConfig(), None, lambda insts: ClusterView(insts))
    rr = RouteRequest(prompt_len=100)
    dec = Decision(decode=d, prefill=p1, hit_tokens=0)
    begin(dec, rr)
    assert p1.load.inflight == 1 and p1.load.inflight_prefill_tokens == 100
    alt = orch.replace(rr, dec, {"p1"})
    assert pol.seen == [["d", "p2", "p3"]]  # the untried prefill instances and the decode instance
    assert alt.prefill is p3
    orch.move(dec, rr, alt.prefill, alt.hit_tokens, alt.predicted_ttft)
    assert dec.prefill is p3 and dec.hit_tokens == 32
    assert (p1.load.inflight, p1.load.inflight_prefill_tokens) == (0, 0)
    assert (p3.load.inflight, p3.load.inflight_prefill_tokens) == (1, 100 - 32)
    # a policy that keeps the prefill on D (no prefill instance) means a local prefill
    assert orch.replace(rr, dec, {"p1", "p2", "p3"}) is None
    orch.move(dec, rr, None)
    assert dec.prefill is None and p3.load.inflight == 0 and d.load.inflight_prefill_tokens == 100 - 32


def test_router_retries_a_failing_prefill_on_the_policys_choice(lt):
    p1, p2, d = MockEngine(name="p1", role="prefill"), MockEngine(name="p2", role="prefill"), MockEngine(name="d")
    for e in (p1, p2, d):
        lt.run(e.start())
    p1.fail_status = 503
    insts = [{"url": e.url, "id": e.name, "model": "mock", "role": r}
             for e, r in ((p1, "prefill"), (p2, "prefill"), (d, "decode"))]
    router = Router(RouterConfig(port=0, policy="round_robin", instances=insts, health_interval_s=60))
    first = [True]

    class FirstP1(_PickLastPrefill):
        def choose(self, req, view):
            dec = super().choose(req, view)
            if first[0]:  # the first placement goes to p1, which fails
                first[0] = False
                return Decision(decode=dec.decode, prefill=router.rt["p1"].state, reason="test")
            return dec

    router.policy = router.pd.policy = pol = FirstP1()
    lt.run(router.start())
    try:
        body = {"model": "mock", "prompt": "hello there " * 10, "max_tokens": 3}
        r = httpx.post(f"http://127.0.0.1:{router.cfg.port}/v1/completions", json=body, timeout=10)
        direct = httpx.post(d.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 200 and r.json() == direct.json()
        assert p1.requests == 1 and p2.prefill_legs == 1
        assert pol.seen[-1] == ["d", "p2"]  # the retry was the policy's choice among untried instances
        assert d.remote_prefills[0]["remote_engine_id"] == "p2"
        reg = router.metrics.registry
        assert reg.get_sample_value("dlmix_router_retries_total", {"kind": "prefill"}) == 1
        assert all(i.load.inflight == 0 and i.load.inflight_prefill_tokens == 0 for i in router.instances)
    finally:
        lt.run(router.stop())
        for e in (p1, p2, d):
            lt.run(e.stop())


def test_admin_api_ids_with_slashes_and_method_errors(lt):
    e = MockEngine(name="a")
    lt.run(e.start())
    router = Router(RouterConfig(port=0, policy="round_robin", admin_key="k", health_interval_s=60))
    lt.run(router.start())
    base, auth = f"http://127.0.0.1:{router.cfg.port}", {"Authorization": "Bearer k"}
    try:
        r = httpx.post(base + "/admin/instances", json={"url": e.url, "model": "mock"}, headers=auth)
        assert r.status_code == 201 and r.json()["id"] == e.url  # the default id is the url
        quoted = urllib.parse.quote(e.url, safe="")
        got = httpx.get(f"{base}/admin/instances/{quoted}", headers=auth)
        assert got.status_code == 200 and got.json()["url"] == e.url
        assert httpx.post(f"{base}/admin/instances/{quoted}/drain", headers=auth).json() == {"draining": True}
        assert router.instances[0].draining
        # the engine restarts and registers again: the operator's drain stays (before, it was undone)
        r = httpx.post(base + "/admin/instances", json={"url": e.url, "model": "mock"}, headers=auth)
        assert r.status_code == 201 and router.instances[0].draining
        h = httpx.get(base + "/health")  # says why nothing can serve
        assert (h.status_code, h.json()["status"]) == (503, "every healthy instance is draining")
        assert httpx.post(f"{base}/admin/instances/{quoted}/heartbeat", json={"waiting": "x"},
                          headers=auth).status_code == 400
        r = httpx.put(base + "/admin/instances", headers=auth)
        assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
        assert r.json()["error"]["message"] == "method not allowed: PUT /admin/instances; use GET or POST"
        assert httpx.get(base + "/admin/nothing", headers=auth).status_code == 404
        assert httpx.get(base + "/admin/instances/nobody", headers=auth).status_code == 404
        assert httpx.get(base + "/admin/instances").status_code == 401
        assert httpx.delete(f"{base}/admin/instances/{quoted}", headers=auth).json() == {"removed": True}
        assert router.instances == []
        h = httpx.get(base + "/health")
        assert (h.status_code, h.json()["status"]) == (503, "no instance registered")
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi"})  # no model named: not "for model None"
        assert (r.status_code, r.json()["error"]["message"]) == (503, "no available instance"), r.text
        assert httpx.delete(base + "/health").status_code == 405
    finally:
        lt.run(router.stop())
        lt.run(e.stop())


def test_kv_events_engine_neutral_updates_and_decoder_registry():
    from dlmix.router import kv_events
    from dlmix.router.kv_events import vllm as ve
    from dlmix.routing.prefix_index import PrefixIndex

    batch = ve.KVEventBatch(ts=1.0, events=[
        ve.BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=list(range(48)), block_size=16,
                       medium="GPU"),
        ve.BlockStored(block_hashes=[9], parent_block_hash=3, token_ids=list(range(16)), block_size=16,
                       medium="CPU"),  # offloaded tier: not a prefix hit
        ve.BlockRemoved(block_hashes=[3], medium="GPU")])
    ups = kv_events.get_decoder("vllm").decode(ve.encode_batch(batch))
    assert ups == [kv_events.Stored([1, 2, 3]), kv_events.Removed([3])]
    ix = PrefixIndex()
    assert kv_events.apply(ix, 0, ups) == 2
    assert ix.match([1, 2, 3]) == {0: 2}
    with pytest.raises(ValueError, match="no KV-event decoder for engine 'tgi'; known: vllm, sglang, lmdeploy"):
        kv_events.get_decoder("tgi")


def test_one_error_hierarchy_keeps_the_old_classes_catchable():
    from dlmix import errors
    from dlmix.launch.config import ConfigError as LaunchConfigError
    from dlmix.router.config import ConfigError as RouterConfigError
    from dlmix.router.server import RegistrationError
    from dlmix.sim.config import ConfigError as SimConfigError

    for cls in (LaunchConfigError, RouterConfigError, SimConfigError):
        assert issubclass(cls, errors.ConfigError) and issubclass(cls, ValueError)
    assert issubclass(errors.ConfigError, errors.DlmixError) and issubclass(RegistrationError, errors.DlmixError)
    with pytest.raises(errors.ConfigError):
        RouterConfig.from_dict({"no_such_key": 1})


def test_a_client_gone_while_a_failed_bridged_leg_winds_down_leaves_no_unretrieved_exception(monkeypatch):
    """A bridged PD request whose prefill leg failed at once (connection refused) while the bridge still ran: the
    bridge is cancelled and awaited; the client going away during that wait must not leave the prefill leg's
    BackendError unretrieved ("Task exception was never retrieved" in the router's log)."""
    import asyncio
    import gc
    from types import SimpleNamespace

    import dlmix.router.orchestrator as orch_mod
    from dlmix.router.proxy import BackendError

    state = {}

    async def fail_request(pool, raw, *a, **kw):
        raise BackendError("cannot connect to backend p: ConnectionRefusedError")

    async def slow_bridge(purl, durl, kvp, rbody, rooms=None):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            state["unwinding"].set()
            await asyncio.sleep(0.2)  # an HTTP call being torn down
            raise

    monkeypatch.setattr(orch_mod, "request", fail_request)
    monkeypatch.setattr(orch_mod, "get_bridge", lambda a, b: slow_bridge)
    eng_p = SimpleNamespace(PD_FLOW="concurrent", NAME="sglang", handoff=lambda h, port: {"room": 1},
                            prefill_body=lambda d, chat, kvp: b"{}")
    eng_d = SimpleNamespace(PD_FLOW="sequential", NAME="vllm")
    p, d = InstanceState(id="p", url="http://127.0.0.1:1", role="prefill"), \
        InstanceState(id="d", url="http://127.0.0.1:2", role="decode")
    pb = SimpleNamespace(engine=eng_p, bootstrap=("127.0.0.1", 3), hostport=b"h", auth=b"", pool=None, state=p)
    db = SimpleNamespace(engine=eng_d, state=d)

    class Reg:
        backends = {"p": pb, "d": db}
        instances = [p, d]

        def fail(self, *a):
            pass

    o = PDOrchestrator(Reg(), None, RouterConfig(), None, lambda insts: None)
    conn = SimpleNamespace(closed=False)
    req = SimpleNamespace(url=b"/v1/completions")
    errors = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda l, ctx: errors.append(ctx.get("message")))
        state["unwinding"] = asyncio.Event()
        t = asyncio.ensure_future(o.bridged(conn, req, {}, RouteRequest(prompt_len=4),
                                            Decision(decode=d, prefill=p), False, b""))
        await state["unwinding"].wait()
        conn.closed = True
        t.cancel()  # the client went away
        try:
            await t
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.3)
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    assert not [e for e in errors if "never retrieved" in (e or "")], errors
