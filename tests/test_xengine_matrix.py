"""The cross-engine PD matrix through one dlmix router, end to end: every ordered pair of prefill engine and decode
engine among vLLM CPU (``DLMixConnector``), SGLang 0.5.23 (``--disaggregation-transfer-backend dlmix``) and LMDeploy
0.18 (``--migration-backend DLMix``), with the real SmolLM2, greedy, each pair's answers against a single instance of
its decode engine in the decode's configuration. Marked slow. The SGLang cells skip with the reason without the
SGLang venv (``scripts/setup_sglang.sh``), the LMDeploy cells without the LMDeploy venv (``scripts/setup_lmdeploy.sh``).

Servers (started once for this module, all at the same time):
  vllm-p      vLLM ``kv_producer``, fp32, block 32 (vLLM CPU's cache)
  vllm-d      vLLM ``kv_consumer``, fp32, block 128; its own reference (the same request straight to it, no prefill)
  sglang-p    SGLang ``--disaggregation-mode prefill``, fp32, page 16, a pool of 2,048 tokens
  sglang-d    SGLang ``--disaggregation-mode decode``, fp32, page 64; S, a single SGLang server in its configuration,
              is its reference
  lmdeploy-p  LMDeploy ``--role Prefill``, bf16, block 16, 48 blocks (768 tokens: a hold never freed shows within a
              few requests), packed pool ``[B, 2, 16, 3, 64]`` per layer
  lmdeploy-d  LMDeploy ``--role Decode``, fp16, block 64, 32 blocks (2,048 tokens); R, an LMDeploy Hybrid instance
              in its configuration with raw logprobs, is its reference
  router      ONE dlmix router with the six PD instances registered (``prefix`` policy, ``allow_pinning``): each
              request names its pair with ``x-dlmix-prefill-instance`` / ``x-dlmix-decode-instance``

Greedy tokens must equal the reference's, or differ first at a near-tie of the reference (the first token is the
prefill engine's own and its CPU kernels round differently; bf16 -> fp32 and fp32 -> fp16 KV on some pairs). The
table in ``docs/pd_core.md`` ("PD across engines") shows what these cells measured.
"""
from __future__ import annotations

import asyncio
import json
import random
from urllib.parse import urlsplit

import httpx
import pytest

pytestmark = pytest.mark.slow

from dlmix_lmdeploy import testing as L  # noqa: E402
from dlmix_sglang import testing as T  # noqa: E402
from dlmix_vllm import testing as V  # noqa: E402

from dlmix.testing import (SHARED_CORES_ENV, compare_greedy, fleet_router, poll, side_by_side, spread_lengths,  # noqa: E402
                          stop_all)

MAX_TOKENS = 16
#: nats; the prefill's KV is rounded otherwise than the reference's own (tests/test_vllm_pd.py uses the same for
#: bf16 -> fp32)
NEAR_TIE = 0.5
ENV = SHARED_CORES_ENV
_WORDS = ("river mountain quiet engine market yellow window garden silver theory station winter bridge signal "
          "harvest lantern ocean pocket rhythm castle meadow copper thunder village orbit canvas planet ribbon").split()


