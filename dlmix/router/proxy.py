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
import socket
import time
from typing import Awaitable, Callable, List, Optional, Tuple

import httptools

HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
     b"transfer-encoding", b"upgrade", b"host", b"content-length", b"authorization", b"expect")
)

_REASONS = {200: b"OK", 201: b"Created", 204: b"No Content", 400: b"Bad Request", 401: b"Unauthorized",
            403: b"Forbidden", 404: b"Not Found", 405: b"Method Not Allowed", 409: b"Conflict",
            413: b"Payload Too Large", 499: b"Client Closed Request", 500: b"Internal Server Error",
            502: b"Bad Gateway", 503: b"Service Unavailable", 504: b"Gateway Timeout"}


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


class ServerProtocol(asyncio.Protocol):
    """Client-facing HTTP/1.1 connection. ``handler(conn, request)`` must write exactly one response to
    ``conn.transport`` (via :meth:`send` or by forwarding a backend response)."""

    __slots__ = ("handler", "transport", "parser", "_url", "_headers", "_body", "_queue", "_task", "closed",
                 "peer", "backends", "max_body", "fast", "_busy")

    def __init__(self, handler: Handler, max_body: int = 64 << 20, fast=None):
        self.handler = handler
        self.fast = fast
        self._busy = False
        self.max_body = max_body
        self.transport = None
        self.parser = httptools.HttpRequestParser(self)
        self._queue: List[Request] = []
        self._task: Optional[asyncio.Task] = None
        self.closed = False
        self.peer = None
        self.backends: List["BackendConn"] = []  # backend connections the current request uses

    # asyncio callbacks
    def connection_made(self, transport):
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        _nodelay(transport)

    def connection_lost(self, exc):
        self.closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for b in self.backends:
            b.abort()
        self.backends = []

    def data_received(self, data: bytes):
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.send(400, b'{"error":"upgrade not supported"}', keep_alive=False)
        except httptools.HttpParserError:
            self.send(400, b'{"error":"malformed HTTP request"}', keep_alive=False)

    # httptools callbacks
    def on_message_begin(self):
        self._url = b""
        self._headers = []
        self._body = []

    def on_url(self, url: bytes):
        self._url += url

    def on_header(self, name: bytes, value: bytes):
        self._headers.append((name.lower(), value))

    def on_body(self, body: bytes):
        self._body.append(body)
        if len(self._body) > 64 and sum(map(len, self._body)) > self.max_body:
            self.send(413, b'{"error":"request body too large"}', keep_alive=False)
            self.transport.abort()

    def on_message_complete(self):
        if self.closed:
            return
        body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        if len(body) > self.max_body:
            self.send(413, b'{"error":"request body too large"}', keep_alive=False)
            return
        req = Request(self.parser.get_method(), self._url, self._headers, body, self.parser.should_keep_alive())
        if self._busy:
            self._queue.append(req)  # HTTP/1.1 pipelining: answer in order
        else:
            self._dispatch(req)

    def _dispatch(self, req: Request) -> None:
        self._busy = True
        fast = self.fast
        if fast is not None and fast(self, req):
            return  # handled with callbacks; the fast path calls done(req)
        self.run_async(req, self.handler(self, req))

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
                import json as _j

                msg = _j.dumps({"error": f"internal router error: {type(ex).__name__}: {ex}"}).encode()
                self.send(500, msg, keep_alive=False)
        self._task = None
        self.done(req)

    def done(self, req: Request) -> None:
        """The response to ``req`` is complete: close if not keep-alive, else start the next pipelined request."""
        if not req.keep_alive and not self.closed:
            self.transport.close()
            self.closed = True
        self._busy = False
        if self._queue and not self.closed:
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
    """Backend connection failed, closed early or timed out (``sent_to_client`` says if bytes were forwarded)."""

    def __init__(self, msg: str, sent_to_client: bool = False):
        super().__init__(msg)
        self.sent_to_client = sent_to_client


class BackendConn(asyncio.Protocol):
    """One kept-alive connection to a backend; one request at a time."""

    __slots__ = ("pool", "transport", "parser", "fut", "sink", "status", "headers", "body", "nchunks", "t_first",
                 "t_last", "gap_sum", "usable", "forwarded", "first_cb", "done_cb")

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

    def connection_made(self, transport):
        self.transport = transport
        self.usable = True
        _nodelay(transport)

    def connection_lost(self, exc):
        self.usable = False
        f = self.fut
        if f is not None and not f.done():
            f.set_exception(BackendError(f"backend {self.pool.name} closed the connection"
                                         + (f": {exc}" if exc else ""), self.forwarded))
        cb = self.done_cb
        if cb is not None:
            self.done_cb = None
            cb(self, BackendError(f"backend {self.pool.name} closed the connection" + (f": {exc}" if exc else ""),
                                  self.forwarded))

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
        self.parser = httptools.HttpResponseParser(self)
        self.fut = None if done_cb is not None else asyncio.get_event_loop().create_future()
        self.sink = sink
        self.forwarded = False
        self.status = 0
        self.headers = [] if sink is None else None
        self.body = []
        self.nchunks = 0
        self.t_first = 0.0
        self.t_last = 0.0
        self.gap_sum = 0.0
        self.transport.write(data)
        return self.fut

    def data_received(self, data: bytes):
        sink = self.sink
        if sink is not None:
            if sink.is_closing():
                self.abort()
                return
            sink.write(data)
            self.forwarded = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as ex:
            f = self.fut
            if f is not None and not f.done():
                f.set_exception(BackendError(f"bad HTTP from backend {self.pool.name}: {ex}", self.forwarded))
            cb = self.done_cb
            self.done_cb = None
            self.abort()
            if cb is not None:
                cb(self, BackendError(f"bad HTTP from backend {self.pool.name}: {ex}", self.forwarded))

    def on_status(self, status: bytes):
        self.status = self.parser.get_status_code()

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


async def request(pool: Pool, data: bytes, sink=None, conn: Optional[ServerProtocol] = None,
                  timeout: Optional[float] = None, first_cb=None) -> BackendConn:
    """Send raw request bytes through ``pool``; forward to ``sink`` or collect. The connection is registered on the
    client ``conn`` (so a disconnect aborts it). Raises BackendError on failure or timeout (the connection is then
    closed)."""
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
                raise BackendError(f"backend {pool.name} timed out after {timeout:.3g} s", c.forwarded) from None
        ok = True
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
    return c


def build_request(method: bytes, path: bytes, hostport: bytes, headers: bytes, body: bytes) -> bytes:
    """Raw HTTP/1.1 request bytes with Content-Length (``headers``: pre-joined ``name: value\\r\\n`` lines)."""
    return b"%s %s HTTP/1.1\r\nhost: %s\r\n%scontent-length: %d\r\n\r\n%s" % (
        method, path, hostport, headers, len(body), body)


def forward_headers(headers: list) -> bytes:
    """Client headers minus hop-by-hop, host, content-length and authorization, as raw lines."""
    return b"".join(b"%s: %s\r\n" % (k, v) for k, v in headers if k not in HOP_BY_HOP)


async def serve(handler: Handler, host: str, port: int, reuse_port: bool = False, backlog: int = 4096,
                fast=None, max_body: int = 64 << 20):
    """Start listening; returns the asyncio Server. ``fast(conn, req) -> bool`` may handle a request with callbacks
    (returning True) before the coroutine ``handler`` is used."""
    loop = asyncio.get_event_loop()
    return await loop.create_server(lambda: ServerProtocol(handler, max_body, fast), host, port, backlog=backlog,
                                    reuse_port=reuse_port or None)
