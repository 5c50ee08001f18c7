"""Compare two router policies on the shared-prefix workload against a real deployment started by ``dlmix launch``.

For each policy (default ``prefix`` and ``round_robin``): launch the deployment file with the router's policy
replaced, run ``dlmix bench`` (seeded shared-prefix workload, Poisson arrivals) at each request rate, stop
everything. Same seeds for both policies, so both see identical prompts and arrival times; fresh engines for each
policy, so no cache carries over. Results (``results.json`` per policy) and comparison plots go to ``--output-dir``.

Prints LAST one JSON line: per level ``ttft_p50_ms``, ``e2el_p50_ms``, ``prefix_hit_rate`` for each policy and the
ratios ``ttft_p50_POLICY_A_vs_POLICY_B`` (B's TTFT / A's TTFT, higher is better for A) and
``prefix_hit_POLICY_A_vs_POLICY_B`` (A's hit rate / B's).

    python benchmarks/bench_policies.py --quick                       # examples/cpu-aggregated.yaml, SmolLM2
    python benchmarks/bench_policies.py --deployment examples/mock-aggregated.yaml --rates 10,20,40
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from rich.console import Console

from dlmix.bench import report, workloads
from dlmix.bench.runner import BenchSettings, Level, run_sweep
from dlmix.bench.stats import parse_goodput
from dlmix.launch import Deployment, launch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default=str(Path(__file__).resolve().parent.parent / "examples"
                                                / "cpu-aggregated.yaml"))
    ap.add_argument("--policies", default="prefix,round_robin")
    ap.add_argument("--rates", default="0.25,0.5,1")
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--goodput", default="ttft:2000 tpot:200")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-dir", default="bench-results/policies")
    ap.add_argument("--quick", action="store_true", help="4 groups x 4 prompts per level")
    a = ap.parse_args()
    if a.quick:
        a.groups, a.per_group = 4, 4
    console = Console()
    out_dir = Path(a.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in a.rates.split(",")]
    policies = a.policies.split(",")
    slo = parse_goodput([a.goodput])
    figures: dict = {"deployment": Path(a.deployment).name, "rates": rates, "policies": policies,
                     "workload": {"groups": a.groups, "per_group": a.per_group, "prefix_len": a.prefix_len,
                                  "suffix_len": a.suffix_len, "output_len": a.output_len}}
    per_policy: dict = {}
    for pol in policies:
        dep = Deployment.from_file(a.deployment)
        assert dep.router is not None, "the deployment needs a router section"
        dep.router.policy = pol
        console.print(f"[bold]policy {pol}[/]: launching {a.deployment}")
        t0 = time.time()
        with launch(dep, console=console) as running:
            console.print(f"ready after {time.time() - t0:.0f} s at {running.url}")
            s = BenchSettings(base_url=running.url, model=running.instances[0].served_model_name, seed=a.seed,
                              goodput_ms=slo, engine_urls=[i.url for i in running.instances])

            def make(seed: int):
                return workloads.shared_prefix(a.groups, a.per_group, a.prefix_len, a.suffix_len, a.output_len,
                                               seed=seed)

            res = asyncio.run(run_sweep(make, [Level(r) for r in rates], s, progress=console.print))
        data = {"label": pol, "base_url": running.url, "workload": "shared-prefix", "levels": res["levels"],
                "settings": figures["workload"]}
        report.write_results(out_dir, pol, data, res["results"])
        report.render_table(data, console)
        per_policy[pol] = res["levels"]
    report.plot_dir(out_dir)
    for pol, levels in per_policy.items():
        figures[pol] = [{"rate": lv["level"]["request_rate"], "completed": lv["metrics"]["completed"],
                         "failed": lv["metrics"]["failed"],
                         "ttft_p50_ms": round(lv["metrics"]["ttft_ms"]["median"], 1),
                         "tpot_p50_ms": round(lv["metrics"]["tpot_ms"]["median"], 1),
                         "e2el_p50_ms": round(lv["metrics"]["e2el_ms"]["median"], 1),
                         "good_fraction": lv["metrics"]["good_fraction"],
                         "prefix_hit_rate": lv["prefix"]["rate"]} for lv in levels]
    if len(policies) == 2:
        pa, pb = policies
        for i, r in enumerate(rates):
            A, B = figures[pa][i], figures[pb][i]
            if A["ttft_p50_ms"] > 0:
                figures[f"ttft_p50_{pa}_vs_{pb}@{r:g}"] = round(B["ttft_p50_ms"] / A["ttft_p50_ms"], 3)
            if A["prefix_hit_rate"] is not None and B["prefix_hit_rate"]:
                figures[f"prefix_hit_{pa}_vs_{pb}@{r:g}"] = round(A["prefix_hit_rate"] / B["prefix_hit_rate"], 3)
    figures["output_dir"] = str(out_dir)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
