"""End-to-end prefill/decode with DLMixConnector on real vLLM CPU servers and the real SmolLM2 (marked slow).

Servers (started once for this module, prefill pinned to core 0, decode to core 1, 256 MiB KV cache, eager):
  P1 fp32, block 128, kv_producer (debug dump of held KV pages on)
  D1 fp32, block 128, kv_consumer (default: weights verified)        D2 fp32, block 128, kv_consumer, verify_weights off
  PB (only in the bf16 -> fp32 test): bf16, block 128, kv_producer
  P3 (only in the negative-control test): perturbed weights, fp32, block 128, verify_weights off

Every server runs fp32 except PB: the dtype is only under test in the bf16 -> fp32 case, and bf16 matmuls run tens of
times slower than fp32 on x86 CPUs without AVX-512 BF16/AMX, so that case alone pays for bf16, with short prompts.

References are the decode servers themselves serving the prompt without kv_transfer_params after their prefix cache
was reset (a single instance with the decode configuration). Near-ties: when a heterogeneous pair's greedy output
first differs from the reference at a position where the reference's top-1/top-2 logprob gap is below the stated
threshold, the prompt is counted (and printed) as a near-tie; any other difference fails.
"""
from __future__ import annotations

import json
import random
import time

import pytest

pytestmark = pytest.mark.slow

vllm = pytest.importorskip("vllm")

from dlmix_vllm import testing as T  # noqa: E402

from dlmix.testing import spread_lengths, stop_all  # noqa: E402

MAX_TOKENS = 16
#: top-1/top-2 logprob gap (nats) under which a first divergence counts as a near-tie. Decode recomputes only the
#: prompt's last token against loaded KV while the reference prefills the whole prompt in one pass: two kernel paths
#: whose rounding can flip a near-tie. bf16 logits of this model (|logit| 16..32) are quantized in steps of 0.125
#: (8-bit mantissa); with a bf16 prefill feeding an fp32 decode the KV itself carries bf16 rounding.
#: (block 32 -> 128, fp32, the same threshold: tests/test_xengine_matrix.py, the vLLM -> vLLM cell of the matrix)
NEAR_TIE = {"same": 0.25, "bf16->fp32": 0.5}
BYTES_PER_BLOCK_LAYER_FP32_128 = 3 * 128 * 2 * 64 * 4  # KV heads * block * (K+V) * head size * fp32
LAYERS = 30
KV_BYTES = 256 << 20  # fp32 at the token capacity that 128 MiB gave bf16 (45 blocks of 128 tokens)


@pytest.fixture(scope="module")
def prompts(tok):
    """20 prompts, 10..1000 tokens in geometric steps (:func:`dlmix.testing.spread_lengths`): completions get exact
    token-id lists, chats get text; half stream."""
    return T.prompt_set(tok, spread_lengths(20), seed=1234)


def _start(servers: dict, name: str):
    """PB or P3 (one test each), started unless it already was; not waited for. PB is started as soon as P1, D1 and
    D2 are ready, P3 once the bf16 test is done with PB: each start-up overlaps the tests before its own instead of
    leaving a core idle (a lone vLLM start-up is mostly one process importing at a time), with at most four
    servers alive."""
    if name not in servers:
        wd, m = servers["_dir"], servers["_model"]
        if name == "PB":
            servers[name] = T.launch("PB", m, wd, role="kv_producer", cpu="0", block_size=128, dtype="bfloat16",
                                     extra={"hold_timeout_s": 300})
        else:
            servers[name] = T.launch("P3", servers["_perturbed"], wd, role="kv_producer", cpu="0", block_size=128,
                                     kv_bytes=KV_BYTES, extra={"verify_weights": False, "hold_timeout_s": 60})
    return servers[name]


@pytest.fixture(scope="module")
def servers(smollm2_dir, perturbed_dir, tmp_path_factory):
    wd = tmp_path_factory.mktemp("pd")
    m = str(smollm2_dir)
    s = {
        "P1": T.launch("P1", m, wd, role="kv_producer", cpu="0", block_size=128, kv_bytes=KV_BYTES,
                       extra={"debug_dump_dir": str(wd / "dump"), "hold_timeout_s": 300}),
        "D1": T.launch("D1", m, wd, role="kv_consumer", cpu="1", block_size=128, kv_bytes=KV_BYTES,
                       extra={"io_timeout_s": 30}),
        "D2": T.launch("D2", m, wd, role="kv_consumer", cpu="1", block_size=128, kv_bytes=KV_BYTES,
                       extra={"verify_weights": False, "io_timeout_s": 30}),
    }
    s.update(_dir=wd, _model=m, _perturbed=str(perturbed_dir))
    try:
        T.wait_ready([v for k, v in s.items() if not k.startswith("_")], timeout_s=400)
        _start(s, "PB")
        yield s
    finally:
        stop_all([v for k, v in s.items() if not k.startswith("_")])


