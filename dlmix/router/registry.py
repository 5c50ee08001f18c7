"""The router's instance registry: registration and validation, health checks, heartbeats and circuit breakers.

:class:`Registry` owns the list of :class:`~dlmix.routing.state.InstanceState` the policies see and, per instance, a
:class:`Backend` (connection pool, engine adapter, health/heartbeat/breaker state, KV-event subscriber task).

Health (what takes an instance out of rotation, :meth:`Backend.refresh`):

* health check: every ``health_interval_s`` the registry GETs the engine's health path; ``health_failures`` failures
  in a row (or one refused connection on a request) take the instance out, one success brings it back;
* heartbeat: an instance registered with ``heartbeat_ttl_s`` > 0 leaves rotation when no heartbeat arrived for that
  long and returns with the next one;
* breaker: ``breaker_failures`` consecutive request failures open it for ``breaker_cooldown_s`` seconds;
* shared store (router replicas, :mod:`dlmix.router.shared`): the heartbeat TTL is an etcd lease instead, and the
  instance is out of rotation on every replica while its lease has expired.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import re
import time
from typing import Annotated, Callable, Dict, List, Optional, Tuple
from urllib.parse import urlparse

import msgspec

from dlmix.errors import DlmixError
from dlmix.pd.contract import ContractError
from dlmix.pd.registration import decode_registration
from dlmix.router import kv_events
from dlmix.router.engines import ENGINES, bridges, can_pair, get_engine, pd_key
from dlmix.router.proxy import BackendError, Pool, build_request, request
from dlmix.routing.hashing import BlockHasher
from dlmix.routing.state import ROLES, InstanceState
from dlmix.net import ip_literal, is_loopback as _loopback

__all__ = ["Backend", "Registry", "RegistrationError", "Heartbeat", "layout_reasons"]

log = logging.getLogger(__name__)
_HOST = re.compile(r"^([A-Za-z0-9_][A-Za-z0-9_.-]{0,252}|[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?)$")
_TOKEN = re.compile(r"^[\x21-\x7e]{1,4096}$")
#: health checks in flight at once
HEALTH_CONCURRENCY = 256
_KV_EVENT_SCHEMES = ("tcp://", "ipc://", "inproc://")
_json_sorted = msgspec.json.Encoder(order="sorted").encode


#: a request count an engine may report (bounded: a huge integer would overflow the policies' float scores)
MAX_COUNT = 1 << 31
_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]


def _router_id(body: bytes) -> str:
    try:
        return str(msgspec.json.decode(body).get("dlmix_router"))
    except (msgspec.DecodeError, AttributeError):
        return "?"


class Heartbeat(msgspec.Struct, forbid_unknown_fields=True):
    """Heartbeat body: the engine's load; every field optional (an absent one keeps its last value), unknown ones
    refused. ``waiting``/``running``: requests (>= 0); ``kv_usage``: fraction of the KV cache in use, 0..1."""

    waiting: Optional[_Count] = None
    running: Optional[_Count] = None
    kv_usage: Optional[Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]] = None


class RegistrationError(DlmixError):
    """Instance registration refused: ``status`` (400 bad field, 409 incompatible KV layout), message, ``reasons``
    (one line per incompatibility)."""

    def __init__(self, status: int, msg: str, reasons: Optional[List[str]] = None):
        super().__init__(msg)
        self.status = status
        self.reasons = reasons or []


def _forget_pairs(url: str) -> None:
    """Drop what the engine adapters (their optional ``forget(url)``: LMDeploy's DistServe connections) and the
    cross-engine bridges remember about the instance at ``url``: it was registered anew (restarted, maybe with
    another transport endpoint behind the same address) or removed."""
    for eng in ENGINES.values():
        forget = getattr(eng, "forget", None)
        if forget is not None:
            forget(url)
    bridges.forget(url)


class Backend:
    """Router-private side of one instance: connection pool, engine adapter, health, heartbeat and breaker state,
    metric children (``m``, set by :class:`~dlmix.router.metrics.Metrics`), KV-event task.

    Args:
        state: the instance as the policies see it. connect_timeout: seconds for a TCP connect.
        ttl: heartbeat TTL in seconds (0: no heartbeats expected).
    """

    __slots__ = ("state", "pool", "hostport", "auth", "engine", "hb_ttl", "last_hb", "hc_ok", "hc_fails", "fails",
                 "open_until", "ev_task", "m", "loop", "bootstrap", "lease_ok")

    def __init__(self, state: InstanceState, connect_timeout: float, ttl: float, via: bytes = b""):
        self.state = state
        u = urlparse(state.url)
        self.pool = Pool(u.hostname, u.port or 80, state.id, connect_timeout)
        self.hostport = self.pool.hostport
        self.auth = (b"authorization: Bearer %s\r\n" % state.api_key.encode() if state.api_key else b"") + via
        self.engine = get_engine(state.engine)
        bp = state.extra.get("bootstrap_port")
        #: (host, port) of the instance's PD bootstrap server (concurrent PD flow), or None
        self.bootstrap = (u.hostname, int(bp)) if isinstance(bp, int) else None
        self.hb_ttl = ttl
        self.last_hb = time.monotonic()
        self.hc_ok = True
        self.hc_fails = 0
        self.fails = 0
        self.open_until = 0.0
        self.ev_task: Optional[asyncio.Task] = None
        self.m = None
        #: why the instance is a routing loop (its health answer is a dlmix router's), or None
        self.loop: Optional[str] = None
        #: False while the instance's heartbeat lease in the shared store (etcd) has expired
        #: (:mod:`dlmix.router.shared`); always True without a shared store
        self.lease_ok = True

    def refresh(self, now: float) -> None:
        """Recompute ``state.healthy`` from health check, heartbeat and breaker (``now``: ``time.monotonic()``)."""
        hb_ok = self.hb_ttl <= 0 or now - self.last_hb <= self.hb_ttl
        self.state.healthy = self.hc_ok and hb_ok and self.lease_ok and now >= self.open_until

    def heartbeat(self, body) -> None:
        """Apply a heartbeat body (:class:`Heartbeat`: ``{"waiting": int, "running": int, "kv_usage": float}``, all
        optional; ``{}``/None: alive only) and mark the instance alive. Raises ValueError naming the bad field
        (nothing is changed then)."""
        ld = self.state.load
        if body is not None and body != {}:
            try:
                hb = msgspec.convert(body, Heartbeat, strict=True)
            except msgspec.ValidationError as ex:
                raise ValueError(str(ex)) from None
            if hb.waiting is not None:
                ld.waiting = hb.waiting
            if hb.running is not None:
                ld.running = hb.running
            if hb.kv_usage is not None:
                ld.kv_usage = hb.kv_usage
        self.last_hb = time.monotonic()
        self.refresh(self.last_hb)


#: kept for code written against the single-file router
Runtime = Backend


def layout_reasons(src: dict, dst: dict, sname: str, dname: str) -> List[str]:
    """Reasons why KV made under the ``src`` layout descriptor cannot be consumed under ``dst`` (empty: compatible):
    the PD core's one pair check, :func:`dlmix.pd.pair.check_pair` (the same function the consumer runs per request
    and the producer runs as a gate); a malformed descriptor is one reason."""
    from dlmix.pd.pair import check_pair

    return check_pair(src, dst, src_name=sname, dst_name=dname)


class Registry:
    """Registered instances and their backends.

    Args:
        cfg: the :class:`~dlmix.router.config.RouterConfig` (timeouts, thresholds, defaults).
        catalog: chip/link catalog (validates ``chip`` and ``transport``).
        index, approx: exact and approximate prefix indexes (a removed instance's slot is cleared in both).
        on_remove: called with the InstanceState that leaves (the policy's private state).
        metrics: a :class:`~dlmix.router.metrics.Metrics` or None.
    """

    def __init__(self, cfg, catalog, index, approx, on_remove: Callable[[InstanceState], None], metrics=None,
                 hasher: Optional[BlockHasher] = None):
        self.cfg = cfg
        self.catalog = catalog
        self.index = index
        self.approx = approx
        self.on_remove = on_remove
        self.metrics = metrics
        self.instances: List[InstanceState] = []
        self.backends: Dict[str, Backend] = {}
        self.on_change: Optional[Callable[[], None]] = None
        #: ``x-dlmix-via`` header line this router adds to every request it forwards (loop detection)
        self.via: bytes = b""
        #: the owning router's id (what its /health answer carries)
        self.own_id: str = ""
        #: registered model names (count of instances serving each) and LoRA adapters ``{name: path}``
        self.model_names: Dict[str, int] = {}
        self.loras: Dict[str, str] = {}
        #: adapter name -> {path: count of registered instances serving it from that path} (what :attr:`loras` is
        #: kept from: an adapter no instance serves any more leaves it)
        self._lora_refs: Dict[str, Dict[str, int]] = {}
        self._pos: Dict[str, int] = {}
        self._by_url: Dict[str, Backend] = {}
        self._free: List[int] = []
        self._next_slot = 0
        self._roles: Dict[str, int] = {}
        self._models: Dict[tuple, int] = {}
        self._groups: Dict[Tuple[str, str], Dict[str, set]] = {}
        self._layouts: Dict[str, dict] = {}
        #: canonical layout key -> count of registered instances with that layout (:attr:`_layouts` keeps only those)
        self._layout_refs: Dict[str, int] = {}
        #: the router's block hasher (stateful KV-event decoders re-hash token ids with it)
        self.hasher = hasher or BlockHasher(cfg.hash_algo, cfg.hash_seed)
        #: decode-role instances that cannot serve a request without a prefill instance (engine adapter's
        #: ``DECODE_NEEDS_PREFILL``)
        self.decode_needs_prefill = 0
        #: (model, role) -> {engine name: instance count} (PD flow compatibility, :meth:`_flow_conflicts`)
        self._flows: Dict[Tuple[str, str], Dict[str, int]] = {}
        self._pair_cache: Dict[Tuple[str, str], bool] = {}
        self._self_cache = None
        self._started = False
        self._task: Optional[asyncio.Task] = None

    # ------------------------------------------------------------------ registration
    def register(self, d: dict, ttl_default: Optional[float] = None) -> InstanceState:
        """Add or replace (same ``id`` or ``url``: keeps its slot and place, drops its cache entries) an instance from
        a registration mapping (schema: :class:`dlmix.pd.registration.Registration`). Returns its state.

        All-or-nothing: the body is validated in full before anything changes, so a refused re-registration leaves
        the live instance registered and unchanged. Cost per call does not grow with the fleet: slots come from a
        free list, the place in :attr:`instances` from a position map, and the KV-layout check runs once per
        distinct (producer layout, consumer layout) pair and is memoised.

        Raises RegistrationError: 400 for a bad field (the message names it), for the router's own address, or for an
        id that another url already holds; 409 when its KV layout cannot pair with a registered prefill/decode
        counterpart of the same model.
        """
        st, ttl, lkey, old = self.validate(d, ttl_default)
        # ---- commit (nothing below raises on a validated body)
        _forget_pairs(st.url)  # a (re)started engine: its PD connections are made and its endpoint learnt again
        if old is not None:
            st.slot = old.state.slot
            if old.state.id == st.id:  # an operator's drain outlives a restart, as with shared state (etcd)
                st.draining = old.state.draining
            pos = self._pos[old.state.id]
            self._detach(old)
            self.instances[pos] = st
        else:
            if self._free:
                st.slot = heapq.heappop(self._free)
            else:
                st.slot, self._next_slot = self._next_slot, self._next_slot + 1
            pos = len(self.instances)
            self.instances.append(st)
        self._pos[st.id] = pos
        b = Backend(st, self.cfg.connect_timeout_s, ttl, self.via)
        self.backends[st.id] = b
        self._by_url[st.url] = b
        self._attach(st, lkey)
        if self.metrics:
            self.metrics.bind(b)
        if self._started and st.kv_events:
            self._subscribe(b)
        self._changed()
        return st

    def validate(self, d, ttl_default: Optional[float] = None) -> Tuple[InstanceState, float, Optional[str],
                                                                         Optional[Backend]]:
        """Run every check of :meth:`register` on registration mapping ``d`` without changing anything. Returns
        (state, heartbeat TTL in seconds, canonical KV-layout key, the backend it would replace or None).
        Raises RegistrationError as :meth:`register` does."""
        st, ttl, lkey = self._parse(d, ttl_default)
        old = self.backends.get(st.id)
        by_url = self._by_url.get(st.url)
        if old is not None and old.state.url != st.url and by_url is not None and by_url is not old:
            raise RegistrationError(400, f"id {st.id!r} is registered with url {old.state.url} and url {st.url} "
                                    f"with id {by_url.state.id!r}; remove one first")
        old = old or by_url
        reasons = self._flow_conflicts(st, old)
        if reasons:
            raise RegistrationError(409, f"PD flow of {st.id} cannot pair with registered instances", reasons)
        reasons = self._layout_conflicts(st, lkey, old)
        if reasons:
            raise RegistrationError(409, f"KV layout of {st.id} is incompatible with registered instances", reasons)
        return st, ttl, lkey, old

    def _parse(self, d, ttl_default: Optional[float]) -> Tuple[InstanceState, float, Optional[str]]:
        """Validate a registration body (schema, then the router's own checks); returns (state, heartbeat TTL,
        canonical KV-layout key). Raises RegistrationError(400) naming the bad field."""
        try:
            reg = decode_registration(d)
        except ContractError as ex:
            raise RegistrationError(400, str(ex)) from None
        url = reg.url.rstrip("/")
        u = urlparse(url)
        if u.scheme != "http":
            raise RegistrationError(400, f"instance url must be http://host:port (the router speaks plain HTTP to "
                                         f"engines), got {reg.url!r}")
        host = u.hostname or ""
        if not _HOST.fullmatch(host):
            raise RegistrationError(400, f"instance url has an invalid host {host!r}")
        if u.path or u.query or u.fragment or u.username or u.password:
            raise RegistrationError(400, f"instance url must be http://host:port without path, query or user, "
                                         f"got {reg.url!r}")
        self_reason = self.is_self(host, u.port)
        if self_reason:
            raise RegistrationError(400, f"refusing to register {url}: {self_reason} (the router would forward "
                                         "requests to itself)")
        if reg.api_key is not None and not _TOKEN.fullmatch(reg.api_key):
            raise RegistrationError(400, "api_key must be 1-4096 visible ASCII characters (it becomes an HTTP header)")
        try:
            eng = get_engine(reg.engine)
        except ValueError as ex:
            raise RegistrationError(400, str(ex)) from None
        if reg.role == "prefill" and eng.PD_FLOW == "concurrent" and reg.bootstrap_port is None:
            raise RegistrationError(400, f"a {reg.engine} prefill instance needs bootstrap_port (the port of its PD "
                                         "bootstrap server, e.g. SGLang's --disaggregation-bootstrap-port)")
        try:
            chip = self.catalog.chip(reg.chip or "cpu-x86").name
        except KeyError as ex:
            raise RegistrationError(400, str(ex.args[0])) from None
        if reg.kv_events is not None:
            if not reg.kv_events.startswith(_KV_EVENT_SCHEMES):
                raise RegistrationError(400, f"kv_events must be a ZMQ endpoint ({', '.join(_KV_EVENT_SCHEMES)}...), "
                                             f"got {reg.kv_events!r}")
            try:
                kv_events.get_decoder(reg.engine)
            except ValueError as ex:
                raise RegistrationError(400, str(ex)) from None
        transport = reg.transport
        extra = {k: v for k, v in d.items() if k != "api_key"}
        if transport is not None:
            try:
                lk = self.catalog.link(transport)
            except KeyError as ex:  # unknown link name: keep the descriptor, price it as the default link
                extra["transport_warning"] = str(ex.args[0])
                log.warning("instance %s: transport %s; priced as the default link", reg.id or url, ex.args[0])
                transport = dict(transport, link=None)
            except (TypeError, ValueError, AttributeError, RecursionError) as ex:
                raise RegistrationError(400, f"bad transport: {ex}") from None
            else:
                # the cost policy divides by the bandwidth: 0, negative or NaN would raise or poison every score
                try:
                    lk.check()
                except ValueError as ex:
                    raise RegistrationError(400, f"bad transport: {ex}") from None
        model = reg.model or ()
        model = (model,) if isinstance(model, str) else tuple(model)
        if reg.lora_adapters:  # an adapter is served under its name: requests naming it may go here
            model = model + tuple(n for n in reg.lora_adapters if n not in model)
        st = InstanceState(
            id=reg.id or url, url=url, engine=reg.engine, role=reg.role,
            model=model, cluster=reg.cluster or "default", chip=chip,
            num_chips=reg.num_chips or 1, block_size=reg.block_size or self.cfg.default_block_size,
            kv_layout=reg.kv_layout, transport=transport, kv_events=reg.kv_events, api_key=reg.api_key, extra=extra)
        if reg.heartbeat_ttl_s is not None:
            ttl = reg.heartbeat_ttl_s
        else:
            ttl = float(self.cfg.heartbeat_ttl_s if ttl_default is None else ttl_default)
        lkey = _json_sorted(reg.kv_layout).decode() if reg.kv_layout else None
        return st, ttl, lkey

    # ------------------------------------------------------------------ self / loop detection
    def is_self(self, host: str, port: Optional[int]) -> Optional[str]:
        """Why ``host:port`` is this router's own listening address (None if it is not): the configured host, any
        loopback address or ``localhost`` when the router listens on loopback or on all addresses, and for a
        wildcard listener this machine's host names and interface addresses. No DNS lookups (names other than
        this machine's are not resolved)."""
        if not port or port != self.cfg.port or not self.cfg.port:
            return None
        h = host.lower().strip("[]")
        names = self._self_names()
        if h in names or h.rstrip(".") in names:  # "localhost." is the same name as "localhost"
            return f"{host}:{port} is this router's own listening address"
        ip = ip_literal(h)
        if ip is not None:
            bind = (self.cfg.host or "").lower().strip("[]")
            local = bind in ("", "0.0.0.0", "::") or _loopback(bind)
            # every spelling the resolver takes for a loopback or wildcard address (127.0.0.2, 127.1, 2130706433,
            # 0x7f000001, ::ffff:127.0.0.1, 0) reaches a router listening on loopback or on all addresses
            if (local and (ip.is_loopback or ip.is_unspecified)) or str(ip) in names:
                return f"{host}:{port} is this router's own listening address"
        return None

    def _self_names(self) -> set:
        if self._self_cache is not None and self._self_cache[0] == (self.cfg.host, self.cfg.port):
            return self._self_cache[1]
        bind = (self.cfg.host or "").lower().strip("[]")
        names = {bind}
        wildcard = bind in ("", "0.0.0.0", "::")
        if wildcard or _loopback(bind):
            names |= {"localhost", "localhost.localdomain", "ip6-localhost", "0.0.0.0", "::", "::1", "127.0.0.1"}
        if wildcard:
            import socket

            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
            try:
                import psutil

                for addrs in psutil.net_if_addrs().values():
                    names |= {a.address.split("%")[0].lower() for a in addrs
                              if a.family in (socket.AF_INET, socket.AF_INET6)}
            except Exception:  # noqa: BLE001 - psutil missing or unsupported platform: names and loopback only
                pass
        names.discard("")
        self._self_cache = ((self.cfg.host, self.cfg.port), names)
        return names

    # ------------------------------------------------------------------ bookkeeping (O(1) per instance)
    def _attach(self, st: InstanceState, lkey: Optional[str]) -> None:
        """Count ``st`` in the layout groups, role and model tallies."""
        self._roles[st.role] = self._roles.get(st.role, 0) + 1
        mk = tuple(st.model)
        self._models[mk] = self._models.get(mk, 0) + 1
        for m in st.model:
            self.model_names[m] = self.model_names.get(m, 0) + 1
        loras = st.extra.get("lora_adapters")
        if isinstance(loras, dict):
            for name, path in loras.items():
                paths = self._lora_refs.setdefault(name, {})
                paths[path] = paths.get(path, 0) + 1
                self.loras[name] = path  # the latest registration's path wins, as before
        st.extra["_lkey"] = lkey
        eng = get_engine(st.engine)
        if st.role == "decode" and eng.DECODE_NEEDS_PREFILL:
            self.decode_needs_prefill += 1
            st.extra["needs_prefill"] = True  # policies never plan a local prefill on it
        for m in (st.model or ("",)):
            f = self._flows.setdefault((m, st.role), {})
            f[eng.NAME] = f.get(eng.NAME, 0) + 1
        if lkey is not None:
            self._layouts.setdefault(lkey, st.kv_layout)
            self._layout_refs[lkey] = self._layout_refs.get(lkey, 0) + 1
            for m in (st.model or ("",)):
                self._groups.setdefault((m, st.role), {}).setdefault(lkey, set()).add(st.id)

    def _detach(self, b: Backend) -> None:
        """Undo :meth:`_attach` for ``b`` and stop its background work; its slot and cache entries go too (the
        caller reuses or frees the slot)."""
        st = b.state
        if b.ev_task is not None:
            b.ev_task.cancel()
        b.pool.close()
        _forget_pairs(st.url)
        self.backends.pop(st.id, None)
        if self._by_url.get(st.url) is b:
            del self._by_url[st.url]
        self._pos.pop(st.id, None)
        self._roles[st.role] -= 1
        mk = tuple(st.model)
        self._models[mk] -= 1
        if not self._models[mk]:
            del self._models[mk]
        for m in st.model:
            self.model_names[m] -= 1
            if not self.model_names[m]:
                del self.model_names[m]
        if st.role == "decode" and b.engine.DECODE_NEEDS_PREFILL:
            self.decode_needs_prefill -= 1
        name = b.engine.NAME
        for m in (st.model or ("",)):
            f = self._flows.get((m, st.role))
            if f is not None and f.get(name):
                f[name] -= 1
                if not f[name]:
                    del f[name]
        loras = st.extra.get("lora_adapters")
        if isinstance(loras, dict):
            for name, path in loras.items():
                paths = self._lora_refs.get(name)
                left = paths.get(path, 0) - 1 if paths is not None else -1
                if left < 0:
                    continue
                if left:
                    paths[path] = left
                    continue
                del paths[path]
                if not paths:
                    del self._lora_refs[name]
                    self.loras.pop(name, None)
                elif self.loras.get(name) == path:
                    self.loras[name] = next(reversed(paths))  # another instance still serves it, from there
        lkey = st.extra.get("_lkey")
        if lkey is not None:
            n = self._layout_refs.get(lkey, 0) - 1
            if n > 0:
                self._layout_refs[lkey] = n
            else:
                self._layout_refs.pop(lkey, None)
                self._layouts.pop(lkey, None)
            for m in (st.model or ("",)):
                g = self._groups.get((m, st.role))
                if g is not None and lkey in g:
                    g[lkey].discard(st.id)
                    if not g[lkey]:
                        del g[lkey]
        self.index.clear(st.slot)
        self.approx.clear(st.slot)
        self.on_remove(st)

    @property
    def has_prefill(self) -> bool:
        """True when a prefill-role instance is registered (PD placements possible)."""
        return self._roles.get("prefill", 0) > 0

    @property
    def distinct_models(self) -> int:
        """Number of distinct registered model lists."""
        return len(self._models)

    def _flow_conflicts(self, st: InstanceState, old: Optional[Backend]) -> List[str]:
        """Why ``st`` cannot take part in PD with the registered prefill/decode counterparts of a shared model: a
        prefill engine cannot feed a decode engine unless their PD flows and protocols are equal or a bridge joins
        them (:func:`dlmix.router.engines.can_pair`; e.g. an LMDeploy prefill feeds a vLLM decode, a vLLM prefill
        feeds no LMDeploy or SGLang decode). Cost: a few dict lookups per model of ``st``."""
        if st.role == "both":
            others = ("prefill",)
        elif st.role == "prefill":
            others = ("decode", "both")
        else:
            others = ("prefill",)
        eng = get_engine(st.engine)
        keys = [(m, r) for m in (tuple(st.model) + ("",) if st.model else ("",)) for r in others]
        if not st.model:
            keys += [k for k in self._flows if k[1] in others and k[0]]
        reasons: List[str] = []
        for m, r in keys:
            f = dict(self._flows.get((m, r)) or {})
            if old is not None and old.state.role == r and (m in old.state.model or (not m and not old.state.model)):
                on = old.engine.NAME
                if f.get(on):
                    f[on] -= 1
            bad = sorted(k for k, n in f.items() if n > 0 and not (
                can_pair(eng, get_engine(k)) if st.role == "prefill" else can_pair(get_engine(k), eng)))
            if bad:
                what = f"model {m!r}" if m else "any model"
                theirs = ", ".join(f"{k} ({pd_key(get_engine(k))})" for k in bad)
                reasons.append(f"{st.id} ({st.engine}, PD flow {pd_key(eng)}) vs registered {r} instances of {what} "
                               f"on {theirs}: a prefill and a decode must use the same PD flow and protocol, or "
                               "engines a bridge joins (dlmix.router.engines.bridges)")
        return reasons

    def _layout_conflicts(self, st: InstanceState, lkey: Optional[str], old: Optional[Backend]) -> List[str]:
        """Incompatibilities between ``st``'s KV layout and registered counterparts (prefill -> decode pairs of a
        shared model; an instance without a model pairs with every model). Counterparts are grouped by (model,
        role, layout), so the work is one memoised :func:`layout_reasons` call per distinct layout pair, not per
        instance; a reason names one instance of the group and how many more share its layout."""
        if lkey is None:
            return []
        skip = {st.id} | ({old.state.id} if old is not None else set())
        if st.model:
            keys = [(m, r) for m in tuple(st.model) + ("",) for r in ROLES]
        else:
            keys = list(self._groups)
        reasons: List[str] = []
        seen = set()
        for m, orole in keys:
            g = self._groups.get((m, orole))
            if not g:
                continue
            fwd = st.role in ("prefill", "both") and orole in ("decode", "both") and (st.role, orole) != ("both", "both")
            back = st.role in ("decode", "both") and orole in ("prefill", "both") and (st.role, orole) != ("both", "both")
            if not (fwd or back):
                continue
            for ok, ids in g.items():
                n = len(ids) - sum(1 for i in skip if i in ids)
                if n <= 0:
                    continue
                rep = next(i for i in ids if i not in skip)
                more = f" (and {n - 1} more with the same layout)" if n > 1 else ""
                for src, dst, sname, dname in ((lkey, ok, st.id, rep + more), (ok, lkey, rep + more, st.id)) \
                        if fwd and back else (((lkey, ok, st.id, rep + more),) if fwd else ((ok, lkey, rep + more, st.id),)):
                    if (src, dst) in seen:
                        continue
                    seen.add((src, dst))
                    if self._pair_ok(src, dst):
                        continue
                    reasons += [f"{sname} -> {dname}: {r}" for r in
                                layout_reasons(self._layout_of(src, st), self._layout_of(dst, st), sname, dname)]
        return reasons

    def _layout_of(self, key: str, st: InstanceState) -> dict:
        return self._layouts.get(key) or st.kv_layout

    def _pair_ok(self, src: str, dst: str) -> bool:
        """Memoised compatibility of two canonical layout keys (one :func:`layout_reasons` call per pair)."""
        r = self._pair_cache.get((src, dst))
        if r is None:
            if len(self._pair_cache) >= 4096:
                self._pair_cache.clear()
            lay_src = self._layouts.get(src) or msgspec.json.decode(src)
            lay_dst = self._layouts.get(dst) or msgspec.json.decode(dst)
            r = self._pair_cache[(src, dst)] = not layout_reasons(lay_src, lay_dst, "prefill", "decode")
        return r

    def _drop(self, b: Backend) -> None:
        """Remove ``b`` entirely (its slot is freed; the list keeps the others' order)."""
        self._detach(b)
        st = b.state
        self.instances = [i for i in self.instances if i is not st]
        self._pos = {i.id: k for k, i in enumerate(self.instances)}
        heapq.heappush(self._free, st.slot)

    def remove(self, iid: str) -> bool:
        """Remove instance ``iid`` (its cache entries too); False if unknown."""
        b = self.backends.get(iid)
        if b is None:
            return False
        self._drop(b)
        self._changed()
        return True

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # ------------------------------------------------------------------ background work
    def start(self) -> None:
        """Start the health-check loop and the KV-event subscribers (in the running event loop)."""
        self._started = True
        self._task = asyncio.get_event_loop().create_task(self._health_loop())
        for b in self.backends.values():
            if b.state.kv_events and b.ev_task is None:
                self._subscribe(b)

    def stop(self) -> None:
        """Cancel background tasks and close idle connections."""
        if self._task is not None:
            self._task.cancel()
        for b in list(self.backends.values()):
            if b.ev_task:
                b.ev_task.cancel()
            b.pool.close()

    def _subscribe(self, b: Backend) -> None:
        st = b.state
        err = self.metrics.kv_event_error if self.metrics else None
        dec = kv_events.decode_fn(st.engine, self.hasher, st.block_size)
        b.ev_task = asyncio.get_event_loop().create_task(kv_events.subscribe(
            st.kv_events, self.index, lambda: st.slot, err, decoder=dec))

    async def _health_loop(self) -> None:
        """Every ``health_interval_s``: one health check per instance, at most :data:`HEALTH_CONCURRENCY` at a time
        (a fleet of 10,000 must not open 10,000 sockets at once and exhaust the router's file descriptors)."""
        sem = asyncio.Semaphore(HEALTH_CONCURRENCY)

        async def one(b: Backend) -> None:
            async with sem:
                await self.check(b)

        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            await asyncio.gather(*(one(b) for b in list(self.backends.values())), return_exceptions=True)

    async def check(self, b: Backend) -> None:
        """One health check of ``b`` (GET the engine's health path, ``health_timeout_s``)."""
        raw = build_request(b"GET", b.engine.HEALTH_PATH, b.hostport, b.auth, b"")
        try:
            c = await request(b.pool, raw, None, None, timeout=self.cfg.health_timeout_s)
            ok = c.status == 200
            if b"dlmix_router" in c.collected()[2]:  # a dlmix router's /health: requests sent there would loop
                rid = _router_id(c.collected()[2])
                b.loop = ("this router itself (same router id)" if rid == self.own_id
                          else f"another dlmix router (id {rid})")
                b.state.extra["_loop"] = b.loop
        except BackendError:
            ok = False
        if b.loop:
            ok = False
            b.hc_fails = self.cfg.health_failures
        if ok:
            b.hc_fails = 0
            b.hc_ok = True
        else:
            b.hc_fails += 1
            if b.hc_fails >= self.cfg.health_failures:
                b.hc_ok = False
        b.refresh(time.monotonic())

    def fail(self, b: Backend, ex: Optional[BaseException] = None) -> None:
        """A request to ``b`` failed: breaker bookkeeping; a refused connection takes it out of rotation at once."""
        b.fails += 1
        now = time.monotonic()
        if ex is not None and "cannot connect" in str(ex):
            b.hc_ok = False
            b.hc_fails = self.cfg.health_failures
        if b.fails >= self.cfg.breaker_failures:
            b.open_until = now + self.cfg.breaker_cooldown_s
        b.refresh(now)
        if self.metrics:
            self.metrics.backend_error(b)

    # ------------------------------------------------------------------ views
    @staticmethod
    def describe(i: InstanceState) -> dict:
        """JSON-able view of an instance (admin list): identity, health, load and calibration."""
        ld = i.load
        d = {"id": i.id, "url": i.url, "engine": i.engine, "role": i.role, "model": list(i.model),
             "cluster": i.cluster, "chip": i.chip, "num_chips": i.num_chips, "block_size": i.block_size,
             "healthy": i.healthy, "draining": i.draining, "loop": i.extra.get("_loop"), "slot": i.slot, "kv_events": i.kv_events,
             "transport": i.transport, "ttft_ratio": i.ttft_ratio, "itl_ratio": i.itl_ratio,
             "load": {"inflight": ld.inflight, "inflight_prefill_tokens": ld.inflight_prefill_tokens,
                      "inflight_decode": ld.inflight_decode, "waiting": ld.waiting, "running": ld.running,
                      "kv_usage": ld.kv_usage, "processed": ld.processed}}
        warning = i.extra.get("transport_warning")
        if warning:  # an unknown link name, priced as the default link: say so where the operator looks
            d["transport_warning"] = f"{warning}; priced as the default link"
        return d
