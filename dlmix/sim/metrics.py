"""Simulation metrics, with the same names as ``dlmix bench`` (vLLM ``bench serve`` conventions).

* TTFT = first token time − arrival; TPOT = (finish − first token) / (output − 1) (requests with ≥ 2 tokens);
  E2EL = finish − arrival.
* ITL = every inter-token gap. In the simulator all sequences decoding in one engine iteration get their token at
  its end, so the ITL distribution is the distribution of iteration durations weighted by the number of tokens
  they gave to already-decoding sequences (exact, no per-token records).
* Goodput (vLLM ``--goodput ttft:MS tpot:MS``; Dynamo recipe TTFT ≤ 2 s, ITL ≤ 25 ms): a request is *good* when
  TTFT ≤ ``slo_ttft`` and its mean inter-token latency (TPOT) ≤ ``slo_itl``; ``request_goodput`` = good / duration
  (req/s), ``good_fraction`` = good / all requests (failed ones count as not good; ``rejected`` counts those a
  policy's admission control refused, a subset of ``failed``; ``too_long`` counts those whose prompt + output
  exceed the model's context limit, refused at arrival as vLLM refuses them, also a subset of ``failed``).
* Prefix-hit rate = Σ prefix-hit tokens at the instance that ran the prefill / Σ prompt tokens.
* Per-instance utilization = busy time (sum of iteration durations) / duration.
Times in the summary are milliseconds where the key ends in ``_ms``, else seconds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import List, Sequence

import numpy as np

PCTS = (50, 90, 95, 99)


def _dist(vals_s, weights=None) -> dict:
    a = np.asarray(vals_s, dtype=float) * 1000.0
    if a.size == 0:
        return {"mean": 0.0, "median": 0.0, **{f"p{p}": 0.0 for p in PCTS}, "max": 0.0}
    if weights is None:
        return {"mean": float(a.mean()), "median": float(np.median(a)),
                **{f"p{p}": float(np.percentile(a, p)) for p in PCTS}, "max": float(a.max())}
    w = np.asarray(weights, dtype=float)
    order = np.argsort(a)
    a, w = a[order], w[order]
    cw = np.cumsum(w)
    tot = cw[-1]

    def q(p):
        return float(a[min(np.searchsorted(cw, p / 100.0 * tot), a.size - 1)])

    return {"mean": float((a * w).sum() / tot), "median": q(50), **{f"p{p}": q(p) for p in PCTS},
            "max": float(a[-1])}


@dataclass
class SimResult:
    """``summary``: metrics dict (JSON-ready). ``records``: per-request :class:`ReqRecord` objects."""

    summary: dict
    records: list = field(default_factory=list, repr=False)

    def to_json(self) -> str:
        """The summary as a JSON string."""
        return json.dumps(self.summary)


def summarize(recs: Sequence, insts: Sequence, step_dt: List[float], step_w: List[int], slo_ttft: float,
              slo_itl: float, label: str = "", transfers: Sequence[tuple] = ()) -> SimResult:
    """Metrics over finished records (see module docstring). ``slo_*`` in seconds."""
    ok = [r for r in recs if not r.failed and r.finish is not None and r.first_token is not None]
    n = len(recs)
    t0 = min((r.req.arrival for r in recs), default=0.0)
    t1 = max((r.finish for r in recs if r.finish is not None), default=t0)
    dur = max(t1 - t0, 1e-9)
    ttft = np.array([r.first_token - r.req.arrival for r in ok])
    e2e = np.array([r.finish - r.req.arrival for r in ok])
    tp = [(r.finish - r.first_token) / (r.req.output_len - 1) for r in ok if r.req.output_len > 1]
    tpot_by = {id(r): (r.finish - r.first_token) / (r.req.output_len - 1) if r.req.output_len > 1 else 0.0
               for r in ok}
    good = sum(1 for r in ok if r.first_token - r.req.arrival <= slo_ttft and tpot_by[id(r)] <= slo_itl)
    out_tok = sum(r.req.output_len for r in ok)
    in_tok = sum(r.req.input_len for r in ok)
    hit = sum(r.hit for r in ok)
    per = {}
    for i in insts:
        per[i.id] = {"chip": i.spec.chip, "role": i.role, "utilization": i.busy_time / dur,
                     "requests": i.requests, "iterations": i.n_steps, "prefill_tokens": i.prefill_tokens,
                     "decode_tokens": i.decode_tokens,
                     "prefix_hit_rate": (i.hit_tokens / i.prompt_tokens) if i.prompt_tokens else 0.0,
                     "kv_blocks": i.kv.num_blocks, "evicted_blocks": i.kv.evicted}
    pd = [r for r in ok if r.prefill_inst is not None and r.prefill_inst is not r.decode_inst]
    summary = {
        "label": label,
        "num_requests": n,
        "completed": len(ok),
        "failed": n - len(ok),
        "rejected": sum(1 for r in recs if getattr(r, "rejected", False)),
        "too_long": sum(1 for r in recs if getattr(r, "too_long", False)),
        "duration_s": dur,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tok / dur,
        "total_token_throughput": (out_tok + in_tok) / dur,
        "request_goodput": good / dur,
        "good_fraction": good / n if n else 0.0,
        "goodput_targets_ms": {"ttft": slo_ttft * 1000.0, "tpot": slo_itl * 1000.0},
        "ttft_ms": _dist(ttft),
        "tpot_ms": _dist(tp),
        "itl_ms": _dist(step_dt, step_w),
        "e2el_ms": _dist(e2e),
        "prefix_hit_rate": hit / in_tok if in_tok else 0.0,
        "pd_fraction": len(pd) / len(ok) if ok else 0.0,
        "kv_transfer_mean_ms": (float(np.mean([r.xfer_s for r in pd])) * 1000.0) if pd else 0.0,
        "kv_transferred_gb": sum(t[1] for t in transfers) / 1e9,
        "per_instance": per,
    }
    return SimResult(summary, list(recs))


def format_table(rows: Sequence[dict], title: str = "") -> str:
    """Plain-text table of summaries (one row each): good and rejected %, goodput, TTFT/ITL/TPOT percentiles, hit
    rate, throughput."""
    hdr = ["label", "good%", "rej%", "goodput/s", "TTFT mean", "TTFT p50", "TTFT p90", "TTFT p99", "ITL p50", "ITL p99",
           "TPOT p90", "hit%", "out tok/s"]
    lines = [title] if title else []
    body = []
    for s in rows:
        n = max(s.get("num_requests", 0), 1)
        body.append([str(s.get("label", "")), f"{100 * s['good_fraction']:.1f}", f"{100 * s.get('rejected', 0) / n:.1f}",
                     f"{s['request_goodput']:.3f}",
                     f"{s['ttft_ms']['mean']:.0f}", f"{s['ttft_ms']['median']:.0f}", f"{s['ttft_ms']['p90']:.0f}",
                     f"{s['ttft_ms']['p99']:.0f}", f"{s['itl_ms']['median']:.1f}", f"{s['itl_ms']['p99']:.1f}",
                     f"{s['tpot_ms']['p90']:.1f}", f"{100 * s['prefix_hit_rate']:.1f}",
                     f"{s['output_throughput']:.0f}"])
    w = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(hdr)]
    lines.append("  ".join(h.rjust(w[i]) for i, h in enumerate(hdr)))
    for b in body:
        lines.append("  ".join(c.rjust(w[i]) for i, c in enumerate(b)))
    return "\n".join(lines)


def format_instances(rows: Sequence[dict]) -> str:
    """Plain-text table of per-instance utilization (busy fraction) and prefix-hit rate, one row per summary."""
    if not rows:
        return ""
    ids = list(rows[0]["per_instance"])
    w = max(len(str(r.get("label", ""))) for r in rows)
    lines = ["per-instance utilization % / prefix-hit %: " + ", ".join(
        f"{i} ({rows[0]['per_instance'][i]['chip']}, {rows[0]['per_instance'][i]['role']})" for i in ids)]
    for r in rows:
        cells = [f"{100 * r['per_instance'][i]['utilization']:5.1f}/{100 * r['per_instance'][i]['prefix_hit_rate']:4.1f}"
                 for i in ids]
        lines.append(str(r.get("label", "")).rjust(w) + "  " + "  ".join(cells))
    return "\n".join(lines)
