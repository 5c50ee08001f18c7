"""Worker side of DLMixConnector (runs in every vLLM worker): hands vLLM's KV tensors and per-step metadata to the
PD core's endpoint (:class:`dlmix.pd.endpoint.KVEndpoint`) and reports results back in vLLM's terms
(``finished_sending``/``finished_recving``, blocks with load errors, stats). No hold/grant/pull/convert logic here.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from dlmix.pd.consumer import failed_blocks
from dlmix.pd.endpoint import DEFAULT_LOOPBACK_SECRET, KVEndpoint

from .config import DLMixSettings
from .layout import arrangement_for, attention_info, describe_engine, latent_layers, ordered_layers, physical_layers
from .metadata import DLMixConnectorMetadata, DLMixHandshake, DLMixWorkerMetadata, RecvJob, ReleaseJob

log = logging.getLogger("dlmix_vllm.worker")

#: seconds :meth:`DLMixConnectorWorker.shutdown` waits for cancelled and queued pulls to tell their prefills to drop
#: their holds (and for queued releases) before it closes the endpoint
SHUTDOWN_NOTICE_S = 5.0

__all__ = ["DLMixConnectorWorker"]


def dump_name(rid: str) -> str:
    """File name of request ``rid``'s debug dump in ``debug_dump_dir`` (characters outside ``[A-Za-z0-9._-]`` as
    ``_``)."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in rid) + ".safetensors"


class DLMixConnectorWorker:
    """Worker-side state of one DLMixConnector (see module doc).

    Args: vllm_config, kv_cache_config: vLLM's; settings: validated :class:`DLMixSettings`; engine_id: this
    instance's id.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: DLMixSettings, engine_id: str):
        from .stats import DLMixKVConnectorStats

        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.ktc = vllm_config.kv_transfer_config
        self.settings = settings
        self.engine_id = engine_id
        self.base_port = settings.port if settings.port is not None else 0
        self.secret = settings.shared_secret or DEFAULT_LOOPBACK_SECRET
        self.layers: list[torch.Tensor] = []
        self.layout = None
        self.endpoint: KVEndpoint | None = None
        # pulls overlap their connect and grant exchange (a silent prefill holds up only its own requests); the
        # core's consumer has them take turns in the staging region
        self.pool = ThreadPoolExecutor(max_workers=settings.pull_threads, thread_name_prefix="dlmix-kv-pull")
        self._wlock = threading.Lock()
        self._active: dict[str, threading.Event] = {}  # req_id -> cancel flag of a queued/running pull
        self._done_recv: set[str] = set()
        self._load_errors: set[int] = set()
        self._pending_errors: set[int] = set()
        self._records: dict[str, dict[str, Any]] = {}
        self._seen_finished: set[str] = set()
        self._sent_pending: set[str] = set()
        self.tp_rank = 0
        self._stats = DLMixKVConnectorStats()
        self._closing = False  # set by shutdown(): pulls still queued only tell their prefill to drop the hold

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe the registered cache, check it against the config and start this worker's endpoint (regions =
        the layers; plus staging on consumers)."""
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = int(get_tensor_model_parallel_rank())
        except Exception:
            self.tp_rank = 0
        order, self.layers = physical_layers([t for _, t in ordered_layers(kv_caches)])
        backend, scales = attention_info(self.vllm_config, list(kv_caches))
        arrangement = arrangement_for(backend, order)
        self.layout = describe_engine(self.vllm_config, self.kv_cache_config, tp_rank=self.tp_rank,
                                      arrangement=arrangement, scales=scales)
        if self.layout.model.attention == "mla":
            self.layers = latent_layers(self.layers)
        port = self.base_port + self.tp_rank if self.base_port else 0
        s = self.settings
        self.endpoint = KVEndpoint(
            s.transport, f"dlmix-{self.engine_id[:12]}-r{self.tp_rank}-{os.getpid()}", self.secret, s.host, port,
            self.layout, self.layers, s.staging_bytes if self.ktc.is_kv_consumer else 0,
            hold_timeout_s=s.hold_timeout_s, registration_wait_s=s.registration_wait_s,
            io_timeout_s=s.io_timeout_s, verify_weights=s.verify_weights, connect_timeout_s=s.connect_timeout_s)
        d = self.endpoint.descriptor()
        log.info("DLMixConnector worker rank %d: %d layers x %d blocks, %s %s block %d; transport %s://%s:%s",
                 self.tp_rank, len(self.layers), self.endpoint.producer.num_blocks, self.layout.arrangement,
                 self.layout.dtype, self.layout.block_size, d.get("kind"), d.get("host"), d.get("port"))

    def get_handshake_metadata(self) -> DLMixHandshake | None:
        if self.endpoint is None:
            return None
        return DLMixHandshake(transport=self.endpoint.descriptor(), layout=self.layout.to_dict())

    def bind_connector_metadata(self, meta: Any) -> None:
        if not isinstance(meta, DLMixConnectorMetadata) or self.endpoint is None:
            return
        for rid, (block_ids, num_tokens) in meta.holds.items():
            if self.settings.debug_dump_dir:
                self._dump(rid, block_ids, num_tokens)
            self.endpoint.add_hold(rid, block_ids, num_tokens, getattr(meta, "digests", {}).get(rid),
                                   getattr(meta, "consumers", {}).get(rid, 1))
        for job in meta.recvs:
            ev = threading.Event()
            with self._wlock:
                self._active[job.req_id] = ev
            self.pool.submit(self._pull, job, ev)
        for rel in meta.releases:
            self.pool.submit(self._release, rel)

    def _release(self, rel: ReleaseJob) -> None:
        try:
            self.endpoint.release(list(rel.remote_transports), rel.remote_req_id, rel.consumed)
        except Exception as e:  # P may be gone: its hold timeout frees the blocks
            log.warning("DLMixConnector: release of %s failed: %s", rel.remote_req_id, e)

    def _pull(self, job: RecvJob, cancel: threading.Event) -> None:
        loaded = job.start
        bad: list[int] = []
        rec: dict[str, Any] = {}
        if self._closing:  # queued when the worker shut down: no transfer, the prefill drops its hold now
            self._release(ReleaseJob(list(job.remote_transports), job.remote_req_id, consumed=False))
            return
        try:
            remote = list(job.remote_transports)  # every prefill rank: the core picks the ranks this one reads
            res = self.endpoint.pull(remote, job.remote_req_id, job.remote_block_ids, job.start, job.end,
                                     job.local_block_ids, cancelled=cancel.is_set,
                                     src_layout=getattr(job, "src_layout", None), digest=getattr(job, "digest", None),
                                     consumers=getattr(job, "consumers", 1))
            loaded, bad = res.loaded_upto, res.failed_block_ids
            if self.settings.debug_dump_dir and res.error is None:
                self._dump(f"loaded-{job.req_id}", list(job.local_block_ids), job.end)
            rec = {"bytes_received": res.bytes_received, "transfer_s": round(res.seconds, 6),
                   "grant_s": round(res.grant_s, 6), "staging_wait_s": round(res.staging_wait_s, 6),
                   "rounds": res.rounds,
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
            bad = failed_blocks(self.layout.block_size, job.local_block_ids, loaded, job.end)
            log.exception("DLMixConnector: pull of %s crashed", job.req_id)
        rec["failed_blocks"] = len(bad)
        # what really arrived: the scheduler's claim set loaded_tokens to the tokens it asked for
        rec["loaded_tokens"] = max(0, loaded - job.start)
        if self.settings.stats_dir:
            self._append_stats({"req_id": job.req_id, "start": job.start, "end": job.end, "loaded_upto": loaded,
                                **rec})
        with self._wlock:
            self._stats.record(float(rec.get("transfer_s", 0.0)), int(rec.get("bytes_received", 0)),
                               loaded - job.start, rec.get("error") is not None)
            self._records[job.req_id] = rec
            self._pending_errors |= set(bad)
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
        """Debug: write a request's raw pages (held by a prefill, or loaded by a decode) exactly as stored,
        ``[L, nblocks, *page]`` (``vllm_cpu``: page ``[H, block_size, 2*D]``; ``mla``: ``[block_size, D]``), with
        the layout, to ``debug_dump_dir/<req_id>.safetensors``."""
        try:
            from safetensors.torch import save_file

            os.makedirs(self.settings.debug_dump_dir, exist_ok=True)
            idx = torch.as_tensor(block_ids, dtype=torch.long)
            pages = torch.stack([t.index_select(0, idx) for t in self.layers]).contiguous()
            save_file({"pages": pages}, os.path.join(self.settings.debug_dump_dir, dump_name(rid)),
                      metadata={"layout": self.layout.to_json(), "num_tokens": str(num_tokens),
                                "block_ids": json.dumps(block_ids), "req_id": rid})
        except Exception as e:
            log.warning("DLMixConnector: debug dump of %s failed: %s", rid, e)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Finished sends (holds consumed/aborted/expired) and finished receives (successful or not: failed blocks
        come from :meth:`get_block_ids_with_load_errors` in the same step). Cancels pulls of finished requests."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

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
        if self.endpoint is not None and self.ktc.is_kv_producer:
            self._seen_finished |= {r for r in finished_req_ids if self.endpoint.is_held(r)}
            self._sent_pending |= self.endpoint.take_finished()
            ready = {r for r in self._sent_pending if r in self._seen_finished}
            self._sent_pending -= ready
            self._seen_finished -= ready
            res.finished_sending = ready
        return res

    def get_kv_connector_stats(self) -> Any:
        """Pull observations since the last call (decode workers); None when there are none."""
        if self._stats.is_empty():
            return None
        with self._wlock:
            return self._stats.clone_and_reset()

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_connector_worker_meta(self) -> DLMixWorkerMetadata | None:
        with self._wlock:
            if not self._records:
                return None
            recs, self._records = self._records, {}
        return DLMixWorkerMetadata(recs)

    def shutdown(self) -> None:
        """Stop the worker (vLLM calls this when its engine shuts down) without leaving holds at the prefills.

        A running pull is cancelled: it stops at its next round and tells its prefill to drop the hold, as a failed
        pull does. A queued pull is not started; it only tells its prefill the same. Queued releases are still sent.
        Waits at most :data:`SHUTDOWN_NOTICE_S` seconds in all for those notices (a prefill that does not answer
        frees the hold at its ``hold_timeout_s``), then closes the endpoint. Idempotent."""
        self._closing = True
        with self._wlock:
            for ev in self._active.values():
                ev.set()
        if self.endpoint is not None:
            waiter = threading.Thread(target=self.pool.shutdown, kwargs={"wait": True}, daemon=True,
                                      name="dlmix-kv-shutdown")
            waiter.start()
            waiter.join(SHUTDOWN_NOTICE_S)
            self.endpoint.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
