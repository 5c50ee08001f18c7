"""The reference producer's HTTP front: just enough of the OpenAI API for a router's PD prefill leg.

Endpoints: ``GET /health``, ``GET /v1/models``, ``GET /stats`` (hold accounting, JSON), ``POST /v1/completions``
and ``POST /v1/chat/completions``. A completion/chat request must carry ``kv_transfer_params`` with
``do_remote_decode: true`` (vLLM's disaggregated-serving convention, which the dlmix router's vLLM protocol
adapter sends on the prefill leg): the producer tokenizes the prompt, runs the forward pass, stores the KV in its
paged cache, holds the blocks and answers an OpenAI response (one greedy token) whose top-level
``kv_transfer_params`` are the contract's :class:`~dlmix.pd.contract.TransferParams`. Anything else is answered
with an OpenAI-style error body and a 4xx/5xx status, never a traceback.

Built on :class:`http.server.ThreadingHTTPServer` (standard library): one thread per connection, HTTP/1.1
keep-alive; the forward pass itself is serialized by the model.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .cache import CacheFullError
from .model import PromptError

log = logging.getLogger("dlmix.pd.reference")

__all__ = ["ReferenceHTTPServer"]

MAX_BODY_BYTES = 16 << 20


class HTTPError(Exception):
    """An error answered to the client: ``status`` and an OpenAI-style ``{"error": {"message", "type"}}`` body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "ReferenceHTTPServer"

    def log_message(self, fmt: str, *args: Any) -> None:  # route access logs to logging, not stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: HTTPError) -> None:
        self._send(e.status, {"error": {"message": e.message, "type": e.kind, "code": e.status}})

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        app = self.server.app
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send(200, {"status": "ok"})
        elif path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": app.served_model_name, "object": "model",
                                                         "owned_by": "dlmix-reference"}]})
        elif path == "/stats":
            self._send(200, app.stats())
        else:
            self._error(HTTPError(404, f"no route GET {path}"))

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        try:
            if path not in ("/v1/completions", "/v1/chat/completions"):
                # drain the body so the connection stays usable
                self._body()
                raise HTTPError(404, f"no route POST {path}")
            body = self._body()
            self._send(200, self.server.app.prefill(body, chat=path.endswith("chat/completions")))
        except HTTPError as e:
            self._error(e)
        except Exception as e:  # never a traceback to the client, never a dead server
            log.exception("reference producer: request failed")
            self._error(HTTPError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    def _body(self) -> dict[str, Any]:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise HTTPError(400, "bad Content-Length") from None
        if n < 0 or n > MAX_BODY_BYTES:
            raise HTTPError(413, f"request body of {n} bytes exceeds {MAX_BODY_BYTES}")
        raw = self.rfile.read(n) if n else b""
        try:
            body = json.loads(raw or b"null")
        except ValueError as e:
            raise HTTPError(400, f"request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object")
        return body


class ReferenceHTTPServer(ThreadingHTTPServer):
    """HTTP server bound to ``(host, port)`` (port 0 = any free port) serving ``app`` (a
    :class:`dlmix.pd.reference.producer.ReferenceProducer`). ``serve_in_thread()`` starts it in a daemon thread."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        super().__init__((host, port), _Handler)
        self.app = app
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def serve_in_thread(self) -> "ReferenceHTTPServer":
        self._thread = threading.Thread(target=self.serve_forever, name="dlmix-ref-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def openai_response(*, rid: str, model: str, chat: bool, text: str, token_id: int, prompt_tokens: int,
                    kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI completion (``chat=False``) or chat completion response of one generated token, with vLLM's
    top-level ``kv_transfer_params`` and ``token_ids`` extensions."""
    created = int(time.time())
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": "length", "token_ids": [token_id]}
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": usage, "kv_transfer_params": kv_transfer_params}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "token_ids": [token_id]}
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage, "kv_transfer_params": kv_transfer_params}


def request_error(e: Exception) -> HTTPError:
    """Map the producer's exceptions to HTTP errors (prompt problems 400, cache full 503)."""
    if isinstance(e, PromptError):
        return HTTPError(400, str(e))
    if isinstance(e, CacheFullError):
        return HTTPError(503, str(e), "server_busy")
    return HTTPError(500, f"{type(e).__name__}: {e}", "server_error")