def _ids(resp: dict) -> tuple[list[int], list[float]]:
    return T.result_tokens(resp)


def _dlmix(resp: dict) -> dict:
    return (resp.get("kv_transfer_params") or {}).get("dlmix") or {}


def _refs(url: str, items: list[dict]) -> dict[int, tuple[list[int], list[float]]]:
    T.reset_prefix_cache(url)
    out = {}
    for p in items:
        r = T.single(url, p["kind"], p["prompt"], MAX_TOKENS, stream=p["stream"])
        out[p["i"]] = _ids(r)
    T.reset_prefix_cache(url)
    return out


def _compare(case: str, got: dict[int, list[int]], refs: dict, threshold: float) -> tuple[int, int]:
    """Return (identical, near_ties); fail on any divergence that is not a near-tie."""
    return T.compare_greedy(case, got, refs, threshold, MAX_TOKENS)


def _through_pd(P, D, items: list[dict], check_record: bool = True) -> dict[int, list[int]]:
    """Each prompt of ``items`` through P then D (the two-step client); D's generated ids per prompt. With
    ``check_record``, every non-streamed answer's transfer record shows KV loaded and no error."""
    got = {}
    for p in items:
        r = T.two_step(P.url, D.url, p["kind"], p["prompt"], MAX_TOKENS, stream=p["stream"])
        got[p["i"]] = _ids(r["decode"])[0]
        if check_record and not p["stream"]:
            info = _dlmix(r["decode"])
            assert info.get("error") is None and info.get("loaded_tokens", 0) > 0, info
    return got


@pytest.fixture(scope="module")
def d1_refs(servers, prompts):
    return _refs(servers["D1"].url, prompts)


def test_same_config_identical_to_single_instance(servers, prompts, d1_refs):
    """P1 (fp32, 128) -> D1 (fp32, 128), 20 prompts of 10..1000 tokens, chat/completion, streaming or not."""
    P, D = servers["P1"], servers["D1"]
    T.reset_prefix_cache(D.url)
    got = _through_pd(P, D, prompts)
    assert len(got) == 20
    # Decode recomputes only the prompt's last token against the loaded KV (vLLM always does), while the reference
    # computes the whole prompt in one prefill pass; the two kernel paths can round a near-tie either way.
    same, ties = _compare("same", got, d1_refs, NEAR_TIE["same"])
    assert same >= 18


def test_bf16_prefill_to_fp32_decode(servers, prompts, smollm2_dir):
    """The one real bf16 path: PB (bf16 KV cache) -> D2 (fp32), KV converted on the way; 5 short prompts (89..234
    tokens: chat and completion, streamed and not), since bf16 prefill is slow on CPUs without AVX-512 BF16."""
    pb = _start(servers, "PB")
    try:
        T.wait_ready([pb], timeout_s=400)
        D = servers["D2"]
        items = prompts[9:14]
        refs = _refs(D.url, items)
        got = _through_pd(pb, D, items)
        same, ties = _compare("bf16->fp32", got, refs, NEAR_TIE["bf16->fp32"])
        assert same + ties == len(got) and same >= len(got) // 2
    finally:
        pb.stop()
        _start(servers, "P3")  # for the negative-control test


