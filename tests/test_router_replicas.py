"""Router replicas over a real etcd (dlmix.router.shared): three ``dlmix router`` processes serve one fleet of mock
engines; registration, heartbeat leases, drain and removal reach every replica; a killed replica loses only its own
requests; with etcd stopped the replicas keep serving and refuse registration with the reason, and recover when it is
back. etcd is the Debian ``etcd-server`` binary that ``scripts/setup.sh`` installs; each test starts its own."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from dlmix.errors import ConfigError
from dlmix.router.config import RouterConfig
from dlmix.router.shared import EtcdClient
from dlmix.testing import free_port, poll, wait_http, wait_until

ETCD = shutil.which("etcd")
needs_etcd = pytest.mark.skipif(ETCD is None, reason="etcd not installed (scripts/setup.sh installs etcd-server)")


class Etcd:
    """One etcd member on loopback ports with its data in ``data``; ``start()``/``stop()`` by process id."""

    def __init__(self, data: str):
        self.data = data
        self.port, self.peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [ETCD, "--name", "t", "--data-dir", self.data, "--listen-client-urls", self.url,
             "--advertise-client-urls", self.url, "--listen-peer-urls", f"http://127.0.0.1:{self.peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer}",
             "--initial-cluster", f"t=http://127.0.0.1:{self.peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_http(self.url + "/health", timeout=60), "etcd did not start"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)


class Replica:
    """A ``dlmix router`` process in replica mode (stopped by process id)."""

    def __init__(self, etcd_url: str, prefix: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dlmix.cli", "router", "--port", str(self.port), "--policy", "round_robin",
             "--etcd", etcd_url, "--etcd-prefix", prefix, "--health-interval-s", "0.5", "--heartbeat-ttl-s", "2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def ready(self) -> None:
        assert wait_http(self.url + "/admin/instances", timeout=60), "router replica did not start"

    def instances(self) -> dict:
        return {i["id"]: i for i in httpx.get(self.url + "/admin/instances", timeout=10).json()["instances"]}

    def shared(self) -> dict:
        return httpx.get(self.url + "/admin/instances", timeout=10).json()["shared"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture()
def fleet(tmp_path):
    """etcd, two mock engines (one process) and three router replicas."""
    etcd = Etcd(str(tmp_path / "etcd"))
    etcd.start()
    ports = [free_port(), free_port()]
    eng = subprocess.Popen([sys.executable, "-m", "dlmix.testing.mock_engine", "--ports", ",".join(map(str, ports)),
                            "--ttft-ms", "5", "--itl-ms", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prefix = f"/dlmix/test-{os.getpid()}-{time.time_ns()}"
    reps = [Replica(etcd.url, prefix) for _ in range(3)]
    try:
        for p in ports:
            assert wait_http(f"http://127.0.0.1:{p}/health", timeout=60)
        for r in reps:
            r.ready()
        yield etcd, [f"http://127.0.0.1:{p}" for p in ports], reps
    finally:
        for r in reps:
            r.kill()
        os.kill(eng.pid, signal.SIGKILL)
        eng.wait(30)
        etcd.stop()


def _register(rep: Replica, url: str, **kw) -> httpx.Response:
    return httpx.post(rep.url + "/admin/instances", json={"url": url, "role": "both", "model": "mock", **kw},
                      timeout=30)


def _complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "mock", "prompt": "hello", "max_tokens": 4}, timeout=30)


@needs_etcd
def test_registration_drain_and_removal_reach_every_replica(fleet):
    etcd, engines, reps = fleet
    t0 = time.monotonic()
    r = _register(reps[0], engines[0], heartbeat_ttl_s=0)
    assert r.status_code == 201, r.text
    iid = r.json()["id"]
    assert poll(lambda: all(iid in x.instances() for x in reps), timeout_s=30, interval_s=0.01)
    seen_s = time.monotonic() - t0
    print(f"registration seen by 3 replicas after {seen_s * 1000:.0f} ms")
    assert seen_s < 1.0, f"registration reached every replica only after {seen_s:.2f} s"
    # every replica serves it
    for x in reps:
        out = _complete(x.url)
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["text"]
    # drain through one replica, seen by all; undrain through another
    assert httpx.post(reps[1].url + f"/admin/instances/{iid}/drain", timeout=10).json() == {"draining": True}
    wait_until(lambda: all(x.instances()[iid]["draining"] for x in reps), 30, "drain on every replica")
    assert httpx.post(reps[2].url + f"/admin/instances/{iid}/undrain", timeout=10).json() == {"draining": False}
    wait_until(lambda: not any(x.instances()[iid]["draining"] for x in reps), 30, "undrain on every replica")
    # a replica started now catches up before it answers
    late = Replica(etcd.url, reps[0].shared()["prefix"].rstrip("/"))
    try:
        late.ready()
        assert iid in late.instances()
        assert late.shared()["connected"] is True
        assert _complete(late.url).status_code == 200
    finally:
        late.kill()
    # removal through one replica leaves every replica
    assert httpx.delete(reps[2].url + f"/admin/instances/{iid}", timeout=10).status_code == 200
    wait_until(lambda: not any(iid in x.instances() for x in reps), 30, "removal on every replica")
    assert _complete(reps[0].url).status_code == 503


@needs_etcd
def test_an_engine_registering_itself_through_one_replica_is_served_by_all(fleet):
    """The engines' own client (:class:`dlmix.pd.router_client.RouterClient`, used by the vLLM connector and the
    SGLang hook) registers through one replica and heartbeats its load; every replica serves and sees it."""
    from dlmix.pd.router_client import RouterClient

    etcd, engines, reps = fleet
    load = {"waiting": 0, "running": 0, "kv_usage": 0.0}
    rc = RouterClient(reps[1].url, lambda: {"url": engines[0], "role": "both", "model": "mock",
                                            "heartbeat_ttl_s": 2.0}, lambda: dict(load), heartbeat_s=0.3,
                      first_wait_s=0)
    rc.start()
    try:
        assert rc.registered.wait(30), rc.last_error
        wait_until(lambda: all(rc.instance_id in x.instances() for x in reps), 30, "the engine on every replica")
        load.update(waiting=5, running=3, kv_usage=0.25)
        wait_until(lambda: all(x.instances()[rc.instance_id]["load"]["waiting"] == 5
                               and x.instances()[rc.instance_id]["load"]["kv_usage"] == 0.25 for x in reps), 30,
                   "the engine's heartbeat load on every replica")
        time.sleep(3)  # longer than the 2 s lease: heartbeats keep it alive everywhere
        assert all(x.instances()[rc.instance_id]["healthy"] for x in reps)
        for x in reps:
            assert _complete(x.url).status_code == 200
    finally:
        rc.stop()
    wait_until(lambda: not any(x.instances()[rc.instance_id]["healthy"] for x in reps), 30,
               "the stopped engine's lease expiring on every replica")


@needs_etcd
def test_expired_heartbeat_lease_takes_the_instance_out_on_every_replica(fleet):
    etcd, engines, reps = fleet
    a = _register(reps[0], engines[0], heartbeat_ttl_s=2).json()["id"]
    b = _register(reps[1], engines[1], heartbeat_ttl_s=0).json()["id"]
    wait_until(lambda: all({a, b} <= set(x.instances()) for x in reps), 30, "both instances on every replica")
    # a heartbeat through one replica carries its load to every replica
    hb = httpx.post(reps[2].url + f"/admin/instances/{a}/heartbeat", json={"waiting": 7, "running": 2}, timeout=10)
    assert hb.status_code == 200, hb.text
    wait_until(lambda: all(x.instances()[a]["load"]["waiting"] == 7 and x.instances()[a]["load"]["running"] == 2
                           for x in reps), 30, "the heartbeat's load on every replica")
    # no more heartbeats: etcd expires the lease (2 s), every replica takes the instance out of rotation
    wait_until(lambda: not any(x.instances()[a]["healthy"] for x in reps), 30, "lease expiry on every replica")
    assert all(x.instances()[b]["healthy"] for x in reps)
    served = {}
    for x in reps:
        for _ in range(4):
            out = _complete(x.url)
            assert out.status_code == 200, out.text
    for x in reps:  # only the healthy instance served them: the expired one processed none, on every replica
        served[x.url] = x.instances()[a]["load"]["processed"]
    assert all(n == 0 for n in served.values()), served
    # the next heartbeat, to any replica, brings it back everywhere
    assert httpx.post(reps[0].url + f"/admin/instances/{a}/heartbeat", json={}, timeout=10).status_code == 200
    wait_until(lambda: all(x.instances()[a]["healthy"] for x in reps), 30, "instance back on every replica")


@needs_etcd
def test_a_killed_replica_loses_only_its_own_requests(fleet):
    etcd, engines, reps = fleet
    for e in engines:
        assert _register(reps[0], e, heartbeat_ttl_s=0).status_code == 201
    wait_until(lambda: all(len(x.instances()) == 2 for x in reps), 30, "both instances on every replica")
    results = {"ok": 0, "retried": 0, "failed_after_kill": [], "wrong": 0}
    killed = threading.Event()
    stop = threading.Event()

    def client(k: int) -> None:  # round robin over the replicas, retry through the next one on a failure
        i = k
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                for attempt in range(3):
                    rep = reps[(i + attempt) % 3]
                    try:
                        out = c.post(rep.url + "/v1/completions",
                                     json={"model": "mock", "prompt": "hello", "max_tokens": 4})
                    except httpx.HTTPError as ex:
                        if killed.is_set() and rep is not reps[0]:
                            results["failed_after_kill"].append(f"{rep.url}: {ex!r}")
                        results["retried"] += 1
                        continue
                    if out.status_code != 200:
                        if killed.is_set() and rep is not reps[0]:
                            results["failed_after_kill"].append(f"{rep.url}: {out.status_code} {out.text[:100]}")
                        results["retried"] += 1
                        continue
                    if not out.json()["choices"][0]["text"]:
                        results["wrong"] += 1
                    results["ok"] += 1
                    break
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    before = results["ok"]
    reps[0].kill()  # SIGKILL mid-load
    killed.set()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(60)
    assert before > 0 and results["ok"] > before, results
    assert results["wrong"] == 0
    assert results["failed_after_kill"] == [], results["failed_after_kill"][:5]
    # the survivors still hold the whole fleet
    for x in reps[1:]:
        assert len(x.instances()) == 2
        assert _complete(x.url).status_code == 200


@needs_etcd
def test_replicas_keep_serving_without_etcd_and_recover(fleet):
    etcd, engines, reps = fleet
    a = _register(reps[0], engines[0], heartbeat_ttl_s=30).json()["id"]
    wait_until(lambda: all(a in x.instances() for x in reps), 30, "registration on every replica")
    etcd.stop()
    wait_until(lambda: not any(x.shared()["connected"] for x in reps), 30, "replicas notice etcd is gone")
    for x in reps:  # serving continues from the last view
        for _ in range(3):
            out = _complete(x.url)
            assert out.status_code == 200, out.text
    r = _register(reps[1], engines[1], heartbeat_ttl_s=0)
    assert r.status_code == 503
    assert "etcd" in r.json()["error"]["message"] and "unavailable" in r.json()["error"]["message"]
    assert engines[1] not in reps[1].instances()
    # a heartbeat still counts on the replica that got it
    assert httpx.post(reps[2].url + f"/admin/instances/{a}/heartbeat", json={"waiting": 1},
                      timeout=10).status_code == 200
    # etcd back (same data): replicas reconnect, registration works and reaches every replica
    etcd.start()
    wait_until(lambda: all(x.shared()["connected"] for x in reps), 60, "replicas reconnect to etcd")
    r = _register(reps[1], engines[1], heartbeat_ttl_s=0)
    assert r.status_code == 201, r.text
    wait_until(lambda: all(len(x.instances()) == 2 for x in reps), 30, "the new registration on every replica")
    assert all(x.instances()[a]["healthy"] for x in reps)


@needs_etcd
def test_a_frozen_etcd_is_noticed_and_serving_goes_on(fleet):
    """etcd stopped with SIGSTOP keeps its sockets open (a dead link, no FIN): the replicas' status probes notice."""
    etcd, engines, reps = fleet
    a = _register(reps[0], engines[0], heartbeat_ttl_s=0).json()["id"]
    wait_until(lambda: all(a in x.instances() for x in reps), 30, "registration on every replica")
    os.kill(etcd.proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: not any(x.shared()["connected"] for x in reps), 60, "replicas notice the frozen etcd")
        for x in reps:
            assert _complete(x.url).status_code == 200
        r = _register(reps[2], engines[1], heartbeat_ttl_s=0)
        assert r.status_code == 503 and "etcd" in r.json()["error"]["message"]
    finally:
        os.kill(etcd.proc.pid, signal.SIGCONT)
    wait_until(lambda: all(x.shared()["connected"] for x in reps), 60, "replicas reconnect")
    assert _register(reps[2], engines[1], heartbeat_ttl_s=0).status_code == 201


