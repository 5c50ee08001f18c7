"""End-to-end SGLang prefill/decode with the ``dlmix`` transfer backend on real SGLang 0.5.23 CPU servers and the real
SmolLM2 (marked slow; skipped with the reason when the SGLang venv of ``scripts/setup_sglang.sh`` is absent).

Servers (started once for this module; SGLang runs with the SGLang venv's python, found by
:func:`dlmix_sglang.testing.sglang_python`):
  S   single server, fp32, page 64 (the decode configuration): the reference
  P1  prefill fp32, page 64 (same configuration as D)      P2  prefill bf16, page 16 (converted on the way)
  D   decode fp32, page 64
  P3  (negative control only) prefill with perturbed weights: refused by D at bootstrap with the reason

Each request sends the same ``/generate`` body with ``bootstrap_host/port/room`` to P and D at once (SGLang's PD
flow, as its router does). Near-ties: a heterogeneous pair's first divergence from the reference is allowed only
where the reference's top-1/top-2 logprob gap is below the threshold; they are counted and printed.
"""
from __future__ import annotations

import json
import random
import threading
import time

import pytest

pytestmark = pytest.mark.slow

from dlmix_sglang import testing as T  # noqa: E402
from dlmix.testing import compare_greedy, stop_all  # noqa: E402

T.require_venv()

MAX_TOKENS = 16
#: top-1/top-2 gap (nats) under which a first divergence counts as a near-tie: bf16 KV carries bf16 rounding.
NEAR_TIE = {"same": 0.0, "p16-bf16->p64-fp32": 0.5}
_WORDS = ("river mountain quiet engine market yellow window garden silver theory station winter bridge signal "
          "harvest lantern ocean pocket rhythm castle meadow copper thunder village orbit canvas planet ribbon").split()


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    """20 token-id prompts of 10..1000 tokens in geometric steps (:func:`dlmix.testing.spread_lengths`): the 10- and
    1,000-token ones first, then the 18 between in a shuffled order."""
    from transformers import AutoTokenizer

    from dlmix.testing import spread_lengths

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    rng = random.Random(14)
    lengths = spread_lengths(20, shuffle=rng)
    out = []
    for n in lengths:
        ids: list[int] = []
        while len(ids) < n:
            ids += tok.encode(" ".join(rng.choice(_WORDS) for _ in range(64)), add_special_tokens=False)
        out.append(ids[:n])
    return out


@pytest.fixture(scope="module")
def servers(smollm2_dir, tmp_path_factory):
    from dlmix.router.config import RouterConfig
    from dlmix.testing import RouterThread

    d = tmp_path_factory.mktemp("sglang-pd")
    m = str(smollm2_dir)
    started = {}
    # a dlmix router with no instances, started first: the PD servers register themselves with it
    # (test_servers_register_themselves_with_the_dlmix_router)
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="cost", model_spec=m,
                                   policy_params={"local_max_uncached": 0}))
    reg = {"DLMIX_SGLANG_CONFIG": json.dumps({"router_url": rt.url, "heartbeat_s": 1, "chip_profile": "cpu-x86"})}
    try:
        # S publishes its KV events (test_kv_events_reach_the_dlmix_router)
        started["S"] = T.start_server(m, T.free_port(), d / "S.log", page_size=64,
                                      kv_events=f"tcp://127.0.0.1:{T.free_port()}")
        started["P1"] = T.start_server(m, T.free_port(), d / "P1.log", mode="prefill", page_size=64, env=reg)
        started["P2"] = T.start_server(m, T.free_port(), d / "P2.log", mode="prefill", page_size=16,
                                       dtype="bfloat16", env=reg)
        started["D"] = T.start_server(m, T.free_port(), d / "D.log", mode="decode", page_size=64, env=reg)
        for s in started.values():
            s.wait_ready()
        started["_dir"] = d
        started["_router"] = rt
        yield started
    finally:
        stop_all(s for k, s in started.items() if not k.startswith("_"))
        rt.close()


def _pd(p: T.SGLangServer, d: T.SGLangServer, ids: list[int], room: int | None = None):
    return T.pd_generate(p, d, ids, MAX_TOKENS, room=room)


