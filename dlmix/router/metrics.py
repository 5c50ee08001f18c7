"""Prometheus metrics of the router (prometheus-client, own registry).

Counters and histograms:

* ``dlmix_router_requests_total{route}``: requests by placement (``pd``, ``local``, policy name...).
* ``dlmix_router_client_responses_total{status}``: every answer the router gave a client, by exact HTTP status: the
  backends' answers it passed through and the ones it made itself (400 bad body, 401 key, 404, 405, 413, 502, 503...).
* ``dlmix_router_responses_total{instance,status}``: forwarded (decode or whole-request) responses by backend status
  class (2xx/4xx/5xx).
* ``dlmix_router_prefill_responses_total{instance,status}``: PD prefill-leg responses by status class; ``error`` when
  the leg failed without an HTTP answer (refused connection, timeout, 200 without ``kv_transfer_params``).
* ``dlmix_router_prefix_hit_tokens_total{instance}``: prefix-hit tokens the router's index expects on the instance
  that prefills (exact with engine KV events, approximate without).
* ``dlmix_router_decode_prefix_hit_tokens_total{instance}``: for PD requests, prompt tokens the decode instance
  already holds per the index (``h_D``; with KV events: what the decode engine reported storing).
* ``dlmix_router_kv_bytes_handed_off_total``: KV bytes the prefill engines reported holding for the decode side,
  from their ``kv_transfer_params`` (``len(remote_block_ids)`` × block bytes of ``remote_layout``, or of the prefill
  instance's registered layout, × its TP ranks). Counted only when the engine reports block ids.
* ``dlmix_router_kv_bytes_estimated_total``: the cost model's *estimate* of PD KV bytes,
  ``(N − h_D) · kv_bytes_per_token`` (``dlmix.hw.cost.CostModel.kv_bytes``); kept separate from what engines report.
* ``dlmix_router_ttft_seconds{instance,chip}``: router-measured TTFT of streamed requests (first SSE chunk).
* ``dlmix_router_itl_seconds{instance,chip}``: mean inter-chunk gap per streamed request (one sample per request).
* ``dlmix_router_request_seconds{instance,chip}``: end-to-end latency.
* ``dlmix_router_retries_total{kind}``: ``decode`` retries, ``prefill`` retries on another instance,
  ``prefill_local`` fallbacks to prefill on the decode instance.
* ``dlmix_router_backend_errors_total{instance}``, ``dlmix_router_kv_event_errors_total``.

Gauges (computed at scrape): ``dlmix_router_instance_{inflight,healthy,kv_usage,ttft_ratio,itl_ratio}{instance,role,
chip}``, ``dlmix_router_instances_registered``, ``dlmix_router_instances_available``.

Bounded output: only instances whose slot is below ``metrics_instance_series`` (router config, default 32) have
their own ``instance`` label value; every other instance is aggregated under ``instance="_other"`` (counters and
histograms add up; gauges per (role, chip): ``inflight`` and ``healthy`` are sums, ``kv_usage`` and the ratios means).
So ``/metrics`` has at most ``metrics_instance_series + 1`` instance values whatever the fleet size.
"""
from __future__ import annotations

import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, generate_latest, CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
OTHER = "_other"


class _Count:
    """A counter child: a plain number, read at scrape time (the router's event loop is its only writer)."""

    __slots__ = ("v",)

    def __init__(self):
        self.v = 0

    def inc(self, n=1) -> None:
        """Add ``n`` (>= 0)."""
        self.v += n


class _Hist:
    """A histogram child over the bucket upper bounds ``bounds`` (seconds): per-bucket counts, sum and count;
    Prometheus' ``le`` rule (a value equal to a bound falls in that bucket)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, v: float) -> None:
        """Record one value ``v``."""
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v


class _Family:
    """The children of one metric, by label values; exported by :class:`_Exporter` at scrape time.

    Args: name (without ``_total``), help text, label names, kind (``counter`` or ``histogram``)."""

    __slots__ = ("name", "doc", "labels", "kind", "children")

    def __init__(self, name: str, doc: str, labels=(), kind: str = "counter"):
        self.name, self.doc, self.labels, self.kind = name, doc, tuple(labels), kind
        self.children: dict = {}

    def child(self, *values: str):
        """The child of these label values (created on first use; keep it: lookups are not free)."""
        c = self.children.get(values)
        if c is None:
            c = self.children[values] = _Count() if self.kind == "counter" else _Hist(_LAT)
        return c

    def collect(self):
        if self.kind == "counter":
            fam = CounterMetricFamily(self.name, self.doc, labels=self.labels)
            for lv, c in self.children.items():
                fam.add_metric(list(lv), c.v)
        else:
            fam = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
            for lv, h in self.children.items():
                acc, buckets = 0, []
                for b, n in zip(h.bounds + (float("inf"),), h.counts):
                    acc += n
                    buckets.append(("+Inf" if b == float("inf") else repr(float(b)), acc))
                fam.add_metric(list(lv), buckets, h.sum)
        return fam


class _Exporter:
    """prometheus-client collector over the :class:`_Family` objects of one router."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        for f in self.families:
            yield f.collect()


