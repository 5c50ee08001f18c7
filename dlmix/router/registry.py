"""The router's instance registry: registration and validation, health checks, heartbeats and circuit breakers.

:class:`Registry` owns the list of :class:`~dlmix.routing.state.InstanceState` the policies see and, per instance, a
:class:`Backend` (connection pool, engine adapter, health/heartbeat/breaker state, KV-event subscriber task).

Health (what takes an instance out of rotation, :meth:`Backend.refresh`):

* health check: every ``health_interval_s`` the registry GETs the engine's health path; ``health_failures`` failures
  in a row (or one refused connection on a request) take the instance out, one success brings it back;
* heartbeat: an instance registered with ``heartbeat_ttl_s`` > 0 leaves rotation when no heartbeat arrived for that
  long and returns with the next one;
* breaker: ``breaker_failures`` consecutive request failures open it for ``breaker_cooldown_s`` seconds.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Dict, List, Optional
from urllib.parse import urlparse

from dlmix.errors import DlmixError
from dlmix.router import kv_events
from dlmix.router.engines import get_engine
from dlmix.router.proxy import BackendError, Pool, build_request, request
from dlmix.routing.state import ROLES, InstanceState

__all__ = ["Backend", "Registry", "RegistrationError", "layout_reasons"]


class RegistrationError(DlmixError):
    """Instance registration refused: ``status`` (400 bad field, 409 incompatible KV layout), message, ``reasons``
    (one line per incompatibility)."""

    def __init__(self, status: int, msg: str, reasons: Optional[List[str]] = None):
        super().__init__(msg)
        self.status = status
        self.reasons = reasons or []


class Backend:
    """Router-private side of one instance: connection pool, engine adapter, health, heartbeat and breaker state,
    metric children (``m``, set by :class:`~dlmix.router.metrics.Metrics`), KV-event task.

    Args:
        state: the instance as the policies see it. connect_timeout: seconds for a TCP connect.
        ttl: heartbeat TTL in seconds (0: no heartbeats expected).
    """

    __slots__ = ("state", "pool", "hostport", "auth", "engine", "hb_ttl", "last_hb", "hc_ok", "hc_fails", "fails",
                 "open_until", "ev_task", "m")

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
        self.m = None

    def refresh(self, now: float) -> None:
        """Recompute ``state.healthy`` from health check, heartbeat and breaker (``now``: ``time.monotonic()``)."""
        hb_ok = self.hb_ttl <= 0 or now - self.last_hb <= self.hb_ttl
        self.state.healthy = self.hc_ok and hb_ok and now >= self.open_until

    def heartbeat(self, body) -> None:
        """Apply a heartbeat body ``{"waiting": int, "running": int, "kv_usage": float}`` (all optional) and mark
        the instance alive. Raises ValueError/TypeError for a bad field (nothing is changed then)."""
        ld = self.state.load
        if isinstance(body, dict):
            w = int(body.get("waiting", ld.waiting))
            r = int(body.get("running", ld.running))
            k = float(body.get("kv_usage", ld.kv_usage))
            ld.waiting, ld.running, ld.kv_usage = w, r, k
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

    def __init__(self, cfg, catalog, index, approx, on_remove: Callable[[InstanceState], None], metrics=None):
        self.cfg = cfg
        self.catalog = catalog
        self.index = index
        self.approx = approx
        self.on_remove = on_remove
        self.metrics = metrics
        self.instances: List[InstanceState] = []
        self.backends: Dict[str, Backend] = {}
        self.on_change: Optional[Callable[[], None]] = None
        self._started = False
        self._task: Optional[asyncio.Task] = None

    # ------------------------------------------------------------------ registration
    def register(self, d: dict, ttl_default: Optional[float] = None) -> InstanceState:
        """Add or replace (same ``id`` or ``url``: keeps its slot, drops its cache entries) an instance from a
        registration mapping (fields in :mod:`dlmix.router.server`). Returns its state.

        Raises RegistrationError: 400 for a bad field, 409 when its KV layout cannot pair with a registered
        prefill/decode counterpart of the same model.
        """
        st = self._parse(d)
        reasons = self._layout_conflicts(st)
        if reasons:
            raise RegistrationError(409, f"KV layout of {st.id} is incompatible with registered instances", reasons)
        old = self.backends.get(st.id) or next((b for b in self.backends.values() if b.state.url == st.url), None)
        if old is not None:
            st.slot = old.state.slot
            self._drop(old)
        else:
            used = {i.slot for i in self.instances}
            st.slot = next(s for s in range(len(used) + 1) if s not in used)
        ttl = float(d.get("heartbeat_ttl_s", self.cfg.heartbeat_ttl_s if ttl_default is None else ttl_default))
        b = Backend(st, self.cfg.connect_timeout_s, ttl)
        self.backends[st.id] = b
        self.instances.append(st)
        if self.metrics:
            self.metrics.bind(b)
        if self._started and st.kv_events:
            self._subscribe(b)
        self._changed()
        return st

    def _parse(self, d: dict) -> InstanceState:
        url = d.get("url")
        if not isinstance(url, str):
            raise RegistrationError(400, "instance needs a url")
        url = url.rstrip("/")
        u = urlparse(url)
        try:
            port = u.port
        except ValueError:
            port = None
        if u.scheme != "http" or not u.hostname or not port:
            raise RegistrationError(400, f"instance url must be http://host:port, got {d.get('url')!r}")
        role = d.get("role", "both")
        if role not in ROLES:
            raise RegistrationError(400, f"role must be one of {ROLES}, got {role!r}")
        engine = d.get("engine", "vllm")
        try:
            get_engine(engine)
        except ValueError as ex:
            raise RegistrationError(400, str(ex)) from None
        try:
            chip = self.catalog.chip(d.get("chip", "cpu-x86")).name
        except KeyError as ex:
            raise RegistrationError(400, str(ex.args[0])) from None
        model = d.get("model") or ()
        model = (model,) if isinstance(model, str) else tuple(model)
        try:
            st = InstanceState(
                id=str(d.get("id") or url), url=url, engine=engine, role=role, model=model,
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
        if st.kv_events:
            try:
                kv_events.get_decoder(engine)
            except ValueError as ex:
                raise RegistrationError(400, str(ex)) from None
        return st

    def _layout_conflicts(self, st: InstanceState) -> List[str]:
        """Incompatibilities between ``st``'s KV layout and registered counterparts (prefill -> decode pairs of a
        shared model)."""
        if not st.kv_layout:
            return []
        reasons: List[str] = []
        for o in self.instances:
            if o.id == st.id or o.url == st.url or not o.kv_layout:
                continue
            if st.model and o.model and not set(st.model) & set(o.model):
                continue
            if st.role in ("prefill", "both") and o.role in ("decode", "both") and (st.role, o.role) != ("both", "both"):
                reasons += [f"{st.id} -> {o.id}: {r}" for r in layout_reasons(st.kv_layout, o.kv_layout, st.id, o.id)]
            if st.role in ("decode", "both") and o.role in ("prefill",) or (st.role == "decode" and o.role == "both"):
                reasons += [f"{o.id} -> {st.id}: {r}" for r in layout_reasons(o.kv_layout, st.kv_layout, o.id, st.id)]
        return reasons

    def _drop(self, b: Backend) -> None:
        st = b.state
        if b.ev_task is not None:
            b.ev_task.cancel()
        b.pool.close()
        self.backends.pop(st.id, None)
        self.instances = [i for i in self.instances if i is not st]
        self.index.clear(st.slot)
        self.approx.clear(st.slot)
        self.on_remove(st)

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
        b.ev_task = asyncio.get_event_loop().create_task(kv_events.subscribe(
            st.kv_events, self.index, lambda: st.slot, err, decoder=kv_events.get_decoder(st.engine)))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            await asyncio.gather(*(self.check(b) for b in list(self.backends.values())), return_exceptions=True)

    async def check(self, b: Backend) -> None:
        """One health check of ``b`` (GET the engine's health path, ``health_timeout_s``)."""
        raw = build_request(b"GET", b.engine.HEALTH_PATH, b.hostport, b.auth, b"")
        try:
            c = await request(b.pool, raw, None, None, timeout=self.cfg.health_timeout_s)
            ok = c.status == 200
        except BackendError:
            ok = False
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
        return {"id": i.id, "url": i.url, "engine": i.engine, "role": i.role, "model": list(i.model),
                "cluster": i.cluster, "chip": i.chip, "num_chips": i.num_chips, "block_size": i.block_size,
                "healthy": i.healthy, "draining": i.draining, "slot": i.slot, "kv_events": i.kv_events,
                "transport": i.transport, "ttft_ratio": i.ttft_ratio, "itl_ratio": i.itl_ratio,
                "load": {"inflight": ld.inflight, "inflight_prefill_tokens": ld.inflight_prefill_tokens,
                         "inflight_decode": ld.inflight_decode, "waiting": ld.waiting, "running": ld.running,
                         "kv_usage": ld.kv_usage, "processed": ld.processed}}