@pytest.fixture(scope="module")
def servers(smollm2_dir, tmp_path_factory):
    wd = tmp_path_factory.mktemp("xengine-matrix")
    m = str(smollm2_dir)
    started, out, insts = [], {"model": m}, []
    rt = None
    try:
        vp = V.launch("vllm-p", m, wd, role="kv_producer", cpu="nobind", block_size=32, kv_bytes=256 << 20, env=ENV)
        started.append(vp)
        vd = V.launch("vllm-d", m, wd, role="kv_consumer", cpu="nobind", block_size=128, kv_bytes=256 << 20, env=ENV,
                      extra={"io_timeout_s": 30})
        started.append(vd)
        out.update({"vllm-p": vp, "vllm-d": vd})
        sgl = T.sglang_python() is not None
        if sgl:
            for name, kw in (("sglang-p", dict(mode="prefill", page_size=16, max_total_tokens=2048)),
                             ("sglang-d", dict(mode="decode", page_size=64)), ("S", dict(page_size=64))):
                out[name] = T.start_server(m, T.free_port(), wd / f"{name}.log", dtype="float32", **kw)
                started.append(out[name])
        if L.lmdeploy_python() is not None:
            common = dict(env={"OMP_NUM_THREADS": "1"}, extra=["--model-name", "smollm2"])
            out["lmdeploy-p"], out["lmdeploy-d"], out["R"] = L.start_all_ready(m, wd, started, [
                dict(common, role="Prefill", dtype="bfloat16", block_size=16, num_blocks=48),
                dict(common, role="Decode", dtype="float16", block_size=64, num_blocks=32),
                dict(common, role="Hybrid", dtype="float16", block_size=64, num_blocks=64,
                     extra=common["extra"] + ["--logprobs-mode", "raw_logprobs"])])
        if sgl:
            for name in ("sglang-p", "sglang-d", "S"):
                out[name].wait_ready()
        V.wait_ready([vp, vd], timeout_s=400)
        for name, role, engine in (("vllm-p", "prefill", "vllm"), ("vllm-d", "decode", "vllm"),
                                   ("sglang-p", "prefill", "sglang"), ("sglang-d", "decode", "sglang"),
                                   ("lmdeploy-p", "prefill", "lmdeploy"), ("lmdeploy-d", "decode", "lmdeploy")):
            if name in out:
                body = {"id": name, "url": out[name].url, "engine": engine, "role": role}
                if name == "sglang-p":
                    body["bootstrap_port"] = out[name].bootstrap_port
                insts.append(body)
        rt = fleet_router(m, insts, allow_pinning=True)
        out["router"] = rt
        yield out
    finally:
        stop_all(reversed(started))
        if rt is not None:
            rt.close()


def _pin(prefill: str, decode: str) -> dict[str, str]:
    """The router headers that send a request to this pair."""
    return {"x-dlmix-prefill-instance": prefill, "x-dlmix-decode-instance": decode}


def _need(servers, *names: str) -> None:
    for n in names:
        if n not in servers:
            venv = "SGLang venv (run scripts/setup_sglang.sh)" if n.startswith("sglang") or n == "S" else \
                "LMDeploy venv (run scripts/setup_lmdeploy.sh)"
            pytest.skip(f"no {venv}")


def _log(server) -> str:
    path = getattr(server, "log_path", None) or server.log
    return path.read_text(errors="replace")


# ------------------------------------------------------------------ into the vLLM decode

def _into_vllm(servers, tok, prefill: str, case: str, n: int, seed: int, longest: int = 600,
               near_tie: float = NEAR_TIE, differ: int = 3) -> None:
    """``n`` prompts of 10..``longest`` tokens, completions and chats, half streamed, from ``prefill`` into vllm-d
    through the router: each answer loaded the whole prompt from the prefill (no local hit, every prompt token, bytes
    received) and its greedy tokens equal vllm-d alone, at most ``differ`` of them parting from it at a near-tie
    (top-2 gap under ``near_tie`` nats; counted)."""
    D, rt = servers["vllm-d"], servers["router"]
    items = []
    lengths = spread_lengths(n, 10, longest)
    for p in V.prompt_set(tok, lengths, kinds=("completion", "chat"), seed=seed):
        if p["kind"] == "completion" and not isinstance(p["prompt"], str):
            p = dict(p, prompt=tok.decode(p["prompt"]))  # LMDeploy's and SGLang's legs get the client's text
        items.append(p)
    got, loaded = V.through_router(rt.url, D.url, items, MAX_TOKENS, headers=_pin(prefill, "vllm-d"))
    assert loaded == n // 2
    refs = {}
    for p in items:
        refs[p["i"]] = V.result_tokens(V.single(D.url, p["kind"], p["prompt"], MAX_TOKENS))
        V.reset_prefix_cache(D.url)
    same, ties = compare_greedy(case, got, refs, near_tie, MAX_TOKENS)
    assert same >= len(items) - differ, (same, ties)


