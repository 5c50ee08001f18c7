"""``cost`` (default): joint prefill/decode placement on heterogeneous chips, scored against the SLO.

For a request of N prompt tokens (h_X = prefix-hit tokens on instance X, from the KV-event index or the router's
approximate index), every decode-capable instance D is scored with its plan (Mooncake FAST'25 Alg. 1 "Conductor",
DistServe OSDI'24 placement, Splitwise ISCA'24 phase split; time formulas in :mod:`dlmix.hw.cost`):

* local (no disaggregation): ``TTFT = Q_D + T_pre_D(N, h_D)·r_D``; ``Q_X`` = time to prefill the work already
  queued on X (router-counted: ``(2·P·q + 2·L·n_q·d·Σ(N² − h²))/(MFU·F)``, q uncached tokens), ``r_X`` = X's
  online TTFT calibration ratio;
* PD with each prefill-role instance P: ``TTFT = Q_P + T_pre_P(N, h_P)·r_P + T_xfer(P→D, N − h_D) + t1``.

Each plan's score is the share of SLO budgets it uses (goodput counts requests meeting TTFT ≤ ``ttft_target`` and
TPOT ≤ ``itl_target``; DistServe's goodput):

    score = TTFT / ttft_target + T_step_D / itl_target + interference · T_pre_X · (B_X / (out · itl_target)
            + W_X / ttft_target)

* ``T_step_D = T_step(B_D+1, Σctx_D+N)·r_itl_D``: D's decode step after admitting the request (its own TPOT);
* the last term is the harm of the prefill to the requests already on the prefilling instance X (D for local, P for
  PD): each of its ``B_X`` decoding requests stalls for ``T_pre_X`` (chunked prefill shares the iteration), which uses
  ``T_pre_X / (out · itl_target)`` of a TPOT budget of ``out`` tokens (``default_output_tokens``); ``W_X`` counts
  its requests still waiting for their prefill (router-counted in flight minus decoding). FCFS engines do not delay
  those for the new request, but its work delays the requests that will queue behind it, which ``W_X`` stands for
  (dropping the term cost 5 % goodput on the full Mooncake trace on 2× H100 + 2× H20 at speedup 0.5, 8 % on
  4× H100 at 0.75, first 1,200 requests).
  This term is what keeps requests on the instance that caches their prefix (a hit prefills few tokens) and keeps
  long prefills off busy decode instances; it is zero on a prefill-role instance with nothing queued.

Guards (score units): ``penalty_s`` per 100 % of D's step above ``itl_target``, and ``mem_penalty`` for a D whose KV
cache would overflow (router-counted Σctx + N + out above ``CostModel.kv_capacity_tokens``) or whose engine reports
``kv_usage ≥ kv_usage_limit``. Each applies only while some D keeps the target / has room: when none does, steering
would only spread requests away from their cached prefixes and add prefill work to an overloaded cluster (with a
10-unit memory penalty the full shared-prefix study at 26 req/s collapsed: prefix hits 78 % → 49 %, goodput 0).

Conditional disaggregation (as Dynamo's ``isl_bounding``): when prefill-role instances are available, a request whose
uncached part on D (``N − h_D``) exceeds ``local_max_uncached`` tokens is always disaggregated (the score picks the
(P, D) pair), and a shorter one, short or mostly cached on D, is prefilled on D (the score picks D), unless D cannot
prefill alone (``extra["needs_prefill"]``, set by the router for decode-role engines that need a prefill instance:
SGLang and LMDeploy decode servers), where every request is disaggregated. Letting the
score also send long prompts to a decode instance when the prefill queues look long was measured worse on the full
Mooncake trace (2× H100 + 2× H20: goodput 0.885 vs 0.967 req/s at speedup 0.5): the prefill stalls a
bandwidth-rich, compute-poor decode chip far beyond the prediction. With only ``both`` instances (aggregated or
cross-cluster mode, different chips) the local plans compete alone: the TTFT and step terms weigh each chip's speed
against its queue.

Early rejection (off by default; Mooncake FAST'25 §7 "overload-oriented scheduling" and Alg. 1's final check):
with ``reject_ttft_factor = f > 0``, a request whose best plan's predicted TTFT exceeds ``f · ttft_target`` raises
:class:`~dlmix.routing.state.OverloadedError` (the router answers 503 at once), so overload does not queue work that
would miss its SLO anyway and delay every request behind it.

Optional load guard (``balance_abs_threshold`` > 0): decode and prefill candidates are first passed through
:func:`~dlmix.routing.policies.base.balance_filter`, the SGLang router's imbalance rule, for deployments where the
model's queue estimate is far off.

Pure object: reads instance state and the view, no I/O. Needs a :class:`dlmix.hw.cost.CostModel` on the view (else it
falls back to least-load scoring); every time comes from its per-chip :class:`~dlmix.hw.cost.ChipCost`
(``CostModel.on(chip, num_chips)``), the one place the roofline formulas live.
"""
from __future__ import annotations

