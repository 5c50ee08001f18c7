"""``round_robin``: rotate over available instances (per role pool), ignoring load and cache. Baseline."""
from __future__ import annotations

from typing import List

from dlmix.router.policies.base import ClusterView, Policy
from dlmix.router.state import InstanceState, NoInstanceError, RouteRequest


class RoundRobin(Policy):
    """Global counter modulo the number of candidates (candidates in registration order)."""

    name = "round_robin"

    def __init__(self, **_):
        self._n = 0

    def select(self, req: RouteRequest, cands: List[InstanceState], view: ClusterView) -> InstanceState:
        """Next candidate in turn. Raises NoInstanceError if ``cands`` is empty."""
        if not cands:
            raise NoInstanceError(f"no available instance for model {req.model!r}")
        self._n += 1
        return cands[self._n % len(cands)]