def test_vllm_prefill_feeds_vllm_decode_through_the_router(servers, tok):
    """vLLM fp32/32 -> vLLM fp32/128 (block size only: the same engine and dtype), 4 prompts of 10..1,000 tokens (a
    same-engine pair: ``tests/test_vllm_pd.py`` runs 20 prompts between two vLLM instances): equal to the decode
    alone, at most 1 near-tie under 0.25 nats (what ``tests/test_vllm_pd.py`` allows its same-configuration pair);
    the prefill holds nothing afterwards."""
    _into_vllm(servers, tok, "vllm-p", "vllm fp32/32 -> vllm fp32/128", 4, seed=31, longest=1000, near_tie=0.25,
               differ=1)
    assert poll(lambda: V.kv_usage(servers["vllm-p"].url) == 0.0, 20), V.kv_usage(servers["vllm-p"].url)


def test_lmdeploy_prefill_feeds_vllm_decode_through_the_router(servers, tok):
    """LMDeploy bf16/16 (packed pool) -> vLLM fp32/128, 10 prompts: the decode loads the whole prompt from
    LMDeploy's blocks; 10 prompts of up to 38 blocks each (about 1,600 tokens) through the 48-block (768-token)
    prefill pool also show that every hold is freed after the decode read it."""
    _need(servers, "lmdeploy-p")
    _into_vllm(servers, tok, "lmdeploy-p", "lmdeploy bf16/16 -> vllm fp32/128", 10, seed=7)


def test_sglang_prefill_feeds_vllm_decode_through_the_router(servers, tok):
    """SGLang fp32/page 16 (per-layer NHD pool) -> vLLM fp32/128, 10 prompts, through the room hand-off. The
    prompts of the three SGLang-prefill cells need about 4,000 tokens of the prefill's 2,048-token pool over the
    module (a room left held fails a later cell), and its log names no hold left behind: every room's pages were freed
    after the decode read them."""
    _need(servers, "sglang-p")
    _into_vllm(servers, tok, "sglang-p", "sglang fp32/16 -> vllm fp32/128", 10, seed=11)
    log = _log(servers["sglang-p"])
    assert "KV hold of room" not in log and "failed on prefill" not in log, log[-3000:]


def test_a_prompt_that_differs_from_the_held_one_is_refused_by_the_prefill_and_computed_by_the_decode(servers):
    """The hand-off of prompt A given to a decode of prompt B (what a confused or hostile client could send): the
    LMDeploy prefill's gate compares the vLLM decode's prompt digest with the one it held and refuses, vLLM computes
    B itself (its answer equals vllm-d alone) and the refused hold is freed (four forged hand-offs of 19 blocks each
    through the 48-block pool, then a normal request through the router still succeeds)."""
    _need(servers, "lmdeploy-p")
    from dlmix.router.engines import lmdeploy as lmd
    from dlmix.router.engines.bridges import lmdeploy_to_vllm

    P, D = servers["lmdeploy-p"], servers["vllm-d"]
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
        r = c.post(servers["router"].url + "/v1/completions", headers=_pin("lmdeploy-p", "vllm-d"),
                   json={"model": "smollm2", "prompt": "ocean pocket rhythm " * 150, "max_tokens": 4,
                         "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["kv_transfer_params"]["dlmix"]["loaded_tokens"] == r.json()["usage"]["prompt_tokens"]


def test_n2_from_an_lmdeploy_prefill_pulls_its_one_hold_for_both_choices(servers):
    """``n=2`` from the LMDeploy prefill to the vLLM decode: the prefill runs once (LMDeploy knows no ``n``), the
    router's decode leg names 2 consumers, vLLM's two choices each pull the one hold (or find the prompt its sibling
    loaded), the prefill refuses none of them, and both greedy (``top_k=1``) choices equal the same request's
    ``n=1`` answer through the same path. A chat request for 2 choices works the same way (its prefill leg asks
    LMDeploy for one: LMDeploy refuses ``n > 1`` with ``with_cache``)."""
    _need(servers, "lmdeploy-p")
    P, D, rt = servers["lmdeploy-p"], servers["vllm-d"], servers["router"]
    pin = _pin("lmdeploy-p", "vllm-d")
    prompt = "harbor lantern violet orbit " * 60
    out = V.n_choices_through_router(rt.url, D.url, {"model": "smollm2", "prompt": prompt, "max_tokens": 8,
                                                     "return_token_ids": True}, headers=pin)
    assert out["choices"] == {0: out["one"], 1: out["one"]}
    assert 1 <= out["pulls"] <= 2  # a choice scheduled after its sibling's load may find the prompt cached locally
    assert out["failed_pulls"] == 0
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
    failed0 = V.metric_sum(D.url, "vllm:dlmix_kv_failed_transfers_total")
    with httpx.Client(timeout=300, headers=pin) as c:
        V.reset_prefix_cache(D.url)
        one = c.post(rt.url + "/v1/chat/completions", json=dict(chat, temperature=0))
        assert one.status_code == 200, one.text[:500]
        V.reset_prefix_cache(D.url)
        r = c.post(rt.url + "/v1/chat/completions", json=dict(chat, temperature=1.0, top_k=1, n=2))
        assert r.status_code == 200, r.text[:500]
    texts = [ch["message"]["content"] for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])]
    assert texts == [one.json()["choices"][0]["message"]["content"]] * 2
    assert V.metric_sum(D.url, "vllm:dlmix_kv_failed_transfers_total") - failed0 == 0
    assert "not held here" not in _log(P)
    assert poll(lambda: V.kv_usage(D.url) == 0.0, timeout_s=60)


