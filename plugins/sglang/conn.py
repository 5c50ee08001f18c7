"""The SGLang transfer backend ``dlmix``: SGLang's PD flow (bootstrap server, rooms, prefill/decode queues,
``KVPoll`` states) on the engine-neutral PD core (:mod:`dlmix.pd`).

SGLang's own backends push: decode allocates pages, sends their ids to prefill, and prefill writes into them. dlmix's
core pulls, so this backend maps SGLang's states onto the core (one request = one bootstrap room; transfer id =
``str(room)``):

prefill (:class:`DLMixKVManager` in prefill mode, :class:`DLMixKVSender`)
  * decode's metadata for a room arrives (``DLMIX META``) -> ``WaitingForInput`` (SGLang then runs the prefill);
  * ``send(page_ids)`` per chunk accumulates pages and tokens; on the last chunk the pages become a core *hold*
    (``KVEndpoint.add_hold``) and decode gets ``DLMIX READY``: the transfer parameters (:class:`dlmix.pd.contract.
    TransferParams`, with this rank's layout and transport) and the request's aux row (first output token, ...);
    status ``Transferring``;
  * the core releases the hold (decode read it and said ``blocks_consumed``) -> ``Success``, SGLang frees the
    pages; released otherwise (decode aborted, hold expired, engine abort) -> ``Failed`` with the reason.

decode (:class:`DLMixKVManager` in decode mode, :class:`DLMixKVReceiver`)
  * at bootstrap (``try_ensure_parallel_info``) the prefill's layout is read from the bootstrap server
    (``GET /dlmix/layout``) and checked with :func:`dlmix.pd.pair.check_pair`: an incompatible pair fails each of its
    requests with the reasons instead of SGLang's own equal-page-size / equal-dtype checks, which dlmix relaxes
    (the bootstrap summary states no page size or dtype);
  * ``send_metadata(page_ids, aux_index)`` records the destination and tells prefill;
  * on ``DLMIX READY`` a worker thread runs :func:`dlmix.pd.consumer.claim` and ``KVEndpoint.pull_params`` (one-sided
    reads in bounded rounds, converted into this pool's page size, dtype and arrangement), writes the aux row,
    sets ``Success`` and releases the prefill's hold (``Failed`` with the reason on any error, hold aborted).

decode fed by another engine's prefill (vLLM, LMDeploy) through the dlmix router (:mod:`dlmix.router.rooms`)
  * the bootstrap address is the router's: its ``GET /dlmix/layout`` answers ``{"dlmix_router": true}``; the
    address then stands for a one-rank prefill of this side's attention-TP size (no SGLang topology is asked);
  * ``send_metadata`` records the destination and a worker thread asks the router for the room
    (``POST /dlmix/handoff`` with the ``router_admin_key`` if set, :class:`dlmix.pd.contract.RoomHandoff`: the hold's
    transfer parameters and the first token), pulls as above, and writes the metadata row itself: the first token
    in ``output_ids`` and the room in ``bootstrap_room`` (SGLang checks it), zeros elsewhere (no first-token
    logprobs or cached-token count).

Limits (refused with a reason): MLA pools, draft-model KV, extra state pools (Mamba/SWA/DSA), host destinations,
decode prefix reuse (run decode with ``--disable-radix-cache``), pools outside host memory.

Attention TP sizes may differ (SGLang's own rank mapping, ``CommonKVManager._resolve_rank_mapping``, decides which
prefill ranks each decode rank bootstraps with and tells): every prefill rank registers its dlmix transport with the
bootstrap server beside its layout, a decode rank reads them all at bootstrap (``GET /dlmix/layout``), and on the
first ``DLMIX READY`` of a room it pulls with every prefill rank's transport, so the core
(:meth:`dlmix.pd.consumer.Consumer.pull`) reads each of this rank's KV heads from a prefill rank that holds it and
releases every prefill rank's hold (a hold is freed once each decode rank released it); the room's further READYs
(one per prefill rank this rank bootstrapped with) are ignored.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np
import requests
from aiohttp import web
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    PrefillServerInfo,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_disagg, get_parallel

from dlmix.pd.consumer import claim
from dlmix.pd.contract import ContractError, TransferParams, decode_room_handoff
from dlmix.pd.endpoint import DEFAULT_LOOPBACK_SECRET, KVEndpoint
from dlmix.pd.pair import check_pair, layout_of

from .config import load_settings
from .frames import META, READY, REG, STATUS_TAG, TAG
from .handoff import HandoffRelay
from .layout import describe_pool, kv_dtype_name, model_config, pool_layers

log = logging.getLogger("dlmix_sglang.conn")

__all__ = ["DLMixKVManager", "DLMixKVSender", "DLMixKVReceiver", "DLMixKVBootstrapServer", "TAG"]

_REG, _META, _READY = REG, META, READY


@dataclasses.dataclass
class _DecodeTarget:
    """One decode rank waiting for a room (prefill side); field names as SGLang's ``_room_notify_targets`` reads."""

    endpoint: str
    dst_port: int
    aux_index: Optional[int]
    required_dst_info_num: int
    decode_prefix_len: int = 0
    is_dummy: bool = False


