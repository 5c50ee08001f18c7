"""``cache_aware``: SGLang router / SMG ``cache_aware`` policy, as a baseline (approximate mode).

Source: ``lightseekorg/smg`` ``model_gateway/src/policies/cache_aware.rs`` (and the vLLM router fork
``vllm-project/router`` ``src/policies/cache_aware.rs``). With L_i = router-counted
in-flight requests:

1. imbalanced iff ``max L − min L > balance_abs_threshold`` **and** ``max L > balance_rel_threshold × min L``
   → the instance with the smallest ``(L, processed, index)``; the tree is still updated;
2. balanced: ``match_rate = matched / input_len`` on the router's approximate tree; ``match_rate > cache_threshold``
   → the instance with the longest match; otherwise the fallback: ``least_load`` (the vLLM router fork's code and
   SGLang after PRs #14305/#14532) or ``smallest_tree`` (the SMG header comment; the "death spiral" variant);
3. the request is inserted into the chosen instance's tree; LRU eviction keeps the tree at ``max_tree_size``.

Defaults are the CLI defaults (``main.rs``, ``router_args.py``): cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5, max_tree_size 2^26.

Approximation of the tree (documented difference): SGLang's HTTP mode matches characters of the raw text; here the
tree is over the request's chained block hashes at ``tree_block_size`` tokens (default 64, ``req.block_hashes``), so
matches are counted in whole blocks of tokens; one LRU over all (block, instance) entries bounds the total size in
tokens; time-based eviction (``eviction_interval_secs``) is not modelled (the policy has no clock).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Literal, Optional

import pydantic

from dlmix.routing.policies.base import ClusterView, Policy, PolicyParams
from dlmix.routing.policies.registry import register_policy
from dlmix.routing.state import InstanceState, NoInstanceError, RouteRequest


@register_policy("cache_aware")
class SGLangCacheAware(Policy):
    """SGLang/SMG ``cache_aware`` (module docstring)."""

    class Params(PolicyParams):
        """cache_threshold (match rate), balance_abs_threshold (requests), balance_rel_threshold (ratio),
        max_tree_size (tokens), tree_block_size (tokens per tree entry), fallback (``least_load`` or
        ``smallest_tree``; None = the class default)."""

        cache_threshold: float = 0.3
        balance_abs_threshold: int = 64
        balance_rel_threshold: float = 1.5
        max_tree_size: int = pydantic.Field(1 << 26, ge=1)
        tree_block_size: int = pydantic.Field(64, ge=1)
        fallback: Optional[Literal["least_load", "smallest_tree"]] = None

    needs_prompt = True
    default_fallback = "least_load"

    def setup(self) -> None:
        """Copy the parameters, empty tree."""
        p = self.params
        self.cache_threshold = p.cache_threshold
        self.abs_t = p.balance_abs_threshold
        self.rel_t = p.balance_rel_threshold
        self.bs = p.tree_block_size
        self.cap = max(p.max_tree_size // self.bs, 1)
        self.fallback = p.fallback or self.default_fallback
        self._lru: "OrderedDict[int, int]" = OrderedDict()   # block key -> bitmask of slots
        self._size: Dict[int, int] = {}                      # slot -> entries

    def _match(self, keys, slot: int) -> int:
        bit = 1 << slot
        get = self._lru.get
        n = 0
        for k in keys:
            if get(k, 0) & bit:
                n += 1
            else:
                break
        return n

    def _insert(self, keys, slot: int) -> None:
        bit = 1 << slot
        lru = self._lru
        pop = lru.pop
        added = 0
        for k in keys:
            v = pop(k, 0)
            if not v & bit:
                added += 1
            lru[k] = v | bit
        self._size[slot] = self._size.get(slot, 0) + added
        total = sum(self._size.values())
        while total > self.cap and lru:
            _k, v = lru.popitem(last=False)
            s = 0
            while v:
                if v & 1:
                    self._size[s] -= 1
                    total -= 1
                v >>= 1
                s += 1

    def select(self, req: RouteRequest, cands: List[InstanceState], view: ClusterView) -> InstanceState:
        """Steps 1-3 of the module docstring. Raises NoInstanceError if ``cands`` is empty."""
        if not cands:
            raise NoInstanceError.for_request(req)
        keys = req.block_hashes(self.bs)
        loads = [c.load.inflight for c in cands]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.abs_t and hi > self.rel_t * lo:
            chosen = min(range(len(cands)), key=lambda i: (loads[i], cands[i].load.processed, i))
        else:
            m = [self._match(keys, c.slot) for c in cands]
            best = max(m)
            n = max(req.prompt_len, 1)
            if best * self.bs / n > self.cache_threshold:
                chosen = min((i for i in range(len(cands)) if m[i] == best), key=lambda i: (loads[i], i))
            elif self.fallback == "least_load":
                chosen = min(range(len(cands)), key=lambda i: (loads[i], cands[i].load.processed, i))
            else:
                chosen = min(range(len(cands)), key=lambda i: (self._size.get(cands[i].slot, 0), i))
        c = cands[chosen]
        self._insert(keys, c.slot)
        return c

    def on_remove(self, inst: InstanceState) -> None:
        """Forget the instance's tree entries."""
        bit = 1 << inst.slot
        for k in [k for k, v in self._lru.items() if v & bit]:
            v = self._lru[k] & ~bit
            if v:
                self._lru[k] = v
            else:
                del self._lru[k]
        self._size.pop(inst.slot, None)


@register_policy("cache_aware_smallest_tree")
class SGLangCacheAwareSmallestTree(SGLangCacheAware):
    """``cache_aware`` with SMG's documented "smallest tree" fallback (ignores load below the cache threshold)."""

    default_fallback = "smallest_tree"
