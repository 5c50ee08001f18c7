"""End-to-end checks of the dlmix router against REAL vLLM CPU servers (SmolLM2-135M, fp32, block size 32).

0. vLLM CPU serves SmolLM2 over the OpenAI API: the greedy chat answer equals transformers' (both fp32).
1. Block hashes: the router's tokenizer/chat-template path + sha256_cbor chained hashing produce exactly the
   ``BlockStored`` hashes the engine publishes (as ints, same order), decoded with the router's own decoder; a
   :class:`PrefixIndex` fed by those events predicts the engine's measured prefix hit of a second request.
2. Through the router (in-process, two ``both`` instances pinned to cores 0 and 1): greedy answers (streamed and not)
   equal the chosen instance's direct answers token for token; unknown request fields pass through; a backend 400
   reaches the client with the backend's status and error body; a request sharing a long prefix that was sent
   *directly* to one engine (so only that engine's KV events can tell the router) is routed to that engine, which
   then reports the expected ``vllm:prefix_cache_hits_total``.

KV events use ``ipc://`` endpoints: vLLM 0.32's ZMQ publisher binds only ``*``/``::``/``ipc``/``inproc`` endpoints
and *connects* to a concrete ``tcp://127.0.0.1:PORT`` (``ZmqEventPublisher._is_bind_endpoint``), so a loopback
endpoint that both sides can use with a connecting SUB (the router) is ``ipc://``.

The engines serve fp32: no check here depends on the dtype, and bf16 matmuls are tens of times slower on x86 CPUs
without AVX-512 BF16. A SUB socket only receives what is published after its subscription reached the publisher (ZMQ's
"slow joiner"), so before relying on events the tests send probe requests until one's events arrive.
"""
from __future__ import annotations

import json
import os
import re
import time

import httpx
import pytest

pytest.importorskip("vllm")
zmq = pytest.importorskip("zmq")

from dlmix.engine_process import EngineProcess, VLLMServerSpec, free_port  # noqa: E402
from dlmix.net import iter_sse_lines  # noqa: E402
from dlmix.router.config import RouterConfig  # noqa: E402
from dlmix.router.kv_events.vllm import BlockStored, apply_batch, decode_batch  # noqa: E402
from dlmix.routing.prefix_index import PrefixIndex  # noqa: E402
from dlmix.router.server import Router  # noqa: E402
from dlmix.testing import RouterThread, wait_until  # noqa: E402

pytestmark = pytest.mark.slow

BS = 32
MODEL = "smollm2"
HASH_SEED = os.environ.get("PYTHONHASHSEED")  # the engines inherit our environment


def _text(topic: str, n: int) -> str:
    """Deterministic English-like filler of ``n`` sentences about ``topic`` (~12 tokens per sentence)."""
    things = ["river", "mill", "library", "orchard", "harbour", "bridge", "market", "tower", "garden", "school"]
    verbs = ["watched", "repaired", "painted", "measured", "visited", "described", "counted", "guarded"]
    return " ".join(f"In year {1700 + 7 * i} the {topic} keeper {verbs[i % len(verbs)]} the "
                    f"{things[(3 * i) % len(things)]} number {i * 13 % 97}." for i in range(n))


# ----------------------------------------------------------------------------------------------- fixtures / helpers
class Engine:
    def __init__(self, proc: EngineProcess, events: str):
        self.proc, self.events, self.url = proc, events, proc.url


