"""Scheduler side of DLMixConnector (runs in vLLM's EngineCore): maps vLLM's request lifecycle onto the PD core.

P (``kv_producer``): :meth:`request_finished` keeps a finished ``do_remote_decode`` request's blocks and returns
:class:`dlmix.pd.contract.TransferParams` (plus vLLM's ``do_remote_*`` flags) as ``kv_transfer_params``; the hold
reaches the worker in the next step's metadata. D (``kv_consumer``): :func:`dlmix.pd.consumer.claim` decides per
request what to load (contract, pair, prompt digest, local prefix hit); the result becomes a worker job. Also runs
the router client. No transfer logic here: it is in :mod:`dlmix.pd`.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from dlmix.pd.consumer import claim
from dlmix.pd.contract import ContractError, TransferParams, decode_params, prompt_digest
from dlmix.pd.producer import MAX_CONSUMERS

from .config import DLMixSettings
from .layout import describe_engine, layout_of
from .metadata import DLMixConnectorMetadata, DLMixHandshake, DLMixWorkerMetadata, RecvJob, ReleaseJob

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger("dlmix_vllm.scheduler")

__all__ = ["DLMixConnectorScheduler"]

ENGINE = "vllm"


def consumers_of(params: dict[str, Any]) -> int:
    """Pulls a producer hold must wait for: ``kv_transfer_params["dlmix_consumers"]`` of a decode request (the
    router's decode leg sets it to the client's ``n``: vLLM fans the request out into ``n`` choices, each pulling
    the one hold, and each ``want`` carries the count to the producer, which may be of another engine and know no
    ``n``) or of a prefill request (a client that asks a producer for it directly). 1 when absent; a value that is
    not an integer 1..MAX_CONSUMERS is ignored (1) with a warning, so the hold is released after the first pull."""
    v = params.get("dlmix_consumers", 1)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_CONSUMERS:
        log.warning("DLMixConnector: ignoring dlmix_consumers=%r (want an integer 1..%d)", v, MAX_CONSUMERS)
        return 1
    return v


def _token_ids(request: Any, n: int | None = None) -> list[int] | None:
    ids = getattr(request, "prompt_token_ids", None)
    if ids is None:
        return None
    ids = list(ids)
    return ids if n is None else ids[:n]


class DLMixConnectorScheduler:
    """Scheduler-side state of one DLMixConnector (see module doc).

    Args: vllm_config, kv_cache_config: vLLM's; settings: validated :class:`DLMixSettings`; engine_id: this
    instance's id; kv_cache_manager: a callable returning vLLM's KV cache manager (or None) for load reports.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: DLMixSettings, engine_id: str,
                 kv_cache_manager: Any = None):
        self.vllm_config = vllm_config
        self.ktc = vllm_config.kv_transfer_config
        self.settings = settings
        self.engine_id = engine_id
        self._mgr = kv_cache_manager
        self.layout = describe_engine(vllm_config, kv_cache_config, tp_rank=0)
        self.layout_dict = self.layout.to_dict()
        self._lock = threading.Lock()
        self._meta = DLMixConnectorMetadata()
        self._info: dict[str, dict[str, Any]] = {}
        self._transports: dict[int, dict[str, Any]] = {}
        self._waiting: set[str] = set()
        self._running: set[str] = set()
        self._num_held = 0
        if self.ktc.is_kv_consumer and self.ktc.kv_load_failure_policy != settings.load_failure_policy:
            log.info("DLMixConnector: setting kv_load_failure_policy=%s (was %s)",
                     settings.load_failure_policy, self.ktc.kv_load_failure_policy)
            self.ktc.kv_load_failure_policy = settings.load_failure_policy
        self.router = None
        if settings.router_url:
            from .router_client import RouterClient

            self.router = RouterClient(settings, vllm_config, self.layout_dict, self._transports,
                                       self._load_snapshot)
            self.router.start()
        log.info("DLMixConnector scheduler side: role=%s engine=%s block_size=%d dtype=%s", self.ktc.kv_role,
                 engine_id, self.layout.block_size, self.layout.dtype)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Receive each worker's transport descriptor (keyed by TP rank) once, after KV cache registration."""
        for rank, m in metadata.items():
            if isinstance(m, DLMixHandshake):
                self._transports[int(rank)] = dict(m.transport)
                if int(rank) == 0 and m.layout:
                    self._adopt_worker_layout(m.layout)
        log.info("DLMixConnector: worker transports %s",
                 {r: f"{d.get('kind')}://{d.get('host')}:{d.get('port')}" for r, d in self._transports.items()})

    def _adopt_worker_layout(self, d: dict[str, Any]) -> None:
        """Take the layout rank 0's worker read from its registered tensors and attention layers (arrangement, fp8
        scales: the scheduler side sees neither); the parameters and the router registration then name the cache as
        it really is."""
        try:
            worker = layout_of(d).with_rank(0)
        except ValueError as e:
            log.error("DLMixConnector: worker sent a malformed layout: %s", e)
            return
        if worker != self.layout:
            log.info("DLMixConnector: KV cache arrangement %s, fp8 scales %s/%s (from the workers)", worker.arrangement,
                     worker.k_scale, worker.v_scale)
            self.layout = worker
            self.layout_dict.clear()
            self.layout_dict.update(worker.to_dict())  # shared with the router client

    def _load_snapshot(self) -> dict[str, Any]:
        usage = None
        mgr = self._mgr() if callable(self._mgr) else None
        if mgr is not None:
            try:
                usage = float(mgr.usage)
            except Exception:
                usage = None
        return {"waiting": len(self._waiting), "running": len(self._running), "held_requests": self._num_held,
                "kv_usage": usage}

    def on_new_request(self, request: "Request") -> None:
        self._waiting.add(request.request_id)

    def _claim(self, request: "Request", local_hit: int):
        return claim(request.kv_transfer_params, self.layout, request.num_prompt_tokens, local_hit,
                     prompt_token_ids=_token_ids(request), verify_weights=self.settings.verify_weights)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens D will load from P beyond its own ``num_computed_tokens`` (loaded asynchronously); 0 when not a
        remote-prefill request or when the claim is refused. Side-effect free."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        c = self._claim(request, num_computed_tokens)
        if c.refused is not None:
            return 0, False
        count = c.end - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        rid = request.request_id
        if rid in self._waiting:
            self._waiting.discard(rid)
            self._running.add(rid)
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        # n > 1 with the engine in process: vLLM's child requests share their parent's kv_transfer_params dict (a
        # shallow copy of the sampling params), so mark this request's own copy, not its siblings'
        params = request.kv_transfer_params = dict(params)
        params["do_remote_prefill"] = False
        params["_dlmix_consumer"] = True
        info = self._info.setdefault(rid, {})
        c = self._claim(request, 0)
        p = c.params
        if p is None:
            info["refused"] = f"invalid kv_transfer_params: {c.refused}"
            log.warning("DLMixConnector: %s: %s", rid, info["refused"])
            return
        release = ReleaseJob(list(p.transports), p.request_id, consumed=False)
        if c.refused is not None:
            log.warning("DLMixConnector: refusing KV of %s from prefill (%s): %s", rid, p.layout.get("engine"),
                        c.refused)
            info.update(refused=c.refused, local_hit_tokens=0, loaded_tokens=0, bytes_received=0)
            with self._lock:
                self._meta.releases.append(release)
            return
        end = c.end
        if num_external_tokens <= 0:
            info.update(local_hit_tokens=end, loaded_tokens=0, bytes_received=0)
            with self._lock:
                self._meta.releases.append(release)
            return
        start = end - num_external_tokens
        info.update(local_hit_tokens=start, loaded_tokens=num_external_tokens, prompt_tokens=request.num_prompt_tokens)
        # the producer's gate compares this prompt's digest with its hold's, also when the parameters carry none
        # (a router that built them from another engine's answer cannot know the producer's token ids)
        ids = _token_ids(request, p.num_tokens)
        mine = prompt_digest(ids) if ids is not None and len(ids) == p.num_tokens else p.digest
        # n choices of one request each pull the one hold: the router names n (dlmix_consumers) when the producer
        # could not know it (a hold handed across engines), and the want tells the producer
        job = RecvJob(rid, list(blocks.get_block_ids()[0]), start, end, list(p.transports), p.request_id,
                      list(p.block_ids), src_layout=p.layout, digest=mine, consumers=consumers_of(params))
        with self._lock:
            self._meta.recvs.append(job)

    def build_connector_meta(self, scheduler_output: Any) -> DLMixConnectorMetadata:
        with self._lock:
            meta, self._meta = self._meta, DLMixConnectorMetadata()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
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
        # every way out: a kv_both request that pulled (do_remote_prefill) may also be held below (do_remote_decode)
        info = self._info.pop(rid, None)
        if not params:
            return False, None
        if params.get("do_remote_decode") and not self.ktc.is_kv_producer:
            # only a producer's worker reports finished_sending: a hold kept here would never be freed
            log.warning("DLMixConnector: %s asks for do_remote_decode on a %s instance; its blocks are not held",
                        rid, self.ktc.kv_role)
        elif params.get("do_remote_decode"):
            if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED) \
                    or not block_ids or not self._transports:
                if not self._transports:
                    log.error("DLMixConnector: no worker transport known (is this instance a kv_producer?); "
                              "request %s is not held", rid)
                return False, None
            num_tokens = int(request.num_computed_tokens)
            ids = _token_ids(request, num_tokens)
            try:
                tp = TransferParams.make(
                    engine=ENGINE, instance_id=self.engine_id,
                    transports=[self._transports[r] for r in sorted(self._transports)], request_id=rid,
                    block_ids=list(block_ids), num_tokens=num_tokens, layout=self.layout_dict,
                    digest=prompt_digest(ids) if ids is not None and len(ids) == num_tokens else None,
                    expiry_s=self.settings.hold_timeout_s)
            except ContractError as e:
                log.error("DLMixConnector: cannot describe the KV of %s (%s); not held", rid, e.reason)
                return False, None
            consumers = consumers_of(params)
            with self._lock:
                self._meta.holds[rid] = (list(block_ids), num_tokens)
                self._meta.digests[rid] = tp.digest
                if consumers > 1:
                    self._meta.consumers[rid] = consumers
            self._num_held += 1
            return True, {"do_remote_prefill": True, "do_remote_decode": False, **tp.to_dict()}
        if params.get("do_remote_prefill"):
            # Finished (aborted) before allocation: P still holds the blocks; let it free them now.
            params = request.kv_transfer_params = dict(params)  # this request's own copy (see above)
            params["do_remote_prefill"] = False
            try:
                p = decode_params(params)
            except ContractError:
                return False, None
            with self._lock:
                self._meta.releases.append(ReleaseJob(list(p.transports), p.request_id, consumed=False))
            self._info.pop(rid, None)
            return False, {"dlmix": {"refused": "request finished before its KV was loaded"}}
        if params.get("_dlmix_consumer"):
            return False, {"dlmix": info or {}}
        return False, None

    def shutdown(self) -> None:
        if self.router is not None:
            self.router.stop()