import pydantic

from dlmix.routing.policies.base import ClusterView, Policy, PolicyParams, balance_filter
from dlmix.routing.policies.registry import register_policy
from dlmix.routing.state import Decision, InstanceState, NoInstanceError, OverloadedError, RouteRequest


@register_policy("cost")
class CostPolicy(Policy):
    """Joint (P, D) placement scored against the SLO (module docstring); parameters in :class:`Params`."""

    class Params(PolicyParams):
        """Seconds unless noted. ttft_target / itl_target: the SLO (TTFT and TPOT/ITL); local_max_uncached
        (tokens): longest uncached part prefilled on D when prefill instances exist; interference: weight of the
        stall a prefill imposes on the prefilling instance's requests; penalty_s: score units per 100 % ITL excess;
        mem_penalty: score units for a full KV cache; default_output_tokens (tokens): when the request has no
        ``max_tokens``; kv_usage_limit (fraction); reject_ttft_factor: 0 = never reject; balance_abs_threshold
        (requests; 0 = no load guard) / balance_rel_threshold (ratio)."""

        ttft_target: float = pydantic.Field(2.0, gt=0)
        itl_target: float = pydantic.Field(0.05, gt=0)
        local_max_uncached: int = pydantic.Field(256, ge=0)
        interference: float = pydantic.Field(1.0, ge=0)
        penalty_s: float = pydantic.Field(0.2, ge=0)
        mem_penalty: float = pydantic.Field(1.0, ge=0)
        default_output_tokens: int = pydantic.Field(256, ge=1)
        kv_usage_limit: float = pydantic.Field(0.95, gt=0, le=1)
        reject_ttft_factor: float = pydantic.Field(0.0, ge=0)
        balance_abs_threshold: float = pydantic.Field(0, ge=0)
        balance_rel_threshold: float = pydantic.Field(1.5, gt=0)

    needs_prompt = True

    def setup(self) -> None:
        """Copy the parameters to hot-path attributes."""
        p = self.params
        self.ttft_target = p.ttft_target
        self.mem_penalty = p.mem_penalty
        self.reject_ttft_factor = p.reject_ttft_factor
        self.kv_usage_limit = p.kv_usage_limit
        self.abs_t = p.balance_abs_threshold
        self.rel_t = p.balance_rel_threshold
        self.itl_target = p.itl_target
        self.local_max_uncached = p.local_max_uncached
        self.interference = p.interference
        self.penalty_s = p.penalty_s
        self.default_output_tokens = p.default_output_tokens

    # --- pieces, public for the simulator and tests -------------------------------------------------------------
    def queue_time(self, cost, inst: InstanceState) -> float:
        """Seconds of prefill work already queued on ``inst``: :meth:`~dlmix.hw.cost.ChipCost.prefill_compute` of
        the router-counted uncached tokens q and their attention term Σ(N² − h²), × TTFT ratio."""
        ld = inst.load
        q = ld.inflight_prefill_tokens
        if q <= 0:
            return 0.0
        return cost.on(inst.chip, inst.num_chips).prefill_compute(q, ld.inflight_prefill_sq) * inst.ttft_ratio

    def step_time(self, cost, d: InstanceState, n: int) -> float:
        """Predicted decode step (s) of D after admitting one more request of ``n`` context tokens, × ITL ratio."""
        ld = d.load
        return cost.on(d.chip, d.num_chips).decode_step_time(ld.inflight_decode + 1, ld.decode_ctx_tokens + n) \
            * d.itl_ratio

    def choose(self, req: RouteRequest, view: ClusterView) -> Decision:
        """Best (P, D) or local plan by SLO-normalised cost. Raises NoInstanceError when no decode-capable
        instance is available."""
        dcands = view.decode_candidates(req)
        if self.abs_t > 0:
            dcands = balance_filter(dcands, self.abs_t, self.rel_t)
        if not dcands:
            raise NoInstanceError.for_request(req)
        cost = view.cost
        if cost is None:
            d = min(dcands, key=lambda c: (c.load.queue_len(), c.load.processed))
            return Decision(decode=d, hit_tokens=view.hit_tokens(req, d), reason="cost:noload")
        pcands = view.prefill_candidates(req)
        if self.abs_t > 0:
            pcands = balance_filter(pcands, self.abs_t, self.rel_t)
        n = req.prompt_len
        out = req.max_tokens or self.default_output_tokens
        inv_t = 1.0 / self.ttft_target
        inv_i = 1.0 / self.itl_target
        # stall of s seconds on an instance with B decoding and W queued requests costs
        # s * (B / (out * itl_target) + W / ttft_target)  (share of their SLO budgets)
        w_dec = self.interference / (self.default_output_tokens * self.itl_target)
        w_q = self.interference * inv_t
        on = cost.on
        pplans = []
        for p in pcands:
            hp = view.hit_tokens(req, p)
            if hp > n:
                hp = n
            pc = on(p.chip, p.num_chips)
            pre = pc.prefill_time(n, hp) * p.ttft_ratio
            lp = p.load
            q = lp.inflight_prefill_tokens
            tp = (pc.prefill_compute(q, lp.inflight_prefill_sq) * p.ttft_ratio if q > 0 else 0.0) + pre
            harm = pre * (lp.inflight_decode * w_dec + max(lp.inflight - lp.inflight_decode, 0) * w_q)
            pplans.append((tp, harm, p, hp))
        best = None
        # the same formulas as step_time / queue_time, one ChipCost lookup per instance (the router's hot path)
        ccs = [on(d.chip, d.num_chips) for d in dcands]
        steps = [cc.decode_step_time(d.load.inflight_decode + 1, d.load.decode_ctx_tokens + n) * d.itl_ratio
                 for cc, d in zip(ccs, dcands)]
        full = [d.load.kv_usage >= self.kv_usage_limit or
                d.load.decode_ctx_tokens + n + out > cost.kv_capacity_tokens(d.chip, d.num_chips) for d in dcands]
        # guards only while some D keeps the target / has room (module docstring)
        guard = min(steps) <= self.itl_target
        mem_guard = not all(full)
        for d, cc, step, d_full in zip(dcands, ccs, steps, full):
            hd = view.hit_tokens(req, d)
            if hd > n:
                hd = n
            ld = d.load
            base = step * inv_i
            if guard and step > self.itl_target:
                base += self.penalty_s * (step / self.itl_target - 1.0)
            if mem_guard and d_full:
                base += self.mem_penalty
            # long, or D cannot prefill (extra["needs_prefill"]: an SGLang/LMDeploy decode-role engine):
            # disaggregated, on the best P for this D
            if pplans and (n - hd > self.local_max_uncached or d.extra.get("needs_prefill")):
                cand = None
                xfer_bytes = (n - hd) * cost.kv_bpt  # KV that D lacks, moved over each P -> D link
                for tp, hp_harm, p, hp in pplans:
                    t = tp + cost.link_between(p.transport, d.transport).transfer_time(xfer_bytes) + cost.t1
                    obj = base + t * inv_t + hp_harm
                    if cand is None or obj < cand[0]:
                        cand = (obj, t, d, p, hp, "cost:pd")
            else:
                t_pre = cc.prefill_time(n, hd) * d.ttft_ratio
                q = ld.inflight_prefill_tokens
                t_local = (cc.prefill_compute(q, ld.inflight_prefill_sq) * d.ttft_ratio if q > 0 else 0.0) + t_pre
                harm = t_pre * (ld.inflight_decode * w_dec + max(ld.inflight - ld.inflight_decode, 0) * w_q)
                cand = (base + t_local * inv_t + harm, t_local, d, None, hd,
                        "cost:local:short" if pplans else "cost:local")
            if best is None or cand[0] < best[0] or (cand[0] == best[0] and
                                                     cand[2].load.processed < best[2].load.processed):
                best = cand
        _, ttft, d, p, hit, why = best
        if self.reject_ttft_factor > 0 and ttft > self.reject_ttft_factor * self.ttft_target:
            raise OverloadedError(f"predicted TTFT {ttft:.2f} s exceeds {self.reject_ttft_factor:g} x the "
                                  f"{self.ttft_target:g} s target on every instance (early rejection)")
        return Decision(decode=d, prefill=p, predicted_ttft=ttft, hit_tokens=hit, reason=why)
