"""The workload a plan is made for: a request sample that can be replayed at any mean request rate.

Sources: a built-in trace name (``mooncake``) or a Mooncake-format JSONL path (first ``n`` requests), or a synthetic
shared-prefix description ``synthetic:groups=16,per_group=16,prefix=6144,suffix=1200,output=128`` (generated with
:func:`dlmix.sim.workload.shared_prefix`, one hash id per :func:`synthetic_trace_block` tokens).
:meth:`PlanWorkload.at` rescales the arrival times so the sample's mean rate is the requested one (the arrival
pattern — bursts, order, prefix sharing — is kept).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from dlmix.sim.workload import SimRequest, WorkloadError, load_trace, shared_prefix
from dlmix.workloads import SHARED_PREFIX_MAX_REQUESTS, SHARED_PREFIX_MAX_TOKENS

__all__ = ["PlanWorkload", "load_plan_workload", "synthetic_trace_block"]

class _Replay(SimRequest):
    """A replayed copy that shares its block-key cache with the sample's request (keys depend on the prompt only),
    so repeated simulations of the same sample hash each prompt once; the simulator's end-of-request
    :meth:`drop_keys` keeps them."""

    def drop_keys(self) -> None:
        """Keep the shared cache (see the class docstring)."""


_SYN_KEYS = {"groups": 16, "per_group": 16, "prefix": 6144, "suffix": 1200, "output": 128, "seed": 0}
#: allowed range of each key of a synthetic workload (inclusive); also groups × per_group <=
#: SHARED_PREFIX_MAX_REQUESTS and 1 <= prefix + suffix <= SHARED_PREFIX_MAX_TOKENS (a larger number is a typo that
#: would generate and simulate for hours)
_SYN_RANGE = {"groups": (1, SHARED_PREFIX_MAX_REQUESTS), "per_group": (1, SHARED_PREFIX_MAX_REQUESTS),
              "prefix": (0, SHARED_PREFIX_MAX_TOKENS), "suffix": (0, SHARED_PREFIX_MAX_TOKENS),
              "output": (1, SHARED_PREFIX_MAX_TOKENS), "seed": (-2 ** 63, 2 ** 63 - 1)}


@dataclass
class PlanWorkload:
    """A request sample with its statistics.

    Attributes:
        name: source description. requests: :class:`SimRequest` sample (arrival-sorted).
        base_rate: mean arrival rate of the sample as read, req/s (``(n − 1) / (last − first arrival)``).
        input_len, output_len: per-request prompt and output tokens (numpy int arrays).
        hit: per-request ideal prefix-hit tokens (leading trace blocks already seen by an earlier request; 512 tokens
        each for a Mooncake trace, :func:`synthetic_trace_block` for a synthetic one).
    """

    name: str
    requests: List[SimRequest]
    base_rate: float
    input_len: np.ndarray
    output_len: np.ndarray
    hit: np.ndarray

    def at(self, rate: float) -> List[SimRequest]:
        """Fresh copies of the sample with arrivals scaled to a mean of ``rate`` req/s. Raises ValueError if
        ``rate <= 0``."""
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        a0 = self.requests[0].arrival
        f = self.base_rate / rate
        return [_Replay(r.rid, (r.arrival - a0) * f, r.input_len, r.output_len, r.hash_ids, r.trace_block, r._keys)
                for r in self.requests]

    def pct_input(self, pct: float) -> int:
        """The ``pct``-th percentile prompt length, tokens."""
        return int(np.percentile(self.input_len, pct))

    def within(self, max_len: int) -> Tuple["PlanWorkload", int]:
        """The sample without the requests no engine of a ``max_len``-token context serves (prompt + output >
        ``max_len`` tokens: vLLM refuses them, HTTP 400), and how many were dropped. The rest keep their arrival
        times; the mean rate and the prefix hits are those of the requests kept. ``max_len`` <= 0: unlimited
        (``self``, 0). Raises WorkloadError when fewer than 2 requests remain."""
        if max_len <= 0:
            return self, 0
        keep = [r for r in self.requests if r.input_len + r.output_len <= max_len]
        dropped = len(self.requests) - len(keep)
        if not dropped:
            return self, 0
        if len(keep) < 2 or keep[-1].arrival <= keep[0].arrival:
            longest = int(max(self.input_len + self.output_len))
            raise WorkloadError(f"workload {self.name!r}: {dropped} of {len(self.requests)} requests need more than "
                                f"the model's {max_len}-token context (prompt + output, up to {longest} tokens); "
                                f"{len(keep)} left, a plan needs >= 2 spread over time")
        return _sample(self.name, keep), dropped


def _parse_synthetic(desc: str) -> dict:
    """Keys of ``synthetic[:k=v,...]`` over :data:`_SYN_KEYS`' defaults. Raises WorkloadError naming the key for an
    unknown or repeated key, a non-integer value or one outside :data:`_SYN_RANGE` (or a sample too large)."""
    kv = dict(_SYN_KEYS)
    seen = set()
    body = desc.split(":", 1)[1] if ":" in desc else ""
    for item in filter(None, (s.strip() for s in body.split(","))):
        if "=" not in item:
            raise WorkloadError(f"synthetic workload: expected KEY=VALUE, got {item!r}")
        k, v = (s.strip() for s in item.split("=", 1))
        if k not in _SYN_KEYS:
            raise WorkloadError(f"synthetic workload: unknown key {k!r}; keys: {', '.join(_SYN_KEYS)}")
        if k in seen:
            raise WorkloadError(f"synthetic workload: key {k!r} given more than once")
        seen.add(k)
        lo, hi = _SYN_RANGE[k]
        try:
            kv[k] = int(v)
        except ValueError:
            raise WorkloadError(f"synthetic workload: {k} must be an integer in {lo}..{hi}, got {v!r}") from None
        if not lo <= kv[k] <= hi:
            raise WorkloadError(f"synthetic workload: {k} must be in {lo}..{hi}, got {kv[k]}")
    if kv["groups"] * kv["per_group"] > SHARED_PREFIX_MAX_REQUESTS:
        raise WorkloadError(f"synthetic workload: groups × per_group must be at most {SHARED_PREFIX_MAX_REQUESTS} "
                            f"requests, got {kv['groups']} × {kv['per_group']}")
    if not 1 <= kv["prefix"] + kv["suffix"] <= SHARED_PREFIX_MAX_TOKENS:
        raise WorkloadError(f"synthetic workload: prefix + suffix must be in 1..{SHARED_PREFIX_MAX_TOKENS} tokens, "
                            f"got {kv['prefix']} + {kv['suffix']}")
    return kv


def synthetic_trace_block(block_size: int) -> int:
    """Tokens per hash id of a synthetic plan workload: ``gcd(block_size, *REFINE_BLOCKS)`` (32 and 128), so a
    shared prefix is seen to the token block of the plan's block size and of both block sizes the refinement tries (a
    Mooncake trace's 512 would share nothing of a prefix under 512 tokens). Raises ValueError for ``block_size < 1``."""
    from dlmix.plan.search import REFINE_BLOCKS  # search imports this module

    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 token, got {block_size}")
    return math.gcd(block_size, *REFINE_BLOCKS)


