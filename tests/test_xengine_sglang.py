"""PD across engines with an SGLang prefill, end to end: a real SGLang 0.5.23 prefill
(``--disaggregation-transfer-backend dlmix``) feeds a real vLLM CPU decode (``DLMixConnector``) and a real LMDeploy
0.18 decode (``--migration-backend DLMix``) behind the dlmix router, with the real SmolLM2, through the room
hand-off (``plugins/sglang/handoff.py``, :func:`dlmix.router.engines.bridges.sglang_to_vllm` /
``sglang_to_lmdeploy``). Marked slow; skipped with the reason without the SGLang venv
(``scripts/setup_sglang.sh``); the LMDeploy test also without the LMDeploy venv.

Servers (started once for this module):
  P       SGLang ``--disaggregation-mode prefill``, fp32, page 16, a pool of 2,048 tokens (the prompts below add up
          to several times that: a room whose pages were never freed shows within the test)
  D       vLLM ``kv_consumer``, fp32, block 128, vLLM CPU's cache (another engine, block size and arrangement)
  D2, R   LMDeploy ``--role Decode`` and a Hybrid reference in D2's configuration, fp16, block 64
  router  the dlmix router with P and D; router2 with P and D2 (``prefix`` policy: always PD)

References: D itself without a prefill; R for D2. Greedy tokens must be equal, or differ first at a near-tie of
the reference (SGLang's and vLLM's CPU kernels round differently; fp32 -> fp16 for LMDeploy).
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

from dlmix_sglang import testing as T  # noqa: E402

T.require_venv()

from dlmix_lmdeploy import testing as L  # noqa: E402
from dlmix_vllm import testing as V  # noqa: E402

from dlmix.testing import SHARED_CORES_ENV, compare_greedy, pd_router, poll  # noqa: E402

MAX_TOKENS = 16
#: nats (as tests/test_xengine_pd.py)
NEAR_TIE = 0.5
ENV = SHARED_CORES_ENV


@pytest.fixture(scope="module")
def servers(smollm2_dir, tmp_path_factory):
    wd = tmp_path_factory.mktemp("xengine-sglang")
    m = str(smollm2_dir)
    started, routers, out = [], [], {"model": m}
    try:
        d = V.launch("D", m, wd, role="kv_consumer", cpu="nobind", block_size=128, kv_bytes=256 << 20, env=ENV,
                     extra={"io_timeout_s": 30})
        started.append(d)
        p = T.start_server(m, T.free_port(), wd / "P.log", mode="prefill", page_size=16, dtype="float32",
                           max_total_tokens=2048)
        started.append(p)
        if L.lmdeploy_python() is not None:
            for name, extra, kw in (("D2", [], dict(role="Decode", num_blocks=32)),
                                    ("R", ["--logprobs-mode", "raw_logprobs"], dict(role="Hybrid", num_blocks=64))):
                out[name] = L.start_ready(m, wd, started, env={"OMP_NUM_THREADS": "1"}, dtype="float16",
                                          block_size=64, extra=extra + ["--model-name", "smollm2"], **kw)
        p.wait_ready()
        V.wait_ready([d], timeout_s=400)
        pairs = [(d, "vllm")] + ([(out["D2"], "lmdeploy")] if "D2" in out else [])
        for dec, engine in pairs:
            routers.append(pd_router(m, {"url": p.url, "engine": "sglang", "bootstrap_port": p.bootstrap_port},
                                     {"url": dec.url, "engine": engine}))
        yield {**out, "P": p, "D": d, "router": routers[0], "router2": routers[1] if len(routers) > 1 else None}
    finally:
        for s in reversed(started):
            s.stop()
        for r_ in routers:
            r_.close()


def test_sglang_prefill_feeds_vllm_decode_through_the_router(servers, tok):
    """12 prompts of 10..600 tokens, completions and chats, half streamed, through the router: the vLLM decode loads
    the whole prompt from SGLang's pages (page 16, SGLang's per-layer NHD pool -> block 128, vLLM CPU's cache) and
    its greedy tokens equal D alone (near-ties counted). The prompts need about 3,700 tokens of the prefill's
    2,048-token pool over the test: every room's pages were freed after the decode read them."""
    D, rt = servers["D"], servers["router"]
    items = []
    for p in V.prompt_set(tok, [10 + 590 * i // 11 for i in range(12)], kinds=("completion", "chat"), seed=11):
        if p["kind"] == "completion" and not isinstance(p["prompt"], str):
            p = dict(p, prompt=tok.decode(p["prompt"]))
        items.append(p)
    got, loaded = V.through_router(rt.url, D.url, items, MAX_TOKENS)
    refs = {}
    assert loaded == 6
    for p in items:
        refs[p["i"]] = V.result_tokens(V.single(D.url, p["kind"], p["prompt"], MAX_TOKENS))
        V.reset_prefix_cache(D.url)
    same, ties = compare_greedy("sglang fp32/16 -> vllm fp32/128", got, refs, NEAR_TIE, MAX_TOKENS)
    assert same >= len(items) - 3, (same, ties)
    log = servers["P"].log_path.read_text(errors="replace")
    assert "KV hold of room" not in log and "failed on prefill" not in log, log[-3000:]


def test_n2_from_an_sglang_prefill_pulls_its_one_room_for_both_choices(servers):
    """``n=2`` through the router from the SGLang prefill to the vLLM decode: one room is prefilled (the leg asks
    for one choice; SGLang would run a warm-up and two choices under the room, handed off once), vLLM's two choices
    each pull its hold (or find the prompt its sibling loaded), no pull fails, both greedy (``top_k=1``) choices
    equal the same request's ``n=1`` answer through the same path, and SGLang answers the prefill leg (before, the
    leg asked for 2 choices, and SGLang's other requests in the room waited for a decode that never came)."""
    P, D, rt = servers["P"], servers["D"], servers["router"]
    legs = []

    def one_leg_answered():  # the one-choice request's prefill leg, answered in the background
        assert poll(lambda: _prefill_answers(rt.url) >= 1, 60)
        legs.append(_prefill_answers(rt.url))
    out = V.n_choices_through_router(rt.url, D.url, {"model": "smollm2", "prompt": "harbor lantern violet orbit " * 60,
                                                     "max_tokens": 8, "return_token_ids": True},
                                     between=one_leg_answered)
    assert out["choices"] == {0: out["one"], 1: out["one"]}
    assert 1 <= out["pulls"] <= 2 and out["failed_pulls"] == 0
    assert poll(lambda: _prefill_answers(rt.url) == legs[0] + 1, 60), _prefill_answers(rt.url) - legs[0]
    log = P.log_path.read_text(errors="replace")
    assert "KV hold of room" not in log and "failed on prefill" not in log, log[-3000:]


def _prefill_answers(router_url: str) -> float:
    """Prefill legs the router saw answered 2xx (``dlmix_router_prefill_responses_total``, every instance)."""
    return V.metric_sum(router_url, "dlmix_router_prefill_responses_total", 'status="2xx"')


def test_sglang_prefill_feeds_lmdeploy_decode_through_the_router(servers, tok):
    """10 prompts of 10..600 tokens, completions and chats, streamed or not, through the router: the LMDeploy decode
    (fp16, block 64, packed pool) pulls SGLang's pages (fp32, page 16) under the blocks' name and continues from
    SGLang's first token (read from the prefill's metadata row); greedy text equals R except near-ties. A
    Decode-role LMDeploy engine cannot compute a prompt itself, so every answer is decoded from SGLang's KV."""
    if servers.get("D2") is None:
        pytest.skip("no LMDeploy venv (run scripts/setup_lmdeploy.sh)")
    rng = __import__("random").Random(6)
    lengths = [10, 600] + [rng.randint(10, 600) for _ in range(8)]
    ties = L.router_against_reference(servers["router2"].url, servers["R"].url, "smollm2", tok, V.PROSE_WORDS,
                                      lengths, rng, "sglang fp32/16 -> lmdeploy fp16/64", NEAR_TIE, MAX_TOKENS)
    assert ties <= len(lengths) // 2
    log = servers["D2"].log_path.read_text(errors="replace")
    assert "not migrated" not in log, log[-3000:]
