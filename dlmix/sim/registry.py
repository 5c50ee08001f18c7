"""Policies the simulator can run by name: the router's registry (:data:`dlmix.routing.policies.POLICIES`) plus the
published baselines and the oracle (one file each in ``dlmix/routing/policies/``)."""
from __future__ import annotations

import inspect
from typing import Dict

from dlmix.routing.policies import POLICIES
from dlmix.routing.policies.base import Policy


def sim_policies() -> Dict[str, type]:
    """Name → policy class: router policies, baselines, oracle."""
    from dlmix.routing.policies.dlrouter_prefix_cache import DLRouterPrefixCache
    from dlmix.routing.policies.dlrouter_min_latency import DLRouterMinExpectedLatency
    from dlmix.routing.policies.sglang_cache_aware import SGLangCacheAware, SGLangCacheAwareSmallestTree
    from dlmix.routing.policies.dynamo_kv import DynamoKV
    from dlmix.routing.policies.oracle import OracleTTFT

    out = dict(POLICIES)
    for c in (DLRouterPrefixCache, DLRouterMinExpectedLatency, SGLangCacheAware, SGLangCacheAwareSmallestTree,
              DynamoKV, OracleTTFT):
        out.setdefault(c.name, c)
    return out


def make_sim_policy(name: str, **params) -> Policy:
    """Policy object by name. ``params`` a class does not accept (e.g. ``seed``) are dropped when its constructor has
    no ``**kwargs``. Raises ValueError for an unknown name."""
    pols = sim_policies()
    if name not in pols:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(pols)}")
    cls = pols[name]
    sig = inspect.signature(cls.__init__)
    if not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        params = {k: v for k, v in params.items() if k in sig.parameters}
    return cls(**params)
