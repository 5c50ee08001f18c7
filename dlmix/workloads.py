"""Workload primitives shared by the benchmark client (:mod:`dlmix.bench.workloads`, token ids) and the simulator
(:mod:`dlmix.sim.workload`, hash ids): the Mooncake trace format, the hash-level shared-prefix generator and the
ideal-prefix-reuse computation.

Mooncake trace format (``kvcache-ai/Mooncake: FAST25-release/README.md``): JSON lines
``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}``; one hash id per
512-token prompt block (:data:`MOONCAKE_BLOCK_TOKENS`), chained, so equal leading ids mean an equal prefix up to
the end of that block. Built-in traces (:data:`BUILTIN_TRACES`) ship in ``dlmix/data``; see their SOURCE.md.
"""
from __future__ import annotations

import difflib
import gzip
import io
import json
import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Hashable, Iterable, Iterator, List, Sequence, Tuple

__all__ = ["WorkloadError", "MOONCAKE_BLOCK_TOKENS", "BUILTIN_TRACES", "TraceRecord", "resolve_trace",
           "read_mooncake_trace", "check_shared_prefix", "SHARED_PREFIX_MAX_REQUESTS", "SHARED_PREFIX_MAX_TOKENS",
           "shared_prefix_hash_ids", "ideal_reuse_of_keys"]

MOONCAKE_BLOCK_TOKENS = 512
_CONVERSATION = "mooncake_conversation_trace.jsonl.gz"
#: built-in trace names -> file in ``dlmix/data`` (the Mooncake FAST'25 conversation trace)
BUILTIN_TRACES = {"mooncake": _CONVERSATION, "mooncake_conversation": _CONVERSATION,
                  "mooncake-conversation": _CONVERSATION}


class WorkloadError(ValueError):
    """Invalid workload parameters or a missing / unreadable / malformed trace (the message names file and line)."""


@dataclass(frozen=True)
class TraceRecord:
    """One line of a Mooncake trace.

    Attributes:
        lineno: 1-based line number in the file.
        timestamp_ms: arrival timestamp (milliseconds). input_length, output_length: tokens.
        hash_ids: one id per 512-token prompt block.
    """

    lineno: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: List[int]


def resolve_trace(name_or_path: str | Path, generators: Sequence[str] = ()) -> Path:
    """Path of a built-in trace name (:data:`BUILTIN_TRACES`: ``mooncake``, ``mooncake-conversation``) or of a file.

    ``generators``: the other workload names the caller accepts (e.g. ``synthetic``), listed in the error and
    suggested for a near miss.

    Raises:
        WorkloadError: the file does not exist (with a "did you mean" for a name close to a known one).
    """
    name = str(name_or_path)
    if name in BUILTIN_TRACES:
        return Path(str(resources.files("dlmix").joinpath("data", BUILTIN_TRACES[name])))
    p = Path(name_or_path)
    if not p.exists():
        known = [*BUILTIN_TRACES, *generators]
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        also = f"; or {', '.join(generators)}" if generators else ""
        raise WorkloadError(f"trace {name!r} not found (built-in: {', '.join(BUILTIN_TRACES)}{also}){hint}")
    return p


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def read_mooncake_trace(name_or_path: str | Path, min_output_length: int = 1) -> Iterator[TraceRecord]:
    """Stream the records of a Mooncake-format JSONL trace (optionally ``.gz``; or a built-in name), in file order.
    Blank lines are skipped.

    Args:
        name_or_path: built-in name or file path (:func:`resolve_trace`).
        min_output_length: smallest accepted ``output_length`` (tokens).

    Raises:
        WorkloadError: missing/unreadable file, invalid JSON, a missing/invalid field, ``input_length < 1`` or
            ``output_length < min_output_length`` (message names file and line).
    """
    p = resolve_trace(name_or_path)
    try:
        with _open_text(p) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    ts = float(rec["timestamp"])
                    ilen = int(rec["input_length"])
                    olen = int(rec["output_length"])
                    ids = [int(h) for h in rec.get("hash_ids", [])]
                except (KeyError, TypeError, ValueError, OverflowError) as e:  # Infinity: int() overflows
                    raise WorkloadError(f"{p}:{lineno}: invalid Mooncake record ({type(e).__name__}: {e}); expected "
                                        "timestamp, input_length, output_length, hash_ids") from None
                if not math.isfinite(ts):  # NaN/Infinity (Python's json accepts them) would poison every arrival
                    raise WorkloadError(f"{p}:{lineno}: timestamp must be a finite number of milliseconds, got {ts}")
                if ilen < 1 or olen < min_output_length:
                    raise WorkloadError(f"{p}:{lineno}: input_length must be >= 1 and output_length >= "
                                        f"{min_output_length}")
                yield TraceRecord(lineno, ts, ilen, olen, ids)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise WorkloadError(f"cannot read trace {p}: {e}") from None


#: bounds of a shared-prefix workload (larger is taken for a typo: every request is generated, hashed and, in the
#: simulator and planner, simulated): requests (``groups × per_group``) and tokens (``prefix + suffix``, ``output``)
SHARED_PREFIX_MAX_REQUESTS = 100_000
SHARED_PREFIX_MAX_TOKENS = 1 << 20


