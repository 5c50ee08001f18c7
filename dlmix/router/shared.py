"""Router replicas: the fleet's shared state in etcd, so any number of ``dlmix router`` processes serve one fleet.

Without ``etcd_endpoints`` a router keeps everything in its own memory (the default for one machine). With them,
what an operator or an engine tells one replica reaches every replica through etcd (the store Kubernetes and NVIDIA
Dynamo use for the same job), and a replica that starts late, or comes back, reads it all first.

Keys under ``etcd_prefix`` (default ``/dlmix/default``); values are JSON:

* ``instances/<id>``: the registration body as accepted (:class:`dlmix.pd.registration.Registration`: url, role,
  chip, model, KV layout, ...). Written by ``POST /admin/instances``, removed by ``DELETE /admin/instances/<id>``.
* ``alive/<id>``: the instance's last heartbeat load (``{"waiting", "running", "kv_usage"}``), attached to an etcd
  lease whose TTL is the instance's heartbeat TTL. Each heartbeat, on whichever replica it lands, renews the lease and,
  when the load changed, writes it, so every replica sees it. When heartbeats stop, etcd lets the lease expire and deletes the key:
  every replica takes the instance out of rotation (it stays registered and comes back with the next heartbeat,
  as on a single router).
* ``drain/<id>``: present while the instance is draining.
* ``calib/<id>``: the instance's online calibration (``{"ttft_ratio", "itl_ratio"}``: measured over predicted TTFT and
  ITL, :class:`~dlmix.routing.state.InstanceState`). Each replica refines it with the requests it serves and writes
  it back every ``calib_interval_s`` when it moved by more than 2 %; a replica applies what another wrote and goes
  on from there (the last writer wins), so a replica that starts late begins with the fleet's calibration.

Each replica applies what it reads (its own :class:`~dlmix.router.registry.Registry`: validation, health checks,
breakers and KV-event subscribers stay per replica) and follows changes with an etcd watch. When etcd cannot be
reached, replicas keep serving from their last view; registration, drain and removal are refused with ``503`` and the
reason, and heartbeats still count on the replica that received them: no lease can expire then, so each replica times
the heartbeats of an instance with a heartbeat TTL itself (the TTL counted from the last heartbeat it received, at the
earliest from the moment it lost etcd), as a single router does. When etcd is back, each replica reads the whole state
again, follows the leases again and resumes its watch.

The client speaks etcd's own v3 JSON gateway (``/v3/kv/range``, ``/v3/kv/put``, ``/v3/lease/grant``,
``/v3/watch``, ...; etcd docs "gRPC gateway") over httpx: no gRPC stack next to the engines. An endpoint that is not
loopback needs etcd authentication (``etcd_user``/``etcd_password``; https with ``etcd_ca``), or an explicit
``etcd_allow_open: true`` where the network admits only the routers (the Kubernetes manifests of ``dlmix launch --emit
k8s`` add a NetworkPolicy for that).
"""
from __future__ import annotations

import asyncio
import base64
import logging
import math
import time
from typing import AsyncIterator, Dict, List, Optional, Tuple
from urllib.parse import urlparse

import httpx
import msgspec

from dlmix.errors import ConfigError, DlmixError
from dlmix.net import is_loopback
from dlmix.router.admin import LocalState
from dlmix.router.registry import Backend, RegistrationError, Registry

__all__ = ["EtcdClient", "EtcdError", "SharedState", "Event"]

log = logging.getLogger("dlmix.router.shared")
_json = msgspec.json.Encoder(order="sorted")

#: etcd's smallest lease TTL (seconds; its server rounds shorter ones up)
MIN_LEASE_TTL_S = 2


class EtcdError(DlmixError):
    """etcd could not be reached or refused a call; the message says which endpoint and why."""


class Event(msgspec.Struct, frozen=True):
    """One change from a watch: ``kind`` ``"put"`` or ``"delete"``, the key (str), the value (bytes; empty for a
    delete), the id of the lease the key is attached to (0: none) and the store revision of the change."""

    kind: str
    key: str
    value: bytes = b""
    lease: int = 0
    revision: int = 0


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _prefix_end(prefix: str) -> str:
    """etcd's range end for "every key starting with ``prefix``": the prefix with its last byte incremented."""
    b = bytearray(prefix.encode())
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return _b64(bytes(b[:i + 1]))
    return _b64(b"\0")


