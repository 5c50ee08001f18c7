"""The router's admin / registration API as a route table (see :mod:`dlmix.router.server` for the bodies).

Every call needs ``Authorization: Bearer ADMIN_KEY``; without ``admin_key`` only loopback peers may call it. JSON in
and out; errors are the router's OpenAI error object ``{"error": {"message", "type", "param", "code"}}``
(:func:`dlmix.router.proxy.error_body`; plus ``"reasons"`` in it for a refused registration). Instance ids may
contain ``/`` (the default id is the instance URL) and are percent-decoded.

With a shared store (router replicas, :mod:`dlmix.router.shared`) registration, drain, undrain and removal go through
etcd, so every replica sees them, and are refused with ``503`` while etcd is unavailable; heartbeats count at once on
the replica that received them and are shared in the background.
"""
from __future__ import annotations

import hmac
import inspect
from typing import Any, Optional

import msgspec

from dlmix.net import is_loopback
from dlmix.router.proxy import error_body, method_not_allowed, not_found
from dlmix.router.registry import RegistrationError, Registry
from dlmix.router.routes import Route, RouteTable

__all__ = ["AdminAPI", "LocalState"]

_json = msgspec.json.Encoder()

#: the 401 of the admin API and of the other instance-facing routes (``POST /dlmix/handoff``)
ADMIN_KEY_REQUIRED = error_body(401, "admin key required (Authorization: Bearer ADMIN_KEY)")
#: the same without an ``admin_key`` configured: only loopback peers are admitted
LOOPBACK_ONLY = error_body(401, "admin API open to loopback peers only (the router has no admin_key)")


class LocalState:
    """The admin API's writes on one router's own memory (the default). :class:`~dlmix.router.shared.SharedState`
    has the same methods and writes through etcd for router replicas. Each returns ``(status, JSON body)``, or a
    coroutine of it; ``heartbeat`` raises ValueError for a bad body."""

    def __init__(self, registry: Registry):
        self.registry = registry

    def register(self, body: dict):
        try:
            st = self.registry.register(body)
        except RegistrationError as ex:
            return ex.status, {"error": str(ex), "reasons": ex.reasons}
        return 201, {"id": st.id, "slot": st.slot}

    def heartbeat(self, backend, body) -> None:
        backend.heartbeat(body)

    def drain(self, backend, on: bool):
        backend.state.draining = on
        return 200, {"draining": on}

    def delete(self, backend):
        self.registry.remove(backend.state.id)
        return 200, {"removed": True}

    def describe(self) -> Optional[dict]:
        return None


def _lmdeploy_status(answer: tuple[int, Any]) -> tuple[int, Any]:
    """A registration's answer as LMDeploy's proxy gives it: 200 instead of 201 (LMDeploy's ``register_to_proxy``
    in ``serve/openai/api_server.py`` logs "Service registration failed" for any status but 200)."""
    status, body = answer
    return (200 if status == 201 else status), body


#: LMDeploy's ``EngineRole`` values (``pytorch/disagg/config.py``) -> dlmix roles
LMDEPLOY_ROLES = {1: "both", 2: "prefill", 3: "decode"}


def lmdeploy_registration(body: Any) -> dict | str:
    """A registration body from LMDeploy's ``/nodes/add`` body, or the reason it is malformed."""
    if not isinstance(body, dict) or not isinstance(body.get("url"), str):
        return "LMDeploy node body must be {\"url\": \"http://host:port\", \"status\": {...}}"
    status = body.get("status") or {}
    if not isinstance(status, dict):
        return "status must be an object"
    rv = status.get("role", 1)
    role = LMDEPLOY_ROLES.get(rv) if isinstance(rv, int) and not isinstance(rv, bool) else None
    if role is None:
        return f"unknown LMDeploy role {status.get('role')!r} (1 Hybrid, 2 Prefill, 3 Decode)"
    # LMDeploy sends no heartbeats: the router's health checks alone keep it in rotation
    reg: dict = {"url": body["url"], "engine": "lmdeploy", "role": role, "heartbeat_ttl_s": 0}
    models = status.get("models")
    if isinstance(models, list) and models and all(isinstance(x, str) for x in models):
        reg["model"] = models
    return reg


