"""Contract tests every dlmix KV transport passes: two real processes (this test process + a peer subprocess driven by
``dlmix_kv_connectors.testing``), bytes verified after reads and writes, many small blocks, 1 GiB in total, cancel,
timeout on a stalled peer, a killed peer, wrong secret, out-of-grant refusals, fuzzed frames.

Parametrized over every kind; a kind whose package is not installed is skipped with the reason. Mooncake's listeners
bind every interface, so its cases run only inside a private network namespace (``DLMIX_NETNS=1``, set by
tests/test_transport_mooncake.py, which re-runs this file under ``unshare -n``).
"""
from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
import time

import numpy as np
import pytest

from dlmix_kv_connectors import (
    AuthError,
    GrantError,
    PeerError,
    Segment,
    TransferCancelled,
    TransferTimeout,
    make_transport,
    transport_kinds,
)
from dlmix_kv_connectors import _wire as W
from dlmix_kv_connectors.base import _resolve
from dlmix_kv_connectors.testing import PeerProcess, fuzz_frame, pattern, raw_auth, sha

SECRET = "contract-secret"
# the built-in kinds, then every third-party kind installed under the ``dlmix.transports`` entry-point group
KINDS = ["tcp", "shm", "dlslime", "mooncake", "nixl"]
KINDS += [k for k in transport_kinds() if k not in KINDS]
MiB = 1 << 20


def skip_reason(kind: str) -> str | None:
    """Why ``kind`` cannot be tested here, or None."""
    try:
        cls = _resolve(kind)
    except ImportError as e:
        return f"{kind} adapter: package not installed ({e})"
    except ValueError as e:  # a broken third-party entry point
        return f"{kind}: {e}"
    check = getattr(cls, "check_available", None)
    if check is not None and (why := check()):
        return why
    if kind == "mooncake" and os.environ.get("DLMIX_NETNS") != "1":
        return "mooncake listeners bind every interface: run via tests/test_transport_mooncake.py (private netns)"
    return None


@pytest.fixture(params=KINDS)
def kind(request):
    why = skip_reason(request.param)
    if why:
        pytest.skip(why)
    return request.param


@pytest.fixture
def spawn(kind):
    peers: list[PeerProcess] = []

    def make(name="remote", secret=SECRET, cfg=None):
        p = PeerProcess(kind, name, secret, cfg)
        peers.append(p)
        return p

    yield make
    for p in peers:
        p.close()


@pytest.fixture
def local(kind):
    t = make_transport(kind, name="local", secret=SECRET)
    yield t
    t.close()


def _setup_pair(local, spawn, size, seed=1, mode="rw", tid="t"):
    p = spawn()
    p.call("region", name="kv", size=size, seed=seed)
    dst = np.zeros(size, dtype=np.uint8)
    local.register("kv", dst)
    assert local.connect(p.desc) == "remote"
    assert p.call("grant", peer="local", tid=tid, ranges=[["kv", 0, size]], mode=mode)["ok"]
    return p, dst


def test_read_write_bytes_verified(kind, local, spawn):
    size = 4 * MiB
    p, dst = _setup_pair(local, spawn, size)
    want = pattern(size, 1)
    segs = [Segment("kv", 0, "kv", 1000, 100_000), Segment("kv", 200_000, "kv", 3_000_000, MiB),
            Segment("kv", 2 * MiB, "kv", 7, 1)]
    h = local.read("remote", segs, "t")
    assert h.result(60) == 100_000 + MiB + 1
    assert h.done() and h.ok()
    for s in segs:
        assert bytes(dst[s.local_offset:s.local_offset + s.length]) == \
            bytes(want[s.remote_offset:s.remote_offset + s.length])
    assert not dst[100_000:200_000].any()  # untouched between segments
    # write: local pattern 2 -> remote [512, 512 + 2 MiB)
    dst[:] = pattern(size, 2)
    assert local.write("remote", [Segment("kv", 0, "kv", 512, 2 * MiB)], "t").result(60) == 2 * MiB
    assert p.call("sha", name="kv", off=512, len=2 * MiB)["sha"] == sha(dst[:2 * MiB])
    assert p.call("sha", name="kv", off=0, len=512)["sha"] == sha(want[:512])
    assert p.call("sha", name="kv", off=512 + 2 * MiB, len=size - 512 - 2 * MiB)["sha"] == \
        sha(want[512 + 2 * MiB:])
    if kind == "shm":
        assert local.check_cma("remote") is True


