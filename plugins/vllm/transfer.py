"""Worker-side KV movement for DLMixConnector over a ``dlmix_kv_connectors`` transport (documented choice:
**decode pulls** with one-sided reads of granted prefill blocks).

Every worker runs one transport endpoint (:class:`KVEndpoint`) that registers its per-layer KV tensors as regions
``L0 .. L{n-1}``; a decode worker also registers a staging region (``staging_bytes``, default 64 MiB).

Protocol (notifications are small JSON dicts on the transport's authenticated control channel):

1. decode -> prefill ``{"type": "want", "req", "block_ids", "layout"}`` (decode's KVLayout dict, first contact per
   request). The prefill side checks the hold exists (waiting up to ``registration_wait_s`` for its worker to learn
   of it from the next engine step) and the pair (:func:`~dlmix_vllm.layout.check_pair`), then grants the decode
   peer read access to exactly the held blocks of every layer for transfer id = request id, and answers
   ``{"type": "blocks_ready", "req", "layout"}`` or ``{"type": "refused", "req", "reasons"}``.
2. decode reads the prefill blocks covering the tokens it lacks, at most ``staging_bytes`` per round, into staging,
   converts them with :func:`dlmix.kv.convert` into its own blocks (block size, dtype), and repeats.
3. decode -> prefill ``{"type": "blocks_consumed", "req"}`` (or ``{"type": "abort", "req"}``): the prefill side revokes
   the grant and reports the request as finished sending, which frees its blocks.

A hold expires after ``hold_timeout_s``; a ``want`` extends it (and its grant) to at least ``io_timeout_s`` from
then, and decode sends ``{"type": "extend"}`` before every further staging round, so blocks are not freed under a
read that is progressing (an expired grant makes a late read fail, and decode recomputes).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dlmix.kv import KVLayout
from dlmix.kv import convert as kv_convert

from .layout import check_pair, layout_of, page_bytes

log = logging.getLogger("dlmix_vllm.transfer")

__all__ = ["KVEndpoint", "Hold", "PullResult", "DEFAULT_LOOPBACK_SECRET"]

#: Secret used when none is configured. Only allowed with a loopback bind (enforced by the settings), where it is
#: equivalent to an unauthenticated loopback socket; set ``shared_secret`` for anything else.
DEFAULT_LOOPBACK_SECRET = "dlmix-loopback-only"


@dataclass
class Hold:
    """Prefill-side record of a finished request whose blocks the scheduler keeps for a decode instance."""

    req_id: str
    block_ids: list[int]
    num_tokens: int
    expiry: float  # time.monotonic() deadline, seconds
    done: bool = False  # consumed, aborted or expired: report finished_sending
    granted_to: str | None = None


@dataclass
class PullResult:
    """Outcome of one pull: tokens ``[start, loaded_upto)`` are in place; bytes are bytes read over the transport."""

    loaded_upto: int
    bytes_received: int = 0
    seconds: float = 0.0
    peak_staging_bytes: int = 0
    rounds: int = 0
    error: str | None = None


class KVEndpoint:
    """One worker's transport endpoint (see module doc).

    Args:
      kind: transport kind for :func:`dlmix_kv_connectors.make_transport` (``tcp`` default).
      name: this endpoint's peer id (unique per worker).
      secret, host, port: transport authentication and listen address (port 0 = any free port).
      layout: this worker's KVLayout; layers: registered per-layer KV tensors in model order.
      staging_bytes: decode staging region size (bytes); 0 = prefill-only (no staging).
      hold_timeout_s, registration_wait_s, io_timeout_s, verify_weights: see :class:`dlmix_vllm.config.DLMixSettings`.
    Raises whatever the transport raises when it cannot start (e.g. port in use), and ValueError on bad input.
    """

    def __init__(self, kind: str, name: str, secret: str, host: str, port: int, layout: KVLayout,
                 layers: list[torch.Tensor], staging_bytes: int, *, hold_timeout_s: float = 120.0,
                 registration_wait_s: float = 10.0, io_timeout_s: float = 60.0, verify_weights: bool = True,
                 transport_cfg: dict[str, Any] | None = None):
        from dlmix_kv_connectors import make_transport

        self.layout = layout
        self.layers = layers
        self.page = page_bytes(layout)
        self.hold_timeout_s = hold_timeout_s
        self.registration_wait_s = registration_wait_s
        self.io_timeout_s = io_timeout_s
        self.verify_weights = verify_weights
        self.t = make_transport(kind, name=name, secret=secret, host=host, port=port, timeout_s=io_timeout_s,
                                **(transport_cfg or {}))
        for i, t in enumerate(layers):
            self.t.register(f"L{i}", t)
        self.staging: torch.Tensor | None = None
        if staging_bytes:
            self.staging = torch.empty(int(staging_bytes), dtype=torch.uint8)
            self.t.register("staging", self.staging)
        self.holds: dict[str, Hold] = {}
        self.cv = threading.Condition()
        self._replies: dict[str, tuple[threading.Event, list]] = {}
        self._work: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.stats = {"bytes_granted": 0, "grants": 0, "refused": 0, "expired": 0, "consumed": 0, "aborted": 0}
        self._pull_lock = threading.Lock()  # one pull at a time uses the staging region
        self._worker = threading.Thread(target=self._serve, name="dlmix-kv-ctl", daemon=True)
        self._worker.start()
        self.t.on_notify(self._on_notify)

    def descriptor(self) -> dict[str, Any]:
        """The transport descriptor a peer needs to connect (JSON-able; no secret)."""
        return self.t.descriptor()

    def close(self) -> None:
        self._stop.set()
        self._work.put(None)
        self.t.close()

    # ------------------------------------------------------------------ prefill side
    def add_hold(self, req_id: str, block_ids: list[int], num_tokens: int) -> None:
        """Register a request whose blocks the scheduler keeps (called from the worker's step)."""
        with self.cv:
            if req_id not in self.holds:
                self.holds[req_id] = Hold(req_id, list(block_ids), int(num_tokens),
                                          time.monotonic() + self.hold_timeout_s)
            self.cv.notify_all()

    def is_held(self, req_id: str) -> bool:
        with self.cv:
            return req_id in self.holds

    def held_count(self) -> int:
        with self.cv:
            return len(self.holds)

    def take_finished(self) -> set[str]:
        """Remove and return holds that were consumed, aborted or expired (expired ones get their grant revoked)."""
        now = time.monotonic()
        out: set[str] = set()
        with self.cv:
            for rid, h in list(self.holds.items()):
                if not h.done and now >= h.expiry:
                    h.done = True
                    self.stats["expired"] += 1
                    log.warning("DLMix: KV hold of %s expired (no decode consumed it); freeing its blocks", rid)
                if h.done:
                    self.t.revoke(rid)
                    out.add(rid)
                    del self.holds[rid]
        return out

    def _on_notify(self, n) -> None:  # transport I/O thread: must not block
        msg = n.msg
        typ = msg.get("type")
        if typ in ("blocks_ready", "refused"):
            with self.cv:
                slot = self._replies.get(str(msg.get("req")))
            if slot is not None:
                slot[1].append(msg)
                slot[0].set()
            return
        self._work.put((n.peer, msg))

    def _serve(self) -> None:
        while not self._stop.is_set():
            item = self._work.get()
            if item is None:
                return
            peer, msg = item
            try:
                self._handle(peer, msg)
            except Exception as e:  # a bad message must not stop the endpoint
                log.warning("DLMix: control message %s from %s failed: %s", msg.get("type"), peer, e)

    def _handle(self, peer: str, msg: dict[str, Any]) -> None:
        typ, rid = msg.get("type"), str(msg.get("req"))
        if typ == "want":
            reasons = check_pair(self.layout, msg.get("layout") or {}, verify_weights=self.verify_weights)
            deadline = time.monotonic() + self.registration_wait_s
            with self.cv:
                while rid not in self.holds and time.monotonic() < deadline:
                    self.cv.wait(timeout=max(0.0, deadline - time.monotonic()))
                h = self.holds.get(rid)
                if h is None or h.done:
                    reasons.append(f"request {rid} is not held here (unknown, expired or already released)")
                elif [int(b) for b in msg.get("block_ids") or []] != h.block_ids:
                    reasons.append(f"block ids for {rid} do not match the held blocks")
                if not reasons:
                    h.expiry = max(h.expiry, time.monotonic() + self.io_timeout_s)
                    ranges = [(f"L{i}", b * self.page, self.page) for i in range(len(self.layers))
                              for b in h.block_ids]
                    self.t.grant(peer, rid, ranges, mode="r", expires_s=max(1.0, h.expiry - time.monotonic()))
                    h.granted_to = peer
                    self.stats["grants"] += 1
                    self.stats["bytes_granted"] += len(ranges) * self.page
            if reasons:
                self.stats["refused"] += 1
                log.warning("DLMix: refusing KV of %s to %s: %s", rid, peer, "; ".join(reasons))
                self.t.notify(peer, {"type": "refused", "req": rid, "reasons": reasons})
            else:
                self.t.notify(peer, {"type": "blocks_ready", "req": rid, "layout": self.layout.to_dict()})
        elif typ == "extend":
            with self.cv:
                h = self.holds.get(rid)
                if h is not None and not h.done and h.granted_to == peer:
                    h.expiry = max(h.expiry, time.monotonic() + self.io_timeout_s)
                    self.t.grant(peer, rid, [], mode="r", expires_s=max(1.0, h.expiry - time.monotonic()))
        elif typ in ("blocks_consumed", "abort"):
            with self.cv:
                h = self.holds.get(rid)
                if h is not None and not h.done:
                    h.done = True
                    self.stats["consumed" if typ == "blocks_consumed" else "aborted"] += 1
        else:
            log.warning("DLMix: unknown control message %r from %s", typ, peer)

    # ------------------------------------------------------------------ decode side
    def release(self, remote: dict[str, Any], remote_req_id: str, consumed: bool) -> None:
        """Tell a prefill worker (transport descriptor ``remote``) it may free ``remote_req_id``'s blocks."""
        peer = self.t.connect(remote, timeout_s=self.io_timeout_s)
        self.t.notify(peer, {"type": "blocks_consumed" if consumed else "abort", "req": remote_req_id})

    def pull(self, remote: dict[str, Any], remote_req_id: str, remote_block_ids: list[int], start: int, end: int,
             local_block_ids: list[int], cancelled: Callable[[], bool] = lambda: False) -> PullResult:
        """Load tokens ``[start, end)`` of the remote request into this worker's blocks ``local_block_ids``
        (the request's block table in token order). Never raises: errors come back in ``PullResult.error`` with
        ``loaded_upto`` telling which prefix of the range is valid."""
        t0 = time.perf_counter()
        res = PullResult(loaded_upto=start)
        peer = None
        try:
            if self.staging is None:
                raise RuntimeError("this endpoint has no staging region (not a consumer)")
            peer = self.t.connect(remote, timeout_s=self.io_timeout_s)
            ev = threading.Event()
            box: list = []
            with self.cv:
                self._replies[remote_req_id] = (ev, box)
            try:
                self.t.notify(peer, {"type": "want", "req": remote_req_id, "block_ids": list(remote_block_ids),
                                     "layout": self.layout.to_dict()})
                deadline = time.monotonic() + self.registration_wait_s + self.io_timeout_s
                while not ev.wait(0.1):
                    # A prefill killed just before (its socket not yet seen closed when we notified) drops out of
                    # the live peers within a moment: fail fast instead of waiting for the timeout.
                    if peer not in self.t.peers():
                        raise ConnectionError(f"prefill {peer} disconnected before answering for {remote_req_id}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no answer from prefill {peer} for {remote_req_id}")
            finally:
                with self.cv:
                    self._replies.pop(remote_req_id, None)
            reply = box[0]
            if reply.get("type") == "refused":
                raise PermissionError("prefill refused: " + "; ".join(reply.get("reasons") or []))
            src = layout_of(reply["layout"])
            reasons = check_pair(src, self.layout, verify_weights=self.verify_weights)
            if reasons:
                raise PermissionError("incompatible prefill/decode pair: " + "; ".join(reasons))
            self._pull_rounds(peer, remote_req_id, src, remote_block_ids, start, end, local_block_ids, res,
                              cancelled)
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}"
        res.seconds = time.perf_counter() - t0
        return res

    def _pull_rounds(self, peer: str, rid: str, src: KVLayout, rblocks: list[int], start: int, end: int,
                     lblocks: list[int], res: PullResult, cancelled: Callable[[], bool]) -> None:
        assert self.staging is not None
        L = src.model.num_layers
        sp = page_bytes(src)
        ns = src.block_size
        per_block = L * sp  # staging bytes per prefill block (all layers)
        cap = self.staging.numel() // per_block
        if cap < 1:
            raise ValueError(f"staging region of {self.staging.numel()} B cannot hold one prefill block "
                             f"({per_block} B over {L} layers)")
        b0, b1 = start // ns, (end + ns - 1) // ns
        if b1 > len(rblocks):
            raise ValueError(f"remote has {len(rblocks)} blocks, tokens up to {end} need {b1}")
        sdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[src.dtype]
        H, D = src.num_local_heads, src.model.head_size
        with self._pull_lock:
            c0 = b0
            while c0 < b1:
                if cancelled():
                    raise RuntimeError("cancelled: the decode request finished before its KV arrived")
                if c0 > b0:  # a long transfer: keep the prefill hold (and grant) alive for the next round
                    self.t.notify(peer, {"type": "extend", "req": rid})
                c1 = min(b1, c0 + cap)
                n = c1 - c0
                segs = []
                for layer in range(L):
                    base = layer * n * sp
                    # merge runs of consecutive remote blocks into one segment
                    i = 0
                    while i < n:
                        j = i + 1
                        while j < n and rblocks[c0 + j] == rblocks[c0 + j - 1] + 1:
                            j += 1
                        segs.append(("staging", base + i * sp, f"L{layer}", rblocks[c0 + i] * sp, (j - i) * sp))
                        i = j
                h = self.t.read(peer, segs, transfer_id=rid, timeout_s=self.io_timeout_s)
                res.bytes_received += h.result(timeout=self.io_timeout_s + 5)
                res.peak_staging_bytes = max(res.peak_staging_bytes, L * n * sp)
                res.rounds += 1
                # convert tokens [t0, t1) from the staged prefill pages into our blocks
                t0, t1 = max(start, c0 * ns), min(end, c1 * ns)
                src_caches = [self.staging[layer * n * sp:(layer + 1) * n * sp].view(sdt).view(n, H, ns, 2 * D)
                              for layer in range(L)]
                src_table = [0] * c0 + list(range(n))
                kv_convert(src, src_caches, src_table, self.layout, self.layers, lblocks, t1, t0,
                           relax_fingerprint=not self.verify_weights)
                res.loaded_upto = t1
                c0 = c1
