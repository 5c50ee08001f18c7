"""Discrete-event simulator of a heterogeneous serving cluster driven by the router's own policy objects.

Event loop: one ``heapq`` of ``(time, seq, kind, obj)``; kinds are request arrivals, engine-iteration ends (one
event per iteration of one instance, see :mod:`dlmix.sim.engine`) and KV-transfer completions. Per arrival the
simulator does what the live router does (:mod:`dlmix.routing.policies.base`)::

    view = ClusterView(instance_states, index=prefix_index, cost=cost_model)
    decision = policy.choose(route_request, view)
    decision.begin(rr); policy.on_dispatch(rr, decision, view)   ... decision.prefill_done(rr) ... decision.end(rr)

``prefix_index`` is a :class:`dlmix.routing.prefix_index.PrefixIndex` fed by the simulated engines' KV events
(BlockStored when a full prompt block is computed or received, BlockRemoved on LRU eviction), optionally delayed by
``kv_event_delay`` seconds. The router's ``InstanceState.load`` carries its own counters (``Decision.begin``/``end``) plus an
instant heartbeat (waiting, running, KV usage) refreshed after each iteration.

PD disaggregation: a request with ``decision.prefill`` is prefilled on P (blocks for the prompt only); when its
prefill completes the KV of the tokens the decode instance D does not already cache (``N − h_D``) is sent over the
P→D link, a FIFO per P's egress: ``T_xfer = setup + bytes / (eff · bandwidth)`` (the slower end's bandwidth, the
larger setup, as :meth:`dlmix.hw.cost.CostModel.link_between`). On arrival D admits it like vLLM's KV consumer
(blocks for prompt + output, prompt blocks registered), and it produces its first token in D's next iteration
(TTFT ends there, as with vLLM's disaggregated proxy where the client's first token comes from D).

Units: seconds, tokens, bytes.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

from dlmix.hw.cost import CostModel, ModelSpec
from dlmix.routing.policies import ClusterView, Policy, make_policy, policy_class
from dlmix.routing.prefix_index import ApproxIndex, PrefixIndex
from dlmix.routing.state import InstanceState, NoInstanceError, OverloadedError, RouteRequest
from dlmix.sim.config import Deployment, load_deployment, load_model
from dlmix.sim.engine import FULL, PREFILL, RECV, Seq, SimInstance
from dlmix.sim.metrics import SimResult, summarize
from dlmix.sim.oracle import OracleTTFT  # noqa: F401  (registers the simulator-only ``oracle`` policy)
from dlmix.sim.timing import LinearTiming, RooflineTiming
from dlmix.sim.workload import SimRequest

ARRIVE, STEP, XFER, KVEV, KICK = 0, 1, 2, 3, 4


class ReqRecord:
    """Per-request outcome: times (s), placement and prefix hit (tokens at the instance that prefilled)."""

    __slots__ = ("req", "rr", "decision", "first_token", "finish", "hit", "prefill_inst", "decode_inst",
                 "failed", "pseq", "xfer_s", "prefilled", "rejected", "too_long")

    def __init__(self, req: SimRequest, rr: RouteRequest):
        self.req = req
        self.rr = rr
        self.decision = None
        self.first_token: Optional[float] = None
        self.finish: Optional[float] = None
        self.hit = 0
        self.prefill_inst: Optional[SimInstance] = None
        self.decode_inst: Optional[SimInstance] = None
        self.failed = False
        self.pseq: Optional[Seq] = None
        self.xfer_s = 0.0
        self.prefilled = False
        self.rejected = False  # refused by the policy's admission control (OverloadedError)
        self.too_long = False  # refused at arrival: prompt + output > the model's context limit (vLLM: HTTP 400)

    def on_admit(self, inst: SimInstance, seq: Seq) -> None:
        """Called by the instance when the prefill leg is admitted (records the true prefix hit)."""
        self.hit = seq.hit


@dataclass
class SimRouteRequest(RouteRequest):
    """A :class:`RouteRequest` that also carries the simulated request (``sim``, read by the simulator-only
    :class:`~dlmix.sim.oracle.OracleTTFT`) and exposes its pseudo-text (``text``, for text-keyed baselines such as
    DLRouter's ``prefix_cache``)."""

    sim: Optional[SimRequest] = None

    @property
    def text(self) -> str:
        """Deterministic pseudo-text of the prompt's first 100 characters (:meth:`SimRequest.text`)."""
        return self.sim.text(100)


class Simulator:
    """Simulate one deployment under one policy.

    Args:
        deployment: :class:`Deployment`, a YAML path or a built-in name.
        model: :class:`ModelSpec` or a preset name / config path.
        policy: a :class:`Policy` object or a registry name (:func:`dlmix.routing.policies.make_policy`; the
            simulator-only ``oracle`` is registered by :mod:`dlmix.sim.oracle`). A policy with a
            ``bind_simulator(sim)`` method is given this simulator (to read its true state).
        cost_model: the router's :class:`CostModel` (default: built from ``model`` and the deployment's catalog with
            ``t0 = r0 + t_step`` and ``t1 = t_step`` of the first instance).
        seed: seeds the policy's random tie-breaks (given as its ``seed`` parameter when it declares one and
            ``policy_params`` does not set it).
        kv_event_delay: seconds between an engine's cache change and the router's index update (0 = instant).
        know_output_len: tell the router each request's output length as ``max_tokens`` (default: unknown).
        policy_params: parameters of a policy given by name; an unknown name raises
            :class:`~dlmix.routing.policies.PolicyParamError` naming the valid ones.
        approx_index: give policies the router-side approximate index, which records every dispatch as the live
            router does (default). False, or a policy with ``exact_index_only``: KV-event index only.
        approx_index_capacity: blocks that index keeps (the live router's ``approx_index_capacity``).

    A request whose prompt + output tokens exceed the model's context limit (``ModelSpec.max_model_len``, when
    known) is refused at arrival, as vLLM refuses it (HTTP 400): it fails, is never routed and is counted in the
    summary's ``too_long``. Whether the model fits the deployment's instances (TP sizes its heads allow) is
    :func:`dlmix.sim.config.check_model`, which ``dlmix sim`` runs first.
    """

    def __init__(self, deployment: Union[Deployment, str, dict], model: Union[ModelSpec, str],
                 policy: Union[Policy, str] = "cost", cost_model: Optional[CostModel] = None, seed: int = 0,
                 kv_event_delay: float = 0.0, know_output_len: bool = False, policy_params: Optional[dict] = None,
                 approx_index: bool = True, approx_index_capacity: int = 1 << 20):
        self.dep = deployment if isinstance(deployment, Deployment) else load_deployment(deployment)
        self.model = load_model(model)
        cat = self.dep.catalog
        self.index = PrefixIndex()
        self.approx = ApproxIndex(approx_index_capacity)
        self.kv_event_delay = float(kv_event_delay)
        self.know_output_len = know_output_len
        self.seed = seed
        self.instances: List[SimInstance] = []
        self.states: List[InstanceState] = []
        for i, spec in enumerate(self.dep.instances):
            if spec.timing:
                timing = LinearTiming.load(spec.timing)
            else:
                timing = RooflineTiming(cat.chip(spec.chip), self.model, spec.num_chips, spec.t_step, spec.r0)
            inst = SimInstance(i, spec, timing, self.dep.kv_blocks(spec, self.model), self._on_store,
                               self._on_remove)
            self.instances.append(inst)
            transport = spec.link if isinstance(spec.link, dict) else ({"link": spec.link} if spec.link else None)
            self.states.append(InstanceState(id=spec.id, url=f"sim://{spec.id}", role=spec.role,
                                             chip=spec.router_chip or spec.chip, num_chips=spec.num_chips,
                                             block_size=spec.block_size, transport=transport, slot=i))
        s0 = self.dep.instances[0]
        self.cost = cost_model or CostModel(self.model, cat, t0=s0.r0 + s0.t_step, t1=s0.t_step)
        if isinstance(policy, str):
            params = dict(policy_params or {})
            if "seed" in policy_class(policy).Params.model_fields:
                params.setdefault("seed", seed)
            policy = make_policy(policy, **params)
        self.policy = policy
        self._approx = None if not approx_index or policy.exact_index_only else self.approx
        bind = getattr(policy, "bind_simulator", None)  # simulator-only policies (the oracle) read the true state
        if bind is not None:
            bind(self)
        self.now = 0.0
        self._heap: list = []
        self._n = 0
        self.step_dt: List[float] = []
        self.step_w: List[int] = []
        self.transfers: List[tuple] = []  # (tokens, bytes, seconds)

    # ---- KV events -------------------------------------------------------------------------------------------
    def _on_store(self, slot: int, keys) -> None:
        if self.kv_event_delay > 0:
            self._push(self.now + self.kv_event_delay, KVEV, (True, slot, list(keys)))
        else:
            self.index.store(slot, keys)

    def _on_remove(self, slot: int, keys) -> None:
        if self.kv_event_delay > 0:
            self._push(self.now + self.kv_event_delay, KVEV, (False, slot, list(keys)))
        else:
            self.index.remove(slot, keys)

    def _push(self, t: float, kind: int, obj) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, kind, obj))

    # ---- helpers -----------------------------------------------------------------------------------------------
    def link_time(self, p: SimInstance, d: SimInstance, tokens: int) -> float:
        """Seconds to move the KV of ``tokens`` tokens from ``p`` to ``d`` on an idle link:
        ``setup + tokens · kv_bytes_per_token / (eff · bandwidth)``; 0 for 0 tokens."""
        if tokens <= 0:
            return 0.0
        link = self.cost.link_between(self.states[p.idx].transport, self.states[d.idx].transport)
        return link.transfer_time(tokens * self.model.kv_bytes_per_token)

    def _kick(self, inst: SimInstance) -> None:
        if inst.busy or not inst.has_work():
            return
        w = inst.B
        dt = inst.plan_step()
        for s in inst.take_rejected():
            self._fail(s.req)
        if dt > 0:
            inst.busy = True
            inst.step_start = self.now
            inst.step_end = self.now + dt
            inst.version += 1
            if w:
                k = inst._k
                inst.itl_idx = len(self.step_dt)
                self.step_dt.append(dt / k)
                self.step_w.append(w * k)
            else:
                inst.itl_idx = -1
            self._push(self.now + dt, STEP, (inst, inst.version))

    def _interrupt(self, inst: SimInstance) -> None:
        # new work for an instance in a multi-iteration decode span: end the span at the next iteration boundary
        if inst.busy and inst._k > 1:
            k0 = inst._k
            new = inst.truncate(self.now - inst.step_start)
            if inst._k != k0:
                if inst.itl_idx >= 0:
                    self.step_dt[inst.itl_idx] = new / inst._k
                    self.step_w[inst.itl_idx] = inst.B * inst._k
                inst.step_end = inst.step_start + new
                inst.version += 1
                self._push(inst.step_end, STEP, (inst, inst.version))

    def _defer_kick(self, inst: SimInstance) -> None:
        # an idle engine starts its next iteration after every event of the same instant (same-time arrivals batch)
        if inst.busy:
            self._interrupt(inst)
        elif not inst.kick_pending:
            inst.kick_pending = True
            self._push(self.now, KICK, inst)

    def _fail(self, rec: ReqRecord) -> None:
        if rec.failed or rec.finish is not None:
            return
        rec.failed = True
        rec.finish = self.now
        rec.decision.end(rec.rr, prefilled=rec.prefilled)
        rec.req.drop_keys()

    def _route(self, rec: ReqRecord) -> None:
        mlen = self.model.max_model_len
        if mlen and rec.req.input_len + rec.req.output_len > mlen:
            # vLLM refuses a request whose prompt + max_tokens exceed max_model_len (HTTP 400) before any engine
            # sees it: failed at arrival, never routed (the planner leaves such requests out of its sample)
            rec.too_long = True
            rec.failed = True
            rec.finish = self.now
            return
        view = ClusterView(self.states, index=self.index, cost=self.cost, approx_index=self._approx)
        try:
            dec = self.policy.choose(rec.rr, view)
        except NoInstanceError as ex:
            rec.rejected = isinstance(ex, OverloadedError)
            rec.failed = True
            rec.finish = self.now
            return
        rec.decision = dec
        dec.begin(rec.rr)
        self.approx.record_decision(rec.rr, dec)
        self.policy.on_dispatch(rec.rr, dec, view)
        req = rec.req
        d = self.instances[dec.decode.slot]
        rec.decode_inst = d
        if dec.prefill is not None:
            p = self.instances[dec.prefill.slot]
            rec.prefill_inst = p
            s = Seq(rec, PREFILL, req.block_keys(p.bs), req.input_len, 0, dest=d)
            rec.pseq = s
            p.enqueue(s, self.now)
            self._defer_kick(p)
        else:
            rec.prefill_inst = d
            d.enqueue(Seq(rec, FULL, req.block_keys(d.bs), req.input_len, req.output_len), self.now)
            self._defer_kick(d)

    def _after_step(self, inst: SimInstance) -> None:
        prefilled, firsts, finished = inst.finish_step()
        now = self.now
        r0 = inst.timing.r0
        for s in prefilled:
            rec = s.req
            rec.prefilled = True
            rec.decision.prefill_done(rec.rr)
            if s.kind == FULL:
                rec.first_token = now + r0
            else:  # PD prefill leg done: send the KV
                d = s.dest
                keys_d = rec.req.block_keys(d.bs)
                h_d = min(d.kv.match(keys_d) * d.bs, s.n)
                tok = s.n - h_d
                dur = self.link_time(inst, d, tok)
                start = max(now, inst.link_free)
                inst.link_free = start + dur
                rec.xfer_s = inst.link_free - now
                self.transfers.append((tok, tok * self.model.kv_bytes_per_token, dur))
                self._push(start + dur, XFER, rec)
        for s in firsts:
            s.req.first_token = now + r0
        for s in finished:
            rec = s.req
            rec.finish = now + r0
            rec.decision.end(rec.rr, prefilled=True)
            rec.req.drop_keys()
        st = self.states[inst.idx].load
        st.waiting = len(inst.waiting)
        st.running = inst.running()
        st.kv_usage = inst.kv.usage()

    # ---- main loop -------------------------------------------------------------------------------------------
    def run(self, requests: Sequence[SimRequest], slo_ttft: float = 2.0, slo_itl: float = 0.025,
            label: str = "") -> SimResult:
        """Simulate ``requests`` (arrival-sorted or not) to completion and summarise.

        Args:
            slo_ttft: TTFT target, s. slo_itl: per-request mean inter-token latency (TPOT) target, s.
        Returns a :class:`SimResult` (``summary`` dict + per-request records).
        """
        recs = []
        for r in requests:
            rr = SimRouteRequest(prompt_len=r.input_len,
                                 max_tokens=r.output_len if self.know_output_len else None,
                                 block_hashes=r.block_keys, key=None, sim=r)
            rec = ReqRecord(r, rr)
            recs.append(rec)
            self._push(r.arrival, ARRIVE, rec)
        heap = self._heap
        pop = heapq.heappop
        insts = self.instances
        while heap:
            t, _, kind, obj = pop(heap)
            self.now = t
            if kind == STEP:
                inst, ver = obj
                if ver != inst.version:
                    continue  # superseded by a truncated span
                inst.busy = False
                self._after_step(inst)
                self._kick(inst)
            elif kind == ARRIVE:
                self._route(obj)
            elif kind == KICK:
                obj.kick_pending = False
                self._kick(obj)
            elif kind == XFER:
                rec = obj
                p = rec.prefill_inst
                p.release(rec.pseq)
                rec.pseq = None
                d = rec.decode_inst
                d.enqueue(Seq(rec, RECV, rec.req.block_keys(d.bs), rec.req.input_len, rec.req.output_len),
                          self.now)
                self._defer_kick(d)
                self._defer_kick(p)
            else:
                stored, slot, keys = obj
                (self.index.store if stored else self.index.remove)(slot, keys)
        for inst in insts:  # anything stuck (cannot happen unless capacity is 0) counts as failed
            for s in list(inst.waiting):
                self._fail(s.req)
        return summarize(recs, insts, self.step_dt, self.step_w, slo_ttft, slo_itl,
                         label=label or getattr(self.policy, "name", "policy"), transfers=self.transfers)


def simulate(deployment, model, policy, requests, seed: int = 0, slo_ttft: float = 2.0, slo_itl: float = 0.025,
             **kw) -> SimResult:
    """One-shot helper: ``Simulator(deployment, model, policy, seed=seed, **kw).run(requests, ...)``.
    ``requests`` are not modified except for their cached block keys."""
    return Simulator(deployment, model, policy, seed=seed, **kw).run(requests, slo_ttft, slo_itl)

