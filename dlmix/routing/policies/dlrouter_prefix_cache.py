"""``dlrouter_prefix_cache``: DLRouter's ``prefix_cache`` strategy, as a baseline.

Source: ``DeepLink-org/DLRouter`` ``dlrouter/routing/prefix_cache.py`` (key from ``core/proxy_engine.py``
``_extract_prompt_for_prefix_cache``), read at ``4f902a8``:

* key = the prompt text (message contents joined with ``\\n``, whitespace normalised), cut to its first **100
  characters**; a character trie whose nodes store ``instance → last_used``;
* lookup returns the deepest node on the key's path that holds a candidate instance: **one matching character is a
  hit**, and a hit routes there regardless of load (the most recently used instance at that node);
* miss: argmin of router-counted in-flight requests ``L_i``, round robin among ties; the key is then recorded for the
  chosen instance (every routed key is recorded, hits included); no eviction.
* PD: prefill and decode instances are chosen independently from their pools with the same key (base ``choose``).

Prompt text: the live router passes none in :class:`RouteRequest`, so the policy uses ``req.text`` when present
(the simulator's requests carry a deterministic pseudo-text derived from their block hash ids, see
:meth:`dlmix.sim.workload.SimRequest.text`), else ``req.key``, else the empty string (always a miss).
The trie holds at most 100 nodes per distinct key (plain dicts, not one object per character of every prompt).
"""
from __future__ import annotations

from typing import List

import pydantic

from dlmix.routing.policies.base import ClusterView, Policy, PolicyParams
from dlmix.routing.policies.registry import register_policy
from dlmix.routing.state import InstanceState, NoInstanceError, RouteRequest


def prompt_text(req: RouteRequest) -> str:
    """The request's prompt text if the caller provided one (``req.text``), else its affinity key, else ``""``."""
    t = getattr(req, "text", None)
    if t:
        return str(t)
    return str(req.key or "")


@register_policy("dlrouter_prefix_cache")
class DLRouterPrefixCache(Policy):
    """Character-trie prefix routing (module docstring)."""

    class Params(PolicyParams):
        """max_chars: key length in characters (100 in DLRouter)."""

        max_chars: int = pydantic.Field(100, ge=1)

    needs_prompt = True

    def setup(self) -> None:
        """Empty trie."""
        self.max_chars = self.params.max_chars
        self._root: dict = {}        # char -> [children dict, {slot: last_used}]
        self._clock = 0
        self._rr = 0

    def select(self, req: RouteRequest, cands: List[InstanceState], view: ClusterView) -> InstanceState:
        """Deepest trie hit (most recently used instance there), else least in-flight with round robin on ties.
        Records the key for the chosen instance. Raises NoInstanceError if ``cands`` is empty."""
        if not cands:
            raise NoInstanceError.for_request(req)
        key = prompt_text(req)[: self.max_chars]
        by_slot = {c.slot: c for c in cands}
        node = self._root
        hit = None
        for ch in key:
            e = node.get(ch)
            if e is None:
                break
            owners = e[1]
            best = None
            for s, t in owners.items():
                if s in by_slot and (best is None or t > best[1]):
                    best = (s, t)
            if best is not None:
                hit = best[0]
            node = e[0]
        if hit is not None:
            chosen = by_slot[hit]
        else:
            lo = min(c.load.inflight for c in cands)
            ties = [c for c in cands if c.load.inflight == lo]
            chosen = ties[self._rr % len(ties)]
            self._rr += 1
        self._clock += 1
        node = self._root
        for ch in key:
            e = node.get(ch)
            if e is None:
                e = node[ch] = [{}, {}]
            e[1][chosen.slot] = self._clock
            node = e[0]
        return chosen

    def on_remove(self, inst: InstanceState) -> None:
        """Forget the instance in every trie node (its slot is reused by the next instance that registers); nodes
        left without owners are dropped."""
        slot = inst.slot
        stack = [self._root]
        while stack:
            node = stack.pop()
            for ch in list(node):
                children, owners = node[ch]
                owners.pop(slot, None)
                if children:
                    stack.append(children)
                if not owners and not children:
                    del node[ch]
