"""The search of ``dlmix plan`` (see ``docs/plan.md``).

1. **Options per chip group**: for every TP size a host can hold and every role (``prefill``, ``decode``, ``both``),
   :func:`dlmix.plan.analytic.estimate_role` checks memory fit, TTFT and ITL and gives the capacity; per (group,
   role) the two TP sizes with the largest group capacity are kept; ``unused`` is always an option. A used group runs
   all the instances its chips form (``Σ_host ⌊count / TP⌋``).
2. **Analytic ranking** of every combination (cartesian product over groups, PD-valid ones) by the cluster capacity
   of :func:`dlmix.plan.analytic.cluster_capacity`.
3. **Simulation** (:class:`dlmix.sim.Simulator`, the router's own policy) of the analytic best of each of the
   ``top_k`` best role patterns (which groups prefill / decode / both / unused) plus the runner-up of the best
   pattern, and, for the Pareto front, the analytic best at other chip counts: the goodput is the largest request rate, on a geometric
   grid of ratio :data:`RATE_GRID`, at which at least ``pct`` % of the sample's requests meet both targets
   (DistServe's SLO-attainment goodput); with a fixed ``rate``, the simulated goodput at that rate.
4. **Refinement** of the winner: a local search over the TP size of each of its groups (every size that passes
   the analytic checks), then router policy and KV block size variants; each variant is first simulated one grid
   step above the winner's goodput and searched further only if it meets the SLO there.

The model bounds the search: only TP sizes its head counts allow (:meth:`dlmix.hw.cost.ModelSpec.allowed_tp_sizes`;
a CPU group's instance is one engine at TP 1, any core count) are considered, and requests longer than its context
limit (``ModelSpec.max_model_len``) are left out of the sample (no engine serves them); :attr:`PlanResult.notes` says
what was excluded and why.

Units: req/s, seconds, tokens.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from dlmix.hw.cost import CostModel, ModelSpec, kv_tp
from dlmix.plan.analytic import SLO, RoleEstimate, cluster_capacity, estimate_role
from dlmix.plan.inventory import Inventory
from dlmix.plan.workload import PlanWorkload
from dlmix.sim.config import deployment_from_dict
from dlmix.sim.simulator import Simulator
from dlmix.sim.timing import LinearTiming, profile_engine_settings

__all__ = ["GroupChoice", "Candidate", "Planner", "PlanResult", "RATE_GRID", "ROLES"]

ROLES = ("prefill", "decode", "both")
RATE_GRID = 1.07
#: how a candidate's ``note`` starts when its goodput is only a lower bound (the sample met the SLO at every rate tried)
UNBOUNDED_NOTE = "goodput is a lower bound"
DEFAULTS = {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "t_step": 0.002, "gpu_memory_utilization": 0.9}
REFINE_POLICIES = ("least_load", "prefix")
REFINE_BLOCKS = (32, 128)


@dataclass(frozen=True)
class GroupChoice:
    """What one chip group does: ``role`` (``prefill``/``decode``/``both``/``unused``), TP size ``tp`` and
    ``instances`` (0 when unused)."""

    chip: str
    role: str
    tp: int = 0
    instances: int = 0

    @property
    def chips(self) -> int:
        """Chips used (``tp × instances``)."""
        return self.tp * self.instances

    def short(self) -> str:
        """E.g. ``H100 P tp1×4``."""
        if self.role == "unused":
            return f"{self.chip} -"
        return f"{self.chip} {self.role[0].upper()} tp{self.tp}×{self.instances}"


@dataclass
class Candidate:
    """One deployment in the search.

    Attributes:
        choices: one :class:`GroupChoice` per group. policy / policy_params: router policy. block_size: KV block,
        tokens. analytic: analytic capacity, req/s. binding: its binding resource. goodput: simulated goodput,
        req/s (None until simulated). summary: simulator summary at that rate. router_chip: chip the router is
        told every instance is (hardware-blind baseline), else None. name: label for baselines. note: e.g. why a
        refinement variant has no goodput ("below the best": it misses the SLO at the best's rate).
    """

    choices: Tuple[GroupChoice, ...]
    policy: str = "cost"
    block_size: int = 64
    analytic: float = 0.0
    binding: str = ""
    goodput: Optional[float] = None
    summary: Optional[dict] = field(default=None, repr=False)
    router_chip: Optional[str] = None
    name: str = ""
    note: str = ""
    tried: Dict[int, float] = field(default_factory=dict, repr=False)

    @property
    def chips_used(self) -> int:
        """Chips in use."""
        return sum(c.chips for c in self.choices)

    @property
    def key(self) -> tuple:
        """Identity for de-duplication."""
        return (tuple(c for c in self.choices if c.role != "unused"), self.policy, self.block_size, self.router_chip)

    def label(self) -> str:
        """Human-readable one-liner."""
        used = [c.short() for c in self.choices if c.role != "unused"]
        return " | ".join(used) + f" [{self.policy}, bs{self.block_size}]"


@dataclass
class PlanResult:
    """Outcome of :meth:`Planner.plan`.

    Attributes:
        feasible: a deployment meets the SLO. best: the recommendation (None if infeasible). alternatives: runners-up
        (simulated, best first). pareto: the goodput-vs-chips front (chips ascending, goodput strictly increasing).
        simulated: every simulated candidate. reasons: why nothing is feasible (binding constraints). analytic_count:
        combinations ranked analytically. sims: simulator runs. wall_s: planning time, s (cpu_s: CPU time of this
        process, s — the wall time grows with other load on a shared machine). rate: the fixed rate or
        None (maximise). slo, inventory, model, workload: the inputs (workload: the requests the model can serve).
        notes: what the model excluded (TP sizes its heads do not allow, requests beyond its context), one line
        each. excluded_requests: requests of the sample longer than the model's context limit.
    """

    feasible: bool
    best: Optional[Candidate]
    alternatives: List[Candidate]
    pareto: List[Candidate]
    simulated: List[Candidate]
    reasons: List[str]
    analytic_count: int
    sims: int
    wall_s: float
    rate: Optional[float]
    slo: SLO
    inventory: Inventory
    model: ModelSpec
    workload: PlanWorkload
    cpu_s: float = 0.0
    notes: List[str] = field(default_factory=list)
    excluded_requests: int = 0


def _distinct(x: float, y: float, digits: int) -> Tuple[str, str]:
    """``x`` and ``y`` (x != y) with ``digits`` decimals, more (up to 9) while both read the same, so a message
    "x > y" never reads "50.0 ms > 50.0 ms"."""
    for d in range(digits, 10):
        a, b = f"{x:.{d}f}", f"{y:.{d}f}"
        if a != b:
            break
    return a, b


class Planner:
    """Plans a deployment of ``model`` on ``inventory`` for ``workload`` under ``slo``.

    Args:
        inventory: :class:`Inventory`. model: :class:`ModelSpec`. slo: :class:`SLO`. workload: :class:`PlanWorkload`.
        rate: request rate to plan for, req/s, or None to maximise the goodput.
        policy: router policy simulated (default ``cost``, given the SLO as its targets). block_size: default KV
        block size, tokens (>= 1; a Mooncake trace resolves shared prefixes per 512 tokens, a synthetic workload
        per :func:`dlmix.plan.workload.synthetic_trace_block`). seed: simulator seed. progress:
        ``callback(message, done, total)`` or None.
        engine: overrides of the engine settings every instance gets (:data:`DEFAULTS`: ``max_num_batched_tokens``,
        ``max_num_seqs``, ``t_step``, ``gpu_memory_utilization``). Raises ValueError for a bad rate, SLO, block size
        or engine key, or a model whose head counts are < 1; WorkloadError (a ValueError) when fewer than 2 requests
        of the workload fit the model's context limit.

    The planner uses ``workload`` without the requests longer than ``model.max_model_len`` (prompt + output
    tokens; :meth:`PlanWorkload.within`): vLLM rejects them whatever the deployment, so they are counted
    (:attr:`excluded_requests`) and reported, not planned for; rates and goodputs are those of the requests kept.
    """

    def __init__(self, inventory: Inventory, model: ModelSpec, slo: SLO, workload: PlanWorkload,
                 rate: Optional[float] = None, policy: str = "cost", block_size: int = 64, seed: int = 0,
                 progress: Optional[Callable[[str, int, int], None]] = None, engine: Optional[dict] = None):
        if rate is not None and not (0 < rate < math.inf):
            raise ValueError(f"rate must be > 0 and finite (or None to maximise), got {rate}")
        if not (0 < slo.ttft < math.inf and 0 < slo.itl < math.inf and 0 < slo.pct <= 100):
            raise ValueError(f"SLO targets must be > 0 and finite and the percentile in (0, 100], got TTFT "
                             f"{slo.ttft} s, ITL {slo.itl} s, p{slo.pct}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        self.inv = inventory
        self.model = model
        self.slo = slo
        self.wl, self.excluded_requests = workload.within(model.max_model_len)
        self.tp_allowed = model.allowed_tp_sizes()
        self.notes = self._model_notes(workload)
        self.rate = rate
        self.policy = policy
        self.block_size = block_size
        self.seed = seed
        self.progress = progress or (lambda msg, done, total: None)
        bad = set(engine or {}) - set(DEFAULTS)
        if bad:
            raise ValueError(f"unknown engine setting(s) {sorted(bad)}; known: {', '.join(DEFAULTS)}")
        self.engine = {**DEFAULTS, **(engine or {})}
        self.notes += self._timing_notes()
        self.cost = CostModel(model, inventory.catalog, t0=self.engine["t_step"], t1=self.engine["t_step"])
        self.sims = 0
        self.kappa: List[float] = []  # simulated / analytic goodput ratios seen so far
        self._est: Dict[tuple, RoleEstimate] = {}
        self._timing: Dict[str, LinearTiming] = {}

    # ------------------------------------------------------------------ model limits
    def engine_tp(self, chip: str, size: int) -> int:
        """The engine's ``tensor_parallel_size`` of an instance of ``size`` chips of ``chip``: ``size``, but 1 on a
        CPU chip type (an instance of size t is one engine pinned to t cores; :func:`dlmix.hw.cost.kv_tp`)."""
        return kv_tp(self.inv.catalog.chip(chip), size)

    def tp_sizes(self, g) -> List[int]:
        """The instance sizes of group ``g`` the search considers: :meth:`ChipGroup.tp_sizes` whose engine TP
        (:meth:`engine_tp`) is one the model's head counts allow (:meth:`ModelSpec.allowed_tp_sizes`)."""
        return [t for t in g.tp_sizes() if self.engine_tp(g.chip, t) in self.tp_allowed]

    def _model_notes(self, workload: PlanWorkload) -> List[str]:
        """One line per exclusion the model imposes: the TP sizes of each group its heads do not allow, the requests
        longer than its context limit."""
        m, out = self.model, []
        name = m.name or "the model"
        bad = [(g.chip, [t for t in g.tp_sizes() if t not in self.tp_sizes(g)]) for g in self.inv.groups]
        bad = [(c, ts) for c, ts in bad if ts]
        if bad:
            out.append(f"TP sizes excluded ({'; '.join(f'{c}: ' + ', '.join(map(str, ts)) for c, ts in bad)}): "
                       f"{name} has {m.q_heads} attention heads and {m.kv_heads} KV heads; vLLM and SGLang run it at "
                       f"TP {', '.join(map(str, self.tp_allowed))} only")
        if self.excluded_requests:
            longest = int(max(workload.input_len + workload.output_len))
            out.append(f"{self.excluded_requests} of {len(workload.requests)} requests of the sample need more than "
                       f"the context limit of {name} ({m.max_model_len} tokens, prompt + output; the longest needs "
                       f"{longest}): no deployment can serve them (vLLM rejects them), so they are left out of the "
                       f"estimates and simulations")
        return out

    def _timing_notes(self) -> List[str]:
        """One line per calibration profile of the inventory's ``timing`` measured with other engine settings
        (``max_num_batched_tokens``, ``max_num_seqs``) than the plan simulates: its iteration times then describe
        another engine (docs/plan.md: set them to what the calibration was measured with)."""
        out = []
        for g in self.inv.groups:
            for size, prof in g.timing:
                try:
                    measured = profile_engine_settings(prof)
                except (OSError, ValueError):
                    continue
                diff = [f"{k} {measured[k]:g} (plan: {self.engine[k]:g}, --{k.replace('_', '-')})"
                        for k in ("max_num_batched_tokens", "max_num_seqs")
                        if isinstance(measured.get(k), (int, float)) and measured[k] != self.engine[k]]
                if diff:
                    out.append(f"timing of {g.chip} size {size} ({prof}) was measured with {', '.join(diff)}: its "
                               "iteration times describe an engine run with the profile's settings; plan with them")
        return out

    # ------------------------------------------------------------------ analytic
    def estimate(self, chip: str, tp: int, role: str) -> RoleEstimate:
        """Memoised :func:`estimate_role` for a group's chip."""
        key = (chip, tp, role)
        e = self._est.get(key)
        if e is None:
            g = self.inv.group(chip)
            prof = g.timing_profile(tp)
            timing = None
            if prof is not None:
                timing = self._timing.get(prof) or self._timing.setdefault(prof, LinearTiming.load(prof))
            e = self._est[key] = estimate_role(self.cost, self.wl, self.slo, chip, tp, role, g.link, timing,
                                               int(self.engine["max_num_batched_tokens"]),
                                               int(self.engine["max_num_seqs"]))
        return e

    def split_options(self, g, every_tp: bool = False) -> List[Tuple[GroupChoice, GroupChoice]]:
        """PD inside one chip group: ``k`` instances prefill and the other ``n − k`` decode, at one TP size ``t``
        whose prefill and decode estimates both pass. Per TP size the ``k`` of largest standalone capacity
        ``min(k · min(p, xfer), (n − k) · d)``; of these the best TP size (``every_tp``: every one)."""
        rows = []
        for tp in self.tp_sizes(g):
            n = g.instances(tp)
            ep, ed = self.estimate(g.chip, tp, "prefill"), self.estimate(g.chip, tp, "decode")
            if n < 2 or not (ep.ok and ed.ok):
                continue
            cap, k = max((min(k * min(ep.p, ep.xfer_cap), (n - k) * ed.d), k) for k in range(1, n))
            rows.append((cap, (GroupChoice(g.chip, "prefill", tp, k), GroupChoice(g.chip, "decode", tp, n - k))))
        rows.sort(key=lambda x: (-x[0], x[1][0].tp))
        return [r for _, r in (rows if every_tp else rows[:1])]

    def group_options(self, keep_tp: Optional[int] = 2) -> List[List[Tuple[GroupChoice, ...]]]:
        """Per group, its options, each a tuple of :class:`GroupChoice`: ``unused``; the SLO-feasible (role, TP)
        choices, the ``keep_tp`` TP sizes of largest group capacity per role (None: every TP whose weights fit,
        SLO-feasible or not — the exhaustive space); and PD inside the group (:meth:`split_options`, a prefill and a
        decode choice)."""
        out = []
        for g in self.inv.groups:
            opts: List[Tuple[GroupChoice, ...]] = [(GroupChoice(g.chip, "unused"),)]
            for role in ROLES:
                cands = []
                for tp in self.tp_sizes(g):
                    n = g.instances(tp)
                    e = self.estimate(g.chip, tp, role)
                    if keep_tp is None:
                        if e.figures.get("kv_capacity_tokens", 0) > 0:
                            cands.append((0.0, GroupChoice(g.chip, role, tp, n)))
                        continue
                    if not e.ok:
                        continue
                    capv = {"prefill": e.p, "decode": e.d, "both": (e.p * e.d / (e.p + e.d)) if e.p + e.d else 0}[role]
                    cands.append((capv * n, GroupChoice(g.chip, role, tp, n)))
                cands.sort(key=lambda x: (-x[0], x[1].tp))
                opts += [(c,) for _, c in (cands if keep_tp is None else cands[:keep_tp])]
            opts += self.split_options(g, every_tp=keep_tp is None)
            out.append(opts)
        return out

    def analytic(self, choices: Sequence[GroupChoice]) -> Tuple[float, str]:
        """Cluster capacity (req/s) and binding resource of a combination; ``(0, 'invalid')`` when it has no
        prefill-capable or no decode-capable instance."""
        pre, dec, both = [], [], []
        for c in choices:
            if c.role == "unused":
                continue
            e = self.estimate(c.chip, c.tp, c.role)
            if c.role == "prefill":
                pre.append((e.p, e.xfer_cap, c.instances))
            elif c.role == "decode":
                dec.append((e.d, c.instances))
            else:
                both.append((e.p, e.d, c.instances))
        if not (pre or both) or not (dec or both):
            return 0.0, "invalid"
        if pre and not (dec or both):
            return 0.0, "invalid"
        return cluster_capacity(pre, dec, both)

    def enumerate(self, keep_tp: Optional[int] = 2) -> List[Candidate]:
        """Every PD-valid combination of :meth:`group_options`, with its analytic capacity, best first."""
        out = []
        for opts in itertools.product(*self.group_options(keep_tp)):
            combo = tuple(c for o in opts for c in o)
            roles = {c.role for c in combo}
            if roles == {"unused"} or {"prefill", "both"} <= roles or ("decode" in roles and "prefill" not in roles):
                continue  # the router treats "both" and "decode" alike: with prefill-role instances as decode,
                # without them as aggregated
            lam, why = self.analytic(combo)
            if why == "invalid":
                continue
            out.append(Candidate(tuple(combo), self.policy, self.block_size, lam, why))
        out.sort(key=self._analytic_order)
        return out

    def _analytic_order(self, c: Candidate):
        if self.rate is None:
            return (-c.analytic, c.chips_used)
        return (c.analytic < 0.8 * self.rate, c.chips_used, -c.analytic)

    # ------------------------------------------------------------------ simulation
    def deployment_dict(self, c: Candidate, name: str = "plan") -> dict:
        """The candidate as a ``dlmix sim`` deployment mapping (:func:`dlmix.sim.config.deployment_from_dict`); each
        group's KV link is the slowest between its hosts and the hosts of the groups it exchanges KV with
        (:meth:`Inventory.link_to`)."""
        inst = []
        used = [ch for ch in c.choices if ch.role != "unused"]
        for ch in used:
            e = {"chip": ch.chip, "count": ch.instances, "role": ch.role, "num_chips": ch.tp,
                 "link": kv_link(self.inv, c, ch)}
            prof = self.inv.group(ch.chip).timing_profile(ch.tp)
            if prof is not None:
                e["timing"] = prof
            if c.router_chip:
                e["router_chip"] = c.router_chip
            inst.append(e)
        return {"name": name, "block_size": c.block_size, **self.engine, "instances": inst}

    def policy_params(self, c: Candidate) -> dict:
        """Router policy parameters: the ``cost`` policy gets the SLO as ``ttft_target`` / ``itl_target``."""
        return {"ttft_target": self.slo.ttft, "itl_target": self.slo.itl} if c.policy == "cost" else {}

    def simulate(self, c: Candidate, rate: float) -> dict:
        """One simulator run of ``c`` with the workload at ``rate`` req/s; returns the summary, whose ``ttft_ms`` and
        ``tpot_ms`` also hold the SLO's own percentile (``p{pct:g}``, ms, over the completed requests, as the others)
        when it is not one of the simulator's fixed ones (e.g. ``p80`` for ``--slo-pct 80``)."""
        dep = deployment_from_dict(self.deployment_dict(c), "plan", self.inv.catalog)
        self.sims += 1
        sim = Simulator(dep, self.model, c.policy, seed=self.seed, policy_params=self.policy_params(c))
        res = sim.run(self.wl.at(rate), self.slo.ttft, self.slo.itl, label=c.label())
        s = res.summary
        key = f"p{self.slo.pct:g}"
        if key not in s.get("ttft_ms", {}) or key not in s.get("tpot_ms", {}):
            import numpy as np

            ok = [r for r in res.records if not r.failed and r.finish is not None and r.first_token is not None]
            ttft = [1000.0 * (r.first_token - r.req.arrival) for r in ok]
            tpot = [1000.0 * (r.finish - r.first_token) / (r.req.output_len - 1) for r in ok if r.req.output_len > 1]
            s.setdefault("ttft_ms", {})[key] = float(np.percentile(ttft, self.slo.pct)) if ttft else 0.0
            s.setdefault("tpot_ms", {})[key] = float(np.percentile(tpot, self.slo.pct)) if tpot else 0.0
        return s

    def _att(self, c: Candidate, k: int, cache: Dict[int, dict]) -> float:
        if k not in cache:
            cache[k] = self.simulate(c, RATE_GRID ** k)
            c.tried[k] = cache[k]["good_fraction"]
        return cache[k]["good_fraction"]

    def evaluate_variant(self, v: Candidate, best: Candidate) -> Candidate:
        """Cheap check of a refinement variant of ``best`` (maximise mode): simulate it one grid step above the best's
        goodput; only if it meets the SLO there is it searched further upwards. Otherwise ``goodput`` stays None and
        ``note`` says it is not better than the best."""
        if self.rate is not None:
            return self.evaluate(v)
        kb = round(math.log(best.goodput) / math.log(RATE_GRID))
        cache: Dict[int, dict] = {}
        if self._att(v, kb + 1, cache) >= self.slo.attain:
            return self.evaluate(v, guess=RATE_GRID ** (kb + 1), cache=cache)
        v.summary = cache[kb + 1]
        v.note = "not better than the best (misses the SLO one rate step above it)"
        return v

    def evaluate(self, c: Candidate, guess: Optional[float] = None, cache: Optional[Dict[int, dict]] = None
                 ) -> Candidate:
        """Simulate ``c``: fills ``goodput`` and ``summary`` (see the module docstring). Returns ``c``."""
        tgt = self.slo.attain
        if self.rate is not None:
            s = self.simulate(c, self.rate)
            c.summary = s
            c.goodput = s["request_goodput"] if s["good_fraction"] >= tgt else 0.0
            return c
        if guess is None:
            k_ = sorted(self.kappa)[len(self.kappa) // 2] if self.kappa else 0.8
            # a candidate the analytic checks reject (capacity 0) may still meet the SLO in the simulator: search
            # from 1 req/s (4 grid steps up at a time, or down by 4..32 steps) rather than from ~0
            guess = c.analytic * k_ if c.analytic > 0 else 1.0
        cache = {} if cache is None else cache
        k0 = round(math.log(guess) / math.log(RATE_GRID))
        lo = hi = None
        if self._att(c, k0, cache) >= tgt:
            lo = k = k0
            for _ in range(6):
                k += 4
                if self._att(c, k, cache) >= tgt:
                    lo = k
                else:
                    hi = k
                    break
        else:
            hi = k = k0
            for step in (4, 8, 16, 32):
                k -= step
                if self._att(c, k, cache) >= tgt:
                    lo = k
                    break
                hi = k
        if lo is None:
            c.goodput = 0.0
            c.summary = cache[min(cache)]
            return c
        while hi is not None and hi - lo > 1:
            mid = (lo + hi) // 2
            if self._att(c, mid, cache) >= tgt:
                lo = mid
            else:
                hi = mid
        c.goodput = RATE_GRID ** lo
        c.summary = cache[lo]
        if hi is None:  # the sample never missed the SLO: the rate is where the search stopped, not a limit
            more = ("a synthetic workload of more groups × per_group requests: -n does not apply to it"
                    if self.wl.name.startswith("synthetic") else "-n, or a longer trace")
            c.note = (f"{UNBOUNDED_NOTE}: the {len(self.wl.requests)}-request sample met the SLO at every rate tried, "
                      f"up to {c.goodput:.4g} req/s, so goodputs and their ranking say little; plan with more requests "
                      f"({more})")
        if c.analytic > 0:
            self.kappa.append(c.goodput / c.analytic)
        return c

    # ------------------------------------------------------------------ the plan
    def infeasible_reasons(self) -> List[str]:
        """Why no option of any group can prefill or decode within the SLO: per group, the reason at its largest
        TP size (the most favourable), for the prefill side (as ``both``: no KV transfer) and the decode side (as
        ``decode``: the full ITL target)."""
        out = []
        for side, roles, shown in (("prefill", ("prefill", "both"), "both"), ("decode", ("decode", "both"), "decode")):
            if any(self.estimate(g.chip, tp, r).ok
                   for g in self.inv.groups for tp in self.tp_sizes(g) for r in roles):
                continue
            parts = [self.estimate(g.chip, self.tp_sizes(g)[-1], shown).reason for g in self.inv.groups
                     if self.tp_sizes(g)]
            out.append(f"no chip group can {side} within the SLO: " + "; ".join(p for p in parts if p))
        return out

    def plan(self, top_k: int = 4, pareto_points: int = 3, refine: bool = True, top_split: int = 2) -> PlanResult:
        """Run the search (module docstring): ``top_k`` role patterns without PD inside a group and ``top_split``
        with it are simulated. Returns a :class:`PlanResult`. Raises ValueError for ``top_k < 1`` or a negative
        ``pareto_points`` / ``top_split``."""
        if top_k < 1 or pareto_points < 0 or top_split < 0:
            raise ValueError(f"top_k must be >= 1 and pareto_points, top_split >= 0, got {top_k}, {pareto_points}, "
                             f"{top_split}")
        t0 = time.perf_counter()
        c0 = time.process_time()
        self.progress("analytic pruning", 0, 1)
        cands = self.enumerate()
        n_an = len(cands)
        self.progress(f"analytic: {n_an} combinations ranked", 1, 1)
        if not cands:
            reasons = self.infeasible_reasons() or ["no prefill+decode-capable combination of the groups fits"]
            return PlanResult(False, None, [], [], [], reasons, 0, self.sims, time.perf_counter() - t0, self.rate,
                              self.slo, self.inv, self.model, self.wl, time.process_time() - c0, list(self.notes),
                              self.excluded_requests)
        # the analytic best of each of the top_k role patterns (which groups prefill / decode / both / unused): the
        # roofline capacities rank candidates of one pattern well but can misjudge PD against aggregation, so the
        # simulator sees every leading pattern; then the runner-up TP variant of the leading pattern
        # patterns with PD inside a group compete for top_split places of their own: their roofline capacity
        # reads high (both sides counted busy), which would otherwise crowd the cross-type patterns out
        pats: Dict[tuple, List[Candidate]] = {}
        for c in cands:
            pats.setdefault(tuple((ch.chip, ch.role) for ch in c.choices), []).append(c)
        ordered = sorted(pats.values(), key=lambda cs: self._analytic_order(cs[0]))
        plain = [cs for cs in ordered if not _has_split(cs[0])]
        heads = (plain or ordered)[:top_k]
        pick = [cs[0] for cs in heads]
        if len(heads[0]) > 1:
            pick.append(heads[0][1])
        pick += [cs[0] for cs in ordered if _has_split(cs[0])][:top_split] if plain else []
        # Pareto helpers: analytic best at other chip counts (below the leader's)
        levels: Dict[int, Candidate] = {}
        for c in cands:
            if c.chips_used not in levels:
                levels[c.chips_used] = c
        lv = sorted(k for k in levels if k < pick[0].chips_used)
        if lv and pareto_points > 0:
            step = max(1, len(lv) // pareto_points)
            extra = [levels[k] for k in lv[::-1][::step][:pareto_points]]
            keys = {c.key for c in pick}
            pick += [c for c in extra if c.key not in keys]
        total = len(pick) + (len(REFINE_POLICIES) + len(REFINE_BLOCKS) if refine else 0)
        for i, c in enumerate(pick):
            self.progress(f"simulating {c.label()}", i, total)
            self.evaluate(c)
        done = len(pick)
        sim = list(pick)
        order = self._sim_order
        sim.sort(key=order)
        best = sim[0]
        if refine and (best.goodput or 0) > 0:
            # local search: the winner with one group at another TP size that passes the analytic checks (the
            # roofline capacity hardly separates TP sizes; the simulated TTFT tail does)
            seen = {c.key for c in sim}
            split = {ch.chip for ch in best.choices if [o.chip for o in best.choices].count(ch.chip) > 1}
            for gi, ch in enumerate(best.choices):
                if ch.role == "unused" or ch.chip in split:  # PD inside a group: its TP and split stay
                    continue
                g = self.inv.group(ch.chip)
                for tp in self.tp_sizes(g):
                    if tp == ch.tp or not self.estimate(ch.chip, tp, ch.role).ok:
                        continue
                    chs = list(best.choices)
                    chs[gi] = GroupChoice(ch.chip, ch.role, tp, g.instances(tp))
                    v = Candidate(tuple(chs), best.policy, best.block_size)
                    if v.key in seen:
                        continue
                    seen.add(v.key)
                    v.analytic, v.binding = self.analytic(v.choices)
                    self.progress(f"local search {v.label()}", done, total)
                    self.evaluate_variant(v, best)
                    sim.append(v)
            sim.sort(key=order)
            best = sim[0]
            variants = [replace(best, policy=p, goodput=None, summary=None, tried={}) for p in REFINE_POLICIES
                        if p != best.policy]
            variants += [replace(best, block_size=b, goodput=None, summary=None, tried={}) for b in REFINE_BLOCKS
                         if b != best.block_size]
            for v in variants:
                self.progress(f"refining {v.label()}", done, total)
                self.evaluate_variant(v, best)
                done += 1
                sim.append(v)
            sim.sort(key=order)
            best = sim[0]
        self.progress("done", total, total)
        feasible = (best.goodput or 0) > 0
        reasons: List[str] = []
        if not feasible:
            reasons = self.sim_reasons(best)
        alts = [c for c in sim[1:] if (c.goodput or 0) > 0][:3]
        notes = list(self.notes)
        if feasible and best.note.startswith(UNBOUNDED_NOTE):
            notes.append(f"predicted {best.note}")
        return PlanResult(feasible, best if feasible else None, alts, pareto_front(sim), sim, reasons, n_an,
                          self.sims, time.perf_counter() - t0, self.rate, self.slo, self.inv, self.model, self.wl,
                          time.process_time() - c0, notes, self.excluded_requests)

    def _sim_order(self, c: Candidate):
        g = c.goodput or 0.0
        if self.rate is None:
            return (-round(g, 9), c.chips_used)
        return (g <= 0, c.chips_used, -g)

    def sim_reasons(self, c: Candidate) -> List[str]:
        """Why the simulated candidate misses the SLO at the lowest rate tried (with ``--rate``: at that rate): which
        percentile of the SLO's (``p{pct:g}``, see :meth:`simulate`) exceeds its target."""
        s = c.summary or {}
        q = self.slo.pct
        key = f"p{q:g}"
        at = "at the given rate" if self.rate is not None else "even at the lowest rate tried"
        out = []
        ttft = s.get("ttft_ms", {}).get(key, 0.0)
        tpot = s.get("tpot_ms", {}).get(key, 0.0)
        if ttft > self.slo.ttft * 1000:
            a, b = _distinct(ttft, self.slo.ttft * 1000, 0)
            out.append(f"TTFT: simulated {key} {a} ms > {b} ms target {at}, on the best deployment found "
                       f"({c.label()})")
        if tpot > self.slo.itl * 1000:
            a, b = _distinct(tpot, self.slo.itl * 1000, 1)
            out.append(f"ITL: simulated {key} TPOT {a} ms > {b} ms target {at} ({c.label()})")
        if not out:
            out.append(f"only {100 * s.get('good_fraction', 0):.1f} % of requests meet both targets "
                       f"(< {q:g} %) {at.replace('even ', '')} ({c.label()})")
        return out


def kv_link(inv: Inventory, c: Candidate, ch: GroupChoice):
    """The KV link descriptor of choice ``ch`` in deployment ``c``: the slowest between its hosts and the hosts of the
    chip types it exchanges KV with (:meth:`Inventory.link_to`)."""
    peer_roles = {"prefill": ("decode", "both"), "decode": ("prefill",), "both": ("prefill",)}[ch.role]
    return inv.link_to(ch.chip, sorted({p.chip for p in c.choices if p.role in peer_roles}))


def _has_split(c: Candidate) -> bool:
    """A chip type appears in more than one choice (PD inside the group)."""
    chips = [ch.chip for ch in c.choices]
    return len(set(chips)) < len(chips)


def pareto_front(cands: Sequence[Candidate]) -> List[Candidate]:
    """Candidates no other beats with as few chips: chips ascending, goodput strictly increasing (simulated ones
    with goodput > 0 only)."""
    good = sorted((c for c in cands if (c.goodput or 0) > 0), key=lambda c: (c.chips_used, -(c.goodput or 0)))
    out: List[Candidate] = []
    for c in good:
        if not out or (c.goodput or 0) > (out[-1].goodput or 0):
            if out and out[-1].chips_used == c.chips_used:
                continue
            out.append(c)
    return out
