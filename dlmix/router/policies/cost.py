"""``cost`` (default): joint prefill/decode placement by predicted TTFT on heterogeneous chips.

For a request of N prompt tokens (h_X = prefix-hit tokens on instance X, from the KV-event index or the approximate
index), every decode-capable instance D is scored for two plans (Mooncake FAST'25 Alg. 1 "Conductor", DistServe
OSDI'24 placement, Splitwise ISCA'24 phase split; formulas in :mod:`dlmix.hw.cost`):

* local (no disaggregation): ``TTFT = Q_D + T_pre_D(N, h_D)·r_D``; ``Q_X`` = time to prefill the uncached tokens
  already queued on X (router-counted, linear term ``2·P·q/(MFU·F)``), ``r_X`` = X's online TTFT calibration ratio;
* PD with each prefill-role instance P: ``TTFT = Q_P + T_pre_P(N, h_P)·r_P + T_xfer(P→D, N − h_D) + t1``.

Memory: a D whose KV cache would overflow (router-counted Σctx + N above the chip's KV capacity, see
``CostModel.kv_capacity_tokens``) or whose engine reports ``kv_usage ≥ kv_usage_limit`` gets ``penalty_s``.

Constraint: D must keep its ITL target after admitting the request, ``T_step_D(B_D+1, Σctx_D+N)·r_itl_D ≤ itl_target``;
instances breaking it get a penalty of ``penalty_s`` per 100 % excess, so they are used only if all break it.
Local prefill stalls D's running batch; that costs ``interference × T_pre_D`` when D has running decodes.
Disaggregate only if it beats local by ``pd_margin_s`` and D lacks more than ``local_max_uncached`` tokens
(short or mostly cached prompts prefill on the decode instance, as Dynamo's ``isl_bounding``).

Without prefill-role instances (aggregated or cross-cluster mode, ``both`` instances on different chips) the objective
is the predicted completion time ``TTFT + out · T_step_D`` (out = max_tokens or ``default_output_tokens``), which
balances per-chip speed against queueing.

Load guard: before scoring, decode candidates and prefill candidates are each passed through
:func:`~dlmix.router.policies.base.balance_filter` (``balance_abs_threshold``, ``balance_rel_threshold``), so a hot
prefix cannot pile every request onto the instance that caches it even when the model underestimates its queue.

Pure object: reads instance state and the view, no I/O. Needs a :class:`dlmix.hw.cost.CostModel` on the view (else it
falls back to least-load scoring). The arithmetic is inlined from :class:`~dlmix.hw.cost.CostModel` with per-chip
constants (``CostModel.coefs``) because it runs for every request and every candidate.
"""
from __future__ import annotations

from dlmix.router.policies.base import ClusterView, Policy, balance_filter
from dlmix.router.state import Decision, InstanceState, NoInstanceError, RouteRequest


