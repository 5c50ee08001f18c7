"""KV connector stats of DLMixConnector for vLLM's logging and Prometheus ``/metrics``.

Decode workers record one observation per finished pull; vLLM ships them worker -> scheduler -> API server, logs
``KV Transfer metrics: ...`` periodically and feeds the Prometheus metrics built here:

* ``vllm:dlmix_kv_bytes_received`` (counter, bytes read from prefill instances),
* ``vllm:dlmix_kv_tokens_loaded`` (counter, tokens written into this instance's KV cache),
* ``vllm:dlmix_kv_transfers`` / ``vllm:dlmix_kv_failed_transfers`` (counters, pulls),
* ``vllm:dlmix_kv_transfer_seconds`` (histogram, wall time of one pull incl. conversion).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

__all__ = ["DLMixKVConnectorStats", "DLMixPromMetrics"]

_KEYS = ("transfer_s", "bytes_received", "tokens_loaded", "failed")


@dataclass
class DLMixKVConnectorStats(KVConnectorStats):
    """Per-interval lists: ``transfer_s`` (seconds), ``bytes_received`` (bytes), ``tokens_loaded`` (tokens),
    ``failed`` (1 per failed pull). Serializable (plain lists)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {k: [] for k in _KEYS}

    def record(self, transfer_s: float, bytes_received: int, tokens_loaded: int, failed: bool) -> None:
        self.data["transfer_s"].append(float(transfer_s))
        self.data["bytes_received"].append(int(bytes_received))
        self.data["tokens_loaded"].append(int(tokens_loaded))
        self.data["failed"].append(1 if failed else 0)

    def clone_and_reset(self) -> "DLMixKVConnectorStats":
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not self.data.get("transfer_s")

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in _KEYS:
            self.data.setdefault(k, []).extend(other.data.get(k, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        n = len(self.data["transfer_s"])
        tot_b = sum(self.data["bytes_received"])
        tot_s = sum(self.data["transfer_s"])
        return {
            "Num transfers": n,
            "Num failed": sum(self.data["failed"]),
            "MB received": round(tot_b / 2**20, 3),
            "Tokens loaded": sum(self.data["tokens_loaded"]),
            "Avg transfer time (ms)": round(1e3 * tot_s / n, 3) if n else 0.0,
            "Throughput (MB/s)": round(tot_b / 2**20 / tot_s, 3) if tot_s > 0 else 0.0,
        }


class DLMixPromMetrics(KVConnectorPromMetrics):
    """Prometheus metrics of DLMixConnector (see module docstring), one child per engine label set."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def counter(name: str, doc: str):
            return create_metric_per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                                            self.per_engine_labelvalues)

        self.bytes = counter("vllm:dlmix_kv_bytes_received", "Bytes of KV read from prefill instances (DLMix).")
        self.tokens = counter("vllm:dlmix_kv_tokens_loaded", "Tokens of KV loaded into this instance (DLMix).")
        self.transfers = counter("vllm:dlmix_kv_transfers", "KV pulls finished, successful or not (DLMix).")
        self.failed = counter("vllm:dlmix_kv_failed_transfers", "KV pulls that failed (DLMix); vLLM recomputes.")
        hist = self._histogram_cls(name="vllm:dlmix_kv_transfer_seconds",
                                   documentation="Wall time of one DLMix KV pull incl. conversion.",
                                   buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
                                   labelnames=labelnames)
        self.seconds = create_metric_per_engine(hist, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        d = transfer_stats_data
        for s in d.get("transfer_s", []):
            self.seconds[engine_idx].observe(s)
        self.bytes[engine_idx].inc(sum(d.get("bytes_received", [])))
        self.tokens[engine_idx].inc(sum(d.get("tokens_loaded", [])))
        self.transfers[engine_idx].inc(len(d.get("transfer_s", [])))
        self.failed[engine_idx].inc(sum(d.get("failed", [])))
