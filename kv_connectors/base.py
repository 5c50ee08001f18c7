"""The dlmix KV transport interface: memory regions, grants, one-sided reads/writes, notifications.

A *transport* is one endpoint of a KV-cache transfer link. It

* **registers memory regions** under names (``register("kv_layer_0", tensor)``): host memory always (a contiguous
  ``torch.Tensor`` on CPU, a C-contiguous ``numpy.ndarray``, a ``memoryview``/``bytearray``, or a raw ``(ptr, length)``
  pair); device memory only where :attr:`Transport.supports_device_memory` says so;
* **describes itself** for a peer (:meth:`Transport.descriptor`, a small JSON-able dict sent over any side channel:
  the KV-transfer params of a request, an HTTP bootstrap, a ZMQ message);
* **connects** to a peer from its descriptor (:meth:`Transport.connect`): both sides prove knowledge of the shared
  secret with an HMAC challenge-response (the secret never crosses the wire);
* moves **scatter-gather lists** of :class:`Segment` ``(local_region, local_offset, remote_region, remote_offset,
  length)`` as one-sided **writes** (push: local → remote, :meth:`Transport.write`) and **reads** (pull: remote → local,
  :meth:`Transport.read`). Both return at once with a :class:`TransferHandle` (``done()``, ``wait(timeout)``,
  ``result()``, ``cancel()``, ``await handle``); a per-transfer timeout fails a stalled transfer;
* enforces **grants**: the owner of a region allows one named peer to read and/or write specific
  ``(region, offset, length)`` ranges for one transfer id (:meth:`Transport.grant`, :meth:`Transport.revoke`). A one-
  sided op from a peer outside an active grant is refused and the initiator's handle fails with :class:`GrantError`;
* carries small **notifications** (JSON-able dicts such as ``{"type": "blocks_ready", ...}``) beside the data
  (:meth:`Transport.notify`, :meth:`Transport.get_notification`, :meth:`Transport.on_notify`).

Threading: every transport owns its background I/O threads. All public methods are safe to call from synchronous
code (vLLM's worker) and from any thread; none of them needs a running event loop. ``await handle`` works from asyncio
code as well.

Typical use (vLLM prefill worker = owner, decode worker = initiator that pulls)::

    t = make_transport("tcp", name="prefill-0", secret=cfg_secret)       # listens on 127.0.0.1, free port
    t.register("kv", kv_cache_tensor)                                     # once, at start-up
    desc = t.descriptor()                                                 # -> send to decode with the request
    # per request:
    t.grant("decode-0", req_id, [("kv", blk * blk_bytes, blk_bytes) for blk in blocks], mode="r", expires_s=120)
    t.notify("decode-0", {"type": "blocks_ready", "req": req_id, "blocks": blocks})   # once decode is connected

    d = make_transport("tcp", name="decode-0", secret=cfg_secret)
    d.register("kv", decode_kv_tensor)
    d.connect(desc)                                                       # -> "prefill-0"
    h = d.read("prefill-0", [Segment("kv", dst_off, "kv", src_off, n) for ...], transfer_id=req_id, timeout_s=30)
    h.result()                                                            # or poll h.done() every step
    d.notify("prefill-0", {"type": "blocks_consumed", "req": req_id})

Creating transports: :func:`make_transport` looks the kind up in a registry. A new transport is ONE module whose
class is decorated with :func:`register_transport`: a file ``dlmix_kv_connectors/<kind>.py`` (found by its name and
imported on first use, see :data:`BUILTIN_KINDS`), or a module of any installed distribution that declares it under
the ``dlmix.transports`` entry-point group (:data:`ENTRY_POINT_GROUP`); ``"package.module:ClassName"`` works as a
kind too. :func:`transport_kinds` lists every known kind without importing any.
"""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures as cf
import ctypes
import importlib
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping, NamedTuple, Sequence

