"""Outputs of ``dlmix plan``: the deployment files (``dlmix sim`` and ``dlmix launch``), the JSON record, rich
tables and the Pareto plot."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import yaml

from dlmix.plan.analytic import time_unit
from dlmix.plan.search import Candidate, PlanResult, Planner, kv_link

__all__ = ["sim_deployment", "launch_deployment", "result_dict", "tables", "plot_pareto", "write_outputs",
           "VENDOR_DEVICE", "HUB_IDS"]

#: catalog vendor -> ``dlmix launch`` device kind (the engine platform of that vendor's chips)
VENDOR_DEVICE = {"NVIDIA": "cuda", "Huawei": "npu", "Hygon": "rocm", "MetaX": "maca", "Iluvatar CoreX": "cuda",
                 "Moore Threads": "musa", "Enflame": "gcu", "Cambricon": "mlu", "generic": "cpu"}
#: model preset -> what ``dlmix launch`` loads (hub id, or a dlmix model name)
HUB_IDS = {"llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct", "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
           "qwen3-8b": "Qwen/Qwen3-8B", "smollm2-135m": "smollm2"}


def _secs(s: float) -> str:
    """A target of ``s`` seconds as written in the report (unit: :func:`dlmix.plan.analytic.time_unit`)."""
    k, unit = time_unit(s)
    return f"{s * k:g} {unit}"


def sim_deployment(pl: Planner, c: Candidate, name: str = "plan") -> str:
    """YAML text of ``c`` that ``dlmix sim --deployment`` loads as it is, with the plan's SLO as ``slo: {ttft_ms,
    itl_ms, pct}`` (``dlmix sim`` uses it unless ``--slo-*`` are given)."""
    head = (f"# dlmix plan: {pl.inv.name} | {pl.model.name} | SLO TTFT {_secs(pl.slo.ttft)}, ITL {pl.slo.itl * 1e3:g} ms, "
            f"p{pl.slo.pct:g}\n# router policy: {c.policy} {pl.policy_params(c)}; predicted goodput "
            f"{(c.goodput or 0):.3f} req/s\n")
    d = pl.deployment_dict(c, name)  # + the SLO it was planned for: `dlmix sim -d` judges goodput against it
    d["slo"] = {"ttft_ms": round(pl.slo.ttft * 1e3, 6), "itl_ms": round(pl.slo.itl * 1e3, 6), "pct": pl.slo.pct}
    return head + yaml.safe_dump(d, sort_keys=False)


def launch_deployment(pl: Planner, c: Candidate, model_ref: Optional[str] = None, name: str = "plan",
                      chips: Optional[List[str]] = None) -> dict:
    """``c`` as a ``dlmix launch`` mapping (:func:`dlmix.launch.config.parse_deployment` schema): one instance per
    engine, named ``HOST-CHIP-ROLE-K``, ``devices`` numbered per host (a CPU instance of size ``t``: one engine
    pinned to ``t`` cores, ``cpus``), ports from 8100, the engine settings the plan simulated
    (``--max-num-batched-tokens``, ``--max-num-seqs`` in ``extra_args``), the router with the plan's policy.
    ``max_model_len``: the power of two from 2048 covering the sample's longest request (prompt + output tokens),
    at most 131072 and never above the model's context limit (``ModelSpec.max_model_len``; the planner's sample holds
    no longer request) nor, on an accelerator, above the instance's KV capacity in tokens (vLLM does not start an
    engine whose KV cache cannot hold one ``max_model_len`` sequence). ``dlmix launch`` starts processes on one host: instances of other hosts need their ``host``
    set there. ``chips``: the extra chip catalog files the plan used (``--chips``), written as ``router.chips``
    (absolute paths) so that ``dlmix launch`` and its router know the chips the instances name."""
    model = model_ref or HUB_IDS.get(pl.model.name, pl.model.name or "model")
    insts: List[dict] = []
    max_len = int(max(pl.wl.input_len + pl.wl.output_len))
    mlen = 2048
    while mlen < max_len and mlen < 131072:
        mlen *= 2
    if pl.model.max_model_len:
        mlen = min(mlen, pl.model.max_model_len)
    next_dev: Dict[str, int] = {}
    for ch in c.choices:
        if ch.role == "unused":
            continue
        g = pl.inv.group(ch.chip)
        prof = pl.inv.catalog.chip(ch.chip)
        device = VENDOR_DEVICE.get(prof.vendor, "cuda")
        # vLLM refuses to start an engine whose KV cache cannot hold one max_model_len sequence: no more than the
        # instance's KV capacity (the longer requests are the ones the simulator could not serve there either)
        cap = pl.cost.kv_capacity_tokens(ch.chip, ch.tp, float(pl.engine["gpu_memory_utilization"])) or mlen
        left = ch.instances
        for host, cnt in g.per_host:
            while left > 0 and next_dev.get(host, 0) + ch.tp <= cnt:  # PD inside a group: parts share the hosts
                k = next_dev.get(host, 0)
                next_dev[host] = k + ch.tp
                left -= 1
                # a CPU "chip" is a core: an instance of size t is one engine on t cores (its threads), not TP
                e = {"name": f"{host}-{ch.chip}-{ch.role}-{len(insts)}", "role": ch.role, "port": 8100 + len(insts),
                     "chip": c.router_chip or ch.chip, "device": device,
                     "tensor_parallel_size": pl.engine_tp(ch.chip, ch.tp),
                     "max_model_len": mlen if device == "cpu" else min(mlen, cap), "kv": {"block_size": c.block_size},
                     # the engine settings the plan simulated (vLLM's flags)
                     "extra_args": ["--max-num-batched-tokens", str(int(pl.engine["max_num_batched_tokens"])),
                                    "--max-num-seqs", str(int(pl.engine["max_num_seqs"]))]}
                if device == "cpu":
                    e["cpus"] = f"{k}-{k + ch.tp - 1}" if ch.tp > 1 else str(k)
                else:
                    e["devices"] = ",".join(str(i) for i in range(k, k + ch.tp))
                    e["kv"]["gpu_memory_utilization"] = 0.9
                insts.append(e)
    router = {"port": 8000, "policy": c.policy, "policy_params": pl.policy_params(c), "kv_events": True}
    if pl.model.name in HUB_IDS:
        router["model_spec"] = pl.model.name
    if chips:
        router["chips"] = [str(Path(f).resolve()) for f in chips]
    return {"name": name, "model": model, "served_model_name": pl.model.name or "model", "router": router,
            "instances": insts}


def _cand_dict(c: Candidate) -> dict:
    s = c.summary or {}
    return {"label": c.label(), "name": c.name, "note": c.note, "chips_used": c.chips_used,
            "groups": [{"chip": g.chip, "role": g.role, "tp": g.tp, "instances": g.instances}
                       for g in c.choices],
            "policy": c.policy, "block_size": c.block_size, "router_chip": c.router_chip,
            "analytic_req_s": round(c.analytic, 4), "binding": c.binding,
            "goodput_req_s": None if c.goodput is None else round(c.goodput, 4),
            "good_fraction": s.get("good_fraction"), "ttft_ms": s.get("ttft_ms"), "tpot_ms": s.get("tpot_ms"),
            "itl_ms": s.get("itl_ms"), "prefix_hit_rate": s.get("prefix_hit_rate"),
            "utilization": {k: round(v["utilization"], 3) for k, v in (s.get("per_instance") or {}).items()}}


def result_dict(r: PlanResult, base: Optional[Dict[str, Candidate]] = None) -> dict:
    """JSON-ready record of a plan (and its baselines with the ``plan_vs_<baseline>`` ratios)."""
    from dlmix.plan.baselines import ratios

    d = {"inventory": r.inventory.name, "total_chips": r.inventory.total_chips, "model": r.model.name,
         "model_max_len": r.model.max_model_len or None, "workload": r.workload.name,
         "requests": len(r.workload.requests), "requests_excluded": r.excluded_requests, "notes": r.notes,
         "slo": {"ttft_s": r.slo.ttft, "itl_s": r.slo.itl, "pct": r.slo.pct},
         "rate": r.rate if r.rate is not None else "maximise", "feasible": r.feasible, "reasons": r.reasons,
         "best": _cand_dict(r.best) if r.best else None, "alternatives": [_cand_dict(c) for c in r.alternatives],
         "pareto": [{"chips": c.chips_used, "goodput_req_s": round(c.goodput or 0, 4), "label": c.label()}
                    for c in r.pareto],
         "simulated": [_cand_dict(c) for c in r.simulated], "analytic_combinations": r.analytic_count,
         "simulations": r.sims, "wall_s": round(r.wall_s, 2), "cpu_s": round(r.cpu_s, 2)}
    if base:
        d["baselines"] = {n: _cand_dict(c) for n, c in base.items()}
        if r.best:
            d["ratios"] = ratios(r.best.goodput or 0.0, base)
    return d


def _pct(s: Optional[dict], key: str, p: str) -> str:
    if not s or key not in s:
        return "-"
    return f"{s[key].get(p, 0):.0f}" if key == "ttft_ms" else f"{s[key].get(p, 0):.1f}"


def tables(r: PlanResult, base: Optional[Dict[str, Candidate]] = None):
    """Rich renderables: the recommendation per chip group, the ranked candidates (best, runners-up, Pareto points),
    the baselines, or the infeasibility explanation; then the notes (what the model excluded). The title shows the
    workload's ``key=value`` settings separated by ``", "`` so that a wrapped title never splits one."""
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    out = []
    title = (f"{r.inventory.name} ({r.inventory.total_chips} chips) | {r.model.name or 'model'} | "
             f"{r.workload.name.replace(',', ', ')} | SLO "
             f"TTFT {_secs(r.slo.ttft)}, ITL {r.slo.itl * 1e3:g} ms, p{r.slo.pct:g} | "
             f"{'maximise' if r.rate is None else f'{r.rate:g} req/s'}")
    notes = [Text(f"note: {n}") for n in r.notes]
    if not r.feasible:
        t = Text(f"NO FEASIBLE DEPLOYMENT: {title}\n", style="bold red")
        for x in r.reasons:
            t.append(f"  binding: {x}\n")
        return [t] + notes
    b = r.best
    rec = Table(title=f"Recommended deployment — {title}")
    for col in ("chip group", "chips", "role", "TP", "instances", "block", "KV link"):
        rec.add_column(col)
    for ch in b.choices:
        g = r.inventory.group(ch.chip)
        link = "-"
        if ch.role != "unused":  # the link the deployment uses (deploy_sim.yaml), not the analytic optimistic one
            link = kv_link(r.inventory, b, ch)
            link = link if isinstance(link, str) else f"{link}"
        rec.add_row(ch.chip, f"{ch.chips}/{g.count}", ch.role, str(ch.tp or "-"), str(ch.instances or "-"),
                    str(b.block_size) if ch.role != "unused" else "-", link if ch.role != "unused" else "-")
    out.append(rec)
    s = b.summary or {}
    q = f"p{int(r.slo.pct)}" if f"p{int(r.slo.pct)}" in s.get("ttft_ms", {}) else "p90"
    out.append(Text(f"router policy {b.policy} {r.best and _pp(b)}; predicted goodput {b.goodput:.3f} req/s "
                    f"({'max rate with' if r.rate is None else 'at the given rate,'} "
                    f">= {r.slo.pct:g} % of requests within both targets); good {100 * s.get('good_fraction', 0):.1f} %; "
                    f"TTFT p50/{q}/p99 {_pct(s, 'ttft_ms', 'median')}/{_pct(s, 'ttft_ms', q)}/"
                    f"{_pct(s, 'ttft_ms', 'p99')} ms; TPOT p50/{q} {_pct(s, 'tpot_ms', 'median')}/"
                    f"{_pct(s, 'tpot_ms', q)} ms; chips {b.chips_used}/{r.inventory.total_chips}; "
                    f"{r.analytic_count} combinations ranked, {r.sims} simulations, {r.wall_s:.1f} s "
                    f"({r.cpu_s:.1f} s CPU)"))
    cand = Table(title="Candidates (simulated; * = Pareto front of goodput vs chips)")
    for col in ("#", "deployment", "chips", "analytic req/s", "goodput req/s", "good %", "TTFT p90 ms", "TPOT p90 ms"):
        cand.add_column(col)
    front = {id(c) for c in r.pareto}
    for i, c in enumerate(r.simulated):
        cs = c.summary or {}
        cand.add_row(f"{i + 1}{'*' if id(c) in front else ''}",
                     escape(c.label() + (" (not better than #1)" if c.note.startswith("not better") else "")),
                     str(c.chips_used), f"{c.analytic:.2f}", "-" if c.goodput is None else f"{c.goodput:.2f}",
                     f"{100 * cs.get('good_fraction', 0):.1f}", _pct(cs, "ttft_ms", "p90"), _pct(cs, "tpot_ms", "p90"))
    out.append(cand)
    if base:
        from dlmix.plan.baselines import ratios

        bt = Table(title="Baselines (same inventory, workload, SLO, simulator)")
        for col in ("baseline", "deployment", "chips", "goodput req/s", "plan_vs"):
            bt.add_column(col)
        rt = ratios(b.goodput or 0.0, base)
        for n, c in base.items():
            v = rt.get(f"plan_vs_{n}")
            bt.add_row(n, escape(c.label() + (f" ({c.note})" if c.note else "")), str(c.chips_used),
                       f"{(c.goodput or 0):.2f}", "-" if v is None else f"{v:.2f}")
        out.append(bt)
    return out + notes


