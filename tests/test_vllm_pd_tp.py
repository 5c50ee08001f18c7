"""Prefill and decode at different TP sizes with DLMixConnector on real vLLM CPU servers (marked slow).

The project's tiny Llama (2 layers, 2 KV heads of size 32, 4 attention heads, fp32) at:

* prefill TP 2 (one KV head per rank) -> decode TP 1;
* prefill TP 1 -> decode TP 2 (each decode rank reads only its head of every prefill block);
* prefill TP 2 of the same model cut to one KV head (multi-query), more ranks than KV heads (the head on both
  ranks: the decode reads it from one and releases both) -> decode TP 1. Two ranks over one head instead of four
  over two: five engine processes on two cores starved the KV threads for tens of seconds (the planning over four
  ranks is checked in tests/test_kv_convert.py).

Prefill block size 32, decode 64. Reference: the decode server itself serving each prompt without
``kv_transfer_params`` after its prefix cache was reset (a single instance with the decode configuration). Greedy
outputs must be equal token for token; a first divergence where the reference's top-1/top-2 logprob gap is below
:data:`NEAR_TIE` is a near-tie, printed and counted. Each decode rank writes its transfer records (``stats_dir``):
the bytes it received for a request must equal exactly its KV heads over the prefill blocks it read.
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

vllm = pytest.importorskip("vllm")

from dlmix.testing import SHARED_CORES_ENV, poll, stop_all  # noqa: E402
from dlmix_vllm import testing as T  # noqa: E402

MAX_TOKENS = 12
NO_EOS = {"ignore_eos": True}  # random weights: the end-of-text token may win at any position
NEAR_TIE = 0.05  # nats: the tiny model's fp32 logits; only a real tie may flip
LAYERS, HEAD = 2, 32
P_BLOCK, D_BLOCK = 32, 64
#: Unpinned, one OpenMP thread per rank, passive OpenMP waits: three or five engine processes share two cores here.
#: Pinned (``VLLM_CPU_OMP_THREADS_BIND``), a prefill rank and the decode on one core, both stepping while a transfer
#: is pending, starved each other's KV threads for tens of seconds (pulls timed out).
ENV = SHARED_CORES_ENV


def _launch(name: str, model: str, wd, tp: int, role: str, extra: dict):
    return T.launch(name, model, wd, role=role, cpu="nobind", env=ENV, block_size=P_BLOCK if role == "kv_producer" else D_BLOCK,
                    extra=extra, kv_bytes=32 << 20,
                    extra_args=["--tensor-parallel-size", str(tp)] if tp > 1 else None)


@pytest.mark.parametrize("kv_heads, ptp, dtp", [(2, 2, 1), (2, 1, 2), (1, 2, 1)],
                         ids=["p-tp2_d-tp1", "p-tp1_d-tp2", "1kv_p-tp2_d-tp1"])
def test_tp_mismatch_identical_to_single_decode_instance(request, tmp_path, kv_heads, ptp, dtp):
    model = str(request.getfixturevalue("tiny_model_dir" if kv_heads == 2 else "tiny_model_1kv_dir"))
    stats = tmp_path / "stats"
    # Generous timeouts: on a loaded two-core machine one transfer waited 40 s for the prefill rank's answer; this
    # test checks the bytes and the tokens, not the speed (benchmarks/ does).
    P = _launch("P", model, tmp_path, ptp, "kv_producer", {"hold_timeout_s": 600})
    D = _launch("D", model, tmp_path, dtp, "kv_consumer", {"io_timeout_s": 120, "stats_dir": str(stats)})
    try:
        T.wait_ready([P, D], timeout_s=600)
        items = T.id_prompts(20, seed=4321, max_len=600)  # the tiny vocabulary, 10..600 tokens
        refs = T.single_references(D.url, items, MAX_TOKENS, extra=NO_EOS)
        got, loaded = {}, {}
        for p in items:
            r = T.two_step(P.url, D.url, p["kind"], p["prompt"], MAX_TOKENS, stream=p["stream"], extra=NO_EOS)
            got[p["i"]] = T.result_tokens(r["decode"])[0]
            assert len(r["params"]["remote_transports"]) == ptp
            if not p["stream"]:
                info = (r["decode"].get("kv_transfer_params") or {}).get("dlmix") or {}
                assert info.get("error") is None and info.get("loaded_tokens", 0) > 0, info
                loaded[p["i"]] = info["loaded_tokens"]
        same, ties = T.compare_greedy(f"TP {ptp} -> TP {dtp}", got, refs, NEAR_TIE, MAX_TOKENS)
        assert same + ties == len(items) and same >= len(items) - 2

        # every decode rank pulled every request, and received exactly its heads of the prefill blocks it read
        recs: dict[int, list[dict]] = {}
        for f in sorted(stats.glob("transfers-*.jsonl")):
            rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            recs[len(recs)] = rows
        assert len(recs) == dtp, sorted(stats.iterdir())
        heads_per_rank = max(1, kv_heads // dtp)
        for rows in recs.values():
            assert len(rows) == len(items)
            for row in rows:
                assert row["error"] is None and row["failed_blocks"] == 0, row
                assert 0 <= row["grant_s"] <= row["transfer_s"], row
                blocks = -(-row["end"] // P_BLOCK) - row["start"] // P_BLOCK
                assert row["bytes_received"] == blocks * P_BLOCK * heads_per_rank * HEAD * 2 * 4 * LAYERS, row
        assert set(loaded.values()) <= {r["end"] - r["start"] for r in recs[0]}
        # every prefill rank's holds were released (consumed by each decode rank): no KV block stays in use
        assert poll(lambda: T.kv_usage(P.url) == 0, timeout_s=60), T.kv_usage(P.url)
        # the connector's own log lines reach vLLM's log (one per prefill rank's endpoint)
        started = [ln for ln in P.log.read_text(errors="replace").splitlines() if "DLMixConnector worker rank" in ln]
        assert len(started) == ptp, started
    finally:
        stop_all([P, D])