__all__ = [
    "TransportError",
    "AuthError",
    "GrantError",
    "TransferTimeout",
    "TransferCancelled",
    "PeerError",
    "ProtocolError",
    "UnsupportedMemoryError",
    "Segment",
    "Range",
    "Region",
    "Notification",
    "TransferHandle",
    "Transport",
    "register_transport",
    "make_transport",
    "available_transports",
    "BUILTIN_KINDS",
    "ENTRY_POINT_GROUP",
    "transport_kinds",
    "NOTIFY_BLOCKS_READY",
    "NOTIFY_BLOCKS_CONSUMED",
    "NOTIFY_ABORT",
    "region_memory",
]

# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------


class TransportError(RuntimeError):
    """Base class of every error a dlmix transport raises or fails a handle with."""


class AuthError(TransportError):
    """The peer failed the HMAC challenge-response (wrong shared secret, or not a dlmix peer)."""


class GrantError(TransportError, PermissionError):
    """The owner refused a one-sided op: no active grant for (peer, transfer id), wrong mode, expired grant, or a
    segment outside the granted ranges / outside the registered region."""


class TransferTimeout(TransportError, TimeoutError):
    """A transfer (or connect) did not complete within its timeout; the peer is dead or stalled."""


class TransferCancelled(TransportError):
    """The transfer was cancelled with :meth:`TransferHandle.cancel` (``result()`` raises this)."""


class PeerError(TransportError, ConnectionError):
    """The connection to the peer failed or closed while the transfer was in flight (peer killed, reset, ...)."""


class ProtocolError(TransportError):
    """A malformed, truncated or oversized frame arrived; the connection that carried it is closed."""


class UnsupportedMemoryError(TransportError, TypeError):
    """The object cannot be registered with this transport (non-contiguous, device memory on a host-only transport,
    unknown type)."""


# --------------------------------------------------------------------------------------------------------------------
# Value types
# --------------------------------------------------------------------------------------------------------------------

NOTIFY_BLOCKS_READY = "blocks_ready"  #: conventional ``msg["type"]``: owner → peer, the granted blocks hold valid KV
NOTIFY_BLOCKS_CONSUMED = "blocks_consumed"  #: peer → owner, the peer has read the blocks; the owner may free them
NOTIFY_ABORT = "abort"  #: either side: the request was aborted; drop its grants and blocks


class Segment(NamedTuple):
    """One scatter-gather element of a transfer (all in bytes).

    ``length`` bytes at ``local_offset`` of the local region named ``local_region`` correspond to ``length`` bytes at
    ``remote_offset`` of the peer's region ``remote_region``. A write copies local → remote, a read remote → local.
    """

    local_region: str
    local_offset: int
    remote_region: str
    remote_offset: int
    length: int


class Range(NamedTuple):
    """A byte range ``[offset, offset + length)`` of the owner's region ``region`` (used by grants)."""

    region: str
    offset: int
    length: int


@dataclass
class Region:
    """A registered memory region (returned by :meth:`Transport.register`).

    Attributes:
        name: the name peers use to address it.
        ptr: its start address (host virtual address, or device address for device memory).
        length: its size in bytes.
        device: ``"cpu"`` or a device string such as ``"cuda:0"``.
        readonly: True when the memory cannot be written (bytes, read-only numpy arrays); only ``mode="r"`` grants.
        view: a writable (or read-only) flat byte ``memoryview`` of host memory; ``None`` for device memory.
        keepalive: the registered object, kept referenced so the memory stays valid while registered.
    """

    name: str
    ptr: int
    length: int
    device: str = "cpu"
    readonly: bool = False
    view: memoryview | None = None
    keepalive: Any = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Notification:
    """A small control message received from a peer: ``peer`` is the sender's authenticated name, ``msg`` the dict."""

    peer: str
    msg: dict


# --------------------------------------------------------------------------------------------------------------------
# Memory helpers
# --------------------------------------------------------------------------------------------------------------------


def _view_from_ptr(ptr: int, length: int) -> memoryview:
    if length == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * length).from_address(ptr)).cast("B")


