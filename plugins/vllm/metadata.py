"""Metadata DLMixConnector passes between vLLM's processes (plain containers, pickled by vLLM): the worker's
start-up handshake, the scheduler -> worker per-step metadata, and the worker -> scheduler per-step records.
Split like vLLM's own NIXL connector package (``metadata``); no transfer logic here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["DLMixHandshake", "RecvJob", "ReleaseJob", "DLMixConnectorMetadata", "DLMixWorkerMetadata"]


@dataclass
class DLMixHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: the worker's transport descriptor and KV layout (JSON-able dicts)."""

    transport: dict[str, Any]
    layout: dict[str, Any]


@dataclass
class RecvJob:
    """Decode-side load of tokens ``[start, end)`` of a remote request into local blocks (token order).
    ``src_layout``: the producer's layout from the transfer parameters (None: asked once from the producer);
    ``digest``: this request's prompt digest (checked by the producer too); ``consumers``: pulls of the remote hold
    this instance makes (the request's ``n`` choices, each a request of its own here)."""

    req_id: str
    local_block_ids: list[int]
    start: int
    end: int
    remote_transports: list[dict[str, Any]]
    remote_req_id: str
    remote_block_ids: list[int]
    src_layout: dict[str, Any] | None = None
    digest: str | None = None
    consumers: int = 1


@dataclass
class ReleaseJob:
    """Decode-side notice to a prefill worker that a held request may be freed (nothing or all consumed)."""

    remote_transports: list[dict[str, Any]]
    remote_req_id: str
    consumed: bool


class DLMixConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per step. ``holds``: req_id -> (block_ids, num_tokens) newly held on P (``digests``:
    their prompt digests, ``consumers``: pulls expected when more than one); ``recvs``/``releases``: jobs for D's
    worker."""

    def __init__(self) -> None:
        self.holds: dict[str, tuple[list[int], int]] = {}
        self.digests: dict[str, str | None] = {}
        self.consumers: dict[str, int] = {}
        self.recvs: list[RecvJob] = []
        self.releases: list[ReleaseJob] = []


@dataclass
class DLMixWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: per-request transfer records of finished pulls (merged over workers)."""

    transfers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        assert isinstance(other, DLMixWorkerMetadata)
        out = dict(self.transfers)
        for rid, rec in other.transfers.items():
            if rid in out:
                a = dict(out[rid])
                for k in ("bytes_received", "rounds", "failed_blocks"):
                    a[k] = a.get(k, 0) + rec.get(k, 0)
                for k in ("transfer_s", "peak_staging_bytes"):
                    a[k] = max(a.get(k, 0), rec.get(k, 0))
                if "loaded_tokens" in a or "loaded_tokens" in rec:  # loaded only where every rank loaded
                    a["loaded_tokens"] = min(a.get("loaded_tokens", 0), rec.get("loaded_tokens", 0))
                a["error"] = a.get("error") or rec.get("error")
                out[rid] = a
            else:
                out[rid] = rec
        return DLMixWorkerMetadata(out)
