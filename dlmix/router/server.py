"""The dlmix router: one OpenAI-compatible endpoint over heterogeneous engine instances.

Client API: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming SSE or not; bodies and SSE chunks are
passed through byte for byte), ``GET /v1/models`` (union of the instances' lists), ``GET /health``, ``GET /metrics``
(Prometheus). Client keys (``api_keys``) are optional: ``Authorization: Bearer KEY``.

Admin / registration API (``Authorization: Bearer ADMIN_KEY``; without ``admin_key`` only loopback peers may call it).
JSON in and out; errors are ``{"error": msg, "reasons": [...]}``:

``POST /admin/instances``
    Register or re-register (same ``id`` or ``url``) an instance. Body: ``url`` (required, ``http://host:port``),
    ``role`` (``prefill``/``decode``/``both``, default both), ``engine`` (``vllm``), ``model`` (str or list),
    ``cluster``, ``chip`` (catalog name), ``num_chips``, ``block_size``, ``kv_layout`` (``dlmix.kv.layout.KVLayout``
    dict), ``transport`` (e.g. ``{"link": "rdma-100g"}`` or ``{"bandwidth_gbps": 100, "setup_ms": 1}``),
    ``kv_events`` (``tcp://host:port`` of the engine's ZMQ KV-event publisher), ``api_key``, ``id``,
    ``heartbeat_ttl_s`` (default ``heartbeat_ttl_s`` of the router; 0 = no heartbeats expected). → ``201 {"id":..,
    "slot":..}``; ``400`` bad field; ``409`` KV layout incompatible with a registered counterpart (prefill vs decode of
    the same model; ``reasons`` from :func:`dlmix.kv.layout.check_compat`).
``POST /admin/instances/{id}/heartbeat``
    Body ``{"waiting": int, "running": int, "kv_usage": float}`` (all optional). Send every ``ttl/3`` s; an instance
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

PD (vLLM): see :mod:`dlmix.router.engines.vllm`; a failed or timed-out prefill leg is retried on another prefill
instance, then falls back to a full prefill on the decode instance; a decode/whole request that fails before any byte
reached the client is retried on another instance (``retries``).
"""
from __future__ import annotations

import asyncio
import ipaddress
import time
from typing import Dict, List, Optional
from urllib.parse import urlparse

import msgspec

from dlmix.hw.cost import CostModel, ModelSpec, ewma_ratio
from dlmix.hw.profiles import load_catalog
from dlmix.router import kv_events, proxy
from dlmix.router.config import ConfigError, RouterConfig
from dlmix.router.engines import get_engine
from dlmix.routing.hashing import BlockHasher, char_chunk_keys
from dlmix.router.metrics import Metrics
from dlmix.routing.policies import ClusterView, begin, end, make_policy, prefill_done, prefill_work
from dlmix.routing.prefix_index import ApproxIndex, PrefixIndex
from dlmix.router.proxy import BackendError, Pool, build_request, forward_headers, request
from dlmix.routing.state import ROLES, InstanceState, NoInstanceError, RouteRequest
from dlmix.router.tokenize import PromptExtractor

_json = msgspec.json.Encoder()
_SENT = object()
_CHAT = b"/v1/chat/completions"
_COMPL = b"/v1/completions"


def _is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RegistrationError(Exception):
    """Instance registration refused: ``status`` (400/409), message, ``reasons``."""

    def __init__(self, status: int, msg: str, reasons: Optional[List[str]] = None):
        super().__init__(msg)
        self.status = status
        self.reasons = reasons or []


class Runtime:
    """Router-private side of one instance: connection pool, health, breaker, metric children."""

    def __init__(self, state: InstanceState, connect_timeout: float, ttl: float):
        self.state = state
        u = urlparse(state.url)
        self.pool = Pool(u.hostname, u.port or 80, state.id, connect_timeout)
        self.hostport = self.pool.hostport
        self.auth = b"authorization: Bearer %s\r\n" % state.api_key.encode() if state.api_key else b""
        self.engine = get_engine(state.engine)
        self.hb_ttl = ttl
        self.last_hb = time.monotonic()
        self.hc_ok = True
        self.hc_fails = 0
        self.fails = 0
        self.open_until = 0.0
        self.ev_task: Optional[asyncio.Task] = None
        self.m = None  # metric children, set by the router

    def refresh(self, now: float) -> None:
        """Recompute ``state.healthy`` from health check, heartbeat and breaker."""
        hb_ok = self.hb_ttl <= 0 or now - self.last_hb <= self.hb_ttl
        self.state.healthy = self.hc_ok and hb_ok and now >= self.open_until