def _references(url: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    out = []
    for ids in prompts:
        st, body = T.generate(url, ids, MAX_TOKENS, logprobs=True)
        assert st == 200, body
        tops = body["meta_info"].get("output_top_logprobs") or []
        gaps = [(t[0][0] - t[1][0]) if t and len(t) > 1 else float("inf") for t in tops]
        out.append((body["output_ids"], gaps))
    return out


@pytest.fixture(scope="module")
def refs(servers, prompts):
    """Reference output ids and per-position top-1/top-2 gaps from the single server S, as a Future: computed in a
    background thread from set-up on, side by side with the first PD test's requests (S is another process)."""
    from concurrent.futures import ThreadPoolExecutor

    ex = ThreadPoolExecutor(1, thread_name_prefix="references")
    try:
        yield ex.submit(_references, servers["S"].url, prompts)
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def _compare(case: str, got: list[list[int]], refs, threshold: float) -> tuple[int, int]:
    """``refs``: the references (a list, or the :func:`refs` Future of one)."""
    refs = refs.result() if hasattr(refs, "result") else refs
    return compare_greedy(case, dict(enumerate(got)), dict(enumerate(refs)), threshold, MAX_TOKENS)


def _run_pair(servers, prompts, pname: str) -> list[list[int]]:
    got = []
    for i, ids in enumerate(prompts):
        (ps, pb), (ds, db) = _pd(servers[pname], servers["D"], ids)
        assert ds == 200 and not _aborted(db), f"{pname}->D prompt {i} ({len(ids)} tokens): {db}\n{servers['D'].log_tail()}"
        assert ps == 200, f"{pname} prompt {i}: {pb}"
        got.append(db["output_ids"])
    return got


def test_same_configuration_equals_single_server(servers, prompts, refs):
    got = _run_pair(servers, prompts, "P1")
    same, ties = _compare("same", got, refs, NEAR_TIE["same"])
    assert same == len(prompts)


def test_page16_bf16_prefill_feeds_page64_fp32_decode(servers, prompts, refs):
    """The 20 prompts from the bf16 prefill with 16-token pages into the fp32 decode with 64-token pages: equal to
    the single fp32 server except near-ties (counted and printed). The prefill's bf16 products run in fp32 on a CPU
    without a native 16-bit matrix product (the test servers' CPU aid, ``DLMIX_SGLANG_CPU_AIDS``)."""
    got = _run_pair(servers, prompts, "P2")
    same, ties = _compare("p16-bf16->p64-fp32", got, refs, NEAR_TIE["p16-bf16->p64-fp32"])
    assert same + ties == len(got) == 20


#: prompts through a router in front of P1 -> D: the 10- and 1,000-token ones and four between. The pair's KV path
#: over all 20 is test_same_configuration_equals_single_server's; a router test checks what the router adds.
FRONT = 6


def test_behind_sglangs_own_router(servers, prompts, refs):
    """SGLang's router (sglang-router, PD mode) adds the bootstrap fields and sends both legs, unchanged: the
    answers to :data:`FRONT` prompts equal the single server's."""
    import subprocess

    py = T.sglang_python()
    if subprocess.run([py, "-c", "import sglang_router"], capture_output=True).returncode != 0:
        pytest.skip("sglang-router is not installed in the SGLang venv")
    r = T.start_sglang_router(servers["P1"], servers["D"], T.free_port(), servers["_dir"] / "router.log")
    try:
        r.wait_ready(timeout_s=180)
        # sglang-router answers its health check before it has registered its workers (in the background): wait
        # until a request finds them
        deadline = time.monotonic() + 120
        while True:
            st, body = T.post_json(r.url + "/generate", {"input_ids": prompts[0][:8], "sampling_params": {
                "temperature": 0, "max_new_tokens": 1}})
            if st != 503 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert st == 200, f"{body}\n{r.log_tail()}"
        got = []
        for ids in prompts[:FRONT]:
            st, body = T.post_json(r.url + "/generate", {"input_ids": ids, "sampling_params": {
                "temperature": 0, "max_new_tokens": MAX_TOKENS}})
            assert st == 200 and not _aborted(body), f"{body}\n{r.log_tail()}"
            got.append(body["output_ids"])
        same, _ = _compare("sglang-router", got, refs.result()[:FRONT], NEAR_TIE["same"])
        assert same == len(got) == FRONT
    finally:
        r.stop()


def test_behind_the_dlmix_router(servers, prompts, refs, smollm2_dir):
    """The dlmix router speaks SGLang's PD flow (both legs at once with one bootstrap room): :data:`FRONT` prompts as
    OpenAI completions with token-id prompts, every second one streamed, each answer's token ids (``return_token_ids``)
    identical to the single server's; every request went through the prefill instance."""
    from dlmix.router.config import RouterConfig
    from dlmix.testing import RouterThread

    p, d = servers["P1"], servers["D"]
    insts = [{"id": "P1", "url": p.url, "role": "prefill", "engine": "sglang", "bootstrap_port": p.bootstrap_port,
              "chip": "cpu-x86"},
             {"id": "D", "url": d.url, "role": "decode", "engine": "sglang", "chip": "cpu-x86"}]
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="cost", model_spec=str(smollm2_dir),
                                   policy_params={"local_max_uncached": 0}, instances=insts))
    try:
        import httpx

        got = []
        with httpx.Client(timeout=300) as h:
            for i, ids in enumerate(prompts[:FRONT]):
                body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": i % 2 == 1,
                        "return_token_ids": True}
                r = h.post(rt.url + "/v1/completions", json=body)
                assert r.status_code == 200, f"{r.text}\n{d.log_tail()}"
                if body["stream"]:
                    chunks = [json.loads(x[6:]) for x in r.text.split("\n") if x.startswith("data: {")]
                    got.append([t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])])
                else:
                    got.append(r.json()["choices"][0]["token_ids"])
        same, _ = _compare("dlmix router", got, refs.result()[:FRONT], NEAR_TIE["same"])
        assert same == len(got) == FRONT
        ok = rt.call(lambda: rt.router.metrics.registry.get_sample_value(
            "dlmix_router_prefill_responses_total", {"instance": "P1", "status": "2xx"}))
        assert ok == FRONT  # every request went through the prefill instance
    finally:
        rt.close()