def _prefill_answers(router_url: str, instance: str) -> float:
    """Prefill legs the router saw ``instance`` answer 2xx (``dlmix_router_prefill_responses_total``)."""
    return V.metric_sum(router_url, "dlmix_router_prefill_responses_total", f'instance="{instance}",status="2xx"')


def test_n2_from_an_sglang_prefill_pulls_its_one_room_for_both_choices(servers):
    """``n=2`` from the SGLang prefill to the vLLM decode: one room is prefilled (the leg asks for one choice; SGLang
    would run a warm-up and two choices under the room, handed off once), vLLM's two choices each pull its hold (or
    find the prompt its sibling loaded), no pull fails, both greedy (``top_k=1``) choices equal the same request's
    ``n=1`` answer through the same path, and SGLang answers the prefill leg (before, the leg asked for 2 choices,
    and SGLang's other requests in the room waited for a decode that never came)."""
    _need(servers, "sglang-p")
    P, D, rt = servers["sglang-p"], servers["vllm-d"], servers["router"]
    legs = []

    def one_leg_answered():  # the one-choice request's prefill leg, answered in the background
        assert poll(lambda: _prefill_answers(rt.url, "sglang-p") >= 1, 60)
        legs.append(_prefill_answers(rt.url, "sglang-p"))
    out = V.n_choices_through_router(rt.url, D.url, {"model": "smollm2", "prompt": "harbor lantern violet orbit " * 60,
                                                     "max_tokens": 8, "return_token_ids": True},
                                     between=one_leg_answered, headers=_pin("sglang-p", "vllm-d"))
    assert out["choices"] == {0: out["one"], 1: out["one"]}
    assert 1 <= out["pulls"] <= 2 and out["failed_pulls"] == 0
    assert poll(lambda: _prefill_answers(rt.url, "sglang-p") == legs[0] + 1, 60), \
        _prefill_answers(rt.url, "sglang-p") - legs[0]
    log = _log(P)
    assert "KV hold of room" not in log and "failed on prefill" not in log, log[-3000:]


# ------------------------------------------------------------------ into the LMDeploy decode

