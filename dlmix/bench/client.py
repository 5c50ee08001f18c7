"""Async streaming OpenAI client (httpx) that times every SSE chunk of a completion.

One request = ``POST {base_url}/v1/completions`` with ``prompt: [token ids]``, ``max_tokens``, ``stream: true``,
``stream_options: {"include_usage": true}`` (the final chunk carries ``usage.prompt_tokens`` /
``usage.completion_tokens``), ``temperature: 0`` and ``ignore_eos: true`` (a vLLM extension, so the output length is
exactly ``max_tokens``; servers that reject unknown fields can turn it off with ``ignore_eos=False``).

With ``endpoint="/v1/chat/completions"`` the prompt must be text and is sent as one user message.

Timing: ``clock`` (default :func:`time.perf_counter`) is read once before sending and once per SSE chunk that
carries output text/tokens; the last read happens at end of stream. Tests inject a fake clock.
"""
from __future__ import annotations

import json
import time
from typing import Callable, Optional, Union

import httpx

from dlmix.bench.stats import RequestResult
from dlmix.net import aiter_sse_lines

__all__ = ["send_request", "Clock"]

Clock = Callable[[], float]


def _chunk_has_output(obj: dict) -> bool:
    for ch in obj.get("choices") or ():
        if ch.get("text") or (ch.get("delta") or {}).get("content") or ch.get("token_ids"):
            return True
    return False


async def send_request(client: httpx.AsyncClient, base_url: str, model: Optional[str],
                       prompt: Union[list[int], str], max_tokens: int, *, endpoint: str = "/v1/completions",
                       ignore_eos: bool = True, extra_body: Optional[dict] = None, headers: Optional[dict] = None,
                       clock: Clock = time.perf_counter, group: int = -1) -> RequestResult:
    """Send one streaming request and time it; never raises for HTTP or stream errors (they become
    ``RequestResult(success=False, error=...)``).

    Args:
        client: shared ``httpx.AsyncClient``.
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (no ``/v1``).
        model: model name for the body (None omits the field).
        prompt: token ids (completions) or text.
        max_tokens: tokens to generate.
        clock: monotonic clock in seconds.

    Returns:
        :class:`RequestResult` with send time, TTFT, ITL gaps, E2E latency (seconds) and token counts.
    """
    chat = endpoint.rstrip("/").endswith("chat/completions")
    body: dict = {"max_tokens": max_tokens, "stream": True, "temperature": 0.0,
                  "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if chat:
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    if extra_body:
        body.update(extra_body)
    n_in = len(prompt) if isinstance(prompt, list) else 0
    res = RequestResult(success=False, input_tokens=n_in, group=group)
    start = clock()
    res.send_time = start
    last = start
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", base_url.rstrip("/") + endpoint, json=body, headers=headers) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                res.error = f"HTTP {r.status_code}: {detail}"
                res.latency = clock() - start
                return res
            async for line in aiter_sse_lines(r):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    res.error = f"bad SSE data: {data[:120]}"
                    res.latency = clock() - start
                    return res
                if obj.get("error"):
                    res.error = f"stream error: {json.dumps(obj['error'])[:200]}"
                    res.latency = clock() - start
                    return res
                if _chunk_has_output(obj):
                    now = clock()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                if obj.get("usage"):
                    usage = obj["usage"]
        res.latency = clock() - start
    except (httpx.HTTPError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        res.latency = clock() - start
        return res
    if usage:
        res.input_tokens = int(usage.get("prompt_tokens") or n_in)
        res.output_tokens = int(usage.get("completion_tokens") or chunks)
    else:
        res.output_tokens = chunks
    if chunks == 0:
        res.error = "no output tokens in stream"
        return res
    res.success = True
    return res
