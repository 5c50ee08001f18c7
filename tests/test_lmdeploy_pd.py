"""End-to-end LMDeploy DistServe with ``--migration-backend DLMix`` on real LMDeploy 0.18 CPU servers and the real
SmolLM2 (marked slow; skipped with the reason when the LMDeploy venv of ``scripts/setup_lmdeploy.sh`` is absent).

Servers (started once for this module with LMDeploy's own CLI, the CPU aid on; :mod:`dlmix_lmdeploy.testing`):
  proxy  ``lmdeploy serve proxy --serving-strategy DistServe`` (LMDeploy's own)
  P      ``--role Prefill``, bf16, block 16, 48 blocks (768 tokens: a leak shows within a few requests)
  D      ``--role Decode``, fp16, block 32: another block size and dtype, converted on the way
  R      a single Hybrid server, fp16, block 32 (the decode's configuration): the reference
"""
from __future__ import annotations

import json
import random

import pytest

pytestmark = pytest.mark.slow

from dlmix_lmdeploy import testing as T  # noqa: E402

if T.lmdeploy_python() is None:
    pytest.skip("no LMDeploy venv (run scripts/setup_lmdeploy.sh, or set DLMIX_LMDEPLOY_VENV)",
                allow_module_level=True)

MAX_TOKENS = 16
#: top-1/top-2 gap (nats) under which a first divergence counts as a near-tie: the prefill's KV carries bf16 rounding
NEAR_TIE = 0.5
_WORDS = ("river mountain quiet engine market yellow window garden silver theory station winter bridge signal "
          "harvest lantern ocean pocket rhythm castle meadow copper thunder village orbit canvas planet ribbon").split()


@pytest.fixture(scope="module")
def servers(smollm2_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("lmdeploy")
    started = []
    try:
        proxy = T.start_proxy(logs)
        started.append(proxy)
        proxy.wait_ready("/nodes/status", timeout_s=120)
        # one at a time, each retried once: LMDeploy 0.18's api_server shuts its multiprocessing manager down while
        # the engine process may still be releasing the manager's condition (zmq_engine.py ``_start_mp_proc``), a
        # start-up race that a loaded machine hits now and then (EOFError, "engine process is not alive")
        specs = {"P": dict(role="Prefill", dtype="bfloat16", block_size=16, num_blocks=48, proxy_url=proxy.url),
                 "D": dict(role="Decode", dtype="float16", block_size=32, num_blocks=64, proxy_url=proxy.url),
                 "R": dict(role="Hybrid", dtype="float16", block_size=32, num_blocks=64,
                           extra=["--logprobs-mode", "raw_logprobs"])}
        servers = {}
        for name, kw in specs.items():
            kw["port"] = T.free_port()  # a retry keeps the port: the proxy may have registered the first attempt
            for attempt in (1, 2):
                s = T.start_api_server(str(smollm2_dir), logs, **kw)
                started.append(s)
                try:
                    s.wait_ready()
                    break
                except RuntimeError:
                    s.stop()
                    if attempt == 2 or "not alive" not in s.log_tail(200):
                        raise
            servers[name] = s
        p, d, r = servers["P"], servers["D"], servers["R"]
        yield {"proxy": proxy, "P": p, "D": d, "R": r, "model": str(smollm2_dir)}
    finally:
        for s in reversed(started):
            s.stop()


def _prompts(n: int, seed: int, lo: int = 5, hi: int = 500) -> list[str]:
    rng = random.Random(seed)
    out = ["The capital of France is"]
    while len(out) < n:
        out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi) * 3 // 4)))
    return out


def _complete(url: str, model: str, prompt: str, session_id: int) -> str:
    """One greedy completion of the raw prompt (LMDeploy's proxy runs DistServe for ``/v1/completions``; its chat
    path fails in LMDeploy 0.18's proxy, which parses the chat id as the session id)."""
    status, out = T.post_json(url + "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "session_id": session_id})
    assert status == 200, (status, out)
    assert "usage" in out and out["usage"]["completion_tokens"] == MAX_TOKENS, (url, out)
    return out["choices"][0]["text"]


def _reference(url: str, prompt: str, tokenizer) -> tuple[str, list[str], list[float]]:
    """The single instance's greedy text for the raw prompt (LMDeploy's ``/generate``), its tokens as text and, per
    token, the gap (nats) between the top-1 and top-2 logprobs."""
    status, out = T.post_json(url + "/generate", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                  "ignore_eos": True, "return_logprob": True,
                                                  "top_logprobs_num": 2})
    assert status == 200, (status, out)
    ids = out["output_ids"]
    assert len(ids) == MAX_TOKENS, out
    gaps = []
    for top in out["meta_info"]["output_top_logprobs"]:
        v = sorted((lp for lp, _ in top), reverse=True)
        gaps.append(v[0] - v[1] if len(v) > 1 else float("inf"))
    return out["text"], [tokenizer.decode([t]) for t in ids], gaps