def _addr_of_view(mv: memoryview) -> int:
    import numpy as np

    if mv.nbytes == 0:
        return 0
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


def region_memory(mem: Any) -> tuple[int, int, str, bool, memoryview | None, Any]:
    """Resolve a registrable object to ``(ptr, length_bytes, device, readonly, flat_byte_view_or_None, keepalive)``.

    Accepted: a contiguous ``torch.Tensor`` (any dtype; CPU tensors get a byte view, device tensors only a pointer), a
    C-contiguous ``numpy.ndarray``, a ``bytearray``/``bytes``/``memoryview`` (contiguous), or a ``(ptr, length)``
    tuple of ints naming host memory the caller keeps alive.

    Raises:
        UnsupportedMemoryError: non-contiguous memory or an unknown type.
    """
    if isinstance(mem, tuple) and len(mem) == 2 and all(isinstance(x, int) for x in mem):
        if any(isinstance(x, bool) for x in mem):
            raise UnsupportedMemoryError(f"bad (ptr, length) region: {mem!r} (booleans are not addresses)")
        ptr, length = mem
        if ptr <= 0 or length < 0:
            raise UnsupportedMemoryError(f"bad (ptr, length) region: ({ptr:#x}, {length})")
        return ptr, length, "cpu", False, _view_from_ptr(ptr, length), None
    mod = type(mem).__module__
    if mod.startswith("torch"):
        if not mem.is_contiguous():
            raise UnsupportedMemoryError("torch tensor must be contiguous to be registered")
        length = mem.numel() * mem.element_size()
        ptr = int(mem.data_ptr())
        dev = str(mem.device)
        if mem.device.type != "cpu":
            return ptr, length, dev, False, None, mem
        return ptr, length, "cpu", False, _view_from_ptr(ptr, length) if length else memoryview(bytearray(0)), mem
    if mod == "numpy":
        if not mem.flags["C_CONTIGUOUS"]:
            raise UnsupportedMemoryError("numpy array must be C-contiguous to be registered")
        ro = not mem.flags["WRITEABLE"]
        mv = memoryview(mem.reshape(-1).view("u1")) if mem.size else memoryview(bytearray(0))
        return int(mem.ctypes.data), mem.nbytes, "cpu", ro, mv, mem
    if isinstance(mem, (bytearray, bytes, memoryview)):
        mv = memoryview(mem)
        if not mv.c_contiguous:
            raise UnsupportedMemoryError("memoryview must be C-contiguous to be registered")
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        return _addr_of_view(mv), mv.nbytes, "cpu", bool(mv.readonly), mv, mem
    raise UnsupportedMemoryError(
        f"cannot register {type(mem).__name__}: use a torch tensor, numpy array, bytearray/memoryview or (ptr, length)"
    )


# --------------------------------------------------------------------------------------------------------------------
# Transfer handle
# --------------------------------------------------------------------------------------------------------------------