def _pp(c: Candidate) -> str:
    return "" if c.policy != "cost" else "(SLO targets as ttft_target/itl_target)"


def plot_pareto(r: PlanResult, path: Path, base: Optional[Dict[str, Candidate]] = None) -> Optional[Path]:
    """PNG of goodput vs chips used: simulated candidates, the Pareto front, baselines. None without matplotlib."""
    from dlmix.plotting import pyplot

    try:
        plt = pyplot()
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = [c for c in r.simulated if c.goodput is not None]
    ax.scatter([c.chips_used for c in pts], [c.goodput for c in pts], s=18, c="0.6", label="simulated candidates")
    if r.pareto:
        ax.plot([c.chips_used for c in r.pareto], [c.goodput for c in r.pareto], "-o", c="C0", label="Pareto front")
    if r.best:
        ax.scatter([r.best.chips_used], [r.best.goodput], marker="*", s=200, c="C3", zorder=5, label="plan")
    for i, (n, c) in enumerate((base or {}).items()):
        if n == "homog_sum":
            continue
        ax.scatter([c.chips_used], [c.goodput or 0], marker="x", s=50, c=f"C{(i % 8) + 1}", label=n)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("chips used")
    ax.set_ylabel(f"goodput, req/s (p{r.slo.pct:g} within TTFT {_secs(r.slo.ttft)}, ITL {r.slo.itl * 1e3:g} ms)")
    ax.set_title(f"dlmix plan: {r.inventory.name}, {r.model.name}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(pl: Planner, r: PlanResult, out: Path, base: Optional[Dict[str, Candidate]] = None,
                  model_ref: Optional[str] = None, chips: Optional[List[str]] = None) -> List[Path]:
    """Write ``plan.json``, ``deploy_sim.yaml`` and ``deploy_launch.yaml`` (when feasible) and ``plan.png`` into
    ``out`` (``chips``: the ``--chips`` files, see :func:`launch_deployment`). Returns the paths written."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    p = out / "plan.json"
    p.write_text(json.dumps(result_dict(r, base), indent=1))
    paths.append(p)
    if r.best:
        p = out / "deploy_sim.yaml"
        p.write_text(sim_deployment(pl, r.best, f"plan-{r.inventory.name}"))
        paths.append(p)
        p = out / "deploy_launch.yaml"
        p.write_text("# dlmix plan -> dlmix launch (one host per run: set `host` of the instances on other hosts)\n"
                     + yaml.safe_dump(launch_deployment(pl, r.best, model_ref, f"plan-{r.inventory.name}", chips),
                                      sort_keys=False))
        paths.append(p)
    q = plot_pareto(r, out / "plan.png", base)
    if q:
        paths.append(q)
    return paths
