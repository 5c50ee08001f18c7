"""Router end-to-end against mock vLLM engines (dlmix.testing.mock_engine): pass-through, PD, failures, balance."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from dlmix.testing import LoopThread  # noqa: E402
from dlmix.testing.mock_engine import MockEngine  # noqa: E402

from dlmix.router.config import RouterConfig  # noqa: E402
from dlmix.router.server import Router  # noqa: E402


@pytest.fixture(scope="module")
def lt():
    t = LoopThread()
    yield t
    t.close()


class Cluster:
    def __init__(self, lt, engines, roles=None, chips=None, **cfg):
        self.lt = lt
        self.engines = engines
        self.urls = [lt.run(e.start()) for e in engines]
        roles = roles or ["both"] * len(engines)
        insts = []
        chips = chips or ["cpu-x86"] * len(engines)
        for e, u, r, ch in zip(engines, self.urls, roles, chips):
            d = {"url": u, "model": "mock", "role": r, "id": e.name, "chip": ch, "transport": {"link": "rdma-100g"}}
            if e.kv_endpoint:
                d["kv_events"] = e.kv_endpoint
            insts.append(d)
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


BODY = {"model": "mock", "prompt": "The quick brown fox jumps over the lazy dog. " * 20, "max_tokens": 7,
        "temperature": 0.0, "my_unknown_field": {"nested": [1, 2.5, None, "x"]}, "top_k": -1}
CHAT = {"model": "mock", "messages": [{"role": "system", "content": "You are terse. " * 30},
                                      {"role": "user", "content": "Say hi."}], "max_tokens": 6,
        "weird_extension": True}


@pytest.mark.parametrize("policy", ["round_robin", "cost"])
def test_answers_identical_to_direct_and_fields_unchanged(lt, policy):
    c = Cluster(lt, [MockEngine(name="a"), MockEngine(name="b")], policy=policy)
    try:
        with httpx.Client(timeout=10) as h:
            for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", CHAT)):
                raw = json.dumps(body, separators=(", ", ": ")).encode()  # unusual spacing on purpose
                for stream in (False, True):
                    b = raw if not stream else raw[:-1] + b', "stream": true}'
                    via = h.post(c.base + path, content=b, headers={"content-type": "application/json"})
                    assert via.status_code == 200
                    # the instance that served it received exactly the client's bytes
                    served = [e for e in c.engines if e.received and e.received[-1] == b]
                    assert len(served) >= 1
                    direct = h.post(served[0].url + path, content=b, headers={"content-type": "application/json"})
                    if stream:
                        assert via.headers["content-type"].startswith("text/event-stream")
                        assert _sse(via.text) == _sse(direct.text) and len(_sse(via.text)) == body["max_tokens"]
                        assert via.text.endswith("data: [DONE]\n\n")
                    else:
                        assert via.json() == direct.json()
    finally:
        c.close()


def test_backend_400_reaches_client(lt):
    c = Cluster(lt, [MockEngine(name="a")], policy="cost")
    try:
        with httpx.Client(timeout=10) as h:
            r = h.post(c.base + "/v1/completions", json=dict(BODY, max_tokens=-3))
            assert r.status_code == 400
            assert r.json()["error"]["message"] == "max_tokens must be at least 1, got -3."
            c.engines[0].fail_status = 422
            r = h.post(c.base + "/v1/completions", json=BODY)
            assert r.status_code == 422 and r.json()["error"]["type"] == "MockError"
            r = h.post(c.base + "/v1/completions", content=b"{not json")
            assert r.status_code == 400
    finally:
        c.close()


def test_pd_orchestration_and_identical_answers(lt):
    p, d = MockEngine(name="p", role="prefill"), MockEngine(name="d", role="decode")
    c = Cluster(lt, [p, d], roles=["prefill", "decode"], chips=["H100", "H20"], policy="cost",
                policy_params={"local_max_uncached": 0}, model_spec="llama-3.1-8b")
    try:
        with httpx.Client(timeout=10) as h:
            for stream in (False, True):
                # a fresh prompt each time: a cached one would (rightly) prefill locally on D
                sysmsg = {"role": "system", "content": f"Variant {stream}. " + "You are terse. " * 30}
                body = dict(CHAT, stream=stream, messages=[sysmsg] + CHAT["messages"][1:])
                if not stream:
                    first_body = body
                via = h.post(c.base + "/v1/chat/completions", json=body)
                direct = h.post(d.url + "/v1/chat/completions", json=body)
                assert via.status_code == 200
                if stream:
                    assert _sse(via.text) == _sse(direct.text)
                else:
                    assert via.json() == direct.json()
        assert p.prefill_legs == 2 and len(d.remote_prefills) == 2
        leg = json.loads(p.received[0])
        assert leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1 and leg["stream"] is False
        assert leg["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                             "remote_engine_id": None, "remote_block_ids": None,
                                             "remote_host": None, "remote_port": None}
        assert leg["weird_extension"] is True
        # decode leg = the client's request plus P's kv_transfer_params, nothing else changed
        dec = json.loads(d.received[0])
        kvp = dec.pop("kv_transfer_params")
        assert dec == first_body and kvp["remote_engine_id"] == "p" and kvp["do_remote_prefill"] is True
        assert d.remote_prefills[0] == kvp
    finally:
        c.close()


def test_prefill_instance_dies_no_request_lost(lt):
    p1 = MockEngine(name="p1", role="prefill", ttft=0.05)
    p2 = MockEngine(name="p2", role="prefill", ttft=0.05)
    d = MockEngine(name="d", role="decode")
    c = Cluster(lt, [p1, p2, d], roles=["prefill", "prefill", "decode"], chips=["H100", "H100", "H20"],
                policy="cost",
                policy_params={"local_max_uncached": 0}, model_spec="llama-3.1-8b")

    at_death = []

    async def run():
        async with httpx.AsyncClient(timeout=120) as h:
            async def one(i):
                return await h.post(c.base + "/v1/completions", json=dict(BODY, prompt=f"{i} " + BODY["prompt"]))
            tasks = [asyncio.ensure_future(one(i)) for i in range(40)]
            deadline = time.monotonic() + 60
            while p1.inflight < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            at_death.append(p1.inflight)
            await p1.die()  # dies with prefill legs in flight
            return await asyncio.gather(*tasks)

    try:
        rs = lt.run(run(), 180)
        assert [r.status_code for r in rs] == [200] * 40, [r.text for r in rs if r.status_code != 200]
        with httpx.Client(timeout=10) as h:
            for i, r in enumerate(rs):
                direct = h.post(d.url + "/v1/completions", json=dict(BODY, prompt=f"{i} " + BODY["prompt"]))
                assert r.json() == direct.json()
        assert at_death[0] >= 3  # it really had prefill legs in flight when it died
        retries = c.router.metrics.registry.get_sample_value("dlmix_router_retries_total", {"kind": "prefill"})
        assert retries and retries >= 1
        assert not c.router.rt["p1"].state.healthy
    finally:
        c.close()


@pytest.mark.parametrize("policy", ["prefix", "cost"])
def test_shared_prefix_spreads_with_high_hits(lt, policy):
    # ttft long enough that all 200 requests are in flight together even on a loaded machine: the balance guard
    # acts on in-flight load, so totals then reflect it (with short requests they depend on the client's pace)
    engines = [MockEngine(name=f"e{i}", ttft=1.0, record=False) for i in range(4)]
    c = Cluster(lt, engines, policy=policy,
                policy_params={"balance_abs_threshold": 2, "balance_rel_threshold": 1.5})
    prefix = "System: you answer questions about the dlmix project. " * 40  # ~2.2 KB shared

    async def run():
        lim = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(timeout=30, limits=lim) as h:
            return await asyncio.gather(*(h.post(c.base + "/v1/completions", json={
                "model": "mock", "prompt": prefix + f"Question {i}?", "max_tokens": 2}) for i in range(200)))

    try:
        rs = lt.run(run(), timeout=60)
        assert all(r.status_code == 200 for r in rs)
        counts = [e.requests for e in engines]
        assert sum(counts) == 200
        # the guard (SGLang's rule) admits a request to an instance while max <= rel * min: one request of
        # granularity above the configured 1.5 ratio, never more
        assert max(counts) <= 1.5 * min(counts) + 1, counts
        reg = c.router.metrics.registry
        hit = sum(reg.get_sample_value("dlmix_router_prefix_hit_tokens_total", {"instance": e.name}) or 0
                  for e in engines)
        prefix_blocks_tokens = (len(prefix) // 64) * 16  # approximate mode: 64-char chunks = 16-token blocks
        assert hit >= 0.9 * 200 * prefix_blocks_tokens, (hit, counts)
    finally:
        c.close()


def test_kv_events_feed_exact_index(lt):
    engines = [MockEngine(name=f"k{i}", kv_events=True, record=False) for i in range(2)]
    c = Cluster(lt, engines, policy="prefix", tokenizer="bytes")
    try:
        time.sleep(0.3)  # SUB sockets connect
        prompt = "shared document " * 40
        with httpx.Client(timeout=10) as h:
            r = h.post(engines[1].url + "/v1/completions", json={"model": "mock", "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200
            deadline = time.time() + 60
            while len(c.router.index) == 0 and time.time() < deadline:
                time.sleep(0.05)
            n_blocks = len(prompt.encode()) // 16
            assert len(c.router.index) == n_blocks
            # the router never sent this prefix anywhere; the exact index (from engine k1's events) routes it to k1
            r = h.post(c.base + "/v1/completions", json={"model": "mock", "prompt": prompt + "more", "max_tokens": 1})
            assert r.status_code == 200
        assert engines[1].requests == 2 and engines[0].requests == 0
    finally:
        c.close()


def test_client_disconnect_aborts_backend(lt):
    e = MockEngine(name="slow", itl=0.05)
    c = Cluster(lt, [e], policy="round_robin")
    try:
        with httpx.Client(timeout=10) as h:
            with h.stream("POST", c.base + "/v1/completions", json=dict(BODY, stream=True, max_tokens=200)) as r:
                for _ in r.iter_bytes():
                    break
        deadline = time.time() + 60
        while e.aborted == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert e.aborted == 1 and e.inflight == 0
        assert c.router.instances[0].load.inflight == 0
    finally:
        c.close()


def test_admin_api_registration_heartbeat_drain(lt):
    a, b = MockEngine(name="a"), MockEngine(name="b")
    c = Cluster(lt, [a], policy="round_robin", admin_key="sekret", heartbeat_ttl_s=2.0)
    lt.run(b.start())
    auth = {"authorization": "Bearer sekret"}
    try:
        with httpx.Client(timeout=10) as h:
            assert h.post(c.base + "/admin/instances", json={"url": b.url}).status_code == 401
            r = h.post(c.base + "/admin/instances", headers=auth,
                       json={"url": b.url, "id": "b", "model": "mock", "chip": "H20", "role": "both"})
            assert r.status_code == 201, r.text
            assert h.post(c.base + "/admin/instances", headers=auth, json={"url": b.url, "chip": "X9"}
                          ).status_code == 400
            assert h.post(c.base + "/admin/instances/b/heartbeat", headers=auth,
                          json={"waiting": 3, "running": 2, "kv_usage": 0.5}).status_code == 200
            lst = h.get(c.base + "/admin/instances", headers=auth).json()["instances"]
            assert {i["id"] for i in lst} == {"a", "b"}
            assert [i["load"]["waiting"] for i in lst if i["id"] == "b"] == [3]
            # heartbeats stop -> b leaves rotation (after the 2 s TTL; the deadline only bounds the wait)
            deadline = time.monotonic() + 60
            while c.router.rt["b"].state.healthy and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not c.router.rt["b"].state.healthy
            for _ in range(4):
                assert h.post(c.base + "/v1/completions", json=BODY).status_code == 200
            assert b.requests == 0
            h.post(c.base + "/admin/instances/b/heartbeat", headers=auth, json={})
            assert c.router.rt["b"].state.healthy
            # drain a -> everything goes to b
            assert h.post(c.base + "/admin/instances/a/drain", headers=auth).status_code == 200
            n = a.requests
            for _ in range(3):
                h.post(c.base + "/admin/instances/b/heartbeat", headers=auth, json={})
                assert h.post(c.base + "/v1/completions", json=BODY).status_code == 200
            assert a.requests == n and b.requests == 3
            assert h.delete(c.base + "/admin/instances/b", headers=auth).status_code == 200
            assert h.post(c.base + "/v1/completions", json=BODY).status_code == 503  # a drained, b gone
    finally:
        c.close()
        lt.run(b.stop())


def test_incompatible_layout_refused_with_reasons(lt):
    from dlmix.kv.layout import KVLayout, ModelIdentity
    import dataclasses

    fields = {f.name for f in dataclasses.fields(ModelIdentity)}
    base = dict(architecture="LlamaForCausalLM", num_layers=30, num_kv_heads=3, head_size=64)
    base = {k: v for k, v in base.items() if k in fields}
    lay_p = KVLayout(model=ModelIdentity(**base), block_size=16, dtype="bfloat16", arrangement="vllm_lbnhc")
    lay_d = KVLayout(model=ModelIdentity(**dict(base, num_layers=32)), block_size=16, dtype="bfloat16",
                     arrangement="vllm_lbnhc")
    cfg = RouterConfig(port=0, instances=[{"url": "http://127.0.0.1:1", "role": "prefill", "model": "m",
                                           "kv_layout": lay_p.to_dict()}])
    r = Router(cfg)
    from dlmix.router.server import RegistrationError

    with pytest.raises(RegistrationError) as ei:
        r.register({"url": "http://127.0.0.1:2", "role": "decode", "model": "m", "kv_layout": lay_d.to_dict()})
    assert ei.value.status == 409 and any("layers" in s for s in ei.value.reasons)
    ok = r.register({"url": "http://127.0.0.1:3", "role": "decode", "model": "m", "kv_layout": lay_p.to_dict()})
    assert ok.slot == 1


def test_prefill_timeout_falls_back_to_decode_instance(lt):
    p = MockEngine(name="p", role="prefill", ttft=3.0)  # hangs longer than the prefill timeout
    d = MockEngine(name="d", role="decode")
    c = Cluster(lt, [p, d], roles=["prefill", "decode"], chips=["H100", "H20"], policy="cost",
                policy_params={"local_max_uncached": 0}, model_spec="llama-3.1-8b", prefill_timeout_s=0.3)
    try:
        with httpx.Client(timeout=10) as h:
            via = h.post(c.base + "/v1/completions", json=BODY)
            direct = h.post(d.url + "/v1/completions", json=BODY)
        assert via.status_code == 200 and via.json() == direct.json()
        assert p.requests == 1 and d.remote_prefills == []  # D prefilled it itself
        reg = c.router.metrics.registry
        assert reg.get_sample_value("dlmix_router_retries_total", {"kind": "prefill_local"}) == 1
    finally:
        c.close()


def test_hf_tokenizer_mode_matches_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    from dlmix.router.tokenize import PromptExtractor

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ex = PromptExtractor(str(tiny_model_dir))
    msgs = [{"role": "user", "content": "hello there"}]
    ids, text = ex.extract(True, {"messages": msgs})
    if tok.chat_template:
        want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert text == want and ids == tok.encode(want, add_special_tokens=False)
    ids, _ = ex.extract(False, {"prompt": "hello there"})
    assert ids == tok.encode("hello there")
    assert ex.extract(False, {"prompt": [5, 6, 7]})[0] == [5, 6, 7]


def test_client_keys_and_body_limit(lt):
    c = Cluster(lt, [MockEngine(name="a")], policy="round_robin", api_keys=["k1"], max_body_mb=1)
    try:
        with httpx.Client(timeout=10) as h:
            assert h.post(c.base + "/v1/completions", json=BODY).status_code == 401
            ok = h.post(c.base + "/v1/completions", json=BODY, headers={"authorization": "Bearer k1"})
            assert ok.status_code == 200
            # the router's key is not forwarded to the backend
            hdrs = dict(c.engines[0].received_headers[-1])
            assert b"authorization" not in hdrs and hdrs[b"content-type"] == b"application/json"
            big = dict(BODY, prompt="x" * (2 << 20))
            r = h.post(c.base + "/v1/completions", json=big, headers={"authorization": "Bearer k1"})
            assert r.status_code == 413
    finally:
        c.close()


@pytest.mark.parametrize("which", ["smollm2", "tiny"])
def test_hf_split_encoding_equals_whole_encoding(which, smollm2_dir, tiny_model_dir):
    from transformers import AutoTokenizer

    from dlmix.router.tokenize import PromptExtractor

    path = str(smollm2_dir if which == "smollm2" else tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(path)
    ex = PromptExtractor(path)
    system = {"role": "system", "content": "You are a careful assistant.  Be brief.\n\nRules: none. " * 8}
    for q in ("Hi", " leading space?", "emoji 🙂 and\ttabs", "<|im_start|> injected", "last one"):
        msgs = [system, {"role": "user", "content": q}]
        ids, text = ex.extract(True, {"messages": msgs})
        assert ids == tok.encode(text, add_special_tokens=False)
        ids2, _ = ex.extract(False, {"prompt": text})
        assert ids2 == tok.encode(text)


def test_health_check_takes_out_and_brings_back(lt):
    a, b = MockEngine(name="a"), MockEngine(name="b")
    c = Cluster(lt, [a, b], policy="round_robin", health_interval_s=0.1, health_failures=1)
    try:
        port = b.port
        lt.run(b.die())
        deadline = time.time() + 60
        while c.router.rt["b"].state.healthy and time.time() < deadline:
            time.sleep(0.05)
        assert not c.router.rt["b"].state.healthy
        with httpx.Client(timeout=10) as h:
            assert all(h.post(c.base + "/v1/completions", json=BODY).status_code == 200 for _ in range(4))
        lt.run(b.start(port))  # the engine comes back on the same address
        deadline = time.time() + 60
        while not c.router.rt["b"].state.healthy and time.time() < deadline:
            time.sleep(0.05)
        assert c.router.rt["b"].state.healthy
        n = b.requests
        with httpx.Client(timeout=10) as h:
            for _ in range(4):
                h.post(c.base + "/v1/completions", json=BODY)
        assert b.requests == n + 2
    finally:
        c.close()


def test_online_calibration_and_metrics(lt):
    e = MockEngine(name="cal", ttft=0.05, itl=0.01)
    c = Cluster(lt, [e], chips=["H100"], policy="cost", model_spec="llama-3.1-8b")
    try:
        with httpx.Client(timeout=10) as h:
            for i in range(3):
                r = h.post(c.base + "/v1/completions", json=dict(BODY, stream=True, prompt=f"{i} " + BODY["prompt"]))
                assert r.status_code == 200
            m = h.get(c.base + "/metrics").text
        st = c.router.rt["cal"].state
        # the model predicts a few ms on an H100; the mock takes >= 50 ms -> measured/predicted ratio rises above 1
        assert st.ttft_ratio > 1.5 and st.itl_ratio != 1.0
        assert 'dlmix_router_ttft_seconds_count{chip="H100",instance="cal"} 3.0' in m
        assert 'dlmix_router_requests_total{route="cost:local"} 3.0' in m
    finally:
        c.close()


def test_cost_early_rejection_answers_503_without_touching_the_engine(lt):
    e = MockEngine(name="rej")
    # a TTFT target no plan can meet: every request is refused by admission control
    c = Cluster(lt, [e], chips=["H100"], policy="cost", model_spec="llama-3.1-8b",
                policy_params={"ttft_target": 1e-6, "reject_ttft_factor": 1.0})
    try:
        with httpx.Client(timeout=10) as h:
            r = h.post(c.base + "/v1/completions", json=BODY)
            assert r.status_code == 503
            assert "early rejection" in r.json()["error"]["message"]
        assert e.requests == 0
        assert c.router.rt["rej"].state.load.inflight == 0
    finally:
        c.close()


def test_pinning_headers_choose_the_pair_and_are_refused_unless_allowed(lt):
    """``x-dlmix-prefill-instance`` / ``x-dlmix-decode-instance`` (router option ``allow_pinning``): every one of the
    4 ordered pairs of a 2x2 PD fleet gets exactly the requests pinned to it (counted on the mock engines), the
    headers never reach an engine, a pin to a dead prefill falls back to the pinned decode computing the prompt
    itself, and bad pins get a 400 naming the problem. A router without the option refuses a pinned request."""
    engines = [MockEngine(name=n, role=r) for n, r in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"),
                                                       ("d1", "decode"))]
    c = Cluster(lt, engines, roles=["prefill", "prefill", "decode", "decode"], policy="prefix", allow_pinning=True)
    by = {e.name: e for e in engines}
    try:
        with httpx.Client(timeout=30) as h:
            want = {}
            for k, (p, d) in enumerate([(p, d) for p in ("p0", "p1") for d in ("d0", "d1")]):
                for j in range(k + 1):  # 1, 2, 3, 4 requests: a pair that got another pair's request shows
                    r = h.post(c.base + "/v1/completions", json=dict(BODY, prompt=f"{p}{d}{j} " + BODY["prompt"]),
                               headers={"x-dlmix-prefill-instance": p, "x-dlmix-decode-instance": d})
                    assert r.status_code == 200, r.text
                    want[p] = want.get(p, 0) + 1
                    want[d] = want.get(d, 0) + 1
            assert {n: (e.prefill_legs if n[0] == "p" else len(e.remote_prefills)) for n, e in by.items()} == want
            assert not [k for e in engines for hs in e.received_headers for k, _ in hs
                        if k in (b"x-dlmix-prefill-instance", b"x-dlmix-decode-instance")]
            # a pinned decode alone: the policy still picks the prefill (both prefill instances are candidates)
            r = h.post(c.base + "/v1/completions", json=dict(BODY, prompt="only d1 " + BODY["prompt"]),
                       headers={"x-dlmix-decode-instance": "d1"})
            assert r.status_code == 200 and len(by["d1"].remote_prefills) == want["d1"] + 1
            for hdrs, why in (({"x-dlmix-decode-instance": "nope"}, "no instance 'nope'"),
                              ({"x-dlmix-decode-instance": "p0"}, "cannot take the decode leg"),
                              ({"x-dlmix-prefill-instance": "d0"}, "cannot take the prefill leg")):
                r = h.post(c.base + "/v1/completions", json=BODY, headers=hdrs)
                assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
            lt.run(by["p1"].die())
            before, p0_legs = by["d0"].requests, by["p0"].prefill_legs
            r = h.post(c.base + "/v1/completions", json=dict(BODY, prompt="after p1 died " + BODY["prompt"]),
                       headers={"x-dlmix-prefill-instance": "p1", "x-dlmix-decode-instance": "d0"})
            assert r.status_code == 200, r.text
            assert by["p0"].prefill_legs == p0_legs  # not moved to the other prefill instance
            assert by["d0"].requests == before + 1
    finally:
        c.close()
    plain = Cluster(lt, [MockEngine(name="d", role="both")])
    try:
        r = httpx.post(plain.base + "/v1/completions", json=BODY, headers={"x-dlmix-decode-instance": "d"},
                       timeout=30)
        assert r.status_code == 400 and "allow_pinning" in r.json()["error"]["message"], r.text
    finally:
        plain.close()
