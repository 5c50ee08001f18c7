"""Fault cases that run fast (no real engine): PD with ``n > 1`` (one prefill hold shared by the ``n`` decode pulls,
released after the last), and the mock-engine classes of the fault campaign (``benchmarks/faults.py``): hostile
clients and fuzzed requests against ``dlmix router`` in front of mock engines. Values are asserted, never timings.
"""
from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch

from dlmix.kv import KVLayout, ModelIdentity
from dlmix.kv.ops import allocate, read_kv, torch_dtype, write_kv
from dlmix.pd.contract import Abort, Consumed, TransferParams, Want, prompt_digest
from dlmix.pd.endpoint import KVEndpoint
from dlmix.pd.producer import MAX_CONSUMERS, Producer
from dlmix.router.engines import vllm as vllm_adapter

SECRET = "faults-test"


def _layout(bs: int = 32, dtype: str = "bf16") -> KVLayout:
    return KVLayout(model=ModelIdentity("LlamaForCausalLM", 2, 2, 16, "gqa", weights_fingerprint="sha256:aa"),
                    block_size=bs, dtype=dtype, arrangement="vllm_cpu")


# ------------------------------------------------------------------------------------------------ PD with n > 1
def test_prefill_body_prefills_once_and_names_the_consumers():
    one = msgspec.json.decode(vllm_adapter.prefill_body({"prompt": "hi", "n": 1}, False))
    assert one["n"] == 1 and "dlmix_consumers" not in one["kv_transfer_params"]
    three = msgspec.json.decode(vllm_adapter.prefill_body({"prompt": "hi", "n": 3, "stream": True}, False))
    assert three["n"] == 1 and three["max_tokens"] == 1 and three["stream"] is False
    assert three["kv_transfer_params"] == {**vllm_adapter.PREFILL_KV_PARAMS, "dlmix_consumers": 3}
    # a bad n is left for the engine to reject with its own 400
    bad = msgspec.json.decode(vllm_adapter.prefill_body({"prompt": "hi", "n": "2"}, False))
    assert bad["n"] == "2" and "dlmix_consumers" not in bad["kv_transfer_params"]


class _T:
    def __init__(self):
        self.grants: dict = {}
        self.sent: list = []

    def grant(self, peer, tid, ranges, mode="r", expires_s=None):
        self.grants[tid] = (peer, list(ranges))

    def revoke(self, tid):
        return self.grants.pop(tid, None) is not None

    def notify(self, peer, msg):
        self.sent.append((peer, msg))


def test_hold_with_n_consumers_is_released_after_the_last():
    t = _T()
    p = Producer(t, _layout(), 16, registration_wait_s=0.0)
    p.add_hold("r", [3, 4], 20, consumers=3)
    want = Want(req="r", block_ids=[3, 4], layout=_layout().to_dict())
    for _ in range(3):
        p.handle("d", want)
    assert [m["type"] for _, m in t.sent] == ["blocks_ready"] * 3 and p.stats["refused"] == 0
    p.handle("d", Consumed(req="r"))
    p.handle("d", Abort(req="r"))  # a choice that found the prompt in its own prefix cache
    assert "r" in t.grants and p.take_finished() == set()
    p.handle("d", Consumed(req="r"))
    assert "r" not in t.grants and p.take_finished() == {"r"} and p.held_count() == 0
    for bad in (0, -1, MAX_CONSUMERS + 1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="consumers"):
            p.add_hold("x", [1], 5, consumers=bad)


def test_n_concurrent_pulls_of_one_hold_over_tcp_read_exact_values():
    """Two pulls of the same remote request from one consumer endpoint at once (vLLM's two choices): each gets its
    own answer, both read the exact values, the producer frees the hold after both consumed notices."""
    lay = _layout()
    n = 40
    sblocks = [5, 2]
    sc = allocate(lay, 8)
    g = torch.Generator().manual_seed(3)
    ref = {}
    for tok in range(n):
        for layer in range(2):
            k = torch.randn(2, 16, generator=g).to(torch_dtype(lay))
            v = torch.randn(2, 16, generator=g).to(torch_dtype(lay))
            write_kv(lay, sc, sblocks, tok, layer, k, v)
            ref[(tok, layer)] = (k, v)
    p = KVEndpoint("tcp", "fp", SECRET, "127.0.0.1", 0, lay, sc, 0, registration_wait_s=1.0, io_timeout_s=10.0)
    dc = allocate(lay, 8)
    d = KVEndpoint("tcp", "fd", SECRET, "127.0.0.1", 0, lay, dc, 1 << 20, registration_wait_s=1.0,
                   io_timeout_s=10.0)
    try:
        digest = prompt_digest(range(n))
        p.add_hold("req", sblocks, n, digest, consumers=2)
        params = TransferParams.make(engine="reference", instance_id="p0", transports=[p.descriptor()],
                                     request_id="req", block_ids=sblocks, num_tokens=n, layout=lay, digest=digest)
        dst = {0: [0, 3], 1: [6, 7]}
        res: dict = {}

        def pull(i):
            res[i] = d.pull_params(params, 0, n, dst[i], digest=digest)

        ths = [threading.Thread(target=pull, args=(i,)) for i in (0, 1)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(30)
        for i in (0, 1):
            assert res[i].error is None and res[i].loaded_upto == n, res[i]
            for tok in (0, 17, n - 1):
                for layer in range(2):
                    k, v = read_kv(lay, dc, dst[i], tok, layer)
                    assert torch.equal(k, ref[(tok, layer)][0]) and torch.equal(v, ref[(tok, layer)][1])
        d.release(p.descriptor(), "req", consumed=True)
        time.sleep(0.2)
        assert p.take_finished() == set() and p.is_held("req")  # one choice still to go
        d.release(p.descriptor(), "req", consumed=True)
        deadline = time.monotonic() + 5
        done: set = set()
        while not done and time.monotonic() < deadline:
            done = p.take_finished()
            time.sleep(0.02)
        assert done == {"req"} and p.held_count() == 0 and p.stats["refused"] == 0
    finally:
        p.close()
        d.close()
