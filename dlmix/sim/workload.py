"""Workloads for the simulator: Mooncake-format traces and a seeded synthetic shared-prefix generator, as
:class:`SimRequest` (hash ids). The trace format, its reader, the hash-level shared-prefix generator and ideal reuse
live in :mod:`dlmix.workloads` (shared with the benchmark client).

Engine block hashes: a trace block of ``tb`` tokens (512 in Mooncake traces; the synthetic generator uses the
deployment's block size, :meth:`dlmix.sim.config.Deployment.hash_block`) with id ``h`` is split into ``tb / bs``
engine blocks when ``bs`` divides ``tb``; engine block ``j`` of it gets the 64-bit key ``mix(h, j)``. A ``bs`` that
does not divide ``tb`` (e.g. a 64-token instance with 16-token synthetic ids) keys each engine block by the trace id
holding its last token and the offset into it (:meth:`SimRequest.block_keys`). Only full engine blocks of the prompt
are hashed (vLLM hashes full blocks only), so a prompt of N tokens has ``N // bs`` keys and a prefix hit counts whole
blocks of the instance's own ``block_size``. Because an equal trace id already implies an equal prefix, the derived
keys have the same "equal key ⇒ equal prefix" property as vLLM's chained hashes.

Pseudo-text: simulated requests have no text, but DLRouter's ``prefix_cache`` policy keys on the first 100 characters
of the prompt. :meth:`SimRequest.text` derives a deterministic string from ``hash_ids``: 64 characters per trace
block from a BLAKE2b digest of the id (base64 alphabet), so two prompts share a text prefix exactly as long as they
share leading trace blocks (plus accidental leading-character collisions between different ids, as real text has).
"""
from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from dlmix.workloads import (BUILTIN_TRACES, MOONCAKE_BLOCK_TOKENS, WorkloadError,  # noqa: F401 (re-exported)
                             check_shared_prefix, ideal_reuse_of_keys, read_mooncake_trace, resolve_trace,
                             shared_prefix_hash_ids)

MOONCAKE_BLOCK = MOONCAKE_BLOCK_TOKENS
MASK64 = (1 << 64) - 1


def _mix(h: int, j: int) -> int:
    """Deterministic 64-bit key of engine block ``j`` inside trace block ``h`` (splitmix64-style finaliser)."""
    z = (h * 0x9E3779B97F4A7C15 + (j + 1) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    z = (z * 0xBF58476D1CE4E5B9) & MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 33)


@dataclass
class SimRequest:
    """One request of a workload.

    Attributes:
        rid: index in the workload (0..n-1).
        arrival: arrival time, seconds from the start (after time scaling).
        input_len: prompt tokens. output_len: output tokens to generate (>= 1).
        hash_ids: one id per ``trace_block`` prompt tokens (Mooncake format).
        trace_block: tokens per hash id (512 for Mooncake traces; the deployment's block size for the synthetic
            workload of ``dlmix sim``).
    """

    rid: int
    arrival: float
    input_len: int
    output_len: int
    hash_ids: Sequence[int]
    trace_block: int = MOONCAKE_BLOCK
    _keys: Dict[int, List[int]] = field(default_factory=dict, repr=False)

    def block_keys(self, bs: int) -> List[int]:
        """64-bit keys of the prompt's full engine blocks of ``bs`` tokens (``input_len // bs`` keys; cached).

        ``bs`` divides the trace block (``trace_block = k·bs``): engine block ``j`` of trace block ``h`` gets
        ``mix(h, j)``. Any other ``bs`` (a multiple of the trace block, or neither): the engine block ending at
        token ``e`` gets ``mix(h_t, −o)`` where ``h_t`` is the id of the trace block holding token ``e − 1`` and
        ``o = e − t·trace_block`` (1..trace_block) the tokens of it the block covers. Both rely on chained ids
        (equal id ⇒ equal prefix up to the end of that trace block), so equal key ⇒ equal prefix; a prefix shared
        only part-way into a trace block is not seen (the trace's resolution).

        Args:
            bs: engine KV block size, tokens (>= 1).

        Raises:
            ValueError: ``bs < 1``.
        """
        ks = self._keys.get(bs)
        if ks is None:
            if bs < 1:
                raise ValueError(f"engine block size must be >= 1 token, got {bs}")
            tb = self.trace_block
            n = self.input_len // bs
            ids = self.hash_ids
            ks = []
            if tb % bs == 0:
                per = tb // bs
                for h in ids:
                    for j in range(per):
                        if len(ks) >= n:
                            break
                        ks.append(_mix(h, j))
            else:
                for j in range(n):
                    end = (j + 1) * bs
                    t = (end - 1) // tb
                    if t >= len(ids):
                        break
                    ks.append(_mix(ids[t], -(end - t * tb)))
            self._keys[bs] = ks
        return ks

    def drop_keys(self) -> None:
        """Free the cached key lists (called when the request finished, to bound memory)."""
        self._keys.clear()

    def text(self, max_chars: int = 100) -> str:
        """Deterministic pseudo-text of the prompt's first ``max_chars`` characters (see module docstring)."""
        out = []
        n = 0
        for h in self.hash_ids:
            d = hashlib.blake2b(int(h).to_bytes(16, "little", signed=True), digest_size=48).digest()
            s = base64.b64encode(d).decode()  # 64 characters
            out.append(s)
            n += len(s)
            if n >= max_chars:
                break
        return "".join(out)[:max_chars]


