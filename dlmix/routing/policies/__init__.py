"""Routing policies: one small file each, registered by name in the one registry :data:`POLICIES`.

Interface: :mod:`dlmix.routing.policies.base` (``Policy``, typed ``PolicyParams``, ``ClusterView``). Registry and
extension points (decorator, ``dlmix.policies`` entry points): :mod:`dlmix.routing.policies.registry`. Build a policy
with :func:`make_policy`. Every module of this package is imported here, so a built-in policy is one file with a
``@register_policy("name")`` class.
"""
from __future__ import annotations

import importlib
import pkgutil

from dlmix.routing.policies.base import ClusterView, Policy, PolicyParamError, PolicyParams, balance_filter
from dlmix.routing.policies.registry import (ENTRY_POINT_GROUP, POLICIES, PolicyRegistry, make_policy, policy_class,
                                             register_policy, split_params)
from dlmix.routing.state import Decision, RouteRequest

for _m in pkgutil.iter_modules(__path__):
    if _m.name not in ("base", "registry"):
        importlib.import_module(f"{__name__}.{_m.name}")
del _m


# Function forms of the load bookkeeping, kept for callers written against them (the router); the one
# implementation is :meth:`dlmix.routing.state.Decision.begin` / ``prefill_done`` / ``end`` / ``prefill_work``.
def begin(decision: Decision, req: RouteRequest) -> None:
    """``decision.begin(req)``."""
    decision.begin(req)


def prefill_done(decision: Decision, req: RouteRequest) -> None:
    """``decision.prefill_done(req)``."""
    decision.prefill_done(req)


def end(decision: Decision, req: RouteRequest, prefilled: bool = True) -> None:
    """``decision.end(req, prefilled)``."""
    decision.end(req, prefilled)


def prefill_work(decision: Decision, req: RouteRequest) -> tuple:
    """``decision.prefill_work(req)``: ``(uncached tokens, N² − h²)``."""
    return decision.prefill_work(req)


__all__ = ["ClusterView", "Policy", "PolicyParams", "PolicyParamError", "balance_filter", "ENTRY_POINT_GROUP",
           "POLICIES", "PolicyRegistry", "make_policy", "policy_class", "register_policy", "split_params", "begin",
           "prefill_done", "end", "prefill_work"]
