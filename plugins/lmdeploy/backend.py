"""The LMDeploy migration backend ``DLMix``: LMDeploy's DistServe flow on the engine-neutral PD core
(:mod:`dlmix.pd`).

LMDeploy's DistServe: the proxy sends the prompt to a Prefill engine (``max_tokens=1``, ``preserve_cache``), which
answers its session id and cache block ids and keeps the blocks; the proxy connects the pair once
(``/distserve/p2p_initialize`` on both, then ``p2p_connect`` with each other's endpoint info), then sends the request
to the Decode engine with a ``migration_request``; the decode allocates blocks, migrates the KV into them, tells the
prefill to free the session (ZMQ), and decodes. Its in-tree backends copy byte ranges pairwise, so both sides must
have the same block size, dtype and pool shape.

With ``--migration-backend DLMix`` (this module plus the patches of :mod:`dlmix_lmdeploy.patches`):

* at start-up each rank describes its cache (:func:`dlmix_lmdeploy.layout.describe_cache`) and opens a
  :class:`dlmix.pd.endpoint.KVEndpoint` (staging only on a Decode rank); an unsupported cache stops the start with
  the reason;
* the endpoint info exchanged at connection time is the rank's transport descriptor and layout; ``p2p_connect`` runs
  :func:`dlmix.pd.pair.check_pair` (prefill layout as producer, decode layout as consumer) and refuses an incompatible
  pair with the reasons, instead of LMDeploy's equal-shape check (block size, dtype and arrangement may differ);
* a Prefill rank turns every finished prefill that keeps its cache into a core *hold* (its blocks, prompt length and
  prompt digest), under :func:`hold_key` of its block ids, and ends the engine session itself when the core releases
  the hold (consumed, aborted, expired);
* a Decode rank pulls each migrating request with :meth:`KVEndpoint.pull` (one-sided reads of exactly the held
  blocks, converted into its own block size, dtype and arrangement) and releases the hold; the prompt digest is
  checked, so a decode whose prompt tokens differ refuses instead of decoding from someone else's KV;
* the decode does not send LMDeploy's ZMQ free after a DLMix migration (its ``remote_session_id`` names the wrong
  session, see :func:`hold_key`); the core's ``blocks_consumed`` ends the hold instead. A free or abort that does
  reach the prefill (the proxy's ``free_cache``; the dlmix router's, naming the hold by
  :func:`dlmix.pd.contract.block_ids_session_alias` of its blocks) ends the hold; the session ends once no read can
  touch its blocks.

KV quantization (``--quant-policy`` 8 or 4: uint8 K/V or two 4-bit values a byte, and a scale and zero point per
token and head; :class:`dlmix_lmdeploy.layout.QuantCache`, :mod:`dlmix.kv.quant`) travels as fp32 values, so any
prefill feeds any decode: a quantized Decode rank receives each request into an fp32 shadow of its blocks and
quantizes it there with LMDeploy's own formula; a quantized Prefill rank dequantizes the blocks it holds into an fp32
copy of its pool (same block ids; the host backs only the pages written), which its decode reads. fp32 holds
LMDeploy's read of a quantized vector exactly, so a quantized prefill feeding a decode of the same quantization hands
over the integers, scales and zeros its own cache has, except where a zero point is large (|zero| >= 512 with fp16
scales: the fp16 zero point then moves by up to 0.25 when re-quantized, and an integer can move by one); every value
the decode reads is then still within one quantization step of the prefill's.

Limits (refused with a reason): TP size 1 per side with LMDeploy's single-process executor (the endpoint lives in the
process of the engine loop), fp8 and TurboQuant KV (``--quant-policy`` 16, 17, 42), MLA.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from lmdeploy.pytorch.disagg.backend.base import MigrationBackendImpl

from dlmix.kv.layout import KVLayout
from dlmix.pd.contract import block_ids_session_alias, block_ids_transfer_id, prompt_digest
from dlmix.pd.endpoint import DEFAULT_LOOPBACK_SECRET, KVEndpoint, PullResult
from dlmix.pd.pair import check_pair, layout_of

from .config import load_settings
from .layout import QuantCache, describe_cache, describe_quant_cache, quant_policy

log = logging.getLogger("dlmix_lmdeploy")

__all__ = ["NAME", "DLMixMigrationBackend", "Rank", "current", "start_rank"]

#: The name users select: ``--migration-backend DLMix`` / ``PytorchEngineConfig(migration_backend=...)``.
NAME = "DLMix"
#: Version of the endpoint-info object this backend exchanges at connection time.
INFO_VERSION = 1
#: Seconds between two looks at the holds the core released (prefill side).
POLL_S = 0.05


def hold_key(block_ids: list[int]) -> str:
    """The transfer id of a held prefill: :func:`dlmix.pd.contract.block_ids_transfer_id` of its cache block ids.

    Not the session id: LMDeploy 0.18's api_server answers the *user's* ``session_id`` (or ``-1`` for every request
    that has none) while the engine keys sessions by an internal counter (``serve/managers/session_manager.py``), so
    the ``remote_session_id`` a decode receives names no engine session. The block ids do, and both sides have them
    (the proxy forwards ``cache_block_ids`` as ``remote_block_ids``; the dlmix router builds a vLLM decode's
    ``kv_transfer_params`` from them)."""
    return block_ids_transfer_id(block_ids)


@dataclass
class Peer:
    """A connected remote engine: its transport descriptor and layout (from its endpoint info)."""

    transport: dict[str, Any]
    layout: KVLayout


@dataclass
class Rank:
    """This process's DLMix state: the engine role, the rank's layout, its endpoint and the connected peers."""

    role: str  # "Prefill" or "Decode"
    layout: KVLayout
    endpoint: KVEndpoint
    endpoint_settings: Any = None
    peers: dict[str, Peer] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    key_of: dict[int, str] = field(default_factory=dict)  # prefill: engine session id -> hold key
    session_of: dict[str, int] = field(default_factory=dict)  # prefill: hold key -> engine session id
    key_of_alias: dict[int, str] = field(default_factory=dict)  # prefill: block_ids_session_alias -> hold key
    alias_of: dict[str, int] = field(default_factory=dict)  # prefill: hold key -> its alias
    scheduler: Any = None
    _loop: Any = None
    quant: QuantCache | None = None  # --quant-policy 4/8: a decode quantizes on arrival, a prefill dequantizes holds
    export: list[Any] | None = None  # quantized prefill: the fp32 copy of its pool its decodes read
    # decode, touched on the engine's event loop only: sessions whose pull is writing their blocks, and the engine
    # stop/end requests for them held back until it is over (:meth:`defer`)
    pulling: set[int] = field(default_factory=set)
    deferred: dict[int, list[Any]] = field(default_factory=dict)

    # ------------------------------------------------------------------ connection
    def endpoint_info(self) -> dict[str, Any]:
        return {"dlmix": INFO_VERSION, "role": self.role, "transport": self.endpoint.descriptor(),
                "layout": self.layout.to_dict()}

    def connect(self, remote_engine_id: str, endpoint_info: str) -> None:
        """Check and remember a remote engine from its endpoint info (JSON text). Raises ValueError with the
        reasons when the info is not a DLMix endpoint or the pair is incompatible."""
        try:
            info = json.loads(endpoint_info)
        except (TypeError, ValueError) as e:
            raise ValueError(f"DLMix: endpoint info of {remote_engine_id} is not JSON: {e}") from None
        if not isinstance(info, dict) or info.get("dlmix") != INFO_VERSION:
            raise ValueError(f"DLMix: {remote_engine_id} is not a DLMix endpoint of version {INFO_VERSION} (did it "
                             "start with --migration-backend DLMix?)")
        try:
            remote = layout_of(info.get("layout"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"DLMix: layout of {remote_engine_id} is malformed: {e}") from None
        if not isinstance(info.get("transport"), dict):
            raise ValueError(f"DLMix: endpoint info of {remote_engine_id} has no transport descriptor")
        settings = self.endpoint_settings
        src, dst = (self.layout, remote) if self.role == "Prefill" else (remote, self.layout)
        reasons = check_pair(src, dst, verify_weights=settings.verify_weights)
        if reasons:
            raise ValueError(f"DLMix: prefill {('this engine' if self.role == 'Prefill' else remote_engine_id)} "
                             f"cannot feed decode {(remote_engine_id if self.role == 'Prefill' else 'this engine')}: "
                             + "; ".join(reasons))
        with self.lock:
            self.peers[remote_engine_id] = Peer(info["transport"], remote)
        log.info("DLMix: connected %s (%s, block %d, %s, %s)", remote_engine_id, info.get("role"),
                 remote.block_size, remote.dtype, remote.arrangement)

    # ------------------------------------------------------------------ prefill side
    def hold(self, scheduler: Any, session_id: int, block_ids: list[int], token_ids: list[int]) -> None:
        """Keep a finished prefill's blocks for its decode under :func:`hold_key` of its block ids (idempotent per
        session). The engine's session is ended by :meth:`poll` once the core releases the hold. Must run on the
        engine's event loop (it starts the poller there)."""
        key = hold_key(block_ids)
        alias = block_ids_session_alias(block_ids)
        digest = prompt_digest(token_ids)
        with self.lock:
            if session_id in self.key_of:
                return
        if self.export is not None:  # before the hold exists: no decode can read these blocks yet
            self.quant.load(block_ids, self.export)
        with self.lock:
            self.key_of[session_id] = key
            self.session_of[key] = session_id
            self.alias_of[key] = alias
            self.key_of_alias[alias] = key
        try:
            self.endpoint.add_hold(key, [int(b) for b in block_ids], len(token_ids), digest)
        except BaseException:  # no core hold: the session is not held (its END/STOP_SESSION must end it)
            with self.lock:
                self.key_of.pop(session_id, None)
                if self.session_of.get(key) == session_id:
                    del self.session_of[key]
                    self.key_of_alias.pop(self.alias_of.pop(key, None), None)
            raise
        if self.scheduler is None:
            self.scheduler = scheduler
            self._loop = asyncio.get_running_loop()
            self._loop.call_later(POLL_S, self.poll)

    def poll(self) -> None:
        """End the engine sessions whose holds the core released (consumed, aborted, expired), on the engine's
        event loop; re-arms itself every :data:`POLL_S` seconds."""
        try:
            finished = self.endpoint.take_finished()
        except Exception as e:  # never let the poller die
            log.error("DLMix: freeing released prefill sessions failed: %s", e)
            finished = set()
        for key in finished:  # each on its own: the core has let go of all of them
            try:
                with self.lock:
                    sid = self.session_of.pop(key, None)
                    if sid is not None:
                        self.key_of.pop(sid, None)
                    self.key_of_alias.pop(self.alias_of.pop(key, None), None)
                if sid is not None and self.scheduler.get_session(sid) is not None:
                    self.scheduler.end_session(sid)
            except Exception as e:  # never let the poller die, nor one session keep the others
                log.error("DLMix: freeing released prefill session of %s failed: %s", key, e)
        self._loop.call_later(POLL_S, self.poll)

    def is_held(self, session_id: int) -> bool:
        """True while this prefill holds the engine session ``session_id`` for a decode."""
        with self.lock:
            return session_id in self.key_of

    def drop(self, session_id: int) -> bool:
        """The engine was asked to end a held session (LMDeploy's free after migration, ``free_cache``, abort): let
        the core end the hold (at once, or when a read in progress finishes); :meth:`poll` then ends the session.
        ``session_id`` is the engine's session or the hold's :func:`~dlmix.pd.contract.block_ids_session_alias`
        (what the dlmix router sends to ``/distserve/free_cache`` when a request's decode leg did not take its KV).
        Returns False when the session is not held here."""
        with self.lock:
            key = self.key_of.get(session_id) if session_id >= 0 else self.key_of_alias.get(session_id)
        if key is None:
            return False
        self.endpoint.engine_abort(key)
        return True

    # ------------------------------------------------------------------ decode side
    def defer(self, session_id: int, call: Any) -> bool:
        """Hold back ``call`` (an engine stop/end of ``session_id``, no arguments) while that session's pull runs:
        LMDeploy stops or ends a session whose client went away at once, which frees (or makes evictable) the blocks
        the pull is still writing, so another request could get them and then have them overwritten. Returns False
        (call it now) when no pull of that session runs. Event loop only."""
        if session_id not in self.pulling:
            return False
        self.deferred.setdefault(session_id, []).append(call)
        return True

    def pull_over(self, session_id: int) -> None:
        """The pull of ``session_id`` is over (its blocks are written or it failed): run what :meth:`defer` held
        back, in order. Event loop only; never raises."""
        self.pulling.discard(session_id)
        for call in self.deferred.pop(session_id, []):
            try:
                call()
            except Exception as e:  # the engine's own handler: log, keep the migration loop alive
                log.error("DLMix: a stop/end of session %s held back during its pull failed: %s", session_id, e)

    def pull(self, remote_engine_id: str, remote_session_id: int, remote_block_ids: list[int],
             local_block_ids: list[int], token_ids: list[int]) -> PullResult:
        """Load a migrating request's KV (all ``len(token_ids)`` prompt tokens) into ``local_block_ids`` and release
        the prefill's hold. Blocking; never raises (errors are in the result). ``seconds`` of the result include
        quantizing on arrival (a ``--quant-policy`` 4/8 decode)."""
        with self.lock:
            peer = self.peers.get(remote_engine_id)
        if peer is None:
            return PullResult(loaded_upto=0, error=f"DLMix: {remote_engine_id} is not connected to this decode engine",
                              failed_block_ids=list(local_block_ids))
        local = [int(b) for b in local_block_ids]
        try:  # the migration request's block ids come from the request body: never raise into the engine loop
            rid = hold_key(remote_block_ids)
            digest = prompt_digest(token_ids)
        except ValueError as e:
            return PullResult(loaded_upto=0, error=f"DLMix: bad migration request: {e}", failed_block_ids=local)
        shadow = self.quant.shadow(len(local)) if self.quant is not None else None
        res = self.endpoint.pull(peer.transport, rid, list(remote_block_ids), 0, len(token_ids),
                                 list(range(len(local))) if shadow is not None else local,
                                 src_layout=peer.layout, digest=digest, dst_layers=shadow)
        try:
            self.endpoint.release(peer.transport, rid, consumed=res.error is None)
        except Exception as e:  # the prefill is gone: its hold timeout (or its death) frees its blocks
            log.warning("DLMix: telling prefill %s that %s is %s failed: %s", remote_engine_id, rid,
                        "consumed" if res.error is None else "aborted", e)
        if shadow is not None:
            res.failed_block_ids = [local[i] for i in res.failed_block_ids]
            if res.error is None:
                t0 = time.perf_counter()
                try:
                    self.quant.store(shadow, local)
                except Exception as e:  # never raise into the engine loop: the request fails, its blocks are freed
                    res.error = f"quantizing the received KV failed: {type(e).__name__}: {e}"
                    res.failed_block_ids = list(local)
                res.seconds += time.perf_counter() - t0  # the migration's time includes quantizing on arrival
        return res


