"""Choices fanned out: a request for ``n > 1`` choices whose decode engine cannot serve several choices in PD runs as
``n`` requests of one choice each, and their answers are merged into the one answer the client asked for.

Which engines: a decode engine adapter that sets ``PD_CHOICES = "fan_out"`` (SGLang: for ``n > 1`` its tokenizer
manager runs a prefix warm-up and the ``n`` samples, all under the request's one bootstrap room, which one prefill
hand-off cannot serve, ``sglang/srt/managers/tokenizer_manager.py`` ``_handle_batch_request``). The router's server
asks :func:`wants_fan_out` once a PD placement names such a decode instance, and then hands the request to
:func:`run_choices` instead of sending its legs.

How: choice ``i`` is the client's body with ``n = 1`` (and ``seed + i`` when the client set a ``seed``, so that
sampled choices differ as an engine's own ``n`` choices do; greedy choices are equal either way). Each one goes the
router's whole way on its own (placement, prefill leg with its own room, decode leg, retries, metrics), through a
:class:`ChoiceConn` that stands in for the client's connection and parses what would have been sent to the client.

* ``stream: false``: when every choice answered 200, one answer: the first choice's fields, ``choices`` in order
  with ``index`` = ``i``, and ``usage`` with the prompt counted once and the completion tokens summed
  (``total_tokens`` = prompt + completions). Otherwise the first failed choice's answer as it came (status and
  body), and the other choices are cancelled.
* ``stream: true``: one event stream; each choice's events are forwarded as they arrive with their ``index``
  rewritten, and their ``id`` and ``created`` set to those of the stream's first event (an OpenAI stream's chunks
  share one ``id``; each choice's engine names its own, and a client that groups chunks by ``id`` would otherwise
  see ``n`` answers of one choice); the choices' usage events (``stream_options.include_usage``) are merged into
  one, sent after every choice ended, then one ``data: [DONE]``. A choice that fails before anything was sent
  answers the client as in the non-streamed case; after the stream started, an ``error`` event ends the stream and
  the other choices are cancelled.

A client that goes away cancels every choice (their backend connections close, as for one request).
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, List, Optional

import httptools
import msgspec

from dlmix.router.bodies import n_choices
from dlmix.router.proxy import MAX_COLLECTED, Request, error_body, response_bytes

__all__ = ["FAN_OUT", "ChoiceConn", "wants_fan_out", "choice_body", "run_choices", "merge_answers"]

#: the value of an engine adapter's ``PD_CHOICES`` whose decode instances get one request per choice
FAN_OUT = "fan_out"
#: the most choices one request may fan out into (each is a request of its own, with its own backend connections)
MAX_FAN_OUT = 128

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()
_STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n"


def wants_fan_out(engine: Any, body: Any) -> bool:
    """True when ``body`` (the parsed client body) asks for ``n > 1`` choices and the decode ``engine`` adapter
    fans them out (``PD_CHOICES == "fan_out"``)."""
    return getattr(engine, "PD_CHOICES", None) == FAN_OUT and n_choices(body) > 1


def choice_body(body: dict, i: int) -> dict:
    """The parsed body of choice ``i`` (0-based) of the client's ``body``: ``n = 1``, and ``seed + i`` when ``seed``
    is an integer. ``body`` is not modified."""
    b = dict(body)
    b["n"] = 1
    seed = b.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        b["seed"] = seed + i
    return b


class _Sink:
    """The transport a :class:`ChoiceConn` gives the router's forwarding code: it parses the HTTP response written
    to it (httptools) and hands status, headers and de-chunked body bytes to its connection."""

    __slots__ = ("conn", "parser", "closing")

    def __init__(self, conn: "ChoiceConn"):
        self.conn = conn
        self.parser = httptools.HttpResponseParser(conn)
        self.closing = False

    def write(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as ex:
            self.conn.broken = f"bad HTTP answer for choice {self.conn.index}: {ex}"
            self.abort()

    def is_closing(self) -> bool:
        return self.closing or self.conn.parent.closed

    def abort(self) -> None:
        if not self.closing:
            self.closing = True
            if not self.conn.complete:
                self.conn.broken = self.conn.broken or f"choice {self.conn.index} was cut off (its backend failed or fell silent mid-answer)"
            self.conn.ended()

    close = abort

    def get_extra_info(self, name: str, default=None):
        return self.conn.parent.transport.get_extra_info(name, default)

    def get_protocol(self):
        """The client's connection: a backend forwarding here stops reading while the client is not reading (its
        write buffer is full), as it does when it forwards to the client itself."""
        return self.conn.parent


class ChoiceConn:
    """Stands in for the client's connection while one choice runs: what the router would send the client is parsed
    here (``status``, ``headers``, ``body`` bytes, ``complete``), and :meth:`on_event` sees each ``data:`` line of
    an event stream as it arrives. ``closed`` follows the client's connection.

    Args:
        parent: the client's :class:`~dlmix.router.proxy.ServerProtocol`.
        index: the choice's index (0-based).
        on_event: ``(conn, payload bytes)`` for every ``data:`` line of a 200 event stream, or None.
        on_end: ``(conn)`` once the answer is complete or cut off.
    """

    __slots__ = ("parent", "index", "transport", "backends", "status", "headers", "body", "complete", "broken",
                 "on_event", "on_end", "_line", "_done", "_closed", "_nbody")

    def __init__(self, parent, index: int, on_event: Optional[Callable] = None, on_end: Optional[Callable] = None):
        self.parent = parent
        self.index = index
        # the client's own list: the server's sweep times out a silent backend of any choice, and a client that goes
        # away closes them all
        self.backends: List = parent.backends
        self.status = 0
        self.headers: List = []
        self.body: List[bytes] = []
        self.complete = False
        self.broken: Optional[str] = None
        self.on_event = on_event
        self.on_end = on_end
        self._line = bytearray()
        self._nbody = 0
        self._done = False
        self._closed = False
        self.transport = _Sink(self)

    @property
    def closed(self) -> bool:
        return self._closed or self.parent.closed

    @closed.setter
    def closed(self, v: bool) -> None:
        self._closed = bool(v)

    def send(self, status: int, body: bytes, content_type: bytes = b"application/json", keep_alive: bool = True,
             extra: bytes = b"") -> None:
        """What the router answers itself (an error, a refusal): parsed like a forwarded answer."""
        self.transport.write(response_bytes(status, body, content_type, True, extra))

    def done(self, req) -> None:  # the router's fast path only; choices take the coroutine path
        pass

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.transport.parser.get_status_code()

    def on_body(self, data: bytes) -> None:
        if self.status != 200 or self.on_event is None:
            self._nbody += len(data)
            if self._nbody > MAX_COLLECTED:
                return self._too_big("answer")
            self.body.append(data)
            return
        if b"\n" not in data:  # the pending line grows in place: no copy of it per chunk
            self._line += data
            if len(self._line) > MAX_COLLECTED:
                self._too_big("event line")
            return
        lines = (bytes(self._line) + data).split(b"\n")
        self._line = bytearray(lines.pop())
        for line in lines:
            line = line.rstrip(b"\r")
            if line.startswith(b"data:"):
                self.on_event(self, line[5:].strip())

    def on_message_complete(self) -> None:
        self.complete = True
        self.ended()

    def _too_big(self, what: str) -> None:
        self.body, self._line = [], bytearray()
        self.broken = self.broken or f"choice {self.index}'s {what} is larger than {MAX_COLLECTED} bytes"
        self.transport.abort()

    def ended(self) -> None:
        if not self._done:
            self._done = True
            if self.on_end is not None:
                self.on_end(self)

    def content_type(self) -> bytes:
        return next((v for k, v in self.headers if k == b"content-type"), b"application/json")


def merge_answers(answers: List[dict]) -> dict:
    """One non-streamed answer from the answers of choices ``0..n-1`` (each with its ``choices`` list): the first
    answer's fields, every choice with ``index`` = its request's position, ``usage`` with ``prompt_tokens`` of the
    first and ``completion_tokens`` summed (``total_tokens`` = their sum). Raises KeyError/TypeError on an answer
    without a ``choices`` list."""
    out = dict(answers[0])
    choices = []
    for i, a in enumerate(answers):
        for ch in a["choices"]:
            choices.append({**ch, "index": i})
    out["choices"] = choices
    usages = [a.get("usage") for a in answers]
    if all(isinstance(u, dict) for u in usages):
        out["usage"] = _merged_usage(usages)
    return out


def _merged_usage(usages: List[dict]) -> dict:
    u = dict(usages[0])
    completion = sum(int(x.get("completion_tokens") or 0) for x in usages)
    u["completion_tokens"] = completion
    u["total_tokens"] = int(u.get("prompt_tokens") or 0) + completion
    return u


class _Stream:
    """The merged event stream of the choices of one streamed request, written to the client's transport."""

    def __init__(self, client, keep_alive: bool):
        self.client = client
        self.keep_alive = keep_alive
        self.started = False
        self.usages: List[dict] = []
        self.usage_event: Optional[dict] = None
        #: ``id`` and ``created`` of the first event forwarded; every later event carries them too
        self.ident: Optional[dict] = None

    def _chunk(self, payload: bytes) -> None:
        ev = b"data: " + payload + b"\n\n"
        self.client.transport.write(b"%x\r\n%s\r\n" % (len(ev), ev))

    def start(self) -> None:
        if not self.started:
            self.started = True
            self.client.transport.write(_STREAM_HEAD + (b"" if self.keep_alive else b"connection: close\r\n")
                                        + b"\r\n")

    def event(self, conn: ChoiceConn, payload: bytes) -> None:
        if self.client.closed or payload == b"[DONE]":
            return
        try:
            ev = _dec.decode(payload)
        except msgspec.DecodeError:
            ev = None
        if not isinstance(ev, dict):
            self.start()
            self._chunk(payload)  # not ours to judge: passed on as it came
            return
        chs = ev.get("choices")
        if isinstance(chs, list) and not chs and isinstance(ev.get("usage"), dict):
            self.usages.append(ev["usage"])  # a usage event: merged, sent once at the end
            if self.usage_event is None:
                self.usage_event = ev
            return
        if isinstance(chs, list):
            ev["choices"] = [{**ch, "index": conn.index} if isinstance(ch, dict) else ch for ch in chs]
        self._same_ident(ev)
        self.start()
        self._chunk(_enc.encode(ev))

    def _same_ident(self, ev: dict) -> None:
        """Give ``ev`` the ``id`` and ``created`` of the first event forwarded (recording them from ``ev`` when it
        is the first)."""
        if self.ident is None:
            self.ident = {k: ev[k] for k in ("id", "created") if k in ev}
        else:
            for k, v in self.ident.items():
                if k in ev:
                    ev[k] = v

    def finish(self) -> None:
        self.start()
        if self.usage_event is not None:
            ev = {**self.usage_event, "usage": _merged_usage(self.usages)}
            self._same_ident(ev)
            self._chunk(_enc.encode(ev))
        self._chunk(b"[DONE]")
        self.client.transport.write(b"0\r\n\r\n")

    def fail(self, msg: str, status: int) -> None:
        """End a started stream with an ``error`` event and the last chunk."""
        self._chunk(error_body(status, msg))
        self.client.transport.write(b"0\r\n\r\n")