@needs_etcd
def test_calibration_is_shared_and_a_late_replica_starts_with_it(tmp_path):
    from dlmix.testing import RouterThread

    etcd = Etcd(str(tmp_path / "etcd"))
    etcd.start()
    routers = []
    try:
        def replica():
            r = RouterThread(RouterConfig(port=0, policy="round_robin", etcd_endpoints=[etcd.url],
                                          etcd_prefix="/dlmix/calib", health_interval_s=3600))
            r.router.shared.calib_interval_s = 0.1
            routers.append(r)
            return r

        a, b = replica(), replica()
        url = f"http://127.0.0.1:{free_port()}"  # nobody listens: calibration does not need a live engine
        r = httpx.post(a.url + "/admin/instances", json={"url": url, "model": "mock", "heartbeat_ttl_s": 0},
                       timeout=10)
        assert r.status_code == 201, r.text
        iid = r.json()["id"]
        wait_until(lambda: b.call(lambda: iid in b.router.registry.backends), 30, "registration on b")

        def ratios(x):
            return x.call(lambda: (x.router.registry.backends[iid].state.ttft_ratio,
                                   x.router.registry.backends[iid].state.itl_ratio))

        def set_ratios(x, t, i):
            def f():
                st = x.router.registry.backends[iid].state
                st.ttft_ratio, st.itl_ratio = t, i
            x.call(f)

        set_ratios(a, 2.5, 0.8)  # replica a refined the calibration with its requests
        wait_until(lambda: ratios(b) == (2.5, 0.8), 30, "a's calibration on b")
        set_ratios(b, 3.0, 0.9)  # b goes on from there; a follows
        wait_until(lambda: ratios(a) == (3.0, 0.9), 30, "b's calibration on a")
        c = replica()  # a replica started now begins with the fleet's calibration
        assert ratios(c) == (3.0, 0.9)
    finally:
        for r in routers:
            r.close()
        etcd.stop()


