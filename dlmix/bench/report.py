"""Benchmark output: a rich table, ``results.json``/``requests.jsonl`` files, and PNG plots (matplotlib, Agg).

Folder layout (``--output-dir OUT``, one sub-folder per ``--label``)::

    OUT/LABEL/results.json      settings + per-level metrics (one object)
    OUT/LABEL/requests.jsonl    per-request records of every level (level index, TTFT, ITL, ...)
    OUT/latency_vs_load.png     every label found under OUT, one line per label (so two runs with different
    OUT/throughput_vs_load.png  router policies and the same OUT give comparison plots)
    OUT/summary.json            one object: label -> list of per-level headline figures
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

__all__ = ["render_table", "write_results", "plot_dir", "load_level_x", "plot_xs", "throughput_series"]


def _f(v: Optional[float], nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def render_table(data: dict, console: Optional[Console] = None, title: str = "") -> Table:
    """Print one run (``results.json`` content) as a table: a row per load level. A level where no request
    succeeded shows ``-`` for the latencies (its ``results.json`` zeros, as ``vllm bench serve`` writes them, are no
    measurement: a 0.0 ms TTFT read as the fastest level)."""
    pct = [k for k in data["levels"][0]["metrics"]["ttft_ms"] if k.startswith("p")] if data["levels"] else []
    hi = pct[-1] if pct else "max"
    t = Table(title=title or f"dlmix bench: {data.get('label', '')} -> {data.get('base_url', '')}")
    cols = ["load", "ok/fail", "req/s", "out tok/s", f"TTFT p50/{hi}", f"TPOT p50/{hi}", f"ITL p50/{hi}",
            f"E2EL p50/{hi}", "goodput req/s (good %)", "prefix hit %"]
    for c in cols:
        t.add_column(c, justify="right" if c != "load" else "left")
    for lv in data["levels"]:
        m, p = lv["metrics"], lv["prefix"]
        good = m.get("good_fraction")

        def pair(key: str) -> str:
            if not m["completed"]:
                return "-"
            return f"{_f(m[key]['median'])} / {_f(m[key].get(hi))}"

        t.add_row(lv["level"]["label"], f"{m['completed']}/{m['failed']}", _f(m["request_throughput"], 2),
                  _f(m["output_throughput"]), pair("ttft_ms"), pair("tpot_ms"), pair("itl_ms"), pair("e2el_ms"),
                  "-" if good is None else f"{_f(m.get('request_goodput'), 2)} ({100 * good:.0f}%)",
                  "-" if p.get("rate") is None else f"{100 * p['rate']:.1f} ({p['source']})")
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 160)
    console.print(t)
    return t


def write_results(out_dir: Path, label: str, data: dict, raw_results: list) -> Path:
    """Write ``OUT/LABEL/results.json`` and ``requests.jsonl``; returns the run folder."""
    d = Path(out_dir) / label
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.json").write_text(json.dumps(_finite(data), indent=1, allow_nan=False))
    with open(d / "requests.jsonl", "w") as f:
        for i, level in enumerate(raw_results):
            for r in level:
                f.write(json.dumps(_finite({"level": i, **r.to_dict()}), allow_nan=False) + "\n")
    return d


def _finite(o):
    """``o`` with every infinite float as the string ``"inf"``/``"-inf"`` (and NaN as None), so the files are strict
    JSON: ``json.dumps`` writes a float ``inf`` (``--request-rate inf``, the default; ``--burstiness inf``) as the bare
    token ``Infinity``, which JSON parsers other than Python's refuse (``JSON.parse``) or turn into 1.8e308 (jq).
    :func:`load_level_x` reads ``"inf"`` back."""
    if isinstance(o, float):
        if math.isnan(o):
            return None
        return ("inf" if o > 0 else "-inf") if math.isinf(o) else o
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def load_level_x(level: dict) -> tuple[str, float]:
    """(axis name, value) of a level for plotting: offered request rate, else concurrency; ``("unbounded", inf)``
    for a level with an infinite rate and no concurrency cap (every request at once: the heaviest load of a sweep),
    ``("level", 0.0)`` for a trace replay."""
    rate = level.get("request_rate")
    if isinstance(rate, str):
        rate = float(rate)
    if rate is not None and not math.isinf(rate):
        return "request rate (req/s)", float(rate)
    if level.get("max_concurrency"):
        return "max concurrency", float(level["max_concurrency"])
    if rate is not None:
        return "unbounded", math.inf
    return "level", 0.0


def plot_xs(levels_by_run: dict) -> tuple[str, dict, Optional[float]]:
    """Where the plots put each level: ``(axis name, {label: [x per level]}, x of unbounded levels or None)``.

    The axis is the request rate when any level has a finite rate, else the concurrency. An unbounded level
    (``--request-rate inf`` without a cap, or ``--max-concurrency 0``) is the heaviest load, so it is placed right
    of the largest finite x (at twice it; 1 when there is none) and its tick reads ``inf``, never at 0.
    """
    named = {label: [load_level_x(lv["level"]) for lv in lvls] for label, lvls in levels_by_run.items()}
    names = [n for pts in named.values() for n, _ in pts]
    xname = next((n for n in ("request rate (req/s)", "max concurrency") if n in names), None) \
        or ("request rate (req/s)" if "unbounded" in names else names[0] if names else "load")  # inf alone: a rate
    finite = [x for pts in named.values() for _, x in pts if not math.isinf(x)]
    inf_x = None
    if any(math.isinf(x) for pts in named.values() for _, x in pts):
        inf_x = 2.0 * max(finite) if finite and max(finite) > 0 else 1.0
    xs = {label: [inf_x if math.isinf(x) else x for _, x in pts] for label, pts in named.items()}
    return xname, xs, inf_x


def throughput_series(levels: list) -> tuple[list, list, list]:
    """y values of the throughput plot per level: output tok/s, goodput req/s, prefix-hit rate %. A figure the run
    did not measure (goodput without ``--goodput``, a hit rate without engine counters: ``-`` in the table) is NaN,
    which matplotlib leaves out, not 0 (a measured zero, e.g. no good request, stays 0)."""
    def y(v: Optional[float], scale: float = 1.0) -> float:
        return math.nan if v is None else scale * v

    return ([lv["metrics"]["output_throughput"] for lv in levels],
            [y(lv["metrics"].get("request_goodput")) for lv in levels],
            [y(lv["prefix"].get("rate"), 100.0) for lv in levels])


def _mark_inf(ax, inf_x: Optional[float]) -> None:
    """Label the tick of the unbounded levels (see :func:`plot_xs`) ``inf``."""
    if inf_x is None:
        return
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t < inf_x * 0.9] + [inf_x]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks[:-1]] + ["inf"])
    ax.set_xlim(lo, hi)  # the data's range, not the tick locator's


def plot_dir(out_dir: Path) -> list[Path]:
    """Plot every ``OUT/*/results.json`` together; returns the PNG paths written (empty without runs)."""
    from dlmix.plotting import pyplot

    plt = pyplot()

    out_dir = Path(out_dir)
    runs = {}
    for f in sorted(out_dir.glob("*/results.json")):
        try:
            runs[f.parent.name] = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
    if not runs:
        return []
    hi_key = None
    written = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"), ("e2el_ms", "E2E latency (ms)")]
    xname, run_xs, inf_x = plot_xs({label: data.get("levels") or [] for label, data in runs.items()})
    summary = {}
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0", "C1", "C2", "C3"])
    for n, (label, data) in enumerate(runs.items()):
        color = colors[n % len(colors)]
        lvls = data.get("levels") or []
        if not lvls:
            continue
        xs = run_xs[label]
        pk = [k for k in lvls[0]["metrics"]["ttft_ms"] if k.startswith("p") and k != "p50"]
        hi_key = pk[-1] if pk else "max"
        for ax, (key, title) in zip(axes.flat, panels):
            ax.plot(xs, [lv["metrics"][key]["median"] for lv in lvls], marker="o", color=color, label=f"{label} p50")
            ax.plot(xs, [lv["metrics"][key][hi_key] for lv in lvls], marker="x", linestyle="--", color=color,
                    label=f"{label} {hi_key}")
            ax.set_title(title)
            ax.set_xlabel(xname)
            ax.grid(True, alpha=0.3)
        summary[label] = [{"load": lv["level"]["label"], "ttft_p50_ms": lv["metrics"]["ttft_ms"]["median"],
                           "tpot_p50_ms": lv["metrics"]["tpot_ms"]["median"],
                           "e2el_p50_ms": lv["metrics"]["e2el_ms"]["median"],
                           "output_throughput": lv["metrics"]["output_throughput"],
                           "request_goodput": lv["metrics"].get("request_goodput"),
                           "prefix_hit_rate": lv["prefix"].get("rate")} for lv in lvls]
    for ax in axes.flat:
        ax.legend(fontsize=7)
        _mark_inf(ax, inf_x)
    fig.suptitle("dlmix bench: latency vs load")
    fig.tight_layout()
    p = out_dir / "latency_vs_load.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    written.append(p)

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    measured = [False, False, False]
    for label, data in runs.items():
        lvls = data.get("levels") or []
        if not lvls:
            continue
        xs = run_xs[label]
        for k, (ax, ys) in enumerate(zip(axes, throughput_series(lvls))):
            ax.plot(xs, ys, marker="o", label=label)
            measured[k] = measured[k] or any(not math.isnan(v) for v in ys)
    for ax, title, seen, why in zip(axes, ("output throughput (tok/s)", "goodput (req/s)", "prefix hit rate (%)"),
                                    measured, ("", "no --goodput", "no engine prefix-cache counters")):
        ax.set_title(title)
        ax.set_xlabel(xname)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        if not seen:
            ax.text(0.5, 0.5, f"not measured ({why})", transform=ax.transAxes, ha="center", va="center")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        _mark_inf(ax, inf_x)
    fig.tight_layout()
    p = out_dir / "throughput_vs_load.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    written.append(p)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return written