class CostPolicy(Policy):
    """Args (seconds unless noted): itl_target (decode ITL SLO), local_max_uncached (tokens), pd_margin_s,
    interference (fraction of a local prefill charged to a busy D), penalty_s, default_output_tokens (tokens),
    balance_abs_threshold / balance_rel_threshold (load guard, see module docstring)."""

    name = "cost"
    needs_prompt = True

    def __init__(self, itl_target: float = 0.05, local_max_uncached: int = 256, pd_margin_s: float = 0.002,
                 interference: float = 0.5, penalty_s: float = 10.0, default_output_tokens: int = 256,
                 balance_abs_threshold: float = 4, balance_rel_threshold: float = 1.5,
                 kv_usage_limit: float = 0.95, **_):
        self.kv_usage_limit = float(kv_usage_limit)
        self.abs_t = float(balance_abs_threshold)
        self.rel_t = float(balance_rel_threshold)
        self.itl_target = float(itl_target)
        self.local_max_uncached = int(local_max_uncached)
        self.pd_margin_s = float(pd_margin_s)
        self.interference = float(interference)
        self.penalty_s = float(penalty_s)
        self.default_output_tokens = int(default_output_tokens)

    # --- pieces, public for the simulator and tests -------------------------------------------------------------
    def queue_time(self, cost, inst: InstanceState) -> float:
        """Seconds of prefill work already queued on ``inst``: ``2·P·q / (MFU·F)`` × TTFT ratio (q = router-counted
        uncached tokens; the quadratic attention term of queued requests is ignored)."""
        q = inst.load.inflight_prefill_tokens
        if q <= 0:
            return 0.0
        return cost._lin * q * cost.coefs(inst.chip, inst.num_chips)[0] * inst.ttft_ratio

    def step_time(self, cost, d: InstanceState, n: int) -> float:
        """Predicted decode step (s) of D after admitting ``n`` more context tokens, × ITL ratio."""
        c = cost.coefs(d.chip, d.num_chips)
        ld = d.load
        mem = (cost._wbytes + (ld.decode_ctx_tokens + n) * cost.kv_bpt) * c[1]
        comp = cost._lin * (ld.inflight_decode + 1) * c[0]
        return (cost.t1 + (mem if mem > comp else comp)) * d.itl_ratio

    def itl_penalty(self, cost, d: InstanceState, n: int) -> float:
        """Penalty (s) if admitting ``n`` more context tokens breaks D's ITL target, else 0."""
        step = self.step_time(cost, d, n)
        if step <= self.itl_target:
            return 0.0
        return self.penalty_s * (step / self.itl_target - 1.0)

    def choose(self, req: RouteRequest, view: ClusterView) -> Decision:
        """Best (P, D) or local plan. Raises NoInstanceError when no decode-capable instance is available."""
        dcands = balance_filter(view.decode_candidates(req), self.abs_t, self.rel_t)
        if not dcands:
            raise NoInstanceError(f"no available instance for model {req.model!r}")
        cost = view.cost
        if cost is None:
            d = min(dcands, key=lambda c: (c.load.queue_len(), c.load.processed))
            return Decision(decode=d, hit_tokens=view.hit_tokens(req, d), reason="cost:noload")
        pcands = balance_filter(view.prefill_candidates(req), self.abs_t, self.rel_t)
        n = req.prompt_len
        n2 = n * n
        lin, quad, t0 = cost._lin, cost._quad, cost.t0
        out = req.max_tokens or self.default_output_tokens
        pplans = []
        for p in pcands:
            hp = view.hit_tokens(req, p)
            if hp > n:
                hp = n
            c0 = cost.coefs(p.chip, p.num_chips)[0]
            tp = self.queue_time(cost, p) + (t0 + (lin * (n - hp) + quad * (n2 - hp * hp)) * c0) * p.ttft_ratio
            pplans.append((tp, p, hp))
        best = None
        interf = self.interference
        for d in dcands:
            hd = view.hit_tokens(req, d)
            if hd > n:
                hd = n
            step = self.step_time(cost, d, n)
            pen = 0.0 if step <= self.itl_target else self.penalty_s * (step / self.itl_target - 1.0)
            ld = d.load
            if ld.kv_usage >= self.kv_usage_limit or \
                    ld.decode_ctx_tokens + n > cost.kv_capacity_tokens(d.chip, d.num_chips):
                pen += self.penalty_s
            c0 = cost.coefs(d.chip, d.num_chips)[0]
            t_pre = (t0 + (lin * (n - hd) + quad * (n2 - hd * hd)) * c0) * d.ttft_ratio
            t_local = self.queue_time(cost, d) + t_pre
            obj = t_local + pen
            if d.load.inflight_decode > 0:
                obj += interf * t_pre
            if not pplans:
                obj += out * step
            cand = (obj, t_local, d, None, hd, "cost:local")
            if pplans and n - hd > self.local_max_uncached:
                for tp, p, hp in pplans:
                    t = tp + cost.transfer_time(n - hd, cost.link_between(p.transport, d.transport)) + cost.t1
                    if t + pen + self.pd_margin_s < cand[0]:
                        cand = (t + pen, t, d, p, hp, "cost:pd")
            if best is None or cand[0] < best[0] or (cand[0] == best[0] and
                                                     cand[2].load.processed < best[2].load.processed):
                best = cand
        _, ttft, d, p, hit, why = best
        if p is None and pplans:
            why = "cost:local:short" if n - best[4] <= self.local_max_uncached else "cost:local"
        return Decision(decode=d, prefill=p, predicted_ttft=ttft, hit_tokens=hit, reason=why)