def load_trace(name_or_path: str, speedup: float = 1.0, limit: Optional[int] = None,
               trace_block: int = MOONCAKE_BLOCK, generators: Sequence[str] = ()) -> List[SimRequest]:
    """Read a Mooncake-format JSONL (optionally gzipped) trace (reader: :func:`dlmix.workloads.read_mooncake_trace`).

    Args:
        name_or_path: built-in name (``mooncake``) or file path (``.jsonl`` or ``.jsonl.gz``).
        speedup: arrival time scale; ``timestamp / 1000 / speedup`` seconds (2.0 = twice the request rate).
        limit: keep only the first ``limit`` requests (None = all).
        trace_block: tokens per hash id (512 for Mooncake).
        generators: other workload names the caller accepts, for the error of an unknown one
          (:func:`dlmix.workloads.resolve_trace`).

    Raises WorkloadError naming the line for malformed input; ``speedup`` must be > 0.
    """
    if speedup <= 0:
        raise WorkloadError(f"speedup must be > 0, got {speedup}")
    resolve_trace(name_or_path, generators)  # a missing file is an error even for limit=0
    reqs: List[SimRequest] = []
    if limit is None or limit > 0:
        for rec in read_mooncake_trace(name_or_path, min_output_length=0):
            reqs.append(SimRequest(len(reqs), rec.timestamp_ms / 1000.0 / speedup, rec.input_length,
                                   max(rec.output_length, 1), rec.hash_ids, trace_block))
            if limit is not None and len(reqs) >= limit:
                break
    reqs.sort(key=lambda r: (r.arrival, r.rid))
    for i, r in enumerate(reqs):
        r.rid = i
    return reqs


def shared_prefix(num_groups: int, requests_per_group: int, prefix_len: int, suffix_len: int, output_len: int,
                  rate: float, seed: int = 0, trace_block: int = MOONCAKE_BLOCK) -> List[SimRequest]:
    """Seeded synthetic shared-prefix workload (llm-d / SGLang ``generated-shared-prefix`` style).

    ``num_groups`` system prompts of ``prefix_len`` tokens, each followed by a unique question of ``suffix_len``
    tokens; ``num_groups × requests_per_group`` requests in random order with Poisson arrivals at ``rate`` req/s.
    Hash ids from :func:`dlmix.workloads.shared_prefix_hash_ids`, one per ``trace_block`` tokens: only the prefix's
    full trace blocks are shared, so pass the engine block size (``dlmix sim`` passes the deployment's
    :meth:`~dlmix.sim.config.Deployment.hash_block`); the default 512 (Mooncake's) shares nothing of a prefix
    shorter than 512 tokens.

    Raises WorkloadError for non-positive sizes, ``rate`` or ``trace_block``.
    """
    check_shared_prefix(num_groups, requests_per_group, prefix_len, suffix_len, output_len)
    if trace_block < 1:
        raise WorkloadError(f"trace_block must be >= 1 token, got {trace_block}")
    n_in = prefix_len + suffix_len
    return [SimRequest(i, t, n_in, output_len, ids, trace_block)
            for i, (_, t, ids) in enumerate(shared_prefix_hash_ids(num_groups, requests_per_group, prefix_len,
                                                                     suffix_len, rate, seed, trace_block))]


def write_trace(reqs: Sequence[SimRequest], path: str) -> None:
    """Write requests as a Mooncake-format JSONL (timestamps in ms, rounded). The format does not carry the block
    size: reading it back (:func:`load_trace`) needs the requests' ``trace_block`` as its ``trace_block``."""
    with open(path, "w", encoding="utf-8") as f:
        for r in reqs:
            f.write(json.dumps({"timestamp": round(r.arrival * 1000), "input_length": r.input_len,
                                "output_length": r.output_len, "hash_ids": list(r.hash_ids)}) + "\n")


def ideal_reuse(reqs: Sequence[SimRequest]) -> float:
    """Ideal prefix reuse (single infinite cache, trace-block granularity): for each request count its leading ids
    already seen, ``hit += min(k · block, input_len)``; divided by total input tokens (the hit rate an
    infinite cache shared by all requests would reach; :func:`dlmix.workloads.ideal_reuse_of_keys`)."""
    return ideal_reuse_of_keys((r.hash_ids, r.input_len, r.trace_block) for r in reqs)
