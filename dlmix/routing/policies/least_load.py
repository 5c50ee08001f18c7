"""``least_load``: join the shortest queue (router-counted in-flight requests, or the engine-reported queue when larger),
with KV usage as a tie-breaker. Baseline (DLRouter ``min_expected_latency``, SMG ``least_load`` without throughput)."""
from __future__ import annotations

from typing import List

from dlmix.routing.policies.base import ClusterView, Policy
from dlmix.routing.policies.registry import register_policy
from dlmix.routing.state import InstanceState, RouteRequest


@register_policy("least_load")
class LeastLoad(Policy):
    """Score = queue length + KV usage (in [0, 1], so it only breaks ties)."""

    def score(self, req: RouteRequest, cands: List[InstanceState], view: ClusterView) -> List[float]:
        """``load.queue_len() + load.kv_usage`` per candidate (lower is better)."""
        return [c.load.queue_len() + c.load.kv_usage for c in cands]