@dataclasses.dataclass
class _Pending:
    pages: list = dataclasses.field(default_factory=list)
    tokens: int = 0


class DLMixKVManager(CommonKVManager):
    """One SGLang rank's dlmix transfer manager (see module doc). Constructed by SGLang's scheduler with its
    ``KVArgs``; raises ValueError for pools this backend does not move and
    :class:`dlmix_sglang.config.DLMixSGLangConfigError` for bad settings."""

    kv_status_msg_tag = STATUS_TAG
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: Optional[bool] = False):
        if is_mla_backend:
            raise ValueError("the dlmix transfer backend does not move MLA KV pools yet")
        import sglang

        self.settings = s = load_settings()
        par = get_parallel()
        self.dlmix_tp_rank, self.dlmix_tp_size = int(par.attn_tp_rank), int(par.attn_tp_size)
        model_dtype = getattr(server_args, "dtype", None)
        if model_dtype in (None, "auto"):  # SGLang then runs the checkpoint's dtype
            model_dtype = model_config(str(server_args.model_path)).get("torch_dtype", "auto")
        kv_dtype = kv_dtype_name(args.kv_cache_dtype_str, model_dtype)
        self.layout = describe_pool(args, model_path=str(server_args.model_path), kv_dtype=kv_dtype,
                                    tp_rank=self.dlmix_tp_rank, tp_size=self.dlmix_tp_size,
                                    engine=f"sglang {sglang.__version__}")
        self.is_decode = disaggregation_mode == DisaggregationMode.DECODE
        port = s.port + self.dlmix_tp_rank if s.port else 0
        role = "d" if self.is_decode else "p"
        self.endpoint = KVEndpoint(
            s.transport, f"dlmix-sglang-{role}-r{self.dlmix_tp_rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            s.shared_secret or DEFAULT_LOOPBACK_SECRET, s.host, port, self.layout, pool_layers(args, self.layout),
            s.staging_bytes if self.is_decode else 0, hold_timeout_s=s.hold_timeout_s,
            registration_wait_s=s.registration_wait_s, io_timeout_s=s.io_timeout_s,
            verify_weights=s.verify_weights, connect_timeout_s=s.connect_timeout_s, on_released=None if self.is_decode else self._on_released)
        self.instance_id = f"sglang-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._pending: dict[int, _Pending] = {}
        self._dst: dict[int, tuple[list[int], Optional[int], str]] = {}
        #: rooms whose pull started (decode): a room's further READYs, one per prefill rank, are ignored
        self._pulled: dict[int, None] = {}
        #: decode: rooms whose pull may still write into their pages or aux row (their receivers report
        #: Transferring, not Failed, until it stopped: SGLang frees a Failed room's pages at once)
        self._pulling: dict[int, int] = {}
        #: guards ``_pulled`` and ``_pulling``: pulls run on ``pull_threads`` threads
        self._rooms_lock = threading.Lock()
        self.incompatible: dict[str, str] = {}
        #: bootstrap address -> the last error reaching it, while it has never answered (the reason a room aborted
        #: while still bootstrapping gives its client, instead of SGLang's bare "Aborted by AbortReq.")
        self.unreachable: dict[str, str] = {}
        #: decode: every rank's transport (rank order) of each prefill whose attention TP size differs from ours
        self.prefill_transports: dict[str, list[dict[str, Any]]] = {}
        #: bootstrap addresses that are dlmix routers handing off rooms of another engine's prefill
        self.handoff_sources: set[str] = set()
        # SGLang's MetadataBuffers.get_buf_infos order: bootstrap_room is the last buffer, before kv_checksum if on
        self._room_aux = len(args.aux_item_lens) - (
            2 if getattr(get_disagg(), "disaggregation_enable_kv_checksum", False) else 1)
        self.early_aborts: dict[int, str] = {}
        self.transfer_stats: list[dict[str, Any]] = []
        self._ctl = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlmix-sglang-ctl")
        self._stop = threading.Event()
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        d = self.endpoint.descriptor()
        log.info("dlmix transfer backend (%s) rank %d: %s page %d %s, %d layers; transport %s %s:%s",
                 "decode" if self.is_decode else "prefill", self.dlmix_tp_rank, self.layout.arrangement,
                 self.layout.block_size, self.layout.dtype, self.layout.model.num_layers, d.get("kind"),
                 d.get("host"), d.get("port"))
        if self.is_decode:
            # pulls overlap their connect and grant exchange (a silent prefill holds up only its own rooms); the
            # core's consumer has them take turns in the staging region
            self._pulls = ThreadPoolExecutor(max_workers=self.settings.pull_threads,
                                             thread_name_prefix="dlmix-sglang-pull")
            threading.Thread(target=self._guard(self._decode_listener), name="dlmix-sglang-dlisten",
                             daemon=True).start()
            # SGLang's own backends (Mooncake, NIXL, Mori) start it: it polls each known prefill's bootstrap
            # ``/health`` and, after SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE misses, forgets what this decode
            # cached about it (:meth:`_handle_node_failure`), so a prefill restarted at the same address (new rank
            # ports) is bootstrapped again instead of being sent every later room at its dead ports
            self._start_heartbeat_checker_thread()
        else:
            threading.Thread(target=self._guard(self._prefill_listener), name="dlmix-sglang-plisten",
                             daemon=True).start()
            threading.Thread(target=self._reaper, name="dlmix-sglang-reaper", daemon=True).start()

    # ------------------------------------------------------------------ bootstrap registration (prefill)
    def _register_topology_row(self, url: str, payload: dict) -> None:
        """SGLang's bootstrap registration, plus this rank's dlmix layout (read by decode's pair check) and transport
        descriptor (read by a decode of another attention-TP size, which pulls from every prefill rank)."""
        super()._register_topology_row(url, {**payload, "dlmix_layout": self.layout.to_dict(),
                                             "dlmix_transport": self.endpoint.descriptor()})

    def _guard(self, fn):
        def run():
            try:
                fn()
            except Exception:
                log.exception("dlmix transfer backend: %s died; requests on this rank will time out", fn.__name__)
                raise
        return run

    # ------------------------------------------------------------------ messages decode -> prefill
    def build_receiver_registration_message(self) -> list[bytes]:
        body = {"layout": self.layout.to_dict(), "aux_item_lens": [int(x) for x in self.kv_args.aux_item_lens],
                "engine_rank": int(self.kv_args.engine_rank)}
        return [TAG, _REG, self.local_ip.encode("ascii"), str(self.rank_port).encode("ascii"),
                json.dumps(body).encode()]

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int,
                                        kv_indices: Any, aux_index: Optional[int], state_indices: Optional[list],
                                        decode_prefix_len: Optional[int], is_dummy: bool,
                                        device_kv_indices: Any = None) -> list[bytes]:
        body = {"required_dst_info_num": int(required_dst_info_num or 1), "num_pages": int(len(kv_indices)),
                "aux_index": None if aux_index is None else int(aux_index),
                "decode_prefix_len": int(decode_prefix_len or 0), "is_dummy": bool(is_dummy),
                "peer": f"{self.local_ip}:{self.rank_port}:{self.kv_args.engine_rank}"}
        return [TAG, _META, str(int(bootstrap_room)).encode("ascii"), self.local_ip.encode("ascii"),
                str(self.rank_port).encode("ascii"), json.dumps(body).encode()]

    def _prefill_listener(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stop.is_set():
            msg = recv()
            if not msg:
                continue
            try:
                self._on_prefill_message(msg)
            except Exception as e:  # one bad message must not stop the listener
                log.warning("dlmix transfer backend: bad message from decode dropped: %s", e)

    def _on_prefill_message(self, msg: list[bytes]) -> None:
        if msg[0] == ABORT_TAG:
            n = AbortNotification.from_zmq(msg)
            if n is not None:
                self._abort_room(n.room, "Aborted by decode-side abort notification.")
            return
        if msg[0] != TAG or len(msg) < 2:
            log.warning("dlmix transfer backend: unexpected message %r dropped", msg[0][:20])
            return
        if msg[1] == _REG:
            body = json.loads(msg[4])
            n_remote = len(body.get("aux_item_lens", []))
            self.check_peer_aux_buffer_count(f"{msg[2].decode()}:{msg[3].decode()}", n_remote)
            return
        if msg[1] != _META:
            log.warning("dlmix transfer backend: unknown message %r dropped", msg[1][:20])
            return
        room = int(msg[2])
        body = json.loads(msg[5])
        target = _DecodeTarget(endpoint=msg[3].decode("ascii"), dst_port=int(msg[4]), aux_index=body["aux_index"],
                               required_dst_info_num=int(body["required_dst_info_num"]),
                               decode_prefix_len=int(body.get("decode_prefix_len", 0)),
                               is_dummy=bool(body.get("is_dummy", False)))
        infos = self.transfer_infos.setdefault(room, {})
        infos[body["peer"]] = target
        if len(infos) >= target.required_dst_info_num:
            self.req_to_decode_prefix_len[room] = target.decode_prefix_len
            self.update_status(room, KVPoll.WaitingForInput)

    def _abort_room(self, room: int, reason: str) -> None:
        """Prefill side: drop ``room`` (a hold already read from is freed by the core only after its reads)."""
        self._pending.pop(room, None)
        if self.endpoint.is_held(str(room)):
            self.record_failure(room, reason)
            self.endpoint.engine_abort(str(room))  # -> _on_released -> Failed
        elif room in self.request_status:
            if self.request_status.get(room) != KVPoll.Success:
                self.record_failure(room, reason)
                self.update_status(room, KVPoll.Failed)
        else:  # the abort overtook the prefill request: fail its sender when it is created
            self.early_aborts[room] = reason
            while len(self.early_aborts) > 10000:
                self.early_aborts.pop(next(iter(self.early_aborts)))

    # ------------------------------------------------------------------ prefill: chunks -> hold -> READY
    def add_transfer_request(self, bootstrap_room: int, kv_indices: Any, index_slice: slice, is_last_chunk: bool,
                             aux_index: Optional[int] = None, state_indices: Optional[list] = None,
                             num_kv_tokens: Optional[int] = None, **_: Any) -> None:
        """One chunk of a room's pages (``kv_indices``: SGLang page ids in token order, ``num_kv_tokens`` tokens).
        The last chunk turns all of them into a core hold and tells decode (see module doc)."""
        room = int(bootstrap_room)
        if room not in self.transfer_infos:
            return  # cleared or never bootstrapped
        p = self._pending.setdefault(room, _Pending())
        p.pages.extend(int(x) for x in np.asarray(kv_indices).reshape(-1))
        p.tokens += int(num_kv_tokens) if num_kv_tokens is not None else len(kv_indices) * self.layout.block_size
        if not is_last_chunk:
            return
        self._pending.pop(room, None)
        try:
            if any(x is not None and len(x) for x in (state_indices or [])):
                raise ValueError("extra state pools are not moved by the dlmix transfer backend")
            if self.req_to_decode_prefix_len.get(room, 0):
                raise ValueError("decode reuses a cached prefix, which the dlmix transfer backend does not support "
                                 "(start decode with --disable-radix-cache)")
            self.endpoint.add_hold(str(room), p.pages, p.tokens)
            desc = self.endpoint.descriptor()
            params = TransferParams.make(engine="sglang", instance_id=self.instance_id,
                                         transports=[desc] * self.dlmix_tp_size, request_id=str(room),
                                         block_ids=p.pages, num_tokens=p.tokens, layout=self.layout,
                                         expiry_s=self.settings.hold_timeout_s)
            aux = self._read_aux(aux_index)
            self.update_status(room, KVPoll.Transferring)
            frames = [TAG, _READY, str(room).encode("ascii"), json.dumps(params.to_dict()).encode(),
                      str(self._prefill_unique_rank()).encode("ascii"), *aux]
            for ip, port in self._room_notify_targets(room):
                self._send_multipart_locked(f"tcp://{ip}:{port}", frames)
        except Exception as e:
            log.warning("dlmix transfer backend: room %s failed on prefill: %s", room, e)
            if self.endpoint.is_held(str(room)):
                self.endpoint.engine_abort(str(room))
            self.conclude_failure(bootstrap_room=room, failure_reason=f"dlmix: {type(e).__name__}: {e}")

    def _read_aux(self, aux_index: Optional[int]) -> list[bytes]:
        if aux_index is None:
            return []
        return [ctypes.string_at(int(ptr) + int(aux_index) * int(n), int(n))
                for ptr, n in zip(self.kv_args.aux_data_ptrs, self.kv_args.aux_item_lens)]

    def _on_released(self, req_id: str, why: str) -> None:  # core thread, under its lock: hand off
        self._ctl.submit(self._released, int(req_id), why)

    def _released(self, room: int, why: str) -> None:
        if why == "consumed":
            self.update_status(room, KVPoll.Success)
        else:
            self.conclude_failure(bootstrap_room=room, failure_reason=f"dlmix: KV hold of room {room} ended: {why}")

    def _reaper(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.endpoint.take_finished()
            except Exception as e:
                log.warning("dlmix transfer backend: reaper: %s", e)

    # ------------------------------------------------------------------ decode: bootstrap check, READY -> pull
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's bootstrap (topology) plus dlmix's pair check against the prefill's layout. An incompatible
        prefill is remembered with the reasons; each of its requests then fails with them (:class:`DLMixKVReceiver`).
        """
        if bootstrap_addr in self.prefill_info_table:
            return True
        reason = None
        try:
            r = requests.get(f"http://{bootstrap_addr}/dlmix/layout", timeout=5)
            self.unreachable.pop(bootstrap_addr, None)  # it answers
            if r.status_code == 503:
                return False
            if r.status_code == 404:
                reason = (f"prefill at {bootstrap_addr} does not run the dlmix transfer backend "
                          "(--disaggregation-transfer-backend dlmix on both sides)")
            elif r.status_code != 200:
                return False
            else:
                body = r.json()
                if body.get("dlmix_router") is True:
                    return self._router_source(bootstrap_addr)
                layouts = body.get("layouts") or []
                transports = body.get("transports") or []
                if len(layouts) == self.dlmix_tp_size:
                    src = next((x for x in layouts if x.get("tp_rank") == self.dlmix_tp_rank), None)
                else:  # another attention-TP size: this rank pulls from every prefill rank (module doc)
                    src = layouts[0] if layouts else None
                    if len(transports) != len(layouts) or not all(isinstance(t, dict) for t in transports):
                        src, reason = None, (f"prefill at {bootstrap_addr} runs attention TP {len(layouts)} and "
                                             f"this decode {self.dlmix_tp_size}, but it states {len(transports)} "
                                             "rank transport(s) (a dlmix prefill older than this decode?)")
                if src is None:
                    reason = reason or (f"prefill at {bootstrap_addr} has no attention-TP rank {self.dlmix_tp_rank} "
                                        f"({len(layouts)} rank(s))")
                else:
                    reasons = check_pair(layout_of(src), self.layout, verify_weights=self.settings.verify_weights,
                                         src_name="prefill", dst_name="decode")
                    if reasons:
                        reason = "incompatible prefill/decode pair: " + "; ".join(reasons)
                    elif len(layouts) != self.dlmix_tp_size:
                        self.prefill_transports[bootstrap_addr] = [dict(t) for t in transports]
        except requests.RequestException as e:
            log.warning("dlmix transfer backend: bootstrap %s unreachable: %s", bootstrap_addr, e)
            if len(self.unreachable) < 1024 or bootstrap_addr in self.unreachable:
                self.unreachable[bootstrap_addr] = f"{type(e).__name__}: {e}"
            return False
        except (ValueError, ContractError) as e:
            reason = f"prefill at {bootstrap_addr} sent an invalid dlmix layout: {e}"
        if reason is not None:
            log.warning("dlmix transfer backend: refusing prefill %s: %s", bootstrap_addr, reason)
            self.incompatible[bootstrap_addr] = reason
        return super().try_ensure_parallel_info(bootstrap_addr)

    def _handle_node_failure(self, failed_bootstrap_addr: str) -> None:
        """SGLang's heartbeat checker lost the prefill at ``failed_bootstrap_addr``: SGLang drops its cached
        topology and rank addresses and fails the rooms in flight; dlmix also forgets its pair-check verdict and
        rank transports, so a prefill started again there (another model, other weights or the same) is checked
        anew when a request next names it. A dlmix router that hands off rooms is left alone: its ``/health`` answers
        503 while it has no healthy instance, and each of its rooms fails with the router's own answer anyway."""
        with self.connection_lock:
            if failed_bootstrap_addr in self.handoff_sources:
                self.heartbeat_failures.pop(failed_bootstrap_addr, None)
                return
            self.incompatible.pop(failed_bootstrap_addr, None)
            self.prefill_transports.pop(failed_bootstrap_addr, None)
        super()._handle_node_failure(failed_bootstrap_addr)

    def _router_source(self, bootstrap_addr: str) -> bool:
        """A dlmix router at ``bootstrap_addr`` hands off rooms of another engine's prefill (module doc): it stands
        for a one-rank prefill of this side's attention-TP size, each decode rank reading its own share."""
        info = PrefillServerInfo(attn_tp_size=self.attn_tp_size, attn_cp_size=1, dp_size=1, pp_size=1,
                                 page_size=None, kv_cache_dtype=None, follow_bootstrap_room=True,
                                 decode_allocation_policy=get_disagg().disaggregation_decode_allocation_policy)
        self._resolve_rank_mapping(info)
        self.handoff_sources.add(bootstrap_addr)
        self.prefill_info_table[bootstrap_addr] = info
        return True

    def fetch_and_pull(self, bootstrap_addr: str, room: int) -> None:
        """Decode side, a room of a router source: ask the router for the room's hand-off, then pull (worker
        thread)."""
        self._pulls.submit(self._fetch_and_pull, bootstrap_addr, int(room))

    def _fetch_and_pull(self, bootstrap_addr: str, room: int) -> None:
        try:
            key = self.settings.router_admin_key  # the route is the router's instance-facing API
            r = requests.post(f"http://{bootstrap_addr}/dlmix/handoff",
                              json={"room": room, "timeout_s": self.settings.io_timeout_s},
                              headers={"Authorization": f"Bearer {key}"} if key else None,
                              timeout=self.settings.io_timeout_s + 5)
        except requests.RequestException as e:
            self._fail(room, f"dlmix: router {bootstrap_addr} unreachable for room {room}: {e}")
            return
        if r.status_code != 200:
            self._fail(room, f"dlmix: router {bootstrap_addr} answered {r.status_code} for room {room}: "
                             f"{r.text[:300]}")
            return
        try:
            params, tok = decode_room_handoff(r.content)
        except ContractError as e:
            self._fail(room, f"dlmix: router {bootstrap_addr}: {e.reason}")
            return
        if tok is None:
            self._fail(room, f"dlmix: router {bootstrap_addr} sent no first token for room {room}")
            return
        lens = [int(n) for n in self.kv_args.aux_item_lens]
        aux = [bytearray(n) for n in lens]
        aux[0][:4] = int(tok).to_bytes(4, "little", signed=True)  # output_ids[0], int32
        aux[self._room_aux][:8] = int(room).to_bytes(8, "little")  # bootstrap_room[0], uint64
        self._pull(room, json.dumps(params.to_dict()).encode(), [bytes(a) for a in aux], whole_prompt=True)

    def register_destination(self, room: int, pages: Any, aux_index: Optional[int], bootstrap_addr: str = "") -> None:
        """Decode side: the pages (ids, token order) and aux row a room's KV and metadata go to, and the bootstrap
        address of its prefill."""
        self._dst[int(room)] = ([int(x) for x in np.asarray(pages).reshape(-1)], aux_index, bootstrap_addr)

    def drop_destination(self, room: int) -> None:
        """Decode side: the room is over; a pull still running stops before its next round."""
        self._dst.pop(int(room), None)

    def _decode_listener(self) -> None:
        while not self._stop.is_set():
            msg = self.server_socket.recv_multipart()
            try:
                if msg and msg[0] == TAG and len(msg) >= 5 and msg[1] == _READY:
                    self._pulls.submit(self._pull, int(msg[2]), msg[3], list(msg[5:]))
                    continue
                if self.handle_abort_ack_message(msg):
                    continue
                parsed = self.parse_kv_status_message(msg)
                if parsed is not None:
                    room, status, prank, reason = parsed
                    self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=prank,
                                              failure_reason=reason)
                    continue
                log.warning("dlmix transfer backend: unexpected message %r dropped", msg[0][:20] if msg else b"")
            except Exception as e:
                log.warning("dlmix transfer backend: bad message from prefill dropped: %s", e)

    def _fail(self, room: int, reason: str) -> None:
        log.warning("dlmix transfer backend: room %s failed on decode: %s", room, reason)
        if room not in self.request_status:  # cleared already: a record now would stay for ever
            return
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)

    def _release(self, params: Any, room: int, consumed: bool) -> None:
        try:
            # every prefill rank: with unequal TP sizes each decode rank releases each prefill rank (dlmix.pd.consumer);
            # the hold's own name (str(room) on an SGLang prefill, the request's on another engine's)
            self.endpoint.release(list(params.transports), params.request_id, consumed)
        except Exception as e:  # the prefill's hold timeout frees its pages then
            log.warning("dlmix transfer backend: cannot release room %s on prefill: %s", room, e)

    def _pull(self, room: int, raw_params: bytes, aux: list[bytes], whole_prompt: bool = False) -> None:
        """Load one room's KV into its decode pages, then its aux row; Success or Failed (with the reason).
        ``whole_prompt``: the hold must cover the prompt this side allocated pages for (up to its last page: a hold
        of another engine's prefill tokenized the prompt itself)."""
        t0 = time.perf_counter()
        dst = self._dst.get(room)
        if room in self._pulled:  # another prefill rank's READY of a room pulled from every rank (module doc)
            return
        try:
            params_d = json.loads(raw_params)
        except ValueError:
            self._fail(room, "dlmix: prefill sent unreadable transfer parameters")
            return
        ranks = self.prefill_transports.get(dst[2]) if dst is not None else None
        if ranks is not None and isinstance(params_d, dict):
            # the READY names its own rank's transport only: pull with every prefill rank's, in rank order
            params_d = {**params_d, "remote_transports": ranks}
            with self._rooms_lock:  # two prefill ranks' READYs of one room, on two pull threads: one pulls
                if room in self._pulled:
                    return
                self._pulled[room] = None
                while len(self._pulled) > 10000:
                    self._pulled.pop(next(iter(self._pulled)))
        c = claim(params_d, self.layout, 1 << 62, 0, verify_weights=self.settings.verify_weights,
                  tp_rank=self.dlmix_tp_rank)
        if dst is None or room not in self.request_status:
            if c.params is not None:
                self._release(c.params, room, consumed=False)
            return
        if c.refused:
            self._fail(room, f"dlmix: {c.refused}")
            if c.params is not None:
                self._release(c.params, room, consumed=False)
            return
        pages, aux_index, _addr = dst
        cap = len(pages) * self.layout.block_size
        if c.end > cap:
            self._fail(room, f"dlmix: prefill holds {c.end} tokens, decode allocated {len(pages)} pages "
                             f"({cap} tokens)")
            self._release(c.params, room, consumed=False)
            return
        if whole_prompt and c.end <= cap - self.layout.block_size:
            self._fail(room, f"dlmix: prefill holds {c.end} tokens, decode's prompt fills {len(pages)} pages of "
                             f"{self.layout.block_size} (the two engines tokenized the prompt differently?)")
            self._release(c.params, room, consumed=False)
            return
        with self._rooms_lock:
            self._pulling[room] = self._pulling.get(room, 0) + 1
        try:
            self._pull_into(room, c, pages, aux_index, aux, t0)
        finally:
            with self._rooms_lock:
                n = self._pulling.pop(room, 1) - 1
                if n > 0:
                    self._pulling[room] = n

    def _pull_into(self, room: int, c: Any, pages: list[int], aux_index: Optional[int], aux: list[bytes],
                   t0: float) -> None:
        res = self.endpoint.pull_params(c.params, c.start, c.end, pages, cancelled=lambda: room not in self._dst)
        if res.error is not None:
            self._fail(room, f"dlmix: KV transfer failed: {res.error}")
            self._release(c.params, room, consumed=False)
            return
        try:
            self._write_aux(aux_index, aux, layout_of(c.params.layout))
        except ValueError as e:
            self._fail(room, f"dlmix: {e}")
            self._release(c.params, room, consumed=False)
            return
        self.update_status(room, KVPoll.Success)
        self._release(c.params, room, consumed=True)
        rec = {"room": room, "tokens": c.end - c.start, "bytes": res.bytes_received, "rounds": res.rounds,
               "pull_s": res.seconds, "total_s": time.perf_counter() - t0,
               "src": f"{c.params.layout.get('arrangement')}/{c.params.layout.get('block_size')}/"
                      f"{c.params.layout.get('dtype')}"}
        self.transfer_stats.append(rec)
        del self.transfer_stats[:-1000]
        log.debug("dlmix transfer backend: %s", rec)

    def _write_aux(self, aux_index: Optional[int], aux: list[bytes], src: Any = None) -> None:
        """Copy the prefill's metadata row into this side's row ``aux_index``. A row whose size differs only by the
        model dtype (the hidden-states row of a bf16 prefill feeding an fp32 decode) is converted from the prefill's
        KV dtype to this side's; a different number of buffers, or any other size, raises ValueError."""
        if aux_index is None:
            return
        lens = [int(n) for n in self.kv_args.aux_item_lens]
        if len(aux) != len(lens):
            raise ValueError(f"prefill sent {len(aux)} metadata buffers, decode has {len(lens)} (an optional "
                             "metadata buffer is enabled on one side only)")
        import torch

        from dlmix.kv.ops import torch_dtype

        for ptr, n, data in zip(self.kv_args.aux_data_ptrs, lens, aux):
            if len(data) != n:
                sdt = torch_dtype(src) if src is not None else None
                ddt = torch_dtype(self.layout)
                esz = torch.empty((), dtype=sdt).element_size() if sdt is not None else 0
                dsz = torch.empty((), dtype=ddt).element_size()
                if not esz or len(data) % esz or (len(data) // esz) * dsz != n:
                    raise ValueError(f"prefill metadata row of {len(data)} B does not fit decode's {n} B")
                data = torch.frombuffer(bytearray(data), dtype=sdt).to(ddt).numpy().tobytes()
            ctypes.memmove(int(ptr) + int(aux_index) * n, data, n)


class DLMixKVSender(CommonKVSender):
    """Prefill side of one room (SGLang's sender contract; the work is :class:`DLMixKVManager`'s). Never claims host
    tensor indices (their pinned-memory/CUDA-event path needs an accelerator)."""

    supports_host_tensor_indices = False

    def __init__(self, mgr: DLMixKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        reason = mgr.early_aborts.pop(bootstrap_room, None)
        if reason is not None:  # decode refused or aborted this room before the prefill request arrived
            mgr.record_failure(bootstrap_room, reason)
            mgr.update_status(bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed

    def abort(self) -> None:
        """Aborted by SGLang: a hold a decode may be reading is freed only after its reads (status Failed then)."""
        room = self.bootstrap_room
        if self.kv_mgr.endpoint.is_held(str(room)):
            self.kv_mgr._abort_room(room, "Aborted by AbortReq.")
            return
        super().abort()

    def clear(self) -> None:
        room = self.bootstrap_room
        self.kv_mgr._pending.pop(room, None)
        if self.kv_mgr.endpoint.is_held(str(room)) and self.conclude_state != KVPoll.Success:
            self.kv_mgr.endpoint.engine_abort(str(room))
        elif self.conclude_state == KVPoll.Success:
            # an abort that came while (or after) decode read the hold recorded a reason but could not fail the room:
            # SGLang's Success path never pops it, and a later request of this room would inherit it
            with self.kv_mgr.failure_lock:
                self.kv_mgr.failure_records.pop(room, None)
        super().clear()


class DLMixKVReceiver(CommonKVReceiver):
    """Decode side of one room: SGLang's receiver contract plus the destination bookkeeping and the refusal of an
    incompatible prefill (with the reasons) at bootstrap."""

    def init(self, prefill_dp_rank: int) -> None:
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        if (self.bootstrap_addr in self.kv_mgr.handoff_sources and info is not None
                and self.conclude_state != KVPoll.Failed):  # a router's room: nothing to bootstrap (module doc)
            self.prefill_info, self.prefill_dp_rank = info, prefill_dp_rank
            self.target_tp_rank, self.target_tp_ranks = info.target_tp_rank, info.target_tp_ranks
            self.target_cp_ranks, self.target_pp_ranks = info.target_cp_ranks, info.target_pp_ranks
            self.required_dst_info_num = info.required_dst_info_num
            self.required_prefill_response_num = info.required_prefill_response_num
            self.kv_mgr.required_prefill_response_num_table[self.bootstrap_room] = info.required_prefill_response_num
            self.bootstrap_infos = []
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.WaitingForInput)
            return
        super().init(prefill_dp_rank)
        reason = self.kv_mgr.incompatible.get(self.bootstrap_addr)
        if reason is not None and self.conclude_state != KVPoll.Failed:
            self.kv_mgr.record_failure(self.bootstrap_room, f"dlmix: {reason}")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
            self.ensure_abort_notified()

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None, state_indices: Optional[list] = None,
                      decode_prefix_len: Optional[int] = None, *args: Any, **kwargs: Any) -> None:
        if self.conclude_state == KVPoll.Failed:
            return
        self.kv_mgr.register_destination(self.bootstrap_room, kv_indices, aux_index, self.bootstrap_addr)
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, *args, **kwargs)
        if self.bootstrap_addr in self.kv_mgr.handoff_sources:
            if decode_prefix_len:
                self.kv_mgr._fail(self.bootstrap_room, "dlmix: decode reuses a cached prefix, which the dlmix "
                                  "transfer backend does not support (start decode with --disable-radix-cache)")
                return
            self.kv_mgr.fetch_and_pull(self.bootstrap_addr, self.bootstrap_room)

    def poll(self) -> KVPoll:
        if self.bootstrap_room in self.kv_mgr._pulling:  # its pages are still being written: not free yet
            return KVPoll.Transferring
        return super().poll()

    def _clear(self) -> None:
        self.kv_mgr.drop_destination(self.bootstrap_room)
        super()._clear()

    def abort(self) -> None:
        """SGLang gives up on the room (its destination is dropped). While its prefill's bootstrap server has never
        been reached, the room fails with that reason (the address and the last connection error), which its client
        gets instead of SGLang's bare "Aborted by AbortReq."."""
        self.kv_mgr.drop_destination(self.bootstrap_room)
        why = self.kv_mgr.unreachable.get(self.bootstrap_addr)
        if why is not None and self.conclude_state != KVPoll.Failed \
                and self.bootstrap_addr not in self.kv_mgr.prefill_info_table:
            self.kv_mgr.record_failure(self.bootstrap_room, f"dlmix: the prefill's bootstrap server "
                                                            f"{self.bootstrap_addr} cannot be reached ({why})")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
        super().abort()


class DLMixKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server plus ``GET /dlmix/layout`` (each prefill rank's dlmix layout, from its
    registration) and ``POST /dlmix/handoff`` (a room's transfer parameters for a decode of another engine,
    :mod:`dlmix_sglang.handoff`). Its summary states no page size or KV dtype: dlmix converts them, and the decode checks the pair
    with the layouts instead."""

    def __init__(self, host: str, port: int):
        self.dlmix_layouts: dict[tuple[int, int, int, int], dict] = {}
        self.dlmix_transports: dict[tuple[int, int, int, int], dict] = {}
        self.dlmix_relay = HandoffRelay(key=load_settings().router_admin_key)
        super().__init__(host, port)

    def _setup_routes(self) -> None:
        super()._setup_routes()
        self.app.router.add_get("/dlmix/layout", self._handle_dlmix_layout)
        self.app.router.add_post("/dlmix/handoff", self._handle_dlmix_handoff)

    async def _handle_dlmix_handoff(self, request: web.Request):
        """A decode of another engine asks for a room's transfer parameters (:mod:`dlmix_sglang.handoff`)."""
        return await self.dlmix_relay.handle(self, request)

    async def _handle_route_put(self, request: web.Request):
        data = await request.json()
        resp = await super()._handle_route_put(request)
        if resp.status == 200:
            lay = data.get("dlmix_layout")
            if isinstance(lay, dict):
                key = (int(data.get("attn_dp_rank", 0)), int(data.get("attn_cp_rank", 0)),
                       int(data.get("attn_tp_rank", 0)), int(data.get("pp_rank", 0)))
                self.dlmix_layouts[key] = lay
                tr = data.get("dlmix_transport")
                if isinstance(tr, dict):
                    self.dlmix_transports[key] = tr
            self.page_size = None
            self.kv_cache_dtype = None
        return resp

    async def _handle_dlmix_layout(self, request: web.Request):
        if not self._is_ready():
            return web.Response(text="prefill not fully registered yet", status=503)
        keys = [k for k in sorted(self.dlmix_layouts) if k[0] == 0 and k[1] == 0 and k[3] == 0]
        return web.json_response({"layouts": [self.dlmix_layouts[k] for k in keys],
                                  "transports": [self.dlmix_transports.get(k) for k in keys]})
