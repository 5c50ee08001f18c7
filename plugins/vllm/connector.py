"""DLMixConnector: vLLM v1 KV connector for heterogeneous prefill/decode (PD) disaggregation.

Roles: ``kv_producer`` (prefill, P), ``kv_consumer`` (decode, D), ``kv_both``. Flow of one request:

1. Client -> P with ``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``. When it finishes,
   P's scheduler-side :meth:`request_finished` keeps the blocks (``delay_free=True``) and returns
   ``kv_transfer_params``: ``do_remote_prefill``, ``remote_transports`` (one ``dlmix_kv_connectors`` transport
   descriptor per TP rank: kind, name, host, port, regions; learnt from the workers' handshake metadata),
   ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``, ``remote_num_tokens``, ``remote_layout``
   (``dlmix.kv.KVLayout`` dict), ``remote_expiry_s``. The P worker learns of the hold in the next step's metadata
   and serves it (:class:`dlmix.pd.endpoint.KVEndpoint`: grants, one-sided reads, notifications).
2. Client -> D with the same request plus those params. D's :meth:`get_num_new_matched_tokens` checks the pair
   (descriptor compatibility incl. the weights fingerprint; a refused pair is recomputed locally and the reason is
   returned in D's response under ``kv_transfer_params.dlmix.refused``) and claims only the tokens beyond D's own
   prefix-cache hit (``num_computed_tokens``), asynchronously. D's worker pulls exactly those tokens from P in
   rounds bounded by ``staging_bytes`` and converts them into its own blocks (block size, dtype), then tells P
   ``release(consumed)``; P reports ``finished_sending`` and frees. Blocks that could not be loaded are reported by
   :meth:`get_block_ids_with_load_errors` so vLLM recomputes them (``kv_load_failure_policy=recompute`` is set on
   consumers unless the settings say ``load_failure_policy: fail``).
3. D's response carries ``kv_transfer_params.dlmix``: ``local_hit_tokens``, ``loaded_tokens``, ``bytes_received``,
   ``prompt_tokens``, ``transfer_s``, ``rounds`` (staging rounds), ``peak_staging_bytes``, ``error``/``refused``
   (the per-request transfer record).

Block lifetime. P frees a hold when D releases it, or after ``hold_timeout_s`` unless a read is in progress (a read
extends the deadline). A P request aborted before it finishes holds nothing. On D, vLLM itself delays freeing a
request aborted while ``WAITING_FOR_REMOTE_KVS`` until the worker reports it finished receiving; the worker stops
the pull at the next chunk boundary and reports it, so freed blocks are never written. A D request aborted before
allocation sends P a release so P frees at once.

Only one KV cache group (plain attention models) is supported. The two sides may differ in TP size: each decode rank
reads the KV heads it needs from the prefill ranks that hold them (:mod:`dlmix.pd.consumer`).

Logging: the connector's loggers (``dlmix_vllm.*`` and the core's ``dlmix.*``) write through vLLM's own handler at
vLLM's level (``VLLM_LOGGING_LEVEL``), so their lines appear in the server's log like vLLM's.

Package layout (like vLLM's own NIXL connector): this module is the thin facade vLLM instantiates;
:mod:`dlmix_vllm.scheduler` (EngineCore side), :mod:`dlmix_vllm.worker` (worker side), :mod:`dlmix_vllm.metadata`
(what crosses processes). The transfer contract and the hold/grant/pull/convert logic are in :mod:`dlmix.pd`.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from .config import DLMixConfigError, DLMixSettings, parse_settings
from .metadata import DLMixConnectorMetadata, DLMixHandshake, DLMixWorkerMetadata, RecvJob, ReleaseJob

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from .scheduler import DLMixConnectorScheduler
    from .worker import DLMixConnectorWorker

log = logging.getLogger("dlmix_vllm.connector")



def log_like_vllm() -> None:
    """Send the ``dlmix_vllm`` and ``dlmix`` loggers' records to vLLM's handlers at vLLM's level (once per process;
    loggers that already have handlers, e.g. configured by an embedding application, are left alone). Without it
    their INFO lines are lost: vLLM configures only its own ``vllm`` logger."""
    vl = logging.getLogger("vllm")
    if not vl.handlers:
        return
    for name in ("dlmix_vllm", "dlmix"):
        lg = logging.getLogger(name)
        if lg.handlers:
            continue
        for h in vl.handlers:
            lg.addHandler(h)
        lg.setLevel(max(vl.getEffectiveLevel(), min(h.level for h in vl.handlers)))
        lg.propagate = False


__all__ = ["DLMixConnector", "log_like_vllm", "DLMixConnectorMetadata", "DLMixWorkerMetadata", "DLMixHandshake", "RecvJob",
           "ReleaseJob"]


class DLMixConnector(KVConnectorBase_V1):
    """KV connector moving (and converting) prefill KV into a decode instance; see the module docstring.

    Constructed by vLLM as ``DLMixConnector(vllm_config, role, kv_cache_config)`` in the scheduler (EngineCore)
    and in every worker; delegates to :class:`~dlmix_vllm.scheduler.DLMixConnectorScheduler` or
    :class:`~dlmix_vllm.worker.DLMixConnectorWorker`. Raises :class:`~dlmix_vllm.config.DLMixConfigError` on
    invalid settings.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        log_like_vllm()
        ktc = self._kv_transfer_config
        self.settings: DLMixSettings = parse_settings(ktc.kv_connector_extra_config)
        self.engine_id = str(ktc.engine_id)
        if kv_cache_config is not None and len(getattr(kv_cache_config, "kv_cache_groups", []) or []) > 1:
            raise DLMixConfigError("DLMixConnector supports one KV cache group (plain attention models) only")
        from .layout import pin_cpu_attn_isa

        pin_cpu_attn_isa()  # before vLLM builds its attention backends: the cache stays in the described layout
        self.connector_scheduler: "DLMixConnectorScheduler | None" = None
        self.connector_worker: "DLMixConnectorWorker | None" = None
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler import DLMixConnectorScheduler

            self.connector_scheduler = DLMixConnectorScheduler(
                vllm_config, kv_cache_config, self.settings, self.engine_id,
                lambda: getattr(self, "_kv_cache_manager", None))
        else:
            from .worker import DLMixConnectorWorker

            self.connector_worker = DLMixConnectorWorker(vllm_config, kv_cache_config, self.settings,
                                                         self.engine_id)

    @property
    def layout(self):
        """This rank's :class:`dlmix.kv.KVLayout` (None on a worker before its caches are registered)."""
        side = self.connector_scheduler or self.connector_worker
        return side.layout

    # ------------------------------------------------------------------ scheduler side
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.set_xfer_handshake_metadata(metadata)

    def on_new_request(self, request: "Request") -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def shutdown(self):
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.connector_worker.get_handshake_metadata() if self.connector_worker is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None:
            self.connector_worker.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Loads are started asynchronously from :meth:`bind_connector_metadata`; nothing to do here."""
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Async loads complete before vLLM schedules the request; no per-layer wait."""
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Prefill never pushes (decode reads granted blocks); nothing to save per layer."""
        return None

    def wait_for_save(self):
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.connector_worker is not None
        return self.connector_worker.get_transfer_results(finished_req_ids)

    def get_kv_connector_stats(self):
        """Pull observations since the last call (decode workers); None when there are none."""
        if self.connector_worker is None:
            return None
        return self.connector_worker.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        from .stats import DLMixKVConnectorStats

        return DLMixKVConnectorStats(data=data) if data is not None else DLMixKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from .stats import DLMixPromMetrics

        return DLMixPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        return self.connector_worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.connector_worker is None:
            return None
        return self.connector_worker.build_connector_worker_meta()
