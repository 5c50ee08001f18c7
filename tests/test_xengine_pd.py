"""PD across engines, end to end: a real LMDeploy 0.18 prefill (``--migration-backend DLMix``) feeds a real vLLM CPU
decode (``DLMixConnector``) behind the dlmix router, with the real SmolLM2 (marked slow; skipped with the reason when
the LMDeploy venv of ``scripts/setup_lmdeploy.sh`` is absent).

Servers (started once for this module):
  P       LMDeploy ``--role Prefill``, bf16, block 16, 48 blocks (768 tokens: a hold that is never freed shows within
          a few requests), packed pool ``[B, 2, 16, 3, 64]`` per layer
  D       vLLM ``kv_consumer``, fp32, block 128, vLLM CPU's cache: another engine, block size, dtype and arrangement
  router  the dlmix router (in this process), ``prefix`` policy (always PD), P and D registered through its admin API
  P2      vLLM ``kv_producer``, fp32, block 32
  D2      LMDeploy ``--role Decode``, fp16, block 64, 32 blocks (2048 tokens: blocks it never frees show within
          the test)
  R       LMDeploy Hybrid, fp16, block 64 (D2's configuration), raw logprobs: the reference for D2's answers
  router2 the dlmix router with P2 and D2

The reference for D's answers is D itself without a prefill (the same request straight to D); for D2's, R. Greedy
tokens must be equal, or differ first at a near-tie of the reference (the prefill's KV is rounded differently from
the reference's own prefill: bf16 -> fp32, fp32 -> fp16).
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

pytestmark = pytest.mark.slow

from dlmix_lmdeploy import testing as L  # noqa: E402

L.require_venv()

from dlmix_vllm import testing as V  # noqa: E402

from dlmix.testing import compare_greedy, pd_router, poll  # noqa: E402

MAX_TOKENS = 16
#: nats; the prefill's KV is bf16, the reference's fp32 (tests/test_vllm_pd.py uses the same for bf16 -> fp32)
NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def servers(smollm2_dir, tmp_path_factory):
    wd = tmp_path_factory.mktemp("xengine")
    m = str(smollm2_dir)
    started, routers = [], []
    try:
        d = V.launch("D", m, wd, role="kv_consumer", cpu="1", block_size=128, kv_bytes=256 << 20,
                     extra={"io_timeout_s": 30})
        started.append(d)
        p = L.start_ready(m, wd, started, role="Prefill", dtype="bfloat16", block_size=16, num_blocks=48,
                          env={"OMP_NUM_THREADS": "1"}, extra=["--model-name", "smollm2"])
        p2 = V.launch("P2", m, wd, role="kv_producer", cpu="0", block_size=32, kv_bytes=256 << 20)
        started.append(p2)
        lmd = {name: L.start_ready(m, wd, started, env={"OMP_NUM_THREADS": "1"}, dtype="float16", block_size=64,
                                   extra=extra + ["--model-name", "smollm2"], **kw)
               for name, extra, kw in (("D2", [], dict(role="Decode", num_blocks=32)),
                                       ("R", ["--logprobs-mode", "raw_logprobs"], dict(role="Hybrid", num_blocks=64)))}
        V.wait_ready([d, p2], timeout_s=400)
        for pre, dec in ((p, d), (p2, lmd["D2"])):
            engine = lambda srv: "vllm" if isinstance(srv, V.VllmServer) else "lmdeploy"  # noqa: E731
            routers.append(pd_router(m, {"url": pre.url, "engine": engine(pre)}, {"url": dec.url,
                                                                                "engine": engine(dec)}))
        yield {"P": p, "D": d, "router": routers[0], "P2": p2, "router2": routers[1], **lmd, "model": m}
    finally:
        for s in reversed(started):
            s.stop()
        for r_ in routers:
            r_.close()


def _prompts(tok, n: int, seed: int, lo: int, hi: int) -> list[dict]:
    return V.prompt_set(tok, [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)], kinds=("completion", "chat"),
                        seed=seed)


def _text(p: dict, tok) -> dict:
    """LMDeploy's prefill leg gets the client's body: completions carry the prompt as text here."""
    if p["kind"] == "completion" and not isinstance(p["prompt"], str):
        p = dict(p, prompt=tok.decode(p["prompt"]))
    return p


def test_lmdeploy_prefill_feeds_vllm_decode_through_the_router(servers, tok):
    """12 prompts of 10..600 tokens, completions and chats, half streamed, through the router: the decode loads the
    whole prompt from LMDeploy's blocks (bf16, block 16, packed pool -> fp32, block 128, vLLM CPU) and its greedy
    tokens equal D alone (near-ties counted); 12 prompts of up to 38 blocks each through a 48-block prefill pool
    also show that every hold is freed after the decode read it."""
    D, rt = servers["D"], servers["router"]
    items = [_text(p, tok) for p in _prompts(tok, 12, seed=7, lo=10, hi=600)]
    got, loaded = V.through_router(rt.url, D.url, items, MAX_TOKENS)
    assert loaded == 6
    refs = {}
    for p in items:
        refs[p["i"]] = V.result_tokens(V.single(D.url, p["kind"], p["prompt"], MAX_TOKENS))
        V.reset_prefix_cache(D.url)
    same, ties = compare_greedy("lmdeploy bf16/16 -> vllm fp32/128", got, refs, NEAR_TIE, MAX_TOKENS)
    assert same >= len(items) - 3, (same, ties)


def test_a_prompt_that_differs_from_the_held_one_is_refused_by_the_prefill_and_computed_by_the_decode(servers):
    """The hand-off of prompt A given to a decode of prompt B (what a confused or hostile client could send): the
    LMDeploy prefill's gate compares the vLLM decode's prompt digest with the one it held and refuses, vLLM computes
    B itself (its answer equals D alone) and the refused hold is freed (four forged hand-offs of 19 blocks each
    through the 48-block pool, then a normal request still succeeds)."""
    from dlmix.router.engines import lmdeploy as lmd
    from dlmix.router.engines.bridges import lmdeploy_to_vllm

    P, D = servers["P"], servers["D"]
    for i in range(4):
        a = {"model": "smollm2", "prompt": f"{i} alpha " + "river mountain quiet engine " * 70, "max_tokens": 8,
             "temperature": 0}
        b = dict(a, prompt=f"{i} beta " + "garden silver theory station " * 70)
        with httpx.Client(timeout=300) as c:
            r = c.post(P.url + "/v1/completions", content=lmd.prefill_body(a, False),
                       headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
            kvp = lmd.kv_transfer_params(r.content)
            assert len(kvp["remote_block_ids"]) >= 17
            params = asyncio.run(lmdeploy_to_vllm(P.url, D.url, kvp, r.content))
            assert params["remote_prompt_digest"] is None and params["remote_engine"] == "lmdeploy"
            V.reset_prefix_cache(D.url)
            out = c.post(D.url + "/v1/completions", json=dict(b, kv_transfer_params=params)).json()
            info = out["kv_transfer_params"]["dlmix"]
            assert info["bytes_received"] == 0 and "differs" in (info["error"] or ""), info
            V.reset_prefix_cache(D.url)
            ref = c.post(D.url + "/v1/completions", json=b).json()
            assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    with httpx.Client(timeout=300) as c:
        r = c.post(servers["router"].url + "/v1/completions",
                   json={"model": "smollm2", "prompt": "ocean pocket rhythm " * 150, "max_tokens": 4,
                         "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["kv_transfer_params"]["dlmix"]["loaded_tokens"] == r.json()["usage"]["prompt_tokens"]


def test_n2_from_an_lmdeploy_prefill_pulls_its_one_hold_for_both_choices(servers):
    """``n=2`` through the router from the LMDeploy prefill to the vLLM decode: the prefill runs once (LMDeploy
    knows no ``n``), the router's decode leg names 2 consumers, vLLM's two choices each pull the one hold (or find
    the prompt its sibling loaded), the prefill refuses none of them, and both greedy (``top_k=1``) choices equal
    the same request's ``n=1`` answer through the same path. Before, the first choice's ``blocks_consumed`` freed
    the hold and the second choice's pull was refused ("not held here") and recomputed. A chat request for 2
    choices works the same way (its prefill leg asks LMDeploy for one: LMDeploy refuses ``n > 1`` with
    ``with_cache``)."""
    P, D, rt = servers["P"], servers["D"], servers["router"]
    prompt = "harbor lantern violet orbit " * 60
    out = V.n_choices_through_router(rt.url, D.url, {"model": "smollm2", "prompt": prompt, "max_tokens": 8,
                                                     "return_token_ids": True})
    assert out["choices"] == {0: out["one"], 1: out["one"]}
    assert 1 <= out["pulls"] <= 2  # a choice scheduled after its sibling's load may find the prompt cached locally
    assert out["failed_pulls"] == 0
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
    failed0 = V.metric_sum(D.url, "vllm:dlmix_kv_failed_transfers_total")
    with httpx.Client(timeout=300) as c:
        V.reset_prefix_cache(D.url)
        one = c.post(rt.url + "/v1/chat/completions", json=dict(chat, temperature=0))
        assert one.status_code == 200, one.text[:500]
        V.reset_prefix_cache(D.url)
        r = c.post(rt.url + "/v1/chat/completions", json=dict(chat, temperature=1.0, top_k=1, n=2))
        assert r.status_code == 200, r.text[:500]
    texts = [ch["message"]["content"] for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])]
    assert texts == [one.json()["choices"][0]["message"]["content"]] * 2
    assert V.metric_sum(D.url, "vllm:dlmix_kv_failed_transfers_total") - failed0 == 0
    assert "not held here" not in P.log_path.read_text(errors="replace")
    assert poll(lambda: V.kv_usage(D.url) == 0.0, timeout_s=60)


def test_vllm_prefill_feeds_lmdeploy_decode_through_the_router(servers, tok):
    """8 prompts of 10..600 tokens, completions and chats, streamed or not, through the router: vLLM's prefill
    (fp32, block 32, vLLM CPU's cache) holds the prompt, LMDeploy's decode (fp16, block 64, packed pool) pulls it
    under the blocks' name and continues from vLLM's first token; greedy text equals R (an LMDeploy instance in D2's
    configuration) except near-ties. A Decode-role LMDeploy engine cannot compute a prompt itself (a failed pull is
    an HTTP 500), so every answer is decoded from vLLM's KV. Afterwards vLLM's prefill holds no blocks (its own
    KV usage gauge) and D2's 32-block pool has served more blocks than it has."""
    rng = __import__("random").Random(5)
    lengths = [10, 600] + [rng.randint(10, 600) for _ in range(6)]
    ties = L.router_against_reference(servers["router2"].url, servers["R"].url, "smollm2", tok, V.PROSE_WORDS,
                                      lengths, rng, "vllm fp32/32 -> lmdeploy fp16/64", NEAR_TIE, MAX_TOKENS)
    blocks = sum(-(-(n + MAX_TOKENS) // 64) for n in lengths)
    assert ties <= len(lengths) // 2
    assert blocks > 32
    assert poll(lambda: V.kv_usage(servers["P2"].url) == 0.0, 20), V.kv_usage(servers["P2"].url)
    log = servers["D2"].log_path.read_text(errors="replace")
    assert "not migrated" not in log, log[-3000:]


def test_n2_from_a_vllm_prefill_to_an_lmdeploy_decode_frees_the_hold_after_its_one_pull(servers):
    """``n=2`` through the router from the vLLM prefill to the LMDeploy decode: LMDeploy ignores ``n`` (one choice,
    one pull), and the vLLM prefill's hold is freed right after that pull. Before, the prefill leg told the prefill
    to wait for 2 pulls, and the blocks stayed held until its 120 s hold timeout. A chat request for 2 choices is
    refused (400) before either leg: LMDeploy's decode refuses ``n > 1`` with cache migration."""
    with httpx.Client(timeout=300) as c:
        r = c.post(servers["router2"].url + "/v1/completions",
                   json={"model": "smollm2", "prompt": "copper meadow signal " * 80, "max_tokens": 4,
                         "temperature": 1.0, "top_k": 1, "n": 2})
    assert r.status_code == 200, r.text[:500]
    assert len(r.json()["choices"]) == 1  # LMDeploy 0.18 answers one completion choice whatever n is
    assert poll(lambda: V.kv_usage(servers["P2"].url) == 0.0, 20), V.kv_usage(servers["P2"].url)
    # a chat request for 2 choices: LMDeploy's decode would refuse it after the prefill (cache migration), so the
    # router refuses it before either leg, and the prefill holds nothing for it
    prefills = V.metric_sum(servers["P2"].url, "vllm:request_success_total")
    with httpx.Client(timeout=300) as c:
        r = c.post(servers["router2"].url + "/v1/chat/completions",
                   json={"model": "smollm2", "messages": [{"role": "user", "content": "copper meadow"}],
                         "max_tokens": 4, "n": 2})
    assert r.status_code == 400 and "n > 1" in r.text, r.text[:500]
    assert V.metric_sum(servers["P2"].url, "vllm:request_success_total") == prefills
    assert V.kv_usage(servers["P2"].url) == 0.0
