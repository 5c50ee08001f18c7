"""Workloads for the simulator: Mooncake-format traces and a seeded synthetic shared-prefix generator.

Mooncake trace format (``kvcache-ai/Mooncake: FAST25-release/README.md``): JSON lines
``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}``; one id per
512-token prompt block, equal ids mean an equal prefix up to the end of that block.

Engine block hashes: a trace block of 512 tokens with id ``h`` is split into ``512 / bs`` engine blocks; engine block
``j`` of it gets the 64-bit key ``mix(h, j)``. Only full engine blocks of the prompt are hashed (vLLM hashes full
blocks only), so a prompt of N tokens has ``N // bs`` keys. Because an equal trace id already implies an equal prefix,
the derived keys have the same "equal key ⇒ equal prefix" property as vLLM's chained hashes.

Pseudo-text: simulated requests have no text, but DLRouter's ``prefix_cache`` policy keys on the first 100 characters
of the prompt. :meth:`SimRequest.text` derives a deterministic string from ``hash_ids``: 64 characters per trace
block from a BLAKE2b digest of the id (base64 alphabet), so two prompts share a text prefix exactly as long as they
share leading trace blocks (plus accidental leading-character collisions between different ids, as real text has).
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional, Sequence

MOONCAKE_BLOCK = 512
MASK64 = (1 << 64) - 1
BUILTIN_TRACES = {"mooncake": "data/mooncake_conversation_trace.jsonl.gz",
                  "mooncake_conversation": "data/mooncake_conversation_trace.jsonl.gz"}


class WorkloadError(ValueError):
    """A workload file or spec is missing or malformed (the message names the file and line)."""


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
        trace_block: tokens per hash id (512 for Mooncake traces).
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

        Raises ValueError if ``bs`` does not divide the trace block size."""
        ks = self._keys.get(bs)
        if ks is None:
            tb = self.trace_block
            if tb % bs:
                raise ValueError(f"engine block size {bs} must divide the trace block size {tb}")
            per = tb // bs
            n = self.input_len // bs
            ks = []
            for h in self.hash_ids:
                for j in range(per):
                    if len(ks) >= n:
                        break
                    ks.append(_mix(h, j))
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


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def resolve_trace(name_or_path: str) -> Path:
    """Path of a built-in trace name (``mooncake``) or of a file. Raises WorkloadError if it does not exist."""
    if name_or_path in BUILTIN_TRACES:
        return Path(str(resources.files("dlmix").joinpath(BUILTIN_TRACES[name_or_path])))
    p = Path(name_or_path)
    if not p.exists():
        raise WorkloadError(f"trace {name_or_path!r} not found (built-in: {', '.join(BUILTIN_TRACES)})")
    return p


def load_trace(name_or_path: str, speedup: float = 1.0, limit: Optional[int] = None,
               trace_block: int = MOONCAKE_BLOCK) -> List[SimRequest]:
    """Read a Mooncake-format JSONL (optionally gzipped) trace.

    Args:
        name_or_path: built-in name (``mooncake``) or file path (``.jsonl`` or ``.jsonl.gz``).
        speedup: arrival time scale; ``timestamp / 1000 / speedup`` seconds (2.0 = twice the request rate).
        limit: keep only the first ``limit`` requests (None = all).
        trace_block: tokens per hash id (512 for Mooncake).

    Raises WorkloadError naming the line for malformed input; ``speedup`` must be > 0.
    """
    if speedup <= 0:
        raise WorkloadError(f"speedup must be > 0, got {speedup}")
    path = resolve_trace(name_or_path)
    reqs: List[SimRequest] = []
    with _open_text(path) as f:
        for ln, line in enumerate(f, 1):
            if limit is not None and len(reqs) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
                ts = float(d["timestamp"])
                n_in = int(d["input_length"])
                n_out = int(d["output_length"])
                ids = [int(x) for x in d.get("hash_ids", [])]
            except (ValueError, KeyError, TypeError) as ex:
                raise WorkloadError(f"{path}:{ln}: bad trace line ({ex!r})") from None
            if n_in < 1 or n_out < 0:
                raise WorkloadError(f"{path}:{ln}: input_length must be >= 1 and output_length >= 0")
            reqs.append(SimRequest(len(reqs), ts / 1000.0 / speedup, n_in, max(n_out, 1), ids, trace_block))
    reqs.sort(key=lambda r: (r.arrival, r.rid))
    for i, r in enumerate(reqs):
        r.rid = i
    return reqs


def shared_prefix(num_groups: int, requests_per_group: int, prefix_len: int, suffix_len: int, output_len: int,
                  rate: float, seed: int = 0, trace_block: int = MOONCAKE_BLOCK) -> List[SimRequest]:
    """Seeded synthetic shared-prefix workload (llm-d / SGLang ``generated-shared-prefix`` style).

    ``num_groups`` system prompts of ``prefix_len`` tokens, each followed by a unique question of ``suffix_len``
    tokens; ``num_groups × requests_per_group`` requests in random order with Poisson arrivals at ``rate`` req/s.
    Hash ids: a group's prefix blocks get ids shared by the group; a block straddling prefix and suffix and all
    suffix blocks get unique ids (as chained hashes would). Raises WorkloadError for non-positive sizes.
    """
    if min(num_groups, requests_per_group, output_len) < 1 or prefix_len < 0 or suffix_len < 0 or rate <= 0:
        raise WorkloadError("shared_prefix: groups, requests per group, output_len must be >= 1, lengths >= 0, "
                            "rate > 0")
    if prefix_len + suffix_len < 1:
        raise WorkloadError("shared_prefix: prefix_len + suffix_len must be >= 1")
    rng = random.Random(seed)
    n_in = prefix_len + suffix_len
    nblk = -(-n_in // trace_block)
    full_prefix_blocks = prefix_len // trace_block
    order = [g for g in range(num_groups) for _ in range(requests_per_group)]
    rng.shuffle(order)
    next_id = num_groups * full_prefix_blocks
    t = 0.0
    out: List[SimRequest] = []
    for i, g in enumerate(order):
        t += rng.expovariate(rate)
        ids = [g * full_prefix_blocks + b for b in range(full_prefix_blocks)]
        for _ in range(nblk - full_prefix_blocks):
            ids.append(next_id)
            next_id += 1
        out.append(SimRequest(i, t, n_in, output_len, ids, trace_block))
    return out


def write_trace(reqs: Sequence[SimRequest], path: str) -> None:
    """Write requests as a Mooncake-format JSONL (timestamps in ms, rounded)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in reqs:
            f.write(json.dumps({"timestamp": round(r.arrival * 1000), "input_length": r.input_len,
                                "output_length": r.output_len, "hash_ids": list(r.hash_ids)}) + "\n")


def ideal_reuse(reqs: Sequence[SimRequest]) -> float:
    """Ideal prefix reuse (single infinite cache, trace-block granularity): for each request count its leading ids
    already seen, ``hit += min(k · block, input_len)``; divided by total input tokens (routing-anchors notes §3)."""
    seen = set()
    hit = tot = 0
    for r in reqs:
        k = 0
        for h in r.hash_ids:
            if h in seen:
                k += 1
            else:
                break
        hit += min(k * r.trace_block, r.input_len)
        tot += r.input_len
        seen.update(r.hash_ids)
    return hit / tot if tot else 0.0
