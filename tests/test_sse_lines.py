"""SSE lines split at CR, LF and CRLF only: a model's output may carry U+2028, U+0085 or \\x1c unescaped inside a
JSON chunk, where httpx's iter_lines (str.splitlines) would cut the event in two."""
from __future__ import annotations

import asyncio
import json

import httpx

from dlmix.net import aiter_sse_lines, iter_sse_lines, sse_split

ODD = "a\u2028b\u2029c\x85d\x1ce\x0bf"


def test_split_at_sse_line_ends_only():
    assert sse_split("", f"data: {ODD}\n\nx\r\ny\rz") == ([f"data: {ODD}", "", "x", "y"], "z")
    # a CR at the end of a read may be the first half of CRLF: kept until the next read
    assert sse_split("", "a\r") == ([], "a\r")
    assert sse_split("a\r", "\nb") == (["a"], "b")
    assert sse_split("a\r", "b") == (["a"], "b")


def _events():
    chunks = [{"choices": [{"index": 0, "text": ODD}]}, {"choices": [{"index": 0, "text": "ok"}]}]
    body = "".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    raw = body.encode()
    # delivered in 7-byte pieces: multi-byte characters and CRLF split across reads
    return chunks, [raw[i:i + 7] for i in range(0, len(raw), 7)]


def _async_transport(pieces):
    async def handler(request):
        async def gen():
            for p in pieces:
                yield p
        return httpx.Response(200, content=gen(), headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handler)


def test_sync_and_async_streams_keep_events_whole():
    chunks, pieces = _events()

    def handler(request):
        return httpx.Response(200, content=iter(pieces), headers={"content-type": "text/event-stream"})

    with httpx.Client(transport=httpx.MockTransport(handler)) as c, c.stream("GET", "http://x/") as r:
        got = [json.loads(x[6:]) for x in iter_sse_lines(r) if x.startswith("data: {")]
    assert got == chunks

    async def run():
        async with httpx.AsyncClient(transport=_async_transport(pieces)) as c:
            async with c.stream("GET", "http://x/") as r:
                return [json.loads(x[6:]) async for x in aiter_sse_lines(r) if x.startswith("data: {")]
    assert asyncio.run(run()) == chunks


def test_bench_client_counts_a_chunk_with_a_unicode_line_separator():
    from dlmix.bench.client import send_request
    _, pieces = _events()

    async def run():
        async with httpx.AsyncClient(transport=_async_transport(pieces)) as c:
            return await send_request(c, "http://x", "m", [1, 2, 3], 2)
    res = asyncio.run(run())
    assert res.success and res.error in ("", None) and res.output_tokens == 2
