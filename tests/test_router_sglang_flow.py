"""The router's SGLang PD flow against mock SGLang engines (:mod:`dlmix.testing.mock_engine`, ``engine="sglang"``):
both legs at once with one bootstrap room, answers identical to a single engine, a failed leg cancels the other,
a failed prefill is placed again by the policy, registration checks. The same flow on real SGLang servers is in
``tests/test_sglang_pd.py``."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from dlmix.router.config import RouterConfig
from dlmix.router.engines import sglang as sg
from dlmix.router.server import Router
from dlmix.testing import LoopThread, poll
from dlmix.testing.mock_engine import MockEngine

BODY = {"model": "mock", "prompt": "The quick brown fox jumps over the lazy dog. " * 20, "max_tokens": 7,
        "temperature": 0.0, "my_unknown_field": {"nested": [1, 2.5, None, "x"]}}
CHAT = {"model": "mock", "messages": [{"role": "system", "content": "You are terse. " * 30},
                                      {"role": "user", "content": "Say hi."}], "max_tokens": 6}
#: the PD placements of the ``cost`` policy on every request (no local prefill)
PD = {"policy": "cost", "policy_params": {"local_max_uncached": 0}, "model_spec": "llama-3.1-8b"}


@pytest.fixture(scope="module")
def lt():
    t = LoopThread()
    yield t
    t.close()


class Cluster:
    """Mock SGLang prefill/decode engines behind a router (plus a plain reference engine, not registered); ``both``:
    engines registered with role ``both`` (an SGLang server without a disaggregation mode)."""

    def __init__(self, lt, prefills, decodes, both=(), **cfg):
        self.lt = lt
        self.ref = MockEngine(name="ref")
        self.engines = [*prefills, *decodes, *both, self.ref]
        for e in self.engines:
            lt.run(e.start())
        insts = [{"url": e.url, "model": "mock", "role": "prefill", "id": e.name, "chip": "H100", "engine": "sglang",
                  "bootstrap_port": e.bootstrap_port} for e in prefills]
        insts += [{"url": e.url, "model": "mock", "role": "decode", "id": e.name, "chip": "H20", "engine": "sglang"}
                  for e in decodes]
        insts += [{"url": e.url, "model": "mock", "role": "both", "id": e.name, "chip": "H20", "engine": "sglang"}
                  for e in both]
        cfg.setdefault("health_interval_s", 0.2)
        self.cfg = RouterConfig(port=0, instances=insts, **cfg)
        self.router = Router(self.cfg)
        lt.run(self.router.start())
        self.base = f"http://127.0.0.1:{self.cfg.port}"

    def close(self):
        self.lt.run(self.router.stop())
        for e in self.engines:
            self.lt.run(e.stop())


def _sse(text: str):
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]


def _prefill(name="p", port=7001, **kw):
    return MockEngine(name=name, role="prefill", engine="sglang", bootstrap_port=port, **kw)


def _decode(name="d", **kw):
    return MockEngine(name=name, role="decode", engine="sglang", **kw)


def test_adapter_bodies():
    kvp = sg.handoff("10.0.0.7", 8998, room=42)
    assert kvp == {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 42}
    assert 0 <= sg.handoff("h", 1)["bootstrap_room"] < 2 ** 63
    raw = b'{"model": "m", "prompt": "hi", "stream": true}'
    assert json.loads(sg.decode_body(raw, kvp)) == {"model": "m", "prompt": "hi", "stream": True, **kvp}
    assert json.loads(sg.decode_body(b"{}", kvp)) == kvp
    # a client's own bootstrap fields are replaced, not duplicated
    spoof = b'{"prompt": "x", "bootstrap_room": 1, "bootstrap_host": "evil"}'
    assert json.loads(sg.decode_body(spoof, kvp)) == {"prompt": "x", **kvp}
    with pytest.raises(ValueError):
        sg.decode_body(b"[1, 2]", kvp)
    p = json.loads(sg.prefill_body({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
                                   False, kvp))
    assert p == {"prompt": "x", "stream": False, **kvp}
    with pytest.raises(ValueError):
        sg.prefill_body({"prompt": "x"}, False, None)


def test_both_legs_at_once_with_one_room_and_identical_answers(lt):
    p, d = _prefill(ttft=0.02), _decode()
    c = Cluster(lt, [p], [d], **PD)
    try:
        with httpx.Client(timeout=30) as h:
            for path, base in (("/v1/completions", BODY), ("/v1/chat/completions", CHAT)):
                for stream in (False, True):
                    body = dict(base, stream=stream)
                    via = h.post(c.base + path, json=body)
                    direct = h.post(c.ref.url + path, json=body)
                    assert via.status_code == 200, via.text
                    if stream:
                        assert _sse(via.text) == _sse(direct.text)
                    else:
                        assert via.json() == direct.json()
        assert p.prefill_legs == 4 and len(d.rooms) == 4
        assert p.rooms == d.rooms  # the same room on both legs, each request its own
        assert len({r[2] for r in d.rooms}) == 4 and all(r[:2] == ("127.0.0.1", 7001) for r in d.rooms)
        leg, dec = json.loads(p.received[-1]), json.loads(d.received[-1])
        room = {k: dec.pop(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
        assert dec == dict(CHAT, stream=True)  # the client's request plus the hand-off, nothing else changed
        assert leg == dict(CHAT, stream=False, **room)
    finally:
        c.close()


def test_pd_metrics_count_the_concurrent_flow(lt):
    """The KV-bytes estimate and the decode-side prefix hits are counted for SGLang's flow as for vLLM's."""
    p, d = _prefill(), _decode()
    c = Cluster(lt, [p], [d], **PD)
    try:
        reg = c.router.metrics.registry

        def est():
            return reg.get_sample_value("dlmix_router_kv_bytes_estimated_total") or 0.0

        def hits():
            return reg.get_sample_value("dlmix_router_decode_prefix_hit_tokens_total", {"instance": "d"}) or 0.0

        per_token = c.router.cost.kv_bytes(1)
        with httpx.Client(timeout=30) as h:
            assert h.post(c.base + "/v1/completions", json=BODY).status_code == 200
            first = est()  # nothing cached anywhere: the whole prompt moves
            assert first > 0 and hits() == 0
            n = first / per_token
            # the same prompt again: the decode instance holds its prefix, only the rest is estimated to move
            assert h.post(c.base + "/v1/completions", json=BODY).status_code == 200
        assert p.prefill_legs == 2
        assert 0 < hits() <= n
        assert est() - first == c.router.cost.kv_bytes(n - hits())
    finally:
        c.close()


def test_legs_run_concurrently(lt):
    """The decode leg is sent while the prefill leg is still running (SGLang's decode pre-allocates and waits)."""
    p, d = _prefill(ttft=3.0), _decode()
    c = Cluster(lt, [p], [d], **PD)
    try:
        seen = []

        async def run():
            async with httpx.AsyncClient(timeout=30) as h:
                t = asyncio.ensure_future(h.post(c.base + "/v1/completions", json=BODY))
                deadline = time.monotonic() + 20
                while not d.rooms and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                seen.append((len(d.rooms), p.inflight, p.prefill_legs))
                return await t
        r = lt.run(run(), 60)
        assert r.status_code == 200
        assert seen == [(1, 1, 0)]  # D had the request while P was still prefilling
    finally:
        c.close()


def test_failed_prefill_cancels_the_decode_leg_and_is_placed_again(lt):
    slow, good, d = _prefill("slow", 7001, ttft=30.0), _prefill("good", 7002), _decode(bootstrap_timeout=30.0)
    c = Cluster(lt, [slow, good], [d], prefill_timeout_s=0.5, breaker_failures=1000, **PD)
    try:
        with httpx.Client(timeout=60) as h:
            for i in range(6):
                body = dict(BODY, prompt=f"{i} " + BODY["prompt"])
                r = h.post(c.base + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json() == h.post(c.ref.url + "/v1/completions", json=body).json()
        assert slow.requests >= 1  # the policy did place some on the hanging prefill
        assert poll(lambda: slow.cancelled == slow.requests and d.cancelled == slow.requests, 10)
        assert good.prefill_legs == 6 and d.requests == 6 + slow.requests
        retries = c.router.metrics.registry.get_sample_value("dlmix_router_retries_total", {"kind": "prefill"})
        assert retries == slow.requests
        # the cancelled legs' bookkeeping runs in their own tasks, which may end just after the client's answer
        assert poll(lambda: all(i.load.inflight == 0 for i in c.router.instances), 10), \
            [(i.id, i.load.inflight) for i in c.router.instances]
    finally:
        c.close()


def test_no_prefill_left_is_a_502_and_cancels_the_decode_leg(lt):
    p, d = _prefill(ttft=30.0), _decode()
    c = Cluster(lt, [p], [d], prefill_timeout_s=0.3, retries=0, **PD)
    try:
        with httpx.Client(timeout=60) as h:
            r = h.post(c.base + "/v1/completions", json=BODY)
        assert r.status_code == 502 and "no prefill instance could serve" in r.json()["error"]["message"], r.text
        assert poll(lambda: d.cancelled == 1 and p.cancelled == 1, 10)
        assert d.inflight == 0 and p.inflight == 0
    finally:
        c.close()


def test_failed_decode_cancels_the_prefill_leg(lt):
    p, d = _prefill(ttft=30.0), _decode()
    d.fail_status = 503
    c = Cluster(lt, [p], [d], **PD)
    try:
        with httpx.Client(timeout=60) as h:
            r = h.post(c.base + "/v1/completions", json=BODY)
        assert r.status_code == 503  # the decode instance's answer, as it sent it
        assert poll(lambda: p.cancelled == 1, 10)
        assert p.prefill_legs == 0 and p.inflight == 0
    finally:
        c.close()


def test_client_disconnect_cancels_both_legs(lt):
    p, d = _prefill(ttft=30.0), _decode()
    c = Cluster(lt, [p], [d], **PD)
    try:
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(timeout=httpx.Timeout(10, read=0.5)) as h:
                h.post(c.base + "/v1/completions", json=dict(BODY, stream=True))
        assert poll(lambda: p.cancelled == 1 and d.cancelled == 1, 10)
        assert poll(lambda: all(i.load.inflight == 0 for i in c.router.instances), 10)
    finally:
        c.close()


def test_prefill_4xx_reaches_the_client_and_cancels_the_decode_leg(lt):
    p, d = _prefill(), _decode(bootstrap_timeout=30.0)
    p.fail_status = 422
    c = Cluster(lt, [p], [d], **PD)
    try:
        with httpx.Client(timeout=30) as h:
            r = h.post(c.base + "/v1/completions", json=BODY)
        assert r.status_code == 422 and r.json()["error"]["message"] == "mock failure"
        # the decode leg was cancelled (or never reached D: P's 422 can come first)
        assert poll(lambda: d.cancelled == d.requests and d.inflight == 0 and not d.prefill_legs, 10)
        assert d.requests <= 1
    finally:
        c.close()


def test_an_sglang_server_without_disaggregation_serves_whole_requests(lt):
    """A ``both``-role SGLang instance (no ``--disaggregation-mode``) is never a decode leg: the cost policy pairs it
    with the prefill instance (every request disaggregated, ``local_max_uncached`` 0), the router serves the request
    on it alone, and the prefill instance gets no leg that would wait for a decode."""
    p, s = _prefill(), MockEngine(name="s", engine="sglang")
    c = Cluster(lt, [p], [], both=[s], **PD)
    try:
        with httpx.Client(timeout=30) as h:
            for stream in (False, True):
                body = dict(BODY, stream=stream)
                via = h.post(c.base + "/v1/completions", json=body)
                direct = h.post(c.ref.url + "/v1/completions", json=body)
                assert via.status_code == 200, via.text
                assert (_sse(via.text) == _sse(direct.text)) if stream else (via.json() == direct.json())
        assert (p.requests, s.requests, s.rooms) == (0, 2, [])
        assert json.loads(s.received[-1]) == dict(BODY, stream=True)  # no bootstrap fields added
        # the prefill instance's share of the placement was taken back: no load left on any instance
        assert poll(lambda: all(i.load.inflight == 0 and i.load.inflight_prefill_tokens == 0
                                for i in c.router.instances), 10)
    finally:
        c.close()


def test_registration_checks(lt):
    d = _decode()
    c = Cluster(lt, [], [d])
    try:
        with httpx.Client(timeout=30) as h:
            # a decode-only SGLang instance cannot serve a request alone
            r = h.post(c.base + "/v1/completions", json=BODY)
            assert r.status_code == 503 and "no prefill instance available" in r.json()["error"]["message"], r.text
            assert d.requests == 0
            adm = c.base + "/admin/instances"
            r = h.post(adm, json={"url": "http://127.0.0.1:9", "role": "prefill", "engine": "sglang", "model": "mock"})
            assert r.status_code == 400 and "bootstrap_port" in r.json()["error"]["message"]
            r = h.post(adm, json={"url": "http://127.0.0.1:9", "role": "prefill", "engine": "sglang", "model": "mock",
                                  "bootstrap_port": 70000})
            assert r.status_code == 400 and "bootstrap_port" in r.json()["error"]["message"]
            # a pair of engines no flow or bridge joins is refused with the reason (every pair of the three engines
            # has one now: take the vLLM -> SGLang bridge away)
            from dlmix.router.engines import bridges

            saved = bridges.BRIDGES.pop(("vllm", "sglang"))
            try:
                r = h.post(adm, json={"url": "http://127.0.0.1:9", "role": "prefill", "engine": "vllm",
                                      "model": "mock"})
            finally:
                bridges.BRIDGES[("vllm", "sglang")] = saved
            assert r.status_code == 409, r.text
            assert any("PD flow" in x for x in r.json()["error"]["reasons"]), r.text
            assert [i["id"] for i in h.get(adm).json()["instances"]] == ["d"]
            r = h.post(adm, json={"url": "http://127.0.0.1:9", "role": "prefill", "engine": "vllm", "model": "mock"})
            assert r.status_code == 201, r.text  # with the bridge: the router's rooms (dlmix.router.rooms)
    finally:
        c.close()


class _HandoffStandIn:
    """The ``POST /dlmix/handoff`` route of an SGLang prefill's bootstrap server (``plugins/sglang/handoff.py``):
    answers each room after ``delay`` s with transfer parameters naming the room (``status`` other than 200: that
    status and a reason, as for a room the prefill failed)."""

    def __init__(self, delay: float = 0.2, status: int = 200):
        from dlmix.kv import KVLayout, ModelIdentity
        from dlmix.pd.contract import TransferParams
        from dlmix.testing import JsonStandIn

        lay = KVLayout(model=ModelIdentity("LlamaForCausalLM", 2, 2, 16, "gqa"), block_size=16, dtype="fp32",
                       arrangement="sglang_nhd")
        tr = {"kind": "tcp", "proto": "dlmix-kv/1", "name": "sglang-p", "host": "127.0.0.1", "port": 1, "regions": {}}

        def route(method, path, body):
            time.sleep(delay)
            if status != 200:
                return status, {"error": f"the SGLang prefill failed room {body['room']}: test"}
            p = TransferParams.make(engine="sglang", instance_id="sglang-1", transports=[tr],
                                    request_id=str(body["room"]), block_ids=[0, 1], num_tokens=20, layout=lay)
            return 200, {"params": p.to_dict(), "first_token_id": 9}

        self.s = JsonStandIn(route)
        self.port = int(self.s.url.rsplit(":", 1)[1])

    def close(self):
        self.s.close()


@contextlib.contextmanager
def _bridged(lt, hand: _HandoffStandIn, ttft: float = 0.5, **cfg):
    """An SGLang prefill mock (its bootstrap port: ``hand``) and a vLLM decode mock behind a router; yields
    ``(prefill, decode, reference engine, router, router URL)`` and stops all of them (and ``hand``) afterwards."""
    p = MockEngine(name="p", role="prefill", engine="sglang", bootstrap_port=hand.port, ttft=ttft)
    d = MockEngine(name="d", role="decode", engine="vllm")
    ref = MockEngine(name="ref")
    for e in (p, d, ref):
        lt.run(e.start())
    insts = [{"url": p.url, "model": "mock", "role": "prefill", "id": "p", "chip": "H100", "engine": "sglang",
              "bootstrap_port": hand.port},
             {"url": d.url, "model": "mock", "role": "decode", "id": "d", "chip": "H20", "engine": "vllm"}]
    cfg = RouterConfig(port=0, instances=insts, health_interval_s=0.2, **{**PD, **cfg})
    router = Router(cfg)
    lt.run(router.start())
    try:
        yield p, d, ref, router, f"http://127.0.0.1:{cfg.port}"
    finally:
        lt.run(router.stop())
        for e in (p, d, ref):
            lt.run(e.stop())
        hand.close()


def test_an_sglang_prefill_feeds_a_vllm_decode_through_the_room_hand_off(lt):
    """SGLang prefill -> vLLM decode (:func:`dlmix.router.engines.bridges.sglang_to_vllm`): the prefill leg (with a
    room) and the hand-off request go out together; the decode leg carries the room's transfer parameters as
    ``kv_transfer_params`` before the prefill leg has answered; the client's answer is the decode's, unchanged."""
    hand = _HandoffStandIn()
    with _bridged(lt, hand) as (p, d, ref, router, base):
        with httpx.Client(timeout=30) as h:
            for stream in (False, True):
                body = dict(BODY, stream=stream)
                via = h.post(base + "/v1/completions", json=body)
                direct = h.post(ref.url + "/v1/completions", json=body)
                assert via.status_code == 200, via.text
                assert (_sse(via.text) == _sse(direct.text)) if stream else (via.json() == direct.json())
            # the prefill legs run on in the background (a real SGLang prefill answers once the decode has read
            # the KV)
            assert poll(lambda: p.prefill_legs == 2, 10)
        assert len(p.rooms) == 2 and len(d.remote_prefills) == 2
        for room, kvp in zip(p.rooms, d.remote_prefills):
            assert room[:2] == ("127.0.0.1", hand.port)
            assert kvp["do_remote_prefill"] is True and kvp["remote_request_id"] == str(room[2])
            assert kvp["remote_engine"] == "sglang" and kvp["contract_version"] == 1
        assert [c[1]["room"] for c in hand.s.calls] == [r[2] for r in p.rooms]
        # counted when the router has read the background leg's answer, which may come after the engine counted it
        assert poll(lambda: router.metrics.registry.get_sample_value(
            "dlmix_router_prefill_responses_total", {"instance": "p", "status": "2xx"}) == 2.0, 10)


def test_a_room_the_sglang_prefill_failed_is_computed_by_the_vllm_decode(lt):
    """The hand-off answers 502 (the prefill failed the room): the prefill leg is cancelled, the router places the
    prefill again and, with no other prefill instance, the vLLM decode computes the prompt itself (the client gets
    the full answer, no ``kv_transfer_params`` reach the decode)."""
    hand = _HandoffStandIn(delay=0.0, status=502)
    with _bridged(lt, hand) as (p, d, ref, router, base):
        with httpx.Client(timeout=30) as h:
            via = h.post(base + "/v1/completions", json=BODY)
            direct = h.post(ref.url + "/v1/completions", json=BODY)
        assert via.status_code == 200 and via.json() == direct.json(), via.text
        assert len(hand.s.calls) == 1 and d.remote_prefills == []
        assert poll(lambda: p.inflight == 0, 10)  # the cancelled prefill leg is gone
        assert router.metrics.registry.get_sample_value("dlmix_router_retries_total",
                                                        {"kind": "prefill_local"}) == 1.0


def test_an_sglang_prefill_leg_that_ends_before_its_hand_off_is_computed_by_the_vllm_decode(lt):
    """The prefill leg answers before the room's hand-off (a real SGLang prefill answers only after the decode read
    the KV, so it never held the room): the hand-off is cancelled and the vLLM decode computes the prompt itself."""
    hand = _HandoffStandIn(delay=3.0)
    with _bridged(lt, hand, ttft=0.0) as (p, d, ref, router, base):
        with httpx.Client(timeout=30) as h:
            via = h.post(base + "/v1/completions", json=BODY)
            direct = h.post(ref.url + "/v1/completions", json=BODY)
        assert via.status_code == 200 and via.json() == direct.json(), via.text
        assert p.prefill_legs == 1 and d.remote_prefills == []
        reg = router.metrics.registry
        assert reg.get_sample_value("dlmix_router_retries_total", {"kind": "prefill_local"}) == 1.0
        assert reg.get_sample_value("dlmix_router_prefill_responses_total", {"instance": "p", "status": "2xx"}) == 1.0


def test_a_client_gone_after_its_answer_leaves_the_background_prefill_leg_running(lt):
    """The client closes its connection as soon as it has the decode's answer, while the prefill leg still waits
    for the prefill's own (late) answer: that leg is not cancelled; it ends normally and is counted as a 2xx."""
    hand = _HandoffStandIn(delay=0.1)
    with _bridged(lt, hand, ttft=1.5) as (p, d, ref, router, base):
        with httpx.Client(timeout=30) as h:
            via = h.post(base + "/v1/completions", json=BODY)
        assert via.status_code == 200, via.text
        assert p.prefill_legs == 0  # the answer came before the prefill leg's end, and the client is gone
        assert poll(lambda: p.prefill_legs == 1, 10)
        assert p.cancelled == 0
        reg = router.metrics.registry
        assert poll(lambda: reg.get_sample_value("dlmix_router_prefill_responses_total",
                                                 {"instance": "p", "status": "2xx"}) == 1.0, 5)
        assert reg.get_sample_value("dlmix_router_prefill_responses_total", {"instance": "p", "status": "error"}) == 0


def test_a_client_gone_during_the_decode_leg_cancels_the_bridged_prefill_leg(lt):
    """The client goes away while the decode streams: the decode leg and the prefill leg (which still holds the
    room's KV) are both cancelled, and no load stays counted."""
    hand = _HandoffStandIn(delay=0.1)
    with _bridged(lt, hand, ttft=30.0) as (p, d, ref, router, base):
        d.itl = 3.0
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(timeout=httpx.Timeout(10, read=1.0)) as h:
                with h.stream("POST", base + "/v1/completions", json=dict(BODY, stream=True)) as r:
                    for _ in r.iter_bytes():
                        pass
        assert poll(lambda: p.cancelled == 1 and d.cancelled == 1, 10)
        assert len(d.remote_prefills) == 1
        assert poll(lambda: all(i.load.inflight == 0 for i in router.instances), 10)


def test_an_n2_request_prefills_one_sglang_room_for_the_vllm_decode(lt):
    """``n=2`` from an SGLang prefill to a vLLM decode: the prefill leg asks for one choice (for ``n=2`` SGLang would
    run a warm-up and two choices under the one room, handed off once, and the rest would wait for a decode until
    its timeout); the decode leg keeps the client's ``n`` and names 2 consumers of the one room's hold."""
    hand = _HandoffStandIn()
    with _bridged(lt, hand) as (p, d, ref, router, base):
        with httpx.Client(timeout=30) as h:
            r = h.post(base + "/v1/completions", json=dict(BODY, n=2))
            assert r.status_code == 200, r.text
            assert poll(lambda: p.prefill_legs == 1, 10)
        (leg,), (dec,) = p.bodies, d.bodies
        assert leg["n"] == 1 and leg["bootstrap_room"] == p.rooms[0][2]
        assert dec["n"] == 2 and dec["kv_transfer_params"]["dlmix_consumers"] == 2
        assert dec["kv_transfer_params"]["remote_request_id"] == str(p.rooms[0][2])
        assert [c[1]["room"] for c in hand.s.calls] == [p.rooms[0][2]]


# ------------------------------------------------------------------ n > 1 into an SGLang decode: one request per choice

def _by_index(events: list, chat: bool) -> dict:
    """Each choice's streamed text, by ``index``."""
    out: dict = {}
    for ev in events:
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
            out[ch["index"]] = out.get(ch["index"], "") + (piece or "")
    return out


def test_n3_into_an_sglang_decode_runs_one_room_per_choice_and_merges_the_answers(lt):
    """``n=3`` (completion and chat, not streamed): three requests of one choice, each with its own room on both legs
    (SGLang would run a warm-up and the three samples under one room), merged into one answer: the choices in order
    with ``index`` 0..2, each equal to the single engine's one choice, the prompt counted once and the completion
    tokens summed. The client's ``seed`` goes to choice ``i`` as ``seed + i``."""
    p, d = _prefill(), _decode()
    c = Cluster(lt, [p], [d], **PD)
    try:
        with httpx.Client(timeout=30) as h:
            for k, (path, base) in enumerate((("/v1/completions", BODY), ("/v1/chat/completions", CHAT))):
                via = h.post(c.base + path, json=dict(base, n=3, seed=40))
                one = h.post(c.ref.url + path, json=base).json()
                assert via.status_code == 200, via.text
                got = via.json()
                assert [ch["index"] for ch in got["choices"]] == [0, 1, 2]
                assert [{**ch, "index": 0} for ch in got["choices"]] == one["choices"] * 3
                u = one["usage"]
                assert got["usage"] == {"prompt_tokens": u["prompt_tokens"],
                                        "completion_tokens": 3 * u["completion_tokens"],
                                        "total_tokens": u["prompt_tokens"] + 3 * u["completion_tokens"]}
                assert {x: got[x] for x in ("id", "object", "model")} == {x: one[x] for x in ("id", "object", "model")}
                legs = [json.loads(b) for b in d.received[-3:]]
                assert sorted(leg["seed"] for leg in legs) == [40, 41, 42] and {leg["n"] for leg in legs} == {1}
                assert p.prefill_legs == 3 * (k + 1)
        assert len(d.rooms) == 6 and sorted(p.rooms) == sorted(d.rooms) and len({r[2] for r in d.rooms}) == 6
        assert poll(lambda: all(i.load.inflight == 0 for i in c.router.instances), 10)
    finally:
        c.close()


def test_n2_streamed_into_an_sglang_decode_is_one_stream_with_both_choices_and_one_usage(lt):
    """``n=2``, streamed, with ``stream_options.include_usage``: one event stream holding both choices' events
    (``index`` 0 and 1, each choice's text equal to the single engine's), one usage event (completion tokens of both
    choices), one ``[DONE]`` at the end."""
    p, d = _prefill(), _decode(itl=0.01)
    c = Cluster(lt, [p], [d], **PD)
    try:
        with httpx.Client(timeout=30) as h:
            for path, base, chat in (("/v1/completions", BODY, False), ("/v1/chat/completions", CHAT, True)):
                body = dict(base, stream=True, stream_options={"include_usage": True})
                via = h.post(c.base + path, json=dict(body, n=2))
                one = h.post(c.ref.url + path, json=body)
                assert via.status_code == 200 and via.headers["content-type"].startswith("text/event-stream")
                evs, ref = _sse(via.text), _sse(one.text)
                text = _by_index(ref, chat)[0]
                assert _by_index(evs, chat) == {0: text, 1: text}
                usage = [e for e in evs if not e["choices"]]
                assert len(usage) == 1 and evs[-1] is usage[0]
                u = ref[-1]["usage"]
                assert usage[0]["usage"]["completion_tokens"] == 2 * u["completion_tokens"]
                assert usage[0]["usage"]["prompt_tokens"] == u["prompt_tokens"]
                lines = [ln for ln in via.text.split("\n") if ln.startswith("data: ")]
                assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
        assert p.prefill_legs == 4 and len(d.rooms) == 4
    finally:
        c.close()


def test_n2_into_a_failing_sglang_decode_answers_its_error_once_and_cancels_the_legs(lt):
    """Every choice's decode answers 503: the client gets that answer once (status and body as the engine sent
    it), and no leg is left running."""
    p, d = _prefill(ttft=30.0), _decode()
    d.fail_status = 503
    c = Cluster(lt, [p], [d], retries=0, **PD)
    try:
        with httpx.Client(timeout=60) as h:
            r = h.post(c.base + "/v1/completions", json=dict(BODY, n=2))
        assert r.status_code == 503, r.text
        assert poll(lambda: p.inflight == 0 and d.inflight == 0, 10)
        assert p.prefill_legs == 0
        assert poll(lambda: all(i.load.inflight == 0 for i in c.router.instances), 10)
    finally:
        c.close()


def test_a_client_gone_cancels_every_choice(lt):
    p, d = _prefill(ttft=30.0), _decode()
    c = Cluster(lt, [p], [d], **PD)
    try:
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(timeout=httpx.Timeout(10, read=0.5)) as h:
                h.post(c.base + "/v1/completions", json=dict(BODY, n=3, stream=True))
        assert poll(lambda: p.cancelled == 3 and d.cancelled == 3, 10), (p.cancelled, d.cancelled)
        assert poll(lambda: all(i.load.inflight == 0 for i in c.router.instances), 10)
    finally:
        c.close()


def test_a_silent_decode_of_a_choice_is_timed_out_like_any_backend(lt):
    """A decode that sends nothing for ``backend_read_timeout_s``: the fanned-out request is answered 504 as a
    one-choice request would be, and no leg is left running."""
    p, d = _prefill(), _decode(ttft=30.0)
    c = Cluster(lt, [p], [d], backend_read_timeout_s=0.5, retries=0, **PD)
    try:
        with httpx.Client(timeout=60) as h:
            r = h.post(c.base + "/v1/completions", json=dict(BODY, n=2))
        assert r.status_code == 504, r.text
        assert poll(lambda: d.inflight == 0 and p.inflight == 0, 10)
        assert poll(lambda: all(i.load.inflight == 0 for i in c.router.instances), 10)
    finally:
        c.close()


def test_a_choice_that_fails_after_the_stream_started_ends_it_with_an_error_event(lt):
    """Streamed ``n=2`` whose decode falls silent after its first token (timed out by ``backend_read_timeout_s``):
    the stream has begun (200, the first tokens), so it ends with one ``error`` event and no ``[DONE]``; no leg is
    left running."""
    p, d = _prefill(), _decode(itl=5.0)
    c = Cluster(lt, [p], [d], backend_read_timeout_s=0.5, retries=0, **PD)
    try:
        with httpx.Client(timeout=60) as h:
            r = h.post(c.base + "/v1/completions", json=dict(BODY, n=2, stream=True))
        assert r.status_code == 200
        evs = _sse(r.text)
        assert {ch["index"] for e in evs for ch in e.get("choices") or []} <= {0, 1}
        assert "error" in evs[-1] and "cut off" in evs[-1]["error"]["message"], evs[-1]
        assert [e for e in evs if "error" in e] == [evs[-1]] and "[DONE]" not in r.text
        assert poll(lambda: d.inflight == 0 and p.inflight == 0, 10)
        assert poll(lambda: all(i.load.inflight == 0 for i in c.router.instances), 10)
    finally:
        c.close()


def test_n_beyond_the_fan_out_limit_is_400_before_any_leg():
    """A decode that takes one choice per request turns ``n`` into ``n`` requests of its own (two legs each): ``n``
    above :data:`dlmix.router.choices.MAX_FAN_OUT` (128, OpenAI's own limit on ``n``) is 400 naming it, and no leg
    starts (``n=2000`` became 4,000 backend requests before); ``n`` at the limit is served."""
    from dlmix.router.choices import MAX_FAN_OUT

    lt = LoopThread()
    p, d = _prefill(), _decode()
    c = Cluster(lt, [p], [d], **PD)
    try:
        with httpx.Client(timeout=60) as h:
            r = h.post(c.base + "/v1/completions", json=dict(BODY, n=MAX_FAN_OUT + 1))
            assert r.status_code == 400, r.text
            assert f"n must be at most {MAX_FAN_OUT}" in r.json()["error"]["message"]
            assert p.prefill_legs == 0 and not d.received
            ok = h.post(c.base + "/v1/completions", json=dict(BODY, n=MAX_FAN_OUT, max_tokens=1))
            assert ok.status_code == 200, ok.text
            assert len(ok.json()["choices"]) == MAX_FAN_OUT
        assert poll(lambda: all(i.load.inflight == 0 for i in c.router.instances), 30)
    finally:
        c.close()
        lt.close()


def test_a_decode_that_refuses_the_room_just_after_its_prefill_failed_answers_the_client_with_its_reason(lt):
    """A real SGLang decode that refuses the pair (a prefill of another model: "incompatible prefill/decode pair:
    decode has 30 layers, prefill 2 ...") aborts the room, the prefill answers 500 first, and the decode's 500 with the
    reasons follows within milliseconds. Before, the router cancelled the decode leg on the prefill's 5xx and the
    client got only "no prefill instance could serve the request (last: prefill instance ... answered 500)"; now the
    decode's own answer reaches the client, as it does when it comes first."""
    p, d = _prefill(), _decode()
    p.fail_status = 500
    d.fail_status, d.fail_delay_s = 500, 0.2
    c = Cluster(lt, [p], [d], **PD)
    try:
        with httpx.Client(timeout=60) as h:
            r = h.post(c.base + "/v1/completions", json=BODY)
        assert r.status_code == 500 and r.json()["error"]["message"] == "mock failure", r.text
        assert d.cancelled == 0
    finally:
        c.close()


def test_failed_prefill_leg_is_named_when_the_decode_cannot_prefill(lt):
    """A vLLM prefill feeding an SGLang decode (the router's rooms) that fails its prefill leg, with no other prefill
    instance: the 503 names the failed prefill and its answer, not only "no prefill instance available" (the
    instance is registered and was placed; the client must learn what happened to it). The decode gets nothing."""
    p = MockEngine(name="vp", role="prefill", engine="vllm")
    d = _decode()
    c = Cluster(lt, [], [d])
    try:
        lt.run(p.start())
        p.fail_status = 500
        with httpx.Client(timeout=30) as h:
            r = h.post(c.base + "/admin/instances", json={"url": p.url, "role": "prefill", "engine": "vllm",
                                                           "model": "mock", "id": "vp"})
            assert r.status_code == 201, r.text
            r = h.post(c.base + "/v1/completions", json=BODY)
        assert r.status_code == 503, r.text
        msg = r.json()["error"]["message"]
        assert msg.startswith("no prefill instance available for decode-only instance d (sglang) (last: "
                              "prefill instance vp answered 500"), msg
        assert d.requests == 0
    finally:
        c.close()
        lt.run(p.stop())