def test_a_remote_etcd_needs_authentication():
    with pytest.raises(ConfigError, match="etcd_user"):
        EtcdClient(["http://10.1.2.3:2379"])
    with pytest.raises(ConfigError, match="http"):
        EtcdClient(["10.1.2.3:2379"])
    EtcdClient(["https://10.1.2.3:2379"], user="root", password="x")  # authenticated: accepted


def test_etcd_flags_parse():
    cfg = RouterConfig().apply_flags(["--etcd", "http://127.0.0.1:2379", "--etcd", "http://127.0.0.1:2380",
                                      "--etcd-prefix", "/dlmix/prod"])
    assert cfg.etcd_endpoints == ["http://127.0.0.1:2379", "http://127.0.0.1:2380"]
    assert cfg.etcd_prefix == "/dlmix/prod"


# ------------------------------------------------------------------ in-process replicas: consistency of the store
_NOBODY = f"http://127.0.0.1:{free_port()}"  # an instance url nobody listens on: routing is not exercised


@pytest.fixture()
def replicas(tmp_path):
    """``replica()``: a new in-process router replica of one fleet over its own etcd (all closed at the end)."""
    if ETCD is None:
        pytest.skip("etcd not installed (scripts/setup.sh installs etcd-server)")
    from dlmix.testing import RouterThread

    etcd = Etcd(str(tmp_path / "etcd"))
    etcd.start()
    prefix = f"/dlmix/consistency-{os.getpid()}-{time.time_ns()}"
    made = []

    def replica(**kw):
        r = RouterThread(RouterConfig(port=0, policy="round_robin", etcd_endpoints=[etcd.url], etcd_prefix=prefix,
                                      health_interval_s=3600, **kw))
        made.append(r)
        return r

    try:
        yield replica
    finally:
        for r in made:
            r.close()
        etcd.stop()