class _Children:
    __slots__ = ("ttft", "itl", "e2e", "hits", "dhits", "err", "s2", "s4", "s5", "p2", "p4", "p5", "perr", "label",
                 "block_bytes")


def _klass(status: int) -> str:
    return "2xx" if status < 400 else "4xx" if status < 500 else "5xx"


class Metrics:
    """Metric objects bound to one router; per-instance children are cached (no label lookups per request).

    The request path only adds to plain numbers (:class:`_Count`, :class:`_Hist`); prometheus-client renders them
    at scrape time through one collector, so a request pays no lock and no label check. Single writer: the
    router's event loop.

    Args:
        router: the :class:`~dlmix.router.server.Router` (its ``instances`` and ``cfg.metrics_instance_series``).
    """

    def __init__(self, router):
        self.router = router
        cfg = getattr(router, "cfg", None)
        self.max_series = int(getattr(cfg, "metrics_instance_series", 32))
        F = _Family
        self.requests = F("dlmix_router_requests", "Requests by placement route", ["route"])
        self.answers = F("dlmix_router_client_responses", "Answers to clients by HTTP status (passed through or made "
                         "by the router)", ["status"])
        self.responses = F("dlmix_router_responses", "Forwarded responses by instance and status class",
                           ["instance", "status"])
        self.prefill = F("dlmix_router_prefill_responses", "PD prefill-leg responses by instance and status class "
                         "(error: no HTTP answer)", ["instance", "status"])
        self.hits = F("dlmix_router_prefix_hit_tokens", "Prefix-hit tokens expected on the prefilling instance",
                      ["instance"])
        self.dhits = F("dlmix_router_decode_prefix_hit_tokens", "PD: prompt tokens the decode instance already holds "
                       "(index)", ["instance"])
        kvb = F("dlmix_router_kv_bytes_handed_off", "KV bytes prefill engines reported holding for the decode side "
                "(kv_transfer_params)")
        kve = F("dlmix_router_kv_bytes_estimated", "Cost-model estimate of PD KV bytes")
        self.ttft = F("dlmix_router_ttft_seconds", "TTFT of streamed requests", ["instance", "chip"], "histogram")
        self.itl = F("dlmix_router_itl_seconds", "Mean ITL per streamed request", ["instance", "chip"], "histogram")
        self.e2e = F("dlmix_router_request_seconds", "End-to-end latency", ["instance", "chip"], "histogram")
        self.retries = F("dlmix_router_retries", "Retries and fallbacks", ["kind"])
        self.errors = F("dlmix_router_backend_errors", "Backend failures", ["instance"])
        eve = F("dlmix_router_kv_event_errors", "Undecodable KV event payloads")
        self.kv_bytes, self.kv_bytes_est, self.ev_errors = kvb.child(), kve.child(), eve.child()
        self._routes: dict = {}
        self._answers: dict = {}
        r = self.registry = CollectorRegistry()
        r.register(_Exporter([self.requests, self.answers, self.responses, self.prefill, self.hits, self.dhits, kvb,
                              kve, self.ttft, self.itl, self.e2e, self.retries, self.errors, eve]))
        r.register(_InstanceCollector(router, self.max_series))

    def label(self, state) -> str:
        """The ``instance`` label value of an instance: its id when its slot is below the cap, else ``_other``."""
        return state.id if 0 <= state.slot < self.max_series else OTHER

    def bind(self, rt) -> None:
        """Create the metric children of one instance backend (``rt.m``)."""
        i, c = self.label(rt.state), rt.state.chip
        ch = _Children()
        ch.label = i
        ch.block_bytes = None
        ch.ttft, ch.itl, ch.e2e = self.ttft.child(i, c), self.itl.child(i, c), self.e2e.child(i, c)
        ch.hits, ch.dhits, ch.err = self.hits.child(i), self.dhits.child(i), self.errors.child(i)
        ch.s2, ch.s4, ch.s5 = (self.responses.child(i, s) for s in ("2xx", "4xx", "5xx"))
        ch.p2, ch.p4, ch.p5, ch.perr = (self.prefill.child(i, s) for s in ("2xx", "4xx", "5xx", "error"))
        rt.m = ch

    def answer(self, status: int) -> None:
        """One answer with HTTP ``status`` went to a client."""
        c = self._answers.get(status)
        if c is None:
            c = self._answers[status] = self.answers.child(str(status))
        c.v += 1

    def done(self, rt, dec, rr, t0: float, status: int, nchunks: int, t_first: float, gaps: float) -> None:
        """A forwarded response finished (``t0``: ``perf_counter`` at arrival; ``gaps``: sum of inter-chunk gaps)."""
        ch = rt.m
        ch.e2e.observe(time.perf_counter() - t0)
        (ch.s2 if status < 400 else ch.s4 if status < 500 else ch.s5).v += 1
        c = self._answers.get(status)
        if c is None:
            c = self._answers[status] = self.answers.child(str(status))
        c.v += 1
        if nchunks > 1:
            ch.ttft.observe(t_first - t0)
            ch.itl.observe(gaps / (nchunks - 1))
        route = dec.reason
        c = self._routes.get(route)
        if c is None:
            c = self._routes[route] = self.requests.child(route)
        c.v += 1

    def prefill_leg(self, rt, status: int = 0, kvp=None) -> None:
        """A PD prefill leg on ``rt`` ended: HTTP ``status`` (0: no answer) and, on success, the engine's
        ``kv_transfer_params`` (its reported block ids feed ``kv_bytes_handed_off``)."""
        ch = rt.m
        if ch is None:
            return
        (ch.perr if not status else ch.p2 if status < 400 else ch.p4 if status < 500 else ch.p5).inc()
        if isinstance(kvp, dict):
            n = kvp.get("remote_block_ids")
            if isinstance(n, list) and n:
                bb = self._block_bytes(rt, kvp)
                if bb:
                    self.kv_bytes.inc(len(n) * bb)

    def _block_bytes(self, rt, kvp: dict) -> int:
        """Bytes of one producer block over all its TP ranks (cached per instance); 0 when no layout is known."""
        ch = rt.m
        if ch.block_bytes is None:
            from dlmix.kv.layout import KVLayout

            lay = kvp.get("remote_layout") or rt.state.kv_layout
            try:
                kl = KVLayout.from_dict(lay)
                ranks = len(kvp.get("remote_transports") or ()) or int(kvp.get("tp_size") or 0) or kl.tp_size
                ch.block_bytes = kl.block_bytes() * max(int(ranks), 1)
            except (TypeError, ValueError, KeyError, AttributeError):
                ch.block_bytes = 0
        return ch.block_bytes

    def hit(self, rt, tokens: int) -> None:
        """``tokens`` prefix-hit tokens expected on the prefilling instance ``rt``."""
        if rt is not None and rt.m is not None:
            rt.m.hits.inc(tokens)

    def decode_hit(self, rt, tokens: int) -> None:
        """PD: the decode instance ``rt`` already holds ``tokens`` of the prompt."""
        if rt is not None and rt.m is not None and tokens > 0:
            rt.m.dhits.inc(tokens)

    def kv_estimate(self, nbytes: int) -> None:
        """Cost-model estimate of one PD transfer's KV bytes."""
        if nbytes > 0:
            self.kv_bytes_est.inc(nbytes)

    def retry(self, kind: str) -> None:
        self.retries.child(kind).inc()

    def backend_error(self, rt) -> None:
        if rt.m is not None:
            rt.m.err.inc()

    def kv_event_error(self, ex) -> None:
        self.ev_errors.inc()

    def render(self):
        """(body bytes, content type) for /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST.encode()


class _InstanceCollector:
    """Scrape-time gauges: one series per instance below the cap, the rest aggregated per (role, chip)."""

    def __init__(self, router, max_series: int):
        self.router = router
        self.max_series = max_series

    def collect(self):
        labels = ["instance", "role", "chip"]
        fams = {n: GaugeMetricFamily(f"dlmix_router_instance_{n}", d, labels=labels) for n, d in (
            ("inflight", "Router-counted in-flight requests"), ("healthy", "1 if in rotation (_other: count)"),
            ("kv_usage", "Engine-reported KV usage (_other: mean)"),
            ("ttft_ratio", "Calibration: measured/predicted TTFT (_other: mean)"),
            ("itl_ratio", "Calibration: measured/predicted ITL (_other: mean)"))}
        agg: dict = {}
        insts = list(self.router.instances)
        avail = 0
        cap = self.max_series
        for i in insts:
            ok = i.available()
            avail += ok
            if 0 <= i.slot < cap:
                lv = [i.id, i.role, i.chip]
                fams["inflight"].add_metric(lv, i.load.inflight)
                fams["healthy"].add_metric(lv, 1.0 if ok else 0.0)
                fams["kv_usage"].add_metric(lv, i.load.kv_usage)
                fams["ttft_ratio"].add_metric(lv, i.ttft_ratio)
                fams["itl_ratio"].add_metric(lv, i.itl_ratio)
            else:
                a = agg.get((i.role, i.chip))
                if a is None:
                    a = agg[(i.role, i.chip)] = [0, 0, 0, 0.0, 0.0, 0.0]
                a[0] += 1
                a[1] += i.load.inflight
                a[2] += ok
                a[3] += i.load.kv_usage
                a[4] += i.ttft_ratio
                a[5] += i.itl_ratio
        for (role, chip), (n, inflight, healthy, kv, tr, ir) in sorted(agg.items()):
            lv = [OTHER, role, chip]
            fams["inflight"].add_metric(lv, inflight)
            fams["healthy"].add_metric(lv, healthy)
            fams["kv_usage"].add_metric(lv, kv / n)
            fams["ttft_ratio"].add_metric(lv, tr / n)
            fams["itl_ratio"].add_metric(lv, ir / n)
        yield from fams.values()
        reg = GaugeMetricFamily("dlmix_router_instances_registered", "Registered instances")
        reg.add_metric([], len(insts))
        yield reg
        av = GaugeMetricFamily("dlmix_router_instances_available", "Instances in rotation (healthy, not draining)")
        av.add_metric([], avail)
        yield av
