"""The shared endpoint of every dlmix transport: authenticated TCP links, grants, notifications, timeouts, and the
built-in TCP data path. Adapters and the same-host path subclass :class:`Endpoint` and override its data-path hooks.

Threads (all daemons, owned by the endpoint):

* one acceptor (listener on ``host:port``, 127.0.0.1 by default) that authenticates each inbound connection on its
  own short-lived thread;
* one reader per connection. On an *inbound* connection (a peer → us) it serves the peer's one-sided requests: checks
  the grant, then receives a write's payload straight into the region (``recvmsg_into`` on memoryviews of the region)
  or sends a read's bytes straight from the region (``sendmsg`` of memoryviews). On an *outbound* connection (us → the
  peer) it receives responses, a read's payload straight into the destination views; but a thread that waits on its
  own transfer (``result()``/``wait()``) reads the response itself (``Endpoint._drive``: no wake-up of the reader and
  no hand-off back). A transfer sent as one chunk disarms the reader's epoll *before* its request goes out, so the
  reader thread cannot race the waiter for the response; the waiter arms it again when done, and whatever cannot
  drive (``done()`` polling, callbacks, a short wait, and the reaper after 50 ms) arms it too. Every connection reads
  through a buffered :class:`._wire.FrameReader` (header, body and a small payload in one ``recv``);
* one sender per outbound connection for large write payloads (small ones are sent inline by the caller);
* one reaper that fails transfers past their deadline (:class:`TransferTimeout`) and purges expired grants.

A link to a peer is ``stripes`` outbound connections; a transfer is cut into chunks of at most ``chunk_bytes`` bytes
and ``segs_per_frame`` segments (many small KV blocks travel in one frame), spread over the stripes.
"""
from __future__ import annotations

import bisect
import hashlib
import hmac
import itertools
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
import uuid
from typing import Any, Callable, Mapping

import msgspec

from . import _wire as W
from .base import (
    AuthError,
    GrantError,
    Notification,
    PeerError,
    ProtocolError,
    Region,
    Segment,
    TransferHandle,
    TransferTimeout,
    Transport,
    TransportError,
    UnsupportedMemoryError,
    region_memory,
)

log = logging.getLogger("dlmix_kv_connectors")

#: the reason an endpoint gives a connection it will not authenticate now (too many handshakes from its address)
BUSY = "busy"


class _PeerBusy(PeerError):
    """The peer answered a new connection ``busy`` (:data:`BUSY`) before the handshake: try again shortly."""


def _host_id() -> str:
    """Identifies 'same host, same PID namespace' (boot id + pid-namespace inode)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = "?"
    return hashlib.sha256(f"{boot}|{ns}".encode()).hexdigest()[:16]


HOST_ID = _host_id()


def _seconds(what: str, v: Any, zero_ok: bool = False) -> float:
    """``v`` as seconds: a finite int or float, > 0 (``zero_ok``: >= 0); else ValueError naming ``what`` (a NaN or
    infinite deadline is never reached; True is not a duration)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
            (0 <= v if zero_ok else 0 < v) and v < float("inf")):
        raise ValueError(f"{what} must be a finite number of seconds {'>= 0' if zero_ok else '> 0'}, got {v!r}")
    return float(v)


class _Grant:
    __slots__ = ("peer", "expires", "table")

    def __init__(self, peer: str):
        self.peer = peer
        self.expires: float | None = None
        # mode letter -> region -> (starts, ends) of sorted disjoint merged intervals
        self.table: dict[str, dict[str, tuple[list[int], list[int]]]] = {"r": {}, "w": {}}

    def add(self, mode: str, region: str, spans: list[tuple[int, int]]) -> None:
        """Grant ``spans`` (``(offset, length)`` pairs, bytes) of ``region`` for ``mode``: merged with what is
        granted already, in one sort (O(n log n) for n spans; a span at a time was quadratic)."""
        starts, ends = self.table[mode].get(region, ([], []))
        ivs = sorted(list(zip(starts, ends)) + [(off, off + ln) for off, ln in spans])
        ms: list[int] = []
        me: list[int] = []
        for s, e in ivs:
            if ms and s <= me[-1]:
                me[-1] = max(me[-1], e)
            else:
                ms.append(s)
                me.append(e)
        self.table[mode][region] = (ms, me)


class _Gate:
    """A cheap ``threading.Event`` stand-in for "no byte is landing in this chunk": a lock held while bytes may land.
    ``clear()`` (receiver, before receiving), ``set()`` (receiver, after; idempotent), ``wait(timeout)`` (cancel)."""

    __slots__ = ("_l",)

    def __init__(self):
        self._l = threading.Lock()

    def clear(self) -> None:
        self._l.acquire()

    def set(self) -> None:
        try:
            self._l.release()
        except RuntimeError:  # already set
            pass

    def wait(self, timeout: float | None = None) -> bool:
        if self._l.acquire(timeout=-1 if timeout is None else timeout):
            self._l.release()
            return True
        return False

    def is_set(self) -> bool:
        return not self._l.locked()


class _Chunk:
    __slots__ = ("id", "xfer", "op", "dp", "segs", "views", "nbytes", "iov", "lock", "receiving", "recv_done",
                 "discard", "conn", "extra")

    def __init__(self, xfer: "_Xfer", op: str, dp: str, segs: list, views: list, nbytes: int, iov=None):
        self.id = 0
        self.xfer = xfer
        self.op = op
        self.dp = dp
        self.segs = segs
        self.views = views
        self.nbytes = nbytes
        self.iov = iov or []
        self.lock = xfer.lock  # never held together with another lock of the transfer; one allocation less
        self.receiving = False
        self.recv_done = _Gate()
        self.discard = False
        self.conn: _Conn | None = None
        self.extra: Any = None

    def begin_receiving(self) -> bool:
        """Mark bytes as about to land in this chunk's local memory, unless it was cancelled (``discard``).

        Returns False when cancelled: the caller must then not touch local memory. Cancellation waits on
        ``recv_done`` so it returns only once no byte can still land."""
        lock = self.lock
        lock.acquire()
        if self.discard:
            lock.release()
            return False
        self.receiving = True
        self.recv_done.clear()
        lock.release()
        return True

    def end_receiving(self) -> None:
        """Mark that no byte lands in this chunk's local memory any more (after :meth:`begin_receiving` returned
        True, whatever the outcome); reports its transfer's failure when one waits for it (:meth:`_Xfer.fail`)."""
        self.receiving = False
        self.recv_done.set()
        x = self.xfer
        if x.failed is not None:
            x.landed()


class _Xfer:
    __slots__ = ("handle", "peer", "op", "chunks", "remaining", "moved", "lock", "deadline", "key", "cause",
                 "failed")

    def __init__(self, handle: TransferHandle, peer: str, op: str, deadline: float):
        self.handle = handle
        self.peer = peer
        self.op = op
        self.chunks: list[_Chunk] = []
        self.remaining = 0
        self.moved = 0
        self.lock = threading.Lock()
        self.deadline = deadline
        self.key = id(handle)
        self.cause: BaseException | None = None  # set before tearing connections down (timeout)
        #: the first error of a failed transfer; reported once no chunk is receiving (see ``fail``)
        self.failed: BaseException | None = None

    def chunk_done(self, n: int) -> bool:
        lock = self.lock
        lock.acquire()
        self.remaining -= 1
        self.moved += n
        last = self.remaining == 0
        lock.release()
        if last:
            self.handle._set_result(self.moved)
        return last

    def fail(self, err: BaseException) -> None:
        """Fail the transfer with ``err`` (or with ``cause``, or the first error already given): no chunk starts
        receiving any more, and the handle fails at once unless a chunk is receiving its payload; then the last
        such chunk reports it as it ends (:meth:`_Chunk.end_receiving`), so a failure is never seen while a byte
        of the transfer can still land in local memory (a stalled one is cut off at the transfer's deadline)."""
        lock = self.lock
        lock.acquire()
        if self.failed is None:
            self.failed = self.cause or err
        busy = False
        for c in self.chunks:
            c.discard = True
            if c.receiving:
                busy = True
        lock.release()
        if not busy:
            self.handle._set_exception(self.failed)

    def landed(self) -> None:
        """A chunk of the failed transfer stopped receiving: report the failure once no chunk receives."""
        lock = self.lock
        lock.acquire()
        busy = any(c.receiving for c in self.chunks)
        lock.release()
        if not busy:
            self.handle._set_exception(self.failed)


