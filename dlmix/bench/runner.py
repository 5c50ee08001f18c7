"""Run a benchmark: one or more load levels (request-rate or concurrency sweep) of a workload against an OpenAI
endpoint, with metric scrapes around each level.

A *level* is ``(request_rate, max_concurrency)``: requests are released on the arrival schedule of
:func:`dlmix.bench.workloads.arrival_times` (or the trace's own timestamps when ``request_rate`` is None and the
workload carries ``arrival_s``) and, with ``max_concurrency``, additionally wait for a free slot (an asyncio
semaphore), as ``vllm bench serve --max-concurrency`` does. Level ``i`` of a synthetic workload uses seed
``seed + i`` so a later level never hits prefixes cached by an earlier one (levels stay independent).
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import httpx

from dlmix.bench.client import Clock, send_request
from dlmix.bench.scrape import prefix_hit_rate, scrape
from dlmix.bench.stats import DEFAULT_PERCENTILES, RequestResult, summarize
from dlmix.bench.workloads import BenchRequest, arrival_times, ideal_prefix_reuse

__all__ = ["Level", "BenchSettings", "run_level", "run_sweep", "resolve_model"]


@dataclass
class Level:
    """One load level: ``request_rate`` req/s (``inf`` = all at once, None = trace timestamps) and an optional
    ``max_concurrency`` cap (requests in flight)."""

    request_rate: Optional[float] = math.inf
    max_concurrency: Optional[int] = None

    def label(self) -> str:
        """Short text, e.g. ``rate=2`` or ``conc=4`` or ``rate=inf,conc=4``."""
        parts = []
        if self.request_rate is None:
            parts.append("trace")
        elif not (math.isinf(self.request_rate) and self.max_concurrency):
            parts.append(f"rate={self.request_rate:g}")
        if self.max_concurrency:
            parts.append(f"conc={self.max_concurrency}")
        return ",".join(parts)


@dataclass
class BenchSettings:
    """Everything a run needs besides the workload.

    Attributes:
        base_url: OpenAI server root (router or engine), e.g. ``http://127.0.0.1:8000``.
        model: model name for requests (None -> first id of ``GET /v1/models``).
        endpoint: ``/v1/completions`` (token-id prompts) or ``/v1/chat/completions``.
        burstiness: Gamma shape of inter-arrival gaps (1 = Poisson).
        seed: arrival seed (level i uses ``seed + i``).
        goodput_ms: SLO targets in ms (``ttft``, ``tpot``, ``e2el``).
        percentiles: reported percentiles.
        engine_urls: engine roots whose ``/metrics`` give vLLM prefix-cache counters.
        scrape_router: also scrape ``base_url/metrics``.
        timeout_s: per-request timeout, seconds.
        ignore_eos: send ``ignore_eos``/``min_tokens`` so outputs have exactly ``max_tokens`` tokens.
        api_key: bearer token for the endpoint (or None).
    """

    base_url: str
    model: Optional[str] = None
    endpoint: str = "/v1/completions"
    burstiness: float = 1.0
    seed: int = 0
    goodput_ms: dict = field(default_factory=dict)
    percentiles: Sequence[float] = DEFAULT_PERCENTILES
    engine_urls: Sequence[str] = ()
    scrape_router: bool = True
    timeout_s: float = 600.0
    ignore_eos: bool = True
    api_key: Optional[str] = None


async def resolve_model(client: httpx.AsyncClient, base_url: str, headers: Optional[dict] = None) -> Optional[str]:
    """First model id of ``GET {base_url}/v1/models``, or None when the list is unavailable."""
    try:
        r = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10.0)
        data = r.json().get("data") or []
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def run_level(workload: Sequence[BenchRequest], level: Level, s: BenchSettings, *, seed: int,
                    clock: Clock = time.perf_counter, client: Optional[httpx.AsyncClient] = None,
                    on_done: Optional[Callable[[RequestResult], None]] = None) -> dict:
    """Send ``workload`` at ``level`` and return ``{"level", "metrics", "prefix", "results"}``.

    ``metrics`` is :func:`dlmix.bench.stats.summarize`; ``prefix`` is
    :func:`dlmix.bench.scrape.prefix_hit_rate`; ``results`` the per-request :class:`RequestResult` list in
    workload order. Durations use ``clock`` (seconds).
    """
    own = client is None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = client or httpx.AsyncClient(timeout=httpx.Timeout(s.timeout_s, connect=10.0), limits=limits)
    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else None
    try:
        model = s.model or await resolve_model(client, s.base_url, headers)
        if level.request_rate is None:
            times = [r.arrival_s or 0.0 for r in workload]
        else:
            times = arrival_times(len(workload), level.request_rate, s.burstiness, seed)
        sem = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None
        r_before = await scrape(client, s.base_url) if s.scrape_router else None
        e_before = [await scrape(client, u) for u in s.engine_urls]

        async def one(req: BenchRequest, at: float, t0: float) -> RequestResult:
            delay = t0 + at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                async with sem:
                    res = await send_request(client, s.base_url, model, req.prompt, req.output_len,
                                             endpoint=s.endpoint, ignore_eos=s.ignore_eos, headers=headers,
                                             clock=clock, group=req.group)
            else:
                res = await send_request(client, s.base_url, model, req.prompt, req.output_len,
                                         endpoint=s.endpoint, ignore_eos=s.ignore_eos, headers=headers,
                                         clock=clock, group=req.group)
            if on_done:
                on_done(res)
            return res

        t0 = clock()
        results = await asyncio.gather(*(one(r, t, t0) for r, t in zip(workload, times)))
        ends = [r.send_time + r.latency for r in results]
        duration = max(max(ends) - t0, 1e-9) if ends else 1e-9
        r_after = await scrape(client, s.base_url) if s.scrape_router else None
        e_after = [await scrape(client, u) for u in s.engine_urls]
    finally:
        if own:
            await client.aclose()
    metrics = summarize(results, duration, s.goodput_ms, s.percentiles)
    prefix = prefix_hit_rate((r_before, r_after) if s.scrape_router else None, list(zip(e_before, e_after)))
    return {"level": {"request_rate": level.request_rate, "max_concurrency": level.max_concurrency,
                      "label": level.label()},
            "model": model, "metrics": metrics, "prefix": prefix, "results": list(results)}


async def run_sweep(make_workload: Callable[[int], list[BenchRequest]], levels: Sequence[Level], s: BenchSettings,
                    block_tokens_for_reuse: int = 16, progress: Optional[Callable[[str], None]] = None,
                    on_done: Optional[Callable[[RequestResult], None]] = None) -> dict:
    """Run every level in order; ``make_workload(seed)`` builds the level's workload (level i: ``seed + i``).

    Returns ``{"levels": [run_level output without "results" + "ideal_prefix_reuse"], "results": [[...], ...]}``.
    """
    out_levels, raw = [], []
    for i, lv in enumerate(levels):
        wl = make_workload(s.seed + i)
        if progress:
            progress(f"level {i + 1}/{len(levels)}: {lv.label()} ({len(wl)} requests)")
        res = await run_level(wl, lv, s, seed=s.seed + i, on_done=on_done)
        res["ideal_prefix_reuse"] = ideal_prefix_reuse(wl, block_tokens_for_reuse)
        raw.append(res.pop("results"))
        out_levels.append(res)
    return {"levels": out_levels, "results": raw}