def test_servers_register_themselves_with_the_dlmix_router(servers, prompts):
    """With ``router_url`` in ``DLMIX_SGLANG_CONFIG``, each PD server's scheduler registers with the dlmix router
    (SGLang's ``HookRegistry``, ``dlmix_sglang.router_hook``) and heartbeats its load and KV usage; the router then
    serves requests over the pairs it learned, with no instance list of its own."""
    import httpx

    from dlmix.testing import wait_until

    rt = servers["_router"]
    want = {servers[n].url: n for n in ("P1", "P2", "D")}

    def listed():
        got = {i["url"]: i for i in httpx.get(rt.url + "/admin/instances", timeout=5).json()["instances"]}
        return got if set(got) == set(want) and all(i["load"]["kv_usage"] is not None and i["healthy"]
                                                    for i in got.values()) else None

    got = wait_until(listed, 120, "P1, P2 and D registered, heartbeating and healthy")
    roles = {want[u]: (i["engine"], i["role"], i["block_size"], i["chip"]) for u, i in got.items()}
    assert roles == {"P1": ("sglang", "prefill", 64, "cpu-x86"), "P2": ("sglang", "prefill", 16, "cpu-x86"),
                     "D": ("sglang", "decode", 64, "cpu-x86")}
    boot = rt.call(lambda: {i.url: i.extra.get("bootstrap_port") for i in rt.router.instances})
    assert boot == {servers["P1"].url: servers["P1"].bootstrap_port, servers["P2"].url: servers["P2"].bootstrap_port,
                    servers["D"].url: None}
    assert all(0.0 <= i["load"]["kv_usage"] <= 1.0 for i in got.values())
    with httpx.Client(timeout=300) as h:
        for ids in prompts[:3]:
            r = h.post(rt.url + "/v1/completions", json={"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0})
            assert r.status_code == 200, f"{r.text}\n{servers['D'].log_tail()}"
            assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    served = rt.call(lambda: sum(rt.router.metrics.registry.get_sample_value(
        "dlmix_router_prefill_responses_total", {"instance": got[servers[n].url]["id"], "status": "2xx"}) or 0
        for n in ("P1", "P2")))
    assert served == 3  # every request was disaggregated over a registered prefill instance


def test_kv_events_reach_the_dlmix_router(servers, prompts, smollm2_dir):
    """SGLang's own KV events (``--kv-events-config``) give the dlmix router exact prefix hits: after a prompt is
    served directly by S (page 64), the router's index (block 16) holds every full block of it under the keys the
    router computes for the same prompt."""
    from dlmix.router.config import RouterConfig
    from dlmix.testing import RouterThread, wait_until

    s = servers["S"]
    insts = [{"id": "S", "url": s.url, "role": "both", "engine": "sglang", "chip": "cpu-x86", "block_size": 16,
              "kv_events": s.kv_events}]
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="cost", model_spec=str(smollm2_dir),
                                   instances=insts))
    try:
        router = rt.router
        probe = iter(range(1000))

        def hit() -> bool:  # ZMQ slow joiner: probe with fresh prompts until one's blocks arrive
            ids = [7 + next(probe)] + prompts[1][:199]
            st, body = T.generate(s.url, ids, 2)
            assert st == 200, body
            rr = rt.call(lambda: router._request_from({"prompt": ids}, False))
            keys = list(rr.block_hashes(16))
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                m = rt.call(lambda: router.index.match(keys))
                if m:
                    assert len(keys) == 12 and m == {router.instances[0].slot: 12}, m
                    return True
                time.sleep(0.1)
            return False
        wait_until(hit, 180, "S's KV events in the router's index", interval_s=0)
    finally:
        rt.close()