class TransferHandle:
    """Completion handle of one asynchronous transfer (returned by :meth:`Transport.read` / :meth:`Transport.write`).

    Thread-safe. The result of a successful transfer is the number of bytes moved (int). Failures are one of
    :class:`GrantError`, :class:`TransferTimeout`, :class:`PeerError`, :class:`ProtocolError`,
    :class:`TransferCancelled` (all :class:`TransportError`).

    * ``done()`` — True once finished (success, failure or cancel); never blocks (poll it from a scheduler step).
    * ``wait(timeout=None)`` — block up to ``timeout`` seconds; returns ``done()``; never raises the transfer's error.
    * ``result(timeout=None)`` — block, then return bytes moved or raise the transfer's error (``TimeoutError`` of
      ``concurrent.futures`` only if *this wait* times out while the transfer is still running).
    * ``exception(timeout=None)`` — the error or None.
    * ``cancel()`` — stop the transfer; returns True if it was still running. After ``cancel()`` returns, the transport
      writes no more bytes into local memory for this transfer (remote memory of a cancelled write may be partial).
    * ``await handle`` — from asyncio code, on any loop; returns the result or raises.
    """

    __slots__ = ("transfer_id", "nbytes", "_state", "_value", "_exc", "_running", "_cbs", "_canceller", "_lock",
                 "started", "finished", "_drive", "_nudge", "_xfer", "__weakref__")

    def __init__(self, transfer_id: str, nbytes: int, canceller: Callable[["TransferHandle"], None] | None = None):
        self.transfer_id = transfer_id
        #: total bytes this transfer moves (sum of segment lengths)
        self.nbytes = nbytes
        # completion: one plain lock, held while the transfer runs and released once it is done (waiters acquire
        # and release it); lighter than a concurrent.futures.Future (no Condition, no waiter list per handle)
        self._state = 0  # 0 running, 1 ok, 2 failed
        self._value = 0
        self._exc: BaseException | None = None
        self._running = threading.Lock()
        self._running.acquire()
        self._cbs: list | None = None
        self._canceller = canceller
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.finished: float | None = None
        #: set by a transport that can make progress in the waiting thread: ``_drive(handle, deadline)`` is called
        #: by ``result``/``wait``/``exception`` before blocking (``deadline`` = ``time.monotonic()`` value or None)
        self._drive: Callable[["TransferHandle", float | None], None] | None = None
        #: set by such a transport: ``_nudge(handle)`` asks it to make progress without this thread (called when the
        #: handle is polled with ``done()`` or given a callback while running)
        self._nudge: Callable[["TransferHandle"], None] | None = None
        #: the transport's own record of this transfer (opaque here)
        self._xfer: Any = None

    # -- producer side (transports) --
    def _finish(self, state: int, value: int, exc: BaseException | None) -> bool:
        lock = self._lock
        lock.acquire()
        if self._state:
            lock.release()
            return False
        self.finished = time.monotonic()
        self._value, self._exc, self._state = value, exc, state
        cbs, self._cbs = self._cbs, None
        self._running.release()
        lock.release()
        if cbs:
            for fn in cbs:
                try:
                    fn(self)
                except Exception:  # a callback's failure is not the transfer's
                    import logging

                    logging.getLogger("dlmix_kv_connectors").exception("transfer done-callback failed")
        return True

    def _set_result(self, value: int) -> bool:
        return self._finish(1, value, None)

    def _set_exception(self, exc: BaseException) -> bool:
        return self._finish(2, 0, exc)

    # -- consumer side --
    def done(self) -> bool:
        """True when the transfer finished (successfully or not). Non-blocking."""
        if self._state:
            return True
        if self._nudge is not None:
            self._nudge(self)
        return self._state != 0

    def _progress(self, timeout: float | None) -> float | None:
        """Let the transport complete the transfer in this thread (see ``_drive``); return the timeout left."""
        drive = self._drive
        if drive is None or self._state:
            return timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        drive(self, deadline)
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def wait(self, timeout: float | None = None) -> bool:
        """Block up to ``timeout`` seconds (None = forever) until done; return :meth:`done`. Never raises."""
        if self._state:
            return True
        timeout = self._progress(timeout)
        if not self._state and self._running.acquire(timeout=-1 if timeout is None else timeout):
            self._running.release()
        return self._state != 0

    def result(self, timeout: float | None = None) -> int:
        """Wait and return the number of bytes moved, or raise the transfer's :class:`TransportError`."""
        if not self.wait(timeout):
            raise cf.TimeoutError(f"transfer {self.transfer_id!r} still running after {timeout} s")
        if self._exc is not None:
            raise self._exc
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait and return the transfer's error, or None on success."""
        if not self.wait(timeout):
            raise cf.TimeoutError(f"transfer {self.transfer_id!r} still running after {timeout} s")
        return self._exc

    def ok(self) -> bool:
        """True when done and successful. Non-blocking."""
        return self._state == 1

    def cancel(self) -> bool:
        """Cancel the transfer. Returns True if it was still running (it now fails with :class:`TransferCancelled`)."""
        if not self._set_exception(TransferCancelled(f"transfer {self.transfer_id!r} cancelled")):
            return False
        if self._canceller is not None:
            self._canceller(self)  # returns once no more bytes can land in local memory
        return True

    def add_done_callback(self, fn: Callable[["TransferHandle"], None]) -> None:
        """Call ``fn(handle)`` once done (from the transport's thread, or at once if already done)."""
        with self._lock:
            running = not self._state
            if running:
                if self._cbs is None:
                    self._cbs = []
                self._cbs.append(fn)
        if not running:
            fn(self)
        elif self._nudge is not None:
            self._nudge(self)

    @property
    def elapsed_s(self) -> float:
        """Seconds from submission to completion (or to now if still running)."""
        return (self.finished or time.monotonic()) - self.started

    def __await__(self):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(h: "TransferHandle") -> None:
            if fut.done():
                return
            if h._exc is not None:
                fut.set_exception(h._exc)
            else:
                fut.set_result(h._value)

        self.add_done_callback(lambda h: loop.call_soon_threadsafe(settle, h))
        return fut.__await__()

    def __repr__(self) -> str:
        state = ("running", "ok", f"failed({type(self._exc).__name__})")[self._state]
        return f"<TransferHandle {self.transfer_id!r} {self.nbytes} B {state}>"


