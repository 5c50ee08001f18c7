"""Faults on a real LMDeploy PD pair behind the dlmix router (LMDeploy 0.18 CPU servers, SmolLM2; marked slow;
skipped with the reason when the LMDeploy venv of ``scripts/setup_lmdeploy.sh`` is absent): a client that
disconnects during the prefill leg or in the middle of the decode's stream, and a prefill engine killed while
requests are in flight. Every request completes with the right text or fails with a readable error, and afterwards
no KV block stays held on either side.

The block accounting read is the engines' own: both engines register themselves with the router (``router_url``)
and heartbeat the used share of LMDeploy's block manager (:mod:`dlmix_lmdeploy.router_hook`), which counts the blocks
a prefill holds for a decode (LMDeploy's ``cache_usage`` metric does not). The prefill's ``hold_timeout_s`` is 600 s
here, so blocks freed within the tests' waits were freed by the flow itself (consumed by the decode, the request
aborted, or the router's ``free_cache`` when a decode leg did not take them), not by that timeout.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.slow

from dlmix_lmdeploy import testing as T  # noqa: E402

T.require_venv()

HOLD_TIMEOUT_S = 600
_WORDS = ("river mountain quiet engine market yellow window garden silver theory station winter bridge signal "
          "harvest lantern ocean pocket rhythm castle meadow copper thunder village orbit canvas planet ribbon").split()


def _prompt(i: int, n_words: int) -> str:
    return f"Story {i}: " + " ".join(_WORDS[(i + k * 7) % len(_WORDS)] for k in range(n_words))


@pytest.fixture(scope="module")
def pair(smollm2_dir, tmp_path_factory):
    """Router + a prefill (bf16, block 16, 96 blocks) and a decode (fp16, block 64, 32 blocks), each registered with
    the router by its own hook, heartbeating every 0.5 s (:class:`dlmix_lmdeploy.testing.RoutedPair`)."""
    with T.RoutedPair(str(smollm2_dir), tmp_path_factory.mktemp("lmdeploy-faults"),
                      hold_timeout_s=HOLD_TIMEOUT_S) as p:
        yield p


#: answers given one at a time, by prompt (the two tests below send the same six prompts: computed once)
_ALONE: dict[str, str] = {}


def _alone(pair, prompts: list[str]) -> list[str]:
    """Each prompt's answer (8 greedy tokens through the router) given one at a time, computed once per prompt."""
    for p in prompts:
        if p not in _ALONE:
            _ALONE[p] = T.router_request(pair.router.url, pair.model, "completion", p, 8)
    return [_ALONE[p] for p in prompts]


def _idle(pair, names=("P", "D"), timeout_s: float = 90) -> dict:
    """Wait until each engine reports at most the idle figure (a block or two LMDeploy may keep for itself); returns
    the last figures in blocks. Fails naming the engine that still holds blocks."""
    last = pair.settle(names, timeout_s)
    assert all(last[n] is not None and last[n] <= pair.IDLE_BLOCKS for n in names), \
        f"KV blocks still held after {timeout_s} s: {last}"
    return last