def _ids(r):
    return r.call(lambda: sorted(r.router.registry.backends))


def test_reregistering_a_url_under_a_new_id_leaves_no_zombie(replicas):
    """The same url registered again under another id (an engine restart) replaces the old id everywhere, in etcd
    too: once the new id is removed, no replica (not even one started later) brings the old id back; before, its
    keys stayed in etcd, a late replica resurrected it and no one could remove it (404 on every replica)."""
    a = replicas()
    body = {"url": _NOBODY, "model": "m", "heartbeat_ttl_s": 0}
    assert httpx.post(a.url + "/admin/instances", json={**body, "id": "old"}, timeout=10).status_code == 201
    # the engine restarts and registers again under another id (same url): it replaces "old"
    assert httpx.post(a.url + "/admin/instances", json={**body, "id": "new"}, timeout=10).status_code == 201
    assert _ids(a) == ["new"]
    # the operator removes the instance
    assert httpx.delete(a.url + "/admin/instances/new", timeout=10).status_code == 200
    assert _ids(a) == []
    assert httpx.delete(a.url + "/admin/instances/old", timeout=10).status_code == 404  # cannot remove it either
    # a replica started now must agree with a: no instance
    late = replicas()
    assert _ids(late) == [], "a replica started later resurrected the replaced id"
    # and so must the shared store itself
    keys = late.call(lambda: sorted(late.router.shared._applied))
    assert keys == []