class _Conn:
    def __init__(self, sock: socket.socket, peer: str, outbound: bool, info: dict):
        self.sock = sock
        self.peer = peer
        self.outbound = outbound
        self.info = info
        self.send_lock = threading.Lock()
        self.pending: dict[int, _Chunk] = {}
        #: inbound: time.monotonic() by which the request being served must be done (0: none being served); the
        #: reaper drops the connection past it (a peer that stopped reading a response or sending a payload)
        self.serve_deadline = 0.0
        #: inbound: the checked ``(Region, offset, length)`` list of the request being served, set by the grant check
        #: under the endpoint lock (None between requests); ``unregister()`` waits for the requests it names a region in
        self.serving: list | None = None
        self.alive = True
        self.sendq: queue.SimpleQueue | None = None
        self.queued_bytes = 0
        self.rx = W.FrameReader(sock)
        #: held by whoever reads frames of an outbound connection (its reader thread, or a waiter in ``_drive``)
        self.rx_lock = threading.Lock()
        self.cpoll = select.poll()  # used only under rx_lock
        self.rx_owner = 0  # thread id of the reader thread while it holds rx_lock
        self.cpoll.register(sock, select.POLLIN)
        self.fd = sock.fileno()
        # the reader thread of an outbound connection waits on this epoll. A transfer whose one chunk travels here
        # disarms it before sending its request (``Endpoint._launch``) and the waiter re-arms it once it has read its
        # own response (``Endpoint._drive``), so the reader thread is not woken by bytes it would not read; anything
        # that cannot drive (``done()`` polling, callbacks, a short wait, the reaper's safety net) arms it again
        self.ep = select.epoll() if outbound and hasattr(select, "epoll") else None
        self.armed = True
        self.disarmed_at = 0.0
        self.arm_lock = threading.Lock()
        #: eventfd in the reader's epoll: a waiter that leaves bytes of a next frame buffered in ``rx`` pokes it
        self.wake_fd = -1
        if self.ep is not None:
            self.ep.register(self.fd, select.EPOLLIN)
            if hasattr(os, "eventfd"):
                self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                self.ep.register(self.wake_fd, select.EPOLLIN)

    def arm(self, on: bool) -> None:
        """(Dis)arm the reader thread's wake-up on readable bytes (EPOLLHUP/EPOLLERR always wake it). One
        ``epoll_ctl`` per change of state, none when the state is already ``on``."""
        if self.ep is None or self.armed is on:
            return
        with self.arm_lock:
            if self.armed is on:
                return
            try:
                self.ep.modify(self.fd, select.EPOLLIN if on else 0)
            except (OSError, ValueError):  # closed meanwhile
                pass
            self.armed = on
            if not on:
                self.disarmed_at = time.monotonic()

    def poke(self) -> None:
        """Wake the reader thread although the socket has no new bytes (a frame is already buffered in ``rx``, or
        the connection was dropped: closing a socket does not wake an ``epoll_wait`` on it)."""
        if self.wake_fd >= 0:
            with self.arm_lock:  # not after close_poll: the descriptor's number may already belong to another file
                if self.wake_fd >= 0:
                    try:
                        os.eventfd_write(self.wake_fd, 1)
                    except OSError:
                        pass

    def close_poll(self) -> None:
        """Release the reader's epoll and eventfd (the reader thread, on exit)."""
        with self.arm_lock:
            if self.ep is not None:
                self.ep.close()
            if self.wake_fd >= 0:
                try:
                    os.close(self.wake_fd)
                except OSError:
                    pass
                self.wake_fd = -1

    def shutdown(self) -> None:
        self.alive = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _norm_segments(segments) -> list[Segment]:
    out = []
    for s in segments:
        if type(s) is not Segment:
            s = Segment(*s)
        lr, lo, rr, ro, ln = s
        if type(lr) is not str or type(rr) is not str:
            if not isinstance(lr, str) or not isinstance(rr, str):
                raise ValueError(f"segment {s}: region names must be str")
        if type(lo) is not int or type(ro) is not int or type(ln) is not int or lo < 0 or ro < 0 or ln < 0:
            for v in (lo, ro, ln):
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ValueError(f"segment {s}: offsets and length must be non-negative ints")
        out.append(s)
    return out