@pytest.fixture(scope="module")
def engines(smollm2_dir, tmp_path_factory):
    """Two vLLM CPU servers (cores 0 and 1) with sha256_cbor prefix caching and ZMQ KV events (ipc)."""
    d = tmp_path_factory.mktemp("vllm-e2e")
    out = []
    for name, core in (("a", "0"), ("b", "1")):
        ev = f"ipc://{d}/{name}-kvev.ipc"
        spec = VLLMServerSpec(
            model=str(smollm2_dir), port=free_port(), dtype="float32", block_size=BS, max_model_len=2048,
            kv_cache_bytes=256 << 20, cpu_bind=core, served_model_name=MODEL,
            extra_args=["--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
                        "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                          "endpoint": ev})])
        out.append(Engine(EngineProcess(spec, name=f"vllm-{name}", log_dir=d), ev))
    try:
        for e in out:  # start both, then wait: the two start-ups overlap
            e.proc.start()
        for e in out:
            e.proc.wait_ready(timeout_s=400)
        yield out
    finally:
        for e in out:
            e.proc.stop()


_probes = iter(range(1, 1 << 30))


def _until_events_flow(url: str, arrived, what: str) -> None:
    """Send probe completions (each with its own first block) directly to the engine at ``url`` until
    ``arrived(wait_s)`` sees events of one (ZMQ slow joiner: a subscription takes effect some time after connect)."""
    def probe() -> bool:
        k = next(_probes)
        r = _post(url, "/v1/completions", {"model": MODEL, "prompt": f"Probe {k}. " + _text(f"probe {k}", 4),
                                           "max_tokens": 1})
        assert r.status_code == 200, r.text
        return arrived(2.0)
    wait_until(probe, 180, what, interval_s=0)


class EventTap:
    """Synchronous SUB socket on an engine's KV-event endpoint, decoding with the router's decoder. Returns once
    the subscription is live (a probe request's events arrived), with nothing pending."""

    def __init__(self, endpoint: str, url: str):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        _until_events_flow(url, lambda wait_s: self.sock.poll(int(wait_s * 1000)) != 0, "a KV-event subscription")
        self.drain()

    def drain(self) -> None:
        while self.sock.poll(200):
            self.sock.recv_multipart()

    def stored_until(self, n_blocks: int, timeout: float = 60.0):
        """(batches, BlockStored hashes in order) once at least ``n_blocks`` stored hashes arrived (+0.5 s)."""
        batches, hashes = [], []
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.sock.poll(500):
                if len(hashes) >= n_blocks:
                    break
                continue
            b = decode_batch(self.sock.recv_multipart()[-1])
            batches.append(b)
            for ev in b.events:
                if isinstance(ev, BlockStored):
                    hashes.extend(ev.block_hashes)
        return batches, hashes

    def close(self) -> None:
        self.sock.close(0)


def _post(url: str, path: str, body: dict, timeout: float = 180.0) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def _metric(url: str, name: str, **labels) -> float:
    """Sum of Prometheus samples ``name{labels...}`` at ``url/metrics`` (0 if absent)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    tot = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        lab = m.group(2) or ""
        if all(f'{k}="{v}"' in lab for k, v in labels.items()):
            tot += float(m.group(3))
    return tot


def _router_for_hashing(smollm2_dir) -> Router:
    return Router(RouterConfig(policy="prefix", tokenizer=str(smollm2_dir), hash_algo="sha256_cbor",
                               hash_seed=HASH_SEED, model_spec=str(smollm2_dir)))


# ----------------------------------------------------------------------------------------------- 1. block hashes
def test_router_block_hashes_equal_vllm_kv_events(engines, smollm2_dir):
    eng = engines[0]
    router = _router_for_hashing(smollm2_dir)
    tap = EventTap(eng.events, eng.url)
    index = PrefixIndex()
    try:
        cases = [
            ("/v1/chat/completions", True,
             {"model": MODEL, "messages": [{"role": "system", "content": "You answer about local history."},
                                           {"role": "user", "content": _text("chat", 24)}]}),
            ("/v1/chat/completions", True,  # no system message (the template adds its default one), multi-turn
             {"model": MODEL, "messages": [{"role": "user", "content": _text("turn", 12)},
                                           {"role": "assistant", "content": "Noted: " + _text("reply", 6)},
                                           {"role": "user", "content": "And what happened next?"}]}),
            ("/v1/completions", False, {"model": MODEL, "prompt": _text("completion", 25)}),
        ]
        for path, chat, body in cases:
            body = dict(body, max_tokens=1, temperature=0)
            rr = router._request_from(body, chat)  # the routing path: tokenizer (+ chat template) and hashing
            tokens, _ = router.extractor.extract(chat, body)
            keys = rr.block_hashes(BS)
            assert rr.prompt_len == len(tokens) >= 280, rr.prompt_len
            assert len(keys) == len(tokens) // BS >= 8
            tap.drain()
            r = _post(eng.url, path, body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(tokens)  # same tokenization as the engine
            batches, got = tap.stored_until(len(keys))
            stored = [ev for b in batches for ev in b.events if isinstance(ev, BlockStored)]
            assert all(ev.medium == "GPU" and ev.block_size == BS for ev in stored), stored
            assert [t for ev in stored for t in ev.token_ids] == tokens[: len(keys) * BS]
            assert all(isinstance(h, int) for h in got)
            assert got == keys, (path, got, keys)
            for b in batches:
                apply_batch(index, 0, b)

        # a second completion sharing the first completion's prompt as prefix
        body1 = dict(cases[-1][2], max_tokens=1, temperature=0)
        body2 = dict(body1, prompt=body1["prompt"] + " Finally, the keeper wrote everything down in a red book.")
        t1, _ = router.extractor.extract(False, body1)
        t2, _ = router.extractor.extract(False, body2)
        common = next((i for i, (x, y) in enumerate(zip(t1, t2)) if x != y), min(len(t1), len(t2)))
        expected = min(common // BS, len(t1) // BS)
        assert expected >= 8
        keys2 = router._request_from(body2, False).block_hashes(BS)
        assert index.match(keys2) == {0: expected}
        hits0 = _metric(eng.url, "vllm:prefix_cache_hits_total")
        r = _post(eng.url, "/v1/completions", body2)
        assert r.status_code == 200, r.text
        assert _metric(eng.url, "vllm:prefix_cache_hits_total") - hits0 == expected * BS
    finally:
        tap.close()


# ----------------------------------------------------------------------------------------------- 2. through the router
def _start_router(engines, smollm2_dir, policy: str) -> RouterThread:
    insts = [{"id": n, "url": e.url, "role": "both", "engine": "vllm", "model": MODEL, "chip": "cpu-x86",
              "block_size": BS, "kv_events": e.events} for n, e in zip("AB", engines)]
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy=policy, tokenizer=str(smollm2_dir),
                                   hash_algo="sha256_cbor", hash_seed=HASH_SEED, model_spec=str(smollm2_dir),
                                   instances=insts))
    try:
        for e in engines:  # the router's KV-event subscriptions are live: a probe's blocks reach its index
            def grew(wait_s: float, n0=rt.call(lambda: len(rt.router.index))) -> bool:
                end = time.monotonic() + wait_s
                while time.monotonic() < end:
                    if rt.call(lambda: len(rt.router.index)) > n0:
                        return True
                    time.sleep(0.1)
                return False
            _until_events_flow(e.url, grew, f"the router's KV-event subscription to {e.url}")
    except BaseException:
        rt.close()
        raise
    return rt


@pytest.fixture(scope="module")
def routed(engines, smollm2_dir):
    rt = _start_router(engines, smollm2_dir, "prefix")
    try:
        yield rt, {"A": engines[0], "B": engines[1]}
    finally:
        rt.close()


def _served(rurl: str, **labels) -> dict:
    """Router responses per instance so far (optionally of one status class, e.g. ``status="4xx"``)."""
    return {i: _metric(rurl, "dlmix_router_responses_total", instance=i, **labels) for i in "AB"}


def _chosen(before: dict, after: dict) -> str:
    diff = [i for i in "AB" if after[i] - before[i] == 1]
    assert len(diff) == 1 and sum(after.values()) - sum(before.values()) == 1, (before, after)
    return diff[0]


def _stream(url: str, path: str, body: dict):
    """(status, concatenated text, token ids, [DONE] seen) of an SSE stream."""
    text, ids, done = [], [], False
    with httpx.stream("POST", url + path, json=body, timeout=180) as r:
        status = r.status_code
        for line in iter_sse_lines(r):
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            for ch in json.loads(data).get("choices", []):
                text.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
                ids.extend(ch.get("token_ids") or [])
    return status, "".join(text), ids, done


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_router_answers_equal_direct(routed, path):
    rt, eng = routed
    if path.endswith("chat/completions"):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours of the rainbow."}]}
    else:
        body = {"model": MODEL, "prompt": "The three primary colours are"}
    body.update(max_tokens=16, temperature=0, return_token_ids=True)

    b0 = _served(rt.url)
    r = _post(rt.url, path, body)
    assert r.status_code == 200, r.text
    who = _chosen(b0, _served(rt.url))
    d = _post(eng[who].url, path, body)
    assert d.status_code == 200, d.text
    got, exp = r.json()["choices"][0], d.json()["choices"][0]
    assert got["token_ids"] == exp["token_ids"] and len(exp["token_ids"]) > 0
    assert got.get("text", got.get("message")) == exp.get("text", exp.get("message"))

    # streamed: same tokens and text as a direct stream from the chosen instance
    sbody = dict(body, stream=True)
    b0 = _served(rt.url)
    st, text, ids, done = _stream(rt.url, path, sbody)
    assert st == 200 and done
    who = _chosen(b0, _served(rt.url))
    st2, text2, ids2, done2 = _stream(eng[who].url, path, sbody)
    assert st2 == 200 and done2
    assert (text, ids) == (text2, ids2)
    assert ids == exp["token_ids"]  # streamed and non-streamed greedy answers agree

    # an unknown request field passes through the router (vLLM ignores it: same answer as without it)
    b0 = _served(rt.url)
    r = _post(rt.url, path, dict(body, dlmix_e2e_unknown_field={"nested": [1, 2, 3]}))
    assert r.status_code == 200, r.text
    who = _chosen(b0, _served(rt.url))
    d = _post(eng[who].url, path, body)
    assert r.json()["choices"][0]["token_ids"] == d.json()["choices"][0]["token_ids"]


def test_router_passes_backend_400(routed):
    rt, eng = routed
    long_prompt = _text("overflow", 260)  # > 2048 tokens = max_model_len
    for body in ({"model": MODEL, "prompt": "Hello", "max_tokens": -1},
                 {"model": MODEL, "prompt": long_prompt, "max_tokens": 4}):
        b0 = _served(rt.url, status="4xx")
        r = _post(rt.url, "/v1/completions", body)
        assert r.status_code == 400, r.text
        who = _chosen(b0, _served(rt.url, status="4xx"))
        d = _post(eng[who].url, "/v1/completions", body)
        assert d.status_code == 400
        assert r.json() == d.json() and "error" in r.json()
        assert r.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize("policy", ["prefix", "cost"])
def test_router_routes_shared_prefix_to_holder_by_kv_events(engines, smollm2_dir, policy):
    rt = _start_router(engines, smollm2_dir, policy)
    try:
        _check_prefix_routing(rt, {"A": engines[0], "B": engines[1]}, policy)
    finally:
        rt.close()


def _check_prefix_routing(rt: RouterThread, eng: dict, policy: str) -> None:
    router = rt.router
    prefixes = {"A": _text(f"alpha-{policy}", 34), "B": _text(f"beta-{policy}", 34)}
    keys = {}
    for who, p in prefixes.items():
        # sent DIRECTLY to the engine: the router never saw it, only that engine's KV events can tell it
        r = _post(eng[who].url, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 1})
        assert r.status_code == 200, r.text
        keys[who] = rt.call(lambda p=p: router._request_from({"model": MODEL, "prompt": p}, False).block_hashes(BS))
        assert len(keys[who]) >= 10
    slot = {i.id: i.slot for i in router.instances}
    end = time.monotonic() + 60
    while time.monotonic() < end:
        m = {w: rt.call(lambda w=w: router.index.match(keys[w])) for w in "AB"}
        if all(m[w] == {slot[w]: len(keys[w])} for w in "AB"):
            break
        time.sleep(0.2)
    assert all(m[w] == {slot[w]: len(keys[w])} for w in "AB"), m

    # alternating order A, B, B, A: no load/round-robin tie-break can produce this sequence by chance
    for who, suffix in (("A", " Question: what did the keeper count?"), ("B", " Question: what did the keeper count?"),
                        ("B", " Summary, please."), ("A", " Summary, please.")):
        p = prefixes[who]
        body = {"model": MODEL, "prompt": p + suffix, "max_tokens": 4, "temperature": 0}
        ids = rt.call(lambda: router.extractor.extract(False, body)[0])
        full, _ = rt.call(lambda p=p: router.extractor.extract(False, {"prompt": p}))
        common = next((i for i, (x, y) in enumerate(zip(full, ids)) if x != y), len(full))
        expected_blocks = min(common // BS, len(keys[who]))
        assert expected_blocks >= 10
        b0 = _served(rt.url)
        eh0 = _metric(eng[who].url, "vllm:prefix_cache_hits_total")
        rh0 = _metric(rt.url, "dlmix_router_prefix_hit_tokens_total", instance=who)
        r = _post(rt.url, "/v1/completions", body)
        assert r.status_code == 200, r.text
        assert _chosen(b0, _served(rt.url)) == who
        assert _metric(eng[who].url, "vllm:prefix_cache_hits_total") - eh0 == expected_blocks * BS
        assert _metric(rt.url, "dlmix_router_prefix_hit_tokens_total", instance=who) - rh0 == expected_blocks * BS


def test_router_models_and_client_disconnect_aborts_backend(routed):
    rt, eng = routed
    r = httpx.get(rt.url + "/v1/models", timeout=30)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [MODEL]

    def total(name: str, **labels) -> float:
        return sum(_metric(e.url, name, **labels) for e in eng.values())

    length0, gen0 = total("vllm:request_success_total", finished_reason="length"), total("vllm:generation_tokens_total")
    body = {"model": MODEL, "prompt": "Count from one to one thousand:", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", rt.url + "/v1/completions", json=body, timeout=120) as s:
        assert s.status_code == 200
        n = 0
        for line in iter_sse_lines(s):
            n += line.startswith("data: ")
            if n >= 3:
                break  # the client goes away mid-stream
    # vLLM 0.32 does not count aborts in request_success_total; an aborted request leaves the running set and
    # stops generating long before max_tokens (1500 tokens take minutes here)
    end = time.monotonic() + 60
    while time.monotonic() < end and total("vllm:num_requests_running") > 0:
        time.sleep(0.5)
    assert total("vllm:num_requests_running") == 0
    gen1 = total("vllm:generation_tokens_total")
    time.sleep(3.0)
    assert total("vllm:generation_tokens_total") == gen1 and 3 <= gen1 - gen0 < 1500
    assert total("vllm:request_success_total", finished_reason="length") == length0


QUESTION = "What is the capital of France?"


def _hf_greedy(model_dir: str, max_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    enc = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
    ids = out[0, enc["input_ids"].shape[1]:].tolist()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    return ids[: ids.index(eos)] if eos in ids else ids


def test_vllm_cpu_serves_smollm2_chat_greedy(engines, smollm2_dir):
    """The real SmolLM2 served by vLLM CPU (fp32; the checkpoint is bf16) over the OpenAI chat API: the greedy
    answer's token ids equal transformers' own greedy generation in fp32, and name Paris."""
    max_tokens = 12
    expected_ids = _hf_greedy(str(smollm2_dir), max_tokens)
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True}
    r = _post(engines[0].url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    got_ids = choice.get("token_ids")
    assert got_ids is not None, choice
    got_ids = [t for t in got_ids if t != 2]  # <|im_end|>
    assert got_ids == expected_ids, (choice["message"]["content"], got_ids, expected_ids)
    assert "Paris" in choice["message"]["content"]
