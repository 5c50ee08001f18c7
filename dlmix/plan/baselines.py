"""Baselines ``dlmix plan`` reports against, on the same inventory, simulated exactly as the plan's candidates
(same workload sample, SLO, rate grid, simulator and router policy):

* ``homog_<chip>``: the best homogeneous aggregated deployment of one chip type (every chip of that type in
  ``both``-role instances at the TP size of largest simulated goodput among those whose weights fit), what a
  per-system configurator recommends; ``homog_best`` is the best of them, ``homog_sum`` the sum of their goodputs
  (each type run as its own cluster, with a perfect load splitter in front: an upper bound of that practice);
* ``all_aggregated``: every chip aggregated behind the router (``both``, each group at the smallest TP whose weights
  and the percentile request fit; the seed's first mode);
* ``blind_pd``: a hardware-blind PD split: the chips in inventory order, the first half (rounded to whole chip
  groups, at least one group) prefill, the rest decode, each at the smallest fitting TP, and the router told every
  instance is the first group's chip (so its cost model cannot tell the chips apart). A one-group inventory splits
  its instances in two halves. A blind operator is as likely to list the chips the other way round:
  ``blind_pd_reversed`` is the same rule on the reversed inventory order.
"""
from __future__ import annotations

from typing import Dict, List

from dlmix.plan.search import Candidate, GroupChoice, Planner

__all__ = ["baselines", "ratios"]


def _min_tp(pl: Planner, chip: str, role: str):
    g = pl.inv.group(chip)
    for tp in pl.tp_sizes(g):
        e = pl.estimate(chip, tp, role)
        if e.figures.get("kv_capacity_tokens", 0) >= 1 and not e.reason.startswith("memory"):
            return tp
    return None


def baselines(pl: Planner, progress=None) -> Dict[str, Candidate]:
    """Simulate the baselines (module docstring) with ``pl``'s settings. Returns name → evaluated
    :class:`Candidate` (goodput 0 when it cannot meet the SLO at any rate tried, or does not fit)."""
    out: Dict[str, Candidate] = {}
    groups = pl.inv.groups
    jobs: List[tuple] = []
    for g in groups:
        for tp in pl.tp_sizes(g):
            if _fits(pl, g.chip, tp):
                jobs.append((f"homog_{g.chip}", Candidate((GroupChoice(g.chip, "both", tp, g.instances(tp)),),
                                                          pl.policy, pl.block_size, name=f"homog_{g.chip}")))
    agg = []
    for g in groups:
        tp = _min_tp(pl, g.chip, "both")
        if tp:
            agg.append(GroupChoice(g.chip, "both", tp, g.instances(tp)))
    if agg:
        jobs.append(("all_aggregated", Candidate(tuple(agg), pl.policy, pl.block_size, name="all_aggregated")))
    for name, rev in (("blind_pd", False), ("blind_pd_reversed", True)):
        blind = _blind(pl, rev)
        if blind is not None:
            blind.name = name
            jobs.append((name, blind))
    for i, (name, c) in enumerate(jobs):
        c.analytic, c.binding = pl.analytic(c.choices)
        if progress:
            progress(f"baseline {name}: {c.label()}", i, len(jobs))
        pl.evaluate(c, guess=max(c.analytic, 0.05) if c.analytic > 0 else None)
        prev = out.get(name)
        if prev is None or (c.goodput or 0) > (prev.goodput or 0):
            out[name] = c
    homog = [c for n, c in out.items() if n.startswith("homog_")]
    if homog:
        best = max(homog, key=lambda c: c.goodput or 0)
        out["homog_best"] = best
        s = Candidate(tuple(ch for c in homog for ch in c.choices), pl.policy, pl.block_size, name="homog_sum")
        s.goodput = sum(c.goodput or 0 for c in homog)
        s.note = "sum of the per-type clusters' goodputs (not one deployment)"
        out["homog_sum"] = s
    return out


def _fits(pl: Planner, chip: str, tp: int) -> bool:
    e = pl.estimate(chip, tp, "both")
    return not e.reason.startswith("memory")


def _blind(pl: Planner, reverse: bool = False):
    groups = pl.inv.groups[::-1] if reverse else pl.inv.groups
    total = pl.inv.total_chips
    tps = {g.chip: _min_tp(pl, g.chip, "prefill") for g in groups}
    usable = [g for g in groups if tps[g.chip]]
    if not usable:
        return None
    if len(usable) == 1:
        g = usable[0]
        n = g.instances(tps[g.chip])
        if n < 2:
            return None
        ch = (GroupChoice(g.chip, "prefill", tps[g.chip], n // 2), GroupChoice(g.chip, "decode", tps[g.chip],
                                                                                 n - n // 2))
    else:
        ch, acc = [], 0
        for i, g in enumerate(usable):
            role = "prefill" if (acc < total / 2 and i < len(usable) - 1) else "decode"
            acc += g.count
            ch.append(GroupChoice(g.chip, role, tps[g.chip], g.instances(tps[g.chip])))
        ch = tuple(ch)
    return Candidate(tuple(ch), pl.policy, pl.block_size, router_chip=usable[0].chip, name="blind_pd")


def ratios(plan_goodput: float, base: Dict[str, Candidate]) -> Dict[str, object]:
    """``plan_vs_<name>`` = plan goodput / baseline goodput (None when the baseline's goodput is 0)."""
    out: Dict[str, object] = {}
    for n, c in base.items():
        g = c.goodput or 0.0
        out[f"plan_vs_{n}"] = round(plan_goodput / g, 3) if g > 0 else None
    return out
