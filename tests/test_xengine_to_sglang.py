"""PD across engines into an SGLang decode, end to end: a real vLLM CPU prefill (``DLMixConnector``,
``kv_producer``) and a real LMDeploy 0.18 prefill (``--migration-backend DLMix``) each feed a real SGLang 0.5.23
decode (``--disaggregation-transfer-backend dlmix``) behind the dlmix router, with the real SmolLM2. The router files
each prefill's transfer parameters and first token under a bootstrap room and gives the SGLang decode its own address
as the bootstrap server (:mod:`dlmix.router.rooms`, :func:`dlmix.router.engines.bridges.vllm_to_sglang` /
``lmdeploy_to_sglang``). Marked slow; skipped with the reason without the SGLang venv (``scripts/setup_sglang.sh``);
the LMDeploy test also without the LMDeploy venv.

Servers (started once for this module):
  PV      vLLM ``kv_producer``, fp32, block 32 (vLLM CPU's cache)
  PL      LMDeploy ``--role Prefill``, bf16, block 16
  D       SGLang ``--disaggregation-mode decode``, fp32, page 64: another engine, block size and pool arrangement,
          and for PL another dtype
  S       a single SGLang server in D's configuration: the reference
  router  the dlmix router with PV and D; router2 with PL and D (``prefix`` policy: always PD)

Greedy tokens must equal S's, or differ first at a near-tie of S (the first token is the prefill engine's own: its
CPU kernels round differently from SGLang's; bf16 KV for PL).
"""
from __future__ import annotations

import random

import httpx
import pytest

pytestmark = pytest.mark.slow

from dlmix_sglang import testing as T  # noqa: E402

T.require_venv()

from dlmix_lmdeploy import testing as L  # noqa: E402
from dlmix_vllm import testing as V  # noqa: E402

from dlmix.testing import SHARED_CORES_ENV, compare_greedy, pd_router, side_by_side  # noqa: E402

MAX_TOKENS = 16
#: nats (as tests/test_xengine_pd.py)
NEAR_TIE = 0.5
ENV = SHARED_CORES_ENV
_WORDS = ("river mountain quiet engine market yellow window garden silver theory station winter bridge signal "
          "harvest lantern ocean pocket rhythm castle meadow copper thunder village orbit canvas planet ribbon").split()


@pytest.fixture(scope="module")
def servers(smollm2_dir, tmp_path_factory):
    wd = tmp_path_factory.mktemp("xengine-to-sglang")
    m = str(smollm2_dir)
    started, routers, out = [], [], {"model": m}
    try:
        pv = V.launch("PV", m, wd, role="kv_producer", cpu="nobind", block_size=32, kv_bytes=256 << 20, env=ENV)
        started.append(pv)
        d = T.start_server(m, T.free_port(), wd / "D.log", mode="decode", page_size=64, dtype="float32")
        started.append(d)
        s = T.start_server(m, T.free_port(), wd / "S.log", page_size=64, dtype="float32")
        started.append(s)
        if L.lmdeploy_python() is not None:
            out["PL"] = L.start_ready(m, wd, started, env={"OMP_NUM_THREADS": "1"}, dtype="bfloat16", block_size=16,
                                      role="Prefill", num_blocks=128, extra=["--model-name", "smollm2"])
        d.wait_ready()
        s.wait_ready()
        V.wait_ready([pv], timeout_s=400)
        for p, engine in [(pv, "vllm")] + ([(out["PL"], "lmdeploy")] if "PL" in out else []):
            routers.append(pd_router(m, {"url": p.url, "engine": engine}, {"url": d.url, "engine": "sglang"}))
        yield {**out, "PV": pv, "D": d, "S": s, "router": routers[0],
               "router2": routers[1] if len(routers) > 1 else None}
    finally:
        for x in reversed(started):
            x.stop()
        for r_ in routers:
            r_.close()