# --------------------------------------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------------------------------------


class Transport(abc.ABC):
    """One endpoint of dlmix KV transfers. See the module docstring for the model and an example.

    Common constructor keywords (every kind accepts them; kinds add their own, see each class):

    * ``name`` (str): this endpoint's peer id, used by peers in ``grant``/``notify``/``read``/``write``. Default:
      ``"<hostname>-<pid>-<random>"``.
    * ``secret`` (str | bytes): the shared secret for HMAC authentication; default ``$DLMIX_KV_SECRET``; required.
    * ``host`` (str): listen address, default ``"127.0.0.1"`` (loopback only). Use a real address only on trusted
      networks.
    * ``port`` (int): listen port, 0 = pick a free one.
    * ``timeout_s`` (float): default per-transfer and connect timeout in seconds (30).
    """

    #: registry name of this kind (set by :func:`register_transport`)
    kind: ClassVar[str] = ""
    #: True when :meth:`register` accepts device (e.g. CUDA) memory
    supports_device_memory: ClassVar[bool] = False

    # ---- lifecycle ----
    @property
    @abc.abstractmethod
    def name(self) -> str:
        """This endpoint's authenticated peer id."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop listening, close every connection, fail in-flight transfers with :class:`PeerError`. Idempotent."""

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- memory ----
    @abc.abstractmethod
    def register(self, name: str, mem: Any) -> Region:
        """Register memory under ``name`` so peers may address it (only through grants).

        Args:
            name: region name, unique on this endpoint (peers address ``(name, offset, length)``).
            mem: contiguous ``torch.Tensor`` / C-contiguous ``numpy.ndarray`` / ``bytearray`` / ``memoryview`` /
                ``(ptr, length)``; the caller keeps ``(ptr, length)`` memory alive until :meth:`unregister`.

        Returns: the :class:`Region` (name, ptr, length in bytes, device).

        Raises:
            ValueError: the name is already registered.
            UnsupportedMemoryError: unsupported object or device memory on a host-only transport.
        """

    @abc.abstractmethod
    def unregister(self, name: str) -> None:
        """Forget region ``name`` (and drop grants on it). Returns once no request of a peer that this endpoint serves
        can touch the region's memory any more (the caller may free or reuse it then). Raises KeyError if unknown."""

    @abc.abstractmethod
    def regions(self) -> dict[str, Region]:
        """The registered regions, by name (a copy)."""

    # ---- peers ----
    @abc.abstractmethod
    def descriptor(self) -> dict:
        """A small JSON-able dict a peer passes to :meth:`connect`: kind, name, address, regions (name → length,
        device) and kind-specific fields. Contains no secret. Call it again after registering more regions."""

    @abc.abstractmethod
    def connect(self, descriptor: Mapping[str, Any], timeout_s: float | None = None) -> str:
        """Connect and authenticate to the peer described by ``descriptor`` (from its :meth:`descriptor`).

        Idempotent per peer (a second call refreshes the peer's region table). Returns the peer's name.

        Raises:
            AuthError: the peer does not know the shared secret (or we do not know its).
            TransferTimeout: the link (every connection of it, handshakes included) not up within ``timeout_s``
                (default: the transport's ``timeout_s``).
            PeerError: connection refused / reset.
            ValueError: the descriptor is malformed or of another kind.
        """

    @abc.abstractmethod
    def peers(self) -> list[str]:
        """Names of peers with a live authenticated connection (inbound or outbound)."""

    # ---- grants (owner side) ----
    @abc.abstractmethod
    def grant(
        self,
        peer_id: str,
        transfer_id: str,
        ranges: Iterable[Range | tuple[str, int, int]],
        mode: str = "r",
        expires_s: float | None = 300.0,
    ) -> None:
        """Allow peer ``peer_id`` one-sided access to ``ranges`` of local regions for transfer ``transfer_id``.

        Args:
            peer_id: the peer's authenticated name.
            transfer_id: the id the peer passes to :meth:`read`/:meth:`write` (e.g. the request id).
            ranges: ``(region, offset, length)`` byte ranges; each must lie inside the registered region.
            mode: ``"r"`` (peer may read), ``"w"`` (peer may write) or ``"rw"``.
            expires_s: the grant lapses after this many seconds (None = until revoked).

        A second grant with the same ``transfer_id`` adds ranges (it must name the same peer). Each segment of a peer's
        op must lie wholly inside one granted range.

        Raises:
            KeyError: unknown region. ValueError: range outside the region or not ``(region, offset, length)``,
            bad mode, ``expires_s`` not a finite number >= 0 (nor None), or a different peer for an existing transfer
            id; nothing is granted then. GrantError: ``"w"`` on a read-only region.
        """

    @abc.abstractmethod
    def revoke(self, transfer_id: str) -> bool:
        """Drop the grant of ``transfer_id``; returns whether one existed. Ops already being served finish."""

    # ---- data ----
    @abc.abstractmethod
    def write(
        self,
        peer_id: str,
        segments: Sequence[Segment | tuple[str, int, str, int, int]],
        transfer_id: str,
        timeout_s: float | None = None,
    ) -> TransferHandle:
        """Push: copy each segment's local bytes into the peer's memory, inside the peer's grant ``transfer_id``
        (mode ``"w"``). Returns immediately; the handle's result is the number of bytes written.

        ``timeout_s``: the transfer's deadline in seconds from now (None: the transport's own ``timeout_s``).

        Raises at once (not via the handle): ``KeyError`` unknown local region, ``ValueError`` segment outside the
        local region or negative, or ``timeout_s`` not a positive finite number, ``PeerError`` not connected to
        ``peer_id``. Everything else fails the handle.
        """

    @abc.abstractmethod
    def read(
        self,
        peer_id: str,
        segments: Sequence[Segment | tuple[str, int, str, int, int]],
        transfer_id: str,
        timeout_s: float | None = None,
    ) -> TransferHandle:
        """Pull: copy each segment's remote bytes from the peer into local memory, inside the peer's grant
        ``transfer_id`` (mode ``"r"``). Returns immediately; same errors as :meth:`write`."""

    # ---- notifications ----
    @abc.abstractmethod
    def notify(self, peer_id: str, msg: Mapping[str, Any], timeout_s: float | None = None) -> None:
        """Send a small JSON-able dict to a connected peer (over the authenticated control channel). Blocks until the
        message is handed to the kernel, at most ``timeout_s`` seconds (None: the transport's own timeout). Raises
        ``PeerError`` if not connected, ``ValueError`` if not JSON-able, larger than the control-frame limit or
        ``timeout_s`` not a positive finite number, ``TransferTimeout`` if the peer stopped reading and the message could not be handed over in time (that
        connection is dropped: a frame may have been cut)."""

    @abc.abstractmethod
    def get_notification(self, timeout: float | None = 0.0) -> Notification | None:
        """Pop the oldest received notification, waiting up to ``timeout`` seconds (0 = poll, None = forever);
        None if none arrived. Not used when a handler is set with :meth:`on_notify`."""

    @abc.abstractmethod
    def on_notify(self, handler: Callable[[Notification], None] | None) -> None:
        """Call ``handler(notification)`` on the transport's I/O thread for each notification (keep it short; it must
        not block). ``None`` switches back to queueing for :meth:`get_notification`."""

    # ---- conveniences ----
    def drain_notifications(self) -> list[Notification]:
        """All queued notifications, without waiting."""
        out = []
        while (n := self.get_notification(0.0)) is not None:
            out.append(n)
        return out