def test_second_request_moves_only_missing_blocks(servers, tok):
    P, D = servers["P1"], servers["D1"]
    T.reset_prefix_cache(D.url)
    rng = random.Random(7)
    prefix = tok(T.prose(rng, 700), add_special_tokens=False).input_ids[:700]
    a = prefix + tok(" " + T.prose(rng, 60), add_special_tokens=False).input_ids[:60]
    b = prefix + tok(" " + T.prose(rng, 90), add_special_tokens=False).input_ids[:90]
    metric = "vllm:dlmix_kv_bytes_received_total"
    before = T.metric_sum(D.url, metric)
    ra = T.two_step(P.url, D.url, "completion", a, MAX_TOKENS)
    rb = T.two_step(P.url, D.url, "completion", b, MAX_TOKENS)
    ia, ib = _dlmix(ra["decode"]), _dlmix(rb["decode"])
    # first request: nothing local, all 760 tokens = 6 blocks of 128 read
    assert ia["local_hit_tokens"] == 0 and ia["loaded_tokens"] == 760
    assert ia["bytes_received"] == 6 * LAYERS * BYTES_PER_BLOCK_LAYER_FP32_128
    # second: D holds the 5 full blocks of the common 700-token prefix; only tokens 640..789 (blocks 5, 6) move
    assert ib["local_hit_tokens"] == 640 and ib["loaded_tokens"] == 790 - 640
    assert ib["bytes_received"] == 2 * LAYERS * BYTES_PER_BLOCK_LAYER_FP32_128
    # the same bytes through vLLM's KV connector stats -> Prometheus (stats travel with the next engine steps)
    want = ia["bytes_received"] + ib["bytes_received"]
    deadline = time.monotonic() + 120
    while T.metric_sum(D.url, metric) - before != want and time.monotonic() < deadline:
        time.sleep(0.5)
    assert T.metric_sum(D.url, metric) - before == want
    refs = _refs(D.url, [{"i": 0, "kind": "completion", "prompt": b, "stream": False}])
    assert _ids(rb["decode"])[0] == refs[0][0]


