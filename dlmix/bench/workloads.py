"""Benchmark workloads (prompts as token ids) and arrival schedules, all seeded and deterministic.

Prompts are lists of token ids sent through the OpenAI completions API (``prompt: [ids]``), so the engine sees
exactly the tokens we chose and prefix sharing is exact (no tokenizer round trip). Token ids are drawn uniformly from
``[token_lo, token_hi)``; the default ``[10, 256)`` is valid for both dlmix models (tiny-llama has 320 ids,
SmolLM2 49,152) and avoids the low special ids.

Workloads:

* :func:`shared_prefix` -- N groups; every prompt of a group starts with the group's shared prefix
  (``prefix_len`` tokens) followed by a unique suffix (``suffix_len`` tokens). Like SGLang's
  ``generated-shared-prefix`` dataset (``--gsp-num-groups``, ``--gsp-prompts-per-group``,
  ``--gsp-system-prompt-len``, ``--gsp-question-len``, ``--gsp-output-len``). Prompts are shuffled (seeded) so
  groups interleave.
* :func:`random_prompts` -- independent random prompts (``vllm bench serve --dataset-name random`` style, fixed
  lengths).
* :func:`load_mooncake_trace` -- Mooncake trace replay (format and reader in :mod:`dlmix.workloads`: JSON lines ``{"timestamp": ms, "input_length": tokens,
  "output_length": tokens, "hash_ids": [int, ...]}``; one hash id per 512-token block, chained, so equal leading
  ids mean an equal prefix). Each hash id maps to a deterministic block of ``block_tokens`` token ids
  (:func:`hash_block`), so equal ids give equal blocks and prefix sharing is real. ``block_tokens`` < 512 scales
  the trace down (input length scaled by ``block_tokens / 512``) so it fits small models.

Arrivals (:func:`arrival_times`): ``vllm bench serve`` semantics. ``request_rate = inf`` sends everything at
t=0; otherwise inter-arrival gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)) seconds, which is a
Poisson process for ``burstiness = 1``; seeded with ``numpy.random.default_rng(seed)``.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from dlmix.workloads import (MOONCAKE_BLOCK_TOKENS, SHARED_PREFIX_MAX_REQUESTS, SHARED_PREFIX_MAX_TOKENS, WorkloadError,
                             check_shared_prefix, ideal_reuse_of_keys, read_mooncake_trace, resolve_trace)

#: most prompt tokens one load level generates up front (all prompts together; 64 Mi token ids are about 0.5 GiB of
#: Python lists): a larger synthetic workload is taken for a typo instead of running out of memory
MAX_LEVEL_PROMPT_TOKENS = 1 << 26


def _check_total(workload: str, prompts: int, tokens_each: int) -> None:
    """Raises WorkloadError when ``prompts × tokens_each`` exceeds :data:`MAX_LEVEL_PROMPT_TOKENS`."""
    if prompts * tokens_each > MAX_LEVEL_PROMPT_TOKENS:
        raise WorkloadError(f"{workload} workload: {prompts} prompts × {tokens_each} tokens is more than "
                            f"{MAX_LEVEL_PROMPT_TOKENS} prompt tokens in all")

__all__ = ["BenchRequest", "shared_prefix", "random_prompts", "hash_block", "load_mooncake_trace",
           "arrival_times", "WorkloadError", "MOONCAKE_BLOCK_TOKENS", "ideal_prefix_reuse", "resolve_trace"]

DEFAULT_TOKEN_LO = 10
DEFAULT_TOKEN_HI = 256


@dataclass
class BenchRequest:
    """One request of a workload.

    Attributes:
        prompt: prompt token ids.
        output_len: tokens to generate (sent as ``max_tokens``, with ``ignore_eos`` so the length is exact).
        arrival_s: scheduled send time from the start of the run (seconds), or None to use the arrival process.
        group: shared-prefix group (or -1).
    """

    prompt: list[int]
    output_len: int
    arrival_s: Optional[float] = None
    group: int = -1


def _check_range(token_lo: int, token_hi: int) -> None:
    if not 0 <= token_lo < token_hi:
        raise WorkloadError(f"token id range must satisfy 0 <= lo < hi, got [{token_lo}, {token_hi})")


def shared_prefix(num_groups: int, prompts_per_group: int, prefix_len: int, suffix_len: int, output_len: int,
                  seed: int = 0, token_lo: int = DEFAULT_TOKEN_LO, token_hi: int = DEFAULT_TOKEN_HI,
                  shuffle: bool = True) -> list[BenchRequest]:
    """Synthetic shared-prefix workload: ``num_groups * prompts_per_group`` prompts of ``prefix_len + suffix_len``
    tokens; prompts of one group share their first ``prefix_len`` tokens exactly.

    Raises:
        WorkloadError: non-positive counts/lengths, the bounds of :func:`dlmix.workloads.check_shared_prefix`, more
            than :data:`MAX_LEVEL_PROMPT_TOKENS` prompt tokens in all, or a bad token range.
    """
    _check_range(token_lo, token_hi)
    check_shared_prefix(num_groups, prompts_per_group, prefix_len, suffix_len, output_len)
    _check_total("shared-prefix", num_groups * prompts_per_group, prefix_len + suffix_len)
    rng = np.random.default_rng(seed)
    reqs = []
    for g in range(num_groups):
        prefix = rng.integers(token_lo, token_hi, size=prefix_len).tolist()
        for _ in range(prompts_per_group):
            suffix = rng.integers(token_lo, token_hi, size=suffix_len).tolist()
            reqs.append(BenchRequest(prompt=prefix + suffix, output_len=output_len, group=g))
    if shuffle:
        order = rng.permutation(len(reqs))
        reqs = [reqs[i] for i in order]
    return reqs


def random_prompts(num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                   token_lo: int = DEFAULT_TOKEN_LO, token_hi: int = DEFAULT_TOKEN_HI) -> list[BenchRequest]:
    """``num_prompts`` independent random prompts of ``input_len`` tokens, each generating ``output_len`` tokens.

    Raises:
        WorkloadError: a count or length < 1, more than :data:`~dlmix.workloads.SHARED_PREFIX_MAX_REQUESTS` prompts
            or more than :data:`~dlmix.workloads.SHARED_PREFIX_MAX_TOKENS` input or output tokens (the bounds of
            the shared-prefix workload: larger is taken for a typo, since every prompt is generated up front), or a
            bad token range.
    """
    _check_range(token_lo, token_hi)
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise WorkloadError("random workload needs num_prompts, input_len and output_len >= 1")
    if num_prompts > SHARED_PREFIX_MAX_REQUESTS:
        raise WorkloadError(f"random workload: num_prompts must be at most {SHARED_PREFIX_MAX_REQUESTS}, got "
                            f"{num_prompts}")
    for name, n in (("input_len", input_len), ("output_len", output_len)):
        if n > SHARED_PREFIX_MAX_TOKENS:
            raise WorkloadError(f"random workload: {name} must be at most {SHARED_PREFIX_MAX_TOKENS} tokens, got {n}")
    _check_total("random", num_prompts, input_len)
    rng = np.random.default_rng(seed)
    return [BenchRequest(prompt=rng.integers(token_lo, token_hi, size=input_len).tolist(), output_len=output_len)
            for _ in range(num_prompts)]


def hash_block(hash_id: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS, seed: int = 0,
               token_lo: int = DEFAULT_TOKEN_LO, token_hi: int = DEFAULT_TOKEN_HI) -> list[int]:
    """Deterministic block of ``block_tokens`` token ids for a trace hash id.

    The ids come from a generator seeded by SHA-256 of ``(seed, hash_id)``, so the same hash id always yields the
    same block (across processes and machines) and different ids yield independent blocks.
    """
    _check_range(token_lo, token_hi)
    digest = hashlib.sha256(f"dlmix-mooncake:{seed}:{int(hash_id)}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return rng.integers(token_lo, token_hi, size=block_tokens).tolist()


def load_mooncake_trace(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS, seed: int = 0,
                        max_requests: Optional[int] = None, time_scale: float = 1.0,
                        max_input_len: Optional[int] = None, max_output_len: Optional[int] = None,
                        token_lo: int = DEFAULT_TOKEN_LO, token_hi: int = DEFAULT_TOKEN_HI) -> list[BenchRequest]:
    """Read a Mooncake trace (JSON lines, optionally ``.gz``; or a built-in name, :func:`resolve_trace`) into
    requests with token-id prompts and scheduled arrivals.

    Each line's ``hash_ids[i]`` becomes :func:`hash_block` (``block_tokens`` ids); the prompt is the concatenation,
    cut to ``input_length * block_tokens / 512`` tokens (at least 1), then to ``max_input_len``. Blocks missing
    from ``hash_ids`` (shorter list than the length needs) are filled with blocks unique to the request.
    ``arrival_s = timestamp_ms / 1000 * time_scale`` relative to the first line's timestamp.

    Raises:
        WorkloadError: unreadable file, invalid JSON or missing/invalid field (message names file and line).
    """
    if block_tokens < 1:
        raise WorkloadError("block_tokens must be >= 1")
    scale = block_tokens / MOONCAKE_BLOCK_TOKENS
    cache: dict[int, list[int]] = {}
    reqs: list[BenchRequest] = []
    t0: Optional[float] = None
    for rec in read_mooncake_trace(path, min_output_length=1):
        lineno, ts, ids = rec.lineno, rec.timestamp_ms, rec.hash_ids
        n = max(1, int(math.ceil(rec.input_length * scale)))
        if max_input_len:
            n = min(n, max_input_len)
        prompt: list[int] = []
        nblocks = -(-n // block_tokens)
        for i in range(nblocks):
            if i < len(ids):
                h = ids[i]
                if h not in cache:
                    cache[h] = hash_block(h, block_tokens, seed, token_lo, token_hi)
                prompt.extend(cache[h])
            else:  # trace has fewer ids than blocks: unique filler, never shared
                prompt.extend(hash_block(-(lineno * 1_000_003 + i), block_tokens, seed, token_lo, token_hi))
        t0 = ts if t0 is None else t0
        olen = rec.output_length
        out = min(olen, max_output_len) if max_output_len else olen
        reqs.append(BenchRequest(prompt=prompt[:n], output_len=out, arrival_s=(ts - t0) / 1000.0 * time_scale))
        if max_requests and len(reqs) >= max_requests:
            break
    if not reqs:
        raise WorkloadError(f"{resolve_trace(path)}: no requests in trace")
    return reqs


def ideal_prefix_reuse(reqs: Sequence[BenchRequest], block_tokens: int) -> float:
    """Fraction of prompt tokens an infinite prefix cache with ``block_tokens``-token blocks would hit.

    Counts, per request, the leading full blocks already seen (as chained prefixes) -- the routing-anchors
    definition of ideal reuse (:func:`dlmix.workloads.ideal_reuse_of_keys`), applied to the token ids actually sent.
    """
    def chained_keys(prompt: list[int]) -> list:
        keys: list = []
        key: object = None
        for i in range(len(prompt) // block_tokens):
            key = hash((key, tuple(prompt[i * block_tokens: (i + 1) * block_tokens])))  # chained block key
            keys.append(key)
        return keys

    return ideal_reuse_of_keys((chained_keys(r.prompt), len(r.prompt), block_tokens) for r in reqs)


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from start) of ``n`` requests.

    ``request_rate`` in requests/second; ``inf`` -> all 0. Gaps are Gamma(shape=burstiness,
    scale=1/(request_rate*burstiness)) (mean ``1/request_rate``); ``burstiness=1`` is Poisson, ``burstiness=inf``
    constant gaps of ``1/request_rate`` (the limit, as in vLLM). The first request is sent after the first gap, as
    in vLLM. Deterministic for a given seed.

    Raises:
        WorkloadError: non-positive rate or burstiness.
    """
    if not (request_rate > 0 and burstiness > 0):  # also refuses NaN
        raise WorkloadError(f"request rate and burstiness must be > 0 (got {request_rate}, {burstiness})")
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        return [(i + 1) / request_rate for i in range(n)]
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    return np.cumsum(gaps).tolist()