# --------------------------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------------------------

#: entry-point group of third-party transports: ``kind = "package.module:Class"`` (or ``"package.module"`` whose
#: import registers ``kind`` with :func:`register_transport`). Declared in the distribution's metadata, e.g.
#: ``[project.entry-points."dlmix.transports"] mykind = "my_pkg.transport:MyTransport"`` in its pyproject.toml.
ENTRY_POINT_GROUP = "dlmix.transports"
#: modules of this package that are not transports
_NOT_TRANSPORTS = frozenset({"base", "testing"})


def _builtin_kinds() -> dict[str, str]:
    """Built-in kinds → module, discovered from the package's files without importing them: every public module of
    ``dlmix_kv_connectors`` (except ``base`` and ``testing``) is a transport whose kind is its file name."""
    import os
    import pkgutil

    pkg = __name__.rpartition(".")[0]
    return {m.name: f"{pkg}.{m.name}" for m in pkgutil.iter_modules([os.path.dirname(os.path.abspath(__file__))])
            if not m.name.startswith("_") and m.name not in _NOT_TRANSPORTS}


#: built-in kinds → the module that registers them (imported on first use); adding ``kv_connectors/<kind>.py`` with
#: a :func:`register_transport` class adds a kind, nothing else to edit.
BUILTIN_KINDS: dict[str, str] = _builtin_kinds()

