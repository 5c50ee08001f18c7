"""The reference producer (dlmix.pd.reference) against the PD core alone, no engine: fast tests on the tiny
random-weight Llama.

* Its paged cache holds exactly transformers' post-RoPE K/V, in several arrangements unlike vLLM CPU's.
* Over HTTP it answers a prefill leg with contract parameters that decode; a core consumer (a ``vllm_cpu`` fp32
  block-32 rank, the decode side of a vLLM CPU instance) pulls them through the real TCP transport, and the K/V that
  arrive equal transformers' (fp16 storage tolerance); then the producer frees every block.
* A prompt that differs by one token is refused with the reason by the consumer's claim and by the producer's
  security gate; bad prefill-leg requests get 4xx with a reason and hold nothing; holds expire.
"""
from __future__ import annotations

import time

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dlmix.kv import KVLayout, allocate, read_kv  # noqa: E402
from dlmix.pd.consumer import claim  # noqa: E402
from dlmix.pd.contract import decode_params, prompt_digest  # noqa: E402
from dlmix.pd.endpoint import DEFAULT_LOOPBACK_SECRET, KVEndpoint  # noqa: E402
from dlmix.pd.reference.producer import ReferenceConfig, ReferenceProducer  # noqa: E402
from dlmix.pd.reference.server import ReferenceHTTPServer  # noqa: E402
from dlmix.testing import poll  # noqa: E402

PROMPT = list(range(5, 5 + 77))  # 77 token ids: 5 blocks of 16, the last one partial


