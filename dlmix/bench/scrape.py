"""Scrape Prometheus ``/metrics`` endpoints before and after a run and derive the prefix-hit rate.

Sources, in order of preference:

* the dlmix router, if its ``/metrics`` exposes a prefix-hit counter pair (``ROUTER_PREFIX_PAIRS``: hit tokens and
  looked-up tokens) -- the router's own view of how many prompt tokens it placed on an instance that had them.
  Today's router exposes only the numerator (``dlmix_router_prefix_hit_tokens_total``, hits it *predicted* at
  placement); that delta is reported as ``router_predicted_hit_tokens`` next to the measured rate;
* otherwise the engines (measured): vLLM's ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (tokens),
  summed over all engines and label sets. The rate is ``delta(hits) / delta(queries)`` over the run.

Parsing uses ``prometheus_client.parser`` (counters appear with their ``_total`` sample names).
"""
from __future__ import annotations

from typing import Optional, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["scrape", "prefix_hit_rate", "ENGINE_HITS", "ENGINE_QUERIES", "ROUTER_PREFIX_PAIRS"]

ENGINE_HITS = "vllm:prefix_cache_hits_total"
ENGINE_QUERIES = "vllm:prefix_cache_queries_total"
ROUTER_PREDICTED_HITS = "dlmix_router_prefix_hit_tokens_total"
# (hits, queries) sample names the dlmix router may expose; the first pair present is used.
ROUTER_PREFIX_PAIRS = (
    ("dlmix_router_prefix_hit_tokens_total", "dlmix_router_prefix_query_tokens_total"),
    ("dlmix_router_prefix_hit_tokens_total", "dlmix_router_prompt_tokens_total"),
    ("dlmix_prefix_hit_tokens_total", "dlmix_prefix_query_tokens_total"),
)


def parse_metrics(text: str) -> dict[str, float]:
    """Sum every sample of a Prometheus text exposition by sample name (labels summed away)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


async def scrape(client: httpx.AsyncClient, url: str) -> Optional[dict[str, float]]:
    """GET ``{url}/metrics`` and parse it; None when unreachable or not Prometheus text."""
    try:
        r = await client.get(url.rstrip("/") + "/metrics", timeout=10.0)
        if r.status_code != 200:
            return None
        return parse_metrics(r.text)
    except (httpx.HTTPError, ValueError, OSError):
        return None


def _delta(before: dict, after: dict, name: str) -> Optional[float]:
    if name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def prefix_hit_rate(router: tuple[Optional[dict], Optional[dict]] | None,
                    engines: Sequence[tuple[Optional[dict], Optional[dict]]] = ()) -> dict:
    """Prefix-hit rate over a run from (before, after) scrapes.

    Returns:
        ``{"source": "router"|"endpoint"|"engines"|None, "hit_tokens": float|None, "query_tokens": float|None,
        "rate": float|None}``; ``rate`` is hits/queries (None when no counters or no queries). With a router
        scrape also ``router_predicted_hit_tokens``: the delta of ``dlmix_router_prefix_hit_tokens_total`` (the
        hits the router predicted when placing requests), or None.
    """
    out = _prefix_hit_rate(router, engines)
    if router and router[0] is not None and router[1] is not None:
        # the dlmix router counts the prefix-hit tokens it predicted at placement (no denominator of its own)
        out["router_predicted_hit_tokens"] = _delta(router[0], router[1], ROUTER_PREDICTED_HITS)
    return out


def _prefix_hit_rate(router, engines) -> dict:
    if router and router[0] is not None and router[1] is not None:
        for hn, qn in ROUTER_PREFIX_PAIRS:
            h, q = _delta(router[0], router[1], hn), _delta(router[0], router[1], qn)
            if h is not None and q is not None:
                return {"source": "router", "hit_tokens": h, "query_tokens": q, "rate": h / q if q > 0 else None}
        # a router that proxies engine metrics exposes vLLM's names
        h, q = _delta(router[0], router[1], ENGINE_HITS), _delta(router[0], router[1], ENGINE_QUERIES)
        if h is not None and q is not None and not engines:
            return {"source": "endpoint", "hit_tokens": h, "query_tokens": q, "rate": h / q if q > 0 else None}
    hits = queries = 0.0
    found = False
    for before, after in engines:
        if before is None or after is None:
            continue
        h, q = _delta(before, after, ENGINE_HITS), _delta(before, after, ENGINE_QUERIES)
        if h is None or q is None:
            continue
        found = True
        hits += h
        queries += q
    if not found:
        return {"source": None, "hit_tokens": None, "query_tokens": None, "rate": None}
    return {"source": "engines", "hit_tokens": hits, "query_tokens": queries,
            "rate": hits / queries if queries > 0 else None}
