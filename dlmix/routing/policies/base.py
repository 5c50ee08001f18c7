"""Policy interface: filter -> score -> pick, as pure objects over plain state, with typed parameters.

A policy is a small object with no I/O: it reads :class:`~dlmix.routing.state.InstanceState` objects (load, health,
chip, role), a :class:`~dlmix.routing.state.RouteRequest`, and prefix hits through a :class:`ClusterView`, and returns a
:class:`~dlmix.routing.state.Decision`. The live router and the simulator (``dlmix.sim``) both drive policies the same
way::

    view = ClusterView(instances, index=prefix_index, cost=cost_model)
    decision = policy.choose(req, view)          # raises NoInstanceError if nothing can serve
    decision.begin(req)                          # count the request in the instances' load
    policy.on_dispatch(req, decision, view)      # policy-private state (round-robin cursor, approximate index)
    ... prefill finishes ...  decision.prefill_done(req)
    ... request finishes ...  decision.end(req)

Writing a policy is one file (in ``dlmix/routing/policies/`` for a built-in, or in any package exposed through the
``dlmix.policies`` entry-point group, see :mod:`dlmix.routing.policies.registry`)::

    from dlmix.routing.policies import Policy, PolicyParams, register_policy

    @register_policy("shortest_queue")
    class ShortestQueue(Policy):
        class Params(PolicyParams):
            kv_weight: float = 1.0             # typed; an unknown or misspelled name is refused

        def score(self, req, cands, view):     # lower is better
            return [c.load.queue_len() + self.params.kv_weight * c.load.kv_usage for c in cands]

Override ``score`` and optionally ``filter``/``pick``/``select``/``choose``; parameters are fields of the nested
``Params`` model (pydantic, unknown names forbidden), validated by the constructor and available as ``self.params``;
``setup()`` runs after validation (copy hot-path values to attributes there).

PD disaggregation for the baseline policies: if the view has available ``prefill``-role instances, the base
``choose`` picks the decode instance from decode-capable instances and, independently, a prefill instance from the
``prefill``-role instances with the same filter/score/pick (what vLLM's and SGLang's PD routers do). The ``cost``
policy overrides ``choose`` to pick the pair jointly.
"""
from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Type

import pydantic

from dlmix.routing.state import Decision, InstanceState, NoInstanceError, RouteRequest


class PolicyParamError(ValueError):
    """A policy parameter is unknown or has a bad value; the message names the policy and its valid parameters."""