def _two_replicas_a_held(replicas, monkeypatch):
    """Two replicas ``(a, b, hold)``: while the Event ``hold`` is set (it is at return), the etcd watch events of
    ``a`` are held back (etcd orders no watch event before the answer to a later put, so ``a`` then sees its own
    writes before the changes another replica made just before them)."""
    import asyncio

    held = set()  # EtcdClients whose watch events are held back
    hold = threading.Event()
    orig = EtcdClient.watch

    async def delayed_watch(self, prefix, start):
        async for evs in orig(self, prefix, start):
            while hold.is_set() and self in held:
                await asyncio.sleep(0.01)
            yield evs

    monkeypatch.setattr(EtcdClient, "watch", delayed_watch)
    a, b = replicas(), replicas()
    held.add(a.router.shared.client)
    hold.set()
    return a, b, hold


def _post_to_a_held(a, b, hold, body: dict) -> httpx.Response:
    """POST ``body`` to ``a``'s ``/admin/instances`` while its watch is held back (:func:`_two_replicas_a_held`);
    ``a``'s watch catches up once ``a``'s write is in the store (``b`` has seen a newer revision). Returns the
    answer."""
    rev = b.call(lambda: b.router.shared.revision)

    def release():
        wait_until(lambda: b.call(lambda: b.router.shared.revision) > rev, 30, "A's write in the store")
        hold.clear()

    t = threading.Thread(target=release)
    t.start()
    try:
        return httpx.post(a.url + "/admin/instances", json=body, timeout=10)
    finally:
        t.join(60)
        hold.clear()


def _layout(layers: int) -> dict:
    """A KV layout dict; a prefill and a decode of one model must agree on its layer count."""
    from dlmix.kv.layout import KVLayout, ModelIdentity

    return KVLayout(model=ModelIdentity(architecture="LlamaForCausalLM", num_layers=layers, num_kv_heads=2,
                                        head_size=64), block_size=16, dtype="bfloat16",
                    arrangement="vllm_lbnhc").to_dict()


def test_replicas_agree_after_two_registrations_that_interact(replicas, monkeypatch):
    """Two registrations of one url under different ids through two replicas, while replica A's watch is held back
    (etcd orders no watch event before the answer to a later put): A applies its own write only after the older
    change, so every replica (and a late one) ends with the same fleet; before, A and B kept different instances
    for good."""
    a, b, hold = _two_replicas_a_held(replicas, monkeypatch)
    body = {"url": _NOBODY, "model": "m", "heartbeat_ttl_s": 0}
    assert httpx.post(b.url + "/admin/instances", json={**body, "id": "from-b"}, timeout=10).status_code == 201

    def release():  # the watch delay ends soon after A's write is in the store (B has applied it)
        wait_until(lambda: _ids(b) == ["from-a"], 30, "A's registration in the store")
        time.sleep(0.3)  # scheduling slack only (A's reply to its own put is back by then); nothing timed
        hold.clear()

    t = threading.Thread(target=release)
    t.start()
    try:
        assert httpx.post(a.url + "/admin/instances", json={**body, "id": "from-a"}, timeout=10).status_code == 201
    finally:
        t.join(60)
        hold.clear()
    # both replicas have caught up with the store
    rev = b.call(lambda: b.router.shared.revision)
    wait_until(lambda: a.call(lambda: a.router.shared.revision) >= rev
               and b.call(lambda: b.router.shared.revision) >= a.call(lambda: a.router.shared.revision), 30,
               "both replicas caught up")
    late = replicas()
    views = {"a": _ids(a), "b": _ids(b), "late": _ids(late)}
    assert views["a"] == views["b"] == views["late"], views


