"""Cross-check the dlmix simulator against NVIDIA Dynamo's mocker trace replay (round robin → KV router change).

Both replay the Mooncake FAST'25 conversation trace (12,031 requests) on 8 aggregated workers with engine block size
64, at arrival speedups 1× and 4×:

* Dynamo (separate venv, default ``/tmp/dynvenv``: ``pip install --no-deps ai-dynamo==1.5.1
  ai-dynamo-runtime==1.5.1`` + ``pydantic==2.13.0 uvloop aiohttp msgspec prometheus-client pyzmq tqdm zstandard``):
  ``dynamo.replay.run_trace_replay(trace, num_workers=8, router_mode=round_robin|kv_router, replay_mode="offline",
  trace_block_size=512, arrival_speedup_ratio=s, extra_engine_args=MockEngineArgs(block_size=64))``. The mocker's
  timing is a hardware-agnostic polynomial, so only relative changes are compared.
* dlmix: ``Simulator`` on 8× (H100 ×2 chips, i.e. TP2) Llama-3.1-8B instances (TP2 puts the round-robin TTFT at 1×
  near the mocker's), policies ``round_robin`` and ``dynamo_kv`` (plus dlmix's ``cost``).

Prints a table and, last, one JSON line with the relative mean/P90 TTFT change (KV router vs round robin) of both
simulators and whether the directions agree. Skips (exit 0, ``"skipped"`` in the JSON) when the Dynamo venv is absent.
``--quick`` is accepted for uniformity (the run takes ~1-3 minutes either way).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

DYN_SCRIPT = r"""
import json, os, sys
os.environ.setdefault("RUST_LOG", "warn")
from dynamo.replay import run_trace_replay
from dynamo._core import MockEngineArgs
trace, speed, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rep = run_trace_replay(trace, num_workers=8, router_mode=mode, replay_mode="offline", trace_block_size=512,
                       arrival_speedup_ratio=speed, extra_engine_args=MockEngineArgs.from_json(json.dumps({"block_size": 64})))
s = rep.summary if hasattr(rep, "summary") else rep["summary"]
print(json.dumps({k: s[k] for k in ("mean_ttft_ms", "p90_ttft_ms", "mean_itl_ms", "prefix_cache_reused_ratio",
                                     "output_throughput_tok_s")}))
"""

DEPLOY = {"name": "8x-h100-tp2", "block_size": 64, "instances": [{"chip": "H100", "count": 8, "num_chips": 2}]}


def run_dynamo(py: str, trace: str, speed: float, mode: str) -> dict:
    """One mocker replay in the Dynamo venv; returns its summary figures. Raises RuntimeError on failure."""
    env = dict(os.environ, RUST_LOG="warn")
    p = subprocess.run([py, "-c", DYN_SCRIPT, trace, str(speed), mode], capture_output=True, text=True, env=env,
                       timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"dynamo replay failed ({mode}, {speed}x): {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_dlmix(speed: float, policy: str) -> dict:
    """One dlmix simulation of the same trace; returns the same figures."""
    from dlmix.sim.simulator import Simulator
    from dlmix.sim.workload import load_trace

    s = Simulator(DEPLOY, "llama-3.1-8b", policy).run(load_trace("mooncake", speedup=speed)).summary
    return {"mean_ttft_ms": s["ttft_ms"]["mean"], "p90_ttft_ms": s["ttft_ms"]["p90"],
            "mean_itl_ms": s["itl_ms"]["mean"], "prefix_cache_reused_ratio": s["prefix_hit_rate"],
            "output_throughput_tok_s": s["output_throughput"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dynamo-python", default="/tmp/dynvenv/bin/python")
    ap.add_argument("--speedups", default="1,4")
    a = ap.parse_args(argv)
    speeds = [float(x) for x in a.speedups.split(",")]
    if not Path(a.dynamo_python).exists():
        print(f"Dynamo venv not found at {a.dynamo_python}: skipping the cross-check")
        print(json.dumps({"skipped": True, "reason": "dynamo venv absent"}))
        return 0
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="dlmix-xcheck-")
    trace = os.path.join(tmp, "conversation_trace.jsonl")
    src = resources.files("dlmix").joinpath("data/mooncake_conversation_trace.jsonl.gz")
    with gzip.open(str(src), "rb") as f, open(trace, "wb") as g:
        g.write(f.read())
    res = {}
    for sp in speeds:
        for mode in ("round_robin", "kv_router"):
            res[("dynamo", mode, sp)] = run_dynamo(a.dynamo_python, trace, sp, mode)
        for pol in ("round_robin", "dynamo_kv", "cost"):
            res[("dlmix", pol, sp)] = run_dlmix(sp, pol)
    print(f"{'sim':8} {'policy':12} {'speed':>5} {'TTFT mean':>10} {'TTFT p90':>9} {'ITL mean':>9} {'hit':>6} {'tok/s':>7}")
    for (sim, pol, sp), v in res.items():
        print(f"{sim:8} {pol:12} {sp:5g} {v['mean_ttft_ms']:10.0f} {v['p90_ttft_ms']:9.0f} {v['mean_itl_ms']:9.1f} "
              f"{v['prefix_cache_reused_ratio']:6.3f} {v['output_throughput_tok_s']:7.0f}")
    out = {}
    agree = True
    for sp in speeds:
        for sim, kv in (("dynamo", "kv_router"), ("dlmix", "dynamo_kv"), ("dlmix_cost", "cost")):
            key = "dlmix" if sim == "dlmix_cost" else sim
            rr, k = res[(key, "round_robin", sp)], res[(key, kv, sp)]
            for m in ("mean_ttft_ms", "p90_ttft_ms"):
                out[f"{sim}_kv_vs_rr_{m.replace('_ms', '')}_change_{sp:g}x"] = round(k[m] / rr[m] - 1.0, 3)
        for m in ("mean_ttft", "p90_ttft"):
            d = out[f"dynamo_kv_vs_rr_{m}_change_{sp:g}x"]
            s = out[f"dlmix_kv_vs_rr_{m}_change_{sp:g}x"]
            agree = agree and (d < 0) == (s < 0)
    out["direction_agrees"] = agree
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
