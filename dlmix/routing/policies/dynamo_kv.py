"""``dynamo_kv``: NVIDIA Dynamo's KV router cost, as a baseline.

Source: ``ai-dynamo/dynamo`` ``docs/components/router/router-concepts.md``, ``router-disaggregated-serving.md``,
``docs/architecture/kv_cache_routing.md``. Blocks are the unit of work (bs = the
instance's engine block size):

    cost_i = w · prefill_blocks_i + decode_blocks_i
    prefill_blocks_i = (queued_prefill_tokens_i + max(N − overlap_i · bs, 0)) / bs
    decode_blocks_i  = (active_tokens_i + N) / bs

``overlap_i`` = leading blocks of the request cached on instance i (from the KV-event-fed index),
``queued_prefill_tokens_i`` = router-counted uncached prompt tokens not yet prefilled, ``active_tokens_i`` = tokens of
the requests active on i (decode contexts + queued prefills), ``w`` = ``overlap_score_weight`` (default 1.0).
Argmin with a random tie-break (``router_temperature`` 0; softmax sampling at ``temperature`` > 0).

Disaggregated: the prefill router chooses P with the cost above; the decode stage turns overlap scoring off
(``w`` = 0, i.e. least active blocks). Conditional disaggregation and device-credit decay are not modelled.
"""
from __future__ import annotations

import math
import random
from typing import List

import pydantic

from dlmix.routing.policies.base import ClusterView, Policy, PolicyParams
from dlmix.routing.policies.registry import register_policy
from dlmix.routing.state import Decision, InstanceState, NoInstanceError, RouteRequest


@register_policy("dynamo_kv")
class DynamoKV(Policy):
    """Dynamo's KV router cost (module docstring)."""

    class Params(PolicyParams):
        """overlap_score_weight: w; temperature: 0 = argmin, > 0 softmax sampling; seed: tie-break/sampling RNG."""

        overlap_score_weight: float = 1.0
        temperature: float = pydantic.Field(0.0, ge=0)
        seed: int = 0

    needs_prompt = True
    exact_index_only = True  # Dynamo's overlap scores come from the engines' KV events (its radix tree)

    def setup(self) -> None:
        """Copy the parameters, seed the RNG."""
        self.w = self.params.overlap_score_weight
        self.temperature = self.params.temperature
        self._rng = random.Random(self.params.seed)

    def costs(self, req: RouteRequest, cands: List[InstanceState], view: ClusterView, w: float) -> List[float]:
        """Cost per candidate (blocks), lower is better."""
        n = req.prompt_len
        out = []
        for c in cands:
            bs = c.block_size
            ov = view.hit_tokens(req, c) if w else 0
            pre = (c.load.inflight_prefill_tokens + max(n - ov, 0)) / bs
            dec = (c.load.decode_ctx_tokens + c.load.inflight_prefill_tokens + n) / bs
            out.append(w * pre + dec)
        return out

    def _pick(self, cands: List[InstanceState], costs: List[float]) -> InstanceState:
        if self.temperature > 0:
            lo = min(costs)
            ws = [math.exp(-(x - lo) / (self.temperature * max(abs(lo), 1.0))) for x in costs]
            return self._rng.choices(cands, weights=ws)[0]
        lo = min(costs)
        ties = [c for c, x in zip(cands, costs) if x == lo]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)

    def select(self, req: RouteRequest, cands: List[InstanceState], view: ClusterView) -> InstanceState:
        """argmin of the cost with overlap weight ``w``. Raises NoInstanceError if empty."""
        if not cands:
            raise NoInstanceError.for_request(req)
        return self._pick(cands, self.costs(req, cands, view, self.w))

    def choose(self, req: RouteRequest, view: ClusterView) -> Decision:
        """Aggregated: argmin over decode-capable instances. Disaggregated: P by the full cost, D with overlap
        scoring off."""
        pc = view.prefill_candidates(req)
        dc = view.decode_candidates(req)
        if not dc:
            raise NoInstanceError.for_request(req)
        if not pc:
            d = self.select(req, dc, view)
            return Decision(decode=d, hit_tokens=view.hit_tokens(req, d), reason=self.name)
        p = self.select(req, pc, view)
        d = self._pick(dc, self.costs(req, dc, view, 0.0))
        return Decision(decode=d, prefill=p, hit_tokens=view.hit_tokens(req, p), reason=self.name + ":pd")
