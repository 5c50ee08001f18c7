"""dlmix plan study: the plan on the built-in inventories against the baselines and exhaustive simulation.

For each inventory (4 H100 + 4 H20; 8 Ascend 910B + 4 H20; ``mix32``: 8 910B + 8 K100 + 8 C500 + 4 MTT-S4000 +
4 H20) plans Llama-3.1-8B on the Mooncake conversation trace (first N requests) for the largest rate at which 80 %
of requests meet TTFT <= 5 s and ITL (TPOT) <= 50 ms, then simulates the baselines of :mod:`dlmix.plan.baselines`
and, on the two small inventories, every combination of the search space (each chip group: unused, or prefill /
decode / both at every TP size whose weights fit, or split between prefill and decode with the analytically best
split at every TP size where both parts pass; router policy ``cost``, block 64) with the same rate search.

Figures (last stdout line, one JSON object): per inventory ``plan_goodput`` (req/s), ``plan_vs_<baseline>``,
``plan_vs_exhaustive`` (the plan's best in that space / the exhaustive best; the plan's refinement can only add to
it, reported as ``plan_refined_vs_exhaustive``), ``plan_wall_s`` and ``plan_cpu_s`` (planning time without the
baselines; the wall time includes waiting for the CPU on a shared machine), ``exhaustive_combinations``.

    python benchmarks/plan_study.py --quick      # 200-request sample
    python benchmarks/plan_study.py              # 400-request sample
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from dlmix.plan.analytic import SLO
from dlmix.plan.baselines import baselines, ratios
from dlmix.plan.inventory import load_inventory
from dlmix.plan.search import Planner
from dlmix.plan.workload import load_plan_workload
from dlmix.sim.config import load_model

INVENTORIES = ("h100x4_h20x4", "910bx8_h20x4", "mix32")
EXHAUSTIVE = ("h100x4_h20x4", "910bx8_h20x4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="200-request sample (default 400)")
    ap.add_argument("--inventories", default=",".join(INVENTORIES))
    ap.add_argument("--no-exhaustive", action="store_true")
    a = ap.parse_args()
    n = 200 if a.quick else 400
    wl = load_plan_workload("mooncake", n)
    slo = SLO(5.0, 0.05, 80)
    model = load_model("llama-3.1-8b")
    out = {"workload": f"mooncake first {n}", "model": model.name,
           "slo": {"ttft_s": slo.ttft, "itl_s": slo.itl, "pct": slo.pct}}
    for name in a.inventories.split(","):
        inv = load_inventory(name)
        pl = Planner(inv, model, slo, wl)
        r = pl.plan()
        in_space = max((c.goodput or 0) for c in r.simulated if c.policy == "cost" and c.block_size == 64)
        row = {"chips": inv.total_chips, "plan": r.best.label() if r.best else None,
               "plan_goodput": round(r.best.goodput, 3) if r.best else 0.0, "plan_wall_s": round(r.wall_s, 1),
               "plan_cpu_s": round(r.cpu_s, 1), "plan_sims": r.sims, "analytic_combinations": r.analytic_count,
               "pareto": [[c.chips_used, round(c.goodput, 3)] for c in r.pareto]}
        print(f"[{name}] plan {row['plan']} goodput {row['plan_goodput']} req/s in {r.wall_s:.1f} s "
              f"({r.cpu_s:.1f} s CPU, {r.sims} sims)", file=sys.stderr, flush=True)
        base = baselines(pl)
        row.update(ratios(r.best.goodput if r.best else 0.0, base))
        row["baseline_goodput"] = {k: round(c.goodput or 0, 3) for k, c in base.items()}
        print(f"[{name}] baselines {row['baseline_goodput']}", file=sys.stderr, flush=True)
        if name in EXHAUSTIVE and not a.no_exhaustive:
            ex = Planner(inv, model, slo, wl)
            t = time.perf_counter()
            cands = ex.enumerate(keep_tp=None)
            for c in cands:
                ex.evaluate(c)
            best = max(cands, key=lambda c: c.goodput or 0)
            row["exhaustive_combinations"] = len(cands)
            row["exhaustive_best"] = best.label()
            row["exhaustive_goodput"] = round(best.goodput or 0, 3)
            row["exhaustive_wall_s"] = round(time.perf_counter() - t, 1)
            row["plan_vs_exhaustive"] = round(in_space / best.goodput, 3) if best.goodput else None
            row["plan_refined_vs_exhaustive"] = (round(r.best.goodput / best.goodput, 3)
                                                 if best.goodput and r.best else None)
            print(f"[{name}] exhaustive {len(cands)} combinations: best {best.label()} {best.goodput:.3f} req/s",
                  file=sys.stderr, flush=True)
        out[name] = row
    print(json.dumps(out))


if __name__ == "__main__":
    main()
