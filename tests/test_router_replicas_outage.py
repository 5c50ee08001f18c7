"""Router replicas (dlmix.router.shared) while etcd is unreachable, and their bookkeeping over many registrations.

In-process replicas over a real etcd (the Debian ``etcd-server`` binary, as in ``tests/test_router_replicas.py``)
and an in-process mock engine that answers health checks (so only the heartbeat decides whether it is in rotation).
"""
from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from dlmix.router.config import RouterConfig
from dlmix.testing import LoopThread, poll, wait_until
from tests.test_router_replicas import ETCD, Etcd

pytestmark = pytest.mark.skipif(ETCD is None, reason="etcd not installed (scripts/setup.sh installs etcd-server)")


@pytest.fixture()
def fleet(tmp_path):
    """(etcd, ``replica(**cfg)`` making in-process router replicas of one fleet, a live mock engine's url)."""
    from dlmix.testing import RouterThread
    from dlmix.testing.mock_engine import MockEngine

    etcd = Etcd(str(tmp_path / "etcd"))
    etcd.start()
    lt = LoopThread(use_uvloop=False)
    eng = MockEngine()
    url = lt.run(eng.start(), 30)
    prefix = f"/dlmix/outage-{os.getpid()}-{time.time_ns()}"
    made = []

    def replica(**kw):
        cfg = dict(port=0, policy="round_robin", etcd_endpoints=[etcd.url], etcd_prefix=prefix, **kw)
        r = RouterThread(RouterConfig(**cfg))
        made.append(r)
        return r

    try:
        yield etcd, replica, url
    finally:
        for r in made:
            r.close()
        lt.run(eng.stop(), 30)
        lt.close()
        etcd.stop()


def _healthy(r, iid: str) -> bool:
    return r.call(lambda: iid in r.router.registry.backends and r.router.registry.backends[iid].state.healthy)


def _connected(r) -> bool:
    return r.call(lambda: r.router.shared.connected)


def test_heartbeat_expiry_is_enforced_while_etcd_is_down_and_the_fleet_converges_after(fleet):
    """An instance whose heartbeats stop while etcd is unreachable leaves rotation on every replica after its TTL
    (timed locally: no lease can expire then); a heartbeat brings it back on the replica that received it; when etcd
    is back every replica follows the lease again. Before, a shared instance was timed only by its etcd lease, so
    with etcd down it stayed in rotation on every replica for as long as the outage lasted."""
    etcd, replica, url = fleet
    a, b = replica(health_interval_s=0.2), replica(health_interval_s=0.2)
    r = httpx.post(a.url + "/admin/instances", json={"url": url, "model": "mock", "heartbeat_ttl_s": 2}, timeout=10)
    assert r.status_code == 201, r.text
    iid = r.json()["id"]
    wait_until(lambda: _healthy(a, iid) and _healthy(b, iid), 20, "the instance in rotation on both replicas")
    etcd.stop()
    wait_until(lambda: not _connected(a) and not _connected(b), 20, "both replicas notice etcd is gone")
    # no heartbeat from now on: 2 s TTL, then out of rotation on both replicas (bounded wait)
    assert poll(lambda: not _healthy(a, iid) and not _healthy(b, iid), timeout_s=15, interval_s=0.1), \
        "an instance without heartbeats stayed in rotation while etcd was down"
    # a heartbeat counts on the replica that received it (only there: it cannot be shared now)
    assert httpx.post(a.url + f"/admin/instances/{iid}/heartbeat", json={}, timeout=10).status_code == 200
    assert _healthy(a, iid)
    assert not _healthy(b, iid)
    # etcd back: the engine heartbeats through replica a again; both replicas follow its lease
    stop = threading.Event()

    def beat():
        while not stop.is_set():
            try:
                httpx.post(a.url + f"/admin/instances/{iid}/heartbeat", json={}, timeout=5)
            except httpx.HTTPError:
                pass
            stop.wait(0.3)

    etcd.start()
    t = threading.Thread(target=beat)
    t.start()
    try:
        wait_until(lambda: _connected(a) and _connected(b), 30, "both replicas reconnect")
        wait_until(lambda: _healthy(a, iid) and _healthy(b, iid), 20, "the heartbeating instance back on both")
    finally:
        stop.set()
        t.join(30)
    # heartbeats stop again: the lease expires, both replicas take it out
    wait_until(lambda: not _healthy(a, iid) and not _healthy(b, iid), 20, "lease expiry on both replicas")