def test_layout_descriptor_matches_transformers(servers, prompts, smollm2_dir):
    """The K/V of a prompt read from P1's real registered cache (fp32) through dlmix's descriptor equal transformers'
    post-RoPE past_key_values (5 % relative L2 per layer)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from dlmix.kv import KVLayout
    from dlmix.kv.ops import pack

    p = next(x for x in prompts if x["kind"] == "completion" and 150 <= x["n"] <= 400)
    r = T.two_step(servers["P1"].url, servers["D1"].url, "completion", p["prompt"], 4)
    rid = r["params"]["remote_request_id"]
    from dlmix_vllm.worker import dump_name

    f = servers["_dir"] / "dump" / dump_name(rid)
    with safe_open(str(f), "pt") as fh:
        pages, meta = fh.get_tensor("pages"), fh.metadata()
    lay = KVLayout.from_json(meta["layout"])
    n = int(meta["num_tokens"])
    assert n == len(p["prompt"]) and lay.arrangement == "vllm_cpu" and lay.block_size == 128
    L, H, D = lay.model.num_layers, lay.num_local_heads, lay.model.head_size
    wire = pack(lay, [pages[i] for i in range(L)], list(range(pages.shape[1])), lay, 0, n)
    assert lay.dtype == "fp32", lay.dtype
    ours = wire.view(torch.float32).view(L, 2, n, H, D)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    with torch.no_grad():
        pkv = model(torch.tensor([p["prompt"]]), use_cache=True).past_key_values
    worst = 0.0
    for layer in range(L):
        for plane, ref in ((0, pkv.layers[layer].keys), (1, pkv.layers[layer].values)):
            ref = ref[0].float().transpose(0, 1)  # [T, H, D]
            rel = float((ours[layer, plane] - ref).norm() / ref.norm())
            worst = max(worst, rel)
    print(f"layout check: {n} tokens, worst per-layer relative L2 error {worst:.4f}")
    assert worst < 0.05
    # a wrong reading (e.g. the last axis as per-token [K|V]) is far off
    wrong = pages[0].view(pages.shape[1], H, 128, 2 * D).permute(0, 2, 1, 3).reshape(-1, H, 2 * D)[:n, :, :D].float()
    ref0 = pkv.layers[0].keys[0].float().transpose(0, 1)
    assert float((wrong - ref0).norm() / ref0.norm()) > 0.5


def test_other_weights_refused_by_default_and_change_output_when_relaxed(servers, prompts, perturbed_dir, d1_refs):
    p3 = _start(servers, "P3")
    try:
        T.wait_ready([p3], timeout_s=400)
        items = [p for p in prompts if not p["stream"]][5:9]  # 113..483 tokens
        # default decode (D1): refused with the reason, recomputed locally -> equal to D1's own output
        T.reset_prefix_cache(servers["D1"].url)
        for p in items:
            r = T.two_step(p3.url, servers["D1"].url, p["kind"], p["prompt"], MAX_TOKENS)
            info = _dlmix(r["decode"])
            assert "fingerprint" in info.get("refused", ""), info
            assert _ids(r["decode"])[0] == d1_refs[p["i"]][0]
        # relaxed decode (D2, fp32): the other weights' KV is used and changes the output
        refs = _refs(servers["D2"].url, items)
        changed = 0
        for p in items:
            r = T.two_step(p3.url, servers["D2"].url, p["kind"], p["prompt"], MAX_TOKENS)
            info = _dlmix(r["decode"])
            assert info.get("error") is None and info.get("loaded_tokens", 0) > 0, info
            changed += _ids(r["decode"])[0] != refs[p["i"]][0]
        print(f"negative control: {changed}/{len(items)} outputs changed with other prefill weights")
        assert changed >= len(items) - 1
    finally:
        p3.stop()


def _open_and_drop(url: str, path: str, body: dict) -> None:
    """Send a streaming request and disconnect right after the response headers (vLLM aborts the request)."""
    import httpx

    with httpx.Client(timeout=120) as c:
        with c.stream("POST", url + path, json=dict(body, stream=True)) as r:
            assert r.status_code == 200
            time.sleep(0.1)  # the server adds the request to the engine right after the headers


def _wait_idle(url: str, timeout_s: float = 120.0) -> float:
    deadline = time.monotonic() + timeout_s
    while T.kv_usage(url) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    return T.kv_usage(url)


def test_aborts_on_either_side_leave_no_blocks_held(servers, tok):
    """Client disconnects abort the request: at P during prefill (nothing is held), and at D after P held the KV
    (D's worker tells P to free, or finishes/cancels its pull first); both instances return to 0 % KV usage long
    before P's 300 s hold timeout."""
    P, D = servers["P1"], servers["D1"]
    T.reset_prefix_cache(D.url)
    rng = random.Random(5)
    import httpx

    for _ in range(2):
        prompt = tok(T.prose(rng, 1100), add_special_tokens=False).input_ids[:1000]
        path, body = T.request_body("completion", prompt, 1, ktp={"do_remote_decode": True})
        _open_and_drop(P.url, path, body)  # abort at P during prefill: nothing may stay held
        with httpx.Client(timeout=120) as c:
            held = c.post(P.url + path, json=body).json()["kv_transfer_params"]  # P now holds this KV
        path_d, body_d = T.request_body("completion", prompt, MAX_TOKENS, ktp=held)
        _open_and_drop(D.url, path_d, body_d)  # abort at D while it waits for / loads the KV
    assert _wait_idle(D.url) == 0.0
    assert _wait_idle(P.url) == 0.0


def _choices(resp, stream: bool) -> dict[int, list[int]]:
    """Generated token ids per choice index of a completion answer (SSE text when ``stream``)."""
    out: dict[int, list[int]] = {}
    for ev in T.parse_sse(resp.text) if stream else [resp.json()]:
        for ch in ev.get("choices") or []:
            out.setdefault(ch["index"], []).extend(ch.get("token_ids") or [])
    return out


def test_n2_through_router_shares_the_prefill_kv(servers, smollm2_dir):
    """``n=2`` through the router on P1 -> D1: both greedy (``top_k=1``) choices equal the single instance's greedy
    answer, seeded sampled choices equal the single instance's own ``n=2`` answer (streamed), each prefill ran once,
    the decode pulled and no pull failed, the prefill refused nothing ("not held here"), and both instances end at
    0 % KV usage (nothing held)."""
    import httpx

    from dlmix.router.config import RouterConfig
    from dlmix.testing import RouterThread

    P, D = servers["P1"], servers["D1"]
    insts = [{"id": "P", "url": P.url, "role": "prefill", "engine": "vllm", "model": "smollm2", "chip": "cpu-x86",
              "block_size": 128},
             {"id": "D", "url": D.url, "role": "decode", "engine": "vllm", "model": "smollm2", "chip": "cpu-x86",
              "block_size": 128}]
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="cost", policy_params={"local_max_uncached": 0},
                                   model_spec=str(smollm2_dir), instances=insts, health_interval_s=1.0))
    try:
        prompts = [[(i * 37 + 11 * k) % 3000 + 100 for i in range(300)] for k in range(2)]
        base = {"model": "smollm2", "max_tokens": 12, "return_token_ids": True}
        # vLLM refuses n > 1 with temperature 0; top_k=1 samples the argmax (greedy), a seed fixes sampled choices
        greedy_n2 = dict(base, temperature=1.0, top_k=1, n=2)
        seeded_n2 = dict(base, temperature=0.8, seed=7, n=2, stream=True)
        with httpx.Client(timeout=300) as c:
            T.reset_prefix_cache(D.url)
            ref0 = c.post(D.url + "/v1/completions", json=dict(base, prompt=prompts[0], temperature=0)).json()
            ref0 = ref0["choices"][0]["token_ids"]
            T.reset_prefix_cache(D.url)
            r = c.post(D.url + "/v1/completions", json=dict(seeded_n2, prompt=prompts[1]))
            ref1 = _choices(r, True)  # the single instance's own two seeded choices
            assert len(ref1) == 2, r.text[:300]
            T.reset_prefix_cache(D.url)
            pulls0 = T.metric_sum(D.url, "vllm:dlmix_kv_transfers_total")
            failed0 = T.metric_sum(D.url, "vllm:dlmix_kv_failed_transfers_total")
            prefills0 = T.metric_sum(P.url, "vllm:request_success_total")
            refused0 = P.log.read_text(errors="replace").count("not held here")
            r = c.post(rt.url + "/v1/completions", json=dict(greedy_n2, prompt=prompts[0]))
            assert r.status_code == 200, r.text[:500]
            assert _choices(r, False) == {0: ref0, 1: ref0}
            r = c.post(rt.url + "/v1/completions", json=dict(seeded_n2, prompt=prompts[1]))
            assert r.status_code == 200, r.text[:500]
            assert _choices(r, True) == ref1  # same seed semantics as the single instance (child i: seed + i)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (T.kv_usage(P.url) > 0 or T.kv_usage(D.url) > 0
                                               or T.metric_sum(D.url, "vllm:dlmix_kv_transfers_total") - pulls0 < 4):
            time.sleep(0.5)
        pulls = T.metric_sum(D.url, "vllm:dlmix_kv_transfers_total") - pulls0
        print(f"n=2 through PD: {pulls:.0f} pulls for 2 requests x 2 choices")
        assert 2 <= pulls <= 4  # a choice scheduled after its sibling's load may find the prompt cached locally
        assert T.metric_sum(D.url, "vllm:dlmix_kv_failed_transfers_total") - failed0 == 0
        assert T.kv_usage(P.url) == 0.0 and T.kv_usage(D.url) == 0.0
        assert P.log.read_text(errors="replace").count("not held here") == refused0
        assert T.metric_sum(P.url, "vllm:request_success_total") - prefills0 == 2  # one prefill per request
    finally:
        rt.close()