_REGISTRY: dict[str, type[Transport]] = {}


def register_transport(kind: str) -> Callable[[type[Transport]], type[Transport]]:
    """Class decorator: make ``make_transport(kind, ...)`` build this class. Raises ValueError on a duplicate kind or
    a kind that is not a non-empty name without ``":"`` (that form means ``"module:Class"``)."""
    if not isinstance(kind, str) or not kind or ":" in kind:
        raise ValueError(f"transport kind must be a non-empty str without ':', not {kind!r}")

    def deco(cls: type[Transport]) -> type[Transport]:
        if not (isinstance(cls, type) and issubclass(cls, Transport)):
            raise ValueError(f"{cls!r} is not a Transport subclass")
        if kind in BUILTIN_KINDS and cls.__module__ != BUILTIN_KINDS[kind]:
            # refused even before the built-in module is imported: otherwise whichever imports first takes the kind
            raise ValueError(f"transport kind {kind!r} is built in ({BUILTIN_KINDS[kind]}); register "
                             f"{cls.__module__}.{cls.__qualname__} under another kind")
        if kind in _REGISTRY and _REGISTRY[kind] is not cls:
            raise ValueError(f"transport kind {kind!r} already registered by {_REGISTRY[kind].__module__}."
                             f"{_REGISTRY[kind].__qualname__}")
        cls.kind = kind
        _REGISTRY[kind] = cls
        return cls

    return deco


