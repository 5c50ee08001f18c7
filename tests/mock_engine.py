"""Mock vLLM engines for router tests and benchmarks: small asyncio servers speaking vLLM's OpenAI API.

* ``POST /v1/completions`` and ``/v1/chat/completions``, streaming (SSE, chunked) or not; deterministic output:
  ``max_tokens`` words derived from the prompt, fixed ``id``/``created``, so a direct call and a routed call (also
  through PD) give identical answers;
* PD: a request with ``kv_transfer_params.do_remote_decode`` is a prefill leg (1 token, returns NIXL-like
  ``kv_transfer_params``); one with ``do_remote_prefill`` is recorded in ``remote_prefills`` and decodes normally;
* KV events over ZMQ PUB in vLLM's wire format (``BlockStored`` for the prompt's full blocks, hashed like vLLM with
  token ids = UTF-8 bytes of the text, ``BlockRemoved`` on LRU eviction);
* control: ``ttft``/``itl`` latency (s), ``fail_status`` (answer every request with that status), ``die()`` (close
  the listener and drop every connection, like a killed process), ``received`` raw bodies, ``max_inflight``;
* ``GET /health``, ``GET /v1/models``.

``LoopThread`` runs an asyncio loop in a background thread so synchronous tests can drive servers with httpx.
"""
from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from typing import List, Optional

import msgspec

from dlmix.router import kv_events, proxy
from dlmix.routing.hashing import BlockHasher
from dlmix.router.tokenize import PromptExtractor

_enc = msgspec.json.Encoder()


class MockEngine:
    """One mock engine instance. ``await start()`` → ``self.url``; ``await stop()``.

    Args:
        model: served model name. role: informative (``prefill``/``decode``/``both``).
        ttft: seconds before the first token. itl: seconds between streamed tokens.
        kv_events: publish KV events on ``tcp://127.0.0.1:<port>`` (``self.kv_endpoint``).
        block_size: KV block size (tokens) for events. capacity_blocks: LRU cache size for events.
        record: keep raw request bodies in ``received``.
    """

    def __init__(self, model: str = "mock", role: str = "both", ttft: float = 0.0, itl: float = 0.0,
                 kv_events: bool = False, block_size: int = 16, capacity_blocks: int = 100_000,
                 record: bool = True, name: str = "mock"):
        self.model, self.role, self.ttft, self.itl = model, role, ttft, itl
        self.block_size = block_size
        self.capacity = capacity_blocks
        self.record = record
        self.name = name
        self.received: List[bytes] = []
        self.received_headers: List[list] = []
        self.remote_prefills: List[dict] = []
        self.prefill_legs = 0
        self.requests = 0
        self.inflight = 0
        self.max_inflight = 0
        self.fail_status: Optional[int] = None
        self.aborted = 0  # streams cut short because the client (router) closed the connection
        self.healthy = True
        self._kv = kv_events
        self._pub = None
        self._stored: dict = {}
        self._seq = 0
        self._conns: set = set()
        self._server = None
        self._extract = PromptExtractor("bytes")
        self._hasher = BlockHasher("sha256_cbor")
        self.url = ""
        self.kv_endpoint = None

    async def start(self, port: int = 0) -> str:
        loop = asyncio.get_event_loop()

        def factory():
            return _MockConn(self)

        self._server = await loop.create_server(factory, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        if self._kv:
            import zmq
            import zmq.asyncio

            self._pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            kp = self._pub.bind_to_random_port("tcp://127.0.0.1")
            self.kv_endpoint = f"tcp://127.0.0.1:{kp}"
        return self.url

    async def stop(self) -> None:
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

    # ------------------------------------------------------------------ events
    def _publish(self, tokens: List[int], salt=None) -> None:
        if self._pub is None:
            return
        hashes = self._hasher.block_hashes(tokens, self.block_size, salt)
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
            events.append(kv_events.BlockStored(
                block_hashes=[k for _, k in new], parent_block_hash=parent,
                token_ids=tokens[i0 * bs:(new[-1][0] + 1) * bs], block_size=bs, medium="GPU"))
        if len(self._stored) > self.capacity:
            drop = [next(iter(self._stored)) for _ in range(0)]
            while len(self._stored) > self.capacity:
                k = next(iter(self._stored))
                del self._stored[k]
                drop.append(k)
            events.append(kv_events.BlockRemoved(block_hashes=drop, medium="GPU"))
        if events:
            payload = kv_events.encode_batch(kv_events.KVEventBatch(ts=time.time(), events=events))
            self._seq += 1
            self._pub.send_multipart([b"", self._seq.to_bytes(8, "big"), payload])

    # ------------------------------------------------------------------ HTTP
    async def _handle(self, conn: proxy.ServerProtocol, req: proxy.Request) -> None:
        path = req.path
        if path == b"/health":
            return conn.send(200 if self.healthy else 503, b"")
        if path == b"/v1/models":
            return conn.send(200, _enc.encode({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "mock", "max_model_len": 4096}]}))
        if path not in (b"/v1/completions", b"/v1/chat/completions"):
            return conn.send(404, b'{"detail":"Not Found"}')
        chat = path == b"/v1/chat/completions"
        self.requests += 1
        if self.record:
            self.received.append(req.body)
            self.received_headers.append(req.headers)
        if self.fail_status is not None:
            return conn.send(self.fail_status, _enc.encode({"error": {"message": "mock failure", "type": "MockError",
                                                                      "code": self.fail_status}}))
        try:
            d = msgspec.json.decode(req.body)
        except msgspec.DecodeError:
            return conn.send(400, b'{"error":{"message":"invalid JSON","type":"BadRequestError","code":400}}')
        n = d.get("max_completion_tokens") if chat else None
        n = d.get("max_tokens", 16) if n is None else n
        if not isinstance(n, int) or n < 1:
            return conn.send(400, _enc.encode({"error": {"message": f"max_tokens must be at least 1, got {n}.",
                                                         "type": "BadRequestError", "param": "max_tokens",
                                                         "code": 400}}))
        if d.get("model") not in (None, self.model):
            return conn.send(404, _enc.encode({"error": {"message": f"The model `{d.get('model')}` does not exist.",
                                                         "type": "NotFoundError", "code": 404}}))
        tokens, text = self._extract.extract(chat, d)
        tokens = tokens or []
        kvp_in = d.get("kv_transfer_params") or {}
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.ttft:
                await asyncio.sleep(self.ttft)
            self._publish(tokens, d.get("cache_salt"))
            seed = int.from_bytes(hashlib.sha256(bytes(tokens)).digest()[:4], "big")
            rid = ("chatcmpl-" if chat else "cmpl-") + f"{seed:08x}"
            words = [f" w{(seed + i) % 997}" for i in range(n)]
            kvp_out = None
            if kvp_in.get("do_remote_decode"):
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

    def __init__(self, engine: "MockEngine"):
        super().__init__(engine._handle)
        self.engine = engine

    def connection_made(self, transport):
        self.engine._conns.add(self)
        super().connection_made(transport)

    def connection_lost(self, exc):
        self.engine._conns.discard(self)
        super().connection_lost(exc)


class LoopThread:
    """An asyncio event loop (uvloop if available) in a daemon thread; ``run(coro)`` waits for the result."""

    def __init__(self, use_uvloop: bool = True):
        if use_uvloop:
            try:
                import uvloop

                self.loop = uvloop.new_event_loop()
            except ImportError:  # pragma: no cover
                self.loop = asyncio.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *a):
        """Run a plain function on the loop thread and return its result."""
        async def _c():
            return fn(*a)
        return self.run(_c())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def main() -> None:
    """``python tests/mock_engine.py --port P [--ttft S] [--itl S] [--model M]``: one mock engine (benchmarks)."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ttft", type=float, default=0.0)
    ap.add_argument("--itl", type=float, default=0.0)
    ap.add_argument("--model", default="mock")
    ap.add_argument("--role", default="both")
    a = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass

    async def run():
        e = MockEngine(a.model, a.role, a.ttft, a.itl, record=False, name=f"mock{a.port}")
        await e.start(a.port)
        print(e.url, flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