def _aborted(body) -> bool:
    fr = body.get("meta_info", {}).get("finish_reason") if isinstance(body, dict) else None
    return isinstance(fr, dict) and fr.get("type") == "abort"


def test_other_weights_refused_at_bootstrap_with_the_reason(servers, prompts, perturbed_dir):
    p3 = T.start_server(str(perturbed_dir), T.free_port(), servers["_dir"] / "P3.log", mode="prefill", page_size=64)
    try:
        p3.wait_ready()
        (ps, pb), (ds, db) = _pd(p3, servers["D"], prompts[0])
        # SGLang answers a failed transfer with an error status or an aborted finish reason carrying the reason
        assert ds != 200 or _aborted(db), db
        assert "weights" in str(db) and "dlmix" in str(db), db
        assert ps != 200 or _aborted(pb), pb
        # the decode still serves a compatible prefill afterwards
        (ps, pb), (ds, db) = _pd(servers["P1"], servers["D"], prompts[0])
        assert ds == 200 and not _aborted(db), db
    finally:
        p3.stop()


def test_an_unreachable_bootstrap_server_is_named_in_the_decodes_answer(servers, prompts):
    """A room whose prefill bootstrap server cannot be reached (a wrong bootstrap port) fails, when SGLang gives up,
    with the address and the connection error; before, the client got only "Aborted by AbortReq." and the cause
    was in the decode's log alone."""
    port = T.free_port()
    st, body = T.generate(servers["D"].url, prompts[0], MAX_TOKENS, bootstrap=("127.0.0.1", port, 4242))
    assert st != 200 or _aborted(body), body
    assert f"bootstrap server 127.0.0.1:{port} cannot be reached" in str(body) and "refused" in str(body), body
    (ps, pb), (ds, db) = _pd(servers["P1"], servers["D"], prompts[0])  # the decode goes on serving
    assert ds == 200 and not _aborted(db), db


def _all_free(rt, urls) -> None:
    T.wait_nothing_held(rt.url, urls)


def test_client_disconnects_and_a_killed_prefill_leave_no_pages_held(servers, prompts, smollm2_dir):
    """Faults through the dlmix router, pages read from each server's own KV usage (heartbeats):

    * clients that go away during the prefill and mid-stream: the router cancels both legs, SGLang aborts them, and
      no page stays held on the prefill or the decode;
    * a prefill killed while it holds a request (stopped, then SIGKILL): the router cancels the decode leg and the
      client gets a clear error naming the prefill's failure (no other prefill is registered with that router); the
      decode frees the room's pages and then serves the next request, whose answer equals the single server's."""
    import os
    import signal

    import httpx

    from dlmix.router.config import RouterConfig
    from dlmix.testing import RouterThread

    rt, d = servers["_router"], servers["D"]
    pd_urls = [servers[n].url for n in ("P1", "P2", "D")]
    _all_free(rt, pd_urls)
    body = {"prompt": prompts[1], "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    for cut_after in (0, 2):  # chunks read before the client goes away (0: during the prefill)
        with httpx.stream("POST", rt.url + "/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    n += 1
                if n >= cut_after:
                    break
        _all_free(rt, pd_urls)
    # a prefill that dies holding a request
    p4 = T.start_server(str(smollm2_dir), T.free_port(), servers["_dir"] / "P4.log", mode="prefill", page_size=64)
    rt4 = None
    try:
        p4.wait_ready()
        rt4 = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="prefix", model_spec=str(smollm2_dir),
                                        instances=[{"id": "P4", "url": p4.url, "role": "prefill", "engine": "sglang",
                                                    "bootstrap_port": p4.bootstrap_port},
                                                   {"id": "D", "url": d.url, "role": "decode", "engine": "sglang"}]))
        os.killpg(p4.proc.pid, signal.SIGSTOP)
        out = {}

        def ask():
            out["r"] = httpx.post(rt4.url + "/v1/completions", json=dict(body, stream=False, max_tokens=8),
                                  timeout=300)
        th = threading.Thread(target=ask)
        th.start()
        time.sleep(3)  # both legs sent; the decode waits for P4's bootstrap
        os.killpg(p4.proc.pid, signal.SIGKILL)
        th.join(300)
        r = out["r"]
        assert r.status_code >= 500 and "prefill" in r.text, (r.status_code, r.text)
        _all_free(rt, [d.url])
        # the decode keeps serving: the next request through the first router equals the single server's answer
        ok = httpx.post(rt.url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": MAX_TOKENS,
                                                          "temperature": 0}, timeout=300)
        ref = httpx.post(servers["S"].url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": MAX_TOKENS,
                                                                     "temperature": 0}, timeout=300)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"], ok.text
        _all_free(rt, pd_urls)
    finally:
        if rt4 is not None:
            rt4.close()
        p4.stop()
