"""``oracle``: an upper-bound-ish reference for the simulator: per-request exhaustive search of the simulated TTFT on
every instance (and every prefill/decode pair) using the simulator's **true** state.

Not a deployable policy, so it lives in the simulator and is registered (``@register_policy("oracle")``) only where
``dlmix.sim`` is imported. It needs a bound :class:`dlmix.sim.simulator.Simulator` (``bind_simulator``) and reads,
for every candidate, what no router knows exactly: the true KV-cache contents (prefix hit), the true per-chip timing
model (not the catalog's belief), the prompts still queued or being prefilled (remaining tokens and positions), the
time left in the running iteration, the KV link's queue, and the request's true output length (for the memory check).

Estimate per aggregated candidate X (``iter_X`` = X's true iteration-time function, B_X/S_X its decode batch)::

    TTFT_X = remaining_iteration_X + Σ_{queued q} iter_X(rem_q, n_q² − done_q², n_q, B_X, S_X)
             + iter_X(N − h_X, N² − h_X², N, B_X, S_X)

and per pair (P, D): ``TTFT_P + link_wait_P + T_xfer(N − h_D) + iter_D(0, 0, 0, B_D + 1, S_D + N)``. Each queued
prompt is charged one iteration (chunk splitting ignored). A candidate whose decode step after admission exceeds
``itl_target`` or whose KV cache cannot hold the request gets a penalty of ``penalty_s`` per 100 % excess.
Greedy per request (a lower bound on what per-request placement can reach, not a global optimum over the schedule;
compare it with the ``cost`` policy, which estimates the same quantities from router-side figures only).
"""
from __future__ import annotations

import pydantic

from dlmix.routing.policies import ClusterView, Policy, PolicyParams, register_policy
from dlmix.routing.state import Decision, NoInstanceError, RouteRequest


@register_policy("oracle")
class OracleTTFT(Policy):
    """Exhaustive search on the simulator's true state (module docstring); parameters in :class:`Params`."""

    class Params(PolicyParams):
        """itl_target (s); penalty_s (s per 100 % ITL excess, and once when the KV cache is full)."""

        itl_target: float = pydantic.Field(0.025, gt=0)
        penalty_s: float = pydantic.Field(10.0, ge=0)

    needs_prompt = True

    def setup(self) -> None:
        """Copy the parameters; no simulator bound yet."""
        self.itl_target = self.params.itl_target
        self.penalty_s = self.params.penalty_s
        self.sim = None

    def bind_simulator(self, sim) -> None:
        """Attach the :class:`~dlmix.sim.simulator.Simulator` whose true state the oracle reads."""
        self.sim = sim

    def _queue(self, x) -> float:
        now = self.sim.now
        t = max(x.step_end - now, 0.0) if x.busy else 0.0
        it = x.timing.iteration
        for s in x.prefilling:
            t += it(s.n - s.done, s.n * s.n - s.done * s.done, s.n, x.B, x.S)
        for s in x.waiting:
            if s.kind != 2:
                t += it(s.n, s.n * s.n, s.n, x.B, x.S)
        return t

    def _own(self, x, n: int, h: int) -> float:
        return x.timing.iteration(n - h, n * n - h * h, n, x.B, x.S) + x.timing.r0

    def _hit(self, x, req) -> int:
        keys = req.block_keys(x.bs)
        return min(x.kv.match(keys), (req.input_len - 1) // x.bs) * x.bs

    def _pen(self, d, n: int, out: int) -> float:
        step = d.timing.iteration(0, 0, 0, d.B + 1, d.S + n)
        pen = 0.0 if step <= self.itl_target else self.penalty_s * (step / self.itl_target - 1.0)
        need = -(-(n + out) // d.bs)
        if need > d.kv.free + len(d.kv.lru):
            pen += self.penalty_s
        return pen

    def choose(self, req: RouteRequest, view: ClusterView) -> Decision:
        """Minimum estimated TTFT (+ penalties) over all aggregated placements and (P, D) pairs.
        Raises RuntimeError when no simulator is bound, NoInstanceError when nothing can serve."""
        if self.sim is None:
            raise RuntimeError("the oracle policy needs a simulator (bind_simulator)")
        sim = self.sim
        r = req.sim
        n, out = r.input_len, r.output_len
        dc = view.decode_candidates(req)
        pc = view.prefill_candidates(req)
        if not dc:
            raise NoInstanceError.for_request(req)
        best = None
        pplans = []
        for p in pc:
            x = sim.instances[p.slot]
            h = self._hit(x, r)
            pplans.append((self._queue(x) + self._own(x, n, h) + max(x.link_free - sim.now, 0.0), p, x, h))
        for d in dc:
            x = sim.instances[d.slot]
            h = self._hit(x, r)
            pen = self._pen(x, n, out)
            t = self._queue(x) + self._own(x, n, h)
            cand = (t + pen, t, d, None, h)
            hd = min(x.kv.match(r.block_keys(x.bs)) * x.bs, n)
            for tp, p, xp, hp in pplans:
                tt = tp + sim.link_time(xp, x, n - hd) + x.timing.iteration(0, 0, 0, x.B + 1, x.S + n)
                if tt + pen < cand[0]:
                    cand = (tt + pen, tt, d, p, hp)
            if best is None or cand[0] < best[0]:
                best = cand
        _, ttft, d, p, h = best
        return Decision(decode=d, prefill=p, predicted_ttft=ttft, hit_tokens=h,
                        reason="oracle:pd" if p is not None else "oracle:local")