class Endpoint(Transport):
    """Base endpoint with the built-in TCP data path (registered as kind ``"tcp"`` in :mod:`.tcp`).

    Keywords (besides the common ``name``, ``secret``, ``host``, ``port``, ``timeout_s`` of :class:`Transport`):

    * ``stripes`` (int, 2): outbound TCP connections per peer; chunks are spread over them.
    * ``chunk_bytes`` (int, 8 MiB): at most this many payload bytes per frame.
    * ``segs_per_frame`` (int, 4096): at most this many segments (KV blocks) per frame.
    * ``max_payload`` (int, 256 MiB) / ``max_body`` (int, 4 MiB) / ``max_segs`` (int, 65536): limits this endpoint
      enforces on frames it receives; a frame over a limit closes that connection (logged).
    * ``handshake_timeout_s`` (float, 10): time an inbound peer gets for each step of its authentication, in all
      (its HELLO, then its AUTH; bytes dripped one at a time do not extend it), then the connection is dropped: an
      unauthenticated peer cannot hold a socket. An outbound handshake (``connect``) waits for the peer's answers
      until the connect timeout instead (in all, likewise): a peer whose threads are starved on a loaded host answers
      late, not never.
    * ``max_handshakes`` (int, 64): inbound connections in their authentication at once (one thread each); further
      connections wait in the listen backlog until one of those ends, so a flood of idle connections costs at most
      this many threads.
    * ``max_handshakes_per_host`` (int, ``max_handshakes // 4``, at least 1): of those, at most this many from one
      source address; a further connection from that address is answered ``busy`` and closed at once (its dialer
      tries again until its connect timeout), so one host's idle connections cannot take every slot from the others.
    * ``timeout_s`` also bounds, on the owner side, the serving of each request of a peer: one not done within
      ``timeout_s`` of its start (the peer stopped reading a read's bytes, or stopped sending a write's payload) has
      that connection dropped by the reaper (within one tick, 20 ms), so no byte moves between the region and that
      peer later than that (a hold's blocks are reused ``io_timeout_s`` after its revoke).
    * ``inline_bytes`` (int, 256 KiB): writes up to this size are sent by the calling thread.
    * ``min_stripe_bytes`` (int, 1 MiB): smallest chunk when a transfer is spread over the stripes.
    * ``spin_us`` (float, 100): a thread waiting on its own transfer of at most ``inline_bytes`` polls the socket
      (``poll`` with a zero timeout, the GIL released in each call) for up to this many microseconds before it sleeps
      in ``recv``: a small read's response usually arrives within that time, and the waiter then skips a sleep and
      a wake-up by the scheduler (about 10 us of the 4 KiB latency on a two-core loopback,
      ``benchmarks/transport.py``). Costs at most this much CPU per wait; 0 never polls.
    """

    DP = "tcp"
    COMPATIBLE_KINDS: frozenset = frozenset({"tcp", "shm"})

    def __init__(
        self,
        *,
        name: str | None = None,
        secret: str | bytes | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 30.0,
        stripes: int = 2,
        chunk_bytes: int = 8 << 20,
        segs_per_frame: int = 4096,
        max_payload: int = 256 << 20,
        max_body: int = 4 << 20,
        max_segs: int = 65536,
        handshake_timeout_s: float = 10.0,
        max_handshakes: int = 64,
        max_handshakes_per_host: int | None = None,
        inline_bytes: int = 256 << 10,
        min_stripe_bytes: int = 1 << 20,
        spin_us: float = 100.0,
    ):
        secret = secret if secret is not None else os.environ.get("DLMIX_KV_SECRET")
        if not isinstance(secret, (str, bytes)):
            raise ValueError(f"secret must be str or bytes, not {type(secret).__name__}")
        if not secret:
            raise ValueError("a shared secret is required (secret=... or $DLMIX_KV_SECRET)")
        self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty str (or None for a generated one), not {name!r}")
        for what, v, lo in (("max_payload", max_payload, 4096), ("max_body", max_body, 4096),
                            ("max_segs", max_segs, 1), ("chunk_bytes", chunk_bytes, 1),
                            ("segs_per_frame", segs_per_frame, 1), ("stripes", stripes, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{what} must be an int >= {lo}, got {v!r}")
        _seconds("timeout_s", timeout_s)
        self._name = name or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        if len(self._name) > W.MAX_NAME:
            raise ValueError(f"name longer than {W.MAX_NAME} characters")
        self.timeout_s = float(timeout_s)
        self.stripes = max(1, int(stripes))
        self.chunk_bytes = max(4096, int(chunk_bytes))
        self.segs_per_frame = max(1, int(segs_per_frame))
        self.max_payload = int(max_payload)
        self.max_body = int(max_body)
        self.max_segs = int(max_segs)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.max_handshakes = int(max_handshakes)
        if self.max_handshakes < 1:
            raise ValueError(f"max_handshakes must be at least 1, got {max_handshakes!r}")
        self.max_handshakes_per_host = (max(1, self.max_handshakes // 4) if max_handshakes_per_host is None
                                        else int(max_handshakes_per_host))
        if not 1 <= self.max_handshakes_per_host <= self.max_handshakes:
            raise ValueError(f"max_handshakes_per_host must be between 1 and max_handshakes ({self.max_handshakes}), "
                             f"got {max_handshakes_per_host!r}")
        self.inline_bytes = int(inline_bytes)
        self.min_stripe_bytes = max(4096, int(min_stripe_bytes))
        if not 0 <= float(spin_us) <= 10_000:
            raise ValueError(f"spin_us must be between 0 and 10000, got {spin_us!r}")
        self.spin_s = float(spin_us) * 1e-6
        if self.chunk_bytes > self.max_payload:
            self.chunk_bytes = self.max_payload

        self._lock = threading.RLock()
        self._regions: dict[str, Region] = {}
        self._grants: dict[str, _Grant] = {}
        self._out: dict[str, list[_Conn]] = {}
        self._in: dict[str, list[_Conn]] = {}
        self._desc: dict[str, dict] = {}
        #: peer -> the descriptor its link was dialed with (the last connect that dialed it and succeeded; a connect
        #: that only reused the live link does not replace it)
        self._linked: dict[str, dict] = {}
        self._connecting: dict[str, int] = {}  # peer -> connect() calls to it in progress
        self._dialing: dict[str, list] = {}  # peer -> [lock, waiters]: one link set-up per peer at a time
        self._xfers: dict[int, _Xfer] = {}
        self._ids = itertools.count(1)
        self._rr = itertools.count()
        self._notes: queue.Queue = queue.Queue()
        self._handler: Callable[[Notification], None] | None = None
        self._closed = False
        #: accepted sockets still in their handshake (``close()`` shuts them down), and the free handshake slots
        self._hs_socks: set[socket.socket] = set()
        self._hs_slots = threading.Semaphore(self.max_handshakes)
        #: handshakes in progress per source address (``_lock``)
        self._hs_hosts: dict[str, int] = {}
        #: inbound connections whose reader (serving) thread runs, dropped ones included until it ends
        self._serving_conns: set[_Conn] = set()
        #: counters for tests and benchmarks
        self.stats = {"protocol_errors": 0, "auth_failures": 0, "refused_ops": 0, "served_ops": 0, "busy_refusals": 0}

        self._lsock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind((host, port))
        self._lsock.listen(128)
        self.host, self.port = self._lsock.getsockname()[:2]
        self._threads = [
            threading.Thread(target=self._accept_loop, name=f"dlmix-kv-accept-{self._name}", daemon=True),
            threading.Thread(target=self._reaper_loop, name=f"dlmix-kv-reaper-{self._name}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ lifecycle
    @property
    def name(self) -> str:
        return self._name

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = [c for cs in list(self._out.values()) + list(self._in.values()) for c in cs]
            xfers = list(self._xfers.values())
            handshaking = list(self._hs_socks)
        try:
            self._lsock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (close alone does not, on Linux)
        except OSError:
            pass
        try:
            self._lsock.close()
        except OSError:
            pass
        self._hs_slots.release()  # wakes the accept thread if it waits for a free handshake slot
        for sock in handshaking:  # ends their handshake threads' reads now, not handshake_timeout_s later
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for c in conns:
            self._drop_conn(c, "transport closed")
        for x in xfers:
            x.fail(PeerError("transport closed"))
        self._dp_close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ memory
    def register(self, name: str, mem: Any) -> Region:
        if not isinstance(name, str) or not name or len(name) > W.MAX_NAME:
            raise ValueError("region name must be a non-empty str of at most 256 characters")
        ptr, length, device, ro, view, keep = region_memory(mem)
        if device != "cpu" and not self.supports_device_memory:
            raise UnsupportedMemoryError(f"{self.kind or type(self).__name__} transport supports host memory only "
                                         f"(got {device}); stage through a host buffer")
        reg = Region(name=name, ptr=ptr, length=length, device=device, readonly=ro, view=view,
                     keepalive=keep if keep is not None else mem)
        with self._lock:
            if name in self._regions:
                raise ValueError(f"region {name!r} already registered")
            self._dp_register(reg)
            self._regions[name] = reg
        return reg

    def unregister(self, name: str) -> None:
        """Forget region ``name`` and drop every grant on it. Returns once no request of a peer being served from it
        can touch its memory any more, so the caller may free or reuse that memory at once: a request in progress
        is let finish, and one still not done at its serving deadline (``timeout_s`` from its start; a stalled peer)
        has its connection dropped, then is waited for to end (at most 5 s more). The peer's own copies of the
        ``cma``/``authz`` data paths (after the owner authorized them) are outside this endpoint's reach.

        Raises KeyError if ``name`` is not registered."""
        with self._lock:
            reg = self._regions.pop(name)
            for g in self._grants.values():
                for t in g.table.values():
                    t.pop(name, None)
            busy = []
            for c in self._serving_conns:
                segs = c.serving
                if segs is not None and any(r is reg for r, _, _ in segs):
                    busy.append((c, segs, c.serve_deadline))
        for c, segs, until in busy:
            self._wait_served(c, segs, until)
        self._dp_unregister(reg)

    def _wait_served(self, conn: _Conn, segs: list, until: float) -> None:
        """Wait until inbound ``conn`` no longer serves the request whose checked segments are ``segs``; past
        ``until`` (``time.monotonic()`` seconds, its serving deadline) drop the connection, which ends the request's
        socket call, and wait at most 5 s more (logged if it still has not ended)."""
        give_up = None
        while conn.serving is segs:
            now = time.monotonic()
            if give_up is None and now > until:
                self._drop_conn(conn, "a region being served was unregistered and the request is past its deadline")
                give_up = now + 5.0
            elif give_up is not None and now > give_up:
                log.error("dlmix-kv %s: a request of %s served from an unregistered region did not end 5 s after its "
                          "connection was dropped", self._name, conn.peer)
                return
            time.sleep(0.002)

    def regions(self) -> dict[str, Region]:
        with self._lock:
            return dict(self._regions)

    # ------------------------------------------------------------------ grants
    def grant(self, peer_id, transfer_id, ranges, mode="r", expires_s=300.0) -> None:
        if mode not in ("r", "w", "rw"):
            raise ValueError(f"mode must be 'r', 'w' or 'rw', not {mode!r}")
        if not isinstance(transfer_id, str) or not isinstance(peer_id, str):
            raise ValueError("peer_id and transfer_id must be str")
        if expires_s is not None:
            _seconds("expires_s", expires_s, zero_ok=True)
        if isinstance(ranges, (str, bytes)) or not hasattr(ranges, "__iter__"):
            raise ValueError("ranges must be a list of (region, offset, length)")
        with self._lock:
            checked = []
            for r in ranges:
                if not isinstance(r, (tuple, list)) or len(r) != 3:
                    raise ValueError(f"range {r!r}: expected (region, offset, length)")
                region, off, ln = r
                reg = self._regions.get(region)
                if reg is None:
                    raise KeyError(f"unknown region {region!r}; registered: {', '.join(sorted(self._regions)) or 'none'}")
                if not all(isinstance(v, int) and not isinstance(v, bool) for v in (off, ln)) or off < 0 or ln < 0:
                    raise ValueError(f"range {tuple(r)}: offset and length must be non-negative ints")
                if off + ln > reg.length:
                    raise ValueError(f"range {tuple(r)} ends past region {region!r} ({reg.length} B)")
                if "w" in mode and reg.readonly:
                    raise GrantError(f"region {region!r} is read-only; cannot grant write")
                checked.append((region, off, ln))
            g = self._grants.get(transfer_id)
            if g is not None and g.peer != peer_id:
                raise ValueError(f"transfer {transfer_id!r} is already granted to {g.peer!r}")
            if g is None:
                g = self._grants[transfer_id] = _Grant(peer_id)
            spans: dict[str, list[tuple[int, int]]] = {}
            for region, off, ln in checked:
                if ln:
                    spans.setdefault(region, []).append((off, ln))
            for region, sp in spans.items():
                for m in mode:
                    g.add(m, region, sp)
            g.expires = None if expires_s is None else time.monotonic() + float(expires_s)

    def revoke(self, transfer_id: str) -> bool:
        with self._lock:
            return self._grants.pop(transfer_id, None) is not None

    def _check_grant(self, peer: str, req: W.Req, conn: _Conn | None = None) -> list[tuple[Region, int, int]]:
        """Return ``(region, offset, length)`` per segment of ``req`` or raise GrantError. With ``conn`` (the inbound
        connection about to serve ``req``), also record that list as ``conn.serving`` under the same lock, so that an
        ``unregister()`` either refuses ``req`` or sees it being served."""
        op = "read" if req.op == "r" else "write"
        with self._lock:
            g = self._grants.get(req.tid)
            if g is None:
                raise GrantError(f"no active grant for transfer {req.tid!r}")
            if g.peer != peer:
                raise GrantError(f"transfer {req.tid!r} is not granted to peer {peer!r}")
            if g.expires is not None and time.monotonic() > g.expires:
                del self._grants[req.tid]
                raise GrantError(f"grant for transfer {req.tid!r} expired")
            table = g.table[req.op]
            out = []
            regions = self._regions
            for region, off, ln in req.segs:
                reg = regions.get(region)
                if reg is None:  # checked first: unregister() also drops the region from every grant
                    raise GrantError(f"unknown region {region!r} (not registered, or unregistered)")
                if off < 0 or ln < 0 or off + ln > reg.length:
                    raise GrantError(f"segment ({region!r}, {off}, {ln}) is outside region ({reg.length} B)")
                iv = table.get(region)
                if iv is None:
                    if not table:
                        raise GrantError(f"grant for transfer {req.tid!r} does not allow {op}")
                    raise GrantError(f"transfer {req.tid!r} grants no {op} access to region {region!r}")
                starts, ends = iv
                i = bisect.bisect_right(starts, off) - 1
                if i < 0 or off + ln > ends[i]:
                    raise GrantError(f"segment ({region!r}, {off}, {ln}) is outside the {op} grant of {req.tid!r}")
                out.append((reg, off, ln))
            if conn is not None:
                conn.serving = out
            return out

    # ------------------------------------------------------------------ peers / handshake
    def descriptor(self) -> dict:
        with self._lock:
            regs = {n: {"length": r.length, "device": r.device, "readonly": r.readonly}
                    for n, r in self._regions.items()}
        d = {"kind": self.kind, "proto": "dlmix-kv/1", "name": self._name, "host": self.host, "port": self.port,
             "pid": os.getpid(), "host_id": HOST_ID, "regions": regs}
        d.update(self._dp_descriptor())
        return d

    def connect(self, descriptor: Mapping[str, Any], timeout_s: float | None = None) -> str:
        if not isinstance(descriptor, Mapping):
            raise ValueError("descriptor must be a dict")
        try:
            kind, peer, host, port = (descriptor["kind"], descriptor["name"], descriptor["host"],
                                      descriptor["port"])
        except KeyError as e:
            raise ValueError(f"descriptor lacks {e}") from None
        if not isinstance(kind, str):
            raise ValueError(f"descriptor kind must be a str, not {type(kind).__name__}")
        if kind not in self.COMPATIBLE_KINDS and kind != self.kind:
            raise ValueError(f"cannot connect a {self.kind!r} transport to a {kind!r} peer")
        if not isinstance(peer, str) or not isinstance(host, str) or not isinstance(port, int) \
                or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError(f"descriptor name/host must be str and port an int in 1..65535 (got port {port!r})")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        desc = dict(descriptor)
        with self._lock:
            if self._closed:
                raise PeerError("transport closed")
            self._desc[peer] = desc
            self._connecting[peer] = self._connecting.get(peer, 0) + 1
            live = [c for c in self._out.get(peer, []) if c.alive]
        ok = dialed = False
        try:
            if not live:
                dialed = self._link_once(peer, timeout, desc)
            ok = True
        finally:
            with self._lock:
                left = self._connecting.pop(peer) - 1
                if left:
                    self._connecting[peer] = left
                if ok and (dialed or peer not in self._linked):
                    self._linked[peer] = self._desc[peer] = desc
                elif ok:
                    # the live link served this connect and it dialed nothing: its descriptor (maybe a stale one, from
                    # a request made before the peer restarted on a new port) did not prove itself; the name keeps
                    # the descriptor of the connect that set the link up
                    self._desc[peer] = self._linked[peer]
                elif not left:
                    # a peer that could not be reached is not remembered (descriptors come from requests: a failed
                    # connect per made-up name would otherwise keep its descriptor for good), also when several
                    # connects to it (a decode's pull threads) failed together: the last one to end puts back the
                    # descriptor of the last connect that succeeded, or forgets the peer
                    prev = self._linked.get(peer)
                    if prev is not None:
                        self._desc[peer] = prev
                    elif not any(c.alive for c in self._out.get(peer, [])):
                        self._desc.pop(peer, None)
        return peer

    def _link_once(self, peer: str, timeout: float, desc: Mapping[str, Any] | None = None) -> bool:
        """Open the link to ``peer`` unless a concurrent connect to it opened one meanwhile. Connects to one peer from
        several threads (a decode's pull threads) set the link up one after another, so the later ones reuse the
        first's connections instead of each opening its own stripes (and, for an adapter, re-adding the peer under a
        transfer in flight). The whole wait, queue included, is bounded by ``timeout`` (TransferTimeout).
        ``desc``: the descriptor to dial (a connect's own; default: see :meth:`_open_link`). Returns whether this call
        dialed the link (False: a concurrent connect's live link was found)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            ent = self._dialing.setdefault(peer, [threading.Lock(), 0])
            ent[1] += 1
        try:
            if not ent[0].acquire(timeout=timeout):
                raise TransferTimeout(f"connect to {peer} timed out after {timeout:.1f} s (another connect to it "
                                      "was still setting the link up)")
            try:
                with self._lock:
                    live = [c for c in self._out.get(peer, []) if c.alive]
                if not live:
                    self._open_link(peer, timeout, deadline, desc)
                    return True
                return False
            finally:
                ent[0].release()
        finally:
            with self._lock:
                ent[1] -= 1
                if ent[1] == 0 and self._dialing.get(peer) is ent:
                    del self._dialing[peer]

    def _open_link(self, peer: str, timeout: float, deadline: float | None = None,
                   desc: Mapping[str, Any] | None = None) -> list[_Conn]:
        """Dial ``stripes`` connections to ``peer`` and add them to its link, all up by ``deadline``
        (``time.monotonic()``; default ``timeout`` s from now: one bound for the whole link, not one per stripe).
        ``timeout`` (s) is the connect's own bound, named in the errors (TransferTimeout, PeerError).

        ``desc``: the descriptor to dial. A connect passes its own, so a concurrent connect to the same name with
        another descriptor (a stale one from a request made before the peer restarted on a new port) cannot make it
        dial that one. Default (a link found down is set up again): the descriptor of the last connect that
        succeeded, else the last one given."""
        if desc is None:
            with self._lock:
                desc = self._linked.get(peer) or self._desc[peer]
        conns = []
        if deadline is None:
            deadline = time.monotonic() + timeout
        try:
            for _ in range(self.stripes):
                if time.monotonic() >= deadline:
                    raise TransferTimeout(f"connect to {peer} at {desc['host']}:{desc['port']} timed out after "
                                          f"{timeout:.1f} s ({len(conns)} of {self.stripes} connections up)")
                conns.append(self._dial(desc, deadline, timeout))
            # a failing data-path hook (an adapter's library cannot reach the peer) must not leave the stripes
            # just dialed alive outside _out, where neither a later connect nor close() would find them
            self._dp_link_up(peer, desc, conns)
            with self._lock:
                if self._closed:  # close() ran while we dialed: it did not see these connections
                    raise PeerError("transport closed")
                self._out[peer] = [c for c in self._out.get(peer, []) if c.alive] + conns
        except BaseException:
            for c in conns:
                self._drop_conn(c, "link setup failed")
            raise
        return conns

    def _dial(self, desc: Mapping, deadline: float, timeout: float) -> _Conn:
        """One authenticated outbound connection, up by ``deadline`` (``time.monotonic()``) or TransferTimeout;
        ``timeout`` (s) is the link's whole bound, for the messages. While the peer answers ``busy`` (too many
        handshakes from this host), tries again after 10 ms, doubling up to 0.5 s."""
        nap = 0.01
        while True:
            try:
                return self._dial_once(desc, deadline, timeout)
            except _PeerBusy as e:  # too many handshakes from this host at the peer: wait for a slot
                left = deadline - time.monotonic()
                if left <= 0:  # the last try came at the deadline: the whole connect timeout was spent
                    raise TransferTimeout(f"{desc['name']} at {desc['host']}:{desc['port']} stayed busy for "
                                          f"{timeout:.1f} s ({e})") from None
                time.sleep(min(nap, left))  # up to the deadline, and one more try there
                nap = min(2 * nap, 0.5)

    def _dial_once(self, desc: Mapping, deadline: float, timeout: float) -> _Conn:
        """One try of :meth:`_dial`; raises _PeerBusy when the peer answered ``busy``."""
        host, port, peer = desc["host"], desc["port"], desc["name"]
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
        except socket.timeout:
            raise TransferTimeout(f"connect to {peer} at {host}:{port} timed out after {timeout:.1f} s") from None
        except OSError as e:
            raise PeerError(f"cannot connect to {peer} at {host}:{port}: {e}") from None
        with self._lock:  # close() shuts the handshaking sockets down: a connect to a silent peer ends with it
            if self._closed:
                sock.close()
                raise PeerError("transport closed")
            self._hs_socks.add(sock)
        try:
            # the caller's connect timeout bounds the wait: on an oversubscribed host a peer's acceptor thread
            # answered a HELLO after more than handshake_timeout_s (10 s), and the transfer failed for no fault
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            info = self._handshake_client(sock, peer)
            sock.settimeout(None)
        except socket.timeout:
            sock.close()
            raise TransferTimeout(f"{peer} at {host}:{port} did not complete the handshake within {timeout:.1f} s") \
                from None
        except (OSError, ProtocolError) as e:
            sock.close()
            if self._closed:
                raise PeerError("transport closed") from None
            if isinstance(e, (AuthError, _PeerBusy)):
                raise
            raise PeerError(f"handshake with {peer} at {host}:{port} failed: {e}") from None
        except BaseException:
            sock.close()
            raise
        finally:
            with self._lock:
                self._hs_socks.discard(sock)
        self._tune(sock)
        conn = _Conn(sock, peer, True, info)
        conn.sendq = queue.SimpleQueue()
        threading.Thread(target=self._reader_loop, args=(conn,), name=f"dlmix-kv-rd-{peer}", daemon=True).start()
        threading.Thread(target=self._sender_loop, args=(conn,), name=f"dlmix-kv-tx-{peer}", daemon=True).start()
        return conn

    @staticmethod
    def _tune(sock: socket.socket) -> None:
        """TCP_NODELAY (small control frames go out at once) and keepalive (a vanished host fails its connections
        within ~25 s even when no transfer is waiting on them)."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, val in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)

    def _handshake_client(self, sock: socket.socket, expect: str) -> dict:
        """The dialing side of the handshake on ``sock``, done within the socket's timeout at entry (seconds; None:
        no limit) in all: a peer dripping its answers byte by byte cannot stretch it. Returns the peer's AUTH_OK info.
        Raises TimeoutError (``socket.timeout``) when that time is spent, AuthError, ProtocolError, PeerError (EOF),
        OSError."""
        hdr = memoryview(bytearray(W.HEADER_SIZE))
        nc = W.new_nonce()
        limit = sock.gettimeout()
        deadline = None if limit is None else time.monotonic() + limit
        sock.sendall(W.pack(W.HELLO, W.Hello(W.VERSION, self._name, nc.hex())))
        ftype, blen, _ = W.read_frame_header(sock, hdr, W.PREAUTH_MAX_BODY, 0, deadline)
        body = W.read_body(sock, ftype, blen, deadline)
        if ftype == W.ERROR:
            if body.reason.startswith(BUSY + ":"):
                raise _PeerBusy(f"peer busy: {body.reason}")
            raise AuthError(f"peer refused: {body.reason}")
        if ftype != W.CHALLENGE:
            raise ProtocolError(f"expected CHALLENGE, got {W.FRAME_NAMES[ftype]}")
        ns = _nonce(body.nonce)
        if not hmac.compare_digest(W.mac(self._secret, b"server", nc, ns, body.name, self._name), body.mac):
            raise AuthError(f"peer at {sock.getpeername()} failed authentication (wrong shared secret?)")
        if body.name != expect:
            raise AuthError(f"peer authenticated as {body.name!r}, descriptor says {expect!r}")
        if deadline is not None:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.sendall(W.pack(W.AUTH, W.Auth(W.mac(self._secret, b"client", nc, ns, self._name, body.name),
                                           self._client_info())))
        ftype, blen, _ = W.read_frame_header(sock, hdr, W.PREAUTH_MAX_BODY, 0, deadline)
        body = W.read_body(sock, ftype, blen, deadline)
        if ftype == W.ERROR:
            raise AuthError(f"peer refused: {body.reason}")
        if ftype != W.AUTH_OK:
            raise ProtocolError(f"expected AUTH_OK, got {W.FRAME_NAMES[ftype]}")
        return body.info

    def _accept_loop(self) -> None:
        """Accept inbound connections and authenticate each on its own thread, at most ``max_handshakes`` at once: at
        the cap it stops accepting (connections wait in the listen backlog) until a handshake ends."""
        slots = self._hs_slots
        while True:
            slots.acquire()
            if self._closed:
                return
            try:
                sock, addr = self._lsock.accept()
            except OSError:
                slots.release()
                if self._closed:
                    return
                time.sleep(0.01)
                continue
            host = addr[0]
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                busy = self._hs_hosts.get(host, 0) >= self.max_handshakes_per_host
                if not busy:
                    self._hs_hosts[host] = self._hs_hosts.get(host, 0) + 1
                    self._hs_socks.add(sock)
            if busy:  # answered before its HELLO is read: costs no thread and no time
                self.stats["busy_refusals"] += 1
                _try_send(sock, W.pack(W.ERROR, W.Error(
                    f"{BUSY}: {self.max_handshakes_per_host} handshakes from {host} in progress")))
                sock.close()
                slots.release()
                continue
            try:
                threading.Thread(target=self._serve_new, args=(sock, addr), daemon=True,
                                 name=f"dlmix-kv-hs-{self._name}").start()
            except RuntimeError as e:  # "can't start new thread": refuse this one, keep accepting
                log.warning("dlmix-kv %s: refusing connection from %s: %s", self._name, addr, e)
                with self._lock:
                    self._hs_socks.discard(sock)
                    self._hs_done(host)
                sock.close()
                slots.release()
                time.sleep(0.01)

    def _hs_done(self, host: str) -> None:
        """One handshake from ``host`` ended (caller holds ``_lock``)."""
        n = self._hs_hosts.get(host, 0) - 1
        if n > 0:
            self._hs_hosts[host] = n
        else:
            self._hs_hosts.pop(host, None)

    def _serve_new(self, sock: socket.socket, addr) -> None:
        """Authenticate an accepted connection (holding one handshake slot until it ends), then serve it."""
        try:
            conn = self._authenticate(sock, addr)
        finally:
            with self._lock:
                self._hs_socks.discard(sock)
                self._hs_done(addr[0])
            self._hs_slots.release()
        if conn is not None:
            with self._lock:
                self._serving_conns.add(conn)
            try:
                self._reader_loop(conn)
            finally:
                with self._lock:
                    self._serving_conns.discard(conn)

    def _authenticate(self, sock: socket.socket, addr) -> _Conn | None:
        """The listening side of the handshake on ``sock``: the authenticated connection, registered in ``_in``, or
        None (refused, failed, timed out, or the endpoint closed; ``sock`` is closed then). Each step (HELLO, AUTH)
        must arrive within ``handshake_timeout_s`` of its start."""
        hdr = memoryview(bytearray(W.HEADER_SIZE))
        try:
            deadline = time.monotonic() + self.handshake_timeout_s
            ftype, blen, plen = W.read_frame_header(sock, hdr, W.PREAUTH_MAX_BODY, 0, deadline)
            if ftype != W.HELLO:
                raise ProtocolError(f"expected HELLO, got {W.FRAME_NAMES[ftype]}")
            hello = W.read_body(sock, ftype, blen, deadline)
            if hello.v != W.VERSION or not hello.name or len(hello.name) > W.MAX_NAME:
                raise ProtocolError("bad HELLO (version or name)")
            nc = _nonce(hello.nonce)
            ns = W.new_nonce()
            sock.settimeout(self.handshake_timeout_s)
            sock.sendall(W.pack(W.CHALLENGE, W.Challenge(
                self._name, ns.hex(), W.mac(self._secret, b"server", nc, ns, self._name, hello.name))))
            deadline = time.monotonic() + self.handshake_timeout_s
            ftype, blen, plen = W.read_frame_header(sock, hdr, W.PREAUTH_MAX_BODY, 0, deadline)
            if ftype != W.AUTH:
                raise ProtocolError(f"expected AUTH, got {W.FRAME_NAMES[ftype]}")
            auth = W.read_body(sock, ftype, blen, deadline)
            if not hmac.compare_digest(W.mac(self._secret, b"client", nc, ns, hello.name, self._name), auth.mac):
                self.stats["auth_failures"] += 1
                log.warning("dlmix-kv %s: connection from %s claiming %r failed authentication", self._name, addr,
                            hello.name)
                _try_send(sock, W.pack(W.ERROR, W.Error("authentication failed")))
                sock.close()
                return None
            conn = _Conn(sock, hello.name, False, auth.info)
            ok_frame = W.pack(W.AUTH_OK, W.AuthOk(self._server_info(conn, auth.info)))
        except (ProtocolError, PeerError, OSError) as e:
            self.stats["protocol_errors"] += isinstance(e, ProtocolError)
            if not self._closed:
                log.warning("dlmix-kv %s: closing unauthenticated connection from %s: %s", self._name, addr, e)
                _try_send(sock, W.pack(W.ERROR, W.Error(str(e)[:200])))
            sock.close()
            return None
        except Exception as e:  # never let a peer kill the acceptor
            log.exception("dlmix-kv %s: handshake error from %s: %s", self._name, addr, e)
            sock.close()
            return None
        self._tune(sock)
        # registered before AUTH_OK leaves, so a notification right after the peer's handshake finds the connection;
        # it waits for the send lock, held until AUTH_OK is out (the peer reads that frame first)
        failed = None
        with conn.send_lock:
            with self._lock:
                self._hs_socks.discard(sock)
                if self._closed:
                    sock.close()
                    return None
                self._in.setdefault(conn.peer, []).append(conn)
            try:
                sock.settimeout(self.handshake_timeout_s)
                sock.sendall(ok_frame)
                sock.settimeout(None)
            except OSError as e:
                failed = e
        if failed is not None:
            self._drop_conn(conn, f"AUTH_OK not delivered: {failed}")
            return None
        return conn

    def peers(self) -> list[str]:
        with self._lock:
            names = {p for p, cs in self._out.items() if any(c.alive for c in cs)}
            names |= {p for p, cs in self._in.items() if any(c.alive for c in cs)}
        return sorted(names)

    def _conns_for(self, peer: str) -> list[_Conn]:
        with self._lock:
            if self._closed:
                raise PeerError("transport closed")
            live = [c for c in self._out.get(peer, []) if c.alive]
            known = peer in self._desc
        if live:
            return live
        if not known:
            raise PeerError(f"not connected to peer {peer!r}; call connect(descriptor) first")
        # the link went down: set it up again once, also when several threads (a decode's pull threads reading or
        # extending) find it down at the same time (each dialed its own stripes before)
        self._link_once(peer, self.timeout_s)
        with self._lock:
            live = [c for c in self._out.get(peer, []) if c.alive]
        if not live:
            raise PeerError(f"the link to {peer!r} went down again while it was set up")
        return live

    # ------------------------------------------------------------------ connection I/O
    def _read_frame(self, conn: _Conn, driving: bool = False) -> str | None:
        """Read and handle one frame of ``conn`` (caller holds ``conn.rx_lock`` on an outbound connection). Returns a
        reason when the connection must close (the peer sent ERROR), else None. ``driving``: called by a thread
        waiting on its own transfer (:meth:`_drive`), so a notification handler runs on a fresh thread, not there."""
        rx = conn.rx
        ftype, body, plen = rx.frame(self.max_body, self.max_payload)
        if ftype == W.REQ and not conn.outbound:
            conn.serve_deadline = time.monotonic() + self.timeout_s  # the reaper drops the connection past it
            try:
                self._serve_req(conn, body, plen)
            finally:
                conn.serving = None  # before the deadline: unregister() keeps the deadline it saw with this request
                conn.serve_deadline = 0.0
        elif ftype == W.RESP and conn.outbound:
            self._on_resp(conn, body, plen)
        elif ftype == W.NOTIFY and plen == 0:
            n = Notification(conn.peer, body.msg)
            if driving and self._handler is not None:
                threading.Thread(target=self._deliver, args=(n,), daemon=True).start()
            else:
                self._deliver(n)
        elif ftype == W.ERROR and plen == 0:
            log.warning("dlmix-kv %s: %s sent ERROR: %s", self._name, conn.peer, body.reason)
            return f"peer error: {body.reason}"
        else:
            raise ProtocolError(f"unexpected {W.FRAME_NAMES[ftype]} frame (payload {plen} B) on "
                                f"{'outbound' if conn.outbound else 'inbound'} connection")
        return None

    def _conn_error(self, conn: _Conn, e: BaseException) -> str:
        """Log ``e`` (raised while reading ``conn``) and return the reason to drop the connection with."""
        if isinstance(e, ProtocolError):
            self.stats["protocol_errors"] += 1
            log.warning("dlmix-kv %s: closing connection with %s: %s", self._name, conn.peer, e)
            _try_send(conn.sock, W.pack(W.ERROR, W.Error(str(e)[:200])))
            return f"protocol error: {e}"
        if isinstance(e, (PeerError, OSError)):
            return f"connection lost: {e}"
        # a bug, or a peer-triggered corner case: drop this connection, keep serving
        log.error("dlmix-kv %s: connection with %s failed", self._name, conn.peer, exc_info=e)
        return f"internal error: {e!r}"

    def _reader_loop(self, conn: _Conn) -> None:
        """Serve an inbound connection (blocking reads), or watch an outbound one: wait until it is readable without
        holding ``rx_lock``, then handle every frame that is there, so a thread waiting on its own transfer can read
        its response itself (:meth:`_drive`, no thread hand-off) while this one stays out of the way."""
        reason = "closed"
        try:
            if not conn.outbound:
                while conn.alive:
                    reason = self._read_frame(conn) or reason
                    if reason != "closed":
                        break
                return
            rx, lock, me, wake_fd = conn.rx, conn.rx_lock, threading.get_ident(), conn.wake_fd
            if conn.ep is not None:
                wait = conn.ep.poll
            else:
                poller = select.poll()
                poller.register(conn.sock, select.POLLIN)
                wait = poller.poll
            while conn.alive:
                if rx.start == rx.end:
                    for fd, _ in wait():
                        if fd == wake_fd:
                            try:
                                os.eventfd_read(wake_fd)
                            except OSError:
                                pass
                with lock:
                    conn.rx_owner = me
                    try:
                        while conn.alive and rx.ready():
                            r = self._read_frame(conn)
                            if r is not None:
                                reason = r
                                return
                    finally:
                        conn.rx_owner = 0
        except BaseException as e:
            reason = self._conn_error(conn, e)
        finally:
            self._drop_conn(conn, reason)
            conn.close_poll()

    def _drive(self, h: TransferHandle, deadline: float | None) -> None:
        """Called by a thread about to wait on ``h`` (``result``/``wait``): when all of its chunks travel on one
        outbound connection and the wait is at least as long as the transfer's own deadline, read that connection
        here (after any frame another thread is handling) until ``h`` is done. This saves the wake-up of the reader
        thread and the hand-off back (the latency of a small transfer); otherwise it arms the reader thread and
        returns at once, and the reader thread completes ``h``.

        The reads block in ``recv`` without a timeout of their own: a stalled peer is cut off by the reaper at the
        transfer's deadline (it shuts the connection down, which ends the ``recv``), and ``deadline`` is not earlier
        than that, so the wait never overruns it by more than one reaper tick."""
        x: _Xfer | None = h._xfer
        if x is None or not x.chunks:
            return
        conn = x.chunks[0].conn
        if (deadline is not None and deadline < x.deadline) or conn is None or not conn.outbound \
                or conn.rx_owner == threading.get_ident() \
                or (len(x.chunks) > 1 and any(c.conn is not conn for c in x.chunks)):
            # a shorter wait than the transfer's own deadline (reading here could overrun it mid-frame), chunks on
            # several connections, or a notification handler on the reader thread itself: leave it to the readers
            self._nudge(h)
            return
        # frames are ordered on a connection: one another thread is handling comes before this transfer's response
        if not conn.rx_lock.acquire(False) and \
                not conn.rx_lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            self._nudge(h)
            return
        reason = None
        conn.arm(False)
        rx = conn.rx
        try:
            if rx.start == rx.end and self.spin_s and h.nbytes <= self.inline_bytes:
                # a small response is usually a few tens of microseconds away: poll for it rather than sleep in recv
                poll, clock = conn.cpoll.poll, time.perf_counter
                end = clock() + self.spin_s
                while not poll(0) and clock() < end:
                    pass
            while not h._state and conn.alive:
                reason = self._read_frame(conn, driving=True)
                if reason is not None:
                    return
            # Frames that arrived with the response and sit in the buffer (e.g. a notification right behind it) raise
            # no further socket event, so the reader thread, asleep in its poll, would never see them: handle them here.
            while conn.alive and rx.start < rx.end:
                reason = self._read_frame(conn, driving=True)
                if reason is not None:
                    return
        except Exception as e:
            reason = self._conn_error(conn, e)
        except BaseException:  # e.g. KeyboardInterrupt mid-frame: the stream is out of step, drop it and re-raise
            reason = "interrupted while reading a frame"
            raise
        finally:
            if rx.start < rx.end and reason is None:
                conn.poke()  # a next frame is buffered: the reader thread's epoll would not see it
            conn.arm(True)
            conn.rx_lock.release()
            if reason is not None:
                self._drop_conn(conn, reason)

    def _nudge(self, h: TransferHandle) -> None:
        """Make sure the reader threads will complete ``h``: arm the connections its chunks travel on (a transfer
        launched on one connection disarms it, expecting its waiter to read the response in :meth:`_drive`)."""
        x: _Xfer | None = h._xfer
        if x is not None:
            for ch in x.chunks:
                c = ch.conn
                if c is not None and not c.armed:
                    c.arm(True)

    def _drop_conn(self, conn: _Conn, reason: str) -> None:
        conn.shutdown()
        conn.poke()  # an outbound reader thread asleep in its epoll (disarmed, or racing the close) exits now
        try:
            conn.sock.close()
        except OSError:
            pass
        with self._lock:
            for table in (self._out, self._in):
                cs = table.get(conn.peer)
                if cs and conn in cs:
                    cs.remove(conn)
                    if not cs:
                        del table[conn.peer]
            pending = list(conn.pending.values())
            conn.pending.clear()
        if conn.sendq is not None:
            conn.sendq.put(None)
        for ch in pending:
            ch.recv_done.set()
            ch.xfer.fail(PeerError(f"connection to {conn.peer!r} lost ({reason}) during transfer "
                                   f"{ch.xfer.handle.transfer_id!r}"))

    def _serve_req(self, conn: _Conn, req: W.Req, plen: int) -> None:
        if req.op not in ("r", "w"):
            raise ProtocolError(f"bad op {req.op!r}")
        if len(req.segs) > self.max_segs:
            raise ProtocolError(f"{len(req.segs)} segments exceed the {self.max_segs} limit")
        total = 0
        for _, off, ln in req.segs:
            if ln < 0 or off < 0:
                raise ProtocolError("negative offset or length")
            total += ln
        if req.dp == "tcp":
            if plen != (total if req.op == "w" else 0):
                raise ProtocolError(f"payload of {plen} B does not match the request ({total} B, op {req.op})")
        elif plen:
            raise ProtocolError(f"unexpected payload for data path {req.dp!r}")
        try:
            checked = self._check_grant(conn.peer, req, conn)
        except GrantError as e:
            self.stats["refused_ops"] += 1
            log.info("dlmix-kv %s: refused %s from %s: %s", self._name, req.op, conn.peer, e)
            if plen:
                conn.rx.skip(plen)
            self._send(conn, [W.pack(W.RESP, W.Resp(req.id, False, code="grant", err=str(e)))])
            return
        self.stats["served_ops"] += 1
        if req.dp == "tcp":
            views = []
            for reg, off, ln in checked:
                views.append(reg.view[off:off + ln])
            if req.op == "w":
                conn.rx.into(views)
                self._send(conn, [W.pack(W.RESP, W.Resp(req.id, True, n=total))])
            else:
                self._send(conn, [W.pack(W.RESP, W.Resp(req.id, True, n=total), total)] + views)
            return
        resp = self._dp_serve(conn, req, checked, total)
        self._send(conn, [W.pack(W.RESP, resp)])

    def _send(self, conn: _Conn, views: list) -> None:
        with conn.send_lock:
            W.send_views(conn.sock, views)

    def _on_resp(self, conn: _Conn, resp: W.Resp, plen: int) -> None:
        lock = self._lock
        lock.acquire()
        ch = conn.pending.pop(resp.id, None)
        lock.release()
        if ch is None:  # cancelled/timed out: throw the bytes away
            if plen:
                conn.rx.skip(plen)
            return
        try:
            self._complete(conn, ch, resp, plen)
        except BaseException as e:  # the chunk left `pending`: fail its transfer here, then drop the connection
            ch.recv_done.set()
            ch.xfer.fail(e if isinstance(e, TransportError) else
                         PeerError(f"connection to {conn.peer!r} failed during transfer "
                                   f"{ch.xfer.handle.transfer_id!r}: {e}"))
            raise

    def _complete(self, conn: _Conn, ch: _Chunk, resp: W.Resp, plen: int) -> None:
        if not resp.ok:
            if plen:
                conn.rx.skip(plen)
            cls = GrantError if resp.code == "grant" else TransportError
            ch.xfer.fail(cls(f"peer {conn.peer!r} refused {'read' if ch.op == 'r' else 'write'} of transfer "
                             f"{ch.xfer.handle.transfer_id!r}: {resp.err}"))
            return
        if ch.op == "r" and ch.dp == "tcp":
            if plen != ch.nbytes:
                raise ProtocolError(f"read response carries {plen} B, expected {ch.nbytes} B")
            discard = not ch.begin_receiving()
            if discard:
                conn.rx.skip(plen)
                return
            try:
                conn.rx.into(ch.views if len(ch.views) == 1 else list(ch.views))
            finally:
                ch.end_receiving()  # reports a failure of another chunk that waited for this one
            self._chunk_ok(ch, resp)
        elif plen:
            raise ProtocolError("unexpected payload in response")
        else:
            self._dp_complete(conn, ch, resp)

    def _dp_complete(self, conn: _Conn, ch: _Chunk, resp: W.Resp) -> None:
        """A non-TCP chunk was authorized by the owner (``resp.ok``): move its bytes, then call ``_chunk_ok``."""
        self._chunk_ok(ch, resp)

    def _chunk_ok(self, ch: _Chunk, resp: W.Resp) -> None:
        x = ch.xfer
        if x.chunk_done(ch.nbytes):
            lock = self._lock
            lock.acquire()
            self._xfers.pop(x.key, None)
            lock.release()
            # break the handle <-> transfer <-> chunk cycles now: freed by reference counting, not by the cyclic GC
            # (whose collections cost more per transfer than the transfer's own Python work)
            x.chunks = []
            x.handle._xfer = None

    def _sender_loop(self, conn: _Conn) -> None:
        q = conn.sendq
        while True:
            ch = q.get()
            if ch is None:
                return
            conn.queued_bytes -= ch.nbytes
            if ch.discard:
                with self._lock:
                    conn.pending.pop(ch.id, None)
                continue
            try:
                self._send(conn, self._frame(ch))
            except OSError as e:
                self._drop_conn(conn, f"send failed: {e}")
                return

    def _frame(self, ch: _Chunk) -> list:
        plen = ch.nbytes if (ch.op == "w" and ch.dp == "tcp") else 0
        req = W.Req(ch.id, ch.op, ch.xfer.handle.transfer_id, ch.dp, ch.segs, ch.iov, os.getpid() if ch.iov else 0)
        head = W.pack(W.REQ, req, plen)
        return [head] + (ch.views if plen else [])

    def _dispatch(self, conn: _Conn, ch: _Chunk) -> None:
        """Register ``ch`` as pending on ``conn`` and send its request (inline if small, else via the sender)."""
        ch.id = next(self._ids)
        ch.conn = conn
        lock = self._lock
        lock.acquire()
        if not conn.alive:
            lock.release()
            raise PeerError(f"connection to {conn.peer!r} is closed")
        conn.pending[ch.id] = ch
        lock.release()
        payload = ch.nbytes if (ch.op == "w" and ch.dp == "tcp") else 0
        if payload <= self.inline_bytes and conn.queued_bytes == 0 and conn.send_lock.acquire(blocking=False):
            try:
                W.send_views(conn.sock, self._frame(ch))
            except OSError as e:
                conn.send_lock.release()
                self._drop_conn(conn, f"send failed: {e}")
                return
            conn.send_lock.release()
            return
        conn.queued_bytes += ch.nbytes
        conn.sendq.put(ch)

    # ------------------------------------------------------------------ data
    def write(self, peer_id, segments, transfer_id, timeout_s=None) -> TransferHandle:
        return self._start("w", peer_id, segments, transfer_id, timeout_s)

    def read(self, peer_id, segments, transfer_id, timeout_s=None) -> TransferHandle:
        return self._start("r", peer_id, segments, transfer_id, timeout_s)

    def _timeout(self, timeout_s) -> float:
        """``timeout_s`` of one call in seconds (None: the endpoint's ``timeout_s``); ValueError from
        :func:`_seconds`."""
        return self.timeout_s if timeout_s is None else _seconds("timeout_s", timeout_s)

    def _start(self, op: str, peer: str, segments, tid: str, timeout_s) -> TransferHandle:
        if not isinstance(tid, str):
            raise ValueError("transfer_id must be a str")
        timeout = self._timeout(timeout_s)
        segs = _norm_segments(segments)
        total = 0
        regions = self._regions  # a dict read is atomic; unregister() racing a transfer is the caller's bug either way
        for s in segs:
            reg = regions.get(s[0])
            if reg is None:
                raise KeyError(f"unknown local region {s.local_region!r}")
            if s[1] + s[4] > reg.length:
                raise ValueError(f"segment {tuple(s)} ends past local region {s.local_region!r} ({reg.length} B)")
            if op == "r" and reg.readonly:
                raise ValueError(f"cannot read into read-only region {s.local_region!r}")
            total += s[4]
        conns = self._out.get(peer)
        if not conns or self._closed or not (conns[0].alive if len(conns) == 1 else all(c.alive for c in conns)):
            conns = self._conns_for(peer)
        h = TransferHandle(tid, total, canceller=self._cancel)
        h._drive = self._drive
        x = _Xfer(h, peer, op, time.monotonic() + timeout)
        h._xfer = x
        self._lock.acquire()
        self._xfers[x.key] = x
        self._lock.release()
        try:
            self._submit(x, op, peer, conns, segs)
        except TransportError as e:
            x.fail(e)
        if not x.chunks and not h._state:
            h._set_result(0)
        if h._state:
            with self._lock:
                self._xfers.pop(x.key, None)
        h._nudge = self._nudge
        return h

    def _split(self, segs: list[Segment], max_bytes: int, max_segs: int) -> list[list[tuple[Segment, int, int]]]:
        """Cut segments into groups of at most ``max_bytes`` bytes and ``max_segs`` pieces."""
        groups: list[list] = []
        cur: list = []
        cur_b = 0
        for s in segs:
            off = 0
            while off < s.length:
                n = min(s.length - off, max_bytes - cur_b)
                cur.append((s, off, n))
                cur_b += n
                off += n
                if cur_b >= max_bytes or len(cur) >= max_segs:
                    groups.append(cur)
                    cur, cur_b = [], 0
        if cur:
            groups.append(cur)
        return groups

    def _submit(self, x: _Xfer, op: str, peer: str, conns: list[_Conn], segs: list[Segment]) -> None:
        """Built-in TCP data path: chunks carry the payload in frames, spread over the stripes. A transfer of at least
        2 x ``min_stripe_bytes`` is cut into at least one chunk per stripe so every connection streams at once."""
        total = 0
        for s in segs:
            total += s[4]
        per = min(self.chunk_bytes, max(self.min_stripe_bytes, -(-total // len(conns))))
        regions = self._regions
        if total <= per and len(segs) <= self.segs_per_frame:  # one chunk (a small transfer): no cutting
            wire, views = [], []
            for lr, lo, rr, ro, ln in segs:  # one loop, no comprehension objects: this is the latency path
                if ln:
                    wire.append((rr, ro, ln))
                    views.append(regions[lr].view[lo:lo + ln])
            if wire:
                self._launch(x, conns, [_Chunk(x, op, "tcp", wire, views, total)])
            return
        groups = self._split(segs, per, self.segs_per_frame)
        chunks = []
        for g in groups:
            wire = [(s.remote_region, s.remote_offset + o, n) for s, o, n in g]
            views = [regions[s.local_region].view[s.local_offset + o: s.local_offset + o + n] for s, o, n in g]
            chunks.append(_Chunk(x, op, "tcp", wire, views, sum(n for _, _, n in g)))
        self._launch(x, conns, chunks)

    def _launch(self, x: _Xfer, conns: list[_Conn], chunks: list[_Chunk]) -> None:
        """Send ``chunks`` round-robin over the live connections of ``conns``. A transfer of one chunk (the latency
        path) disarms its connection's reader thread first: its waiter reads the response itself (:meth:`_drive`)."""
        x.chunks = chunks
        x.remaining = n = len(chunks)
        start = next(self._rr)
        h = x.handle
        for i in range(n):
            if h._state:
                break
            conn = conns[(start + i) % len(conns)]
            if not conn.alive:
                live = [c for c in conns if c.alive]
                if not live:
                    x.fail(PeerError(f"all connections to {x.peer!r} closed"))
                    break
                conn = live[(start + i) % len(live)]
            if n == 1:
                conn.arm(False)
            self._dispatch(conn, chunks[i])

    def _cancel(self, h: TransferHandle) -> None:
        x: _Xfer | None = h._xfer
        if x is None:
            return
        for ch in x.chunks:
            with ch.lock:
                ch.discard = True
        for ch in x.chunks:
            if not ch.recv_done.wait(5.0) and ch.conn is not None:
                self._drop_conn(ch.conn, "cancelled transfer stalled mid-payload")
                ch.recv_done.wait(2.0)
        self._dp_cancel(x)
        with self._lock:
            self._xfers.pop(x.key, None)

    def _reaper_loop(self) -> None:
        while not self._closed:
            time.sleep(0.02)
            now = time.monotonic()
            with self._lock:
                late = [x for x in self._xfers.values() if now > x.deadline and not x.handle._state]
                for k in [k for k, x in self._xfers.items() if x.handle._state]:
                    del self._xfers[k]
                for tid in [t for t, g in self._grants.items() if g.expires is not None and now > g.expires]:
                    del self._grants[tid]
                idle = [c for cs in self._out.values() for c in cs if not c.armed]
                stuck = [c for cs in self._in.values() for c in cs if 0.0 < c.serve_deadline < now]
            for x in late:
                self._expire(x)
            for c in stuck:  # serving a request past timeout_s: the peer stopped reading a response or sending a payload
                log.warning("dlmix-kv %s: a request of %s was not served within %.1f s (the peer stopped reading or "
                            "sending); dropping the connection", self._name, c.peer, self.timeout_s)
                self._drop_conn(c, "request not served within timeout_s (peer stalled)")
            # safety net: a link disarmed for a waiter that has not come to read it within 50 ms is armed again
            for c in idle:
                if not c.armed and now - c.disarmed_at > 0.05 and not c.rx_lock.locked():
                    c.arm(True)

    def _expire(self, x: _Xfer) -> None:
        x.cause = TransferTimeout(
            f"transfer {x.handle.transfer_id!r} with {x.peer!r} did not complete within its timeout "
            f"({x.handle.elapsed_s:.1f} s); peer dead or stalled")
        for ch in x.chunks:
            with ch.lock:
                ch.discard = True
        stalled = {id(ch.conn): ch.conn for ch in x.chunks
                   if ch.conn is not None and ch.id in ch.conn.pending or ch.receiving}
        conns = [c for c in stalled.values() if c is not None]
        with self._lock:  # mark all dead at once, so no new transfer picks one of them meanwhile
            for conn in conns:
                conn.alive = False
        for conn in conns:
            self._drop_conn(conn, f"transfer {x.handle.transfer_id!r} timed out")
        for ch in x.chunks:
            ch.recv_done.wait(2.0)
        self._dp_cancel(x)
        x.fail(x.cause)  # reported at once, or by a chunk still receiving (a library op too) as it ends
        with self._lock:
            self._xfers.pop(x.key, None)

    # ------------------------------------------------------------------ notifications
    def notify(self, peer_id, msg, timeout_s=None) -> None:
        if not isinstance(msg, Mapping):
            raise ValueError("notification must be a dict")
        try:
            frame = W.pack(W.NOTIFY, W.Notify(dict(msg)))
        except (TypeError, msgspec.EncodeError) as e:
            raise ValueError(f"notification is not JSON-able: {e}") from None
        if len(frame) - W.HEADER_SIZE > self.max_body:
            raise ValueError(f"notification of {len(frame)} B exceeds the {self.max_body} B control-frame limit")
        deadline = time.monotonic() + self._timeout(timeout_s)
        with self._lock:
            conns = [c for c in self._out.get(peer_id, []) if c.alive] + \
                    [c for c in self._in.get(peer_id, []) if c.alive]
        if not conns:
            conns = self._conns_for(peer_id)
        timed_out = False
        for c in conns:
            try:
                self._send_until(c, [frame], deadline)
                return
            except TimeoutError:  # a peer that stopped reading: its send buffer is full (or another send is stuck)
                timed_out = True
            except OSError as e:
                self._drop_conn(c, f"send failed: {e}")
        if timed_out:
            raise TransferTimeout(f"notification to {peer_id!r} not handed to the kernel within its timeout; "
                                  f"peer stalled")
        raise PeerError(f"could not deliver notification to {peer_id!r}")

    def _send_until(self, conn: _Conn, views: list, deadline: float) -> None:
        """``_send`` bounded by ``deadline`` (monotonic s): raises TimeoutError when the send lock or the socket's
        send buffer does not free up in time. A send cut short that way may leave a frame half sent (the stream out
        of step): the connection is dropped then."""
        if not conn.send_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError("send lock busy")
        try:
            try:
                W.send_views_until(conn.sock, views, deadline)
            finally:
                try:
                    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 0))
                except OSError:
                    pass
        except BlockingIOError:  # SO_SNDTIMEO expired, possibly mid-frame
            conn.send_lock.release()
            self._drop_conn(conn, "notification send timed out")
            raise TimeoutError("send timed out") from None
        except BaseException:
            conn.send_lock.release()
            raise
        conn.send_lock.release()

    def _deliver(self, n: Notification) -> None:
        h = self._handler
        if h is None:
            self._notes.put(n)
            return
        try:
            h(n)
        except Exception:
            log.exception("dlmix-kv %s: notification handler failed", self._name)

    def get_notification(self, timeout: float | None = 0.0) -> Notification | None:
        try:
            if timeout == 0:
                return self._notes.get_nowait()
            return self._notes.get(timeout=timeout)
        except queue.Empty:
            return None

    def on_notify(self, handler) -> None:
        self._handler = handler
        if handler is not None:
            while (n := self.get_notification(0)) is not None:
                self._deliver(n)

    # ------------------------------------------------------------------ data-path hooks (subclasses)
    def _client_info(self) -> dict:
        """Extra info sent in AUTH (after the peer proved the secret)."""
        return {"pid": os.getpid(), "host_id": HOST_ID}

    def _server_info(self, conn: _Conn, info: dict) -> dict:
        """Check an authenticated client's AUTH info; return the AUTH_OK info."""
        return {"pid": os.getpid(), "host_id": HOST_ID}

    def _dp_descriptor(self) -> dict:
        return {}

    def _dp_register(self, reg: Region) -> None:
        pass

    def _dp_unregister(self, reg: Region) -> None:
        pass

    def _dp_link_up(self, peer: str, desc: Mapping, conns: list[_Conn]) -> None:
        pass

    def _dp_serve(self, conn: _Conn, req: W.Req, checked: list, total: int) -> W.Resp:
        """Serve a non-TCP data-path request whose grant check passed. Base: ``authz`` = grant check only."""
        if req.dp == "authz":
            return W.Resp(req.id, True, n=total)
        raise ProtocolError(f"unsupported data path {req.dp!r}")

    def _dp_cancel(self, x: _Xfer) -> None:
        pass

    def _dp_close(self) -> None:
        pass


def _nonce(hexstr: str) -> bytes:
    try:
        b = bytes.fromhex(hexstr)
    except ValueError:
        raise ProtocolError("nonce is not hex") from None
    if len(b) != 32:
        raise ProtocolError("nonce must be 32 bytes")
    return b


def _try_send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.settimeout(0.5)
        sock.sendall(data)
    except OSError:
        pass
