"""``dlrouter_min_expected_latency``: DLRouter's default strategy, as a baseline.

Source: ``DeepLink-org/DLRouter`` ``dlrouter/routing/`` (``min_expected_latency``), read at ``4f902a8``:
argmin ``L_i / speed_i`` with a random tie-break, ``L_i`` = router-counted unfinished requests,
``speed_i`` only settable through ``/nodes/add`` (nothing else sets it, so all nodes are equal: speed 1.0) —
effectively join-shortest-queue. PD: prefill and decode chosen independently (base ``choose``).
"""
from __future__ import annotations

import random
from typing import Dict, List, Optional

from dlmix.routing.policies.base import ClusterView, Policy, PolicyParams
from dlmix.routing.policies.registry import register_policy
from dlmix.routing.state import InstanceState, NoInstanceError, RouteRequest


@register_policy("dlrouter_min_expected_latency")
class DLRouterMinExpectedLatency(Policy):
    """argmin of in-flight requests / speed (module docstring)."""

    class Params(PolicyParams):
        """seed: tie-break RNG seed; speeds: optional ``{instance id: speed}`` (missing = 1.0)."""

        seed: int = 0
        speeds: Optional[Dict[str, float]] = None

    def setup(self) -> None:
        """Seed the RNG, copy the speeds."""
        self._rng = random.Random(self.params.seed)
        self.speeds = dict(self.params.speeds or {})

    def select(self, req: RouteRequest, cands: List[InstanceState], view: ClusterView) -> InstanceState:
        """argmin ``inflight / speed``, uniformly random among ties. Raises NoInstanceError if empty."""
        if not cands:
            raise NoInstanceError.for_request(req)
        sc = [c.load.inflight / float(self.speeds.get(c.id, 1.0)) for c in cands]
        lo = min(sc)
        ties = [c for c, s in zip(cands, sc) if s == lo]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)
