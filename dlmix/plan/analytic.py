"""Analytic pruning of ``dlmix plan``: per chip group and role, does an instance fit, meet the SLO, and how many
requests per second can it carry? Formulas from :class:`dlmix.hw.cost.CostModel` (DistServe OSDI'24 §3,
Splitwise ISCA'24 §3, Mooncake FAST'25 §5); units: seconds, tokens, bytes, req/s.

Per instance of chip ``c`` with TP size ``t`` (``t`` chips), for the workload sample (prompt ``N_i``, ideal prefix
hit ``h_i``, output ``O_i``), SLO TTFT target ``T*``, ITL target ``I*``, attainment percentile ``q``:

* **memory fit**: KV capacity ``(0.9 · mem · t − P·b) / kv_bpt(t)`` must hold the ``q``-th percentile request's
  prompt + output tokens (vLLM reserves them; the weights alone may already not fit); ``kv_bpt(t)``: the KV bytes
  per token over the ``t`` ranks, ``t / h_kv`` times ``kv_bpt`` when ``t`` exceeds the model's ``h_kv`` KV heads
  (each rank holds at least one, :meth:`dlmix.hw.cost.ModelSpec.kv_bytes_per_token_tp`);
* **TTFT**: the share of requests whose own prefill ``T_pre(N_i, h_i)`` (plus, on a prefill-role instance, the KV
  transfer of ``N_i`` tokens over the group's link) is within ``T*`` must reach ``q``;
* **prefill capacity** ``p = ρ / mean_i T_pre(N_i, h_i)`` req/s with target utilisation ``ρ = 0.8`` (queueing);
* **ITL**: one decoding request's step ``T_step(1, C̄)`` (``C̄ = mean N + mean O / 2``) must be within ``I*``;
* **decode capacity** ``d = B / (Ō · T_step(B, B·C̄))`` req/s with the largest batch ``B`` whose step is within
  ``I*`` (``0.75 · I*`` on an aggregated instance, where chunked prefills share the iterations), that fits the KV
  capacity (``B · (N̄ + Ō)``) and ``max_num_seqs``;
* **KV transfer**: a prefill-role instance can send at most ``link bytes/s / (mean uncached N · kv_bpt)`` req/s.

With a measured timing profile (:class:`dlmix.sim.timing.LinearTiming`, ``T_iter = c0 + c_tok·T_p + c_quad·Q +
c_seq·B + c_ctx·S``) instead of the roofline: ``T_pre(N, h) = r0 + k·c0 + c_tok·(N − h) + c_quad·(N² − h²)`` with
``k = ⌈(N − h) / budget⌉`` prefill iterations of the token ``budget``, and ``T_step(B, S) = c0 + c_seq·B + c_ctx·S``,
so the largest batch within an ITL target ``I`` is ``(I − c0) / (c_seq + c_ctx·C̄)``.

Cluster capacity (:func:`cluster_capacity`): the largest rate ``λ`` whose prefill work fits the prefill-role
instances plus a share of the aggregated ones, and whose decode work fits the decode-role instances plus the rest of
the aggregated ones' time (a two-resource split solved greedily by prefill/decode speed ratio, which is optimal for
this fractional problem).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Sequence, Tuple

import numpy as np

from dlmix.hw.cost import CostModel
from dlmix.plan.workload import PlanWorkload

__all__ = ["SLO", "RoleEstimate", "estimate_role", "cluster_capacity", "RHO_PREFILL", "BOTH_ITL_FACTOR"]

RHO_PREFILL = 0.8
BOTH_ITL_FACTOR = 0.75
MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class SLO:
    """Latency targets: ``ttft`` and ``itl`` in seconds (ITL = a request's mean inter-token time, TPOT) and the
    attainment ``pct`` (e.g. 90: at least 90 % of requests meet both targets)."""

    ttft: float
    itl: float
    pct: float = 90.0

    @property
    def attain(self) -> float:
        """Required fraction of good requests (``pct / 100``)."""
        return self.pct / 100.0


@dataclass
class RoleEstimate:
    """Analytic figures of one instance (chip, TP size) in one role.

    Attributes:
        ok: fits and meets the SLO on its own. reason: why not (the binding constraint), else "".
        p: prefill capacity, req/s (0 for decode). d: decode capacity, req/s (0 for prefill).
        ttft_share: share of requests whose prefill (+ transfer) fits the TTFT target.
        xfer_cap: KV-transfer-limited rate of a prefill-role instance, req/s (inf otherwise).
        figures: the numbers behind ``reason`` (for reports).
    """

    ok: bool
    reason: str = ""
    p: float = 0.0
    d: float = 0.0
    ttft_share: float = 0.0
    xfer_cap: float = float("inf")
    figures: Dict[str, float] = field(default_factory=dict)


class _WorkStats:
    """Workload numbers the estimates need, computed once per (workload, model)."""

    def __init__(self, wl: PlanWorkload, cost: CostModel, slo: SLO):
        n = wl.input_len.astype(float)
        h = np.minimum(wl.hit, wl.input_len - 1).astype(float)
        self.n_mean = float(n.mean())
        self.o_mean = float(wl.output_len.mean())
        self.ctx = self.n_mean + self.o_mean / 2
        m = cost.model
        self.flops = m.flops_per_token * (n - h) + m.attn_flops_per_token2 * (n * n - h * h)  # per request, FLOP
        self.flops_mean = float(self.flops.mean())
        self.n_tokens = n
        self.hit = h
        self.uncached_mean = float((n - h).mean())
        q = slo.pct
        self.req_pct = float(np.percentile(n + wl.output_len, q))
        self.n_pct = float(np.percentile(n, q))


def time_unit(target_s: float) -> Tuple[float, str]:
    """How a time next to the target ``target_s`` (seconds) is written: ``(factor, unit)``, seconds for a target of
    a second or more, milliseconds below (a 1 ms target read "0.00 s")."""
    return (1.0, "s") if target_s >= 1 else (1e3, "ms")


def work_stats(wl: PlanWorkload, cost: CostModel, slo: SLO) -> _WorkStats:
    """:class:`_WorkStats` for this (workload, cost model, SLO), memoised on the workload object."""
    key = (id(cost), slo)
    memo = wl.__dict__.setdefault("_stats", {})
    s = memo.get(key)
    if s is None or s.cost is not cost:
        s = memo[key] = _WorkStats(wl, cost, slo)
        s.cost = cost
    return s


def estimate_role(cost: CostModel, wl: PlanWorkload, slo: SLO, chip: str, tp: int, role: str,
                  link=None, timing=None, budget: int = 8192, max_num_seqs: int = MAX_NUM_SEQS) -> RoleEstimate:
    """Analytic estimate of one instance (see the module docstring). ``role`` is ``prefill``/``decode``/``both``;
    ``link`` the KV link descriptor of a prefill-role instance; ``timing`` a measured
    :class:`dlmix.sim.timing.LinearTiming` of this instance size (None: the catalog roofline); ``budget`` the
    engine's token budget per iteration and ``max_num_seqs`` its sequence limit. Raises KeyError for an unknown
    chip."""
    st = work_stats(wl, cost, slo)
    c_f, c_b = cost.coefs(chip, tp)
    if timing is not None:
        new = st.n_tokens - st.hit
        pre_t = (timing.r0 + np.ceil(np.maximum(new, 1.0) / budget) * timing.c0 + timing.c_tok * new
                 + timing.c_quad * (st.n_tokens ** 2 - st.hit ** 2))

        def step_time(b: int, s: float) -> float:
            return timing.c0 + timing.c_seq * b + timing.c_ctx * s
    else:
        pre_t = cost.t0 + st.flops * c_f

        def step_time(b: int, s: float) -> float:
            return cost.decode_step_time(chip, b, int(s), tp)
    cap = cost.kv_capacity_tokens(chip, tp)
    fig: Dict[str, float] = {"kv_capacity_tokens": float(cap)}
    if cap <= 0:
        p = cost.chip(chip)
        return RoleEstimate(False, f"memory: {cost.model.name or 'model'} weights "
                            f"({cost.model.params * cost.model.dtype_bytes / 1e9:.1f} GB) exceed 90 % of "
                            f"{tp}× {chip} ({0.9 * p.mem_gb * tp:.1f} GB)", figures=fig)
    if cap < st.req_pct:
        return RoleEstimate(False, f"memory: KV cache of {tp}× {chip} holds {cap} tokens < the p{slo.pct:g} request "
                            f"({st.req_pct:.0f} prompt+output tokens)", figures=fig)
    est = RoleEstimate(True, figures=fig)
    if role in ("prefill", "both"):
        t_pre = pre_t
        if role == "prefill":
            ln = cost.catalog.link(link)
            t_pre = t_pre + ln.setup_ms * 1e-3 + st.n_tokens * cost.kv_bpt / ln.bytes_per_s
            est.xfer_cap = ln.bytes_per_s / max(st.uncached_mean * cost.kv_bpt, 1.0)
        est.ttft_share = float((t_pre <= slo.ttft).mean())
        t_q = float(np.percentile(t_pre, slo.pct))
        fig["ttft_pct_s"] = t_q
        est.p = RHO_PREFILL / float(pre_t.mean())
        if est.ttft_share < slo.attain:
            est.ok = False
            k, unit = time_unit(slo.ttft)
            nd = ".2f" if unit == "s" else ".4g"
            a, b = f"{t_q * k:{nd}} {unit}", f"{slo.ttft * k:{nd}} {unit}"
            est.reason = (f"TTFT: the p{slo.pct:g} prompt ({st.n_pct:.0f} tokens) takes {a} to prefill"
                          f"{' and transfer' if role == 'prefill' else ''} on {tp}× {chip} > {b} target")
    if role in ("decode", "both"):
        itl = slo.itl * (BOTH_ITL_FACTOR if role == "both" else 1.0)
        step1 = step_time(1, st.ctx)
        fig["itl_1_s"] = step1
        if step1 > itl:
            est.ok = False
            est.d = 0.0
            r = (f"ITL: one decoding request's step takes {step1 * 1e3:.1f} ms on {tp}× {chip} > "
                 f"{itl * 1e3:.1f} ms{' (75 % of the target: aggregated)' if role == 'both' else ''}")
            est.reason = est.reason + "; " + r if est.reason else r
        else:
            if timing is not None:
                lim = (itl - timing.c0) / max(timing.c_seq + timing.c_ctx * st.ctx, 1e-12)
            else:
                bw_b = ((itl - cost.t1) / c_b - cost.model.weight_bytes) / (st.ctx * cost.on(chip, tp).kv_bpt)
                fl_b = (itl - cost.t1) / (cost.model.flops_per_token * c_f)
                lim = min(bw_b, fl_b)
            b = max(1.0, min(lim, cap / (st.n_mean + st.o_mean), max_num_seqs))
            step = step_time(int(b), b * st.ctx)
            est.d = b / (st.o_mean * step)
            fig["decode_batch"] = b
    return est


def cluster_capacity(prefill: Sequence[Tuple[float, float, int]], decode: Sequence[Tuple[float, int]],
                     both: Sequence[Tuple[float, float, int]]) -> Tuple[float, str]:
    """Largest sustainable rate ``λ`` (req/s) and its binding resource.

    Args:
        prefill: per prefill-role group ``(p, xfer_cap, instances)``. decode: per decode-role group ``(d,
            instances)``. both: per aggregated group ``(p, d, instances)``.
    Returns ``(λ, binding)`` with binding one of ``prefill``, ``decode``, ``kv-transfer``, ``none`` (no capacity).
    """
    p_roles = sum(min(p, x) * k for p, x, k in prefill)
    p_raw = sum(p * k for p, x, k in prefill)
    d_roles = sum(d * k for d, k in decode)
    bo = sorted(((p, d, k) for p, d, k in both if p > 0 and d > 0), key=lambda e: -e[0] / e[1])
    total_p = p_roles + sum(p * k for p, d, k in bo)
    total_d = d_roles + sum(d * k for p, d, k in bo)
    if (not prefill and not bo) or (not decode and not bo) or total_p <= 0 or total_d <= 0:
        return 0.0, "none"

    def fits(lam: float) -> Tuple[bool, str]:
        need_p = max(0.0, lam - p_roles)
        need_d = max(0.0, lam - d_roles)
        got_d = 0.0
        for p, d, k in bo:
            use = min(need_p, p * k)
            need_p -= use
            got_d += d * k * (1 - use / (p * k))
        if need_p > 1e-12:
            return False, "prefill"
        if got_d + 1e-12 < need_d:
            return False, "decode"
        return True, ""

    lo, hi = 0.0, min(total_p, total_d)
    ok, _ = fits(hi)
    if ok:
        lam = hi
    else:
        for _ in range(22):
            mid = (lo + hi) / 2
            if fits(mid)[0]:
                lo = mid
            else:
                hi = mid
        lam = lo
    # binding resource: which one fails just above λ
    _, why = fits(lam * 1.02 + 1e-9)
    if why == "prefill" and p_raw > p_roles + 1e-12:
        why = "kv-transfer"
    return lam, why or "prefill"
