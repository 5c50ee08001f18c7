"""Prometheus metrics of the router (prometheus-client, own registry).

* ``dlmix_router_requests_total{route}``: requests by placement (``pd``, ``local``, policy name...).
* ``dlmix_router_responses_total{instance,status}``: by backend status class (2xx/4xx/5xx).
* ``dlmix_router_prefix_hit_tokens_total{instance}``: predicted prefix-hit tokens on the prefilling instance.
* ``dlmix_router_kv_bytes_moved_total``: KV bytes the PD transfers move (``(N − h_D) · kv_bytes_per_token``).
* ``dlmix_router_ttft_seconds{instance,chip}``: router-measured TTFT of streamed requests (first SSE chunk).
* ``dlmix_router_itl_seconds{instance,chip}``: mean inter-chunk gap per streamed request (one sample per request).
* ``dlmix_router_request_seconds{instance,chip}``: end-to-end latency.
* ``dlmix_router_retries_total{kind}``: ``decode`` retries, ``prefill`` retries on another instance,
  ``prefill_local`` fallbacks to prefill on the decode instance.
* ``dlmix_router_backend_errors_total{instance}``, ``dlmix_router_kv_event_errors_total``.
* ``dlmix_router_instance_{inflight,healthy,kv_usage,ttft_ratio,itl_ratio}{instance,role,chip}`` gauges (at scrape).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, CONTENT_TYPE_LATEST
from prometheus_client.core import GaugeMetricFamily

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _Children:
    __slots__ = ("ttft", "itl", "e2e", "hits", "err", "s2", "s4", "s5")


class Metrics:
    """Metric objects bound to one router; per-instance children are cached (no label lookups per request)."""

    def __init__(self, router):
        self.router = router
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dlmix_router_requests", "Requests by placement route", ["route"], registry=r)
        self.responses = Counter("dlmix_router_responses", "Responses by instance and status class",
                                 ["instance", "status"], registry=r)
        self.hits = Counter("dlmix_router_prefix_hit_tokens", "Prefix-hit tokens", ["instance"], registry=r)
        self.kv_bytes = Counter("dlmix_router_kv_bytes_moved", "KV bytes moved by PD transfers", registry=r)
        self.ttft = Histogram("dlmix_router_ttft_seconds", "TTFT of streamed requests", ["instance", "chip"],
                              buckets=_LAT, registry=r)
        self.itl = Histogram("dlmix_router_itl_seconds", "Mean ITL per streamed request", ["instance", "chip"],
                             buckets=_LAT, registry=r)
        self.e2e = Histogram("dlmix_router_request_seconds", "End-to-end latency", ["instance", "chip"],
                             buckets=_LAT, registry=r)
        self.retries = Counter("dlmix_router_retries", "Retries and fallbacks", ["kind"], registry=r)
        self.errors = Counter("dlmix_router_backend_errors", "Backend failures", ["instance"], registry=r)
        self.ev_errors = Counter("dlmix_router_kv_event_errors", "Undecodable KV event payloads", registry=r)
        self._routes: dict = {}
        r.register(_InstanceCollector(router))

    def bind(self, rt) -> None:
        """Create the metric children of one instance runtime."""
        i, c = rt.state.id, rt.state.chip
        ch = _Children()
        ch.ttft, ch.itl, ch.e2e = self.ttft.labels(i, c), self.itl.labels(i, c), self.e2e.labels(i, c)
        ch.hits, ch.err = self.hits.labels(i), self.errors.labels(i)
        ch.s2, ch.s4, ch.s5 = (self.responses.labels(i, s) for s in ("2xx", "4xx", "5xx"))
        rt.m = ch

    def done(self, rt, dec, rr, t0: float, status: int, nchunks: int, t_first: float, gaps: float) -> None:
        """A forwarded response finished."""
        ch = rt.m
        now = time.perf_counter()
        ch.e2e.observe(now - t0)
        (ch.s2 if status < 400 else ch.s4 if status < 500 else ch.s5).inc()
        if nchunks > 1:
            ch.ttft.observe(t_first - t0)
            ch.itl.observe(gaps / (nchunks - 1))
        route = dec.reason
        c = self._routes.get(route)
        if c is None:
            c = self._routes[route] = self.requests.labels(route)
        c.inc()

    def hit(self, rt, tokens: int) -> None:
        if rt is not None and rt.m is not None:
            rt.m.hits.inc(tokens)

    def retry(self, kind: str) -> None:
        self.retries.labels(kind).inc()

    def backend_error(self, rt) -> None:
        if rt.m is not None:
            rt.m.err.inc()

    def kv_event_error(self, ex) -> None:
        self.ev_errors.inc()

    def render(self):
        """(body bytes, content type) for /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST.encode()


class _InstanceCollector:
    def __init__(self, router):
        self.router = router

    def collect(self):
        labels = ["instance", "role", "chip"]
        fams = {n: GaugeMetricFamily(f"dlmix_router_instance_{n}", d, labels=labels) for n, d in (
            ("inflight", "Router-counted in-flight requests"), ("healthy", "1 if in rotation"),
            ("kv_usage", "Engine-reported KV usage"), ("ttft_ratio", "Calibration: measured/predicted TTFT"),
            ("itl_ratio", "Calibration: measured/predicted ITL"))}
        for i in list(self.router.instances):
            lv = [i.id, i.role, i.chip]
            fams["inflight"].add_metric(lv, i.load.inflight)
            fams["healthy"].add_metric(lv, 1.0 if i.available() else 0.0)
            fams["kv_usage"].add_metric(lv, i.load.kv_usage)
            fams["ttft_ratio"].add_metric(lv, i.ttft_ratio)
            fams["itl_ratio"].add_metric(lv, i.itl_ratio)
        yield from fams.values()