def test_taking_a_refused_write_back_restores_what_another_replica_wrote(replicas, monkeypatch):
    """A's refused registration of ``d`` overwrote B's registration of ``d`` (accepted, 201) made just before it. Taking
    A's write back must put B's value back, the one the store held before A's write: before, A restored what it had
    applied itself when it validated (nothing), so B's accepted registration was deleted from the store and from
    every replica."""
    a, b, hold = _two_replicas_a_held(replicas, monkeypatch)
    other = f"http://127.0.0.1:{free_port()}"
    prefill = {"url": _NOBODY, "id": "p", "model": "m", "role": "prefill", "kv_layout": _layout(4),
               "heartbeat_ttl_s": 0}
    decode_b = {"url": other, "id": "d", "model": "m", "role": "decode", "kv_layout": _layout(4),
                "heartbeat_ttl_s": 0}
    decode_a = {**decode_b, "kv_layout": _layout(5)}  # cannot pair with p: refused once A sees p
    assert httpx.post(b.url + "/admin/instances", json=prefill, timeout=10).status_code == 201
    assert httpx.post(b.url + "/admin/instances", json=decode_b, timeout=10).status_code == 201
    r = _post_to_a_held(a, b, hold, decode_a)
    assert r.status_code == 409, r.text
    wait_until(lambda: _ids(a) == _ids(b) == ["d", "p"], 30, "both replicas serve B's decode and the prefill")
    late = replicas()
    assert _ids(late) == ["d", "p"], "the store lost the registration B accepted"
    assert late.call(lambda: late.router.registry.backends["d"].state.kv_layout)["model"]["num_layers"] == 4


def test_a_registration_refused_after_its_write_leaves_nothing_in_the_store(replicas, monkeypatch):
    """Replica A validates a decode while B's registration of a prefill it cannot pair with is on its way to A (A's
    watch held back): A writes, then applies the store in order (B's prefill first) and refuses its own decode, as
    every replica does. A answers 409 with the reason and takes its write back out of etcd: once the prefill is
    removed, a replica started later does not bring back the decode its client was told was refused (before, the
    key stayed in the store and a late replica served an instance no other replica had)."""
    a, b, hold = _two_replicas_a_held(replicas, monkeypatch)
    other = f"http://127.0.0.1:{free_port()}"
    prefill = {"url": _NOBODY, "id": "p", "model": "m", "role": "prefill", "kv_layout": _layout(4),
               "heartbeat_ttl_s": 0}
    decode = {"url": other, "id": "d", "model": "m", "role": "decode", "kv_layout": _layout(5),
              "heartbeat_ttl_s": 0}
    assert httpx.post(b.url + "/admin/instances", json=prefill, timeout=10).status_code == 201
    r = _post_to_a_held(a, b, hold, decode)
    assert r.status_code == 409, r.text
    assert any("layers" in s for s in r.json()["error"]["reasons"]), r.json()
    wait_until(lambda: _ids(a) == _ids(b) == ["p"], 30, "both replicas serve the prefill only")
    assert httpx.delete(b.url + "/admin/instances/p", timeout=10).status_code == 200
    late = replicas()
    assert _ids(late) == [], "a replica started later applied the refused registration left in the store"
    wait_until(lambda: _ids(a) == _ids(b) == [], 30, "the prefill removed everywhere")


def test_a_registration_whose_lease_grant_fails_leaves_nothing_registered(replicas, monkeypatch):
    """Review 4: a registration is written to etcd, then its heartbeat lease is granted. When the grant failed (etcd
    refused the TTL, 1e308, or went away in between) the client got 503 "registration refused" while the
    instance key stayed in etcd without a lease: registered on every replica, and on every replica started later,
    for good. The replica now takes its write back out."""
    from dlmix.router.shared import EtcdError

    a, b = replicas(), replicas()

    async def refuse(ttl_s):
        raise EtcdError("etcd at x answered 400 to /v3/lease/grant: etcdserver: too large lease TTL")

    monkeypatch.setattr(a.router.shared.client, "grant", refuse)
    body = {"url": f"http://127.0.0.1:{free_port()}", "id": "x", "role": "both", "heartbeat_ttl_s": 30}
    r = httpx.post(a.url + "/admin/instances", json=body, timeout=10)
    assert r.status_code == 503, r.text
    time.sleep(1.0)  # b's watch would have applied the write by now (the README measures ~0.15 s)
    assert _ids(a) == [] and _ids(b) == [], (_ids(a), _ids(b))
    assert _ids(replicas()) == [], "a replica started later applied the refused registration left in the store"