class AdminAPI:
    """Handlers of ``/admin/...`` over a :class:`~dlmix.router.registry.Registry`.

    Args:
        registry: the instances. admin_key: bearer token, or None (loopback peers only).
        shared: the replica's :class:`~dlmix.router.shared.SharedState`, or None (one router, memory only).
    """

    def __init__(self, registry: Registry, admin_key: Optional[str], shared=None):
        self.registry = registry
        #: where registration, heartbeats, drain and removal are written
        self.state = shared if shared is not None else LocalState(registry)
        self._auth = b"Bearer " + admin_key.encode() if admin_key else None
        self.table = RouteTable([
            Route("GET", "/admin/instances", self.list),
            Route("POST", "/admin/instances", self.register),
            Route("POST", "/admin/instances/{id:path}/heartbeat", self.heartbeat),
            Route("POST", "/admin/instances/{id:path}/drain", self.drain),
            Route("POST", "/admin/instances/{id:path}/undrain", self.undrain),
            Route("GET", "/admin/instances/{id:path}", self.get),
            Route("DELETE", "/admin/instances/{id:path}", self.delete),
            # LMDeploy's registration (``lmdeploy serve api_server --proxy-url ROUTER``), as its proxy serves it
            Route("POST", "/nodes/add", self.lmdeploy_add),
            Route("POST", "/nodes/remove", self.lmdeploy_remove),
        ])

    def key_ok(self, req) -> bool:
        """True if ``req`` carries the admin key (False when no admin key is configured)."""
        return self._auth is not None and self._key_matches(req)

    def _key_matches(self, req) -> bool:
        """The ``Authorization`` header equals ``Bearer ADMIN_KEY``, compared in constant time."""
        got = req.header(b"authorization")
        return got is not None and hmac.compare_digest(got, self._auth)

    def allowed(self, conn, req) -> bool:
        """True if the caller may use the admin API (right bearer token, or a loopback peer without a key)."""
        if self._auth is not None:
            return self._key_matches(req)
        peer = conn.peer[0] if conn.peer else ""
        return is_loopback(peer)

    def refusal(self) -> bytes:
        """The 401 body for a caller :meth:`allowed` refuses."""
        return ADMIN_KEY_REQUIRED if self._auth is not None else LOOPBACK_ONLY

    def handle(self, conn, req):
        """Answer one ``/admin/...`` request on ``conn``. Returns None when answered, or a coroutine to await (a
        handler that writes to the shared store)."""
        if not self.allowed(conn, req):
            return conn.send(401, self.refusal())
        route, params, status = self.table.match(req.method, req.path)
        if route is None:
            if status == 405:
                body, allow = method_not_allowed(req, params["allow"])
                return conn.send(405, body, extra=allow)
            return conn.send(404, not_found(req))
        try:
            body = msgspec.json.decode(req.body) if req.body else {}
        except msgspec.DecodeError as ex:
            return conn.send(400, error_body(400, f"request body is not valid JSON: {ex}"))
        except RecursionError:
            return conn.send(400, error_body(400, "request body is not valid JSON: nested too deeply"))
        if "id" in params:
            b = self.registry.backends.get(params["id"])
            if b is None:
                return conn.send(404, error_body(404, f"unknown instance {params['id']!r}"))
            params = {"backend": b}
        r = route.handler(body, **params)
        if inspect.iscoroutine(r):
            return self._answer_later(conn, r)
        self._answer(conn, *r)

    @staticmethod
    def _answer(conn, status: int, out) -> None:
        if status >= 400 and isinstance(out, dict) and isinstance(out.get("error"), str):
            # the handlers' (and SharedState's) {"error": msg, ...} -> the OpenAI error object, extras inside it
            out = error_body(status, out["error"], **{k: v for k, v in out.items() if k != "error"})
        conn.send(status, out if isinstance(out, bytes) else _json.encode(out))

    async def _answer_later(self, conn, coro) -> None:
        status, out = await coro
        if not conn.closed:
            self._answer(conn, status, out)

    # ------------------------------------------------------------------ handlers: (body, ...) -> (status, json)
    def list(self, body):
        out = {"instances": [self.registry.describe(i) for i in self.registry.instances]}
        shared = self.state.describe()
        if shared is not None:
            out["shared"] = shared
        return 200, out

    def register(self, body):
        if not isinstance(body, dict):
            return 400, {"error": "body must be a JSON object"}
        return self.state.register(body)

    def lmdeploy_add(self, body):
        """LMDeploy's ``/nodes/add`` (``serve/openai/api_server.py``: ``{"url", "status": {"models", "role"}}``, role
        = ``EngineRole`` value 1 Hybrid, 2 Prefill, 3 Decode) as a registration of an ``lmdeploy`` instance."""
        reg = lmdeploy_registration(body)
        if isinstance(reg, str):
            return 400, {"error": reg}
        out = self.state.register(reg)
        if inspect.isawaitable(out):
            async def done():
                return _lmdeploy_status(await out)
            return done()
        return _lmdeploy_status(out)

    def lmdeploy_remove(self, body):
        """LMDeploy's ``/nodes/remove`` (``{"url"}``): removes the instances registered with that URL."""
        url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str):
            return 400, {"error": "body must be {\"url\": \"http://host:port\"}"}
        b = next((b for b in self.registry.backends.values() if b.state.url.rstrip("/") == url.rstrip("/")), None)
        if b is None:
            return 404, {"error": f"no instance with url {url!r}"}
        return self.state.delete(b)

    def get(self, body, backend):
        return 200, self.registry.describe(backend.state)

    def delete(self, body, backend):
        return self.state.delete(backend)

    def heartbeat(self, body, backend):
        try:
            self.state.heartbeat(backend, body)
        except ValueError as ex:
            return 400, {"error": f"bad heartbeat: {ex}"}
        return 200, b'{"ok":true}'

    def drain(self, body, backend):
        return self.state.drain(backend, True)

    def undrain(self, body, backend):
        return self.state.drain(backend, False)
