"""One engine rank's PD endpoint: a ``dlmix_kv_connectors`` transport with this rank's KV planes registered, a
:class:`~dlmix.pd.producer.Producer` and (with staging) a :class:`~dlmix.pd.consumer.Consumer`, and the dispatch of
control messages (decoded and validated by :func:`dlmix.pd.contract.decode_message`; a malformed one is counted,
answered with ``refused`` when it is a ``want``, and never changes a hold).

Documented choice: **the consumer pulls** with one-sided reads of the producer's granted blocks. See
:mod:`dlmix.pd.producer` and :mod:`dlmix.pd.consumer` for the rules of each side.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from dlmix.kv.layout import KVLayout

from .consumer import Consumer, PullResult
from .contract import ContractError, Ready, Refuse, decode_message
from .engine import check_caches, layer_planes
from .outbox import HostOutbox, needs_outbox
from .producer import Hold, Producer, register_regions

log = logging.getLogger("dlmix.pd.endpoint")

__all__ = ["KVEndpoint", "Hold", "PullResult", "DEFAULT_LOOPBACK_SECRET"]

#: Secret used when none is configured. Only allowed with a loopback bind (enforced by adapters' settings), where it
#: is equivalent to an unauthenticated loopback socket; set a shared secret for anything else.
DEFAULT_LOOPBACK_SECRET = "dlmix-loopback-only"

#: wants waiting for their hold (each up to ``registration_wait_s``) on threads of their own at one time; a further
#: one waits on the control thread, as every want did before
MAX_WAITING_WANTS = 64


class _Slots:
    """Answers (``blocks_ready``/``refused``) awaited by pulls, by producer peer and request id. Several pulls of one
    remote request (the ``n`` choices of one prefill) wait in the order they asked; the producer answers one peer's
    wants in order, so each answer goes to the oldest pull still waiting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, str], list[tuple[threading.Event, list]]] = {}

    def open(self, peer: str, req: str) -> tuple[threading.Event, list]:
        slot = (threading.Event(), [])
        with self._lock:
            self._slots.setdefault((peer, req), []).append(slot)
        return slot

    def close(self, peer: str, req: str, slot: tuple[threading.Event, list] | None = None) -> None:
        """Stop waiting: ``slot`` (from :meth:`open`) or, when None, every pull of ``req`` from ``peer``."""
        req = (peer, req)
        with self._lock:
            waiting = self._slots.get(req)
            if waiting is None:
                return
            if slot is None:
                waiting.clear()
            else:
                waiting[:] = [s for s in waiting if s[0] is not slot[0]]
            if not waiting:
                del self._slots[req]

    def deliver(self, peer: str, msg: Ready | Refuse) -> bool:
        with self._lock:
            waiting = self._slots.get((peer, msg.req))
            slot = next((s for s in waiting if not s[0].is_set()), None) if waiting else None
            if slot is None:
                return False
            slot[1].append(msg)
            slot[0].set()
        return True