def _entry_points() -> dict[str, Any]:
    """Kind → entry point of every installed distribution's ``dlmix.transports`` group (read afresh each call, so a
    distribution added to ``sys.path`` at run time is seen)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _load_entry_point(kind: str, ep: Any) -> type[Transport]:
    try:
        obj = ep.load()
    except ImportError:
        raise
    except Exception as e:  # a broken plugin: say which one
        raise ValueError(f"transport kind {kind!r}: loading entry point {ep.value!r} failed: "
                         f"{type(e).__name__}: {e}") from None
    if isinstance(obj, type) and issubclass(obj, Transport):
        if _REGISTRY.get(kind) is not obj:
            register_transport(kind)(obj)
        return obj
    if kind in _REGISTRY:  # a module whose import registered the kind
        return _REGISTRY[kind]
    raise ValueError(f"transport kind {kind!r}: entry point {ep.value!r} is neither a Transport subclass nor a module "
                     f"registering {kind!r}")


def transport_kinds() -> list[str]:
    """Every kind :func:`make_transport` knows, without importing any transport: registered ones, the package's own
    modules (:data:`BUILTIN_KINDS`) and the ``dlmix.transports`` entry points. Sorted; includes kinds whose optional
    package is missing (see :func:`available_transports` for which can be built here)."""
    return sorted(set(_REGISTRY) | set(BUILTIN_KINDS) | set(_entry_points()))


def _resolve(kind: str) -> type[Transport]:
    if not isinstance(kind, str):
        raise ValueError(f"transport kind must be a str, not {type(kind).__name__}")
    if kind in _REGISTRY:
        return _REGISTRY[kind]
    if kind in BUILTIN_KINDS:
        ep = _entry_points().get(kind)
        if ep is not None:  # a third-party entry point under a built-in kind is never used: say so
            warnings.warn(f"transport entry point {kind!r} = {ep.value!r} is ignored: {kind!r} is a built-in kind "
                          f"({BUILTIN_KINDS[kind]}); publish it under another kind", RuntimeWarning, stacklevel=3)
        importlib.import_module(BUILTIN_KINDS[kind])  # ImportError (missing optional package) propagates
        if kind in _REGISTRY:
            return _REGISTRY[kind]
        raise ValueError(f"module {BUILTIN_KINDS[kind]} registers no transport kind {kind!r} (a built-in transport "
                         "module must be named after its kind)")
    if ":" in kind:
        mod, _, attr = kind.partition(":")
        cls = getattr(importlib.import_module(mod), attr)
        if not (isinstance(cls, type) and issubclass(cls, Transport)):
            raise ValueError(f"{kind!r} is not a Transport subclass")
        return cls
    ep = _entry_points().get(kind)
    if ep is not None:
        return _load_entry_point(kind, ep)
    raise ValueError(f"unknown transport kind {kind!r}; known: {transport_kinds()}")


def make_transport(kind: str = "tcp", **cfg: Any) -> Transport:
    """Build a transport of ``kind`` from config keywords (see :class:`Transport` for the common ones).

    ``kind`` is a known name (:func:`transport_kinds`: ``"tcp"``, ``"shm"``, ``"mooncake"``, ``"nixl"``,
    ``"dlslime"``, any kind registered with :func:`register_transport` or declared under the ``dlmix.transports``
    entry-point group) or ``"package.module:ClassName"``.

    Raises:
        ValueError: unknown kind (the message lists the known ones) or a broken entry point. ImportError: the
        kind's optional package is not installed (message names it).
    """
    return _resolve(kind)(**cfg)


def available_transports() -> dict[str, str | None]:
    """Map every built-in/registered kind to None when it can be built here, else the reason (e.g. the ImportError)."""
    out: dict[str, str | None] = {}
    for kind in transport_kinds():
        try:
            cls = _resolve(kind)
            check = getattr(cls, "check_available", None)
            out[kind] = check() if check else None
        except Exception as e:  # noqa: BLE001 - report any reason
            out[kind] = f"{type(e).__name__}: {e}"
    return out
