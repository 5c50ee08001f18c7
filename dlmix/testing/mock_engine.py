"""The one mock OpenAI engine of dlmix (asyncio, in process or as a command): vLLM's API with known behaviour.

Used by the router tests (in process, with :class:`~dlmix.testing.LoopThread`), the bench tests, ``dlmix launch``
(``engine: mock``, run as ``python -m dlmix.testing.mock_engine``) and ``benchmarks/router.py`` (``--canned``).

* ``POST /v1/completions`` and ``/v1/chat/completions``, streaming (SSE, chunked; ``stream_options.include_usage``)
  or not; deterministic output: ``max_tokens`` words derived from the prompt, fixed ``id``/``created``, so a direct
  call and a routed call (also through PD) give identical answers. Prompt tokens: token-id lists as they are, text as
  its UTF-8 bytes (:class:`~dlmix.router.tokenize.PromptExtractor` ``"bytes"`` mode, as the router's test mode).
* Timing: the first token ``ttft`` seconds after the request arrived, then one token every ``itl`` seconds (a
  non-streamed answer is sent after ``ttft + itl * (n - 1)``).
* PD: a request with ``kv_transfer_params.do_remote_decode`` is a prefill leg (1 token, returns NIXL-like
  ``kv_transfer_params``); one with ``do_remote_prefill`` is recorded in ``remote_prefills`` and decodes normally.
* SGLang's PD flow (``engine="sglang"``): a request carrying ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``
  on a ``prefill`` mock (its ``bootstrap_port`` set) is a prefill leg: after ``ttft`` it marks the room ready (in a
  table shared by the mocks of one process) and answers 1 token; on a ``decode`` mock it waits (up to
  ``bootstrap_timeout`` s; 500 then) until the room named by its bootstrap fields is ready, then decodes normally.
  A ``decode`` SGLang mock answers a request without bootstrap fields with 400, as a decode-mode server cannot serve
  it. ``rooms`` records ``(bootstrap_host, bootstrap_port, bootstrap_room)`` of each leg.
* Prefix cache counters as vLLM counts them (``GET /metrics``: ``vllm:prefix_cache_queries_total``,
  ``vllm:prefix_cache_hits_total``, ``vllm:num_requests_running``, ``vllm:request_success_total``): the prompt is cut
  into ``block_size``-token blocks chained by hash; a request hits the leading full blocks seen before (unbounded).
* KV events over ZMQ PUB in vLLM's wire format (``BlockStored`` for the prompt's full blocks, hashed like vLLM,
  ``BlockRemoved`` on LRU eviction past ``capacity_blocks``).
* Control: ``fail_status`` (answer every generation request with that status, after ``fail_delay_s``), ``healthy``
  (``/health`` 200 or 503), ``die()`` (close the listener and drop every connection, like a killed process),
  ``received`` raw bodies (``bodies`` parsed), ``max_inflight``, ``aborted`` (streams cut short), ``cancelled`` (any
  request cut short).
* ``canned=True``: every generation request gets a fixed 8-token answer (JSON or SSE) written from a callback without
  parsing, so a router benchmark measures the router, not the mock; ``GET /mock/stats`` answers ``{"requests": n}``.

Command line (see :func:`main`): ``python -m dlmix.testing.mock_engine --port 8001 --ttft-ms 50 --itl-ms 10``.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional

import msgspec

from dlmix.router import proxy
from dlmix.router.kv_events import vllm as vllm_events
from dlmix.router.tokenize import PromptExtractor
from dlmix.routing.hashing import BlockHasher

__all__ = ["MockEngine", "serve", "main"]

_enc = msgspec.json.Encoder()
#: SGLang PD emulation: (bootstrap_port, bootstrap_room) -> name of the prefill mock that served the room
_READY_ROOMS: dict = {}
_GEN = (b"/v1/completions", b"/v1/chat/completions")


def _canned_responses() -> tuple:
    """(JSON response bytes, SSE response bytes) of the fixed 8-token answer."""
    body = _enc.encode({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "mock",
                        "choices": [{"index": 0, "text": " a b c d e f g h", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 250, "completion_tokens": 8, "total_tokens": 258}})
    plain = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    evs = [b"data: " + _enc.encode({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "mock",
                                    "choices": [{"index": 0, "text": f" w{i}"}]}) + b"\n\n" for i in range(8)]
    evs.append(b"data: [DONE]\n\n")
    sse = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
           + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in evs) + b"0\r\n\r\n")
    return plain, sse


#: the most tokens one mock answer may ask for (more: 400, as vLLM refuses more than its context); tests stream up to
#: tens of thousands, a hostile 1e23 made the mock build that many words (the process froze and grew by GBs)
MAX_TOKENS = 1 << 20

class MockEngine:
    """One mock engine. ``await start(port, host)`` -> ``self.url``; ``await stop()``.

    Args:
        model: served model name. role: informative (``prefill``/``decode``/``both``).
        ttft: seconds before the first token. itl: seconds between tokens.
        kv_events: publish KV events on ``tcp://127.0.0.1:<port>`` (``self.kv_endpoint``).
        block_size: KV block size (tokens) for events and prefix counters. capacity_blocks: LRU size for events.
        record: keep raw request bodies in ``received``. name: ``remote_engine_id`` of its prefill answers.
        canned: fixed fast answers (benchmarks; see the module docstring).
        engine: ``vllm`` or ``sglang`` (PD flow, see the module docstring). bootstrap_port: an SGLang prefill
        mock's bootstrap port (any int: no socket is opened). bootstrap_timeout: seconds an SGLang decode mock
        waits for its room's prefill.
    """

    def __init__(self, model: str = "mock", role: str = "both", ttft: float = 0.0, itl: float = 0.0,
                 kv_events: bool = False, block_size: int = 16, capacity_blocks: int = 100_000,
                 record: bool = True, name: str = "mock", canned: bool = False, engine: str = "vllm",
                 bootstrap_port: Optional[int] = None, bootstrap_timeout: float = 5.0):
        self.model, self.role, self.ttft, self.itl = model, role, ttft, itl
        self.engine = engine
        self.bootstrap_port = bootstrap_port
        self.bootstrap_timeout = bootstrap_timeout
        self.rooms: List[tuple] = []
        self.block_size = block_size
        self.capacity = capacity_blocks
        self.record = record
        self.name = name
        self.canned = canned
        self.received: List[bytes] = []
        self.received_headers: List[list] = []
        self.remote_prefills: List[dict] = []
        self.prefill_legs = 0
        self.requests = 0
        self.inflight = 0
        self.max_inflight = 0
        self.hits = 0  # prefix-cache hit tokens (vLLM's counter)
        self.queries = 0  # prefix-cache query tokens
        self.fail_status: Optional[int] = None
        self.fail_delay_s = 0.0  # seconds before the ``fail_status`` answer (a decode refusing after its prefill)
        self.aborted = 0  # streams cut short because the client (router) closed the connection
        self.cancelled = 0  # requests of any kind cut short that way (waiting, prefilling or streaming)
        self.healthy = True
        self._kv = kv_events
        self._pub = None
        self._stored: dict = {}
        self._seen: set = set()
        self._seq = 0
        self._conns: set = set()
        self._server = None
        self._extract = PromptExtractor("bytes")
        self._hasher = BlockHasher("sha256_cbor")
        self._canned = _canned_responses() if canned else None
        self.url = ""
        self.port = 0
        self.kv_endpoint = None

    @property
    def server(self):
        """The listening asyncio server (None before :meth:`start` and after :meth:`die`)."""
        return self._server

    @property
    def bodies(self) -> List[dict]:
        """The recorded request bodies, parsed."""
        return [msgspec.json.decode(b) for b in self.received]

    @property
    def running(self) -> int:
        """Requests in progress (vLLM's ``num_requests_running``)."""
        return self.inflight

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> str:
        """Listen on ``host:port`` (0: a free port); returns the base URL."""
        loop = asyncio.get_event_loop()
        fast = self._fast if self.canned else None

        def factory():
            return _MockConn(self, fast)

        self._server = await loop.create_server(factory, host, port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        if self._kv:
            import zmq
            import zmq.asyncio

            self._pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            kp = self._pub.bind_to_random_port("tcp://127.0.0.1")
            self.kv_endpoint = f"tcp://127.0.0.1:{kp}"
        return self.url

    async def stop(self) -> None:
        """Stop listening, drop connections, close the KV-event socket."""
        await self.die()
        if self._pub is not None:
            self._pub.close(0)
            self._pub = None

    async def die(self) -> None:
        """Stop listening and drop every open connection (a killed process)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for c in list(self._conns):
            if c.transport is not None:
                c.transport.abort()
        self._conns.clear()

    # ------------------------------------------------------------------ prefix counters
    def prefix_lookup(self, hashes: List[bytes], n_tokens: int) -> int:
        """Count hit tokens of a prompt of ``n_tokens`` tokens whose full blocks hash to ``hashes`` (leading blocks
        seen before), then remember its blocks. Returns the hit tokens."""
        hit_blocks = 0
        leading = True
        for h in hashes:
            if leading and h in self._seen:
                hit_blocks += 1
            else:
                leading = False
            self._seen.add(h)
        hit = hit_blocks * self.block_size
        self.hits += hit
        self.queries += n_tokens
        return hit

    def metrics_text(self) -> str:
        """Prometheus exposition of the counters (vLLM's metric names)."""
        lab = f'{{model_name="{self.model}"}}'
        return (f"# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{lab} {self.queries}\n"
                f"# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{lab} {self.hits}\n"
                f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{lab} {self.running}\n"
                f"# TYPE vllm:request_success counter\nvllm:request_success_total{lab} {self.requests}\n")

    # ------------------------------------------------------------------ events
    def _publish(self, hashes: List[bytes], tokens: List[int]) -> None:
        if self._pub is None:
            return
        new = []
        parent = None
        for i, h in enumerate(hashes):
            k = int.from_bytes(h, "big") & ((1 << 64) - 1)
            if k in self._stored:
                self._stored[k] = self._stored.pop(k)
            else:
                self._stored[k] = True
                new.append((i, k))
        events = []
        if new:
            i0 = new[0][0]
            parent = int.from_bytes(hashes[i0 - 1], "big") & ((1 << 64) - 1) if i0 > 0 else None
            bs = self.block_size
            events.append(vllm_events.BlockStored(
                block_hashes=[k for _, k in new], parent_block_hash=parent,
                token_ids=tokens[i0 * bs:(new[-1][0] + 1) * bs], block_size=bs, medium="GPU"))
        if len(self._stored) > self.capacity:
            drop = []
            while len(self._stored) > self.capacity:
                k = next(iter(self._stored))
                del self._stored[k]
                drop.append(k)
            events.append(vllm_events.BlockRemoved(block_hashes=drop, medium="GPU"))
        if events:
            payload = vllm_events.encode_batch(vllm_events.KVEventBatch(ts=time.time(), events=events))
            self._seq += 1
            self._pub.send_multipart([b"", self._seq.to_bytes(8, "big"), payload])

    # ------------------------------------------------------------------ HTTP
    def _fast(self, conn: proxy.ServerProtocol, req: proxy.Request) -> bool:
        """Canned mode: answer generation requests from the callback (no task, no parsing)."""
        if req.path not in _GEN:
            return False
        self.requests += 1
        b = req.body
        conn.transport.write(self._canned[1] if (b'"stream": true' in b or b'"stream":true' in b) else self._canned[0])
        conn.done(req)
        return True

    async def _handle(self, conn: proxy.ServerProtocol, req: proxy.Request) -> None:
        path = req.path
        if path == b"/health" or path == b"/ready":  # vLLM's and SGLang's health paths
            return conn.send(200 if self.healthy else 503, b"")
        if path == b"/v1/models":
            return conn.send(200, _enc.encode({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "mock", "max_model_len": 4096}]}))
        if path == b"/metrics":
            return conn.send(200, self.metrics_text().encode(), b"text/plain; version=0.0.4")
        if path == b"/mock/stats":
            return conn.send(200, _enc.encode({"requests": self.requests}))
        if path not in _GEN:
            return conn.send(404, b'{"detail":"Not Found"}')
        chat = path == b"/v1/chat/completions"
        self.requests += 1
        if self.record:
            self.received.append(req.body)
            self.received_headers.append(req.headers)
        if self.fail_status is not None:
            if self.fail_delay_s:
                await asyncio.sleep(self.fail_delay_s)
            return conn.send(self.fail_status, _enc.encode({"error": {"message": "mock failure", "type": "MockError",
                                                                      "code": self.fail_status}}))
        try:
            d = msgspec.json.decode(req.body)
        except msgspec.DecodeError:
            return conn.send(400, b'{"error":{"message":"invalid JSON","type":"BadRequestError","code":400}}')
        if not isinstance(d, dict):
            return conn.send(400, b'{"error":{"message":"body must be an object","type":"BadRequestError","code":400}}')
        n = d.get("max_completion_tokens") if chat else None
        n = d.get("max_tokens", 16) if n is None else n
        if not isinstance(n, int) or n < 1:
            return conn.send(400, _enc.encode({"error": {"message": f"max_tokens must be at least 1, got {n}.",
                                                         "type": "BadRequestError", "param": "max_tokens",
                                                         "code": 400}}))
        if n > MAX_TOKENS:  # as vLLM: not more than it can hold (1e23 froze the process and ate its memory)
            return conn.send(400, _enc.encode({"error": {"message": f"max_tokens must be at most {MAX_TOKENS} "
                                                                    f"(the mock's limit), got {n}.",
                                                         "type": "BadRequestError", "param": "max_tokens",
                                                         "code": 400}}))
        if d.get("model") not in (None, self.model):
            return conn.send(404, _enc.encode({"error": {"message": f"The model `{d.get('model')}` does not exist.",
                                                         "type": "NotFoundError", "code": 404}}))
        tokens, text = self._extract.extract(chat, d)
        tokens = tokens or []
        kvp_in = d.get("kv_transfer_params") or {}
        room = None
        if self.engine == "sglang":
            if "bootstrap_room" in d:
                room = (d.get("bootstrap_host"), d.get("bootstrap_port"), d.get("bootstrap_room"))
                self.rooms.append(room)
            elif self.role == "decode":
                return conn.send(400, _enc.encode({"error": {"message": "decode mode needs bootstrap_room",
                                                             "type": "BadRequestError", "code": 400}}))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if room is not None and self.role == "decode":
                deadline = time.monotonic() + self.bootstrap_timeout
                while _READY_ROOMS.get(room[1:]) is None:
                    if time.monotonic() > deadline:
                        return conn.send(500, _enc.encode({"error": {"message": f"bootstrap room {room[2]} timed "
                                                                                f"out", "code": 500}}))
                    await asyncio.sleep(0.005)
            if self.ttft:
                await asyncio.sleep(self.ttft)
            if room is not None and self.role == "prefill":
                if room[1] != self.bootstrap_port:
                    return conn.send(400, _enc.encode({"error": {"message": f"bootstrap_port {room[1]} is not "
                                                                            f"this prefill's", "code": 400}}))
                _READY_ROOMS[room[1:]] = self.name
                if len(_READY_ROOMS) > 100_000:
                    _READY_ROOMS.clear()
            salt = d.get("cache_salt")
            hashes = self._hasher.block_hashes(tokens, self.block_size, salt if isinstance(salt, str) else None)
            self.prefix_lookup(hashes, len(tokens))
            self._publish(hashes, tokens)
            seed = int.from_bytes(hashlib.sha256(msgspec.msgpack.encode(tokens)).digest()[:4], "big")
            rid = ("chatcmpl-" if chat else "cmpl-") + f"{seed:08x}"
            words = [f" w{(seed + i) % 997}" for i in range(n)]
            kvp_out = None
            if room is not None and self.role == "prefill":
                self.prefill_legs += 1
                words = words[:1]
            elif kvp_in.get("do_remote_decode"):
                self.prefill_legs += 1
                words = words[:1]
                bs = self.block_size
                kvp_out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.name,
                           "remote_request_id": rid, "remote_block_ids": list(range((len(tokens) + bs - 1) // bs)),
                           "remote_host": "127.0.0.1", "remote_port": self.port, "tp_size": 1,
                           "remote_num_tokens": len(tokens)}
            elif kvp_in.get("do_remote_prefill"):
                self.remote_prefills.append(kvp_in)
            usage = {"prompt_tokens": len(tokens), "total_tokens": len(tokens) + len(words),
                     "completion_tokens": len(words)}
            if d.get("stream"):
                try:
                    await self._stream(conn, chat, rid, words, d, usage)
                except asyncio.CancelledError:  # the client (router) closed the connection: vLLM aborts
                    self.aborted += 1
                    raise
            else:
                if self.itl and len(words) > 1:
                    await asyncio.sleep(self.itl * (len(words) - 1))
                text_out = "".join(words)
                if chat:
                    choice = {"index": 0, "message": {"role": "assistant", "content": text_out},
                              "logprobs": None, "finish_reason": "length", "stop_reason": None}
                else:
                    choice = {"index": 0, "text": text_out, "logprobs": None, "finish_reason": "length",
                              "stop_reason": None}
                out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": 0,
                       "model": self.model, "choices": [choice], "usage": usage, "kv_transfer_params": kvp_out}
                conn.send(200, _enc.encode(out))
        except asyncio.CancelledError:  # the client (router) closed the connection mid-request
            self.cancelled += 1
            raise
        finally:
            self.inflight -= 1

    async def _stream(self, conn, chat, rid, words, d, usage) -> None:
        t = conn.transport
        t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i, w in enumerate(words):
            if i and self.itl:
                await asyncio.sleep(self.itl)
            if conn.closed:
                self.aborted += 1
                return
            last = i == len(words) - 1
            if chat:
                ch = {"index": 0, "delta": {"content": w} if i else {"role": "assistant", "content": w},
                      "logprobs": None, "finish_reason": "length" if last else None}
            else:
                ch = {"index": 0, "text": w, "logprobs": None, "finish_reason": "length" if last else None}
            ev = b"data: " + _enc.encode({"id": rid, "object": obj, "created": 0, "model": self.model,
                                         "choices": [ch]}) + b"\n\n"
            t.write(b"%x\r\n%s\r\n" % (len(ev), ev))
        if (d.get("stream_options") or {}).get("include_usage"):
            ev = b"data: " + _enc.encode({"id": rid, "object": obj, "created": 0, "model": self.model,
                                         "choices": [], "usage": usage}) + b"\n\n"
            t.write(b"%x\r\n%s\r\n" % (len(ev), ev))
        done = b"data: [DONE]\n\n"
        t.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


class _MockConn(proxy.ServerProtocol):
    __slots__ = ("engine",)

    def __init__(self, engine: "MockEngine", fast=None):
        super().__init__(engine._handle, fast=fast)
        self.engine = engine

    def connection_made(self, transport):
        self.engine._conns.add(self)
        super().connection_made(transport)

    def connection_lost(self, exc):
        self.engine._conns.discard(self)
        super().connection_lost(exc)


async def serve(eng: MockEngine, host: str = "127.0.0.1", port: int = 0):
    """Start serving ``eng`` on ``host:port`` (0 = any free port) in the running loop; returns the asyncio server."""
    await eng.start(port, host)
    return eng.server


def main(argv: Optional[List[str]] = None) -> int:
    """Command line: one or more mock engines in this process until SIGINT/SIGTERM.

    ``--port P`` (or ``--ports P1,P2,...``), ``--host``, ``--model``, ``--role``, ``--ttft-ms``, ``--itl-ms``,
    ``--block-size``, ``--kv-events``, ``--canned``; unknown flags (an engine's) are printed and ignored. Test
    switches: ``--startup-s S`` sleeps before listening (a slow engine); ``--fail-after S`` exits with code 1 after
    ``S`` seconds without serving (an engine that fails to start); ``--spawn-child`` starts a ``sleep`` grandchild
    in the same process group and prints its pid (group kills must leave no orphans). Prints ``mock engine pid N``
    first and ``mock engine listening on URL`` per engine once serving. Returns the exit code.
    """
    ap = argparse.ArgumentParser(prog="python -m dlmix.testing.mock_engine")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--ports", default=None, help="comma-separated ports: several engines in one process")
    ap.add_argument("--model", default="mock")
    ap.add_argument("--role", default="both")
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--itl-ms", type=float, default=5.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-events", action="store_true")
    ap.add_argument("--canned", action="store_true", help="fixed fast answers (router benchmarks)")
    ap.add_argument("--startup-s", type=float, default=0.0, help="sleep before listening (a slow engine)")
    ap.add_argument("--fail-after", type=float, default=None)
    ap.add_argument("--spawn-child", action="store_true")
    ap.add_argument("--stop-delay-s", type=float, default=0.0,
                    help="keep serving this long after SIGINT/SIGTERM (an engine slow to stop)")
    a, unknown = ap.parse_known_args(argv)
    ports = [int(p) for p in a.ports.split(",")] if a.ports else [a.port if a.port is not None else 0]
    print(f"mock engine pid {os.getpid()} args {sys.argv[1:]} ignored {unknown}", flush=True)
    child = None
    if a.spawn_child:
        child = subprocess.Popen(["sleep", "600"])
        print(f"grandchild pid {child.pid}", flush=True)
    if a.fail_after is not None:
        time.sleep(a.fail_after)
        print("ERROR: mock engine failed to start (requested by --fail-after)", flush=True)
        return 1
    time.sleep(a.startup_s)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass

    async def run() -> None:
        engines = []
        for p in ports:
            e = MockEngine(a.model, a.role, a.ttft_ms / 1000, a.itl_ms / 1000, kv_events=a.kv_events,
                           block_size=a.block_size, record=False, name=f"mock{p}", canned=a.canned)
            print(f"mock engine listening on {await e.start(p, a.host)}"
                  + (f" kv_events {e.kv_endpoint}" if e.kv_endpoint else ""), flush=True)
            engines.append(e)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await asyncio.sleep(a.stop_delay_s)
        for e in engines:
            await e.stop()
        if child is not None:  # as an engine stops its own children (EngineCore, workers) on SIGTERM
            child.terminate()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