#: the names :func:`check_shared_prefix` gives its parameters in errors by default (a command passes its own flags)
SHARED_PREFIX_NAMES = ("groups", "per_group", "prefix_len", "suffix_len", "output_len")


def check_shared_prefix(num_groups: int, per_group: int, prefix_len: int, suffix_len: int, output_len: int,
                        names: Sequence[str] = SHARED_PREFIX_NAMES) -> None:
    """Validate shared-prefix workload parameters (counts and lengths in prompts / tokens).

    ``names``: what the errors call the five parameters, in order (a command's own flags, e.g. ``--gsp-num-groups``
    for ``dlmix bench``; default :data:`SHARED_PREFIX_NAMES`).

    Raises:
        WorkloadError naming the parameter: ``num_groups``, ``per_group`` or ``output_len`` < 1, a negative length,
            or ``prefix_len + suffix_len < 1``; more than :data:`SHARED_PREFIX_MAX_REQUESTS` requests
            (``num_groups × per_group``) or more than :data:`SHARED_PREFIX_MAX_TOKENS` prompt tokens
            (``prefix_len + suffix_len``) or output tokens.
    """
    g, pg, pre, suf, out = names
    for v, n in ((num_groups, g), (per_group, pg), (output_len, out)):
        if v < 1:
            raise WorkloadError(f"shared-prefix: {n} must be >= 1, got {v}")
    for v, n in ((prefix_len, pre), (suffix_len, suf)):
        if v < 0:
            raise WorkloadError(f"shared-prefix: {n} must be >= 0 tokens, got {v}")
    if prefix_len + suffix_len < 1:
        raise WorkloadError(f"shared-prefix: {pre} + {suf} must be >= 1 token (a prompt), got 0")
    if num_groups * per_group > SHARED_PREFIX_MAX_REQUESTS:
        raise WorkloadError(f"shared-prefix: {g} × {pg} must be at most {SHARED_PREFIX_MAX_REQUESTS} "
                            f"requests, got {num_groups} × {per_group}")
    if prefix_len + suffix_len > SHARED_PREFIX_MAX_TOKENS:
        raise WorkloadError(f"shared-prefix: {pre} + {suf} must be at most {SHARED_PREFIX_MAX_TOKENS} "
                            f"tokens, got {prefix_len} + {suffix_len}")
    if output_len > SHARED_PREFIX_MAX_TOKENS:
        raise WorkloadError(f"shared-prefix: {out} must be at most {SHARED_PREFIX_MAX_TOKENS} tokens, got "
                            f"{output_len}")


def shared_prefix_hash_ids(num_groups: int, per_group: int, prefix_len: int, suffix_len: int, rate: float,
                           seed: int = 0, block: int = MOONCAKE_BLOCK_TOKENS) -> List[Tuple[int, float, List[int]]]:
    """Hash-level shared-prefix workload (llm-d / SGLang ``generated-shared-prefix`` style), seeded.

    ``num_groups × per_group`` requests of ``prefix_len + suffix_len`` tokens in random order (``random.Random(seed)``
    shuffle) with Poisson arrivals at ``rate`` req/s. Hash ids, one per ``block`` tokens: a group's full prefix
    blocks get ids shared by the group; a block straddling prefix and suffix and all suffix blocks get unique ids
    (as chained hashes would).

    Returns:
        ``(group, arrival_s, hash_ids)`` per request, in arrival order.

    Raises:
        WorkloadError: ``rate <= 0`` (other parameters are checked by the caller with :func:`check_shared_prefix`).
    """
    if rate <= 0:
        raise WorkloadError(f"shared-prefix needs rate > 0, got {rate}")
    rng = random.Random(seed)
    nblk = -(-(prefix_len + suffix_len) // block)
    full_prefix_blocks = prefix_len // block
    order = [g for g in range(num_groups) for _ in range(per_group)]
    rng.shuffle(order)
    next_id = num_groups * full_prefix_blocks
    t = 0.0
    out: List[Tuple[int, float, List[int]]] = []
    for g in order:
        t += rng.expovariate(rate)
        ids = [g * full_prefix_blocks + b for b in range(full_prefix_blocks)]
        for _ in range(nblk - full_prefix_blocks):
            ids.append(next_id)
            next_id += 1
        out.append((g, t, ids))
    return out


def ideal_reuse_of_keys(prompts: Iterable[Tuple[Sequence[Hashable], int, int]]) -> float:
    """Ideal prefix reuse of a request stream: the fraction of prompt tokens a single infinite prefix cache hits.

    Args:
        prompts: per request ``(keys, input_len, block)``: chained block keys of its prompt (equal key ⇒ equal
            prefix up to the end of that block), prompt tokens, tokens per key.

    Each request hits ``min(k · block, input_len)`` tokens, ``k`` = its leading keys already seen; then all its keys
    are seen. Source: the trace format of Mooncake (FAST'25), ``kvcache-ai/Mooncake: FAST25-release/traces``.
    """
    seen: set = set()
    hit = total = 0
    for keys, input_len, block in prompts:
        k = 0
        for key in keys:
            if key in seen:
                k += 1
            else:
                break
        hit += min(k * block, input_len)
        total += input_len
        seen.update(keys)
    return hit / total if total else 0.0
