"""DLMixConnector: vLLM v1 KV connector for heterogeneous prefill/decode (PD) disaggregation.

Roles: ``kv_producer`` (prefill, P), ``kv_consumer`` (decode, D), ``kv_both``. Flow of one request:

1. Client -> P with ``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``. When it finishes,
   P's scheduler-side :meth:`request_finished` keeps the blocks (``delay_free=True``) and returns
   ``kv_transfer_params``: ``do_remote_prefill``, ``remote_transports`` (one ``dlmix_kv_connectors`` transport
   descriptor per TP rank: kind, name, host, port, regions; learnt from the workers' handshake metadata),
   ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``, ``remote_num_tokens``, ``remote_layout``
   (``dlmix.kv.KVLayout`` dict), ``remote_expiry_s``. The P worker learns of the hold in the next step's metadata
   and serves it (:class:`~dlmix_vllm.transfer.KVEndpoint`: grants, one-sided reads, notifications).
2. Client -> D with the same request plus those params. D's :meth:`get_num_new_matched_tokens` checks the pair
   (descriptor compatibility incl. the weights fingerprint; a refused pair is recomputed locally and the reason is
   returned in D's response under ``kv_transfer_params.dlmix.refused``) and claims only the tokens beyond D's own
   prefix-cache hit (``num_computed_tokens``), asynchronously. D's worker pulls exactly those tokens from P in
   chunks bounded by ``staging_bytes`` and converts them into its own blocks (block size, dtype), then tells P
   ``release(consumed)``; P reports ``finished_sending`` and frees. Blocks that could not be loaded are reported by
   :meth:`get_block_ids_with_load_errors` so vLLM recomputes them (``kv_load_failure_policy=recompute`` is set on
   consumers unless the settings say ``load_failure_policy: fail``).
3. D's response carries ``kv_transfer_params.dlmix``: ``local_hit_tokens``, ``loaded_tokens``, ``bytes_received``,
   ``transfer_s``, ``chunks``, ``peak_staging_bytes``, ``error``/``refused`` (the per-request transfer record).

Block lifetime. P frees a hold when D releases it, or after ``hold_timeout_s`` unless a read is in progress (a read
extends the deadline). A P request aborted before it finishes holds nothing. On D, vLLM itself delays freeing a
request aborted while ``WAITING_FOR_REMOTE_KVS`` until the worker reports it finished receiving; the worker stops
the pull at the next chunk boundary and reports it, so freed blocks are never written. A D request aborted before
allocation sends P a release so P frees at once.

Only one KV cache group (plain attention models) and equal TP sizes on both sides are supported; others are refused
with reasons.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
from .layout import check_pair, check_registered, describe_engine, ordered_layers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("dlmix_vllm.connector")

__all__ = ["DLMixConnector", "DLMixConnectorMetadata", "DLMixWorkerMetadata"]

_REMOTE_KEYS = ("remote_transports", "remote_request_id", "remote_block_ids", "remote_num_tokens", "remote_layout")


@dataclass
class DLMixHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: the worker's transport descriptor and KV layout (JSON-able dicts)."""

    transport: dict[str, Any]
    layout: dict[str, Any]


@dataclass
class RecvJob:
    """Decode-side load of tokens ``[start, end)`` of a remote request into local blocks (token order)."""

    req_id: str
    local_block_ids: list[int]
    start: int
    end: int
    remote_transports: list[dict[str, Any]]
    remote_req_id: str
    remote_block_ids: list[int]


@dataclass
class ReleaseJob:
    """Decode-side notice to a prefill worker that a held request may be freed (nothing or all consumed)."""

    remote_transports: list[dict[str, Any]]
    remote_req_id: str
    consumed: bool


class DLMixConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per step. ``holds``: req_id -> (block_ids, num_tokens) newly held on P;
    ``recvs``/``releases``: jobs for D's worker. Plain containers (pickled by vLLM)."""

    def __init__(self) -> None:
        self.holds: dict[str, tuple[list[int], int]] = {}
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
                a["error"] = a.get("error") or rec.get("error")
                out[rid] = a
            else:
                out[rid] = rec
        return DLMixWorkerMetadata(out)