def load_plan_workload(source: str, n: int = 400, block_size: int = 64) -> PlanWorkload:
    """Build the sample: ``source`` is a trace name/path (first ``n`` requests) or ``synthetic[:k=v,...]``
    (hash ids per :func:`synthetic_trace_block` of ``block_size`` tokens).

    ``n`` does not apply to a synthetic source (its sample is all its ``groups × per_group`` requests).

    Raises WorkloadError for a bad source or a sample of fewer than 2 requests (``n < 2`` for a trace) / zero
    duration; ValueError for ``block_size < 1``."""
    if source == "synthetic" or source.startswith("synthetic:"):
        k = _parse_synthetic(source)
        reqs = shared_prefix(k["groups"], k["per_group"], k["prefix"], k["suffix"], k["output"], 1.0, k["seed"],
                             synthetic_trace_block(block_size))
    else:
        if n < 2:
            raise WorkloadError(f"the workload sample needs at least 2 requests, got {n}")
        reqs = load_trace(source, limit=n, generators=("synthetic",))
    if len(reqs) < 2 or reqs[-1].arrival <= reqs[0].arrival:
        raise WorkloadError(f"workload {source!r}: needs >= 2 requests spread over time")
    return _sample(source, reqs)


def _sample(source: str, reqs: List[SimRequest]) -> PlanWorkload:
    """The :class:`PlanWorkload` of ``reqs`` (arrival-sorted, >= 2, spread over time): rate and ideal prefix hits."""
    seen: set = set()
    hit = []
    for r in reqs:
        k = 0
        for h in r.hash_ids:
            if h in seen:
                k += 1
            else:
                break
        hit.append(min(k * r.trace_block, r.input_len))
        seen.update(r.hash_ids)
    base = (len(reqs) - 1) / (reqs[-1].arrival - reqs[0].arrival)
    return PlanWorkload(source, reqs, base, np.array([r.input_len for r in reqs]),
                        np.array([r.output_len for r in reqs]), np.array(hit))