_rank: Rank | None = None


def current() -> Rank | None:
    """This process's DLMix rank, or None when DLMix is not in use here."""
    return _rank


def start_rank(agent: Any) -> Rank:
    """Describe the cache of LMDeploy's model agent and open this rank's endpoint (called once the cache engine
    exists). Raises ValueError (unsupported cache or TP size) or the config error with the reason."""
    global _rank
    if _rank is not None:
        return _rank
    level = os.environ.get("DLMIX_LMDEPLOY_LOG")
    if level:  # e.g. INFO: one line per migration (tokens, bytes, seconds), read by benchmarks/pd_lmdeploy.py
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        for name in ("dlmix_lmdeploy", "dlmix.pd"):
            logging.getLogger(name).addHandler(handler)
            logging.getLogger(name).setLevel(level.upper())
    cc = agent.cache_config
    role = cc.role.name
    dist = getattr(agent, "dist_config", None)
    tp = int(getattr(dist, "attn_tp", 1) or 1) if dist is not None else 1
    if tp != 1:
        raise ValueError(f"the DLMix migration backend runs TP size 1 per engine for now, this engine has attention "
                         f"TP {tp}")
    settings = load_settings()
    import lmdeploy

    quant = export = None
    if quant_policy(agent.cache_engine) in (4, 8):
        layout, quant = describe_quant_cache(agent.cache_engine, agent.model_config, str(agent.model_path),
                                             tp_rank=0, tp_size=tp, engine=f"lmdeploy {lmdeploy.__version__}",
                                             receives=role == "Decode")
        if role == "Decode":
            layers = quant.shadow(1)  # the endpoint's own caches: a decode holds nothing for others
        else:
            layers = export = quant.export_pool()
    else:
        layout, layers = describe_cache(agent.cache_engine, agent.model_config, str(agent.model_path), tp_rank=0,
                                        tp_size=tp, engine=f"lmdeploy {lmdeploy.__version__}")
    secret = settings.shared_secret or DEFAULT_LOOPBACK_SECRET
    name = f"lmdeploy-{role.lower()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ep = KVEndpoint(settings.transport, name, secret, settings.host, settings.port or 0, layout, layers,
                    settings.staging_bytes if role == "Decode" else 0, hold_timeout_s=settings.hold_timeout_s,
                    registration_wait_s=settings.registration_wait_s, io_timeout_s=settings.io_timeout_s,
                    verify_weights=settings.verify_weights, connect_timeout_s=settings.connect_timeout_s)
    _rank = Rank(role=role, layout=layout, endpoint=ep, endpoint_settings=settings, quant=quant,
                 export=export)
    log.info("DLMix: %s endpoint %s, layout block %d %s %s", role, ep.descriptor(), layout.block_size,
             layout.dtype, layout.arrangement)
    return _rank