def test_many_small_blocks(kind, local, spawn):
    blk, n = 4096, 2048
    p, dst = _setup_pair(local, spawn, blk * n, seed=3)
    want = pattern(blk * n, 3).reshape(n, blk)
    perm = np.random.default_rng(0).permutation(n)
    segs = [Segment("kv", i * blk, "kv", int(perm[i]) * blk, blk) for i in range(n)]
    assert local.read("remote", segs, "t").result(60) == blk * n
    assert np.array_equal(dst.reshape(n, blk), want[perm])
    # write back in another order
    dst[:] = pattern(blk * n, 4)
    perm2 = np.random.default_rng(1).permutation(n)
    segs = [Segment("kv", i * blk, "kv", int(perm2[i]) * blk, blk) for i in range(n)]
    assert local.write("remote", segs, "t").result(60) == blk * n
    expect = np.empty((n, blk), dtype=np.uint8)
    expect[perm2] = dst.reshape(n, blk)
    assert p.call("sha", name="kv", off=0, len=blk * n)["sha"] == sha(expect)


def test_one_gib_in_chunks(kind, local, spawn):
    size = 64 * MiB
    p, dst = _setup_pair(local, spawn, size, seed=5)
    want_sha = sha(pattern(size, 5))
    chunk = 16 * MiB
    segs = [Segment("kv", o, "kv", o, chunk) for o in range(0, size, chunk)]
    moved = 0
    for i in range(8):  # 8 x 64 MiB reads
        dst[:] = 0
        moved += local.read("remote", segs, "t").result(120)
        assert sha(dst) == want_sha
    for i in range(8):  # 8 x 64 MiB writes, each different
        dst ^= np.uint8(i + 1)
        moved += local.write("remote", segs, "t").result(120)
        assert p.call("sha", name="kv", off=0, len=size)["sha"] == sha(dst)
    assert moved == 1 << 30


def test_cancel(kind, local, spawn):
    size = 8 * MiB
    p, dst = _setup_pair(local, spawn, size, seed=6)
    p.stop()
    try:
        h = local.read("remote", [Segment("kv", 0, "kv", 0, size)], "t", timeout_s=60)
        assert not h.done()
        assert h.cancel() is True
        assert h.done()
        with pytest.raises(TransferCancelled):
            h.result(5)
        assert h.cancel() is False
        snapshot = dst.copy()
    finally:
        p.cont()
    # the cancelled read never lands later; the link still works
    assert local.read("remote", [Segment("kv", 0, "kv", 0, 4096)], "t").result(60) == 4096
    assert np.array_equal(dst[4096:], snapshot[4096:])
    assert bytes(dst[:4096]) == bytes(pattern(size, 6)[:4096])


def test_timeout_on_stalled_peer(kind, local, spawn):
    size = 4 * MiB
    p, dst = _setup_pair(local, spawn, size, seed=8)
    p.stop()
    try:
        h = local.read("remote", [Segment("kv", 0, "kv", 0, size)], "t", timeout_s=1.0)
        with pytest.raises(TransferTimeout):
            h.result(60)
    finally:
        p.cont()
    assert local.read("remote", [Segment("kv", 0, "kv", 0, size)], "t").result(60) == size
    assert sha(dst) == sha(pattern(size, 8))


def test_killed_peer_mid_transfer(kind, local, spawn):
    size = 8 * MiB
    src = pattern(size, 7)
    inbox = np.zeros(size, dtype=np.uint8)
    local.register("kv", src)
    local.register("in", inbox)
    local.grant("victim", "tv", [("kv", 0, size)], "r")
    local.grant("other", "to", [("kv", 0, size)], "rw")
    victim = spawn("victim")
    other = spawn("other")
    victim.call("region", name="kv", size=size, seed=9)
    other.call("region", name="kv", size=size, seed=10)
    # the victim pulls from us in a loop, and we pull from the victim
    assert victim.call("connect", desc=local.descriptor())["ok"]
    assert victim.call("read_loop", peer="local", segs=[["kv", 0, "kv", 0, size]], tid="tv")["ok"]
    victim.call("grant", peer="local", tid="tl", ranges=[["kv", 0, size]], mode="r")
    local.connect(victim.desc)
    victim.stop()
    h = local.read("victim", [Segment("in", 0, "kv", 0, size)], "tl", timeout_s=60)
    victim.kill()
    with pytest.raises((PeerError, TransferTimeout)):
        h.result(60)
    assert isinstance(h.exception(), PeerError)
    # the survivor keeps serving another peer, both directions
    assert other.call("connect", desc=local.descriptor())["ok"]
    r = other.call("read", peer="local", segs=[["kv", 0, "kv", 0, size]], tid="to")
    assert r["ok"] and r["n"] == size
    assert other.call("sha", name="kv", off=0, len=size)["sha"] == sha(src)
    other.call("grant", peer="local", tid="back", ranges=[["kv", 0, size]], mode="r")
    local.connect(other.desc)
    assert local.read("other", [Segment("in", 0, "kv", 0, size)], "back").result(60) == size
    assert other.call("sha", name="kv", off=0, len=size)["sha"] == sha(inbox)
    assert "victim" not in local.peers()


