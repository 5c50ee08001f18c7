"""Lean asyncio HTTP/1.1 machinery for the router hot path (httptools parsing, uvloop when available).

* :class:`ServerProtocol` - one per client connection: parses requests with ``httptools``, runs them one at a time
  (HTTP/1.1 pipelining keeps order), keeps connections alive, sets TCP_NODELAY, and cancels the running handler when
  the client disconnects (the handler then closes the backend connection, which makes vLLM abort the request).
* :class:`BackendConn` / :class:`Pool` - keep-alive connection pool per backend. A response is either *forwarded*
  (the backend's raw bytes go to the client socket as they arrive: status, headers, chunked SSE framing untouched;
  httptools only watches for the end of the message) or *collected* (status, headers and body returned).

No pydantic, no logging and no per-request allocation beyond the parsed request on this path.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Awaitable, Callable, List, Optional, Tuple

import httptools

HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
     b"transfer-encoding", b"upgrade", b"host", b"content-length", b"authorization", b"expect")
)

_REASONS = {200: b"OK", 201: b"Created", 204: b"No Content", 400: b"Bad Request", 401: b"Unauthorized",
            403: b"Forbidden", 404: b"Not Found", 405: b"Method Not Allowed", 408: b"Request Timeout",
            409: b"Conflict", 413: b"Payload Too Large", 414: b"URI Too Long",
            431: b"Request Header Fields Too Large", 499: b"Client Closed Request", 500: b"Internal Server Error",
            502: b"Bad Gateway", 503: b"Service Unavailable", 504: b"Gateway Timeout", 508: b"Loop Detected"}


def error_type(status: int) -> str:
    """The OpenAI error ``type`` of a router answer with HTTP ``status``: ``authentication_error`` (401),
    ``invalid_request_error`` (other 4xx), ``server_error`` (5xx)."""
    if status == 401:
        return "authentication_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(status: int, message: str, *, type: Optional[str] = None, param: Optional[str] = None,
               code=None, **extra) -> bytes:
    """The JSON body of every error the router answers itself: the OpenAI error object
    ``{"error": {"message", "type", "param", "code"}}`` (``type`` from :func:`error_type` unless given; ``code`` the
    HTTP status unless given, as vLLM's ``ErrorResponse``). ``extra`` keys (e.g. a refused registration's
    ``reasons``) go into the error object after those four."""
    err = {"message": message, "type": type or error_type(status), "param": param,
           "code": status if code is None else code}
    err.update(extra)
    return json.dumps({"error": err}).encode()


def _where(req: "Request") -> str:
    path = req.path.decode("utf-8", "replace")
    return f"{req.method.decode('ascii', 'replace')} {path if len(path) <= 200 else path[:200] + '...'}"


def not_found(req: "Request") -> bytes:
    """The 404 body for a path the router does not serve."""
    return error_body(404, f"not found: {_where(req)} is not an endpoint of this router")


def method_not_allowed(req: "Request", allow: List[str]) -> Tuple[bytes, bytes]:
    """The 405 body for a known path under another method, and its ``allow`` header line (``send(extra=...)``)."""
    return (error_body(405, f"method not allowed: {_where(req)}; use {' or '.join(allow)}"),
            b"allow: %s\r\n" % ", ".join(allow).encode())


def _nodelay(transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError):
            pass


class Request:
    """A parsed client request. ``headers`` is a list of (lower-case name, value) bytes pairs; ``body`` bytes."""

    __slots__ = ("method", "url", "path", "query", "headers", "body", "keep_alive", "t0")

    def __init__(self, method: bytes, url: bytes, headers: list, body: bytes, keep_alive: bool):
        self.method = method
        self.url = url
        q = url.find(b"?")
        self.path = url if q < 0 else url[:q]
        self.query = b"" if q < 0 else url[q + 1:]
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.t0 = time.perf_counter()

    def header(self, name: bytes) -> Optional[bytes]:
        """First value of header ``name`` (lower-case bytes) or None."""
        for k, v in self.headers:
            if k == name:
                return v
        return None


def response_bytes(status: int, body: bytes, content_type: bytes = b"application/json",
                   keep_alive: bool = True, extra: bytes = b"") -> bytes:
    """A complete HTTP/1.1 response with Content-Length."""
    return b"".join((b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n" % (
        status, _REASONS.get(status, b"Status"), content_type, len(body)),
        extra, b"" if keep_alive else b"connection: close\r\n", b"\r\n", body))


Handler = Callable[["ServerProtocol", Request], Awaitable[None]]


class Limits:
    """Client-side limits and timeouts of one server (defaults after nginx's; times in seconds, sizes in bytes).

    * ``max_url`` (8 KiB, nginx ``large_client_header_buffers`` 8k) -> ``414``;
      ``max_header_bytes`` (32 KiB: 4 x 8k) for the whole request head, ``max_headers`` (100) -> ``431``;
      ``max_body`` (64 MiB) -> ``413`` (readable: answered before or while the body arrives, then the rest is read
      and discarded for up to ``linger_timeout``, nginx ``lingering_timeout`` 5 s, so the client sees the answer, not a
      reset).
    * ``header_timeout`` (60 s, nginx ``client_header_timeout``): the whole request head must arrive within it, counted
      from its first byte (from the accept for a new connection); ``body_timeout`` (60 s, nginx
      ``client_body_timeout``): the whole body within it, counted from the end of the head (stricter than nginx, which
      times the gap between reads, so a 1-byte-per-minute body cannot hold a socket). Both answer ``408`` and close.
    * ``keepalive_timeout`` (75 s, nginx ``keepalive_timeout``): an idle kept-alive connection is closed.
    * ``max_connections`` (4096; nginx ``worker_connections`` 512 per worker): accepted connections beyond it are
      answered ``503`` with ``connection: close`` at once.
    * ``backend_read_timeout`` (600 s; nginx ``proxy_read_timeout`` is 60 s, but a non-streamed LLM answer sends no
      byte until the whole generation is done): a backend connection of a running request that receives nothing for
      this long fails with a timeout (the router answers ``504`` when nothing reached the client yet).

    Enforcement: one timer per server (:class:`Hub`) looks at every connection each ``tick`` seconds (a quarter of the
    smallest timeout, 20 ms to 1 s). The hot path only marks a phase change (``_t = 0.0``); the sweep that sees the
    mark starts the clock, so a timeout fires between its value and its value plus two ticks (at most 1.5x), and no
    request pays for a timer or a clock read.
    Raises ValueError for a non-positive value.
    """

    __slots__ = ("max_url", "max_header_bytes", "max_headers", "max_body", "header_timeout", "body_timeout",
                 "keepalive_timeout", "linger_timeout", "max_connections", "backend_read_timeout")

    def __init__(self, max_url: int = 8192, max_header_bytes: int = 32768, max_headers: int = 100,
                 max_body: int = 64 << 20, header_timeout: float = 60.0, body_timeout: float = 60.0,
                 keepalive_timeout: float = 75.0, linger_timeout: float = 5.0, max_connections: int = 4096,
                 backend_read_timeout: float = 600.0):
        for k, v in locals().items():
            if k != "self":
                if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                    raise ValueError(f"HTTP limit {k} must be a positive number, got {v!r}")
                setattr(self, k, v)

    def tick(self) -> float:
        """Seconds between two sweeps of the :class:`Hub`."""
        t = min(self.header_timeout, self.body_timeout, self.keepalive_timeout, self.backend_read_timeout) / 4
        return min(max(t, 0.02), 1.0)


_DEFAULT_LIMITS = Limits()


class Hub:
    """The connections of one server and the one timer that enforces their timeouts (:class:`Limits`).

    ``start()`` in the running loop arms the timer; ``close()`` stops it. ``refused`` counts connections answered 503
    because ``max_connections`` were open; ``timeouts`` counts connections closed by a client-side timeout.
    ``on_answer(status)``, when set, is called for every answer the HTTP layer makes itself (400 malformed HTTP, 408,
    413, 414, 431, 503 over ``max_connections``), so the router's answer counter sees them too.
    """

    __slots__ = ("limits", "conns", "refused", "timeouts", "on_answer", "_handle", "_loop")

    def __init__(self, limits: Optional[Limits] = None, on_answer: Optional[Callable[[int], None]] = None):
        self.limits = limits or Limits()
        self.conns: set = set()
        self.refused = 0
        self.timeouts = 0
        self.on_answer = on_answer
        self._handle = None
        self._loop = None

    def start(self) -> None:
        """Arm the sweep timer in the running loop."""
        self._loop = asyncio.get_event_loop()
        self._handle = self._loop.call_later(self.limits.tick(), self._sweep)

    def close(self) -> None:
        """Stop the sweep timer."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _sweep(self) -> None:
        lim = self.limits
        now = time.perf_counter()
        try:
            for c in list(self.conns):
                if c.closed:
                    continue
                if c._busy:
                    for b in list(c.backends):  # fail() may remove b from the list
                        if b.t_io == 0.0:
                            b.t_io = now  # activity since the last sweep: the silence starts now
                        elif now - b.t_io > lim.backend_read_timeout:
                            why = (f"the client read none of backend {b.pool.name}'s answer for" if b.held else
                                   f"backend {b.pool.name} sent nothing for")
                            b.fail(BackendError(f"{why} {lim.backend_read_timeout:.3g} s", b.forwarded,
                                                timeout=True))
                    continue
                if c._t == 0.0:
                    c._t = now  # a new phase began since the last sweep: time it from now
                    continue
                r = c._reading
                if r == 1 and now - c._t > lim.header_timeout:
                    self.timeouts += 1
                    c.send(408, error_body(408, "request head not received in time (header_timeout_s)"),
                           keep_alive=False)
                    self._answered(408)
                elif r == 2 and now - c._t > lim.body_timeout:
                    self.timeouts += 1
                    c.send(408, error_body(408, "request body not received in time (body_timeout_s)"),
                           keep_alive=False)
                    self._answered(408)
                elif r == 0 and now - c._t > lim.keepalive_timeout:
                    c.closed = True
                    c.transport.close()
        finally:
            if self._handle is not None:
                self._handle = self._loop.call_later(lim.tick(), self._sweep)

    def _answered(self, status: int) -> None:
        cb = self.on_answer
        if cb is not None:
            try:
                cb(status)
            except Exception:  # noqa: BLE001 - a metrics hook never breaks the HTTP layer
                pass


_MAX_PIPELINED = 32  # queued pipelined requests per connection before it stops reading
#: the most bytes of a backend answer the router holds in memory (an answer it collects: a PD prefill leg's, a model
#: list, a fanned-out choice's); a larger one fails its request with a BackendError (502) and closes the connection
MAX_COLLECTED = 64 << 20


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing after the request was refused (response already sent)."""


class ServerProtocol(asyncio.Protocol):
    """Client-facing HTTP/1.1 connection. ``handler(conn, request)`` must write exactly one response to
    ``conn.transport`` (via :meth:`send` or by forwarding a backend response).

    Args:
        handler: coroutine function for a request. max_body: body limit in bytes (``hub.limits.max_body`` wins when
            a hub is given). fast: optional callback driver (see :func:`serve`). hub: the server's :class:`Hub`
            (limits, timeouts, connection cap); without one, the default :class:`Limits` sizes apply and no timeouts.
    """

    __slots__ = ("handler", "transport", "parser", "_url", "_headers", "_body", "_queue", "_task", "closed",
                 "peer", "backends", "max_body", "fast", "_busy", "hub", "lim", "_reading", "_t", "_hb", "_nbody",
                 "_clen", "_discard", "_expect", "_paused", "_cl_digits", "write_paused")

    def __init__(self, handler: Handler, max_body: int = 64 << 20, fast=None, hub: Optional[Hub] = None):
        self.handler = handler
        self.fast = fast
        self._busy = False
        self.hub = hub
        self.lim = hub.limits if hub is not None else _DEFAULT_LIMITS
        self.max_body = self.lim.max_body if hub is not None else max_body
        self._cl_digits = len(str(self.max_body))  # a shorter Content-Length cannot exceed the limit
        self.transport = None
        self.parser = httptools.HttpRequestParser(self)
        self._queue: List[Request] = []
        self._task: Optional[asyncio.Task] = None
        self.closed = False
        self.peer = None
        self.backends: List["BackendConn"] = []  # backend connections the current request uses
        self._reading = 1  # 0 idle (kept alive), 1 reading a request head, 2 reading a body
        self._t = 0.0  # start of the current phase (0.0: not seen by the Hub's sweep yet)
        self._hb = 0  # bytes received while the current head is incomplete
        self._nbody = 0
        self._clen = None
        self._discard = False  # refused: read and drop whatever the client still sends
        self._expect = False
        self._paused = False
        #: the client is not reading: its transport's write buffer is above the high-water mark (asyncio's
        #: ``pause_writing``); backends forwarding to it stop reading until ``resume_writing``
        self.write_paused = False

    # asyncio callbacks
    def pause_writing(self):
        self.write_paused = True

    def resume_writing(self):
        self.write_paused = False
        for b in self.backends:
            b.unhold()

    def connection_made(self, transport):
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        _nodelay(transport)
        hub = self.hub
        if hub is not None:
            if len(hub.conns) >= self.lim.max_connections:
                hub.refused += 1
                self._refuse(503, error_body(503, "too many connections (max_connections); retry later"))
                return
            hub.conns.add(self)

    def connection_lost(self, exc):
        self.closed = True
        if self.hub is not None:
            self.hub.conns.discard(self)
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for b in self.backends:
            b.abort()
        self.backends = []

    def data_received(self, data: bytes):
        if self._discard:
            return
        if self._reading != 2:
            self._hb += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.send(400, error_body(400, "upgrade not supported"), keep_alive=False)
            if self.hub is not None:
                self.hub._answered(400)
            return
        except httptools.HttpParserError as ex:
            if not self._discard:
                self._refuse(400, error_body(400, f"malformed HTTP request: {ex}"))
            return
        if self._reading == 1 and self._hb > self.lim.max_header_bytes + self.lim.max_url:
            self._refuse(431, error_body(431, "request head too large (max_header_bytes)"))

    def _refuse(self, status: int, body: bytes) -> None:
        """Answer ``status`` with ``connection: close``, then read and drop the rest for ``linger_timeout`` (the
        client sees the answer instead of a reset: closing with unread data would send RST)."""
        self._discard = True
        self._queue = []
        if self.closed:
            return
        t = self.transport
        t.write(response_bytes(status, body, keep_alive=False))
        self.closed = True
        if self.hub is not None:
            self.hub.conns.discard(self)
            self.hub._answered(status)
        try:
            if t.can_write_eof():
                t.write_eof()
        except (OSError, RuntimeError):
            pass
        asyncio.get_event_loop().call_later(self.lim.linger_timeout, t.close)

    # httptools callbacks
    def on_message_begin(self):
        self._reading = 1
        self._t = 0.0
        self._url = b""
        self._headers = []
        self._body = []
        self._nbody = 0
        self._clen = None
        self._expect = False

    def on_url(self, url: bytes):
        self._url += url
        if len(self._url) > self.lim.max_url:
            self._refuse(414, error_body(414, "request URL too long (max_url)"))
            raise _Refused

    def on_header(self, name: bytes, value: bytes):
        name = name.lower()
        self._headers.append((name, value))
        if name == b"content-length":
            self._clen = value
        elif name == b"expect":
            self._expect = value.lower() == b"100-continue"

    def on_headers_complete(self):
        # sizes: a head still incomplete is cut in data_received; here the finished one (cheap bound first)
        lim = self.lim
        h = self._headers
        if len(h) > lim.max_headers:
            self._refuse(431, error_body(431, "too many request headers (max_headers)"))
            raise _Refused
        if self._hb > lim.max_header_bytes and sum(len(k) + len(v) + 4 for k, v in h) > lim.max_header_bytes:
            self._refuse(431, error_body(431, "request headers too large (max_header_bytes)"))
            raise _Refused
        self._reading = 2
        self._t = 0.0
        self._hb = 0
        cl = self._clen
        if cl is not None and len(cl) >= self._cl_digits and (len(cl) > 18 or not cl.isdigit()
                                                               or int(cl) > self.max_body):
            self._refuse(413, error_body(413, f"request body too large: {cl[:32].decode('ascii', 'replace')} "
                                              f"bytes, limit {self.max_body} (max_body_mb)"))
            raise _Refused
        if self._expect and not self._busy:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes):
        n = self._nbody = self._nbody + len(body)  # a running count: 1-byte chunks cost O(1) each
        if n > self.max_body:
            self._refuse(413, error_body(413, f"request body too large: over {self.max_body} bytes (max_body_mb)"))
            raise _Refused
        self._body.append(body)

    def on_message_complete(self):
        self._reading = 0
        self._hb = 0
        if self.closed:
            return
        b = self._body
        body = b"".join(b) if len(b) != 1 else b[0]
        req = Request(self.parser.get_method(), self._url, self._headers, body, self.parser.should_keep_alive())
        if self._busy:
            q = self._queue
            q.append(req)  # HTTP/1.1 pipelining: answer in order
            if len(q) >= _MAX_PIPELINED and not self._paused:
                self._paused = True  # stop reading: a pipelining client cannot queue without bound
                self.transport.pause_reading()
        else:
            self._dispatch(req)

    def _dispatch(self, req: Request) -> None:
        self._busy = True
        fast = self.fast
        try:
            if fast is not None and fast(self, req):
                return  # handled with callbacks; the fast path calls done(req)
        except Exception as ex:  # a handler bug must not surface as a parser error ("malformed request")
            self._internal_error(ex)
            return
        self.run_async(req, self.handler(self, req))

    def _internal_error(self, ex: BaseException) -> None:
        self._busy = False
        self.send(500, error_body(500, f"internal router error: {type(ex).__name__}: {ex}"), keep_alive=False)

    def run_async(self, req: Request, coro) -> None:
        """Finish ``req`` with a coroutine (slow path: awaits, retries, PD); calls :meth:`done` afterwards."""
        self._task = asyncio.get_event_loop().create_task(self._run(req, coro))

    async def _run(self, req: Request, coro):
        try:
            await coro
        except asyncio.CancelledError:
            for b in self.backends:
                b.abort()
            self.backends = []
            raise
        except Exception as ex:  # a handler bug must not kill the connection silently
            if not self.closed:
                self._internal_error(ex)
        self._task = None
        self.done(req)

    def done(self, req: Request) -> None:
        """The response to ``req`` is complete: close if not keep-alive, else start the next pipelined request."""
        if not req.keep_alive and not self.closed:
            self.transport.close()
            self.closed = True
        self._busy = False
        if self._reading == 0:
            self._t = 0.0  # idle from now (keep-alive timeout)
        if self._queue and not self.closed:
            if self._paused and len(self._queue) <= _MAX_PIPELINED // 2:
                self._paused = False
                self.transport.resume_reading()
            self._dispatch(self._queue.pop(0))

    def send(self, status: int, body: bytes, content_type: bytes = b"application/json", keep_alive: bool = True,
             extra: bytes = b"") -> None:
        """Write a complete response (Content-Length framed)."""
        if self.closed:
            return
        self.transport.write(response_bytes(status, body, content_type, keep_alive, extra))
        if not keep_alive:
            self.transport.close()
            self.closed = True


class BackendError(Exception):
    """Backend connection failed, closed early, answered something that is not HTTP, or timed out
    (``sent_to_client``: bytes were already forwarded; ``timeout``: it timed out, the router answers 504 rather than
    502; ``prefill_failed``: no prefill instance could serve a concurrent-flow PD request, the decode instance is not
    to blame)."""

    def __init__(self, msg: str, sent_to_client: bool = False, timeout: bool = False, prefill_failed: bool = False):
        super().__init__(msg)
        self.sent_to_client = sent_to_client
        self.timeout = timeout
        self.prefill_failed = prefill_failed

    @property
    def status(self) -> int:
        """The status a client gets for this failure when nothing was forwarded yet: 504 (timeout) or 502."""
        return 504 if self.timeout else 502


class BackendConn(asyncio.Protocol):
    """One kept-alive connection to a backend; one request at a time.

    A forwarded response reaches the client only once its status line and headers parsed: bytes before that are held
    back, so a backend that answers garbage fails with BackendError (the router answers 502) instead of reaching the
    client. ``t_io`` is reset to 0.0 on every send or receive; the :class:`Hub`'s sweep stamps it and times out a
    backend that stays silent."""

    __slots__ = ("pool", "transport", "parser", "fut", "sink", "status", "headers", "body", "nchunks", "t_first",
                 "t_last", "gap_sum", "usable", "forwarded", "first_cb", "done_cb", "t_io", "hdr_done", "pending",
                 "held", "client", "nbody")

    def __init__(self, pool: "Pool"):
        self.pool = pool
        self.transport = None
        self.parser = httptools.HttpResponseParser(self)
        self.fut: Optional[asyncio.Future] = None
        self.sink = None
        self.usable = False
        self.forwarded = False
        self.first_cb = None
        self.done_cb = None
        self.t_io = 0.0
        self.hdr_done = False
        self.pending = None
        #: reading paused because the client's write buffer is full (:meth:`ServerProtocol.pause_writing`)
        self.held = False
        self.client: Optional[ServerProtocol] = None

    def connection_made(self, transport):
        self.transport = transport
        self.usable = True
        _nodelay(transport)

    def hold(self) -> None:
        """Stop reading the backend: the client it forwards to is not reading (backpressure)."""
        if not self.held and self.transport is not None and not self.transport.is_closing():
            self.held = True
            self.transport.pause_reading()

    def unhold(self) -> None:
        """Read the backend again (the client's write buffer drained)."""
        if self.held:
            self.held = False
            if self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    def connection_lost(self, exc):
        self.usable = False
        if self.fut is not None or self.done_cb is not None:
            self.fail(BackendError(f"backend {self.pool.name} closed the connection" + (f": {exc}" if exc else ""),
                                   self.forwarded))

    def fail(self, err: BackendError) -> None:
        """End the running request with ``err`` (its future or ``done_cb``) and close the connection."""
        f = self.fut
        self.fut = None
        cb = self.done_cb
        self.done_cb = None
        self.sink = None
        self.abort()
        if f is not None and not f.done():
            f.set_exception(err)
        if cb is not None:
            cb(self, err)

    def abort(self) -> None:
        """Close the connection now (client went away): vLLM aborts the request on disconnect."""
        self.usable = False
        if self.transport is not None:
            self.transport.abort()

    def start(self, data: bytes, sink, first_cb=None, done_cb=None) -> Optional[asyncio.Future]:
        """Send a request; forward the response to ``sink`` (a transport) or collect it when ``sink`` is None.
        ``first_cb()`` runs when the first body bytes arrive (e.g. prefill finished). With ``done_cb``, no future is
        made: ``done_cb(conn, None)`` runs at the end of the response, ``done_cb(conn, BackendError)`` on failure
        (the connection is then closed; on success it is NOT returned to the pool: call ``pool.release``)."""
        self.first_cb = first_cb
        self.done_cb = done_cb
        self.unhold()
        self.parser = httptools.HttpResponseParser(self)
        self.fut = None if done_cb is not None else asyncio.get_event_loop().create_future()
        self.sink = sink
        get = getattr(sink, "get_protocol", None)  # a client connection's transport (not a choice's parser sink)
        client = get() if get is not None else None
        self.client = client if isinstance(client, ServerProtocol) else None
        self.forwarded = False
        self.status = 0
        self.headers = [] if sink is None else None
        self.body = []
        self.nbody = 0
        self.nchunks = 0
        self.t_first = 0.0
        self.t_last = 0.0
        self.gap_sum = 0.0
        self.hdr_done = False
        self.pending = None
        self.t_io = 0.0
        self.transport.write(data)
        return self.fut

    def data_received(self, data: bytes):
        self.t_io = 0.0
        sink = self.sink
        if sink is not None:
            if sink.is_closing():
                self.abort()
                return
            if self.hdr_done:
                sink.write(data)
                c = self.client
                if c is not None and c.write_paused:
                    self.hold()  # the client is not reading: stop reading its answer until it drains
            else:  # held back until the status line and headers parsed (on_headers_complete)
                self.pending = data if self.pending is None else self.pending + data
        elif self.fut is None and self.done_cb is None:
            self.abort()  # bytes while no request runs: a broken backend; never reuse this connection
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as ex:
            self.fail(BackendError(f"bad HTTP from backend {self.pool.name}: {ex}", self.forwarded))

    def on_headers_complete(self):
        # the status code from the parser here, not in on_status: httptools calls on_status with the reason phrase
        # only, and never for a status line without one ("HTTP/1.1 200"), which left such answers with status 0
        self.status = self.parser.get_status_code()
        self.hdr_done = True
        p = self.pending
        if p is not None:
            self.pending = None
            sink = self.sink
            if sink is not None:
                sink.write(p)
                self.forwarded = True
                c = self.client
                if c is not None and c.write_paused:
                    self.hold()

    def on_header(self, name: bytes, value: bytes):
        if self.headers is not None:
            self.headers.append((name.lower(), value))

    def on_body(self, body: bytes):
        t = time.perf_counter()
        if self.nchunks == 0:
            self.t_first = t
            if self.first_cb is not None:
                self.first_cb()
                self.first_cb = None
        else:
            self.gap_sum += t - self.t_last
        self.t_last = t
        self.nchunks += 1
        if self.sink is None:
            n = self.nbody = self.nbody + len(body)
            if n > MAX_COLLECTED:
                self.body = []
                if self.fut is not None or self.done_cb is not None:
                    self.fail(BackendError(f"backend {self.pool.name} answered more than {MAX_COLLECTED} bytes",
                                           self.forwarded))
                return
            self.body.append(body)

    def on_message_complete(self):
        self.usable = self.usable and self.parser.should_keep_alive()
        f = self.fut
        self.fut = None
        self.sink = None
        if f is not None and not f.done():
            f.set_result(self)
        if not self.usable and self.transport is not None:
            self.transport.close()
        cb = self.done_cb
        if cb is not None:
            self.done_cb = None
            cb(self, None)

    def collected(self) -> Tuple[int, list, bytes]:
        """(status, headers, body) of a collected response."""
        return self.status, self.headers, b"".join(self.body)


class Pool:
    """Keep-alive connections to one backend ``host:port``.

    Args:
        host, port: backend address. name: label for errors. connect_timeout: seconds.
    """

    __slots__ = ("host", "port", "name", "idle", "connect_timeout", "hostport")

    def __init__(self, host: str, port: int, name: str = "", connect_timeout: float = 3.0):
        self.host = host
        self.port = port
        self.name = name or f"{host}:{port}"
        self.idle: List[BackendConn] = []
        self.connect_timeout = connect_timeout
        self.hostport = f"{host}:{port}".encode()

    def idle_conn(self) -> Optional[BackendConn]:
        """An idle live connection or None (no waiting; the callback fast path uses it)."""
        idle = self.idle
        while idle:
            c = idle.pop()
            if c.usable and not c.transport.is_closing():
                return c
        return None

    async def acquire(self) -> BackendConn:
        """An idle live connection, or a new one. Raises BackendError if the backend cannot be reached."""
        idle = self.idle
        while idle:
            c = idle.pop()
            if c.usable and not c.transport.is_closing():
                return c
        loop = asyncio.get_event_loop()
        try:
            _, c = await asyncio.wait_for(
                loop.create_connection(lambda: BackendConn(self), self.host, self.port), self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as ex:
            raise BackendError(f"cannot connect to backend {self.name}: {ex!r}") from None
        task = asyncio.current_task()
        if task is not None and getattr(task, "cancelling", lambda: 0)():
            # Python 3.11's wait_for returns the connection when the caller is cancelled as it completes, and the
            # cancellation is lost (fixed in 3.12, cpython gh-86296): the request would then go out for a caller
            # that gave up on it (a cancelled PD leg left running on its engine). Honour the cancellation.
            c.transport.close()
            raise asyncio.CancelledError
        return c

    def release(self, c: BackendConn) -> None:
        """Return a finished connection for reuse (called by the connection itself)."""
        if len(self.idle) < 1024:
            self.idle.append(c)
        else:
            c.transport.close()

    def close(self) -> None:
        """Close all idle connections."""
        for c in self.idle:
            c.transport.close()
        self.idle = []


class Answer:
    """What one backend request got (a snapshot taken before its connection went back to the pool, where the next
    request resets it): ``status``, ``headers`` (collected responses only), ``body`` chunks (collected only),
    ``nchunks`` body chunks, ``t_first`` (``perf_counter`` seconds at the first body bytes), ``gap_sum`` (seconds
    between chunks, summed), ``forwarded`` (bytes reached the client)."""

    __slots__ = ("status", "headers", "body", "nchunks", "t_first", "gap_sum", "forwarded")

    def __init__(self, c: BackendConn):
        self.status, self.headers, self.body = c.status, c.headers, c.body
        self.nchunks, self.t_first, self.gap_sum, self.forwarded = c.nchunks, c.t_first, c.gap_sum, c.forwarded

    def collected(self) -> Tuple[int, list, bytes]:
        """(status, headers, body) of a collected response."""
        return self.status, self.headers, b"".join(self.body)


async def request(pool: Pool, data: bytes, sink=None, conn: Optional[ServerProtocol] = None,
                  timeout: Optional[float] = None, first_cb=None) -> Answer:
    """Send raw request bytes through ``pool``; forward to ``sink`` or collect. The connection is registered on the
    client ``conn`` (so a disconnect aborts it). Returns the :class:`Answer`, taken before the connection is pooled
    again: a caller that reads it later (a leg run as its own task) cannot see another request's state. Raises
    BackendError on failure or timeout (the connection is then closed)."""
    c = await pool.acquire()
    if conn is not None:
        conn.backends.append(c)
    ok = False
    try:
        try:
            fut = c.start(data, sink, first_cb)
        except RuntimeError as ex:  # uvloop: transport closed under us (backend died)
            raise BackendError(f"backend {pool.name} connection closed: {ex}") from None
        if timeout is None:
            await fut
        else:
            try:
                await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                c.abort()
                raise BackendError(f"backend {pool.name} timed out after {timeout:.3g} s", c.forwarded,
                                   timeout=True) from None
        ok = True
        answer = Answer(c)
    except BaseException:
        c.abort()
        raise
    finally:
        if conn is not None:
            try:
                conn.backends.remove(c)
            except ValueError:
                pass
        if ok and c.usable:
            pool.release(c)
    return answer


def build_request(method: bytes, path: bytes, hostport: bytes, headers: bytes, body: bytes) -> bytes:
    """Raw HTTP/1.1 request bytes with Content-Length (``headers``: pre-joined ``name: value\\r\\n`` lines)."""
    return b"%s %s HTTP/1.1\r\nhost: %s\r\n%scontent-length: %d\r\n\r\n%s" % (
        method, path, hostport, headers, len(body), body)


#: request headers that pin a request to instances by id (router option ``allow_pinning``,
#: :meth:`dlmix.router.server.Router._pins`)
PIN_PREFILL = b"x-dlmix-prefill-instance"
PIN_DECODE = b"x-dlmix-decode-instance"
#: client headers addressed to the router itself (instance pinning), never forwarded to an engine
ROUTER_ONLY = frozenset((PIN_PREFILL, PIN_DECODE))
_NOT_FORWARDED = HOP_BY_HOP | ROUTER_ONLY


def forward_headers(headers: list) -> bytes:
    """Client headers minus hop-by-hop, host, content-length, authorization and the router's own pinning headers,
    as raw lines."""
    return b"".join(b"%s: %s\r\n" % (k, v) for k, v in headers if k not in _NOT_FORWARDED)


async def serve(handler: Handler, host: str, port: int, reuse_port: bool = False, backlog: int = 4096,
                fast=None, max_body: int = 64 << 20, hub: Optional[Hub] = None):
    """Start listening; returns the asyncio Server. ``fast(conn, req) -> bool`` may handle a request with callbacks
    (returning True) before the coroutine ``handler`` is used. With ``hub`` (a :class:`Hub`, started here) its
    :class:`Limits` and timeouts apply; without one, only ``max_body`` and the default size limits."""
    loop = asyncio.get_event_loop()
    if hub is not None:
        hub.start()
    return await loop.create_server(lambda: ServerProtocol(handler, max_body, fast, hub), host, port,
                                    backlog=backlog, reuse_port=reuse_port or None)