class PolicyParams(pydantic.BaseModel):
    """Base of every policy's parameter model: typed fields with defaults, unknown names forbidden, immutable.

    Values are coerced as pydantic's lax mode does (``"0.05"`` → 0.05 for a float field), so parameters parsed from
    ``--policy-param key=value`` or a YAML ``policy_params`` mapping validate the same way. Non-finite floats (inf,
    nan, ``1e400``) are refused."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False,  # 1e400 is inf: refused
                                      validate_default=True)  # a plugin's ill-typed default is an error too

    @classmethod
    def names(cls) -> List[str]:
        """Valid parameter names, in declaration order."""
        return list(cls.model_fields)

    @classmethod
    def parse(cls, policy: str, values: Mapping[str, Any]) -> "PolicyParams":
        """Validate ``values`` for the policy named ``policy``. Raises :class:`PolicyParamError` naming the unknown
        parameter(s) and the valid ones, or the field whose value is invalid."""
        unknown = [k for k in values if k not in cls.model_fields]
        if unknown:
            raise PolicyParamError(
                f"unknown parameter{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for policy "
                f"{policy!r}; valid: {', '.join(cls.names()) or '(none: the policy takes no parameters)'}")
        try:
            return cls(**values)
        except pydantic.ValidationError as ex:
            errs = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'params'}: {e['msg']} (got {e.get('input')!r})"
                             for e in ex.errors())
            raise PolicyParamError(f"policy {policy!r}: invalid parameter value: {errs}") from None


class ClusterView:
    """Snapshot handle a policy decides on: instances plus prefix-hit lookups. No I/O.

    Args:
        instances: all registered instances (the view filters availability itself).
        index: a prefix index with ``match(hashes: Sequence[int]) -> dict[slot, blocks]`` (see
            :class:`dlmix.routing.prefix_index.PrefixIndex`), or None (no prefix information).
        cost: a :class:`dlmix.hw.cost.CostModel` or None (only the ``cost`` policy needs one).
        approx_index: optional second index (router-recorded prefixes) consulted when ``index`` has no hit for an
            instance; hits from it count the same.
        has_prefill: False when the caller knows no ``prefill``-role instance is among ``instances`` (the router
            keeps that tally), so :meth:`prefill_candidates` need not scan them; None (default): scan.
    """

    __slots__ = ("instances", "index", "approx_index", "cost", "_hits", "has_prefill")

    def __init__(self, instances: Sequence[InstanceState], index=None, cost=None, approx_index=None,
                 has_prefill: Optional[bool] = None):
        self.instances = instances
        self.index = index
        self.approx_index = approx_index
        self.cost = cost
        self.has_prefill = has_prefill
        self._hits: Dict[int, Dict[int, int]] = {}

    def hit_tokens(self, req: RouteRequest, inst: InstanceState) -> int:
        """Prefix-hit tokens of ``req`` on ``inst``: leading consecutive cached blocks × block size (tokens).

        Looks up the exact (KV-event fed) index first, then the approximate one; results are cached per block size
        for the life of this view (one view per request).
        """
        if self.index is None and self.approx_index is None:
            return 0
        bs = inst.block_size
        per_slot = self._hits.get(bs)
        if per_slot is None:
            hashes = req.block_hashes(bs)
            per_slot = {}
            if hashes:
                if self.approx_index is not None:
                    per_slot.update(self.approx_index.match(hashes))
                if self.index is not None and len(self.index):
                    for s, n in self.index.match(hashes).items():
                        if n > per_slot.get(s, 0):
                            per_slot[s] = n
            self._hits[bs] = per_slot
        return per_slot.get(inst.slot, 0) * bs

    def decode_candidates(self, req: RouteRequest) -> List[InstanceState]:
        """Available instances serving ``req.model`` whose role is ``decode`` or ``both`` (only ``req.decode_id``
        when the request is pinned)."""
        m = req.model
        pin = req.decode_id
        return [i for i in self.instances if i.healthy and not i.draining and i.role != "prefill"
                and (not m or not i.model or m in i.model) and (pin is None or i.id == pin)]

    def prefill_candidates(self, req: RouteRequest) -> List[InstanceState]:
        """Available ``prefill``-role instances serving ``req.model`` (empty: no PD disaggregation; only
        ``req.prefill_id`` when the request is pinned)."""
        if self.has_prefill is False:
            return []
        m = req.model
        pin = req.prefill_id
        return [i for i in self.instances if i.healthy and not i.draining and i.role == "prefill"
                and (not m or not i.model or m in i.model) and (pin is None or i.id == pin)]


class Policy:
    """Base policy. Subclasses override :meth:`score` (and optionally the other steps).

    Args:
        **params: the policy's parameters, validated against its ``Params`` model (see the module docstring).
            Raises :class:`PolicyParamError` for an unknown name or a bad value.

    Class attributes:
        name: registry name (``--policy NAME``), set by :func:`~dlmix.routing.policies.registry.register_policy`.
        Params: the :class:`PolicyParams` subclass declaring the parameters (default: none).
        exact_index_only: True for baselines that, as published, score prefixes from engine KV events only; the
            simulator then gives them no router-side approximate index (the live router always passes both).
        needs_prompt: True if the policy uses prefix hits; the router then extracts/tokenizes the prompt and builds
            block hashes (costly), otherwise it only reads ``model``/``stream`` from the body.
    """

    name = "base"
    Params: ClassVar[Type[PolicyParams]] = PolicyParams
    needs_prompt = False
    exact_index_only = False

    def __init__(self, **params):
        self.params = self.Params.parse(self.name, params)
        self.setup()

    def setup(self) -> None:
        """Called once after the parameters were validated (``self.params``). Default: nothing."""

    def filter(self, req: RouteRequest, cands: List[InstanceState], view: ClusterView) -> List[InstanceState]:
        """Drop candidates that must not be used. Default: keep all."""
        return cands

    def score(self, req: RouteRequest, cands: List[InstanceState], view: ClusterView) -> List[float]:
        """One score per candidate, lower is better. Default: router-counted in-flight requests."""
        return [float(c.load.inflight) for c in cands]

    def pick(self, req: RouteRequest, cands: List[InstanceState], scores: List[float]) -> InstanceState:
        """Pick the lowest score; ties broken by fewest processed requests, then list order."""
        best = 0
        for i in range(1, len(cands)):
            if scores[i] < scores[best] or (
                scores[i] == scores[best] and cands[i].load.processed < cands[best].load.processed
            ):
                best = i
        return cands[best]

    def select(self, req: RouteRequest, cands: List[InstanceState], view: ClusterView) -> InstanceState:
        """filter → score → pick over ``cands``. Raises NoInstanceError when nothing is left."""
        cands = self.filter(req, cands, view)
        if not cands:
            raise NoInstanceError.for_request(req)
        if len(cands) == 1:
            return cands[0]
        scores = self.score(req, cands, view)
        if len(scores) != len(cands) or any(x != x for x in scores):  # x != x: NaN, which compares as no order
            raise ValueError(f"policy {self.name!r}: score() must return one number (not NaN) per candidate; got "
                             f"{list(scores)[:8]!r} for {len(cands)} candidates")
        return self.pick(req, cands, scores)

    def choose(self, req: RouteRequest, view: ClusterView) -> Decision:
        """Place ``req``: decode instance from decode-capable instances, plus an independent prefill instance when
        ``prefill``-role instances exist. Raises NoInstanceError."""
        d = self.select(req, view.decode_candidates(req), view)
        pcands = view.prefill_candidates(req)
        if not pcands:
            return Decision(decode=d, hit_tokens=view.hit_tokens(req, d), reason=self.name)
        p = self.select(req, pcands, view)
        return Decision(decode=d, prefill=p, hit_tokens=view.hit_tokens(req, p), reason=self.name + ":pd")

    def on_dispatch(self, req: RouteRequest, decision: Decision, view: ClusterView) -> None:
        """Called after a decision was dispatched (update policy-private state). Default: nothing."""

    def on_remove(self, inst: InstanceState) -> None:
        """Called when an instance leaves the registry (drop policy-private state). Default: nothing."""


def balance_filter(cands: List[InstanceState], abs_t: float, rel_t: float) -> List[InstanceState]:
    """Drop *overloaded* candidates: queue length ``L_i − L_min > abs_t`` and ``L_i > rel_t · L_min`` (SGLang router's
    imbalance rule applied per candidate). The least-loaded candidate always stays."""
    if len(cands) < 2:
        return cands
    loads = []
    for c in cands:
        ld = c.load
        w = ld.waiting + ld.running
        loads.append(ld.inflight if ld.inflight > w else w)
    lo = min(loads)
    lim = lo + abs_t
    if max(loads) <= lim:  # common case: nothing overloaded
        return cands
    return [c for c, l in zip(cands, loads) if not (l > lim and l > rel_t * lo)]


__all__ = ["ClusterView", "Policy", "PolicyParams", "PolicyParamError", "balance_filter", "Decision", "RouteRequest",
           "NoInstanceError"]