def _prompts(tok, lengths: list[int], seed: int) -> list[tuple[str, list[int]]]:
    """``(text, SGLang's token ids of it)`` per length (about that many tokens of random words)."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        text = tok.decode(tok.encode(" ".join(rng.choice(_WORDS) for _ in range(n)))[:n])
        out.append((text, tok.encode(text)))
    return out


def _reference(S, ids: list[int]) -> tuple[list[int], list[float]]:
    st, body = T.generate(S.url, ids, MAX_TOKENS, logprobs=True)
    assert st == 200, body
    tops = body["meta_info"].get("output_top_logprobs") or []
    return body["output_ids"], [(t[0][0] - t[1][0]) if t and len(t) > 1 else float("inf") for t in tops]


def _through(router_url: str, text: str, **extra) -> dict:
    r = httpx.post(router_url + "/v1/completions", json={
        "model": "smollm2", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **extra}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _run(servers, tok, router_url: str, case: str, seed: int) -> None:
    rng = random.Random(seed)
    lengths = [10, 600] + [rng.randint(10, 600) for _ in range(8)]
    items = _prompts(tok, lengths, seed)
    got, refs = {}, {}
    # the single server's references side by side with the router requests (another process: both cores work)
    for i, ((text, ids), (out, ref)) in enumerate(zip(items, side_by_side(
            items, lambda it: _through(router_url, it[0]), lambda it: _reference(servers["S"], it[1])))):
        assert out["usage"]["prompt_tokens"] == len(ids), (out["usage"], len(ids))
        got[i] = out["choices"][0]["token_ids"]
        refs[i] = ref
    same, ties = compare_greedy(case, got, refs, NEAR_TIE, MAX_TOKENS)
    assert same >= len(items) // 2, (same, ties)
    log = servers["D"].log_path.read_text(errors="replace")
    assert "failed on decode" not in log, log[-3000:]


def test_vllm_prefill_feeds_sglang_decode_through_the_router(servers, tok):
    """10 prompts of 10..600 tokens: the SGLang decode (page 64, per-layer NHD pool) pulls the vLLM prefill's
    blocks (block 32, vLLM CPU's cache) through the room the router filed, continues from vLLM's first token, and
    its greedy tokens equal the single SGLang server's except near-ties. Streaming and chat answer too."""
    _run(servers, tok, servers["router"].url, "vllm fp32/32 -> sglang fp32/64", seed=21)
    rt = servers["router"].url
    text = _prompts(tok, [200], seed=3)[0][0]
    whole = _through(rt, text)["choices"][0]["text"]
    with httpx.stream("POST", rt + "/v1/completions", json={
            "model": "smollm2", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        chunks = [ln for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    import json

    assert "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks) == whole
    r = httpx.post(rt + "/v1/chat/completions", json={
        "model": "smollm2", "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 8,
        "temperature": 0}, timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text


def test_n2_is_refused_before_either_leg_and_holds_are_freed(servers, tok):
    """``n=2`` for the SGLang decode: 400 with the reason before the prefill leg (SGLang would run a warm-up and both
    choices under one bootstrap room and hang), so the vLLM prefill holds nothing for it; every hold of the test so
    far was read and released (none expired on the prefill)."""
    rt = servers["router"].url
    before = V.metric_sum(rt, "dlmix_router_prefill_responses_total")
    r = httpx.post(rt + "/v1/completions", json={"model": "smollm2", "prompt": "a b c", "max_tokens": 4, "n": 2},
                   timeout=60)
    assert r.status_code == 400 and "n > 1 is not supported by an SGLang decode" in r.text, r.text
    assert V.metric_sum(rt, "dlmix_router_prefill_responses_total") == before > 0
    log = servers["PV"].log.read_text(errors="replace")
    assert "expired" not in log, log[-3000:]


def test_lmdeploy_prefill_feeds_sglang_decode_through_the_router(servers, tok):
    """10 prompts of 10..600 tokens from the LMDeploy prefill (bf16, block 16, packed pool) into the SGLang decode
    (fp32, page 64): greedy tokens equal the single SGLang server's except near-ties. The prompts need more than the
    prefill's pool of 2,048 tokens: every hold was freed once the decode had read it."""
    if servers.get("router2") is None:
        pytest.skip("no LMDeploy venv (run scripts/setup_lmdeploy.sh)")
    _run(servers, tok, servers["router2"].url, "lmdeploy bf16/16 -> sglang fp32/64", seed=22)


def test_a_room_the_router_does_not_know_fails_that_request_only(servers, tok):
    """A decode request naming the router as its bootstrap server with a room it never filed (stale or forged): the
    SGLang decode answers an error naming the router's answer instead of waiting, and the next request through the
    router is served."""
    from urllib.parse import urlsplit

    rt = servers["router"].url
    u = urlsplit(rt)
    r = httpx.post(servers["D"].url + "/v1/completions", json={
        "model": "smollm2", "prompt": "river mountain quiet", "max_tokens": 4, "temperature": 0,
        "bootstrap_host": u.hostname, "bootstrap_port": u.port, "bootstrap_room": 12345}, timeout=120)
    assert r.status_code >= 400 and "unknown here or expired" in r.text, (r.status_code, r.text)
    text = _prompts(tok, [50], seed=5)[0][0]
    assert len(_through(rt, text)["choices"][0]["token_ids"]) == MAX_TOKENS