class KVEndpoint:
    """One worker's PD endpoint (see module doc).

    Args:
      kind: transport kind for :func:`dlmix_kv_connectors.make_transport` (``tcp`` default).
      name: this endpoint's peer id (unique per worker).
      secret, host, port: transport authentication and listen address (port 0 = any free port).
      layout: this rank's KVLayout; layers: per-layer KV caches in model order (:mod:`dlmix.kv` form).
      staging_bytes: consumer staging region size (bytes); 0 = producer only. Host memory (page-locked when the
        cache is on a CUDA device); each pull round is copied to the cache's device (into a device buffer of the
        same size, allocated on the first such pull) and converted there.
      outbox_bytes: host outbox size (bytes) when the cache is in device memory and the transport registers host
        memory only (:mod:`dlmix.pd.outbox`; bounds the KV of the requests granted at one time); unused otherwise.
      hold_timeout_s, registration_wait_s, io_timeout_s, verify_weights: see :mod:`dlmix.pd.producer`;
      connect_timeout_s: see :class:`dlmix.pd.consumer.Consumer`.
      on_released: optional producer hook ``(request_id, why)``.
    Raises whatever the transport raises when it cannot start (e.g. port in use), and ValueError on caches that do
    not match the layout.
    """

    def __init__(self, kind: str, name: str, secret: str, host: str, port: int, layout: KVLayout,
                 layers: list[Any], staging_bytes: int, *, hold_timeout_s: float = 120.0,
                 registration_wait_s: float = 10.0, io_timeout_s: float = 60.0, verify_weights: bool = True,
                 connect_timeout_s: float = 5.0, transport_cfg: dict[str, Any] | None = None,
                 on_released: Callable[[str, str], None] | None = None, outbox_bytes: int = 256 << 20):
        import torch
        from dlmix_kv_connectors import make_transport

        self.layout = layout
        self.layers = layers
        num_blocks = check_caches(layout, layers)
        self.t = make_transport(kind, name=name, secret=secret, host=host, port=port, timeout_s=io_timeout_s,
                                **(transport_cfg or {}))
        try:
            self.outbox = None
            if needs_outbox(self.t, layout, layers):
                self.outbox = HostOutbox(layout, layers, outbox_bytes)
                self.outbox.register(self.t)
            else:
                register_regions(self.t, layout, layers)
            self.staging = None
            if staging_bytes:
                pin = torch.cuda.is_available() and any(
                    p.device.type == "cuda" for p in layer_planes(layout, layers[0]))
                self.staging = torch.empty(int(staging_bytes), dtype=torch.uint8, pin_memory=pin)
                self.t.register("staging", self.staging)
            self.producer = Producer(self.t, layout, num_blocks, hold_timeout_s=hold_timeout_s,
                                     registration_wait_s=registration_wait_s, io_timeout_s=io_timeout_s,
                                     verify_weights=verify_weights, on_released=on_released, outbox=self.outbox)
            self._slots = _Slots()
            self.consumer = Consumer(self.t, layout, layers, self.staging, slots=self._slots,
                                     io_timeout_s=io_timeout_s, registration_wait_s=registration_wait_s,
                                     verify_weights=verify_weights, connect_timeout_s=connect_timeout_s)
            self._work: queue.Queue = queue.Queue()
            self._waiters = threading.BoundedSemaphore(MAX_WAITING_WANTS)  # wants waiting for their hold, each on a thread
            #: request -> the messages for it that arrived while its want waits on its own thread (handled after it)
            self._behind: dict[str, list] = {}
            self._behind_lock = threading.Lock()
            self._stop = threading.Event()
            self._worker = threading.Thread(target=self._serve, name="dlmix-kv-ctl", daemon=True)
            self._worker.start()
        except BaseException:  # do not leave the transport's threads running and its port bound
            self.t.close()
            raise
        self.t.on_notify(self._on_notify)

    @classmethod
    def for_engine(cls, engine: Any, *, kind: str = "tcp", name: str, secret: str, host: str = "127.0.0.1",
                   port: int = 0, staging_bytes: int = 0, hooks: Any = None, **kw: Any) -> "KVEndpoint":
        """Endpoint for an :class:`~dlmix.pd.engine.EngineKV` (``layout`` + ``layers``) with optional
        :class:`~dlmix.pd.engine.LifecycleHooks`; ``kw``: the timeouts and ``verify_weights`` of the constructor."""
        return cls(kind, name, secret, host, port, engine.layout, list(engine.layers), staging_bytes,
                   on_released=getattr(hooks, "hold_released", None), **kw)

    # ------------------------------------------------------------------ common
    @property
    def stats(self) -> dict[str, int]:
        return self.producer.stats

    @property
    def holds(self) -> dict[str, Hold]:
        return self.producer.holds

    def descriptor(self) -> dict[str, Any]:
        """The transport descriptor a peer needs to connect (JSON-able; no secret)."""
        return self.t.descriptor()

    def close(self) -> None:
        self._stop.set()
        self._work.put(None)
        self.producer.close()  # wants waiting for their hold end now, not registration_wait_s later
        self.t.close()

    def _on_notify(self, n) -> None:  # transport I/O thread: must not block
        try:
            msg = decode_message(n.msg)
        except ContractError as e:
            self._work.put((n.peer, n.msg, e))
            return
        if isinstance(msg, (Ready, Refuse)):
            if not self._slots.deliver(n.peer, msg):
                log.debug("dlmix.pd: unexpected %s for %s from %s", type(msg).__name__, msg.req, n.peer)
            return
        self._work.put((n.peer, msg, None))

    def _serve(self) -> None:
        while not self._stop.is_set():
            item = self._work.get()
            if item is None:
                return
            peer, msg, err = item
            req = getattr(msg, "req", None) if err is None else None
            if req is not None:
                with self._behind_lock:
                    later = self._behind.get(req)
                    if later is not None:  # a want of this request waits on its thread: keep the order
                        later.append((peer, msg))
                        continue
            if err is None and self.producer.would_wait(msg) and self._waiters.acquire(blocking=False):
                # a want that overtook its hold waits for it (up to registration_wait_s) on a thread of its own: the
                # wants, extends and releases of other requests queued behind it must not wait with it (a decode's
                # pull threads ask one prefill for several requests at once)
                with self._behind_lock:
                    self._behind[req] = []
                try:
                    threading.Thread(target=self._wait_one, args=(peer, msg), name="dlmix-kv-want",
                                     daemon=True).start()
                    continue
                except Exception as e:  # no thread to be had (RuntimeError): wait here, as every want did before
                    log.warning("dlmix.pd: cannot start a thread for the want of %s (%s); it waits on the control "
                                "thread", req, e)
                    with self._behind_lock:  # nothing was queued behind it: only this thread queues
                        del self._behind[req]
                    self._waiters.release()
            self._handle_one(peer, msg, err)

    def _wait_one(self, peer: str, want: Any) -> None:
        """On a thread of its own holding one of :data:`MAX_WAITING_WANTS` slots: handle ``want`` (it waits for its
        hold), then the messages of the same request that arrived meanwhile, in their order (an ``abort`` sent while
        the want waited releases the hold it is then granted, as on the control thread)."""
        try:
            self._handle_one(peer, want, None)
            while True:
                with self._behind_lock:
                    later = self._behind[want.req]
                    if not later:
                        del self._behind[want.req]
                        return
                    self._behind[want.req] = []
                for p, m in later:
                    self._handle_one(p, m, None)
        finally:
            self._waiters.release()

    def _handle_one(self, peer: str, msg: Any, err: ContractError | None) -> None:
        """Handle one control message from the queue (``err``: its decoding error); never raises."""
        try:
            if err is not None:
                self.producer.refuse_bad(peer, msg, err)
            else:
                self.producer.handle(peer, msg)
        except Exception as e:  # a bad message must not stop the endpoint
            log.warning("dlmix.pd: control message from %s failed: %s", peer, e)

    def _handle(self, peer: str, msg: Any) -> None:
        """Handle one raw control message synchronously (decoding it first)."""
        try:
            m = decode_message(msg)
        except ContractError as e:
            self.producer.refuse_bad(peer, msg, e)
            return
        self.producer.handle(peer, m)

    # ------------------------------------------------------------------ producer side
    def add_hold(self, req_id: str, block_ids: list[int], num_tokens: int, digest: str | None = None,
                 consumers: int = 1) -> None:
        """See :meth:`dlmix.pd.producer.Producer.add_hold`."""
        self.producer.add_hold(req_id, block_ids, num_tokens, digest, consumers)

    def is_held(self, req_id: str) -> bool:
        return self.producer.is_held(req_id)

    def held_count(self) -> int:
        return self.producer.held_count()

    def take_finished(self) -> set[str]:
        """See :meth:`dlmix.pd.producer.Producer.take_finished`."""
        return self.producer.take_finished()

    def engine_abort(self, req_id: str) -> None:
        """See :meth:`dlmix.pd.producer.Producer.engine_abort`."""
        self.producer.engine_abort(req_id)

    # ------------------------------------------------------------------ consumer side
    def release(self, remote: dict[str, Any], remote_req_id: str, consumed: bool) -> None:
        """See :meth:`dlmix.pd.consumer.Consumer.release`."""
        self.consumer.release(remote, remote_req_id, consumed)

    def pull(self, remote: dict[str, Any], remote_req_id: str, remote_block_ids: list[int], start: int, end: int,
             local_block_ids: list[int], cancelled: Callable[[], bool] = lambda: False, *,
             src_layout: KVLayout | dict[str, Any] | None = None, digest: str | None = None,
             dst_layers: list[Any] | None = None, consumers: int = 1) -> PullResult:
        """See :meth:`dlmix.pd.consumer.Consumer.pull`. Never raises."""
        return self.consumer.pull(remote, remote_req_id, remote_block_ids, start, end, local_block_ids, cancelled,
                                  src_layout=src_layout, digest=digest, dst_layers=dst_layers, consumers=consumers)

    def pull_params(self, params: Any, start: int, end: int, local_block_ids: list[int],
                    cancelled: Callable[[], bool] = lambda: False, *, digest: str | None = None) -> PullResult:
        """See :meth:`dlmix.pd.consumer.Consumer.pull_params`."""
        return self.consumer.pull_params(params, start, end, local_block_ids, cancelled, digest=digest)