@pytest.fixture(scope="module")
def model_ref(tiny_model_dir):
    """transformers' K/V ``[T, H, D]`` per layer for PROMPT (fp32), computed directly."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.inference_mode():
        pkv = m(torch.tensor([PROMPT]), use_cache=True).past_key_values
    return [(pkv.layers[i].keys[0].transpose(0, 1).clone(), pkv.layers[i].values[0].transpose(0, 1).clone())
            for i in range(len(pkv.layers))]


def _start(tiny_model_dir, **kw):
    kw.setdefault("kv_cache_bytes", 4 << 20)
    cfg = ReferenceConfig(model_dir=tiny_model_dir, served_model_name="tiny", **kw)
    app = ReferenceProducer(cfg)
    http = ReferenceHTTPServer(app).serve_in_thread()
    return app, http


@pytest.fixture(scope="module")
def producer(tiny_model_dir):
    app, http = _start(tiny_model_dir, arrangement="lmdeploy", block_size=16, dtype="fp16")
    yield app, http
    http.close()
    app.close()


def _consumer(layout_of_producer: KVLayout, num_blocks: int = 16):
    """A consumer rank shaped like a vLLM CPU decode (vllm_cpu, block 32, fp32) over the real TCP transport."""
    dst = KVLayout(layout_of_producer.model, block_size=32, dtype="fp32", arrangement="vllm_cpu", engine="test")
    caches = allocate(dst, num_blocks, fill=0.0)
    ep = KVEndpoint("tcp", f"consumer-{time.monotonic_ns()}", DEFAULT_LOOPBACK_SECRET, "127.0.0.1", 0, dst, caches,
                    4 << 20, io_timeout_s=10.0, registration_wait_s=2.0)
    return dst, caches, ep


def _prefill(url: str, prompt, chat: bool = False, ktp=None) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 1}
    if chat:
        body["messages"] = prompt
    else:
        body["prompt"] = prompt
    body["kv_transfer_params"] = {"do_remote_decode": True} if ktp is None else ktp
    return httpx.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=60)


def test_layout_states_the_cores_weights_fingerprint(producer, tiny_model_dir):
    """The producer's layout carries the core's fingerprint of its folder: the string the vLLM adapter computes
    for the same folder (it re-exports the core's function), so the pair check compares like with like."""
    from dlmix.pd import weights_fingerprint

    app, _ = producer
    fp = weights_fingerprint(tiny_model_dir)
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 32
    assert app.layout.model.weights_fingerprint == fp == weights_fingerprint(str(tiny_model_dir))
    try:
        from dlmix_vllm.layout import weights_fingerprint as vllm_fp
    except ImportError:  # the vLLM adapter needs torch only, but keep this test meaningful without it
        return
    assert vllm_fp is weights_fingerprint


# ---------------------------------------------------------------------------------------------------- the cache
@pytest.mark.parametrize("arrangement,block_size,dtype", [("lmdeploy", 16, "fp16"), ("vllm_lbnhc", 16, "bf16"),
                                                           ("vllm_flash_nhd", 8, "fp32")])
def test_cache_holds_transformers_kv(tiny_model_dir, model_ref, arrangement, block_size, dtype):
    from dlmix.pd.reference.cache import PagedKVCache
    from dlmix.pd.reference.model import TransformersPrefill

    m = TransformersPrefill(tiny_model_dir)
    r = m.prefill(PROMPT)
    lay = KVLayout(model_ref_identity(m), block_size=block_size, dtype=dtype, arrangement=arrangement)
    assert lay.arrangement != "vllm_cpu"
    c = PagedKVCache(lay, 12)
    c.allocate(3)  # the prompt's blocks are not the first ones
    blocks = c.allocate(len(PROMPT))
    assert len(blocks) == -(-len(PROMPT) // block_size)
    c.store(r.keys, r.values, blocks)
    tol = {"fp16": 2e-3, "bf16": 2e-2, "fp32": 1e-6}[dtype]
    for layer, (k_ref, v_ref) in enumerate(model_ref):
        for t in (0, block_size - 1, block_size, len(PROMPT) - 1):
            k, v = read_kv(lay, c.caches, blocks, t, layer)
            assert torch.allclose(k.float(), k_ref[t], atol=tol, rtol=tol), (layer, t)
            assert torch.allclose(v.float(), v_ref[t], atol=tol, rtol=tol), (layer, t)
    c.free(blocks)
    with pytest.raises(ValueError, match="not allocated"):
        c.free(blocks)


def model_ref_identity(m):
    from dlmix.kv import ModelIdentity

    return ModelIdentity(m.architecture, m.num_layers, m.num_kv_heads, m.head_size, m.attention)


# ---------------------------------------------------------------------------------------------------- the pull
def test_prefill_leg_params_and_pull_into_vllm_cpu_layout(producer, model_ref):
    app, http = producer
    r = _prefill(http.url, PROMPT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and len(body["choices"][0]["token_ids"]) == 1
    ktp = body["kv_transfer_params"]
    p = decode_params(ktp)  # the envelope flags are ignored, the rest is the contract
    assert p.engine == "reference" and p.num_tokens == len(PROMPT) and p.digest == prompt_digest(PROMPT)
    src = p.kv_layout
    assert (src.arrangement, src.block_size, src.dtype) == ("lmdeploy", 16, "fp16")
    assert app.stats()["held_requests"] == 1 and app.stats()["used_blocks"] == len(p.block_ids) == 5

    dst, caches, ep = _consumer(src)
    try:
        c = claim(ktp, dst, len(PROMPT), 0, prompt_token_ids=PROMPT)
        assert c.refused is None and (c.start, c.end) == (0, len(PROMPT))
        local = [7, 2, 9]  # 77 tokens in blocks of 32
        res = ep.pull_params(c.params, c.start, c.end, local, digest=prompt_digest(PROMPT))
        assert res.error is None, res.error
        assert res.loaded_upto == len(PROMPT) and res.failed_block_ids == []
        assert res.bytes_received == src.block_bytes() * len(p.block_ids)
        for layer, (k_ref, v_ref) in enumerate(model_ref):
            for t in range(len(PROMPT)):
                k, v = read_kv(dst, caches, local, t, layer)
                assert torch.allclose(k, k_ref[t], atol=2e-3, rtol=2e-3), (layer, t)
                assert torch.allclose(v, v_ref[t], atol=2e-3, rtol=2e-3), (layer, t)
        ep.release(p.transport_for_rank(0), p.request_id, consumed=True)
        assert poll(lambda: app.stats()["held_requests"] == 0)
        st = app.stats()
        assert st["used_blocks"] == 0 and st["free_blocks"] == st["num_blocks"]
        assert st["core"]["consumed"] >= 1 and st["core"]["holds"] == 0
    finally:
        ep.close()


def test_prompt_one_token_off_is_refused_with_reason(producer):
    app, http = producer
    ktp = _prefill(http.url, PROMPT).json()["kv_transfer_params"]
    other = list(PROMPT)
    other[40] += 1
    dst, caches, ep = _consumer(decode_params(ktp).kv_layout)
    try:
        # the consumer's per-request decision
        c = claim(ktp, dst, len(other), 0, prompt_token_ids=other)
        assert c.count == 0 and "prompt differs" in c.refused and "digest" in c.refused
        # the producer's security gate, if a consumer asked anyway
        p = decode_params(ktp)
        res = ep.pull_params(p, 0, len(other), [0, 1, 2], digest=prompt_digest(other))
        assert res.error and "refused" in res.error and "prompt of" in res.error and "differs" in res.error
        assert res.loaded_upto == 0 and res.failed_block_ids == [0, 1, 2]
        assert app.stats()["held_requests"] == 1  # a refused want never changes the hold
        ep.release(p.transport_for_rank(0), p.request_id, consumed=False)
        assert poll(lambda: app.stats()["held_requests"] == 0)
        assert app.stats()["used_blocks"] == 0
    finally:
        ep.close()


def test_perturbed_producer_states_its_own_prompt(tiny_model_dir):
    app, http = _start(tiny_model_dir, perturb_token=-1)
    try:
        ktp = _prefill(http.url, PROMPT).json()["kv_transfer_params"]
        changed = PROMPT[:-1] + [PROMPT[-1] + 1]
        assert ktp["remote_prompt_digest"] == prompt_digest(changed) != prompt_digest(PROMPT)
    finally:
        http.close()
        app.close()


# ---------------------------------------------------------------------------------------------------- errors
def test_bad_requests_get_reasons_and_hold_nothing(producer):
    app, http = producer
    before = app.stats()["used_blocks"]
    cases = [
        ({"model": "tiny", "prompt": PROMPT}, "only serves prefill legs"),
        ({"model": "tiny", "prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": "yes"}}, "prefill legs"),
        ({"model": "tiny", "prompt": [], "kv_transfer_params": {"do_remote_decode": True}}, "prompt"),
        ({"model": "tiny", "prompt": [1, "a"], "kv_transfer_params": {"do_remote_decode": True}}, "prompt"),
        ({"model": "tiny", "prompt": [10 ** 9], "kv_transfer_params": {"do_remote_decode": True}}, "vocabulary"),
        ({"model": "tiny", "prompt": [1] * 5000, "kv_transfer_params": {"do_remote_decode": True}}, "max_model_len"),
    ]
    for body, why in cases:
        r = httpx.post(http.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert why in r.json()["error"]["message"]
    r = httpx.post(http.url + "/v1/chat/completions", json={"messages": "hi",
                                                            "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(http.url + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = httpx.post(http.url + "/v1/embeddings", json={}, timeout=30)
    assert r.status_code == 404
    r = httpx.post(http.url + "/v1/completions", json={"model": "other", "prompt": PROMPT,
                                                       "kv_transfer_params": {"do_remote_decode": True}}, timeout=30)
    assert r.status_code == 404 and "The model `other` does not exist" in r.json()["error"]["message"]
    assert httpx.get(http.url + "/health").status_code == 200
    assert httpx.get(http.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    assert app.stats()["used_blocks"] == before


def test_an_empty_model_name_is_the_served_model_as_in_vllm(producer):
    """vLLM serves a request whose ``model`` is empty (or left out) with its own model (``_is_model_supported``:
    ``if not model_name: return True``); so does the reference producer, and it names its served model in the answer.
    Before, ``"model": ""`` was answered 404 "The model `` does not exist"."""
    app, http = producer
    body = {"model": "", "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(http.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny" and r.json()["kv_transfer_params"]["do_remote_prefill"] is True


def test_cache_full_is_503_and_expired_holds_free_their_blocks(tiny_model_dir):
    app, http = _start(tiny_model_dir, hold_timeout_s=3.0, kv_cache_bytes=16 * 8192)
    try:
        per = app.layout.block_bytes()
        n = app.cache.num_blocks
        assert n == 16 and per == 8192  # 2 layers x K,V x 2 heads x 32 x fp16 x 16 tokens
        long_prompt = list(range(5, 5 + 16 * (n // 2 + 1)))  # more than half the cache
        assert _prefill(http.url, long_prompt).status_code == 200
        r = _prefill(http.url, long_prompt)
        assert r.status_code == 503 and "KV cache full" in r.json()["error"]["message"], r.text
        assert app.stats()["held_requests"] == 1 and per > 0
        assert poll(lambda: app.stats()["held_requests"] == 0)  # expired: nobody pulled
        st = app.stats()
        assert st["used_blocks"] == 0 and st["core"]["expired"] == 1
        assert _prefill(http.url, long_prompt).status_code == 200  # the space is back
    finally:
        http.close()
        app.close()


def test_chat_prefill_uses_the_chat_template(producer, tiny_model_dir):
    from transformers import AutoTokenizer

    app, http = producer
    msgs = [{"role": "user", "content": "Tell me about rivers."}]
    r = _prefill(http.url, msgs, chat=True)
    assert r.status_code == 200, r.text
    ktp = r.json()["kv_transfer_params"]
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False).input_ids
    assert ktp["remote_num_tokens"] == len(ids) and ktp["remote_prompt_digest"] == prompt_digest(ids)
    ep_dst = KVLayout(decode_params(ktp).kv_layout.model, block_size=32, dtype="fp32", arrangement="vllm_cpu")
    assert claim(ktp, ep_dst, len(ids), 0, prompt_token_ids=ids).refused is None


def test_command_line_process_serves_and_stops(tiny_model_dir):
    """``python -m dlmix.pd.reference`` announces url/kv/layout on one JSON line, serves, and exits 0 on SIGTERM."""
    import json
    import os
    import signal
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "dlmix.pd.reference", "--model", str(tiny_model_dir),
                             "--served-model-name", "tiny", "--kv-cache-bytes", str(1 << 20), "--block-size", "8",
                             "--log-level", "WARNING"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read().decode()[-2000:]
        info = json.loads(line)
        assert info["layout"]["arrangement"] == "lmdeploy" and info["layout"]["block_size"] == 8
        assert info["kv"]["kind"] == "tcp" and info["kv"]["port"] > 0
        reg = info["registration"]
        assert (reg["url"], reg["role"], reg["engine"]) == (info["url"], "prefill", "vllm")
        assert reg["kv_layout"] == info["layout"] and reg["contract_version"] == 1
        r = _prefill(info["url"], PROMPT[:20])
        assert r.status_code == 200 and r.json()["kv_transfer_params"]["remote_num_tokens"] == 20
        assert httpx.get(info["url"] + "/stats").json()["held_requests"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    bad = subprocess.run([sys.executable, "-m", "dlmix.pd.reference", "--model", str(tiny_model_dir),
                          "--arrangement", "nope"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "unknown arrangement" in bad.stderr


def test_command_line_refuses_bad_ports_and_missing_model(tiny_model_dir):
    """A port out of range, a port already taken and a missing model folder are clear errors (exit 2), not
    tracebacks (found by a new-user review: OverflowError / OSError / a hub repo-id message before)."""
    import os
    import socket
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    base = [sys.executable, "-m", "dlmix.pd.reference", "--kv-cache-bytes", str(1 << 20), "--block-size", "8"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        for args, want in ((["--model", str(tiny_model_dir), "--port", "-5"], "--port must be in 0..65535"),
                           (["--model", str(tiny_model_dir), "--port", str(taken)], "cannot serve HTTP"),
                           (["--model", "/no/such/model/folder"], "no model folder")):
            r = subprocess.run(base + args, capture_output=True, text=True, timeout=120, env=env)
            assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