class DLMixConnector(KVConnectorBase_V1):
    """KV connector moving (and converting) prefill KV into a decode instance; see the module docstring.

    Constructed by vLLM as ``DLMixConnector(vllm_config, role, kv_cache_config)`` in the scheduler (EngineCore)
    and in every worker. Raises :class:`~dlmix_vllm.config.DLMixConfigError` on invalid settings.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.settings: DLMixSettings = parse_settings(ktc.kv_connector_extra_config)
        self.engine_id = str(ktc.engine_id)
        self.base_port = self.settings.port if self.settings.port is not None else 0
        from .transfer import DEFAULT_LOOPBACK_SECRET

        self.secret = self.settings.shared_secret or DEFAULT_LOOPBACK_SECRET
        if kv_cache_config is not None and len(getattr(kv_cache_config, "kv_cache_groups", []) or []) > 1:
            raise DLMixConfigError("DLMixConnector supports one KV cache group (plain attention models) only")
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # ------------------------------------------------------------------ scheduler side
    def _init_scheduler(self) -> None:
        ktc = self._kv_transfer_config
        self.layout = describe_engine(self._vllm_config, self._kv_cache_config, tp_rank=0)
        self.layout_dict = self.layout.to_dict()
        self._lock = threading.Lock()
        self._meta = DLMixConnectorMetadata()
        self._compat: dict[str, list[str]] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._transports: dict[int, dict[str, Any]] = {}
        self._waiting: set[str] = set()
        self._running: set[str] = set()
        self._num_held = 0
        if ktc.is_kv_consumer and ktc.kv_load_failure_policy != self.settings.load_failure_policy:
            log.info("DLMixConnector: setting kv_load_failure_policy=%s (was %s)",
                     self.settings.load_failure_policy, ktc.kv_load_failure_policy)
            ktc.kv_load_failure_policy = self.settings.load_failure_policy
        self.router = None
        if self.settings.router_url:
            from .router_client import RouterClient

            self.router = RouterClient(self.settings, self._vllm_config, self.layout_dict, self._transports,
                                       self._load_snapshot)
            self.router.start()
        log.info("DLMixConnector scheduler side: role=%s engine=%s block_size=%d dtype=%s", ktc.kv_role,
                 self.engine_id, self.layout.block_size, self.layout.dtype)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Receive each worker's transport descriptor (keyed by TP rank) once, after KV cache registration."""
        for rank, m in metadata.items():
            if isinstance(m, DLMixHandshake):
                self._transports[int(rank)] = dict(m.transport)
        log.info("DLMixConnector: worker transports %s",
                 {r: f"{d.get('kind')}://{d.get('host')}:{d.get('port')}" for r, d in self._transports.items()})

    def _load_snapshot(self) -> dict[str, Any]:
        usage = None
        mgr = self._kv_cache_manager
        if mgr is not None:
            try:
                usage = float(mgr.usage)
            except Exception:
                usage = None
        return {"waiting": len(self._waiting), "running": len(self._running), "held_requests": self._num_held,
                "kv_usage": usage}

    def _pair_reasons(self, remote_layout: dict[str, Any]) -> list[str]:
        key = json.dumps(remote_layout, sort_keys=True)
        r = self._compat.get(key)
        if r is None:
            r = check_pair(remote_layout, self.layout, verify_weights=self.settings.verify_weights)
            self._compat[key] = r
            if r:
                log.warning("DLMixConnector: refusing KV from prefill (%s): %s", remote_layout.get("engine"),
                            "; ".join(r))
        return r

    @staticmethod
    def _remote_params_ok(params: dict[str, Any]) -> bool:
        return all(params.get(k) is not None for k in _REMOTE_KEYS) and bool(params.get("remote_transports"))

    def on_new_request(self, request: "Request") -> None:
        self._waiting.add(request.request_id)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens D will load from P beyond its own ``num_computed_tokens`` (loaded asynchronously); 0 when not a
        remote-prefill request, when the params are incomplete, or when the pair is refused. Side-effect free."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not self._remote_params_ok(params):
            return 0, False
        if self._pair_reasons(params["remote_layout"]):
            return 0, False
        end = min(int(params["remote_num_tokens"]), request.num_prompt_tokens)
        count = end - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        rid = request.request_id
        if rid in self._waiting:
            self._waiting.discard(rid)
            self._running.add(rid)
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False
        params["_dlmix_consumer"] = True
        info = self._info.setdefault(rid, {})
        if not self._remote_params_ok(params):
            info["refused"] = "incomplete kv_transfer_params (need " + ", ".join(_REMOTE_KEYS) + ")"
            return
        release = ReleaseJob(list(params["remote_transports"]), str(params["remote_request_id"]), consumed=False)
        reasons = self._pair_reasons(params["remote_layout"])
        end = min(int(params["remote_num_tokens"]), request.num_prompt_tokens)
        if reasons:
            info.update(refused="; ".join(reasons), local_hit_tokens=0, loaded_tokens=0, bytes_received=0)
            with self._lock:
                self._meta.releases.append(release)
            return
        if num_external_tokens <= 0:
            info.update(local_hit_tokens=end, loaded_tokens=0, bytes_received=0)
            with self._lock:
                self._meta.releases.append(release)
            return
        start = end - num_external_tokens
        info.update(local_hit_tokens=start, loaded_tokens=num_external_tokens, prompt_tokens=request.num_prompt_tokens)
        job = RecvJob(rid, list(blocks.get_block_ids()[0]), start, end, list(params["remote_transports"]),
                      str(params["remote_request_id"]), [int(b) for b in params["remote_block_ids"]])
        with self._lock:
            self._meta.recvs.append(job)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        with self._lock:
            meta, self._meta = self._meta, DLMixConnectorMetadata()
        return meta

    def update_connector_output(self, connector_output) -> None:
        self._num_held = max(0, self._num_held - len(connector_output.finished_sending or ()))
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, DLMixWorkerMetadata):
            for rid, rec in wm.transfers.items():
                if rid in self._info:
                    self._info[rid].update(rec)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """P: keep the blocks of a length-capped/stopped ``do_remote_decode`` request and return the params D needs.
        D: return the transfer record. Aborted/failed P requests hold nothing."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        rid = request.request_id
        self._waiting.discard(rid)
        self._running.discard(rid)
        if not params:
            return False, None
        if params.get("do_remote_decode"):
            if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED) \
                    or not block_ids or not self._transports:
                if not self._transports:
                    log.error("DLMixConnector: no worker transport known (is this instance a kv_producer?); "
                              "request %s is not held", rid)
                return False, None
            num_tokens = int(request.num_computed_tokens)
            with self._lock:
                self._meta.holds[rid] = (list(block_ids), num_tokens)
            self._num_held += 1
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_request_id": rid,
                "remote_transports": [self._transports[r] for r in sorted(self._transports)],
                "remote_block_ids": list(block_ids),
                "remote_num_tokens": num_tokens,
                "remote_layout": self.layout_dict,
                "remote_expiry_s": self.settings.hold_timeout_s,
                "transfer_mode": "dlmix-pull",
            }
        if params.get("do_remote_prefill") and self._remote_params_ok(params):
            # Finished (aborted) before allocation: P still holds the blocks; let it free them now.
            params["do_remote_prefill"] = False
            with self._lock:
                self._meta.releases.append(ReleaseJob(list(params["remote_transports"]),
                                                      str(params["remote_request_id"]), consumed=False))
            self._info.pop(rid, None)
            return False, {"dlmix": {"refused": "request finished before its KV was loaded"}}
        if params.get("_dlmix_consumer"):
            return False, {"dlmix": self._info.pop(rid, {})}
        return False, None

    def shutdown(self):
        if getattr(self, "router", None) is not None:
            self.router.stop()
        if getattr(self, "endpoint", None) is not None:
            self.endpoint.close()
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ worker side
    def _init_worker(self) -> None:
        self.layers: list[torch.Tensor] = []
        self.layout = None
        self.endpoint = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlmix-kv-pull")
        self._wlock = threading.Lock()
        self._active: dict[str, threading.Event] = {}  # req_id -> cancel flag of a queued/running pull
        self._done_recv: set[str] = set()
        self._load_errors: set[int] = set()
        self._pending_errors: set[int] = set()
        self._records: dict[str, dict[str, Any]] = {}
        self._seen_finished: set[str] = set()
        self._sent_pending: set[str] = set()
        self.tp_rank = 0
        from .stats import DLMixKVConnectorStats

        self._stats = DLMixKVConnectorStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Describe the registered cache (``[num_blocks, H, block_size, 2*D]`` per layer), check it against the
        config, and start this worker's transport endpoint (regions = the layers; plus staging on consumers)."""
        from .transfer import KVEndpoint

        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = int(get_tensor_model_parallel_rank())
        except Exception:
            self.tp_rank = 0
        self.layers = [t for _, t in ordered_layers(kv_caches)]
        self.layout = describe_engine(self._vllm_config, self._kv_cache_config, tp_rank=self.tp_rank)
        nb = check_registered(self.layers, self.layout)
        ktc = self._kv_transfer_config
        port = self.base_port + self.tp_rank if self.base_port else 0
        self.endpoint = KVEndpoint(
            self.settings.transport, f"dlmix-{self.engine_id[:12]}-r{self.tp_rank}-{os.getpid()}", self.secret,
            self.settings.host, port, self.layout, self.layers,
            self.settings.staging_bytes if ktc.is_kv_consumer else 0,
            hold_timeout_s=self.settings.hold_timeout_s, registration_wait_s=self.settings.registration_wait_s,
            io_timeout_s=self.settings.io_timeout_s, verify_weights=self.settings.verify_weights)
        d = self.endpoint.descriptor()
        log.info("DLMixConnector worker rank %d: %d layers x %d blocks, %s %s block %d; transport %s://%s:%s",
                 self.tp_rank, len(self.layers), nb, self.layout.arrangement, self.layout.dtype,
                 self.layout.block_size, d.get("kind"), d.get("host"), d.get("port"))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.endpoint is None:
            return None
        return DLMixHandshake(transport=self.endpoint.descriptor(), layout=self.layout.to_dict())

    def _remote_for_rank(self, transports: list[dict[str, Any]]) -> dict[str, Any]:
        if self.tp_rank >= len(transports):
            raise ValueError(f"prefill has {len(transports)} TP ranks, this worker is rank {self.tp_rank}")
        return transports[self.tp_rank]

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        if not isinstance(meta, DLMixConnectorMetadata) or self.endpoint is None:
            return
        for rid, (block_ids, num_tokens) in meta.holds.items():
            if self.settings.debug_dump_dir:
                self._dump(rid, block_ids, num_tokens)
            self.endpoint.add_hold(rid, block_ids, num_tokens)
        for job in meta.recvs:
            ev = threading.Event()
            with self._wlock:
                self._active[job.req_id] = ev
            self.pool.submit(self._pull, job, ev)
        for rel in meta.releases:
            self.pool.submit(self._release, rel)

    def _release(self, rel: ReleaseJob) -> None:
        try:
            self.endpoint.release(self._remote_for_rank(rel.remote_transports), rel.remote_req_id, rel.consumed)
        except Exception as e:  # P may be gone: its hold timeout frees the blocks
            log.warning("DLMixConnector: release of %s failed: %s", rel.remote_req_id, e)

    def _pull(self, job: RecvJob, cancel: threading.Event) -> None:
        loaded = job.start
        rec: dict[str, Any] = {}
        try:
            remote = self._remote_for_rank(job.remote_transports)
            res = self.endpoint.pull(remote, job.remote_req_id, job.remote_block_ids, job.start, job.end,
                                     job.local_block_ids, cancelled=cancel.is_set)
            loaded = res.loaded_upto
            rec = {"bytes_received": res.bytes_received, "transfer_s": round(res.seconds, 6), "rounds": res.rounds,
                   "peak_staging_bytes": res.peak_staging_bytes, "error": res.error}
            try:
                self.endpoint.release(remote, job.remote_req_id, consumed=res.error is None)
            except Exception as e:
                if res.error is None:
                    log.warning("DLMixConnector: consumed notice for %s failed: %s", job.req_id, e)
            if res.error is not None:
                log.warning("DLMixConnector: load of %s failed after %d/%d tokens: %s (vLLM recomputes the rest)",
                            job.req_id, loaded - job.start, job.end - job.start, res.error)
        except Exception as e:  # never let a pull kill the worker
            rec = {"error": f"{type(e).__name__}: {e}", "bytes_received": 0}
            log.exception("DLMixConnector: pull of %s crashed", job.req_id)
        bad: set[int] = set()
        if loaded < job.end:
            bs = self.layout.block_size
            bad = set(job.local_block_ids[loaded // bs:(job.end + bs - 1) // bs])
        rec["failed_blocks"] = len(bad)
        if self.settings.stats_dir:
            self._append_stats({"req_id": job.req_id, "start": job.start, "end": job.end, "loaded_upto": loaded,
                                **rec})
        with self._wlock:
            self._stats.record(float(rec.get("transfer_s", 0.0)), int(rec.get("bytes_received", 0)),
                               loaded - job.start, rec.get("error") is not None)
            self._records[job.req_id] = rec
            self._pending_errors |= bad
            self._done_recv.add(job.req_id)
            self._active.pop(job.req_id, None)

    def _append_stats(self, rec: dict[str, Any]) -> None:
        try:
            os.makedirs(self.settings.stats_dir, exist_ok=True)
            with open(os.path.join(self.settings.stats_dir, f"transfers-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            log.warning("DLMixConnector: cannot write stats: %s", e)

    def _dump(self, rid: str, block_ids: list[int], num_tokens: int) -> None:
        """Debug: write the held request's raw pages ``[L, nblocks, H, block_size, 2*D]`` exactly as stored, with
        the layout, to ``debug_dump_dir/<req_id>.safetensors``."""
        try:
            from safetensors.torch import save_file

            os.makedirs(self.settings.debug_dump_dir, exist_ok=True)
            idx = torch.as_tensor(block_ids, dtype=torch.long)
            pages = torch.stack([t.index_select(0, idx) for t in self.layers]).contiguous()
            safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in rid)
            save_file({"pages": pages}, os.path.join(self.settings.debug_dump_dir, f"{safe}.safetensors"),
                      metadata={"layout": self.layout.to_json(), "num_tokens": str(num_tokens),
                                "block_ids": json.dumps(block_ids), "req_id": rid})
        except Exception as e:
            log.warning("DLMixConnector: debug dump of %s failed: %s", rid, e)

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
        """Finished sends (holds consumed/aborted/expired) and finished receives (successful or not: failed blocks
        come from :meth:`get_block_ids_with_load_errors` in the same step). Cancels pulls of finished requests."""
        res = KVConnectorTransferResults()
        with self._wlock:
            for rid in finished_req_ids:
                ev = self._active.get(rid)
                if ev is not None:
                    ev.set()
            res.finished_recving = set(self._done_recv)
            self._done_recv.clear()
            self._load_errors = set(self._pending_errors)
            self._pending_errors.clear()
        if self.endpoint is not None and self._kv_transfer_config.is_kv_producer:
            self._seen_finished |= {r for r in finished_req_ids if self.endpoint.is_held(r)}
            self._sent_pending |= self.endpoint.take_finished()
            ready = {r for r in self._sent_pending if r in self._seen_finished}
            self._sent_pending -= ready
            self._seen_finished -= ready
            res.finished_sending = ready
        return res

    def get_kv_connector_stats(self):
        """Pull observations since the last call (decode workers); None when there are none."""
        st = getattr(self, "_stats", None)
        if st is None or st.is_empty():
            return None
        with self._wlock:
            return st.clone_and_reset()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        from .stats import DLMixKVConnectorStats

        return DLMixKVConnectorStats(data=data) if data is not None else DLMixKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from .stats import DLMixPromMetrics

        return DLMixPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        with self._wlock:
            if not self._records:
                return None
            recs, self._records = self._records, {}
        return DLMixWorkerMetadata(recs)
