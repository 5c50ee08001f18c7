"""SGLang PD with the ``dlmix`` transfer backend across attention-TP sizes, on real SGLang 0.5.23 CPU servers (marked
slow; skipped with the reason when the SGLang venv of ``scripts/setup_sglang.sh`` is absent).

The tiny random Llama (fp32, 2 KV heads, so TP 2 gives each rank one head); servers started once for this module:
  P2  prefill TP 2, page 16        ->  D1  decode TP 1, page 16   (each decode rank reads both prefill ranks)
  P1  prefill TP 1, page 32        ->  D2  decode TP 2, page 16   (each decode rank reads its head from the one
                                                                   prefill rank; page size converted too)
SGLang's own rank mapping decides which prefill ranks a decode rank bootstraps with; the dlmix backend pulls each
decode rank's heads from the prefill ranks that hold them. The reference is transformers' greedy ``generate`` in
fp32 (SGLang's single server equals it on this model). TP 2 sums the row-parallel products in another order, so a
first divergence is allowed where the reference's top-1/top-2 gap is below :data:`NEAR_TIE` (counted, printed).
"""
from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.slow

from dlmix_sglang import testing as T  # noqa: E402

from dlmix.testing import compare_greedy, spread_lengths, stop_all  # noqa: E402

T.require_venv()

MAX_TOKENS = 16
#: nats: fp32 with another summation order differs by ~1e-6 in the logits
NEAR_TIE = 0.01


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """The four servers, and a dlmix router they heartbeat their KV usage and queues to (``router_url``)."""
    import json

    from dlmix.router.config import RouterConfig
    from dlmix.testing import RouterThread

    d = tmp_path_factory.mktemp("sglang-pd-tp")
    m = str(tiny_model_dir)
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="cost", model_spec=m))
    reg = {"DLMIX_SGLANG_CONFIG": json.dumps({"router_url": rt.url, "heartbeat_s": 1, "chip_profile": "cpu-x86"})}
    started = {}
    try:
        for name, mode, page, tp in (("P2", "prefill", 16, 2), ("D1", "decode", 16, 1),
                                     ("P1", "prefill", 32, 1), ("D2", "decode", 16, 2)):
            started[name] = T.start_server(m, T.free_port(), d / f"{name}.log", mode=mode, page_size=page,
                                           max_total_tokens=4096, mem_fraction=0.05, tp=tp, env=reg)
        for s in started.values():
            s.wait_ready()
        yield {**started, "_router": rt}
    finally:
        stop_all(started.values())
        rt.close()


@pytest.fixture(scope="module")
def prompts():
    """10 prompts of 10..1,000 random byte tokens (the tiny Llama's vocabulary), lengths in geometric steps."""
    rng = random.Random(15)
    return [[rng.randrange(256) for _ in range(n)] for n in spread_lengths(10, shuffle=rng)]


@pytest.fixture(scope="module")
def refs(tiny_model_dir, prompts):
    """transformers' greedy ids (fp32) and per-position top-1/top-2 logprob gaps, per prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            g = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                               return_dict_in_generate=True, eos_token_id=None, pad_token_id=256)
            gaps = []
            for sc in g.scores:
                top = torch.log_softmax(sc[0].float(), -1).topk(2).values
                gaps.append(float(top[0] - top[1]))
            out[i] = (g.sequences[0, len(ids):].tolist(), gaps)
    return out


@pytest.mark.parametrize("pname,dname", [("P2", "D1"), ("P1", "D2")], ids=["p-tp2_d-tp1", "p-tp1_d-tp2"])
def test_tp_mismatch_equals_a_single_instance(servers, prompts, refs, pname, dname):
    """Every prompt through the pair: greedy ids equal transformers' (near-ties counted); the decode took the KV
    from the prefill (no failed transfer in its log), and both sides hold no page afterwards (their heartbeats)."""
    got = {}
    for i, ids in enumerate(prompts):
        (ps, pb), (ds, db) = T.pd_generate(servers[pname], servers[dname], ids, MAX_TOKENS, ignore_eos=True)
        assert ds == 200 and ps == 200, (i, len(ids), pb, db, servers[dname].log_tail())
        fr = (db.get("meta_info") or {}).get("finish_reason") or {}
        assert fr.get("type") != "abort", (i, db, servers[dname].log_tail())
        got[i] = db["output_ids"]
    same, ties = compare_greedy(f"{pname}->{dname}", got, refs, NEAR_TIE, MAX_TOKENS)
    assert same + ties == len(prompts)
    assert same >= len(prompts) - 2, (same, ties)
    dlog = servers[dname].log_path.read_text(errors="replace")
    assert "failed on decode" not in dlog, dlog[-3000:]
    T.wait_nothing_held(servers["_router"].url, [servers[pname].url, servers[dname].url])
    assert "expired" not in servers[pname].log_path.read_text(errors="replace")