def test_prefill_killed_between_steps_decode_recomputes(servers, tok):
    """Runs last: kills P1. D1 fails the load fast, reports the blocks, recomputes, and nothing stays held."""
    P, D = servers["P1"], servers["D1"]
    # before it dies: P1 released everything the decodes of the tests before consumed
    assert _wait_idle(P.url) == 0.0
    T.reset_prefix_cache(D.url)
    prompt = tok(T.prose(random.Random(99), 500), add_special_tokens=False).input_ids[:450]

    def kill(params):
        P.kill()

    t0 = time.monotonic()
    r = T.two_step(P.url, D.url, "completion", prompt, MAX_TOKENS, between=kill, timeout_s=120)
    elapsed = time.monotonic() - t0
    info = _dlmix(r["decode"])
    print(f"prefill killed: decode done in {elapsed:.1f}s, transfer record {json.dumps(info)}")
    assert info.get("error") and info.get("failed_blocks", 0) == 4  # 450 tokens = 4 blocks of 128 recomputed
    assert info.get("loaded_tokens") == 0 and info.get("bytes_received") == 0, info  # what arrived, not what was asked
    refs = _refs(D.url, [{"i": 0, "kind": "completion", "prompt": prompt, "stream": False}])
    assert _ids(r["decode"])[0] == refs[0][0]
    # nothing left held: decode servers idle at 0 % KV usage
    for name in ("D1", "D2"):
        assert _wait_idle(servers[name].url) == 0.0, name