def test_wrong_secret_refused(kind, local, spawn):
    p = spawn(secret="the-right-one")
    with pytest.raises(AuthError):
        local.connect(p.desc)
    assert "remote" not in local.peers()
    # a client with the wrong secret is refused by our listener too
    bad = spawn(name="bad", secret="wrong")
    r = bad.call("connect", desc=local.descriptor())
    assert not r["ok"] and r["etype"] == "AuthError"
    # server side: a client that answers the challenge with a bad MAC gets ERROR and is cut off
    d = local.descriptor()
    with socket.create_connection((d["host"], d["port"]), timeout=5) as s:
        s.sendall(W.pack(W.HELLO, W.Hello(W.VERSION, "mallory", os.urandom(32).hex())))
        ftype, blen, _ = W.read_frame_header(s, memoryview(bytearray(16)), 1 << 16, 0)
        assert ftype == W.CHALLENGE
        W.read_body(s, ftype, blen)
        s.sendall(W.pack(W.AUTH, W.Auth("00" * 32, {})))
        ftype, blen, _ = W.read_frame_header(s, memoryview(bytearray(16)), 1 << 16, 0)
        assert ftype == W.ERROR
        assert "authentication failed" in W.read_body(s, ftype, blen).reason
        assert s.recv(1) == b""
    assert local.stats["auth_failures"] >= 1


def test_out_of_grant_refused(kind, local, spawn):
    size = MiB
    p = spawn()
    p.call("region", name="kv", size=size, seed=11)
    p.call("region", name="other", size=size, seed=12)
    dst = np.zeros(size, dtype=np.uint8)
    local.register("kv", dst)
    local.connect(p.desc)
    p.call("grant", peer="local", tid="t", ranges=[["kv", 0, 65536], ["kv", 131072, 4096]], mode="r")
    p.call("grant", peer="someone-else", tid="t2", ranges=[["kv", 0, size]], mode="rw")
    p.call("grant", peer="local", tid="gone", ranges=[["kv", 0, size]], mode="r", expires_s=0)

    def refused(op, segs, tid):
        h = (local.read if op == "r" else local.write)("remote", segs, tid, timeout_s=30)
        with pytest.raises(GrantError):
            h.result(30)

    refused("r", [Segment("kv", 0, "kv", 65536, 4096)], "t")  # past the first range
    refused("r", [Segment("kv", 0, "kv", 65000, 4096)], "t")  # straddles the end
    refused("r", [Segment("kv", 0, "kv", 60000, 80000)], "t")  # spans the gap between ranges
    refused("r", [Segment("kv", 0, "kv", 0, 4096), Segment("kv", 4096, "kv", 200000, 4096)], "t")  # one bad of two
    refused("w", [Segment("kv", 0, "kv", 0, 4096)], "t")  # read-only grant
    refused("r", [Segment("kv", 0, "other", 0, 4096)], "t")  # another region
    refused("r", [Segment("kv", 0, "kv", 0, 4096)], "t2")  # granted to another peer
    refused("r", [Segment("kv", 0, "kv", 0, 4096)], "nope")  # no grant
    refused("r", [Segment("kv", 0, "kv", 0, 4096)], "gone")  # expired
    refused("r", [Segment("kv", 0, "kv", size - 10, 4096)], "t")  # past the region
    assert not dst.any()  # nothing refused landed
    want = pattern(size, 11)
    assert local.read("remote", [Segment("kv", 0, "kv", 131072, 4096)], "t").result(30) == 4096
    assert bytes(dst[:4096]) == bytes(want[131072:131072 + 4096])
    assert p.call("revoke", tid="t")["existed"] is True
    refused("r", [Segment("kv", 0, "kv", 0, 4096)], "t")
    assert p.call("sha", name="kv", off=0, len=size)["sha"] == sha(want)
    assert p.call("stats")["stats"]["refused_ops"] >= 11