async def run_choices(client, req: Request, body: dict, chat: bool,
                      run_one: Callable[[ChoiceConn, Request, dict], Awaitable[None]]) -> None:
    """Answer ``req`` (parsed ``body``, ``n > 1`` choices) on the client's connection ``client`` by running each
    choice as its own request: ``run_one(conn, sub_request, sub_body)`` is the router's whole path for one request
    (it must answer on ``conn``). See the module's docstring for the merge. Cancelling this coroutine (the client
    went away) cancels every choice."""
    n = n_choices(body)
    stream = bool(body.get("stream"))
    merged = _Stream(client, req.keep_alive) if stream else None
    failed: List[ChoiceConn] = []
    wake = asyncio.Event()

    def on_end(c: ChoiceConn) -> None:
        if c.broken or c.status != 200:
            failed.append(c)
            wake.set()

    conns, tasks = [], []
    for i in range(n):
        sb = choice_body(body, i)
        sub = Request(req.method, req.url, req.headers, _enc.encode(sb), True)
        sub.t0 = req.t0
        c = ChoiceConn(client, i, merged.event if merged is not None else None, on_end)
        conns.append(c)
        tasks.append(asyncio.ensure_future(run_one(c, sub, sb)))
    pending = set(tasks)
    try:
        while pending and not failed:
            waiter = asyncio.ensure_future(wake.wait())
            try:
                _, pending = await asyncio.wait(pending | {waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            pending.discard(waiter)
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()
            for c, t in zip(conns, tasks):
                if t.done() and not c.complete and c not in failed:  # ended without a whole answer
                    c.broken = c.broken or f"choice {c.index} ended without an answer"
                    failed.append(c)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        if any(not t.done() for t in tasks):
            await asyncio.wait(tasks)
        for t in tasks:
            if t.done() and not t.cancelled():
                t.exception()  # retrieved
    if client.closed:
        return
    if failed:
        c = failed[0]
        status = c.status if c.status and c.status != 200 else 502
        msg = c.broken or f"choice {c.index} of {n} failed ({c.status})"
        if merged is not None and merged.started:
            merged.fail(msg, status)
            if not req.keep_alive:
                client.transport.close()
                client.closed = True
        elif c.status and c.status != 200 and c.complete:
            client.send(c.status, b"".join(c.body), c.content_type(), req.keep_alive)
        else:
            client.send(502, error_body(502, f"backend failed: {msg}"), b"application/json", req.keep_alive)
        return
    if merged is not None:
        merged.finish()
        if not req.keep_alive:
            client.transport.close()
            client.closed = True
        return
    try:
        out = merge_answers([_dec.decode(b"".join(c.body)) for c in conns])
    except (msgspec.DecodeError, KeyError, TypeError) as ex:
        client.send(502, error_body(502, f"backend answered a choice without choices: {ex}"),
                    b"application/json", req.keep_alive)
        return
    client.send(200, _enc.encode(out), b"application/json", req.keep_alive)
