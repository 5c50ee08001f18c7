"""Contract robustness: 10,000 invalid transfer parameters and control messages (seeded, :mod:`pd_fuzz_cases`) fed
into both sides' receive paths over the real TCP transport, against a reference producer that holds real blocks.

Receive paths:
* consumer, parameters: :func:`dlmix.pd.consumer.claim` (what a decode engine's scheduler calls with the
  ``kv_transfer_params`` it received): every case refused with a reason, nothing claimed;
* producer, control messages: sent by a consumer endpoint with ``notify`` over TCP (non-dict values and raw bytes,
  which ``notify`` cannot carry, go into the producer endpoint's same dispatch directly): every case refused with
  the decoder's reason (counted as a bad message; a ``want`` naming a request is answered ``refused``), no grant,
  no hold changed;
* consumer, control messages (``blocks_ready``/``refused`` replies): sent by the producer endpoint over TCP: every
  case refused (counted), nothing delivered to a waiting pull.

Afterwards both endpoints still work (a real pull of a held request returns transformers' K/V), and once the holds
are released the producer's hold accounting shows no block held.
"""
from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import httpx  # noqa: E402

import pd_fuzz_cases as F  # noqa: E402
from dlmix.kv import KVLayout, allocate  # noqa: E402
from dlmix.pd.consumer import claim  # noqa: E402
from dlmix.pd.contract import ContractError, decode_message, decode_params, prompt_digest  # noqa: E402
from dlmix.pd.endpoint import DEFAULT_LOOPBACK_SECRET, KVEndpoint  # noqa: E402
from dlmix.pd.reference.producer import ReferenceConfig, ReferenceProducer  # noqa: E402
from dlmix.pd.reference.server import ReferenceHTTPServer  # noqa: E402
from dlmix.testing import poll  # noqa: E402

N_CASES = 10_000
PROMPTS = [list(range(7, 7 + n)) for n in (20, 33, 64)]


