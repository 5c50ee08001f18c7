"""Serving metrics computed from per-request timings, with the definitions of ``vllm bench serve``.

Definitions (vLLM ``vllm/benchmarks/serve.py``, ``calculate_metrics``):

* **TTFT** (time to first token, seconds): client send time -> arrival of the first SSE chunk carrying output.
* **ITL** (inter-token latency, seconds): every gap between consecutive output-carrying chunks of a request; the ITL
  distribution pools the gaps of all requests. (A chunk holding several tokens counts as one gap, as in vLLM.)
* **TPOT** (time per output token, seconds): per request ``(E2EL - TTFT) / (output_tokens - 1)``, only for requests
  with more than one output token.
* **E2EL** (end-to-end latency, seconds): send -> last byte of the response.
* Throughputs: ``completed / duration`` (req/s), ``output_tokens / duration`` (tok/s), ``(input + output) / duration``;
  ``duration`` is the benchmark's wall time (first send -> last completion), seconds.
* **Goodput** (``--goodput ttft:MS --goodput tpot:MS``, or ``--goodput "ttft:MS tpot:MS"``): a completed request is
  *good* when each given metric is <= its target (milliseconds); ``request_goodput = good / duration`` (req/s). We
  also report ``good_fraction`` = good / all requests sent (a failed request is not good, as in ``dlmix sim``'s
  ``good_fraction``), so a level with failed requests cannot read as meeting its SLO.
* Percentiles: ``numpy.percentile`` with linear interpolation (vLLM's choice); reported in milliseconds.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

__all__ = ["RequestResult", "parse_goodput", "summarize", "GOODPUT_METRICS", "DEFAULT_PERCENTILES"]

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestResult:
    """Outcome of one benchmark request. Times are seconds on the client's monotonic clock.

    Attributes:
        success: HTTP 200 and a complete stream.
        input_tokens: prompt length in tokens (usage ``prompt_tokens`` when reported, else what we sent).
        output_tokens: generated tokens (usage ``completion_tokens`` when reported, else output chunks counted).
        send_time: when the request was sent.
        ttft: seconds from send to the first output chunk (0 when none arrived).
        itl: gaps between consecutive output chunks, seconds.
        latency: seconds from send to the end of the response (E2EL).
        error: error text for failed requests.
        group: workload group (shared-prefix group id, or -1).
    """

    success: bool
    input_tokens: int = 0
    output_tokens: int = 0
    send_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    group: int = -1

    @property
    def tpot(self) -> Optional[float]:
        """``(latency - ttft) / (output_tokens - 1)`` seconds, or None for fewer than two output tokens."""
        if self.output_tokens > 1:
            return (self.latency - self.ttft) / (self.output_tokens - 1)
        return None

    def to_dict(self) -> dict:
        """Plain dict (JSON-ready) including the derived ``tpot``."""
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


def parse_goodput(specs: Iterable[str] | None) -> dict[str, float]:
    """Parse ``["ttft:500", "tpot:50"]`` (vLLM's ``--goodput`` syntax, milliseconds) into ``{"ttft": 500.0, ...}``.

    Several ``KEY:MS`` may also be given in one string separated by spaces or commas.

    Raises:
        ValueError: unknown metric name, missing colon, or a value that is not a positive number (NaN included).
    """
    out: dict[str, float] = {}
    for spec in specs or ():
        for item in spec.replace(",", " ").split():
            if ":" not in item:
                raise ValueError(f"--goodput item {item!r} must be KEY:MILLISECONDS (keys: {', '.join(GOODPUT_METRICS)})")
            key, val = item.split(":", 1)
            key = key.strip().lower()
            if key not in GOODPUT_METRICS:
                raise ValueError(f"--goodput: unknown metric {key!r}; choose from {', '.join(GOODPUT_METRICS)}")
            try:
                ms = float(val)
            except ValueError:
                raise ValueError(f"--goodput {key}: {val!r} is not a number of milliseconds") from None
            if not ms > 0:  # NaN too: no latency meets a NaN target, so goodput would read 0 % silently
                raise ValueError(f"--goodput {key}: target must be > 0 ms, got {ms}")
            out[key] = ms
    return out


def _dist(values_s: Sequence[float], percentiles: Sequence[float]) -> dict:
    """mean/median/std/min/max and percentiles of seconds values, reported in milliseconds (zeros when empty)."""
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    if a.size == 0:
        d = {"mean": 0.0, "median": 0.0, "std": 0.0, "min": 0.0, "max": 0.0}
        d.update({f"p{_pname(p)}": 0.0 for p in percentiles})
        return d
    d = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
         "min": float(a.min()), "max": float(a.max())}
    for p in percentiles:
        d[f"p{_pname(p)}"] = float(np.percentile(a, p))
    return d


def _pname(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def is_good(r: RequestResult, slo_ms: dict[str, float]) -> bool:
    """True when the successful request meets every target of ``slo_ms`` (metric -> milliseconds)."""
    if not r.success:
        return False
    vals = {"ttft": r.ttft, "e2el": r.latency, "tpot": r.tpot if r.tpot is not None else 0.0}
    return all(vals[k] * 1000.0 <= v for k, v in slo_ms.items())


def summarize(results: Sequence[RequestResult], duration_s: float, goodput_ms: dict[str, float] | None = None,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict:
    """Aggregate metrics of one benchmark run.

    Args:
        results: one :class:`RequestResult` per request sent.
        duration_s: wall time of the run in seconds (> 0).
        goodput_ms: SLO targets in milliseconds (keys ``ttft``, ``tpot``, ``e2el``); empty or None = no goodput.
        percentiles: percentiles to report (e.g. ``(50, 90, 99)``).

    Returns:
        dict with ``completed``, ``failed``, token totals, throughputs (``request_throughput`` req/s,
        ``output_throughput`` tok/s, ``total_token_throughput`` tok/s), ``request_goodput`` and ``good_fraction``
        (good / all requests in ``results``, failed ones included; both None without targets), and ``ttft_ms``/``tpot_ms``/``itl_ms``/``e2el_ms`` dicts of mean/median/std/min/
        max/pNN in milliseconds.

    Raises:
        ValueError: ``duration_s`` is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [g for r in ok for g in r.itl]
    e2els = [r.latency for r in ok]
    tin = sum(r.input_tokens for r in ok)
    tout = sum(r.output_tokens for r in ok)
    out = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": tin,
        "total_output_tokens": tout,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": tout / duration_s,
        "total_token_throughput": (tin + tout) / duration_s,
        "request_goodput": None,
        "good_fraction": None,
        "goodput_targets_ms": dict(goodput_ms or {}),
        "ttft_ms": _dist(ttfts, percentiles),
        "tpot_ms": _dist(tpots, percentiles),
        "itl_ms": _dist(itls, percentiles),
        "e2el_ms": _dist(e2els, percentiles),
    }
    if goodput_ms:
        good = sum(1 for r in ok if is_good(r, goodput_ms))
        out["request_goodput"] = good / duration_s
        out["good_fraction"] = good / len(results) if results else 0.0  # a failed request is not good
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            key = (r.error or "unknown").splitlines()[0][:120]
            errors[key] = errors.get(key, 0) + 1
    out["errors"] = errors
    return out
