"""`dlmix demo` end to end: CPU heterogeneous PD (bf16/32 -> fp32/128; LMDeploy bf16/16 -> vLLM fp32/128) with
SmolLM2 behind the router."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow


def test_demo_runs_and_decode_receives_kv(tmp_path, smollm2_dir):
    """The README's main job as it is run (both default deployments): vLLM PD across block size and dtype, then an
    LMDeploy prefill feeding a vLLM decode (when the LMDeploy venv exists; the demo says it skipped otherwise)."""
    from dlmix.demo import DEFAULT_DEPLOYMENTS, _missing_python

    out = tmp_path / "rows.json"
    p = subprocess.run([sys.executable, "-m", "dlmix.cli", "demo", "--free-ports", "--max-tokens", "16",
                        "--json", str(out)], capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "dlmix demo cpu-pd: one row per request" in p.stdout
    every = json.loads(out.read_text())
    xengine = DEFAULT_DEPLOYMENTS[1].stem
    if _missing_python(DEFAULT_DEPLOYMENTS[1]):
        assert f"skipping {xengine}.yaml" in p.stdout
    else:
        x = [r for r in every if r["deployment"] == xengine]
        assert len(x) == 6 and all(r["ok"] for r in x), x
        # every request of the cross-engine deployment: LMDeploy's prefill leg, vLLM's decode read its KV
        assert all(r["path"] == "disaggregated" and r["prefill"] == "prefill" and r["decode"] == "decode"
                   and r["kv_bytes"] > 0 for r in x), x
        assert all(r["single"] == "same" or r["single"].startswith("near-tie@") for r in x), x
    rows = {r["label"]: r for r in every if r["deployment"] == "cpu-pd"}
    assert len(rows) == 6 and all(r["ok"] for r in rows.values())
    # the prefix policy of examples/cpu-pd.yaml always disaggregates: every request's KV went prefill -> decode
    assert {r["path"] for r in rows.values()} == {"disaggregated"}
    assert all(r["prefill"] == "prefill" and r["decode"] == "decode" for r in rows.values())
    assert all(r["kv_bytes"] > 0 for r in rows.values())
    # every answer was checked against the decode instance alone (own prefill): equal, or a near-tie
    assert all(r["single"] == "same" or r["single"].startswith("near-tie@") for r in rows.values()), \
        {k: r["single"] for k, r in rows.items()}
    assert "answers equal to a single instance" in p.stdout
    # the second turn shares the first turn's prompt: decode already holds most of it, so far fewer bytes move
    t1, t2 = rows["chat turn 1"], rows["chat turn 2"]
    assert t2["prompt_tokens"] > t1["prompt_tokens"]
    assert t2["extra"]["decode_hit_tokens"] > 0
    assert t2["kv_bytes"] < t1["kv_bytes"] / 2