@pytest.fixture(scope="module")
def rig(tiny_model_dir):
    app = ReferenceProducer(ReferenceConfig(model_dir=tiny_model_dir, served_model_name="tiny",
                                            kv_cache_bytes=2 << 20, hold_timeout_s=600))
    http = ReferenceHTTPServer(app).serve_in_thread()
    params = []
    for ids in PROMPTS:
        r = httpx.post(http.url + "/v1/completions", json={"prompt": ids, "max_tokens": 1,
                                                           "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 200, r.text
        params.append(r.json()["kv_transfer_params"])
    src = decode_params(params[0]).kv_layout
    dst = KVLayout(src.model, block_size=32, dtype="fp32", arrangement="vllm_cpu", engine="fuzz-consumer")
    caches = allocate(dst, 8, fill=0.0)
    ep = KVEndpoint("tcp", "fuzz-consumer", DEFAULT_LOOPBACK_SECRET, "127.0.0.1", 0, dst, caches, 1 << 20,
                    io_timeout_s=10.0, registration_wait_s=0.2)
    peer = ep.t.connect(params[0]["remote_transports"][0])
    yield {"app": app, "http": http, "params": params, "dst": dst, "caches": caches, "ep": ep, "peer": peer}
    ep.close()
    http.close()
    app.close()


def test_fuzz_10000_cases_refused_no_crash_no_block_held(rig):
    app, ep, params, dst = rig["app"], rig["ep"], rig["params"], rig["dst"]
    prod = app.core  # the producer's endpoint (its producer side and dispatch)
    reqs = [(p["remote_request_id"], p["remote_block_ids"], p["remote_num_tokens"]) for p in params]
    cases = F.generate(N_CASES, seed=12, reqs=reqs)
    assert len(cases) == N_CASES
    held_before = {rid: list(prod.holds[rid].block_ids) for rid, _, _ in reqs}
    stats0 = dict(prod.stats)
    cons_bad0 = ep.stats["bad_messages"]
    refusals: list = []
    orig_deliver = ep._slots.deliver
    ep._slots.deliver = lambda peer, m: refusals.append(m) or orig_deliver(peer, m)  # answers reaching the consumer
    by_layer: Counter = Counter()

    # ---- consumer: parameters
    n_params = 0
    for c in cases:
        if c.target != "params":
            continue
        n_params += 1
        cl = claim(c.obj, dst, 64, 0, prompt_token_ids=PROMPTS[2])
        assert cl.refused and cl.count == 0, (c.kind, c.what)
        try:
            decode_params(c.obj)
            by_layer["params refused by the pair/prompt check"] += 1  # decoded, but claim refused it
        except ContractError as e:
            assert e.reason
            by_layer["params refused by the contract"] += 1

    # ---- producer: control messages over TCP (dicts) or its dispatch (anything else)
    to_prod = [c for c in cases if c.target == "to_producer"]
    wants_named = 0  # malformed wants that name a request: answered `refused` with the decoder's reason
    decoded = []  # cases the contract decoder lets through: the producer's gates must refuse them
    n_bad = 0
    for c in to_prod:
        try:
            m = decode_message(c.obj)
        except ContractError as e:
            assert e.reason
            n_bad += 1
            if isinstance(c.obj, dict) and c.obj.get("type") == "want" and isinstance(c.obj.get("req"), str) \
                    and c.obj.get("req"):
                wants_named += 1
        else:
            assert type(m).__name__ == "Want", (c.kind, c.what)  # only a want can pass and still be wrong
            decoded.append(c)
        if isinstance(c.obj, dict):
            ep.t.notify(rig["peer"], c.obj)
            by_layer["to producer over TCP"] += 1
        else:
            prod._handle(rig["peer"], c.obj)
            by_layer["to producer dispatch (non-dict/bytes)"] += 1
    by_layer["to producer: passed the contract, refused by the producer's pair gate"] = len(decoded)
    assert poll(lambda: prod.stats["bad_messages"] - stats0["bad_messages"] == n_bad
                 and prod.stats["refused"] - stats0["refused"] == len(decoded)), (prod.stats, stats0, n_bad)

    # ---- consumer: replies over TCP from the producer's transport
    to_cons = [c for c in cases if c.target == "to_consumer"]
    cpeer = next(p for p in prod.t.peers() if p.startswith("fuzz-consumer"))
    sent = 0
    for c in to_cons:
        with pytest.raises(ContractError):
            decode_message(c.obj)
        if isinstance(c.obj, dict):
            prod.t.notify(cpeer, c.obj)
            sent += 1
        else:
            ep._handle(cpeer, c.obj)
    assert poll(lambda: ep.stats["bad_messages"] - cons_bad0 == len(to_cons)), (ep.stats, len(to_cons))
    by_layer["to consumer over TCP"] += sent

    # every want that named a request got a `refused` with a reason; nothing else reached a pull
    assert poll(lambda: len(refusals) >= wants_named + len(decoded))
    assert all(type(m).__name__ == "Refuse" and m.reasons and all(m.reasons) for m in refusals)
    assert len(refusals) == wants_named + len(decoded)

    # ---- nothing granted, no hold changed
    assert prod.stats["grants"] == stats0["grants"] and prod.stats["consumed"] == stats0["consumed"]
    assert prod.stats["aborted"] == stats0["aborted"]
    assert {rid: list(prod.holds[rid].block_ids) for rid, _, _ in reqs} == held_before
    print(f"[fuzz] {N_CASES} cases: params {n_params}, to producer {len(to_prod)}, to consumer {len(to_cons)}; "
          f"{dict(by_layer)}; kinds {dict(Counter(c.kind for c in cases))}; refused answers {len(refusals)}")

    # ---- both sides still work: a real pull of a held request
    p = decode_params(params[2])
    res = ep.pull_params(p, 0, p.num_tokens, [3, 5], digest=prompt_digest(PROMPTS[2]))
    assert res.error is None and res.loaded_upto == p.num_tokens, res.error
    assert httpx.get(rig["http"].url + "/health").status_code == 200

    # ---- release everything: no block stays held
    for q in params:
        ep.release(q["remote_transports"][0], q["remote_request_id"], consumed=True)
    assert poll(lambda: app.stats()["held_requests"] == 0)
    st = app.stats()
    assert st["used_blocks"] == 0 and st["free_blocks"] == st["num_blocks"] and st["core"]["holds"] == 0, st


def test_fuzz_into_a_separate_producer_process(tiny_model_dir):
    """1,000 invalid control messages over TCP into a ``python -m dlmix.pd.reference`` process holding a real
    request: it stays up, counts every one as refused (``/stats``), grants nothing, and frees the hold on release."""
    import json
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "dlmix.pd.reference", "--model", str(tiny_model_dir),
                             "--served-model-name", "tiny", "--kv-cache-bytes", str(1 << 20), "--log-level", "ERROR"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    ep = None
    try:
        info = json.loads(proc.stdout.readline())
        r = httpx.post(info["url"] + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 1,
                                                               "kv_transfer_params": {"do_remote_decode": True}})
        ktp = r.json()["kv_transfer_params"]
        src = decode_params(ktp).kv_layout
        dst = KVLayout(src.model, block_size=32, dtype="fp32", arrangement="vllm_cpu", engine="fuzz-consumer")
        ep = KVEndpoint("tcp", "fuzz-consumer-2", DEFAULT_LOOPBACK_SECRET, "127.0.0.1", 0, dst,
                        allocate(dst, 4, fill=0.0), 1 << 20, io_timeout_s=10.0)
        peer = ep.t.connect(info["kv"])
        cases = [c for c in F.generate(3000, seed=99, targets=("to_producer",),
                                       reqs=[(ktp["remote_request_id"], ktp["remote_block_ids"],
                                              ktp["remote_num_tokens"])]) if isinstance(c.obj, dict)][:1000]
        n_bad = 0
        for c in cases:
            try:
                decode_message(c.obj)
            except ContractError:
                n_bad += 1
            ep.t.notify(peer, c.obj)

        def stats():
            return httpx.get(info["url"] + "/stats", timeout=30).json()
        assert poll(lambda: stats()["core"]["bad_messages"] + stats()["core"]["refused"] == len(cases))
        st = stats()
        assert st["core"]["bad_messages"] == n_bad and st["core"]["grants"] == 0 and st["held_requests"] == 1, st
        ep.release(info["kv"], ktp["remote_request_id"], consumed=False)
        assert poll(lambda: stats()["held_requests"] == 0)
        assert stats()["used_blocks"] == 0 and proc.poll() is None
    finally:
        if ep is not None:
            ep.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