def _kv(kv: dict) -> Tuple[str, bytes, int, int]:
    return (base64.b64decode(kv.get("key", "")).decode(), base64.b64decode(kv.get("value", "")),
            int(kv.get("lease", 0)), int(kv.get("mod_revision", 0)))


class EtcdClient:
    """Minimal async etcd v3 client over etcd's JSON gateway (httpx).

    Args:
        endpoints: client URLs (``http://127.0.0.1:2379``); calls go to the first that answers.
        timeout_s: connect/read timeout of one call in seconds (a watch has no read timeout).
        user, password: etcd authentication (required for a non-loopback endpoint).
        ca: CA bundle file for https endpoints (None: the system's).
        allow_open: accept a non-loopback endpoint without authentication (the network admits only the routers,
            e.g. a Kubernetes NetworkPolicy).
    Raises ConfigError for no endpoint, a bad URL, or a non-loopback endpoint without authentication.
    """

    def __init__(self, endpoints: List[str], timeout_s: float = 2.0, user: Optional[str] = None,
                 password: Optional[str] = None, ca: Optional[str] = None, allow_open: bool = False):
        if not endpoints:
            raise ConfigError("etcd_endpoints is empty")
        self.endpoints = []
        for e in endpoints:
            u = urlparse(e)
            if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
                raise ConfigError(f"etcd endpoint must be http(s)://host:port, got {e!r}")
            if not is_loopback(u.hostname) and not user and not allow_open:
                raise ConfigError(f"etcd endpoint {e} is not loopback: set etcd_user/etcd_password (etcd "
                                  "authentication) so the fleet's state does not travel unauthenticated, or "
                                  "etcd_allow_open: true when only the routers can reach it")
            self.endpoints.append(e.rstrip("/"))
        self.timeout_s = timeout_s
        self.user, self.password = user, password
        self._token: Optional[str] = None
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), verify=ca or True, trust_env=False)

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        await self._http.aclose()

    async def _auth(self, base: str) -> None:
        r = await self._http.post(base + "/v3/auth/authenticate", json={"name": self.user, "password": self.password})
        if r.status_code != 200:
            raise EtcdError(f"etcd at {base} refused authentication as {self.user!r}: {r.text[:200]}")
        self._token = r.json().get("token")

    def _headers(self) -> dict:
        return {"Authorization": self._token} if self._token else {}

    async def call(self, path: str, body: dict) -> dict:
        """POST ``body`` to ``path`` (e.g. ``/v3/kv/put``) on the first endpoint that answers; returns the JSON
        answer. Raises EtcdError with the endpoint and the reason."""
        last = "no endpoint"
        for base in self.endpoints:
            try:
                for attempt in (0, 1):
                    if self.user and self._token is None:
                        await self._auth(base)
                    r = await self._http.post(base + path, json=body, headers=self._headers())
                    if r.status_code == 401 and self.user and attempt == 0:
                        self._token = None  # expired token: authenticate again once
                        continue
                    break
            except httpx.HTTPError as ex:
                last = f"etcd at {base} unreachable: {type(ex).__name__}: {ex}"
                continue
            if r.status_code != 200:
                raise EtcdError(f"etcd at {base} answered {r.status_code} to {path}: {r.text[:200]}")
            return r.json()
        raise EtcdError(last)

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write ``key`` (attached to ``lease`` when non-zero). Returns the store revision. Raises EtcdError."""
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        r = await self.call("/v3/kv/put", body)
        return int(r.get("header", {}).get("revision", 0))

    async def delete(self, key: str, prefix: bool = False) -> int:
        """Delete ``key`` (every key under it with ``prefix``). Returns the store revision. Raises EtcdError."""
        body = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _prefix_end(key)
        r = await self.call("/v3/kv/deleterange", body)
        return int(r.get("header", {}).get("revision", 0))

    async def txn_prev(self, key: str, value: bytes, deletes: List[str]) -> Tuple[int, Optional[bytes]]:
        """Write ``key`` and delete every key of ``deletes`` in one etcd transaction (all or nothing, one store
        revision; etcd's ``/v3/kv/txn`` without a compare, the put asking for ``prev_kv``). Returns the store revision
        and the value ``key`` held just before this write (None: it did not exist), what :meth:`undo_if_unchanged`
        puts back. Raises EtcdError (then nothing was written, unless the answer alone was lost)."""
        ops = [{"request_put": {"key": _b64(key), "value": _b64(value), "prev_kv": True}}]
        ops += [{"request_delete_range": {"key": _b64(k)}} for k in deletes]
        r = await self.call("/v3/kv/txn", {"compare": [], "success": ops, "failure": []})
        prev = ((r.get("responses") or [{}])[0].get("response_put") or {}).get("prev_kv")
        return (int(r.get("header", {}).get("revision", 0)),
                None if prev is None else base64.b64decode(prev.get("value", "")))

    async def undo_if_unchanged(self, key: str, mod_revision: int, value: Optional[bytes]) -> int:
        """Put ``value`` back under ``key`` (delete ``key`` when ``value`` is None), but only while ``key`` was last
        written at store revision ``mod_revision``: an etcd transaction comparing the key's ``mod_revision``, so a
        later write by anyone else is never overwritten. Returns the store revision of the undo, 0 when ``key``
        had changed (nothing written). Raises EtcdError."""
        op = ({"request_delete_range": {"key": _b64(key)}} if value is None
              else {"request_put": {"key": _b64(key), "value": _b64(value)}})
        cmp = {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}
        r = await self.call("/v3/kv/txn", {"compare": [cmp], "success": [op], "failure": []})
        return int(r.get("header", {}).get("revision", 0)) if r.get("succeeded") else 0

    async def get_prefix(self, prefix: str) -> Tuple[int, List[Event]]:
        """Every key under ``prefix``: (store revision, events of kind ``"put"``). Raises EtcdError."""
        r = await self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        rev = int(r.get("header", {}).get("revision", 0))
        out = []
        for kv in r.get("kvs", []):
            k, v, lease, mrev = _kv(kv)
            out.append(Event("put", k, v, lease, mrev))
        return rev, out

    async def grant(self, ttl_s: float) -> int:
        """A new lease of ``ttl_s`` seconds (at least :data:`MIN_LEASE_TTL_S`, rounded up). Returns its id."""
        r = await self.call("/v3/lease/grant", {"TTL": max(MIN_LEASE_TTL_S, math.ceil(ttl_s))})
        return int(r["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew ``lease``; returns its TTL in seconds, 0 when it has expired (or never existed)."""
        r = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(r.get("result", {}).get("TTL", 0))

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[List[Event]]:
        """Changes under ``prefix`` from ``start_revision`` on, one list per etcd response. Ends (raises EtcdError)
        when the stream breaks or etcd cancels the watch (e.g. the revision was compacted)."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _prefix_end(prefix),
                                   "start_revision": str(start_revision)}}
        last = ""
        for base in self.endpoints:
            try:
                if self.user and self._token is None:
                    await self._auth(base)
                async with self._http.stream("POST", base + "/v3/watch", json=body, headers=self._headers(),
                                             timeout=httpx.Timeout(self.timeout_s, read=None)) as r:
                    if r.status_code != 200:
                        raise EtcdError(f"etcd at {base} answered {r.status_code} to a watch")
                    async for line in r.aiter_lines():
                        if not line.strip():
                            continue
                        msg = msgspec.json.decode(line)
                        if "error" in msg:
                            raise EtcdError(f"etcd watch error: {msg['error']}")
                        res = msg.get("result", {})
                        if res.get("canceled"):
                            raise EtcdError(f"etcd cancelled the watch: {res.get('cancel_reason', '')} "
                                            f"(compact revision {res.get('compact_revision', '?')})")
                        evs = []
                        for e in res.get("events", []):
                            k, v, lease, mrev = _kv(e.get("kv", {}))
                            evs.append(Event("delete" if e.get("type") == "DELETE" else "put", k, v, lease, mrev))
                        if evs:
                            yield evs
                raise EtcdError(f"etcd at {base} closed the watch stream")
            except (httpx.HTTPError, msgspec.DecodeError) as ex:
                last = f"etcd at {base}: watch failed: {type(ex).__name__}: {ex}"
        raise EtcdError(last or "watch ended")


class SharedState:
    """A router replica's link to the fleet's state in etcd (see the module docstring for the keys).

    Args:
        registry: this replica's registry; what is read from etcd is applied to it.
        client: an :class:`EtcdClient`. prefix: key prefix of this fleet (str, no trailing slash needed).
        ttl_default: heartbeat TTL in seconds for a registration that names none (the router's
            ``heartbeat_ttl_s``). retry_s: seconds between attempts to reach etcd again.
        calib_interval_s: seconds between two writes of the calibrations this replica refined.
        probe_s: seconds between two status probes of etcd while the watch is quiet.
    """

    def __init__(self, registry: Registry, client: EtcdClient, prefix: str = "/dlmix/default",
                 ttl_default: Optional[float] = None, retry_s: float = 0.5, calib_interval_s: float = 2.0,
                 probe_s: float = 2.0):
        self.registry = registry
        self._local = LocalState(registry)  # instances of this replica's own configuration stay local
        self.client = client
        self.prefix = prefix.rstrip("/") + "/"
        self.ttl_default = ttl_default
        self.retry_s = retry_s
        #: True while this replica's view follows etcd (the watch runs); False while etcd cannot be reached
        self.connected = False
        #: the last reason etcd could not be used ("" when connected)
        self.error = "not connected yet"
        self.revision = 0
        self._applied: Dict[str, bytes] = {}   # id -> registration body applied from etcd
        self._ttl: Dict[str, float] = {}       # id -> heartbeat TTL of its registration (s; 0: no lease)
        self._alive: Dict[str, Tuple[int, bytes]] = {}  # id -> (lease id, value) of its alive key
        self._draining: set = set()
        self._keyrev: Dict[str, int] = {}      # key -> store revision of the last change applied (put or delete)
        #: key -> revision of a delete this replica applied ahead of its watch; its _keyrev entry is dropped once the
        #: watch has passed that revision (no older change can arrive then), so removed keys leave nothing behind
        self._tomb: Dict[str, int] = {}
        self._calib: Dict[str, Tuple[float, float]] = {}  # id -> (ttft_ratio, itl_ratio) last written or applied
        self.calib_interval_s = calib_interval_s
        self.probe_s = probe_s
        self._task: Optional[asyncio.Task] = None
        self._bg: set = set()
        self._synced = asyncio.Event()
        self._advanced = asyncio.Event()  # set (and replaced) each time the follower applied more of the store

    # ------------------------------------------------------------------ keys
    def _key(self, kind: str, iid: str) -> str:
        return f"{self.prefix}{kind}/{iid}"

    def _split(self, key: str) -> Tuple[str, str]:
        rest = key[len(self.prefix):]
        kind, _, iid = rest.partition("/")
        return kind, iid

    # ------------------------------------------------------------------ lifecycle
    async def start(self, wait_s: float = 2.0) -> None:
        """Start following etcd; waits up to ``wait_s`` seconds for the first full read (a replica that cannot reach
        etcd yet starts anyway, with the instances of its own configuration, and catches up when etcd answers)."""
        self._task = asyncio.get_event_loop().create_task(self._follow())
        self._spawn(self._calibrations())
        try:
            await asyncio.wait_for(self._synced.wait(), wait_s)
        except asyncio.TimeoutError:
            log.warning("router replica: etcd not reached within %.1f s (%s); serving without the shared state "
                        "until it answers", wait_s, self.error)

    async def stop(self) -> None:
        """Stop following etcd and close the client."""
        for t in [self._task, *self._bg]:
            if t is not None:
                t.cancel()
        await self.client.aclose()

    def _spawn(self, coro) -> None:
        t = asyncio.get_event_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    # ------------------------------------------------------------------ following etcd
    async def _follow(self) -> None:
        while True:
            try:
                rev, kvs = await self.client.get_prefix(self.prefix)
                self._resync(kvs, rev)
                self.revision = rev
                self._wake()
                self._leases_again()
                self.connected, self.error = True, ""
                self._synced.set()
                await self._watch(rev + 1)
            except asyncio.CancelledError:
                raise
            except EtcdError as ex:
                if self.connected or self.error != str(ex):
                    log.warning("router replica: lost etcd (%s); serving from the last view", ex)
                self._disconnected(str(ex))
            except Exception as ex:  # a bug must not end the follower: log, retry
                log.exception("router replica: shared-state follower failed")
                self._disconnected(f"internal error: {ex!r}")
            await asyncio.sleep(self.retry_s)

    async def _watch(self, start: int) -> None:
        """Apply the watch's changes from revision ``start`` on. Meanwhile etcd is asked for its status every
        ``probe_s`` seconds: a watch stream over a dead link would wait for ever, so a failed probe ends the watch
        (EtcdError) and this replica counts as disconnected."""

        async def consume():
            async for evs in self.client.watch(self.prefix, start):
                for e in sorted(evs, key=self._order):
                    self._apply(e)
                    self.revision = max(self.revision, e.revision)
                self._wake()

        w = asyncio.ensure_future(consume())
        try:
            while True:
                done, _ = await asyncio.wait({w}, timeout=self.probe_s)
                if done:
                    w.result()  # raises what ended the watch
                    return
                await self.client.call("/v3/maintenance/status", {})
        finally:
            w.cancel()

    def _disconnected(self, why: str) -> None:
        """This replica lost etcd (``why``): no lease can expire for it now, so from here on each shared instance with
        a heartbeat TTL is timed by the heartbeats this replica receives (:meth:`Backend.refresh`), its TTL counted at
        the earliest from now; one out of rotation stays out until such a heartbeat."""
        was, self.connected, self.error = self.connected, False, why
        if not was:
            return
        now = time.monotonic()
        for iid, ttl, b in self._heartbeat_backends():
            b.hb_ttl = ttl
            b.last_hb = max(b.last_hb, now)
            b.refresh(now)

    def _heartbeat_backends(self):
        """``(id, heartbeat TTL in s, Backend)`` of each shared instance registered with a heartbeat TTL."""
        for iid, ttl in self._ttl.items():
            b = self.registry.backends.get(iid)
            if b is not None and ttl > 0:
                yield iid, ttl, b

    def _leases_again(self) -> None:
        """etcd answers again and the store was read: each shared instance with a heartbeat TTL is timed by its lease
        again (in rotation while its alive key exists), on every replica alike."""
        now = time.monotonic()
        for iid, ttl, b in self._heartbeat_backends():
            b.hb_ttl = 0.0
            b.lease_ok = iid in self._alive
            b.refresh(now)

    def _wake(self) -> None:
        ev, self._advanced = self._advanced, asyncio.Event()
        ev.set()
        if self._tomb:  # the follower is at self.revision: no change older than that can arrive any more
            for k, r in list(self._tomb.items()):
                if r <= self.revision:
                    del self._tomb[k]
                    if self._keyrev.get(k) == r:
                        del self._keyrev[k]

    async def _until_applied(self, rev: int) -> None:
        """Wait (at most the etcd call timeout) until the follower applied the store up to revision ``rev``: a
        change another replica wrote before this replica's own write at ``rev`` is then applied before it, in the
        order every other replica applies them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.client.timeout_s
        while self.revision < rev and self.connected:
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._advanced.wait(), left)
            except asyncio.TimeoutError:
                return

    def _order(self, e: Event) -> tuple:
        kind, _ = self._split(e.key)
        return (e.revision, {"instances": 0, "alive": 1, "drain": 2, "calib": 3}.get(kind, 4))

    async def _calibrations(self) -> None:
        """Every ``calib_interval_s``: write the calibrations of shared instances that moved by more than 2 %."""
        while True:
            await asyncio.sleep(self.calib_interval_s)
            if not self.connected:
                continue
            for iid in list(self._applied):
                b = self.registry.backends.get(iid)
                if b is None:
                    continue
                now = (b.state.ttft_ratio, b.state.itl_ratio)
                last = self._calib.get(iid, (1.0, 1.0))
                if all(abs(x - y) <= 0.02 * max(y, 1e-6) for x, y in zip(now, last)):
                    continue
                value = _json.encode({"ttft_ratio": now[0], "itl_ratio": now[1]})
                try:
                    rev = await self.client.put(self._key("calib", iid), value)
                except EtcdError as ex:
                    log.info("router replica: calibration of %s not shared: %s", iid, ex)
                    break
                self._calib[iid] = now
                self._keyrev[self._key("calib", iid)] = rev

    def _resync(self, kvs: List[Event], rev: int) -> None:
        """Make this replica's view equal to a full read of the prefix at store revision ``rev`` (instances gone from
        etcd are removed)."""
        present = {"instances": set(), "alive": set(), "drain": set(), "calib": set()}
        for e in sorted(kvs, key=self._order):
            kind, iid = self._split(e.key)
            if kind in present:
                present[kind].add(iid)
            self._apply(e)
        for iid in list(self._applied):
            if iid not in present["instances"]:
                self._apply(Event("delete", self._key("instances", iid), b"", 0, rev))
        for iid, ttl in list(self._ttl.items()):
            if ttl > 0 and iid not in present["alive"]:
                self._apply(Event("delete", self._key("alive", iid), b"", 0, rev))
        for iid in list(self._draining):
            if iid not in present["drain"]:
                self._apply(Event("delete", self._key("drain", iid), b"", 0, rev))
        for iid in list(self._calib):
            if iid not in present["calib"]:
                self._apply(Event("delete", self._key("calib", iid), b"", 0, rev))

    def _apply(self, e: Event) -> None:
        """Apply one change to this replica's registry (a bad value is logged and skipped). A change older than the
        last one applied to the same key (a watch event behind this replica's own write) is ignored."""
        if e.revision:
            if e.revision <= self._keyrev.get(e.key, 0):
                return
            self._keyrev[e.key] = e.revision
            if e.kind == "delete":
                self._tomb[e.key] = e.revision
            else:
                self._tomb.pop(e.key, None)
        kind, iid = self._split(e.key)
        reg = self.registry
        if kind == "instances":
            if e.kind == "delete":
                self._ttl.pop(iid, None)
                self._alive.pop(iid, None)
                if self._applied.pop(iid, None) is not None:  # an instance of this replica's own configuration stays
                    reg.remove(iid)
                return
            if self._applied.get(iid) == e.value and iid in reg.backends:
                return
            try:
                st = reg.register(msgspec.json.decode(e.value), self.ttl_default)
            except (RegistrationError, msgspec.DecodeError) as ex:
                log.warning("router replica: cannot apply the shared registration of %s: %s", iid, ex)
                return
            b = reg.backends[st.id]
            self._ttl[st.id] = b.hb_ttl
            b.hb_ttl = 0.0  # the lease in etcd times the heartbeats of a shared instance, on every replica
            b.lease_ok = self._ttl[st.id] <= 0 or st.id in self._alive
            b.state.draining = st.id in self._draining
            if st.id in self._calib:
                b.state.ttft_ratio, b.state.itl_ratio = self._calib[st.id]
            b.refresh(time.monotonic())
            self._applied[st.id] = e.value
            return
        b = reg.backends.get(iid)
        if kind == "alive":
            if e.kind == "delete":
                self._alive.pop(iid, None)
                if b is not None and self._ttl.get(iid, 0) > 0:
                    b.lease_ok = False
                    b.refresh(time.monotonic())
                return
            self._alive[iid] = (e.lease, e.value)
            if b is not None:
                b.lease_ok = True
                try:
                    b.heartbeat(msgspec.json.decode(e.value) or None)
                except (ValueError, msgspec.DecodeError) as ex:
                    log.warning("router replica: bad shared heartbeat of %s: %s", iid, ex)
                    b.refresh(time.monotonic())
        elif kind == "calib":
            if e.kind == "delete":
                self._calib.pop(iid, None)
                return
            try:
                c = msgspec.json.decode(e.value, type=Dict[str, float])
                ratios = (float(c["ttft_ratio"]), float(c["itl_ratio"]))
                if not all(0.0 < r < 1e6 for r in ratios):
                    raise ValueError(f"ratios out of range: {ratios}")
            except (msgspec.DecodeError, msgspec.ValidationError, KeyError, ValueError) as ex:
                log.warning("router replica: bad shared calibration of %s: %s", iid, ex)
                return
            self._calib[iid] = ratios
            if b is not None:
                b.state.ttft_ratio, b.state.itl_ratio = ratios
        elif kind == "drain":
            if e.kind == "delete":
                self._draining.discard(iid)
            else:
                self._draining.add(iid)
            if b is not None:
                b.state.draining = e.kind != "delete"

    # ------------------------------------------------------------------ admin API (awaited by the handlers)
    def _refuse(self, what: str, ex: Optional[BaseException] = None) -> Tuple[int, dict]:
        why = str(ex) if ex is not None else self.error
        return 503, {"error": f"{what} refused: the shared state store (etcd) is unavailable ({why}); this "
                              "router keeps serving the instances it knows; retry later"}

    async def register(self, body: dict) -> Tuple[int, dict]:
        """``POST /admin/instances``: validate here, write to etcd, apply here. Returns (status, JSON body): 201,
        400/409 for a refused body (with ``reasons``), 503 while etcd is unavailable."""
        reg = self.registry
        try:
            st, ttl, _, old = reg.validate(body, self.ttl_default)
        except RegistrationError as ex:
            return ex.status, {"error": str(ex), "reasons": ex.reasons}
        if not self.connected:
            return self._refuse("registration")
        value = _json.encode(body)
        # the same url under another id replaces that instance: its keys go too, in the same transaction as the new
        # key (a failure in between would leave them in etcd for good: a replica that reads the store later would
        # bring the replaced id back, and no one could remove it any more)
        gone = old.state.id if old is not None and old.state.id != st.id and old.state.id in self._applied else None
        stale = [self._key(kind, gone) for kind in ("instances", "alive", "drain", "calib")] if gone else []
        key = self._key("instances", st.id)
        written = None
        try:
            # ``before``: what the store held under the key just before this write (not what this replica had applied:
            # another replica may have written the key since), the value a refused write is undone to
            rev, before = await self.client.txn_prev(key, value, stale)
            written = (rev, before)
            await self._until_applied(rev)  # older changes first (no-op below when the watch applied it)
            self._apply(Event("put", key, value, 0, rev))
            for k in stale:
                self._apply(Event("delete", k, b"", 0, rev))
            if self._applied.get(st.id) != value:
                return await self._refused_after_write(body, st.id, key, rev, before)
            if ttl > 0:
                lease = await self.client.grant(ttl)
                rev = await self.client.put(self._key("alive", st.id), b"{}", lease)
                self._apply(Event("put", self._key("alive", st.id), b"{}", lease, rev))
        except EtcdError as ex:
            if written is not None:  # the registration is in the store but its lease is not: the client is told
                await self._undo_write(st.id, key, *written)  # "refused", so take the write back out
            return self._refuse("registration", ex)
        if st.id not in reg.backends:  # another change won meanwhile (e.g. a removal by another replica)
            return 409, {"error": f"{st.id} was changed by another router replica meanwhile; retry", "reasons": []}
        return 201, {"id": st.id, "slot": reg.backends[st.id].state.slot}

    async def _undo_write(self, iid: str, key: str, rev: int, before: Optional[bytes]) -> None:
        """Take the registration written at ``rev`` back out of etcd (unless someone changed ``key`` since) after a
        later step of the same registration failed (its lease grant), and apply that here: before, the instance
        stayed registered on every replica, for good (no lease), while its client got 503 "registration refused"."""
        try:
            undone = await self.client.undo_if_unchanged(key, rev, before)
        except EtcdError as ex:
            log.warning("router replica: could not undo the failed registration of %s: %s", iid, ex)
            return
        if undone:
            self._apply(Event("delete", key, b"", 0, undone) if before is None else Event("put", key, before, 0, undone))

    async def _refused_after_write(self, body: dict, iid: str, key: str, rev: int,
                                   before: Optional[bytes]) -> Tuple[int, dict]:
        """The registration written at revision ``rev`` was not applied: a change another replica wrote just before
        it made it incompatible (every replica refuses it alike, applying changes in store order), or a later change
        replaced it. Undo the write in etcd unless someone changed ``key`` since (``before``: the value the store held
        just before the write, None when the key did not exist), so the store never keeps a registration its client
        was told was refused (a replica reading the store later would apply it). Returns (409, body with the reasons)."""
        try:
            undone = await self.client.undo_if_unchanged(key, rev, before)
        except EtcdError as ex:
            log.warning("router replica: could not undo the refused registration of %s: %s", iid, ex)
            undone = 0
        if undone:
            self._apply(Event("delete", key, b"", 0, undone) if before is None else Event("put", key, before, 0, undone))
        try:
            self.registry.validate(body, self.ttl_default)
        except RegistrationError as ex:
            return ex.status, {"error": f"{ex} (registered through another router replica meanwhile)",
                               "reasons": ex.reasons}
        return 409, {"error": f"{iid} was changed by another router replica meanwhile; retry", "reasons": []}

    def heartbeat(self, b: Backend, body) -> None:
        """``POST /admin/instances/<id>/heartbeat``: counts here at once (raises ValueError for a bad body, like
        :meth:`Backend.heartbeat`); renewing the lease and sharing the load with the other replicas runs in the
        background (while etcd is unavailable only this replica sees it)."""
        b.heartbeat(body)
        iid = b.state.id
        if iid in self._applied and self._ttl.get(iid, 0) > 0:
            if not self.connected and not b.lease_ok:  # no lease to follow now: the heartbeat brings it back here
                b.lease_ok = True
                b.refresh(b.last_hb)
            self._spawn(self._publish_alive(iid, body or {}))

    async def _publish_alive(self, iid: str, body: dict) -> None:
        try:
            value = _json.encode(body)
            lease, last = self._alive.get(iid, (0, b""))
            if lease and await self.client.keepalive(lease) > 0:
                if last == value:
                    return  # lease renewed, load unchanged: one etcd call for this heartbeat
            else:
                lease = await self.client.grant(self._ttl.get(iid) or MIN_LEASE_TTL_S)
            rev = await self.client.put(self._key("alive", iid), value, lease)
            self._apply(Event("put", self._key("alive", iid), value, lease, rev))
        except EtcdError as ex:
            log.info("router replica: heartbeat of %s not shared: %s", iid, ex)

    async def drain(self, b: Backend, on: bool) -> Tuple[int, dict]:
        """``POST .../drain`` and ``.../undrain`` for every replica. 503 while etcd is unavailable."""
        iid = b.state.id
        if iid not in self._applied:  # an instance of this replica's own configuration: local only
            return self._local.drain(b, on)
        if not self.connected:
            return self._refuse("drain" if on else "undrain")
        try:
            if on:
                rev = await self.client.put(self._key("drain", iid), b"1")
            else:
                rev = await self.client.delete(self._key("drain", iid))
        except EtcdError as ex:
            return self._refuse("drain" if on else "undrain", ex)
        self._apply(Event("put" if on else "delete", self._key("drain", iid), b"1" if on else b"", 0, rev))
        return 200, {"draining": on}

    async def delete(self, b: Backend) -> Tuple[int, dict]:
        """``DELETE /admin/instances/<id>`` on every replica. 503 while etcd is unavailable."""
        iid = b.state.id
        if iid not in self._applied:
            return self._local.delete(b)
        if not self.connected:
            return self._refuse("removal")
        try:
            for kind in ("alive", "drain", "calib", "instances"):
                rev = await self.client.delete(self._key(kind, iid))
                self._apply(Event("delete", self._key(kind, iid), b"", 0, rev))
        except EtcdError as ex:
            return self._refuse("removal", ex)
        return 200, {"removed": True}

    def describe(self) -> dict:
        """JSON-able state of the link (``"shared"`` in the admin list)."""
        return {"etcd": self.client.endpoints, "prefix": self.prefix, "connected": self.connected,
                "revision": self.revision, **({"error": self.error} if self.error else {})}

