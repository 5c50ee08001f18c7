"""PNG plots of simulation results (matplotlib, Agg backend; matplotlib is in the ``dev`` extra)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

import numpy as np

from dlmix.plotting import pyplot as _plt  # the one matplotlib set-up


def plot_results(results: Sequence, out_dir, title: str = "") -> List[Path]:
    """Write ``ttft_cdf.png``, ``goodput.png`` and ``utilization.png`` for a list of :class:`SimResult` (one per
    policy) into ``out_dir``. Returns the paths written."""
    plt = _plt()
    out = Path(out_dir)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        t = np.sort([x.first_token - x.req.arrival for x in r.records if x.first_token is not None and not x.failed])
        if t.size:
            ax.plot(t, np.arange(1, t.size + 1) / t.size, label=r.summary["label"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.axvline(r.summary["goodput_targets_ms"]["ttft"] / 1000.0 if results else 2.0, color="grey", ls=":")
    ax.set_title(f"TTFT CDF {title}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = out / "ttft_cdf.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [r.summary["label"] for r in results]
    ax.bar(range(len(labels)), [r.summary["request_goodput"] for r in results])
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("goodput (req/s meeting TTFT and ITL SLO)")
    ax.set_title(f"Goodput {title}")
    fig.tight_layout()
    p = out / "goodput.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(len(results), 1)
    for k, r in enumerate(results):
        per = r.summary["per_instance"]
        ax.bar(np.arange(len(per)) + k * width, [v["utilization"] for v in per.values()], width,
               label=r.summary["label"])
    if results:
        ids = list(results[0].summary["per_instance"])
        ax.set_xticks(np.arange(len(ids)) + 0.4 - width / 2)
        ax.set_xticklabels(ids, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("utilization (busy fraction)")
    ax.set_title(f"Per-instance utilization {title}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = out / "utilization.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def plot_study(rows: Sequence[dict], out_dir, name: str = "study") -> List[Path]:
    """Goodput and TTFT p90 versus load for every (workload, cluster) of a study: ``rows`` are dicts with
    ``workload``, ``cluster``, ``load``, ``policy``, ``request_goodput``, ``ttft_p90_ms``. One PNG per pair."""
    plt = _plt()
    out = Path(out_dir)
    paths = []
    pairs = sorted({(r["workload"], r["cluster"]) for r in rows})
    for wl, cl in pairs:
        sub = [r for r in rows if r["workload"] == wl and r["cluster"] == cl]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for pol in sorted({r["policy"] for r in sub}):
            pts = sorted((r["load"], r["request_goodput"], r["ttft_p90_ms"]) for r in sub if r["policy"] == pol)
            xs = [p[0] for p in pts]
            a1.plot(xs, [p[1] for p in pts], marker="o", label=pol)
            a2.plot(xs, [p[2] / 1000.0 for p in pts], marker="o", label=pol)
        a1.set_xlabel("arrival speedup")
        a1.set_ylabel("goodput (req/s)")
        a2.set_xlabel("arrival speedup")
        a2.set_ylabel("TTFT p90 (s)")
        a2.set_yscale("log")
        a1.legend(fontsize=7)
        fig.suptitle(f"{wl} / {cl}")
        fig.tight_layout()
        p = out / f"{name}_{wl}_{cl}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths
