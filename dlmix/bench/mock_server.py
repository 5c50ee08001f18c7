"""A small OpenAI-compatible mock engine (asyncio, no dependencies) with known, configurable delays.

Used by the bench unit tests (in process) and by ``dlmix launch`` tests and dry runs (``engine: mock``) as a stand-in
for a vLLM server that starts in well under a second. It is a test engine: it generates token id ``7`` repeatedly.

Endpoints: ``GET /health``, ``GET /v1/models``, ``GET /metrics`` (Prometheus text with vLLM's
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` counters and ``vllm:num_requests_running``),
``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming SSE with ``stream_options.include_usage``, or
one JSON body).

Timing: the first output chunk is sent ``ttft_s`` seconds after the request arrived, then one chunk per token every
``itl_s`` seconds. Prefix cache: the prompt (token ids; text is taken byte-wise) is cut into ``block_size``-token
blocks chained by hash; a request hits the leading full blocks an earlier request already had (infinite cache), and
the counters grow by ``hit blocks * block_size`` (hits) and ``len(prompt)`` (queries), as vLLM counts tokens.

Run standalone: ``python -m dlmix.bench.mock_server --port 8001 --ttft-ms 50 --itl-ms 10``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["MockEngine", "serve", "main"]


@dataclass
class MockEngine:
    """State and behaviour of one mock server. Times in seconds, lengths in tokens."""

    model: str = "mock"
    ttft_s: float = 0.0
    itl_s: float = 0.0
    block_size: int = 16
    seen_blocks: set = field(default_factory=set)
    hits: int = 0
    queries: int = 0
    running: int = 0
    requests: int = 0
    bodies: list = field(default_factory=list)

    def prefix_lookup(self, prompt: list[int]) -> int:
        """Count hit tokens for ``prompt`` (leading full blocks seen before), then remember its blocks."""
        key: object = None
        hit_blocks = 0
        leading = True
        for i in range(len(prompt) // self.block_size):
            key = hash((key, tuple(prompt[i * self.block_size:(i + 1) * self.block_size])))
            if leading and key in self.seen_blocks:
                hit_blocks += 1
            else:
                leading = False
            self.seen_blocks.add(key)
        hit = hit_blocks * self.block_size
        self.hits += hit
        self.queries += len(prompt)
        return hit

    def metrics_text(self) -> str:
        """Prometheus exposition of the counters."""
        lab = f'{{model_name="{self.model}"}}'
        return (f"# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{lab} {self.queries}\n"
                f"# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{lab} {self.hits}\n"
                f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{lab} {self.running}\n"
                f"# TYPE vllm:request_success counter\nvllm:request_success_total{lab} {self.requests}\n")


async def _write_head(w: asyncio.StreamWriter, status: int, ctype: str, length: Optional[int]) -> None:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
    head += f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    w.write((head + "\r\n").encode())


async def _send(w: asyncio.StreamWriter, status: int, body: bytes, ctype: str = "application/json") -> None:
    await _write_head(w, status, ctype, len(body))
    w.write(body)
    await w.drain()


async def _chunk(w: asyncio.StreamWriter, data: bytes) -> None:
    w.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await w.drain()


async def _completion(eng: MockEngine, w: asyncio.StreamWriter, body: dict, chat: bool) -> None:
    if chat:
        msgs = body.get("messages") or []
        prompt = list("".join(str(m.get("content", "")) for m in msgs).encode())
    else:
        p = body.get("prompt", "")
        if isinstance(p, list) and p and isinstance(p[0], list):
            p = p[0]
        prompt = list(p) if isinstance(p, list) else list(str(p).encode())
    n = int(body.get("max_tokens") or 16)
    eng.bodies.append(body)
    eng.requests += 1
    hit = eng.prefix_lookup([int(t) for t in prompt])
    obj = "chat.completion.chunk" if chat else "text_completion"
    usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
             "prompt_tokens_details": {"cached_tokens": hit}}
    eng.running += 1
    try:
        if not body.get("stream"):
            await asyncio.sleep(eng.ttft_s + eng.itl_s * max(n - 1, 0))
            choice = ({"index": 0, "message": {"role": "assistant", "content": "a" * n}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": "a" * n, "finish_reason": "length"})
            await _send(w, 200, json.dumps({"id": "mock", "object": obj, "model": eng.model,
                                            "choices": [choice], "usage": usage}).encode())
            return
        await _write_head(w, 200, "text/event-stream", None)
        await asyncio.sleep(eng.ttft_s)
        for i in range(n):
            if i:
                await asyncio.sleep(eng.itl_s)
            choice = ({"index": 0, "delta": {"content": "a"}, "finish_reason": None} if chat
                      else {"index": 0, "text": "a", "finish_reason": None})
            if i == n - 1:
                choice["finish_reason"] = "length"
            await _chunk(w, b"data: " + json.dumps({"id": "mock", "object": obj, "model": eng.model,
                                                    "choices": [choice]}).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            await _chunk(w, b"data: " + json.dumps({"id": "mock", "object": obj, "model": eng.model,
                                                    "choices": [], "usage": usage}).encode() + b"\n\n")
        await _chunk(w, b"data: [DONE]\n\n")
        await _chunk(w, b"")
    finally:
        eng.running -= 1


async def _handle(eng: MockEngine, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while True:
            line = await r.readline()
            if not line:
                return
            parts = line.decode("latin-1").split()
            if len(parts) < 2:
                return
            method, path = parts[0], parts[1].split("?")[0]
            length = 0
            while True:
                h = await r.readline()
                if h in (b"\r\n", b"\n", b""):
                    break
                k, _, v = h.decode("latin-1").partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v.strip())
            raw = await r.readexactly(length) if length else b""
            if method == "GET" and path == "/health":
                await _send(w, 200, b"", "text/plain")
            elif method == "GET" and path == "/v1/models":
                await _send(w, 200, json.dumps({"object": "list", "data": [{"id": eng.model, "object": "model"}]})
                            .encode())
            elif method == "GET" and path == "/metrics":
                await _send(w, 200, eng.metrics_text().encode(), "text/plain; version=0.0.4")
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                try:
                    body = json.loads(raw or b"{}")
                except json.JSONDecodeError:
                    await _send(w, 400, b'{"error": {"message": "invalid JSON"}}')
                    continue
                await _completion(eng, w, body, chat=path.endswith("chat/completions"))
            else:
                await _send(w, 404, b'{"error": {"message": "not found"}}')
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        try:
            w.close()
        except Exception:  # pragma: no cover
            pass


async def serve(eng: MockEngine, host: str = "127.0.0.1", port: int = 0) -> asyncio.AbstractServer:
    """Start serving ``eng`` on ``host:port`` (0 = any free port) in the running loop; returns the server."""
    return await asyncio.start_server(lambda r, w: _handle(eng, r, w), host, port)


def main(argv: Optional[list[str]] = None) -> int:
    """Command-line entry (see module docstring). Extra test switches: ``--fail-after S`` exits with code 1 after
    ``S`` seconds without ever serving (an engine that fails to start); ``--spawn-child`` starts a ``sleep``
    grandchild in the same process group and prints its pid (to check that group kills leave no orphans)."""
    ap = argparse.ArgumentParser(prog="python -m dlmix.bench.mock_server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="mock")
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--itl-ms", type=float, default=5.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--startup-s", type=float, default=0.0, help="sleep before listening (a slow engine)")
    ap.add_argument("--fail-after", type=float, default=None)
    ap.add_argument("--spawn-child", action="store_true")
    a, unknown = ap.parse_known_args(argv)
    print(f"mock engine pid {os.getpid()} args {sys.argv[1:]} ignored {unknown}", flush=True)
    if a.spawn_child:
        child = subprocess.Popen(["sleep", "600"])
        print(f"grandchild pid {child.pid}", flush=True)
    if a.fail_after is not None:
        time.sleep(a.fail_after)
        print("ERROR: mock engine failed to start (requested by --fail-after)", flush=True)
        return 1
    time.sleep(a.startup_s)
    eng = MockEngine(model=a.model, ttft_s=a.ttft_ms / 1000, itl_s=a.itl_ms / 1000, block_size=a.block_size)

    async def run() -> None:
        server = await serve(eng, a.host, a.port)
        print(f"mock engine listening on http://{a.host}:{a.port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with server:
            await stop.wait()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