def _into_lmdeploy(servers, tok, prefill: str, case: str, seed: int, near_tie: float = NEAR_TIE) -> None:
    """10 prompts of 10..600 tokens, kinds cycling completion, chat, streamed completion, streamed chat, from
    ``prefill`` into lmdeploy-d (fp16, block 64, packed pool) through the router: greedy text equals R except
    near-ties (top-2 gap of R under ``near_tie`` nats). A Decode-role LMDeploy engine cannot compute a prompt itself
    (a failed pull is an HTTP 500), so every answer is decoded from the prefill's KV; the prompts need more blocks
    than lmdeploy-d's 32."""
    _need(servers, "lmdeploy-d")
    rng = random.Random(seed)
    lengths = spread_lengths(10, 10, 600, shuffle=rng)
    ties = L.router_against_reference(servers["router"].url, servers["R"].url, "smollm2", tok, V.PROSE_WORDS,
                                      lengths, rng, case, near_tie, MAX_TOKENS, headers=_pin(prefill, "lmdeploy-d"))
    assert ties <= len(lengths) // 2
    assert sum(-(-(n + MAX_TOKENS) // 64) for n in lengths) > 32
    log = _log(servers["lmdeploy-d"])
    assert "not migrated" not in log, log[-3000:]


def test_vllm_prefill_feeds_lmdeploy_decode_through_the_router(servers, tok):
    """vLLM fp32/32 -> LMDeploy fp16/64: LMDeploy pulls vLLM's blocks under their name and continues from vLLM's
    first token; afterwards vLLM's prefill holds no blocks (its own KV usage gauge)."""
    # The first token is vLLM's fp32 prefill's own, the reference's comes from LMDeploy's fp16 prefill on the CPU:
    # on the 600-token chat prompt of this set they part at token 0 where R's top-2 gap is 0.875 nats (measured
    # every run of this prompt set, 2026-12-04). The two prefills' arithmetic differs there (fp32 against fp16 on the
    # CPU), not the hand-off (every later token of that answer is decoded from vLLM's KV and was not compared), so
    # this cell's near-tie threshold is 1.0 nats; near-ties are counted and printed all the same.
    _into_lmdeploy(servers, tok, "vllm-p", "vllm fp32/32 -> lmdeploy fp16/64", seed=5, near_tie=1.0)
    assert poll(lambda: V.kv_usage(servers["vllm-p"].url) == 0.0, 20), V.kv_usage(servers["vllm-p"].url)


def test_n2_from_a_vllm_prefill_to_an_lmdeploy_decode_runs_one_migration_per_choice(servers):
    """``n=2`` from the vLLM prefill to the LMDeploy decode (LMDeploy answers one choice to a completion's ``n`` and
    refuses a chat ``n > 1`` with cache migration): the router runs one request per choice, each with its own
    prefill leg and migration, and answers both choices, completion and chat, each equal (greedy, ``top_k=1``) to
    the same request's one-choice answer; the vLLM prefill holds nothing afterwards."""
    _need(servers, "lmdeploy-d")
    P, rt, pin = servers["vllm-p"], servers["router"].url, _pin("vllm-p", "lmdeploy-d")
    with httpx.Client(timeout=300, headers=pin) as c:
        for path, body, text in (
                ("/v1/completions", {"model": "smollm2", "prompt": "copper meadow signal " * 80, "max_tokens": 6},
                 lambda ch: ch["text"]),
                ("/v1/chat/completions", {"model": "smollm2", "max_tokens": 6,
                                          "messages": [{"role": "user", "content": "copper meadow " * 40}]},
                 lambda ch: ch["message"]["content"])):
            one = c.post(rt + path, json=dict(body, temperature=0))
            assert one.status_code == 200, one.text[:500]
            prefills = V.metric_sum(P.url, "vllm:request_success_total")
            r = c.post(rt + path, json=dict(body, temperature=1.0, top_k=1, n=2))
            assert r.status_code == 200, r.text[:500]
            chs = r.json()["choices"]
            assert [ch["index"] for ch in chs] == [0, 1]
            assert [text(ch) for ch in chs] == [text(one.json()["choices"][0])] * 2
            assert V.metric_sum(P.url, "vllm:request_success_total") - prefills == 2  # one prefill leg per choice
            assert poll(lambda: V.kv_usage(P.url) == 0.0, 20), V.kv_usage(P.url)
    log = _log(servers["lmdeploy-d"])
    assert "not migrated" not in log, log[-3000:]


def test_sglang_prefill_feeds_lmdeploy_decode_through_the_router(servers, tok):
    """SGLang fp32/page 16 -> LMDeploy fp16/64: LMDeploy pulls SGLang's pages under the blocks' name and continues
    from SGLang's first token (read from the prefill's metadata row)."""
    _need(servers, "sglang-p")
    _into_lmdeploy(servers, tok, "sglang-p", "sglang fp32/16 -> lmdeploy fp16/64", seed=6)


def test_lmdeploy_prefill_feeds_lmdeploy_decode_through_the_router(servers, tok):
    """LMDeploy bf16/16 -> LMDeploy fp16/64 (another block size and dtype, the same engine) through the same router."""
    _need(servers, "lmdeploy-p")
    _into_lmdeploy(servers, tok, "lmdeploy-p", "lmdeploy bf16/16 -> lmdeploy fp16/64", seed=9)


# ------------------------------------------------------------------ into the SGLang decode

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


def _through(router_url: str, text: str, pin: dict, **extra) -> dict:
    r = httpx.post(router_url + "/v1/completions", headers=pin, json={
        "model": "smollm2", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **extra}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _into_sglang(servers, tok, prefill: str, case: str, seed: int, n: int = 10) -> None:
    """``n`` prompts of 10..600 tokens from ``prefill`` into sglang-d (fp32, page 64, per-layer NHD pool) through the
    room the router filed (or SGLang's own bootstrap for an SGLang prefill): greedy tokens equal S's except
    near-ties."""
    _need(servers, "sglang-d", prefill)
    rng = random.Random(seed)
    items = _prompts(tok, spread_lengths(n, 10, 600, shuffle=rng), seed)
    got, refs = {}, {}
    pin, rt = _pin(prefill, "sglang-d"), servers["router"].url
    # the single server's references side by side with the router requests (another process: both cores work)
    for i, ((text, ids), (out, ref)) in enumerate(zip(items, side_by_side(
            items, lambda it: _through(rt, it[0], pin), lambda it: _reference(servers["S"], it[1])))):
        assert out["usage"]["prompt_tokens"] == len(ids), (out["usage"], len(ids))
        got[i] = out["choices"][0]["token_ids"]
        refs[i] = ref
    same, ties = compare_greedy(case, got, refs, NEAR_TIE, MAX_TOKENS)
    assert same >= len(items) // 2, (same, ties)
    log = _log(servers["sglang-d"])
    assert "failed on decode" not in log, log[-3000:]


def test_vllm_prefill_feeds_sglang_decode_through_the_router(servers, tok):
    """vLLM fp32/32 -> SGLang fp32/page 64: the SGLang decode pulls vLLM's blocks through the room the router
    filed and continues from vLLM's first token. Streaming and chat answer too."""
    _into_sglang(servers, tok, "vllm-p", "vllm fp32/32 -> sglang fp32/64", seed=21)
    rt, pin = servers["router"].url, _pin("vllm-p", "sglang-d")
    text = _prompts(tok, [200], seed=3)[0][0]
    whole = _through(rt, text, pin)["choices"][0]["text"]
    with httpx.stream("POST", rt + "/v1/completions", headers=pin, json={
            "model": "smollm2", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        chunks = [ln for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks) == whole
    r = httpx.post(rt + "/v1/chat/completions", headers=pin, json={
        "model": "smollm2", "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 8,
        "temperature": 0}, timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text


def test_n2_into_the_sglang_decode_runs_one_room_per_choice_and_holds_are_freed(servers, tok):
    """``n=2`` for the SGLang decode (SGLang would run a warm-up and both choices under one bootstrap room and hang):
    the router runs one request per choice, each with its own room and vLLM prefill leg, and answers both choices,
    not streamed and streamed, each equal to the same request's one-choice answer (greedy, ``top_k=1``); every hold
    of the module so far was read and released (none expired on the prefill)."""
    _need(servers, "sglang-d")
    rt, pin = servers["router"].url, _pin("vllm-p", "sglang-d")
    text = _prompts(tok, [120], seed=8)[0][0]
    one = _through(rt, text, pin)["choices"][0]["token_ids"]
    before = V.metric_sum(rt, "dlmix_router_prefill_responses_total", 'instance="vllm-p"')
    got = _through(rt, text, pin, n=2, temperature=1.0, top_k=1)
    assert [(ch["index"], ch["token_ids"]) for ch in got["choices"]] == [(0, one), (1, one)]
    assert got["usage"]["completion_tokens"] == 2 * len(one)
    with httpx.stream("POST", rt + "/v1/completions", headers=pin, json={
            "model": "smollm2", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 1.0, "top_k": 1,
            "ignore_eos": True, "n": 2, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    streamed: dict = {}
    for ln in lines[:-1]:
        for ch in json.loads(ln[6:])["choices"]:
            streamed[ch["index"]] = streamed.get(ch["index"], "") + ch["text"]
    whole = _through(rt, text, pin)["choices"][0]["text"]
    assert streamed == {0: whole, 1: whole}
    assert V.metric_sum(rt, "dlmix_router_prefill_responses_total", 'instance="vllm-p"') - before == 5
    assert poll(lambda: V.kv_usage(servers["vllm-p"].url) == 0.0, 20), V.kv_usage(servers["vllm-p"].url)
    assert "expired" not in _log(servers["vllm-p"]), _log(servers["vllm-p"])[-3000:]
    log = _log(servers["sglang-d"])
    assert "failed on decode" not in log, log[-3000:]


def test_lmdeploy_prefill_feeds_sglang_decode_through_the_router(servers, tok):
    """LMDeploy bf16/16 (packed pool) -> SGLang fp32/page 64. The prompts need more than the prefill's pool of 768
    tokens: every hold was freed once the decode had read it."""
    _need(servers, "lmdeploy-p")
    _into_sglang(servers, tok, "lmdeploy-p", "lmdeploy bf16/16 -> sglang fp32/64", seed=22)


def test_sglang_prefill_feeds_sglang_decode_through_the_router(servers, tok):
    """SGLang page 16 -> SGLang page 64 (the same engine, another page size), both with the dlmix backend, through
    the same router (SGLang's own bootstrap server on the prefill, no room hand-off); 4 prompts (a same-engine pair:
    ``tests/test_sglang_pd.py`` runs 20 between two SGLang instances)."""
    _into_sglang(servers, tok, "sglang-p", "sglang fp32/16 -> sglang fp32/64", seed=23, n=4)


def test_a_room_the_router_does_not_know_fails_that_request_only(servers, tok):
    """A decode request naming the router as its bootstrap server with a room it never filed (stale or forged): the
    SGLang decode answers an error naming the router's answer instead of waiting, and the next request through the
    router is served."""
    _need(servers, "sglang-d")
    rt = servers["router"].url
    u = urlsplit(rt)
    r = httpx.post(servers["sglang-d"].url + "/v1/completions", json={
        "model": "smollm2", "prompt": "river mountain quiet", "max_tokens": 4, "temperature": 0,
        "bootstrap_host": u.hostname, "bootstrap_port": u.port, "bootstrap_room": 12345}, timeout=120)
    assert r.status_code >= 400 and "unknown here or expired" in r.text, (r.status_code, r.text)
    text = _prompts(tok, [50], seed=5)[0][0]
    assert len(_through(rt, text, _pin("vllm-p", "sglang-d"))["choices"][0]["token_ids"]) == MAX_TOKENS


def test_each_pinned_pair_is_the_pair_that_answers(servers, tok):
    """One short request per available ordered pair (up to 9) through the one router: each is answered by exactly
    the pair it names (the router's own counters: one more 2xx prefill leg on that prefill instance, one more 2xx
    answer from that decode instance, and no other instance's counters move), and an unpinned request is placed
    by the policy as usual."""
    rt = servers["router"].url
    names = [n for n in ("vllm-p", "vllm-d", "sglang-p", "sglang-d", "lmdeploy-p", "lmdeploy-d") if n in servers]

    def counts() -> dict[str, float]:
        return {n: _prefill_answers(rt, n) if n.endswith("-p") else
                V.metric_sum(rt, "dlmix_router_responses_total", f'instance="{n}",status="2xx"') for n in names}
    text = _prompts(tok, [40], seed=8)[0][0]
    for p in [n for n in names if n.endswith("-p")]:
        for d in [n for n in names if n.endswith("-d")]:
            before = counts()
            out = _through(rt, text, _pin(p, d))
            assert out["usage"]["completion_tokens"] == MAX_TOKENS and out["choices"][0]["text"], (p, d, out)
            want = dict(before, **{p: before[p] + 1, d: before[d] + 1})
            assert poll(lambda: counts() == want, 30), (p, d, counts(), want)  # a bridged leg is counted later
    r = httpx.post(rt + "/v1/completions", json={"model": "smollm2", "prompt": text, "max_tokens": 4,
                                                 "temperature": 0}, timeout=300)
    assert r.status_code == 200, r.text