def _body(m: str, prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": m, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def _open(url: str, body: dict) -> http.client.HTTPConnection:
    u = urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return c


def test_decode_leg_refused_frees_the_prefill_hold_at_once(pair):
    """A request the prefill leg serves but the decode refuses (``logprobs`` without ``--logprobs-mode`` on the
    decode; the router's prefill leg drops logprobs): the client gets the decode's 400 with its reason, and the
    router's ``free_cache`` (the hold named by its block ids) frees the prefill's blocks long before the hold
    timeout."""
    rt, m = pair.router, pair.model
    _idle(pair)
    status, out = T.post_json(rt.url + "/v1/completions", {**_body(m, _prompt(4, 400), 8), "logprobs": 2})
    assert status == 400 and "logprobs" in json.dumps(out), (status, out)
    print("after the refused decode leg:", _idle(pair))


def test_an_empty_prompt_is_an_error_and_the_engine_goes_on_serving(pair):
    """An empty prompt sent straight to the prefill engine (the router refuses it itself) is answered with an error:
    LMDeploy 0.18's engine loop asserted on it and ended, and the engine served nothing until restarted
    (:mod:`dlmix_lmdeploy.patches`). The pair then serves the next request."""
    rt, m = pair.router, pair.model
    status, out = T.post_json(pair.P.url + "/v1/completions", {"model": m, "prompt": "", "max_tokens": 4})
    assert status == 400, (status, out)  # LMDeploy's answer to an input-length error
    prompt = _prompt(7, 60)
    status, out = T.post_json(pair.P.url + "/v1/completions", _body(m, prompt, 4))
    assert status == 200 and out["usage"]["completion_tokens"] == 1, (status, out)  # a prefill: 1 token; it lives
    assert T.router_request(rt.url, m, "completion", prompt, 8)  # and the pair serves


def test_client_disconnects_leave_no_block_held(pair):
    """A client that goes away (1) while its prompt is being prefilled and (2) after two streamed tokens: afterwards
    neither engine holds a block (the decode aborts its sequence; a prefill hold is consumed by the decode or freed
    by the router when the decode leg did not take it), and both keep serving: the next request answers the same
    text as before the disconnects."""
    rt, m = pair.router, pair.model
    _idle(pair)
    prompt = _prompt(1, 500)  # ~500 tokens: a prefill of about a second or more here
    before = T.router_request(rt.url, m, "completion", prompt, 8)
    _idle(pair)

    # (1) gone during the prefill leg
    c = _open(rt.url, _body(m, _prompt(2, 700), 8))
    time.sleep(0.3)
    c.sock.shutdown(2)
    c.close()
    # (2) gone in the middle of the decode's stream
    c = _open(rt.url, _body(m, _prompt(3, 300), 400, stream=True))
    r = c.getresponse()
    assert r.status == 200
    got = 0
    while got < 2:
        line = r.fp.readline()
        assert line, "stream ended early"
        if line.startswith(b"data: {"):
            got += 1
    c.sock.shutdown(2)
    c.close()
    print("after the disconnects:", _idle(pair))
    assert T.router_request(rt.url, m, "completion", prompt, 8) == before
    # the router's free_cache of a hold the decode had already consumed is a quiet no-op, not LMDeploy's warning
    assert "Invalid Free session -" not in pair.P.log_tail(100_000)


def test_prompts_beyond_the_prefill_pool_keep_their_held_blocks(pair):
    """Six prompts at once whose KV together (about 2,100 tokens) exceeds the prefill's pool (96 blocks of 16 = 1,536
    tokens): the prefill admits the later ones only as decodes consume the earlier ones' KV, and its scheduler must
    never evict a block it holds for a decode to make room (LMDeploy turns a finished prefill's session evictable
    when its request ends). Every answer equals the one given one at a time, twice over."""
    rt, m = pair.router, pair.model
    prompts = [_prompt(10 + i, 250 + 40 * i) for i in range(6)]
    want = _alone(pair, prompts)
    for _ in range(2):
        with ThreadPoolExecutor(6) as ex:
            got = list(ex.map(lambda p: T.post_json(rt.url + "/v1/completions", _body(m, p, 8), timeout=300),
                              prompts))
        assert [st for st, _ in got] == [200] * 6, got
        assert [out["choices"][0]["text"] for _, out in got] == want
    _idle(pair)


def test_a_pull_whose_prefill_is_gone_fails_that_request_and_does_not_raise_into_the_engine():
    """The decode's per-request pull (run from LMDeploy's engine loop) tells the prefill at the end whether it took
    the KV; when the prefill is gone that notice cannot be sent, and the pull still returns its result (the request
    fails with the reason) instead of raising into the engine loop, which would stop the decode engine. Run in the
    LMDeploy venv with a stand-in endpoint whose release raises as the transport does for a dead peer."""
    import subprocess

    code = """
from dlmix_kv_connectors.base import PeerError
from dlmix.pd.endpoint import PullResult
from dlmix_lmdeploy.backend import Peer, Rank

class Endpoint:
    def pull(self, *a, **k):
        return PullResult(loaded_upto=0, error="ConnectionError: prefill gone", failed_block_ids=[3])
    def release(self, *a, **k):
        raise PeerError("cannot connect to prefill at 127.0.0.1:1: [Errno 111] Connection refused")

rank = Rank(role="Decode", layout=None, endpoint=Endpoint())
rank.peers["http://prefill"] = Peer({"kind": "tcp"}, None)
res = rank.pull("http://prefill", 0, [1], [3], [5, 6, 7])
print(repr(res.error), res.failed_block_ids)
"""
    out = subprocess.run([T.lmdeploy_python(), "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "'ConnectionError: prefill gone' [3]", out.stdout
    assert "telling prefill http://prefill that" in out.stderr  # logged as a warning


def test_killed_prefill_fails_its_requests_readably_and_the_decode_frees_everything(pair):
    """Six requests in flight, then the prefill engine is killed (SIGKILL to its process group). Each request either
    answers the same text as when nothing failed, or fails with an HTTP error whose body says why (never a 200 with
    other text: a decode-only LMDeploy instance is not given a whole request when its prefill leg fails);
    afterwards the decode holds no block, the router stops sending requests to the dead prefill, and once a prefill
    runs again on the same address the pair answers as before (the decode's engine survived pulls from a dead
    prefill)."""
    rt, m = pair.router, pair.model
    prompts = [_prompt(10 + i, 250 + 40 * i) for i in range(6)]
    want = _alone(pair, prompts)
    _idle(pair)

    def one(p: str):
        status, out = T.post_json(rt.url + "/v1/completions", _body(m, p, 8), timeout=300)
        return status, out

    with ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(one, p) for p in prompts]
        time.sleep(1.5)
        os.killpg(pair.P.proc.pid, signal.SIGKILL)
        results = [f.result() for f in futs]
    ok = failed = 0
    for (status, out), w in zip(results, want):
        if status == 200:
            assert out["choices"][0]["text"] == w, (out, w)
            ok += 1
        else:
            assert status >= 500 and (out.get("error") or out.get("message") or out.get("raw")), (status, out)
            failed += 1
    print(f"killed prefill: {ok} answered correctly, {failed} failed with a reason: "
          f"{[(s, str(o)[:120]) for s, o in results if s != 200]}")
    assert failed >= 1  # the kill came while requests were in flight
    _idle(pair, names=("D",))
    status, out = T.post_json(rt.url + "/v1/completions", _body(m, prompts[0], 8), timeout=120)
    assert status in (502, 503) and (out.get("error") or out.get("message")), (status, out)
    # the decode survived the pulls that found its prefill gone: a prefill started again on the same address
    # registers, and the pair answers as before
    pair.launch("P", port=int(pair.P.url.rsplit(":", 1)[1]))
    assert [T.router_request(rt.url, m, "completion", p, 8) for p in prompts[:2]] == want[:2]
    _idle(pair)