def test_a_registration_refused_while_etcd_is_down_is_not_half_applied(fleet):
    """A registration that cannot be written to etcd is refused (503) and applied nowhere, so there is nothing a
    replica accepted that the others could miss; the engine's client registers again (RouterClient retries any
    refusal), and once etcd is back that registration reaches every replica."""
    etcd, replica, url = fleet
    a, b = replica(health_interval_s=3600), replica(health_interval_s=3600)
    etcd.stop()
    wait_until(lambda: not _connected(a) and not _connected(b), 20, "both replicas notice etcd is gone")
    body = {"url": url, "model": "mock", "heartbeat_ttl_s": 0}
    r = httpx.post(a.url + "/admin/instances", json=body, timeout=10)
    assert r.status_code == 503, r.text
    assert a.call(lambda: sorted(a.router.registry.backends)) == []
    etcd.start()
    wait_until(lambda: _connected(a) and _connected(b), 30, "both replicas reconnect")
    assert a.call(lambda: sorted(a.router.registry.backends)) == [] == b.call(lambda: sorted(b.router.registry.backends))
    r = httpx.post(a.url + "/admin/instances", json=body, timeout=10)  # the client's retry
    assert r.status_code == 201, r.text
    wait_until(lambda: r.json()["id"] in b.call(lambda: list(b.router.registry.backends)), 20, "registration on b")


def test_bookkeeping_stays_bounded_over_many_registrations_and_removals(fleet):
    """Registering and removing instances under new ids (engines restarting on new addresses) leaves no per-key
    state behind on the replica that wrote it nor on one that followed it: before, each removal left a revision
    entry per key (``_keyrev``: four per id on the writer) for good."""
    etcd, replica, url = fleet
    a, b = replica(health_interval_s=3600), replica(health_interval_s=3600)
    n = 40
    for k in range(n):
        body = {"url": f"http://127.0.0.1:{20000 + k}", "id": f"i{k}", "model": "mock", "heartbeat_ttl_s": 2}
        assert httpx.post(a.url + "/admin/instances", json=body, timeout=10).status_code == 201
        assert httpx.post(a.url + f"/admin/instances/i{k}/drain", timeout=10).status_code == 200
        assert httpx.delete(a.url + f"/admin/instances/i{k}", timeout=10).status_code == 200
    # the store's revision now: that of the last removal, an event every replica's watch delivers
    rev = int(httpx.post(etcd.url + "/v3/kv/range", json={"key": "AA=="}, timeout=10).json()["header"]["revision"])
    sizes = {}
    for x, name in ((a, "writer"), (b, "follower")):
        wait_until(lambda: x.call(lambda: x.router.shared.revision) >= rev, 20, f"{name} caught up")
        sizes[name] = x.call(lambda: {k: len(getattr(x.router.shared, k)) for k in
                                      ("_keyrev", "_applied", "_ttl", "_alive", "_draining", "_calib")})
        assert x.call(lambda: len(x.router.registry.backends)) == 0
    assert all(v <= 4 for s in sizes.values() for v in s.values()), sizes


def test_a_replacement_whose_cleanup_failed_leaves_no_zombie_after_the_retry(fleet, monkeypatch):
    """The same url registered again under a new id replaces the old id, whose keys are deleted from etcd. When etcd
    is lost at that deletion the registration is refused (503) and the engine registers again; nothing of the old id
    may be left in etcd after that. Before, the new id's key was already written when the deletion failed, the retry
    found the new id registered and deleted nothing: the old id's key stayed in etcd, a replica started after the new
    id's removal brought the old id back, and no replica could remove it (404). Now the new key and the deletion are
    one etcd transaction."""
    from dlmix.router.shared import EtcdClient, EtcdError

    etcd, replica, url = fleet
    a = replica(health_interval_s=3600)
    body = {"url": url, "model": "mock", "heartbeat_ttl_s": 0}
    assert httpx.post(a.url + "/admin/instances", json={**body, "id": "old"}, timeout=10).status_code == 201
    orig = EtcdClient.call
    fail = {"n": 1}

    async def flaky_call(self, path, body):  # etcd lost when the replaced id's keys are deleted
        if path in ("/v3/kv/deleterange", "/v3/kv/txn") and fail["n"] > 0:
            fail["n"] -= 1
            raise EtcdError("etcd at test: unreachable (injected)")
        return await orig(self, path, body)

    monkeypatch.setattr(EtcdClient, "call", flaky_call)
    r = httpx.post(a.url + "/admin/instances", json={**body, "id": "new"}, timeout=10)
    assert r.status_code == 503, r.text
    assert fail["n"] == 0
    r = httpx.post(a.url + "/admin/instances", json={**body, "id": "new"}, timeout=10)  # the engine's retry
    assert r.status_code == 201, r.text
    assert httpx.delete(a.url + "/admin/instances/new", timeout=10).status_code == 200
    late = replica(health_interval_s=3600)
    assert late.call(lambda: sorted(late.router.registry.backends)) == [], "a late replica resurrected the old id"