def test_fuzzed_frames_never_crash(kind, local, spawn):
    size = MiB
    p, dst = _setup_pair(local, spawn, size, seed=13)
    p.call("grant", peer="fuzzer", tid="fz", ranges=[["kv", 0, 4096]], mode="r")
    host, port = p.desc["host"], p.desc["port"]
    rng = random.Random(1234)
    sent = 0
    for i in range(1200):  # unauthenticated garbage
        try:
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(fuzz_frame(rng))
            sent += 1
        except OSError:  # the endpoint may hang up first
            pass
    for i in range(400):  # authenticated, then hostile frames until the endpoint hangs up
        s = raw_auth(host, port, "fuzzer", SECRET)
        try:
            for _ in range(8):
                s.sendall(fuzz_frame(rng))
                sent += 1
        except OSError:
            pass
        finally:
            s.close()
    assert sent >= 2000
    # the endpoint still serves correctly and counted the bad frames; its memory was not modified
    assert local.read("remote", [Segment("kv", 0, "kv", 0, size)], "t").result(60) == size
    assert sha(dst) == sha(pattern(size, 13))
    st = p.call("stats")
    assert st["ok"] and st["stats"]["protocol_errors"] > 100
    assert p.call("sha", name="kv", off=0, len=size)["sha"] == sha(pattern(size, 13))


def test_notifications_both_ways(kind, local, spawn):
    p, _ = _setup_pair(local, spawn, 4096)
    assert p.call("notify", peer="local", msg={"type": "blocks_ready", "req": "r1", "blocks": [3, 1, 2]})["ok"]
    n = local.get_notification(30)
    assert n is not None and n.peer == "remote" and n.msg == {"type": "blocks_ready", "req": "r1", "blocks": [3, 1, 2]}
    local.notify("remote", {"type": "blocks_consumed", "req": "r1"})
    local.notify("remote", {"type": "abort", "req": "r2"})
    got = []
    while len(got) < 2:
        got += p.call("notes", timeout=30)["notes"]
    assert got == [{"peer": "local", "msg": {"type": "blocks_consumed", "req": "r1"}},
                   {"peer": "local", "msg": {"type": "abort", "req": "r2"}}]
    with pytest.raises(ValueError):
        local.notify("remote", {"bad": object()})
    with pytest.raises(PeerError):
        local.notify("nobody", {"type": "x"})


def test_await_handle(kind, local, spawn):
    size = MiB
    p, dst = _setup_pair(local, spawn, size, seed=14)

    async def go():
        hs = [local.read("remote", [Segment("kv", o, "kv", o, size // 4)], "t") for o in range(0, size, size // 4)]
        return await asyncio.gather(*hs)

    assert asyncio.run(go()) == [size // 4] * 4
    assert sha(dst) == sha(pattern(size, 14))



def test_progress_without_a_waiter(kind, local, spawn):
    """A transfer sent as one chunk keeps its link's reader thread asleep for the thread that will wait on it; one that
    is only polled with done(), only given a callback, or never touched at all still completes (the reader thread is
    armed again), and a notification arriving over the same link right after a waited read is delivered."""
    size = 4 * 4096
    p, dst = _setup_pair(local, spawn, size, seed=15)

    def seg(i):
        return [Segment("kv", i * 4096, "kv", i * 4096, 4096)]

    assert local.read("remote", seg(0), "t").result(60) == 4096
    assert p.call("notify", peer="local", msg={"type": "after-read"})["ok"]
    n = local.get_notification(30)
    assert n is not None and n.msg == {"type": "after-read"}

    h = local.read("remote", seg(1), "t")  # polled only
    deadline = time.monotonic() + 60
    while not h.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert h.ok()

    ev = threading.Event()  # a callback only
    h = local.read("remote", seg(2), "t")
    h.add_done_callback(lambda _: ev.set())
    assert ev.wait(60) and h.ok()

    h = local.read("remote", seg(3), "t")  # never waited on nor polled: ok() does not drive
    deadline = time.monotonic() + 60
    while not h.ok() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert h.ok()
    assert sha(dst) == sha(pattern(size, 15))
