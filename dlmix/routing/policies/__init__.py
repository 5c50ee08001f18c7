"""Routing policies: one small file each, registered by name in :data:`POLICIES`.

Interface and bookkeeping: :mod:`dlmix.routing.policies.base`. Build one with :func:`make_policy`.
"""
from __future__ import annotations

from dlmix.routing.policies.base import ClusterView, Policy, begin, end, prefill_done, prefill_work  # noqa: F401
from dlmix.routing.policies.cost import CostPolicy
from dlmix.routing.policies.least_load import LeastLoad
from dlmix.routing.policies.prefix import PrefixAware
from dlmix.routing.policies.round_robin import RoundRobin

POLICIES = {p.name: p for p in (RoundRobin, LeastLoad, PrefixAware, CostPolicy)}


def make_policy(name: str, **params) -> Policy:
    """Policy instance by registry name with its keyword parameters. Raises ValueError for an unknown name."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return cls(**params)
# Published baselines (one file each; compared in dlmix sim). The simulator-only `oracle` is in dlmix.sim.registry.
from dlmix.routing.policies import dlrouter_min_latency as _b1, dlrouter_prefix_cache as _b2, dynamo_kv as _b3, sglang_cache_aware as _b4  # noqa: E402,E501
POLICIES.update({c.name: c for c in (_b1.DLRouterMinExpectedLatency, _b2.DLRouterPrefixCache, _b3.DynamoKV, _b4.SGLangCacheAware, _b4.SGLangCacheAwareSmallestTree)})  # noqa: E501