class DLMixMigrationBackend(MigrationBackendImpl):
    """LMDeploy's ``MigrationBackendImpl`` for ``DLMix``. The KV itself moves through the rank's
    :class:`~dlmix.pd.endpoint.KVEndpoint` (pulled per request by the patched engine loop); this class answers the
    connection handshake. ``links[remote_engine_id].remote_engine_config`` is kept because LMDeploy reads it."""

    def __init__(self) -> None:
        self.links: dict[str, Any] = {}

    @staticmethod
    def _rank() -> Rank:
        r = current()
        if r is None:
            raise RuntimeError("DLMix: this engine has no DLMix endpoint (it runs with --role Hybrid?)")
        return r

    def p2p_initialize(self, init_request: Any) -> None:
        self._rank()
        self.links[init_request.remote_engine_id] = init_request

    def register_memory_region(self, register_mr_request: Any) -> None:
        """Nothing to do: the endpoint registered the cache's layers when it started."""

    def endpoint_info(self, remote_engine_id: str, protocol: Any) -> dict[str, Any]:
        return self._rank().endpoint_info()

    def p2p_connect(self, remote_engine_id: str, conn_req: Any) -> None:
        self._rank().connect(remote_engine_id, conn_req.endpoint_info)

    async def p2p_migrate(self, assignment: Any, async_op: bool = False) -> None:
        raise RuntimeError("DLMix migrations run per request from the engine loop, not from byte assignments")

    def store(self, assignment: Any, async_op: bool = False) -> None:
        raise NotImplementedError("DLMix does not store to a remote pool")

    def load(self, assignment: Any, async_op: bool = False) -> None:
        raise NotImplementedError("DLMix does not load from a remote pool")
