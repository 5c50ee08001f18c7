"""The dlmix router: one OpenAI-compatible endpoint over heterogeneous engine instances.

Client API: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming SSE or not; bodies and SSE chunks are
passed through byte for byte), ``GET /v1/models`` (union of the instances' lists), ``GET /health``, ``GET /metrics``
(Prometheus); ``GET /dlmix/layout`` and ``POST /dlmix/handoff``, the bootstrap side of the rooms the router hands to
SGLang decodes fed by another engine's prefill (:mod:`dlmix.router.rooms`; the hand-off needs the admin key, as
registration).
Client keys (``api_keys``) are optional: ``Authorization: Bearer KEY``. Client-side limits and
timeouts (414/431/413/408, connection cap 503, backend 502/504) are config keys, enforced by
:class:`~dlmix.router.proxy.Limits` (table in ``dlmix/router/README.md``); malformed generation bodies get 400 naming
the problem (:mod:`~dlmix.router.bodies`), a model no instance serves 404.

Admin / registration API (``Authorization: Bearer ADMIN_KEY``; without ``admin_key`` only loopback peers may call it).
JSON in and out. Every error the router answers itself (client API, admin API, limits) is the OpenAI error object
``{"error": {"message": msg, "type": ..., "param": null, "code": status}}`` (:func:`dlmix.router.proxy.error_body`;
a refused registration adds ``"reasons": [...]`` to it):

``POST /admin/instances``
    Register or re-register (same ``id`` or ``url``) an instance. Body: ``url`` (required, ``http://host:port``),
    ``role`` (``prefill``/``decode``/``both``, default both), ``engine`` (``vllm``), ``model`` (str or list),
    ``cluster``, ``chip`` (catalog name), ``num_chips``, ``block_size``, ``kv_layout`` (``dlmix.kv.layout.KVLayout``
    dict), ``transport`` (e.g. ``{"link": "rdma-100g"}`` or ``{"bandwidth_gbps": 100, "setup_ms": 1}``),
    ``kv_events`` (``tcp://host:port`` of the engine's ZMQ KV-event publisher), ``api_key``, ``id``,
    ``heartbeat_ttl_s`` (default ``heartbeat_ttl_s`` of the router; 0 = no heartbeats expected), ``lora_adapters``.
    Schema: :class:`dlmix.pd.registration.Registration`. → ``201 {"id":.., "slot":..}``; ``400`` bad field (named),
    or the router's own address; ``409`` KV layout incompatible with a registered counterpart (prefill vs decode of
    the same model; ``reasons`` from :func:`dlmix.pd.pair.check_pair`). A refused body changes nothing.
``POST /admin/instances/{id}/heartbeat``
    Body ``{"waiting": int, "running": int, "kv_usage": float}`` (all optional; :class:`~dlmix.router.registry.
    Heartbeat`). Send every ``ttl/3`` s; an instance
    whose heartbeats stop for ``heartbeat_ttl_s`` leaves rotation and returns with the next heartbeat. ``404`` if the
    router does not know the id (re-register then).
``GET /admin/instances``
    List with health, load and calibration.
``POST /admin/instances/{id}/drain`` / ``.../undrain``
    Stop / resume sending new requests (running ones finish).
``DELETE /admin/instances/{id}``
    Remove.

Health: every ``health_interval_s`` the router GETs each instance's ``/health``; ``health_failures`` failures in a
row (or a refused connection) take it out, one success brings it back. Circuit breaker: ``breaker_failures``
consecutive request failures open it for ``breaker_cooldown_s``.

PD (vLLM): see :mod:`dlmix.router.engines.vllm`; a failed or timed-out prefill leg is placed again by the policy
(another prefill instance, or a full prefill on the decode instance; :mod:`dlmix.router.orchestrator`); a
decode/whole request that fails before any byte reached the client is retried on another instance (``retries``).

The parts: :mod:`~dlmix.router.registry` (instances, health, heartbeats, breakers), :mod:`~dlmix.router.admin`
(admin API as a route table, :mod:`~dlmix.router.routes`), :mod:`~dlmix.router.orchestrator` (PD prefill leg),
:mod:`~dlmix.router.kv_events` (engine KV events -> prefix index), :mod:`~dlmix.router.engines` (engine adapters),
:mod:`~dlmix.router.proxy` (HTTP/1.1 client and server); this module holds the client endpoints and the one
completion and retry path.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Dict, List, Optional

import msgspec

from dlmix.hw.cost import CostModel, ModelSpec, ewma_ratio
from dlmix.hw.profiles import load_catalog
from dlmix.router import proxy
from dlmix.router.admin import AdminAPI
from dlmix.router.bodies import EMPTY_BODY, BadRequest, check as check_body, decode as decode_body, n_choices
from dlmix.router.choices import MAX_FAN_OUT, run_choices, wants_fan_out
from dlmix.router.config import ConfigError, RouterConfig
from dlmix.router.engines import ROUTER_FIELDS
from dlmix.router.metrics import Metrics
from dlmix.router.orchestrator import SENT, PDOrchestrator
from dlmix.router.proxy import (BackendError, build_request, error_body, forward_headers, method_not_allowed,
                                not_found, request)
from dlmix.router.registry import Backend, RegistrationError, Registry, Runtime  # noqa: F401 - re-exported
from dlmix.router.rooms import RoomTable
from dlmix.router.routes import Route, RouteTable
from dlmix.router.tokenize import PromptExtractor, lora_of, prefix_keys
from dlmix.routing.hashing import BlockHasher
from dlmix.routing.policies import POLICIES, ClusterView, begin, end, make_policy, prefill_done
from dlmix.routing.prefix_index import ApproxIndex, PrefixIndex
from dlmix.routing.state import InstanceState, NoInstanceError, RouteRequest
from dlmix.net import is_loopback as _is_loopback

__all__ = ["Router", "RegistrationError", "run"]

_json = msgspec.json.Encoder()
_CHAT = b"/v1/chat/completions"
_COMPL = b"/v1/completions"


class Router:
    """The router application: client endpoints and the one completion path, over a
    :class:`~dlmix.router.registry.Registry`, a :class:`~dlmix.router.orchestrator.PDOrchestrator` and an
    :class:`~dlmix.router.admin.AdminAPI`. ``await start()`` to listen; ``await stop()`` to close.

    Args:
        cfg: :class:`~dlmix.router.config.RouterConfig`.
    Raises ConfigError/CatalogError/RegistrationError/ValueError for a bad configuration.
    """

    def __init__(self, cfg: RouterConfig):
        cfg.validate()
        self.cfg = cfg
        if not cfg.api_keys and not cfg.allow_open and not _is_loopback(cfg.host):
            raise ConfigError(f"refusing to serve {cfg.host} without client api_keys; set api_keys, bind a "
                              "loopback host, or set allow_open: true explicitly")
        try:  # the simulator-only oracle is registered once dlmix.sim is imported, as by the dlmix CLI
            POLICIES.serving_class(cfg.policy)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.policy = make_policy(cfg.policy, **(cfg.policy_params or {}))
        self.catalog = load_catalog(cfg.chips)
        ms = cfg.model_spec
        spec = ModelSpec(**ms) if isinstance(ms, dict) else (
            ModelSpec.from_hf_config(ms) if isinstance(ms, str) and ("/" in ms) else ms)
        self.cost = CostModel(spec, self.catalog) if spec else None
        self.index = PrefixIndex()
        self.approx = ApproxIndex(cfg.approx_index_capacity)
        self.extractor = PromptExtractor(cfg.tokenizer)
        self.hasher = BlockHasher(cfg.hash_algo, cfg.hash_seed)
        self.registry = Registry(cfg, self.catalog, self.index, self.approx, self.policy.on_remove,
                                 hasher=self.hasher)
        self.metrics = Metrics(self) if cfg.metrics else None
        self.registry.metrics = self.metrics
        self.registry.on_change = self._update_flags
        #: hand-offs of bootstrap rooms for SGLang decodes fed by another engine's prefill (dlmix.router.rooms)
        self.rooms = RoomTable(cfg, ttl_s=max(600.0, float(cfg.prefill_timeout_s)))
        self.pd = PDOrchestrator(self.registry, self.policy, cfg, self.metrics, self._view, self.rooms)
        #: router replicas: the fleet's shared state in etcd (None: this router's memory only)
        self.shared = None
        if cfg.etcd_endpoints:
            from dlmix.router.shared import EtcdClient, SharedState

            self.shared = SharedState(self.registry, EtcdClient(
                cfg.etcd_endpoints, cfg.etcd_timeout_s, cfg.etcd_user, cfg.etcd_password, cfg.etcd_ca,
                cfg.etcd_allow_open),
                cfg.etcd_prefix)
        self.admin = AdminAPI(self.registry, cfg.admin_key, self.shared)
        #: this router's id: in its /health answer and in the x-dlmix-via header of every request it forwards, so a
        #: router registered as an instance (of itself or of a router that leads back here) is detected
        self.router_id = uuid.uuid4().hex[:16]
        self._via = self.router_id.encode()
        self.registry.own_id = self.router_id
        self.registry.via = b"x-dlmix-via: %s\r\n" % self._via
        self.routes = RouteTable([
            Route("POST", "/v1/chat/completions", self._chat),
            Route("POST", "/v1/completions", self._completions),
            Route("GET", "/v1/models", self._models),
            Route("GET", "/health", self._health),
            Route("GET", "/metrics", self._metrics),
            Route("GET", "/dlmix/layout", self._dlmix_layout),
            Route("POST", "/dlmix/handoff", self._dlmix_handoff),
        ])
        self._client_auth = {b"Bearer " + k.encode() for k in cfg.api_keys}
        self._server = None
        self.hub: Optional[proxy.Hub] = None
        self.limits = self.http_limits()
        self._plain = RouteRequest()
        self._needs_parse = True
        self._pd = False
        for d in cfg.instances:
            self.register(dict(d), ttl_default=0.0)

    # ------------------------------------------------------------------ registry (delegated)
    @property
    def instances(self) -> List[InstanceState]:
        """Registered instances (what the policies see)."""
        return self.registry.instances

    @property
    def rt(self) -> Dict[str, Backend]:
        """Backends by instance id."""
        return self.registry.backends

    def register(self, d: dict, ttl_default: Optional[float] = None) -> InstanceState:
        """Add or replace an instance (see :meth:`Registry.register`). Raises RegistrationError."""
        return self.registry.register(d, ttl_default)

    def remove(self, iid: str) -> bool:
        """Remove instance ``iid``; False if unknown."""
        return self.registry.remove(iid)

    def describe(self, i: InstanceState) -> dict:
        """JSON-able view of an instance (admin list)."""
        return self.registry.describe(i)

    def _update_flags(self) -> None:
        """Recompute the fast-path flags from the registry's tallies (O(1): no scan of the fleet)."""
        pd = self.registry.has_prefill
        self._needs_parse = self.policy.needs_prompt or self.registry.distinct_models > 1 or pd
        self._pd = pd or self.registry.decode_needs_prefill > 0

    def _view(self, instances) -> ClusterView:
        return ClusterView(instances, self.index, self.cost, self.approx, self.registry.has_prefill)

    # ------------------------------------------------------------------ lifecycle
    def http_limits(self) -> proxy.Limits:
        """The client-side HTTP limits and timeouts from the config (``max_url_bytes`` ... ``backend_read_timeout_s``;
        see :class:`~dlmix.router.proxy.Limits`). ``max_connections`` is lowered to what the process's open-file
        limit allows (each running request also holds a backend connection), after raising the soft limit towards
        the hard one. Raises ConfigError for a non-positive value."""
        c = self.cfg
        for k in ("max_url_bytes", "max_header_bytes", "max_headers", "max_body_mb", "header_timeout_s",
                  "body_timeout_s", "keepalive_timeout_s", "linger_timeout_s", "max_connections",
                  "backend_read_timeout_s"):
            v = getattr(c, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"router config key {k} must be a positive number, got {v!r}")
        conns = int(c.max_connections)
        try:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            need = 2 * conns + 256
            if soft != resource.RLIM_INFINITY and soft < need:
                new = need if hard == resource.RLIM_INFINITY else min(need, hard)
                if new > soft:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                    soft = new
                conns = max(min(conns, (soft - 256) // 2), 1)
        except (ImportError, ValueError, OSError):  # pragma: no cover - not POSIX, or not allowed
            pass
        try:
            return proxy.Limits(max_url=c.max_url_bytes, max_header_bytes=c.max_header_bytes,
                                max_headers=c.max_headers, max_body=int(c.max_body_mb * (1 << 20)),
                                header_timeout=c.header_timeout_s, body_timeout=c.body_timeout_s,
                                keepalive_timeout=c.keepalive_timeout_s, linger_timeout=c.linger_timeout_s,
                                max_connections=conns, backend_read_timeout=c.backend_read_timeout_s)
        except ValueError as ex:
            raise ConfigError(f"router config: {ex}") from None

    async def start(self) -> None:
        """Listen on ``cfg.host:cfg.port`` and start health checks and KV-event subscribers."""
        # the HTTP layer's own answers (408, 413, 414, 431, 503 over max_connections...) count as answers too
        self.hub = proxy.Hub(self.limits, on_answer=self.metrics.answer if self.metrics is not None else None)
        self._server = await proxy.serve(self.handle, self.cfg.host, self.cfg.port,
                                         fast=self.fast if self.cfg.fast_path else None, hub=self.hub)
        if self.cfg.port == 0:
            self.cfg.port = self._server.sockets[0].getsockname()[1]
        self.registry.start()
        if self.shared is not None:
            await self.shared.start()

    async def stop(self) -> None:
        """Stop listening and cancel background tasks."""
        if self.shared is not None:
            await self.shared.stop()
        self.registry.stop()
        if self.hub is not None:
            self.hub.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # ------------------------------------------------------------------ HTTP entry
    async def handle(self, conn: proxy.ServerProtocol, req: proxy.Request) -> None:
        """Dispatch one client request through the route tables (``/admin/...`` to the admin API)."""
        if req.path.startswith(b"/admin/") or req.path.startswith(b"/nodes/"):
            r = self.admin.handle(conn, req)
            if r is not None:
                await r
            return
        route, params, status = self.routes.match(req.method, req.path)
        if route is None:
            if status == 405:
                body, allow = method_not_allowed(req, params["allow"])
                return self._send(conn, 405, body, extra=allow)
            return self._send(conn, 404, not_found(req))
        r = route.handler(conn, req)
        if r is not None:
            await r

    def _send(self, conn, status: int, body: bytes, content_type: bytes = b"application/json",
              extra: bytes = b"") -> None:
        """Answer the client from the router itself (counted in ``dlmix_router_client_responses_total``)."""
        if self.metrics is not None:
            self.metrics.answer(status)
        conn.send(status, body, content_type, extra=extra)

    def _client_ok(self, req) -> bool:
        return not self._client_auth or req.header(b"authorization") in self._client_auth

    def _dlmix_layout(self, conn, req) -> None:
        """``GET /dlmix/layout``: tells an SGLang decode's dlmix backend that this bootstrap address is a dlmix router
        (its rooms are answered by ``POST /dlmix/handoff``), not an SGLang prefill's bootstrap server."""
        self._send(conn, 200, b'{"dlmix_router":true,"layouts":[]}')

    def _dlmix_handoff(self, conn, req) -> None:
        """``POST /dlmix/handoff`` ``{"room": R}`` (:class:`dlmix.pd.contract.RoomHandoffRequest`): the
        :class:`dlmix.pd.contract.RoomHandoff` a bridge filed under room R (:mod:`dlmix.router.rooms`); 401 without
        the admin key (an instance-facing route, as registration: loopback peers need none while no ``admin_key`` is
        set), 400 for a malformed body, 404 for a room unknown or expired."""
        from dlmix.pd.contract import RoomHandoffRequest

        if not self.admin.allowed(conn, req):
            return self._send(conn, 401, self.admin.refusal())
        try:
            ask = msgspec.json.decode(req.body, type=RoomHandoffRequest)
        except (msgspec.ValidationError, msgspec.DecodeError) as ex:
            return self._send(conn, 400, error_body(400, f"invalid hand-off request: {ex}"))
        h = self.rooms.get(ask.room)
        if h is None:
            return self._send(conn, 404, error_body(404, f"room {ask.room} is unknown here or expired"))
        self._send(conn, 200, _json.encode(h))

    def _health(self, conn, req) -> None:
        """200 when an instance is available (healthy, not draining), else 503 saying why (no instance registered,
        every healthy one draining, none healthy); the body names this router (loop detection)."""
        insts = self.instances
        if any(i.available() for i in insts):
            status = b"ok"
        elif not insts:
            status = b"no instance registered"
        elif any(i.healthy for i in insts):
            status = b"every healthy instance is draining"
        else:
            status = b"no healthy instance"
        self._send(conn, 200 if status == b"ok" else 503, b'{"status":"%s","dlmix_router":"%s"}' % (status, self._via))

    def _looped(self, req) -> bool:
        """True when ``req`` already passed through this router (its id in an ``x-dlmix-via`` header)."""
        own = self._via
        for k, v in req.headers:
            if k == b"x-dlmix-via" and own in v:
                return True
        return False

    def _metrics(self, conn, req) -> None:
        """Prometheus text. With client keys configured it needs one of them (or the admin key)."""
        if self._client_auth and not (self._client_ok(req) or self.admin.key_ok(req)):
            return self._send(conn, 401, _BAD_KEY)
        if self.metrics is None:
            return self._send(conn, 404, error_body(404, "metrics disabled (router option metrics: false)"))
        body, ctype = self.metrics.render()
        self._send(conn, 200, body, ctype)

    async def _models(self, conn, req) -> None:
        """Union of the available instances' model lists (an instance that does not answer contributes its
        registered names)."""
        if not self._client_ok(req):
            return self._send(conn, 401, _BAD_KEY)
        seen: Dict[str, dict] = {}

        async def one(b: Backend):
            raw = build_request(b"GET", b.engine.MODELS_PATH, b.hostport, b.auth, b"")
            try:
                c = await request(b.pool, raw, None, None, 5.0)
                st, _, body = c.collected()
                if st == 200:
                    return msgspec.json.decode(body).get("data") or []
            except (BackendError, msgspec.DecodeError, AttributeError):
                pass
            return [{"id": m, "object": "model", "owned_by": "dlmix"} for m in b.state.model]

        bs = [b for b in self.rt.values() if b.state.available()]
        for lst in await asyncio.gather(*(one(b) for b in bs)):
            for e in lst:
                if isinstance(e, dict) and e.get("id") not in seen:
                    seen[e["id"]] = e
        self._send(conn, 200, _json.encode({"object": "list", "data": list(seen.values())}))

    def _chat(self, conn, req):
        return self._completion(conn, req, True)

    def _completions(self, conn, req):
        return self._completion(conn, req, False)

    async def _completion(self, conn, req, chat: bool) -> None:
        if not self._client_ok(req):
            return self._send(conn, 401, _BAD_KEY)
        if self._looped(req):
            return self._send(conn, 508, error_body(508, "routing loop: this request already passed through this "
                                                         "router (an instance URL leads back to it); remove that "
                                                         "instance"))
        d, rr = None, self._plain
        try:
            pins = self._pins(req)
            if not req.body or req.body.isspace():
                raise BadRequest(EMPTY_BODY)
            if self._needs_parse:
                d = decode_body(req.body)
                check_body(d, chat)
                ROUTER_FIELDS.check(d)
                rr = self._request_from(d, chat)
            else:
                ROUTER_FIELDS.check_raw(req.body)
        except BadRequest as ex:
            return self._send(conn, 400, _bad_request(str(ex)))
        if pins is not None:
            if rr is self._plain:
                rr = RouteRequest()
            rr.prefill_id, rr.decode_id = pins
        await self._run(conn, req, chat, d, rr)

    def _pins(self, req) -> Optional[tuple]:
        """The instances a request pins itself to: ``(prefill id or None, decode id or None)`` from the
        ``x-dlmix-prefill-instance`` / ``x-dlmix-decode-instance`` headers (instance ids as registered; the URL when
        none was given), or None without either header. Pinning is for operators and tests (a canary on one
        instance, one PD pair of a mixed fleet): with ``allow_pinning`` off (the default) a pinned request is
        refused. The policy then chooses among the pinned instances only; a failed pinned prefill leg is
        recomputed on the decode instance, never moved to another prefill instance. Raises BadRequest (400) when
        pinning is off, for an id no instance has, or for an instance whose role cannot take that leg (a
        ``prefill``-role instance as the decode, a non-``prefill`` one as the prefill)."""
        p = dec = None
        for k, v in req.headers:
            if k == proxy.PIN_PREFILL:
                p = v
            elif k == proxy.PIN_DECODE:
                dec = v
        if p is None and dec is None:
            return None
        if not self.cfg.allow_pinning:
            raise BadRequest("instance pinning is off on this router: x-dlmix-prefill-instance and "
                             "x-dlmix-decode-instance need the router option allow_pinning")
        out = []
        for v, leg in ((p, "prefill"), (dec, "decode")):
            if v is None:
                out.append(None)
                continue
            name = v.decode("utf-8", "replace")
            b = self.registry.backends.get(name)
            if b is None:
                raise BadRequest(f"x-dlmix-{leg}-instance: no instance {name!r} is registered")
            if (b.state.role == "prefill") != (leg == "prefill"):
                raise BadRequest(f"x-dlmix-{leg}-instance: instance {name!r} has role {b.state.role} and cannot "
                                 f"take the {leg} leg")
            out.append(name)
        return out[0], out[1]

    def _no_instance(self, conn, rr: RouteRequest, ex: NoInstanceError, err: Optional[BackendError]) -> None:
        """Answer a request no instance can take: 404 (OpenAI style) for a model no registered instance serves,
        the last attempt's 502/504 when earlier attempts failed, else 503 (also while no instance is registered)."""
        insts = self.instances
        if rr.model and insts and not any(i.serves(rr.model) for i in insts):
            return self._send(conn, 404, _json.encode({"error": {
                "message": f"The model `{rr.model}` does not exist.", "type": "invalid_request_error",
                "param": "model", "code": "model_not_found"}}))
        if err is not None:
            return self._send(conn, err.status, error_body(err.status, f"backend failed: {err}"))
        self._send(conn, 503, error_body(503, str(ex)))

    def _request_from(self, d: dict, chat: bool) -> RouteRequest:
        """The routing view of a parsed client body: model, max tokens, stream, and (when the policy uses prefixes)
        prompt length in tokens and a block-hash function ``block_size -> keys`` (cached per block size)."""
        model = d.get("model")
        mt = d.get("max_completion_tokens") if chat else None
        mt = mt or d.get("max_tokens")
        rr = RouteRequest(model=model if isinstance(model, str) else None,
                          max_tokens=mt if isinstance(mt, int) else None, stream=bool(d.get("stream")))
        if self.policy.needs_prompt:
            reg = self.registry
            lora = lora_of(model, reg.loras, reg.model_names) if reg.model_names else None
            rr.prompt_len, bh = prefix_keys(self.extractor, self.hasher, chat, d, lora)
            rr.block_hashes = bh
        return rr

    # ------------------------------------------------------------------ the completion path
    # One path: choose (policy) -> _dispatch (load bookkeeping) -> forward -> _settle (metrics, calibration,
    # breaker, retry decision). Forwarding has two drivers over the same steps: callbacks on an idle pooled
    # connection (fast: no task, no future; only without PD) and a coroutine (_run: PD legs, new connections,
    # retries).

    def fast(self, conn: proxy.ServerProtocol, req: proxy.Request) -> bool:
        """Callback driver for generation requests without PD. Returns False to let the coroutine path handle the
        request (other endpoints, PD, bad input, no instance)."""
        path = req.path
        if (path != _CHAT and path != _COMPL) or req.method != b"POST" or self._pd:
            return False
        if self._client_auth and req.header(b"authorization") not in self._client_auth:
            return False
        if self._looped(req):
            return False
        body = req.body
        if not body or body.isspace():
            return False  # the coroutine path answers 400
        for k, _ in req.headers:
            if k in proxy.ROUTER_ONLY:
                return False  # the coroutine path checks the pins
        chat = path == _CHAT
        d = None
        if self._needs_parse:
            try:
                d = decode_body(req.body)
                check_body(d, chat)
                ROUTER_FIELDS.check(d)
            except BadRequest:
                return False  # the coroutine path answers 400
            rr = self._request_from(d, chat)
        else:
            try:
                ROUTER_FIELDS.check_raw(body)
            except BadRequest:
                return False  # the coroutine path answers 400
            rr = self._plain
        reg = self.registry
        view = ClusterView(reg.instances, self.index, self.cost, self.approx, False)
        try:
            dec = self.policy.choose(rr, view)
        except NoInstanceError:
            return False
        b = reg.backends.get(dec.decode.id)
        if b is None:
            return False
        bc = b.pool.idle_conn()
        if bc is None:  # first use of this backend: connect on the coroutine path with this decision
            conn.run_async(req, self._run(conn, req, chat, d, rr, dec, view))
            return True
        self._dispatch(rr, dec, view)
        state = [False]

        def first(_s=state, _dec=dec, _rr=rr):
            _s[0] = True
            prefill_done(_dec, _rr)

        def finished(c, err, _s=state):
            try:
                conn.backends.remove(c)
            except ValueError:
                pass
            end(dec, rr, _s[0])
            if self._settle(conn, req, b, dec, rr, c, err, 0):
                conn.run_async(req, self._run(conn, req, chat, d, rr, None, None, {dec.decode.id}, 1))
                return
            if err is None and c.usable:
                b.pool.release(c)
            conn.done(req)

        raw = build_request(req.method, req.url, b.hostport, b.auth + forward_headers(req.headers), req.body)
        conn.backends.append(bc)
        try:
            bc.start(raw, conn.transport, first, finished)
        except RuntimeError:  # transport closed under us: let the connection_lost callback retry
            bc.abort()
        return True

    async def _run(self, conn: proxy.ServerProtocol, req: proxy.Request, chat: bool, d, rr: RouteRequest,
                   dec=None, view=None, excluded: Optional[set] = None, attempts: int = 0) -> None:
        """Coroutine driver: place (unless ``dec`` is given), run the PD prefill leg if any, forward, settle; retry
        on another instance while :meth:`_settle` says so."""
        fwd = forward_headers(req.headers)
        last: Optional[BackendError] = None
        while True:
            if dec is None:
                insts = self.instances if not excluded else [i for i in self.instances if i.id not in excluded]
                view = self._view(insts)
                try:
                    dec = self.policy.choose(rr, view)
                except NoInstanceError as ex:
                    return self._no_instance(conn, rr, ex, last)
            if dec.prefill is not None and dec.decode.role == "decode" and d is not None:
                db = self.rt.get(dec.decode.id)
                if db is not None and wants_fan_out(db.engine, d):  # n > 1 on a decode that takes one choice
                    if n_choices(d) > MAX_FAN_OUT:
                        return self._send(conn, 400, _bad_request(
                            f"invalid request body: n must be at most {MAX_FAN_OUT} on this router's "
                            f"{dec.decode.engine} decode instances, got {n_choices(d)}"))
                    return await run_choices(conn, req, d, chat, self._one_choice(rr, chat))
            self._dispatch(rr, dec, view)
            state = [False]  # prefilled

            def first(_s=state, _dec=dec, _rr=rr):
                if not _s[0]:
                    _s[0] = True
                    prefill_done(_dec, _rr)
            b = c = err = None
            try:
                r = await self._legs(conn, req, chat, d, rr, dec, view, fwd, first)
                if r is SENT:
                    return
                b, c = r
            except BackendError as ex:
                err = ex
                b = None if ex.prefill_failed else self.rt.get(dec.decode.id)
            finally:
                end(dec, rr, state[0])
            if not self._settle(conn, req, b, dec, rr, c, err, attempts):
                return
            last = err
            attempts += 1
            excluded = (excluded or set()) | {dec.decode.id}
            dec = None

    def _one_choice(self, rr: RouteRequest, chat: bool):
        """The router's whole path for one choice of a fanned-out request (:mod:`dlmix.router.choices`): placed on
        its own, with the client's pins."""
        async def run_one(conn, sub, body: dict) -> None:
            rr_i = self._request_from(body, chat)
            rr_i.prefill_id, rr_i.decode_id = rr.prefill_id, rr.decode_id
            await self._run(conn, sub, chat, body, rr_i)
        return run_one

    async def _legs(self, conn, req, chat: bool, d, rr: RouteRequest, dec, view, fwd: bytes, first):
        """The backend legs of one placement: the PD prefill leg (sequential or concurrent, by the prefill instance's
        engine adapter) if any, and the decode (or whole-request) leg streaming to the client. Returns
        ``(decode backend, proxy.Answer)``, or :data:`SENT` when the answer was already sent (a prefill instance's
        4xx; 503 when a decode-only instance has no prefill instance). Raises BackendError."""
        m = self.metrics
        db = self.rt.get(dec.decode.id)
        if dec.prefill is not None and dec.decode.role == "both":
            if db is not None and not db.engine.BOTH_TAKES_PD:
                self.pd.move(dec, rr, None)  # serves whole requests only: it prefills this one itself
        pb = self.rt.get(dec.prefill.id) if dec.prefill is not None else None
        bridged = False
        if pb is not None and pb.engine.PD_FLOW == "concurrent":
            if db is None or db.engine.PD_FLOW == "concurrent":
                if m:
                    self._pd_metrics(view, rr, dec)
                return await self.pd.concurrent(conn, req, d, rr, dec, chat, fwd, first)
            bridged = True  # a concurrent-flow prefill feeding a decode of another engine, through a bridge
        data = req.body
        abort = None
        if dec.prefill is not None:
            if bridged:
                handoff = await self.pd.bridged(conn, req, d, rr, dec, chat, fwd)
            else:
                handoff = await self.pd.prefill(conn, req, d, rr, dec, chat, fwd)
            if handoff is SENT:
                return SENT
            if handoff is not None:  # else: fell back to prefill on D (dec.prefill is None now)
                abort = handoff.abort
                try:
                    data = self.rt[dec.decode.id].engine.decode_body(req.body, handoff.kvp, d)
                except BaseException:
                    if abort is not None:
                        abort()
                    raise
                if m:
                    self._pd_metrics(view, rr, dec)
                first()
        b = self.rt.get(dec.decode.id)
        if b is None:
            if abort is not None:
                abort()
            raise BackendError(f"instance {dec.decode.id} was removed")
        if dec.prefill is None and dec.decode.role == "decode" and b.engine.DECODE_NEEDS_PREFILL:
            why = f" (last: {dec.prefill_failure})" if dec.prefill_failure else ""
            self._send(conn, 503, error_body(503, f"no prefill instance available for decode-only "
                                                  f"instance {dec.decode.id} ({dec.decode.engine}){why}"))
            return SENT
        raw = build_request(req.method, req.url, b.hostport, b.auth + fwd, data)
        if abort is None:
            return b, await request(b.pool, raw, conn.transport, conn, None, first)
        # the prefill holds this request's KV: free it now when the decode leg did not take it (client gone, decode
        # failed), not at the prefill's hold timeout; freeing a hold already consumed is a no-op
        try:
            c = await request(b.pool, raw, conn.transport, conn, None, first)
        except BaseException:
            abort()
            raise
        if c.status != 200:
            abort()
        return b, c

    def _pd_metrics(self, view: ClusterView, rr: RouteRequest, dec) -> None:
        """A PD hand-off (either flow): the prompt tokens the decode instance already holds, and the cost model's
        estimate of the KV bytes the rest needs, ``(N - h_D) * kv_bytes_per_token``."""
        m = self.metrics
        hd = min(view.hit_tokens(rr, dec.decode), rr.prompt_len)
        m.decode_hit(self.rt.get(dec.decode.id), hd)
        if self.cost is not None:
            m.kv_estimate(self.cost.kv_bytes(rr.prompt_len - hd))

    def _dispatch(self, rr: RouteRequest, dec, view: ClusterView) -> None:
        """A placement goes out: count it in the load, tell the policy, remember the prefix (approximate index)."""
        begin(dec, rr)
        self.policy.on_dispatch(rr, dec, view)
        if rr.prompt_len and self._needs_parse:
            self.approx.record_decision(rr, dec)
            if self.metrics and dec.hit_tokens:
                self.metrics.hit(self.rt.get((dec.prefill or dec.decode).id), dec.hit_tokens)

    def _settle(self, conn, req, b: Optional[Backend], dec, rr: RouteRequest, c, err: Optional[BackendError],
                attempts: int) -> bool:
        """Outcome of one forwarded attempt (``c``: the backend connection, ``err``: its failure). Records
        metrics, calibration and breaker state; returns True when the request should be retried on another
        instance (nothing reached the client, the client is still there, ``attempts`` < ``retries``). Otherwise
        the request is finished: answered, cut off (bytes already sent / client gone), or answered 502."""
        m = self.metrics
        if err is None:
            b.fails = 0
            status = c.status
            if m:
                m.done(b, dec, rr, req.t0, status, c.nchunks, c.t_first, c.gap_sum)
            if status >= 500:
                b.fails += 1
            if dec.predicted_ttft and c.nchunks > 1 and status == 200:
                self._calibrate(dec, rr, c.t_first - req.t0, c.gap_sum / (c.nchunks - 1))
            return False
        gone = conn.closed or conn.transport.is_closing()
        if b is not None and not gone:  # a client that went away is not the backend's fault
            self.registry.fail(b, err)
        if err.sent_to_client or gone:
            if not conn.closed:
                conn.transport.abort()
                conn.closed = True
            return False
        if attempts + 1 > self.cfg.retries:
            self._send(conn, err.status, error_body(err.status, f"backend failed: {err}"))
            return False
        if m:
            m.retry("decode")
        return True

    def _calibrate(self, dec, rr: RouteRequest, ttft: float, itl: float) -> None:
        """Online refinement: EWMA of measured/predicted TTFT (prefilling instance) and ITL (decode instance)."""
        cost = self.cost
        if cost is None:
            return
        p = dec.prefill or dec.decode
        pred = dec.predicted_ttft / max(p.ttft_ratio, 1e-6)
        p.ttft_ratio = ewma_ratio(p.ttft_ratio, ttft, pred)
        dd = dec.decode
        step = cost.decode_step_time(dd.chip, max(dd.load.inflight_decode, 1), dd.load.decode_ctx_tokens + rr.prompt_len,
                                     dd.num_chips)
        dd.itl_ratio = ewma_ratio(dd.itl_ratio, itl, step)


def _bad_request(msg: str) -> bytes:
    """A 400 body naming the problem (OpenAI style)."""
    return error_body(400, msg)


_BAD_KEY = error_body(401, "invalid or missing API key (Authorization: Bearer KEY)")


def run(cfg: RouterConfig) -> None:
    """Run the router until interrupted (uvloop when installed)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass

    async def main():
        r = Router(cfg)
        await r.start()
        import gc

        gc.collect()
        gc.freeze()  # start-up objects (modules, catalogs, tokenizer) leave the collector's working set: shorter pauses
        print(f"dlmix router on http://{cfg.host}:{cfg.port} policy={cfg.policy} instances={len(r.instances)}",
              flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await r.stop()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
