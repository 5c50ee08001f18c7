"""The PD core is engine-neutral: the reference producer (transformers' forward pass, ``lmdeploy`` layout = separate
K/V NHD, block 16, fp16; no engine code) feeds a REAL vLLM CPU decode instance (``DLMixConnector`` kv_consumer,
fp32, block 128, ``vllm_cpu`` layout) through the dlmix router's PD flow (marked slow).

Processes: reference producer P (core 0), a second reference producer Q whose prompt differs by one token
(``--perturb-token -1``, core 0), vLLM decode D (core 1), the router in-process (policy ``round_robin``: P is the
only prefill instance, so every request takes the PD path).

* Greedy output through the router equals D serving the prompt alone (its prefix cache reset: a single instance
  with the decode configuration), over completions (token ids and text) and chats, streamed and not; every
  routed request really loaded the prompt's KV from P (D's transfer record). A first divergence at a position whose
  reference top-1/top-2 logprob gap is below :data:`NEAR_TIE` counts as a near-tie, printed and counted; any other
  difference fails.
* Q's KV is refused by D with the reason (prompt digest), D recomputes, the answer equals the reference, and Q frees
  the hold (abort).
* At the end neither producer holds a block (their ``/stats`` hold accounting).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import httpx
import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from dlmix.router.config import RouterConfig  # noqa: E402
from dlmix.testing import RouterThread, stop_all, wait_until  # noqa: E402
from dlmix_vllm import testing as T  # noqa: E402

MAX_TOKENS = 16
#: top-1/top-2 logprob gap (nats) below which a first divergence counts as a near-tie: the producer's KV comes from
#: transformers' fp32 forward pass stored in fp16 (relative rounding 2^-11), the reference's from vLLM's fp32 kernels.
NEAR_TIE = 0.25

class Producer:
    """A ``python -m dlmix.pd.reference`` subprocess (own process group) and its announced URL."""

    def __init__(self, name: str, model: str, workdir, extra: list[str] | None = None, cpu: str = "0"):
        self.log = workdir / f"{name}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONUNBUFFERED="1")
        cmd = ["taskset", "-c", cpu, sys.executable, "-m", "dlmix.pd.reference", "--model", model,
               "--served-model-name", "smollm2", "--arrangement", "lmdeploy", "--block-size", "16", "--dtype", "fp16",
               "--hold-timeout-s", "300", *(extra or [])]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(self.log, "wb"), env=env,
                                     start_new_session=True)
        self.url = None

    def wait_ready(self, timeout_s: float = 300) -> None:
        box: list = []
        th = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        th.start()
        th.join(timeout_s)
        if not box or not box[0]:
            raise RuntimeError(f"reference producer did not start:\n{self.log.read_text()[-3000:]}")
        self.info = json.loads(box[0])
        self.url = self.info["url"]

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=30).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory):
    wd = tmp_path_factory.mktemp("pdref")
    m = str(smollm2_dir)
    P = Producer("P", m, wd)
    Q = Producer("Q", m, wd, ["--perturb-token", "-1"])
    D = T.launch("D", m, wd, role="kv_consumer", cpu="1", block_size=128, dtype="float32",
                 extra={"io_timeout_s": 30})
    rt = None
    try:
        P.wait_ready()
        Q.wait_ready()
        T.wait_ready([D], timeout_s=400)
        # P's entry is its own registration body (the core's one builder: role prefill, its KV layout)
        insts = [dict(P.info["registration"], id="P", chip="cpu-x86"),
                 {"id": "D", "url": D.url, "role": "decode", "engine": "vllm", "model": "smollm2", "chip": "cpu-x86",
                  "block_size": 128}]
        rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="round_robin", model_spec=m, instances=insts,
                                       prefill_timeout_s=300))
        yield {"P": P, "Q": Q, "D": D, "router": rt}
    finally:
        if rt is not None:
            rt.close()
        stop_all([D, P, Q])


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    """8 prompts, 12..700 tokens: completions as token ids and as text, chats; half streamed."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    return T.prompt_set(tok, [12, 60, 130, 200, 290, 400, 520, 700], kinds=("completion", "chat", "text"), seed=2024,
                        vocabulary=T.PROSE_WORDS[:28])


def _post(url: str, p: dict, ktp: dict | None = None) -> dict:
    path, body = T.request_body(p["kind"], p["prompt"], MAX_TOKENS, stream=p["stream"], ktp=ktp)
    with httpx.Client(timeout=600) as c:
        return T._post(c, url + path, body)


def _record(resp: dict) -> dict:
    return (resp.get("kv_transfer_params") or {}).get("dlmix") or {}


def test_reference_producer_feeds_vllm_decode_through_router(stack, prompts):
    D, P, rt = stack["D"], stack["P"], stack["router"]
    layout = P.info["layout"]
    assert (layout["arrangement"], layout["block_size"], layout["dtype"]) == ("lmdeploy", 16, "fp16")
    T.reset_prefix_cache(D.url)
    refs = {}
    for p in prompts:
        refs[p["i"]] = T.result_tokens(_post(D.url, p))
    got = {}
    for p in prompts:
        T.reset_prefix_cache(D.url)  # D must load the whole prompt from P, not hit its own cache
        resp = _post(rt.url, p)
        if not p["stream"]:  # a streamed answer carries no per-request record; the producer's count below does
            rec = _record(resp)
            assert not rec.get("refused") and not rec.get("error"), (p["i"], rec)
            assert rec.get("local_hit_tokens") == 0 and rec.get("loaded_tokens", 0) > 0, (p["i"], rec)
            assert rec.get("bytes_received", 0) > 0 and rec.get("failed_blocks", 0) == 0, (p["i"], rec)
        got[p["i"]] = T.result_tokens(resp)[0]
    same, ties = T.compare_greedy("reference->vllm", got, refs, NEAR_TIE, MAX_TOKENS)
    assert same + ties == len(prompts)
    wait_until(lambda: not P.stats()["held_requests"], 120, "P to release every hold")
    st = P.stats()
    assert st["held_requests"] == 0 and st["used_blocks"] == 0, st
    assert st["core"]["consumed"] == len(prompts) and st["core"]["refused"] == 0, st


def test_producer_one_token_off_is_refused_by_decode(stack, prompts):
    D, Q = stack["D"], stack["Q"]
    p = next(x for x in prompts if isinstance(x["prompt"], list) and len(x["prompt"]) >= 100 and not x["stream"])
    T.reset_prefix_cache(D.url)
    ref = T.result_tokens(_post(D.url, p))[0]
    T.reset_prefix_cache(D.url)
    r = T.two_step(Q.url, D.url, p["kind"], p["prompt"], MAX_TOKENS, stream=p["stream"])
    assert r["params"]["remote_num_tokens"] == len(p["prompt"])
    rec = _record(r["decode"])
    why = rec.get("refused") or ""
    print(f"[one token off] decode refused: {why}")
    assert "prompt differs" in why and "digest" in why and rec.get("loaded_tokens") == 0, rec
    assert T.result_tokens(r["decode"])[0] == ref  # D recomputed the prompt itself
    wait_until(lambda: not Q.stats()["held_requests"], 120, "Q to release its hold")
    st = Q.stats()
    assert st["held_requests"] == 0 and st["used_blocks"] == 0 and st["core"]["grants"] == 0, st