def _layout_compat(src: dict, dst: dict, sname: str, dname: str) -> List[str]:
    """Reasons why KV made under ``src`` cannot be consumed under ``dst`` (empty = compatible)."""
    try:
        from dlmix.kv.layout import KVLayout, check_compat
    except ImportError:  # pragma: no cover - dlmix.kv ships with dlmix
        keys = ("num_layers", "num_kv_heads", "head_size")
        return [f"{k} differs ({src.get(k)} vs {dst.get(k)})" for k in keys if src.get(k) != dst.get(k)]
    try:
        a, b = KVLayout.from_dict(src), KVLayout.from_dict(dst)
    except Exception as ex:  # noqa: BLE001 - report any malformed descriptor
        return [f"invalid kv_layout: {ex}"]
    c = check_compat(a, b, src_name=sname, dst_name=dname)
    return list(c.reasons)


class Router:
    """The router application. ``await start()`` to listen; ``await stop()`` to close.

    Args:
        cfg: :class:`~dlmix.router.config.RouterConfig`.
    Raises ConfigError/CatalogError/RegistrationError/ValueError for a bad configuration.
    """

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        if not cfg.api_keys and not cfg.allow_open and not _is_loopback(cfg.host):
            raise ConfigError(f"refusing to serve {cfg.host} without client api_keys; set api_keys, bind a "
                              "loopback host, or set allow_open: true explicitly")
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
        self.instances: List[InstanceState] = []
        self.rt: Dict[str, Runtime] = {}
        self.metrics = Metrics(self) if cfg.metrics else None
        self._client_auth = {b"Bearer " + k.encode() for k in cfg.api_keys}
        self._admin_auth = b"Bearer " + cfg.admin_key.encode() if cfg.admin_key else None
        self._server = None
        self._tasks: List[asyncio.Task] = []
        self._started = False
        self._plain = RouteRequest()
        self._needs_parse = True
        self._pd = False
        for d in cfg.instances:
            self.register(dict(d), ttl_default=0.0)

    # ------------------------------------------------------------------ registry
    def register(self, d: dict, ttl_default: Optional[float] = None) -> InstanceState:
        """Add or replace an instance from a registration dict (see module docstring). Raises RegistrationError."""
        url = d.get("url")
        if not isinstance(url, str):
            raise RegistrationError(400, "instance needs a url")
        u = urlparse(url.rstrip("/"))
        if u.scheme != "http" or not u.hostname or not u.port:
            raise RegistrationError(400, f"instance url must be http://host:port, got {url!r}")
        role = d.get("role", "both")
        if role not in ROLES:
            raise RegistrationError(400, f"role must be one of {ROLES}, got {role!r}")
        engine = d.get("engine", "vllm")
        try:
            get_engine(engine)
        except ValueError as ex:
            raise RegistrationError(400, str(ex)) from None
        chip = d.get("chip", "cpu-x86")
        try:
            chip = self.catalog.chip(chip).name
        except KeyError as ex:
            raise RegistrationError(400, str(ex.args[0])) from None
        model = d.get("model") or ()
        model = (model,) if isinstance(model, str) else tuple(model)
        try:
            st = InstanceState(
                id=str(d.get("id") or url.rstrip("/")), url=url.rstrip("/"), engine=engine, role=role, model=model,
                cluster=str(d.get("cluster", "default")), chip=chip, num_chips=int(d.get("num_chips", 1)),
                block_size=int(d.get("block_size", self.cfg.default_block_size)), kv_layout=d.get("kv_layout"),
                transport=d.get("transport"), kv_events=d.get("kv_events"), api_key=d.get("api_key"),
                extra={k: v for k, v in d.items() if k not in ("api_key",)})
            if st.block_size <= 0:
                st.block_size = self.cfg.default_block_size
            if st.transport is not None:
                if not isinstance(st.transport, dict):
                    raise ValueError("transport must be a mapping")
                try:
                    self.catalog.link(st.transport)
                except KeyError as ex:  # unknown link name: keep the descriptor, price it as the default link
                    st.extra["transport_warning"] = str(ex.args[0])
                    st.transport = dict(st.transport, link=None)
        except (TypeError, ValueError, KeyError) as ex:
            raise RegistrationError(400, f"bad instance field: {ex}") from None
        reasons = self._check_layouts(st)
        if reasons:
            raise RegistrationError(409, f"KV layout of {st.id} is incompatible with registered instances", reasons)
        old = self.rt.get(st.id)
        if old is None:
            for r in self.rt.values():
                if r.state.url == st.url:
                    old = r
                    break
        if old is not None:
            st.slot = old.state.slot
            self._drop(old, clear_slot=True)
        else:
            used = {i.slot for i in self.instances}
            st.slot = next(s for s in range(len(used) + 1) if s not in used)
        ttl = float(d.get("heartbeat_ttl_s", self.cfg.heartbeat_ttl_s if ttl_default is None else ttl_default))
        rt = Runtime(st, self.cfg.connect_timeout_s, ttl)
        self.rt[st.id] = rt
        self.instances.append(st)
        if self.metrics:
            self.metrics.bind(rt)
        if self._started and st.kv_events:
            rt.ev_task = asyncio.get_event_loop().create_task(self._subscribe(rt))
        self._update_flags()
        return st

    def _check_layouts(self, st: InstanceState) -> List[str]:
        if not st.kv_layout:
            return []
        reasons: List[str] = []
        for o in self.instances:
            if o.id == st.id or o.url == st.url or not o.kv_layout:
                continue
            if st.model and o.model and not set(st.model) & set(o.model):
                continue
            if st.role in ("prefill", "both") and o.role in ("decode", "both") and (st.role, o.role) != ("both", "both"):
                reasons += [f"{st.id} -> {o.id}: {r}" for r in _layout_compat(st.kv_layout, o.kv_layout,
                                                                              st.id, o.id)]
            if st.role in ("decode", "both") and o.role in ("prefill",) or (st.role == "decode" and o.role == "both"):
                reasons += [f"{o.id} -> {st.id}: {r}" for r in _layout_compat(o.kv_layout, st.kv_layout,
                                                                              o.id, st.id)]
        return reasons

    def _drop(self, rt: Runtime, clear_slot: bool) -> None:
        st = rt.state
        if rt.ev_task is not None:
            rt.ev_task.cancel()
        rt.pool.close()
        self.rt.pop(st.id, None)
        self.instances = [i for i in self.instances if i is not st]
        if clear_slot:
            self.index.clear(st.slot)
            self.approx.clear(st.slot)
        self.policy.on_remove(st)

    def remove(self, iid: str) -> bool:
        """Remove instance ``iid``; False if unknown."""
        rt = self.rt.get(iid)
        if rt is None:
            return False
        self._drop(rt, clear_slot=True)
        self._update_flags()
        return True

    def _update_flags(self) -> None:
        models = {tuple(i.model) for i in self.instances}
        multi = len(models) > 1
        pd = any(i.role == "prefill" for i in self.instances)
        self._needs_parse = self.policy.needs_prompt or multi or pd
        self._pd = pd

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Listen on ``cfg.host:cfg.port`` and start health checks and KV-event subscribers."""
        self._started = True
        self._server = await proxy.serve(self.handle, self.cfg.host, self.cfg.port, fast=self.fast if self.cfg.fast_path else None,
                                         max_body=self.cfg.max_body_mb << 20)
        if self.cfg.port == 0:
            self.cfg.port = self._server.sockets[0].getsockname()[1]
        loop = asyncio.get_event_loop()
        self._tasks.append(loop.create_task(self._health_loop()))
        for rt in self.rt.values():
            if rt.state.kv_events and rt.ev_task is None:
                rt.ev_task = loop.create_task(self._subscribe(rt))

    async def stop(self) -> None:
        """Stop listening and cancel background tasks."""
        for t in self._tasks:
            t.cancel()
        for rt in list(self.rt.values()):
            if rt.ev_task:
                rt.ev_task.cancel()
            rt.pool.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _subscribe(self, rt: Runtime) -> None:
        st = rt.state
        err = self.metrics.kv_event_error if self.metrics else None
        await kv_events.subscribe(st.kv_events, self.index, lambda: st.slot, err)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            rts = list(self.rt.values())
            await asyncio.gather(*(self._check(rt) for rt in rts), return_exceptions=True)

    async def _check(self, rt: Runtime) -> None:
        raw = build_request(b"GET", rt.engine.HEALTH_PATH, rt.hostport, rt.auth, b"")
        try:
            c = await request(rt.pool, raw, None, None, timeout=self.cfg.health_timeout_s)
            ok = c.status == 200
        except BackendError:
            ok = False
        if ok:
            rt.hc_fails = 0
            rt.hc_ok = True
        else:
            rt.hc_fails += 1
            if rt.hc_fails >= self.cfg.health_failures:
                rt.hc_ok = False
        rt.refresh(time.monotonic())

    def _fail(self, rt: Runtime, ex: Optional[BaseException] = None) -> None:
        """A request to ``rt`` failed: breaker bookkeeping; a refused connection takes it out at once."""
        rt.fails += 1
        now = time.monotonic()
        if ex is not None and "cannot connect" in str(ex):
            rt.hc_ok = False
            rt.hc_fails = self.cfg.health_failures
        if rt.fails >= self.cfg.breaker_failures:
            rt.open_until = now + self.cfg.breaker_cooldown_s
        rt.refresh(now)
        if self.metrics:
            self.metrics.backend_error(rt)

    # ------------------------------------------------------------------ HTTP entry
    async def handle(self, conn: proxy.ServerProtocol, req: proxy.Request) -> None:
        """Dispatch one client request."""
        path = req.path
        if path == _CHAT or path == _COMPL:
            if req.method != b"POST":
                return conn.send(405, b'{"error":"use POST"}')
            if self._client_auth and req.header(b"authorization") not in self._client_auth:
                return conn.send(401, b'{"error":"invalid or missing API key"}')
            return await self._generate(conn, req, path == _CHAT)
        if path == b"/health":
            ok = any(i.available() for i in self.instances)
            return conn.send(200 if ok else 503, b'{"status":"ok"}' if ok else b'{"status":"no healthy instance"}')
        if path == b"/v1/models":
            if self._client_auth and req.header(b"authorization") not in self._client_auth:
                return conn.send(401, b'{"error":"invalid or missing API key"}')
            return await self._models(conn)
        if path == b"/metrics":
            if self.metrics is None:
                return conn.send(404, b'{"error":"metrics disabled"}')
            body, ctype = self.metrics.render()
            return conn.send(200, body, ctype)
        if path.startswith(b"/admin/"):
            return self._admin(conn, req)
        conn.send(404, b'{"error":"not found"}')

    def _request_from(self, d: dict, chat: bool) -> RouteRequest:
        model = d.get("model")
        mt = d.get("max_completion_tokens") if chat else None
        mt = mt or d.get("max_tokens")
        rr = RouteRequest(model=model if isinstance(model, str) else None,
                          max_tokens=mt if isinstance(mt, int) else None, stream=bool(d.get("stream")))
        if self.policy.needs_prompt:
            try:
                tokens, text = self.extractor.extract(chat, d)
            except RuntimeError:
                tokens, text = None, ""
            salt = d.get("cache_salt")
            cache: dict = {}
            if tokens is not None:
                rr.prompt_len = len(tokens)
                hasher = self.hasher

                def bh(bs: int, _t=tokens, _c=cache, _s=salt):
                    r = _c.get(bs)
                    if r is None:
                        r = _c[bs] = hasher.block_keys(_t, bs, _s if isinstance(_s, str) else None)
                    return r
            else:
                rr.prompt_len = len(text) // 4

                def bh(bs: int, _t=text, _c=cache):
                    r = _c.get(bs)
                    if r is None:
                        r = _c[bs] = char_chunk_keys(_t, bs)
                    return r
            rr.block_hashes = bh
        return rr

    # ------------------------------------------------------------------ hot path
    def fast(self, conn: proxy.ServerProtocol, req: proxy.Request) -> bool:
        """Callback fast path for generation requests without PD: parse, place, forward on an idle pooled
        connection, all without a task or future. Returns False to let the coroutine path handle the request (other
        endpoints, PD, bad input, no idle connection yet, retries)."""
        path = req.path
        if (path != _CHAT and path != _COMPL) or req.method != b"POST" or self._pd:
            return False
        if self._client_auth and req.header(b"authorization") not in self._client_auth:
            return False
        chat = path == _CHAT
        d = None
        if self._needs_parse:
            try:
                d = msgspec.json.decode(req.body)
            except msgspec.DecodeError:
                return False
            if not isinstance(d, dict):
                return False
            rr = self._request_from(d, chat)
        else:
            rr = self._plain
        view = ClusterView(self.instances, self.index, self.cost, self.approx)
        try:
            dec = self.policy.choose(rr, view)
        except NoInstanceError:
            return False
        rt = self.rt.get(dec.decode.id)
        if rt is None:
            return False
        bc = rt.pool.idle_conn()
        if bc is None:  # first use of this backend: connect on the coroutine path with this decision
            conn.run_async(req, self._generate(conn, req, chat, d, rr, dec))
            return True
        begin(dec, rr)
        self.policy.on_dispatch(rr, dec, view)
        if rr.prompt_len and self._needs_parse:
            self._record(rr, dec)
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
            if err is None:
                rt.fails = 0
                status = c.status
                if self.metrics:
                    self.metrics.done(rt, dec, rr, req.t0, status, c.nchunks, c.t_first, c.gap_sum)
                if dec.predicted_ttft and c.nchunks > 1 and status == 200:
                    self._calibrate(dec, rr, c.t_first - req.t0, c.gap_sum / (c.nchunks - 1))
                if c.usable:
                    rt.pool.release(c)
                conn.done(req)
                return
            gone = conn.closed or conn.transport.is_closing()
            if not gone:  # a client that went away is not the backend's fault
                self._fail(rt, err)
            if err.sent_to_client or gone:
                if not conn.closed:
                    conn.transport.abort()
                    conn.closed = True
                conn.done(req)
                return
            if self.metrics:
                self.metrics.retry("decode")
            conn.run_async(req, self._generate(conn, req, chat, d, rr, None, {dec.decode.id}, 1))

        raw = build_request(req.method, req.url, rt.hostport, rt.auth + forward_headers(req.headers), req.body)
        conn.backends.append(bc)
        try:
            bc.start(raw, conn.transport, first, finished)
        except RuntimeError as ex:  # transport closed under us: let the connection_lost callback retry
            bc.abort()
            _ = ex
        return True

    async def _generate(self, conn: proxy.ServerProtocol, req: proxy.Request, chat: bool, d=None, rr=None,
                        first_dec=None, excluded: Optional[set] = None, attempts: int = 0) -> None:
        body = req.body
        if rr is not None:
            pass
        elif self._needs_parse:
            try:
                d = msgspec.json.decode(body)
            except msgspec.DecodeError as ex:
                return conn.send(400, _json.encode({"error": f"request body is not valid JSON: {ex}"}))
            if not isinstance(d, dict):
                return conn.send(400, b'{"error":"request body must be a JSON object"}')
            rr = self._request_from(d, chat)
        else:
            rr = self._plain
        fwd = forward_headers(req.headers)
        m = self.metrics
        while True:
            insts = self.instances if not excluded else [i for i in self.instances if i.id not in excluded]
            view = ClusterView(insts, self.index, self.cost, self.approx)
            if first_dec is not None:
                dec, first_dec = first_dec, None
            else:
                try:
                    dec = self.policy.choose(rr, view)
                except NoInstanceError as ex:
                    return conn.send(503, _json.encode({"error": str(ex)}))
            begin(dec, rr)
            self.policy.on_dispatch(rr, dec, view)
            if rr.prompt_len and self._needs_parse:
                self._record(rr, dec)
            state = [False]  # prefilled

            def first(_s=state, _dec=dec, _rr=rr):
                if not _s[0]:
                    _s[0] = True
                    prefill_done(_dec, _rr)
            rt = None
            try:
                data = body
                if dec.prefill is not None:
                    kvp = await self._prefill(conn, req, d, rr, dec, chat, fwd)
                    if kvp is _SENT:
                        return
                    if kvp is not None:  # else: fell back to prefill on D (dec.prefill is None now)
                        data = rt_engine_decode(self.rt[dec.decode.id], body, kvp, d)
                        if m and self.cost is not None:
                            hd = min(view.hit_tokens(rr, dec.decode), rr.prompt_len)
                            m.kv_bytes.inc(self.cost.kv_bytes(rr.prompt_len - hd))
                        first()
                rt = self.rt.get(dec.decode.id)
                if rt is None:
                    raise BackendError(f"instance {dec.decode.id} was removed")
                raw = build_request(req.method, req.url, rt.hostport, rt.auth + fwd, data)
                c = await request(rt.pool, raw, conn.transport, conn, None, first)
                status, nch, t_first, gaps = c.status, c.nchunks, c.t_first, c.gap_sum
                rt.fails = 0
                if m:
                    m.done(rt, dec, rr, req.t0, status, nch, t_first, gaps)
                if status >= 500:
                    rt.fails += 1
                if dec.predicted_ttft and nch > 1 and status == 200:
                    self._calibrate(dec, rr, t_first - req.t0, gaps / (nch - 1))
                return
            except BackendError as ex:
                gone = conn.closed or conn.transport.is_closing()
                if rt is not None and not gone:
                    self._fail(rt, ex)
                if ex.sent_to_client or gone:
                    if not conn.closed:
                        conn.transport.abort()
                        conn.closed = True
                    return
                attempts += 1
                if attempts > self.cfg.retries:
                    return conn.send(502, _json.encode({"error": f"backend failed: {ex}"}))
                excluded = excluded or set()
                excluded.add(dec.decode.id)
                if m:
                    m.retry("decode")
            finally:
                end(dec, rr, state[0])

    def _record(self, rr: RouteRequest, dec) -> None:
        """Approximate index: remember that these prefixes now live on the chosen instance(s)."""
        self.approx.record_decision(rr, dec)
        if self.metrics and dec.hit_tokens:
            self.metrics.hit(self.rt.get((dec.prefill or dec.decode).id), dec.hit_tokens)

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

    async def _prefill(self, conn, req, d, rr, dec, chat, fwd):
        """Run the prefill leg; returns kv_transfer_params, None (fall back to local prefill on D) or _SENT (a 4xx
        from the prefill instance went to the client)."""
        p = dec.prefill
        engine = self.rt[p.id].engine
        pbody = engine.prefill_body(d, chat)
        tried = {p.id}
        m = self.metrics
        while True:
            rt = self.rt.get(p.id)
            if rt is not None:
                raw = build_request(b"POST", req.url, rt.hostport, rt.auth + fwd, pbody)
                try:
                    c = await request(rt.pool, raw, None, conn, self.cfg.prefill_timeout_s)
                    status, hdrs, rbody = c.collected()
                    if status == 200:
                        kvp = rt.engine.kv_transfer_params(rbody)
                        rt.fails = 0
                        return kvp
                    if 400 <= status < 500:
                        ctype = next((v for k, v in hdrs if k == b"content-type"), b"application/json")
                        conn.send(status, rbody, ctype)
                        return _SENT
                    self._fail(rt)
                except BackendError as ex:
                    if conn.closed:
                        raise
                    self._fail(rt, ex)
                except ValueError:
                    self._fail(rt)
            others = [i for i in self.instances if i.role == "prefill" and i.available() and i.serves(rr.model)
                      and i.id not in tried]
            if not others or len(tried) > self.cfg.retries:
                self._move_prefill(dec, rr, None)
                if m:
                    m.retry("prefill_local")
                return None
            p2 = min(others, key=lambda i: (i.load.queue_len(), i.load.processed))
            self._move_prefill(dec, rr, p2)
            tried.add(p2.id)
            p = p2
            if m:
                m.retry("prefill")

    @staticmethod
    def _move_prefill(dec, rr: RouteRequest, new) -> None:
        """Re-assign the prefill leg (load bookkeeping): to another prefill instance, or to D (``new`` None)."""
        work = prefill_work(dec, rr)
        old = dec.prefill.load
        old.inflight = max(old.inflight - 1, 0)
        old.unqueue_prefill(*work)
        if new is None:
            dec.decode.load.queue_prefill(*work)
        else:
            new.load.inflight += 1
            new.load.processed += 1
            new.load.queue_prefill(*work)
        dec.prefill = new

    async def _models(self, conn) -> None:
        seen: Dict[str, dict] = {}

        async def one(rt: Runtime):
            raw = build_request(b"GET", rt.engine.MODELS_PATH, rt.hostport, rt.auth, b"")
            try:
                c = await request(rt.pool, raw, None, None, 5.0)
                st, _, b = c.collected()
                if st == 200:
                    return msgspec.json.decode(b).get("data") or []
            except (BackendError, msgspec.DecodeError, AttributeError):
                pass
            return [{"id": m, "object": "model", "owned_by": "dlmix"} for m in rt.state.model]

        rts = [rt for rt in self.rt.values() if rt.state.available()]
        for lst in await asyncio.gather(*(one(rt) for rt in rts)):
            for e in lst:
                if isinstance(e, dict) and e.get("id") not in seen:
                    seen[e["id"]] = e
        conn.send(200, _json.encode({"object": "list", "data": list(seen.values())}))

    # ------------------------------------------------------------------ admin
    def _admin_ok(self, conn, req) -> bool:
        if self._admin_auth is not None:
            return req.header(b"authorization") == self._admin_auth
        peer = conn.peer[0] if conn.peer else ""
        try:
            return ipaddress.ip_address(peer).is_loopback
        except ValueError:
            return False

    def _admin(self, conn, req) -> None:
        if not self._admin_ok(conn, req):
            return conn.send(401, b'{"error":"admin key required"}')
        parts = req.path.decode("utf-8", "replace").strip("/").split("/")
        if parts[:2] != ["admin", "instances"]:
            return conn.send(404, b'{"error":"not found"}')
        try:
            body = msgspec.json.decode(req.body) if req.body else {}
        except msgspec.DecodeError as ex:
            return conn.send(400, _json.encode({"error": f"invalid JSON: {ex}"}))
        if len(parts) == 2:
            if req.method == b"GET":
                return conn.send(200, _json.encode({"instances": [self.describe(i) for i in self.instances]}))
            if req.method == b"POST":
                if not isinstance(body, dict):
                    return conn.send(400, b'{"error":"body must be a JSON object"}')
                try:
                    st = self.register(body)
                except RegistrationError as ex:
                    return conn.send(ex.status, _json.encode({"error": str(ex), "reasons": ex.reasons}))
                return conn.send(201, _json.encode({"id": st.id, "slot": st.slot}))
            return conn.send(405, b'{"error":"method not allowed"}')
        iid = "/".join(parts[2:-1]) if len(parts) > 3 and parts[-1] in ("heartbeat", "drain", "undrain") else \
            "/".join(parts[2:])
        import urllib.parse as _up
        iid = _up.unquote(iid)
        rt = self.rt.get(iid)
        if rt is None:
            return conn.send(404, _json.encode({"error": f"unknown instance {iid!r}"}))
        action = parts[-1] if len(parts) > 3 else None
        if req.method == b"DELETE" and action is None:
            self.remove(iid)
            return conn.send(200, b'{"removed":true}')
        if req.method == b"GET" and action is None:
            return conn.send(200, _json.encode(self.describe(rt.state)))
        if req.method == b"POST" and action == "heartbeat":
            ld = rt.state.load
            if isinstance(body, dict):
                try:
                    ld.waiting = int(body.get("waiting", ld.waiting))
                    ld.running = int(body.get("running", ld.running))
                    ld.kv_usage = float(body.get("kv_usage", ld.kv_usage))
                except (TypeError, ValueError) as ex:
                    return conn.send(400, _json.encode({"error": f"bad heartbeat: {ex}"}))
            rt.last_hb = time.monotonic()
            rt.refresh(rt.last_hb)
            return conn.send(200, b'{"ok":true}')
        if req.method == b"POST" and action in ("drain", "undrain"):
            rt.state.draining = action == "drain"
            return conn.send(200, _json.encode({"draining": rt.state.draining}))
        return conn.send(405, b'{"error":"method not allowed"}')

    def describe(self, i: InstanceState) -> dict:
        """JSON-able view of an instance (admin list)."""
        ld = i.load
        return {"id": i.id, "url": i.url, "engine": i.engine, "role": i.role, "model": list(i.model),
                "cluster": i.cluster, "chip": i.chip, "num_chips": i.num_chips, "block_size": i.block_size,
                "healthy": i.healthy, "draining": i.draining, "slot": i.slot, "kv_events": i.kv_events,
                "transport": i.transport, "ttft_ratio": i.ttft_ratio, "itl_ratio": i.itl_ratio,
                "load": {"inflight": ld.inflight, "inflight_prefill_tokens": ld.inflight_prefill_tokens,
                         "inflight_decode": ld.inflight_decode, "waiting": ld.waiting, "running": ld.running,
                         "kv_usage": ld.kv_usage, "processed": ld.processed}}


def rt_engine_decode(rt: Runtime, body: bytes, kvp: dict, parsed) -> bytes:
    """Decode-leg body through the decode instance's engine adapter."""
    return rt.engine.decode_body(body, kvp, parsed)


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
