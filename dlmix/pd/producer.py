"""Producer (prefill) side of the pull path, engine-neutral.

The engine adapter calls :meth:`Producer.add_hold` when a finished request's blocks are kept for a consumer, polls
:meth:`Producer.take_finished` (or gets ``hold_released`` hooks) to learn which holds it may free, and calls
:meth:`Producer.engine_abort` if it must drop a hold itself. Control messages from consumers arrive through
:meth:`Producer.handle` (already decoded by :func:`dlmix.pd.contract.decode_message`).

Rules:

* ``want``: checked against the hold (exists, same block ids, same prompt digest when both are known) and the pair
  (:func:`dlmix.pd.pair.check_pair`, the security gate); then exactly the held blocks of every layer plane are
  granted read-only to the asking peer for transfer id = request id, the deadline becomes at least
  ``io_timeout_s`` from now, and ``blocks_ready`` is sent; otherwise ``refused`` with the reasons.
* ``extend`` (from the grantee): deadline and grant pushed to ``io_timeout_s`` from now.
* ``blocks_consumed`` / ``abort``: one of the hold's ``consumers`` is done; when all are (1 unless the engine or a
  ``want`` said more: a request with ``n > 1`` choices whose decode fans out into ``n`` pulls of the one prefill), the grant is
  revoked and the hold released. With different TP sizes each decode rank is a consumer peer of its own (``want``
  states how many, ``ranks``), gets its own grant, and the hold waits for ``consumers * ranks`` notices. With one
  consumer rank, a notice from a peer the granted hold was not granted to (its ``want`` was refused: another decode
  named the same blocks) is ignored, so it cannot end the hold under the grantee's read.
* deadline passed (``hold_timeout_s`` after the hold began, or ``io_timeout_s`` after the last want/extend):
  revoked and released (``expired``); a later read fails and the consumer recomputes. A hold that was granted is
  released only ``io_timeout_s`` after that (or at the consumer's ``blocks_consumed``/``abort``), as after
  :meth:`engine_abort`: a read already being served may still touch its blocks.
* every message may name a hold by its request id or by :func:`dlmix.pd.contract.block_ids_transfer_id` of its
  block ids (a consumer that learnt the blocks but not the request id: an LMDeploy decode fed by a vLLM prefill);
  the grant is made under the name the consumer used.
* :meth:`engine_abort`: revoke at once; a never-granted hold is released at once, a granted one only after
  ``io_timeout_s`` more (a read already being served may still touch the blocks; the transport lets served ops
  finish after a revoke) or when the consumer reports ``blocks_consumed``/``abort``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from dlmix.kv.layout import KVLayout

from .contract import (MAX_CONSUMERS, Abort, Consumed, ContractError, ControlMessage, Extend, Ready, Refuse, Want,
                       block_ids_transfer_id, encode)
from .engine import layer_planes, plane_page_bytes, region_names
from .pair import check_pair

log = logging.getLogger("dlmix.pd.producer")

#: how many freed holds' names a producer remembers (:attr:`Producer.ended`)
ENDED_KEPT = 4096

__all__ = ["Hold", "Producer", "block_ranges", "MAX_CONSUMERS"]



@dataclass
class Hold:
    """A request whose blocks the engine keeps for a consumer. ``expiry``: ``time.monotonic()`` deadline (s);
    ``done``: released (consumed, aborted, expired) and waiting for the engine to take it; ``why``: the reason;
    ``peers``: consumer peer -> the transfer id its read grant was made under (one peer, unless the decode's TP
    size differs and several of its ranks read this rank); ``free_after``: engine-aborted with a grant: not before;
    ``consumers``: pulls per consumer rank (the ``n`` of a request whose decode fans out into ``n`` choices);
    ``ranks``: consumer ranks that read or release this rank (the largest ``ranks`` a consumer stated);
    ``released``: consumed/abort notices received (the hold is released at ``consumers * ranks``)."""

    req_id: str
    block_ids: list[int]
    num_tokens: int
    expiry: float
    digest: str | None = None
    done: bool = False
    why: str = ""
    free_after: float = 0.0
    grants: int = 0
    consumers: int = 1
    alias: str = ""
    peers: dict[str, str] = field(default_factory=dict)
    ranks: int = 1
    released: int = 0
    #: host outbox pages holding this hold's blocks (a device cache behind a host-only transport), once granted
    pages: list[int] | None = None

    @property
    def granted_to(self) -> str | None:
        """The first peer granted (None: never granted)."""
        return next(iter(self.peers), None)

    def revoke(self, transport: Any) -> None:
        """Revoke every read grant of this hold (under each transfer id it was made under)."""
        for tid in set(self.peers.values()):
            transport.revoke(tid)
        transport.revoke(self.req_id)


def block_ranges(layout: KVLayout, block_ids: list[int]) -> list[tuple[str, int, int]]:
    """``(region, offset, length)`` byte ranges covering exactly ``block_ids`` of every layer plane of ``layout``'s
    region scheme (:mod:`dlmix.pd.engine`); runs of consecutive block ids become one range."""
    page = plane_page_bytes(layout)
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and b == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return [(name, b0 * page, n * page) for names in region_names(layout) for name in names for b0, n in runs]


class Producer:
    """Hold/grant/extend/release bookkeeping over a transport (see module doc).

    Args:
      transport: a ``dlmix_kv_connectors`` transport (uses ``grant``, ``revoke``, ``notify``) whose regions are this
        engine's KV planes (:func:`register_regions`).
      layout: this rank's KVLayout.
      num_blocks: blocks per plane of the registered cache (block ids must be below it).
      hold_timeout_s, registration_wait_s, io_timeout_s: seconds (see :class:`dlmix_vllm.config.DLMixSettings`).
      verify_weights: refuse consumers whose weights fingerprint differs.
      on_released: optional hook ``(request_id, why)`` called when a hold is released.
      outbox: a :class:`dlmix.pd.outbox.HostOutbox` whose host planes are the registered regions (a device cache
        behind a host-only transport): a grant first copies the held blocks into outbox pages and names them in
        ``blocks_ready``; the pages are freed with the hold.
    """

    def __init__(self, transport: Any, layout: KVLayout, num_blocks: int, *, hold_timeout_s: float = 120.0,
                 registration_wait_s: float = 10.0, io_timeout_s: float = 60.0, verify_weights: bool = True,
                 on_released: Callable[[str, str], None] | None = None, outbox: Any = None):
        self.t = transport
        self.outbox = outbox
        self.layout = layout
        self.num_blocks = int(num_blocks)
        self.hold_timeout_s = hold_timeout_s
        self.registration_wait_s = registration_wait_s
        self.io_timeout_s = io_timeout_s
        self.verify_weights = verify_weights
        self.on_released = on_released
        self.holds: dict[str, Hold] = {}
        #: block_ids_transfer_id(block ids) -> request id, for consumers that name a hold by its blocks
        self.aliases: dict[str, str] = {}
        #: request ids of the last :data:`ENDED_KEPT` holds freed (not names made of block ids: those come back with
        #: the next hold on the same blocks): a want for one is refused at once instead of waiting
        #: ``registration_wait_s`` for a hold that will not come (stale or replayed parameters)
        self.ended: OrderedDict[str, None] = OrderedDict()
        #: the last :data:`ENDED_KEPT` names a want was refused for because nothing was held under them: the
        #: consumer's abort that follows names the right id, it is no bad message
        self.refused_unheld: OrderedDict[str, None] = OrderedDict()
        self.cv = threading.Condition()
        self.closed = False  # set by close(): a want waiting for its hold stops waiting
        self.stats = {"bytes_granted": 0, "grants": 0, "refused": 0, "expired": 0, "consumed": 0, "aborted": 0,
                      "engine_aborted": 0, "bad_messages": 0}

    # ------------------------------------------------------------------ engine-facing
    def add_hold(self, req_id: str, block_ids: list[int], num_tokens: int, digest: str | None = None,
                 consumers: int = 1) -> None:
        """Keep ``block_ids`` (token order) of ``req_id`` for ``consumers`` pulls (1..:data:`MAX_CONSUMERS`; the
        ``n`` of a request whose decode fans out into ``n`` choices). Idempotent per request id.
        Raises ValueError for block ids outside the cache, too few blocks for ``num_tokens`` or a bad
        ``consumers``."""
        if isinstance(consumers, bool) or not isinstance(consumers, int) or not 1 <= consumers <= MAX_CONSUMERS:
            raise ValueError(f"hold of {req_id}: consumers must be an integer 1..{MAX_CONSUMERS}, got {consumers!r}")
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"hold of {req_id}: block ids {bad[:5]} are outside 0..{self.num_blocks - 1}")
        if -(-int(num_tokens) // self.layout.block_size) > len(ids):
            raise ValueError(f"hold of {req_id}: {num_tokens} tokens need more than {len(ids)} blocks")
        alias = block_ids_transfer_id(ids)
        with self.cv:
            self.ended.pop(req_id, None)
            self.ended.pop(alias, None)
            if req_id not in self.holds:
                self.holds[req_id] = Hold(req_id, ids, int(num_tokens), time.monotonic() + self.hold_timeout_s,
                                          digest=digest, consumers=consumers, alias=alias)
                # blocks held for one request are not reused while held, so the alias names one hold; if two live
                # holds share every block (the same cached prefix), the first keeps the alias
                self.aliases.setdefault(alias, req_id)
            self.cv.notify_all()

    def _hold(self, name: str) -> Hold | None:  # under self.cv
        h = self.holds.get(name)
        if h is None:
            rid = self.aliases.get(name)
            h = self.holds.get(rid) if rid is not None else None
        return h

    def _awaited(self, name: str) -> bool:  # under self.cv
        """Whether a want for ``name`` waits for the engine's hold: not held (yet), not known to have ended, and the
        endpoint is open."""
        return self._hold(name) is None and name not in self.ended and not self.closed

    def close(self) -> None:
        """The endpoint is closing: wants waiting for their hold stop waiting (and are refused)."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def is_held(self, req_id: str) -> bool:
        with self.cv:
            return req_id in self.holds

    def would_wait(self, msg: Any) -> bool:
        """Whether handling ``msg`` would block: a ``want`` for a name not held (yet) and not known to have ended
        waits up to ``registration_wait_s`` for the engine's hold."""
        if not isinstance(msg, Want) or self.registration_wait_s <= 0:
            return False
        with self.cv:
            return self._awaited(msg.req)

    def held_count(self) -> int:
        with self.cv:
            return len(self.holds)

    def engine_abort(self, req_id: str) -> None:
        """The engine drops ``req_id``: revoke its grant now; release at once if never granted, else after
        ``io_timeout_s`` (or the consumer's consumed/abort), so no in-flight read touches freed blocks."""
        with self.cv:
            h = self.holds.get(req_id)
            if h is None or h.done:
                return
            h.revoke(self.t)
            self.stats["engine_aborted"] += 1
            if h.granted_to is None:
                self._release(h, "engine_abort")
            else:
                h.expiry = -1.0  # never extended again
                h.free_after = time.monotonic() + self.io_timeout_s

    def take_finished(self) -> set[str]:
        """Remove and return the holds the engine may free now (consumed, aborted, expired; expired ones get their
        grant revoked)."""
        now = time.monotonic()
        out: set[str] = set()
        with self.cv:
            for rid, h in list(self.holds.items()):
                if h.free_after:
                    if now >= h.free_after:
                        self._release(h, h.why or "engine_abort")
                elif not h.done and now >= h.expiry:
                    self.stats["expired"] += 1
                    if h.granted_to is None:
                        log.warning("dlmix.pd: KV hold of %s expired (no consumer read it); freeing its blocks", rid)
                        self._release(h, "expired")
                    else:  # a read already being served may still touch the blocks: as engine_abort of a granted hold
                        log.warning("dlmix.pd: KV hold of %s expired (its consumer went silent); freeing its blocks "
                                    "in %.0f s", rid, self.io_timeout_s)
                        h.revoke(self.t)
                        h.why, h.expiry, h.free_after = "expired", -1.0, now + self.io_timeout_s
                if h.done:
                    out.add(rid)
                    del self.holds[rid]
                    if self.aliases.get(h.alias) == rid:
                        del self.aliases[h.alias]
                    if rid != h.alias:  # a name made of block ids (an alias, an LMDeploy hold) names the next
                        # hold on those blocks too (freed blocks are reused, a prefix-cache hit gives the same ones):
                        # a want for it may overtake that hold and must wait for it, as for any unknown name
                        _remember(self.ended, rid)
        return out

    def _release(self, h: Hold, why: str) -> None:  # under self.cv
        h.done, h.why, h.free_after = True, why, 0.0
        h.revoke(self.t)
        if h.pages is not None and self.outbox is not None:
            self.outbox.unstage(h.pages)
            h.pages = None
        if self.on_released is not None:
            try:
                self.on_released(h.req_id, why)
            except Exception as e:  # a hook must not break the bookkeeping
                log.warning("dlmix.pd: hold_released hook failed for %s: %s", h.req_id, e)

    # ------------------------------------------------------------------ consumer-facing
    def handle(self, peer: str, msg: ControlMessage) -> None:
        """Act on one decoded control message from ``peer`` (may block up to ``registration_wait_s`` for a want
        that overtook the engine's hold)."""
        if isinstance(msg, Want):
            self._want(peer, msg)
        elif isinstance(msg, Extend):
            with self.cv:
                h = self._hold(msg.req)
                tid = h.peers.get(peer) if h is not None else None
                if tid is not None and not h.done and not h.free_after and _named(tid, msg.req):
                    h.expiry = max(h.expiry, time.monotonic() + self.io_timeout_s)
                    self.t.grant(peer, tid, [], mode="r", expires_s=max(1.0, h.expiry - time.monotonic()))
        elif isinstance(msg, (Consumed, Abort)):
            with self.cv:
                h = self._hold(msg.req)
                if h is not None and not h.done and h.peers and peer not in h.peers \
                        and max(h.ranks, msg.ranks) == 1:
                    # granted to another peer (one consumer rank): this peer's want was refused or never made; its
                    # notice must not end the hold (and free the blocks) under the grantee's read
                    self.stats["bad_messages"] += 1
                    log.warning("dlmix.pd: ignoring %s of %s from %s: granted to %s", type(msg).__name__, msg.req,
                                peer, h.granted_to)
                elif h is not None and not h.done:
                    consumed = isinstance(msg, Consumed)
                    self.stats["consumed" if consumed else "aborted"] += 1
                    h.ranks = max(h.ranks, msg.ranks)
                    h.released += 1
                    if h.released >= h.consumers * h.ranks:
                        self._release(h, "consumed" if consumed else "aborted")
                elif h is None and msg.req not in self.ended and msg.req not in self.refused_unheld:
                    # never held here: most likely the consumer names its own request id, not the producer's
                    # (TransferParams.request_id), and the hold it meant stays until hold_timeout_s
                    self.stats["bad_messages"] += 1
                    log.warning("dlmix.pd: %s of %s from %s names no hold here (a release names the producer's "
                                "request id, the transfer parameters' request_id)", type(msg).__name__, msg.req, peer)
        else:
            self.stats["bad_messages"] += 1
            log.warning("dlmix.pd: producer ignores %s from %s", type(msg).__name__, peer)

    def refuse_bad(self, peer: str, raw: Any, err: ContractError) -> None:
        """A message from ``peer`` failed to decode: count it and, when it names a request, answer ``refused`` with
        the reason so the consumer fails fast. Never changes a hold."""
        self.stats["bad_messages"] += 1
        req = raw.get("req") if isinstance(raw, dict) else None
        log.warning("dlmix.pd: bad control message from %s: %s", peer, err.reason)
        if isinstance(req, str) and req and raw.get("type") == "want":
            self._notify(peer, Refuse(req=req[:512], reasons=[err.reason[:4000]]))

    def _notify(self, peer: str, msg: ControlMessage) -> None:
        try:
            self.t.notify(peer, encode(msg))
        except Exception as e:  # the consumer may be gone
            log.warning("dlmix.pd: cannot answer %s: %s", peer, e)

    def _want(self, peer: str, msg: Want) -> None:
        rid = msg.req
        reasons = check_pair(self.layout, msg.layout, verify_weights=self.verify_weights, src_name="producer",
                             dst_name="consumer")
        asked = time.monotonic()
        deadline = asked + self.registration_wait_s
        with self.cv:
            while self._awaited(rid) and time.monotonic() < deadline:
                self.cv.wait(timeout=max(0.0, deadline - time.monotonic()))
            h = self._hold(rid)
            waited = time.monotonic() - asked
            if waited > 1.0:
                log.info("dlmix.pd: the want for %s from %s waited %.1f s for the engine's hold", rid, peer, waited)
            if h is None or h.done or h.free_after:
                reasons.append(f"request {rid} is not held here (unknown, expired or already released)")
                if h is None:
                    _remember(self.refused_unheld, rid)
            else:
                if list(msg.block_ids) != h.block_ids:
                    reasons.append(f"block ids for {rid} do not match the held blocks")
                if msg.digest is not None and h.digest is not None and msg.digest != h.digest:
                    reasons.append(f"prompt of {rid} differs (consumer digest {msg.digest[:19]}..., held "
                                   f"{h.digest[:19]}...)")
                tid = h.peers.get(peer)
                if tid is None and h.peers and (len(h.peers) >= max(h.ranks, msg.ranks)
                                                 or not _named(next(iter(h.peers.values())), rid)):
                    reasons.append(f"request {rid} is already granted to another consumer")
                elif tid is not None and not _named(tid, rid):
                    reasons.append(f"request {rid} is already granted to another consumer (under another name)")
            if not reasons and self.outbox is not None and h.pages is None:
                try:
                    h.pages = self.outbox.stage(h.block_ids)
                except Exception as e:  # outbox full (MemoryError) or the device copy failed
                    reasons.append(f"cannot stage {rid} for the transport: {e}")
            if not reasons:
                h.ranks = max(h.ranks, msg.ranks)
                h.consumers = max(h.consumers, msg.consumers)
                if tid is None:  # the first grantee reads under the name it used; a further rank gets its own id
                    tid = rid if not h.peers else f"{rid}~{len(h.peers)}"
                    h.peers[peer] = tid
                h.expiry = max(h.expiry, time.monotonic() + self.io_timeout_s)
                pages = h.pages
                ranges = block_ranges(self.layout, h.block_ids if pages is None else pages)
                self.t.grant(peer, tid, ranges, mode="r", expires_s=max(1.0, h.expiry - time.monotonic()))
                h.grants += 1
                self.stats["grants"] += 1
                self.stats["bytes_granted"] += sum(r[2] for r in ranges)
        if reasons:
            self.stats["refused"] += 1
            log.warning("dlmix.pd: refusing KV of %s to %s: %s", rid, peer, "; ".join(reasons))
            self._notify(peer, Refuse(req=rid, reasons=reasons))
        else:
            self._notify(peer, Ready(req=rid, layout=self.layout.to_dict() if msg.send_layout else None,
                                     tid=None if tid == rid else tid, pages=pages))


def _remember(names: "OrderedDict[str, None]", name: str) -> None:
    """Add ``name`` to ``names`` as its newest entry, keeping the newest :data:`ENDED_KEPT`."""
    names[name] = None
    names.move_to_end(name)
    while len(names) > ENDED_KEPT:
        names.popitem(last=False)


def _named(tid: str, name: str) -> bool:
    """Whether grant id ``tid`` belongs to the name ``name`` a consumer used (its request id or its block
    alias; a further rank's id is that name with ``~k``)."""
    return tid == name or tid.startswith(name + "~")


def register_regions(transport: Any, layout: KVLayout, layers: list[Any]) -> None:
    """Register every layer plane of ``layers`` with ``transport`` under :func:`region_names`."""
    for names, cache in zip(region_names(layout), layers):
        for name, plane in zip(names, layer_planes(layout, cache)):
            transport.register(name, plane)
