"""``round_robin``: rotate over available instances (per role pool), ignoring load and cache. Baseline."""
from __future__ import annotations

from typing import List

from dlmix.routing.policies.base import ClusterView, Policy
from dlmix.routing.policies.registry import register_policy
from dlmix.routing.state import InstanceState, NoInstanceError, RouteRequest


@register_policy("round_robin")
class RoundRobin(Policy):
    """One counter per pool (prefill-role candidates, decode-capable candidates) modulo the pool's size
    (candidates in registration order). Separate counters keep a PD deployment with pools of even size from
    sending every prefill to the same instance, which one shared counter stepping twice per request would do."""

    def setup(self) -> None:
        """One cursor per pool."""
        self._n = {True: 0, False: 0}  # keyed by "this pool is the prefill pool"

    def select(self, req: RouteRequest, cands: List[InstanceState], view: ClusterView) -> InstanceState:
        """Next candidate in turn. Raises NoInstanceError if ``cands`` is empty."""
        if not cands:
            raise NoInstanceError.for_request(req)
        pool = cands[0].role == "prefill"
        n = self._n[pool] = self._n[pool] + 1
        return cands[n % len(cands)]