def _first_divergence(text: str, ref_tokens: list[str]) -> int | None:
    """Index of the first reference token that ``text`` does not continue with (None: same text)."""
    pos = 0
    for k, tok in enumerate(ref_tokens):
        if not text.startswith(tok, pos):
            return k
        pos += len(tok)
    return None if pos == len(text) else len(ref_tokens)


def test_pd_across_block_size_and_dtype_equals_single_instance(servers):
    """Prefill bf16/block 16 -> decode fp16/block 32 through LMDeploy's own proxy: greedy text equals the single
    fp16/block-32 instance (prompts of 5..~500 tokens, up to 32 prefill blocks); a first divergence is allowed only
    where the reference's top-1/top-2 logprob gap is below NEAR_TIE (bf16 rounding of the prefill's KV), counted
    and printed."""
    from transformers import AutoTokenizer

    m = servers["model"]
    tokenizer = AutoTokenizer.from_pretrained(m)
    prompts = _prompts(8, seed=13)
    same = ties = 0
    for i, prompt in enumerate(prompts):
        got = _complete(servers["proxy"].url, m, prompt, 1000 + i)
        ref, tokens, gaps = _reference(servers["R"].url, prompt, tokenizer)
        assert "".join(tokens) == ref and len(gaps) == MAX_TOKENS, (ref, tokens, gaps)
        k = _first_divergence(got, tokens)
        if k is None:
            same += 1
            continue
        gap = gaps[k] if k < len(gaps) else float("inf")
        assert gap < NEAR_TIE, f"prompt {i} differs at token {k} (top-2 gap {gap:.4f}): {got!r} vs {ref!r}"
        ties += 1
        print(f"prompt {i}: near-tie at token {k} (top-2 gap {gap:.4f})")
    print(f"PD bf16/16 -> fp16/32 vs single fp16/32: identical {same}/{len(prompts)}, near-ties {ties} "
          f"(threshold {NEAR_TIE} nats)")
    assert same >= len(prompts) // 2
    log = servers["D"].log_path.read_text(errors="replace")
    assert "not migrated" not in log, log[-3000:]


def test_prefill_blocks_are_freed(servers):
    """Three times the prefill's whole pool (48 blocks of 16 tokens) goes through PD: a hold or session that was
    not freed would leave later requests without blocks."""
    m = servers["model"]
    prompts = _prompts(12, seed=5, lo=200, hi=250)  # ~13-16 blocks each on the prefill
    for i, prompt in enumerate(prompts):
        assert _complete(servers["proxy"].url, m, prompt, 3000 + i)


def test_incompatible_pair_refused_at_connection_with_reason(servers):
    """A prefill whose layout cannot feed this decode (other KV heads, other weights) is refused at
    ``p2p_connect`` with the reasons, instead of moving bytes between unlike pools."""
    d = servers["D"].url
    cfg = dict(tp_size=1, ep_size=1, dp_size=1, pp_size=None, dp_rank=0, block_size=16, num_cpu_blocks=0,
               num_gpu_blocks=64)
    fake = "http://127.0.0.1:9"
    status, body = T.post_json(d + "/distserve/p2p_initialize", dict(
        local_engine_id=d, local_engine_config=cfg, remote_engine_id=fake, remote_engine_config=cfg, protocol=1))
    assert status == 200, body
    info = json.loads(body["kvtransfer_endpoint_info"][0]["endpoint_info"])
    assert info["dlmix"] == 1 and info["role"] == "Decode"
    assert info["layout"]["block_size"] == 32 and info["layout"]["dtype"] == "fp16"
    assert info["layout"]["arrangement"] == "lmdeploy_packed"
    bad = dict(info["layout"], model=dict(info["layout"]["model"], num_kv_heads=5, weights_fingerprint="other"))
    ep = {"dlmix": 1, "role": "Prefill", "transport": info["transport"], "layout": bad}
    status, body = T.post_json(d + "/distserve/p2p_connect", dict(
        protocol=1, remote_engine_id=fake, remote_engine_endpoint_info={"zmq_address": "tcp://127.0.0.1:9"},
        remote_kvtransfer_endpoint_info=[{"protocol": 1, "endpoint_info": json.dumps(ep)}]))
    assert status >= 400
    log = servers["D"].log_path.read_text(errors="replace")
    assert "cannot feed decode this engine: decode has 3 KV heads, prefill 5" in log
    assert "weights fingerprint" in log
    # the decode keeps serving
    assert _complete(servers["proxy"].url, servers["model"], "The capital of France is", 4000)
