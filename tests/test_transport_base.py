"""Unit tests of the transport interface pieces that need no second process: memory registration, registry, grant
validation, handle semantics, frame limits, the cross-memory-attach helper and the coalescing helpers."""
from __future__ import annotations

import asyncio
import ctypes
import json
import os
import socket
import time

import numpy as np
import pytest
import torch

from dlmix.testing import poll
from dlmix_kv_connectors import (
    GrantError,
    PeerError,
    ProtocolError,
    Segment,
    TransferCancelled,
    TransferHandle,
    Transport,
    UnsupportedMemoryError,
    available_transports,
    make_transport,
    register_transport,
)
from dlmix_kv_connectors import _wire as W
from dlmix_kv_connectors.base import region_memory
from dlmix_kv_connectors.tcp import TcpTransport


@pytest.fixture
def pair():
    a = make_transport("tcp", name="a", secret="s3")
    b = make_transport("tcp", name="b", secret="s3")
    yield a, b
    a.close()
    b.close()


def test_region_memory_accepts_host_buffers():
    t = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    ptr, n, dev, ro, view, _ = region_memory(t)
    assert (ptr, n, dev, ro) == (t.data_ptr(), 48, "cpu", False)
    assert bytes(view) == t.view(torch.uint8).numpy().tobytes()
    a = np.arange(10, dtype=np.float32)
    ptr, n, dev, ro, view, _ = region_memory(a)
    assert (ptr, n, ro) == (a.ctypes.data, 40, False) and bytes(view) == a.tobytes()
    a.flags.writeable = False
    assert region_memory(a)[3] is True
    ba = bytearray(b"hello")
    assert region_memory(ba)[1:4] == (5, "cpu", False)
    assert region_memory(b"ro")[3] is True
    buf = ctypes.create_string_buffer(b"xyz", 3)
    ptr, n, _, _, view, _ = region_memory((ctypes.addressof(buf), 3))
    assert bytes(view) == b"xyz"
    with pytest.raises(UnsupportedMemoryError):
        region_memory(torch.zeros(4, 4).t())
    with pytest.raises(UnsupportedMemoryError):
        region_memory(np.zeros((4, 4))[:, 1])
    with pytest.raises(UnsupportedMemoryError):
        region_memory([1, 2, 3])


def test_registry_and_config_errors():
    with pytest.raises(ValueError, match="unknown transport kind"):
        make_transport("nope", secret="x")
    with pytest.raises(ValueError, match="secret"):
        make_transport("tcp", name="x", secret="")
    t = make_transport("dlmix_kv_connectors.tcp:TcpTransport", name="x", secret="sekrit-XYZ")
    assert isinstance(t, TcpTransport) and t.kind == "tcp"
    d = t.descriptor()
    assert d["host"] == "127.0.0.1" and d["kind"] == "tcp" and "sekrit" not in json.dumps(d)
    t.close()
    avail = available_transports()
    assert avail["tcp"] is None and avail["shm"] is None and set(avail) >= {"mooncake", "nixl", "dlslime"}

    @register_transport("unit-test-kind")
    class Mine(TcpTransport):
        pass

    m = make_transport("unit-test-kind", name="m", secret="k")
    assert type(m) is Mine and m.kind == "unit-test-kind"
    m.close()
    with pytest.raises(ValueError, match="already registered"):
        register_transport("unit-test-kind")(TcpTransport)


def test_register_and_grant_validation(pair):
    a, _ = pair
    a.register("kv", np.zeros(4096, dtype=np.uint8))
    a.register("ro", b"x" * 100)
    with pytest.raises(ValueError, match="already registered"):
        a.register("kv", bytearray(4))
    with pytest.raises(KeyError):
        a.grant("b", "t", [("missing", 0, 1)])
    with pytest.raises(ValueError, match="ends past"):
        a.grant("b", "t", [("kv", 4000, 100)])
    with pytest.raises(ValueError, match="mode"):
        a.grant("b", "t", [("kv", 0, 1)], mode="x")
    with pytest.raises(GrantError, match="read-only"):
        a.grant("b", "t", [("ro", 0, 10)], mode="w")
    a.grant("b", "t", [("kv", 0, 10)])
    with pytest.raises(ValueError, match="already granted"):
        a.grant("c", "t", [("kv", 0, 10)])
    assert a.revoke("t") is True and a.revoke("t") is False
    a.unregister("kv")
    assert set(a.regions()) == {"ro"}


def test_loopback_torch_and_raw_pointer_regions(pair):
    a, b = pair
    src = torch.randn(8, 16, dtype=torch.bfloat16)  # [blocks, elems]: 32 B per block
    a.register("kv", src)
    raw = ctypes.create_string_buffer(256)
    b.register("dst", (ctypes.addressof(raw), 256))
    assert b.connect(a.descriptor()) == "a"
    a.grant("b", "req-1", [("kv", 32 * 2, 32), ("kv", 32 * 5, 32)], mode="rw")
    h = b.read("a", [Segment("dst", 0, "kv", 64, 32), Segment("dst", 32, "kv", 160, 32)], "req-1", timeout_s=10)
    assert h.result(10) == 64 and h.ok()
    want = src.view(torch.uint8).numpy().reshape(8, 32)
    assert raw.raw[:32] == want[2].tobytes() and raw.raw[32:64] == want[5].tobytes()
    raw.raw = bytes(range(256))
    assert b.write("a", [Segment("dst", 0, "kv", 64, 32)], "req-1").result(10) == 32
    assert src.view(torch.uint8).numpy().reshape(8, 32)[2].tobytes() == bytes(range(32))
    assert asyncio.run(_await(b.read("a", [Segment("dst", 0, "kv", 160, 32)], "req-1"))) == 32
    with pytest.raises(KeyError):
        b.read("a", [Segment("nope", 0, "kv", 0, 1)], "req-1")
    with pytest.raises(ValueError, match="past local region"):
        b.read("a", [Segment("dst", 250, "kv", 0, 10)], "req-1")
    with pytest.raises(PeerError, match="not connected"):
        b.read("zed", [Segment("dst", 0, "kv", 0, 1)], "req-1")
    assert b.read("a", [], "req-1").result(1) == 0
    assert "a" in b.peers() and "b" in a.peers()


async def _await(h):
    return await h


def test_handle_semantics():
    cancelled = []
    h = TransferHandle("t", 10, canceller=lambda hh: cancelled.append(hh.transfer_id))
    assert not h.done() and h.wait(0.01) is False
    assert h.cancel() is True and cancelled == ["t"]
    assert h.done() and not h.ok() and h.cancel() is False
    with pytest.raises(TransferCancelled):
        h.result()
    h2 = TransferHandle("u", 5)
    seen = []
    h2.add_done_callback(lambda x: seen.append(x.transfer_id))
    assert h2._set_result(5) and h2.result() == 5 and h2.ok() and seen == ["u"]
    assert h2._set_exception(RuntimeError()) is False  # first completion wins


def test_oversized_and_malformed_frames_close_only_that_connection(pair):
    a, b = pair
    a.register("kv", bytearray(64))
    b.register("kv", bytearray(64))
    b.connect(a.descriptor())
    d = a.descriptor()
    # pre-auth body larger than the pre-auth limit
    with socket.create_connection((d["host"], d["port"]), timeout=5) as s:
        s.sendall(W.HEADER.pack(W.MAGIC, W.VERSION, W.HELLO, 1 << 20, 0))
        ftype, blen, _ = W.read_frame_header(s, memoryview(bytearray(16)), 1 << 16, 0)
        assert ftype == W.ERROR and "exceeds" in W.read_body(s, ftype, blen).reason
        assert s.recv(1) == b""
    errors_before = a.stats["protocol_errors"]
    with socket.create_connection((d["host"], d["port"]), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        try:
            while s.recv(4096):
                pass
        except ConnectionResetError:
            pass
    for _ in range(500):  # the endpoint counts it on its own thread
        if a.stats["protocol_errors"] == errors_before + 1:
            break
        time.sleep(0.01)
    assert a.stats["protocol_errors"] == errors_before + 1
    # the authenticated link is untouched
    a.grant("b", "t", [("kv", 0, 64)])
    assert b.read("a", [Segment("kv", 0, "kv", 0, 64)], "t").result(10) == 64


def test_notify_handler_and_limits(pair):
    a, b = pair
    b.connect(a.descriptor())
    got = []
    a.on_notify(got.append)
    b.notify("a", {"type": "blocks_ready", "blocks": list(range(5))})
    b.notify("a", {"type": "abort"})
    deadline = 100
    while len(got) < 2 and deadline:
        deadline -= 1
        b.get_notification(0.05)
    assert [n.msg for n in got] == [{"type": "blocks_ready", "blocks": [0, 1, 2, 3, 4]}, {"type": "abort"}]
    assert {n.peer for n in got} == {"b"}
    with pytest.raises(ValueError, match="limit"):
        b.notify("a", {"x": "y" * (5 << 20)})
    with pytest.raises(ValueError):
        b.notify("a", ["not", "a", "dict"])


def test_cma_copy_and_coalescing():
    from dlmix_kv_connectors._adapter import coalesce_pairs
    from dlmix_kv_connectors.shm import cma_copy

    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    n = cma_copy(os.getpid(), [(dst.ctypes.data, 1000), (dst.ctypes.data + 5000, 3000)],
                 [(src.ctypes.data + 100, 1000), (src.ctypes.data + 9000, 3000)], to_remote=False)
    assert n == 4000
    assert np.array_equal(dst[:1000], src[100:1100]) and np.array_equal(dst[5000:8000], src[9000:12000])
    with pytest.raises(OSError):
        cma_copy(os.getpid(), [(dst.ctypes.data, 16)], [(8, 16)], to_remote=False)  # EFAULT
    with pytest.raises(ValueError):
        cma_copy(os.getpid(), [(dst.ctypes.data, 16)], [(src.ctypes.data, 8)], to_remote=False)
    assert coalesce_pairs([0, 10, 30], [100, 110, 200], [10, 10, 5]) == ([0, 30], [100, 200], [20, 5])


def test_transport_is_abstract():
    with pytest.raises(TypeError):
        Transport()  # type: ignore[abstract]


def test_dlslime_calls_carry_at_most_32_assignments():
    """DLSlime 0.1.23 can report a call with > 32 assignments done before the data lands: the adapter splits."""
    pytest.importorskip("dlmix_kv_connectors.dlslime", reason="dlslime not installed")
    from dlmix_kv_connectors.dlslime import MAX_ASSIGN, coalesce

    assert MAX_ASSIGN == 32
    assert coalesce([(1, 2, 0, 100, 10), (1, 2, 10, 110, 5), (1, 2, 50, 115, 5)]) == [(1, 2, 0, 100, 15),
                                                                                       (1, 2, 50, 115, 5)]
    blk, n = 4096, 100
    src = np.random.default_rng(3).integers(0, 256, blk * n, dtype=np.uint8)
    dst = np.zeros_like(src)
    a = make_transport("dlslime", name="a", secret="s")
    b = make_transport("dlslime", name="b", secret="s")
    try:
        a.register("kv", src)
        b.register("kv", dst)
        b.connect(a.descriptor())
        a.grant("b", "t", [("kv", 0, src.nbytes)], mode="r")
        peer = b._lib_peers["a"]
        real, sizes = peer.ep, []

        class Spy:
            def __getattr__(self, name):
                return getattr(real, name)

            def read(self, items):
                sizes.append(len(items))
                return real.read(items)

        peer.ep = Spy()
        perm = np.random.default_rng(4).permutation(n)  # no two blocks contiguous on both sides -> 100 assignments
        segs = [Segment("kv", i * blk, "kv", int(perm[i]) * blk, blk) for i in range(n)]
        assert b.read("a", segs, "t").result(60) == blk * n
        assert np.array_equal(dst.reshape(n, blk), src.reshape(n, blk)[perm])
        assert max(sizes) <= 32 and sum(sizes) <= n and len(sizes) >= -(-sum(sizes) // 32)
    finally:
        b.close()
        a.close()


def test_frame_reader_reassembles_any_fragmentation():
    """The buffered reader returns the same headers, bodies and payload bytes however the stream is cut: byte by
    byte, several frames per recv, a body larger than its buffer, payloads below and above the direct-receive size."""
    import threading

    frames = []
    rng = np.random.default_rng(5)
    for i, plen in enumerate([0, 1, 4096, W.RX_DIRECT - 1, W.RX_DIRECT, 300_000, 7]):
        body = W.Req(i, "w", "t" * (i + 1), "tcp", [("kv", 0, plen)])
        frames.append((W.pack(W.REQ, body, plen), rng.integers(0, 256, plen, dtype=np.uint8).tobytes()))
    big = W.Notify({"blob": "x" * (W.RX_BUFFER + 1000)})  # body larger than the reader's buffer
    frames.append((W.pack(W.NOTIFY, big), b""))
    stream = b"".join(h + p for h, p in frames)

    for cut in (5, 97, 4096, len(stream)):
        a, b = socket.socketpair()
        try:
            def feed():  # the first 64 KiB in pieces of `cut` bytes (headers split anywhere), then the rest at once
                n = min(len(stream), 64 << 10)
                for i in range(0, n, cut):
                    b.sendall(stream[i:min(i + cut, n)])
                b.sendall(stream[n:])

            th = threading.Thread(target=feed, daemon=True)
            th.start()
            rx = W.FrameReader(a, size=W.RX_BUFFER)
            for k, (head, payload) in enumerate(frames):
                if (k + cut) % 2:  # both ways of reading a frame: header + body, and frame() in one call
                    ftype, blen, plen = rx.header(8 << 20, 1 << 20)
                    msg = rx.body(ftype, blen)
                else:
                    ftype, msg, plen = rx.frame(8 << 20, 1 << 20)
                assert plen == len(payload)
                if ftype == W.REQ:
                    assert msg.id == k and msg.segs == [("kv", 0, plen)]
                    if k % 2:  # scatter into two views
                        dst = bytearray(plen)
                        mv = memoryview(dst)
                        rx.into([mv[:plen // 3], mv[plen // 3:]])
                        assert bytes(dst) == payload
                    else:
                        rx.skip(plen)
                else:
                    assert msg.msg == big.msg
            th.join(10)
            assert rx.start == rx.end  # nothing left over
            b.close()
            with pytest.raises(PeerError):
                rx.header(1 << 20, 1 << 20)  # EOF
        finally:
            a.close()
            b.close()


def test_an_outbound_handshake_waits_for_a_slow_peer_until_the_connect_timeout(monkeypatch):
    """A peer whose acceptor answers late (starved threads on a loaded host) is connected to as long as it answers
    within the connect timeout, even after ``handshake_timeout_s`` (the inbound limit); a peer that never answers
    fails with TransferTimeout once the connect timeout is spent."""
    from dlmix_kv_connectors import TransferTimeout
    from dlmix_kv_connectors._core import Endpoint

    a = make_transport("tcp", name="a", secret="s3", handshake_timeout_s=0.3)
    b = make_transport("tcp", name="b", secret="s3", handshake_timeout_s=5.0)
    silent = socket.socket()
    try:
        serve = Endpoint._serve_new

        def slow_serve(self, sock, addr):  # b answers the HELLO after 1 s, three times a's handshake_timeout_s
            time.sleep(1.0)
            serve(self, sock, addr)

        monkeypatch.setattr(b, "_serve_new", slow_serve.__get__(b))
        assert a.connect(b.descriptor(), timeout_s=30) == "b"
        b.register("kv", np.arange(64, dtype=np.uint8))
        b.grant("a", "t1", [("kv", 0, 64)], mode="r")
        dst = np.zeros(64, dtype=np.uint8)
        a.register("dst", dst)
        a.read("b", [Segment("dst", 0, "kv", 0, 64)], "t1").result(30)
        assert dst.tolist() == list(range(64))

        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # accepts (the kernel's backlog) and never says a word
        desc = {**b.descriptor(), "name": "mute", "port": silent.getsockname()[1]}
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="did not complete the handshake within 1.0 s"):
            a.connect(desc, timeout_s=1.0)
        assert time.monotonic() - t0 >= 0.9  # the connect timeout, not a's 0.3 s handshake_timeout_s
    finally:
        silent.close()
        a.close()
        b.close()


def test_connect_timeout_bounds_the_whole_link_not_each_stripe(monkeypatch):
    """``connect(timeout_s=T)`` dials ``stripes`` connections one after another; ``T`` bounds them all. A peer whose
    acceptor answers each handshake after 0.7 s takes 1.4 s for the two stripes, so a 1 s connect fails with
    TransferTimeout (each stripe had its own full 1 s before, and this connect succeeded after 1.4 s), leaving no
    half-made link behind: a later connect with time enough succeeds."""
    from dlmix_kv_connectors import TransferTimeout
    from dlmix_kv_connectors._core import Endpoint

    a = make_transport("tcp", name="a", secret="s3", stripes=2)
    b = make_transport("tcp", name="b", secret="s3")
    try:
        serve = Endpoint._serve_new

        def slow_serve(self, sock, addr):
            time.sleep(0.7)
            serve(self, sock, addr)

        monkeypatch.setattr(b, "_serve_new", slow_serve.__get__(b))
        with pytest.raises(TransferTimeout, match=r"timed out after 1\.0 s|within 1\.0 s"):
            a.connect(b.descriptor(), timeout_s=1.0)
        assert a.peers() == []
        assert a.connect(b.descriptor(), timeout_s=30) == "b"
        assert len(a._out["b"]) == 2
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("bad, why", [
    (W.HEADER.pack(b"XX", W.VERSION, W.REQ, 2, 0) + b"{}", "bad magic"),
    (W.HEADER.pack(W.MAGIC, 9, W.REQ, 2, 0) + b"{}", "unsupported protocol version 9"),
    (W.HEADER.pack(W.MAGIC, W.VERSION, 42, 2, 0) + b"{}", "unknown frame type 42"),
    (W.HEADER.pack(W.MAGIC, W.VERSION, W.REQ, 5000, 0) + b"{}", "body of 5000 B exceeds the 4096 B limit"),
    (W.HEADER.pack(W.MAGIC, W.VERSION, W.REQ, 2, 1 << 30) + b"{}", "payload of 1073741824 B exceeds"),
    (W.HEADER.pack(W.MAGIC, W.VERSION, W.REQ, 2, 0) + b"{}", "malformed REQ body"),
])
def test_frame_reader_refuses_a_bad_frame_in_one_call_as_header_does(bad, why):
    """``FrameReader.frame`` (one call for a buffered frame, the latency path) refuses exactly what
    ``header``/``body`` refuse, with the same reason."""
    for how in ("frame", "header+body"):
        a, b = socket.socketpair()
        try:
            b.sendall(bad)
            rx = W.FrameReader(a)
            with pytest.raises(ProtocolError, match=why):
                if how == "frame":
                    rx.frame(4096, 1 << 20)
                else:
                    ftype, blen, _ = rx.header(4096, 1 << 20)
                    rx.body(ftype, blen)
        finally:
            a.close()
            b.close()


def _linked_pair(seed: int, mode: str, a_kw: dict, b_kw: dict):
    """TCP transports ``a`` (owner of 1 MiB of random bytes ``src``, region ``kv``, granted to ``b`` as transfer
    ``t`` in ``mode``) and ``b`` (1 MiB of zeros ``dst``, connected to ``a``): ``(a, b, src, dst)``."""
    a = make_transport("tcp", name="a", secret="s3", **a_kw)
    b = make_transport("tcp", name="b", secret="s3", **b_kw)
    src = np.random.default_rng(seed).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    a.register("kv", src)
    b.register("kv", dst)
    a.grant("b", "t", [("kv", 0, 1 << 20)], mode, None)
    b.connect(a.descriptor())
    return a, b, src, dst


@pytest.mark.parametrize("spin_us", [0, 100, 10_000])
def test_a_waiter_polling_or_sleeping_reads_exact_bytes(spin_us):
    """``spin_us`` only changes how a waiter waits for its response (poll, then sleep): reads of 1 B .. 1 MiB and
    a write land the exact bytes either way, and a refused read still fails with the owner's reason."""
    a, b, src, dst = _linked_pair(7, "rw", {"spin_us": spin_us}, {"spin_us": spin_us})
    try:
        for n in (1, 4096, 300_000, 1 << 20):
            dst[:] = 0
            assert b.read("a", [Segment("kv", 0, "kv", 0, n)], "t").result(30) == n
            assert np.array_equal(dst[:n], src[:n]) and not dst[n:].any()
        dst[:4096] = 9
        assert b.write("a", [Segment("kv", 0, "kv", 8192, 4096)], "t").result(30) == 4096
        assert (src[8192:8192 + 4096] == 9).all()
        with pytest.raises(GrantError, match="no active grant"):
            b.read("a", [Segment("kv", 0, "kv", 0, 16)], "other").result(30)
    finally:
        a.close()
        b.close()


def test_refusals_name_the_region_that_is_not_there():
    """A grant on a region never registered is a KeyError naming it and the registered ones (before: a bare
    ``KeyError: 'nope'``); a read under a live grant of a region since unregistered is refused as an unknown region
    (before: "grant for transfer 't' does not allow read", which hid the cause)."""
    a, b, src, dst = _linked_pair(8, "r", {}, {})
    try:
        with pytest.raises(KeyError, match="unknown region 'nope'; registered: kv"):
            a.grant("b", "t2", [("nope", 0, 10)], "r", None)
        assert b.read("a", [Segment("kv", 0, "kv", 0, 16)], "t").result(30) == 16
        a.unregister("kv")
        with pytest.raises(GrantError, match=r"unknown region 'kv' \(not registered, or unregistered\)"):
            b.read("a", [Segment("kv", 0, "kv", 0, 16)], "t").result(30)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("bad", [-1, 10_001, "x"])
def test_spin_us_out_of_range_is_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        make_transport("tcp", name="x", secret="s", spin_us=bad)


def test_a_connection_found_dead_at_launch_carries_no_chunk(monkeypatch):
    """A stripe that fails between a transfer's connection lookup and its launch (marked dead, not yet removed from
    the link) gets no chunk: one-chunk and many-chunk reads go over the live stripes and land the exact bytes; with
    every stripe dead the transfer fails with the reason instead of hanging."""
    a, b, src, dst = _linked_pair(11, "r", {}, {"stripes": 3, "chunk_bytes": 64 << 10, "min_stripe_bytes": 64 << 10})
    try:
        link = list(b._out["a"])
        assert len(link) == 3
        dead = link[1]
        dead.alive = False  # failed; its reader has not removed it from the link yet
        monkeypatch.setattr(b, "_conns_for", lambda peer: list(link))  # the lookup raced the failure
        used = []
        real = b._dispatch
        monkeypatch.setattr(b, "_dispatch", lambda conn, ch: (used.append(conn), real(conn, ch))[1])
        for n, chunks in ((4096, 1), (1 << 20, 16)):
            for _ in range(3):  # the round-robin start moves on every transfer: each stripe is picked first once
                used.clear()
                dst[:] = 0
                assert b.read("a", [Segment("kv", 0, "kv", 0, n)], "t").result(30) == n
                assert np.array_equal(dst[:n], src[:n]) and not dst[n:].any()
                assert len(used) == chunks and dead not in used
        for c in link:
            c.alive = False
        with pytest.raises(PeerError, match="all connections to 'a' closed"):
            b.read("a", [Segment("kv", 0, "kv", 0, 4096)], "t").result(30)
    finally:
        for c in b._out.get("a", []):
            c.alive = True
        a.close()
        b.close()


def _threads_of(*names: str) -> list[str]:
    import threading

    return sorted(t.name for t in threading.enumerate()
                  if t.is_alive() and any(t.name.endswith(f"-{n}") for n in names))


def _wait_threads_gone(*names: str, timeout: float = 10.0) -> list[str]:
    """The threads of ``names`` still alive after waiting up to ``timeout`` s for none to be left."""
    poll(lambda: not _threads_of(*names), timeout_s=timeout, interval_s=0.02)
    return _threads_of(*names)


def test_close_and_a_dropped_link_leave_no_thread_behind():
    """``close()`` ends the endpoint's accept thread and every reader thread, also the reader of an outbound link
    whose epoll is disarmed (a one-chunk read disarms it while its waiter reads the response itself). Before, closing
    the listening socket did not wake ``accept`` and closing a connection did not wake an ``epoll_wait`` on it: three
    threads (and an epoll and an eventfd) stayed per closed endpoint, and one per dropped link."""
    a, b, src, dst = _linked_pair(13, "r", {}, {"stripes": 2})
    try:
        assert b.read("a", [Segment("kv", 0, "kv", 0, 4096)], "t").result(30) == 4096  # one chunk: disarms a link
        assert np.array_equal(dst[:4096], src[:4096])
        assert _threads_of("a").count("dlmix-kv-rd-a") == 2, _threads_of("a")
        link = list(b._out["a"])
        b._drop_conn(link[0], "test drop")  # one stripe dropped while the endpoint lives on
        def readers_of_link() -> int:  # b's reader threads of its outbound connections to a
            return _threads_of("a").count("dlmix-kv-rd-a")

        poll(lambda: readers_of_link() <= 1, timeout_s=10, interval_s=0.02)
        assert readers_of_link() == 1, _threads_of("a")
        assert b.read("a", [Segment("kv", 0, "kv", 0, 4096)], "t").result(30) == 4096  # the other stripe serves
    finally:
        a.close()
        b.close()
    assert _wait_threads_gone("a", "b") == []


def _link_threads(peer: str) -> list[str]:
    """Reader and sender threads of outbound links to ``peer`` in this process."""
    return [t for t in _threads_of(peer) if t in (f"dlmix-kv-rd-{peer}", f"dlmix-kv-tx-{peer}")]


def test_a_link_whose_data_path_hook_fails_is_closed_not_leaked():
    """When the data-path hook fails after the stripes are dialed (an adapter whose library cannot reach the peer),
    ``connect`` raises and the stripes are dropped: no reader or sender thread stays, the peer sees them go, and a
    later ``close()`` has nothing left to miss. Before, each failed ``connect`` left two threads, a socket, an epoll
    and an eventfd per stripe."""

    class FailingHook(TcpTransport):
        def _dp_link_up(self, peer, desc, conns):
            raise PeerError("library cannot reach the peer")

    a = make_transport("tcp", name="ha", secret="s")
    b = FailingHook(name="hb", secret="s")
    try:
        for _ in range(3):
            with pytest.raises(PeerError, match="library cannot reach"):
                b.connect(a.descriptor())
        assert b._out == {}
        assert poll(lambda: _link_threads("ha") == [], timeout_s=10), _threads_of("ha")
        assert poll(lambda: a.peers() == [], timeout_s=10), a.peers()
    finally:
        b.close()
        a.close()
    assert _wait_threads_gone("ha", "hb") == []


def test_connect_on_a_closed_endpoint_or_racing_close_opens_nothing():
    """``connect`` after ``close()`` raises PeerError("transport closed"); a ``close()`` that runs while a
    ``connect`` is in its handshake makes that ``connect`` raise and drop the stripes it dialed, instead of adding a
    link nothing would close."""
    import threading

    a = make_transport("tcp", name="ca", secret="s")
    b = make_transport("tcp", name="cb", secret="s")
    c = make_transport("tcp", name="cc", secret="s")
    try:
        b.close()
        with pytest.raises(PeerError, match="transport closed"):
            b.connect(a.descriptor())
        in_handshake, go = threading.Event(), threading.Event()
        real = c._handshake_client

        def slow_handshake(sock, expect):
            info = real(sock, expect)
            in_handshake.set()
            go.wait(10)
            return info

        c._handshake_client = slow_handshake
        err = []
        th = threading.Thread(target=lambda: err.append(pytest.raises(PeerError, c.connect, a.descriptor())))
        th.start()
        assert in_handshake.wait(10)
        c.close()
        go.set()
        th.join(10)
        assert not th.is_alive() and err and "transport closed" in str(err[0].value)
        assert c._out == {}
    finally:
        for t in (a, b, c):
            t.close()
    assert _wait_threads_gone("ca", "cb", "cc") == []


def test_notify_to_a_peer_that_stopped_reading_times_out():
    """``notify(..., timeout_s)`` to an authenticated peer that never reads (a stopped decode process) raises
    TransferTimeout within about its timeout once the socket buffers are full, and drops that connection, so later
    notifications and the caller's other peers are not held behind it. Before, it blocked in ``sendall`` forever."""
    import threading

    from dlmix_kv_connectors import TransferTimeout
    from dlmix_kv_connectors.testing import raw_auth

    a = make_transport("tcp", name="na", secret="s")
    s = raw_auth(a.host, a.port, "stalled", "s")  # authenticated, never reads again
    out: dict = {"sent": 0, "err": None}

    def flood():
        try:
            for _ in range(200):  # 200 MiB: far beyond any loopback socket buffer
                a.notify("stalled", {"pad": "x" * (1 << 20)}, timeout_s=1.0)
                out["sent"] += 1
        except Exception as e:
            out["err"] = e

    th = threading.Thread(target=flood, daemon=True)
    try:
        th.start()
        th.join(30)
        assert not th.is_alive(), f"notify still blocked after 30 s ({out['sent']} MiB handed over)"
        assert isinstance(out["err"], TransferTimeout), out
        assert out["sent"] < 200
    finally:
        s.close()
        a.close()


def test_notify_to_a_peer_reading_a_little_at_a_time_is_bounded_by_its_timeout():
    """A peer that reads a few KiB at a time lets every send call make progress, so the socket's send timeout never
    fired and a ``notify(timeout_s=1)`` of 3 MiB that did not fit the socket's send buffer blocked as long as the peer
    took to read it (57 s measured). The deadline now bounds the whole notification: TransferTimeout."""
    import threading

    from dlmix_kv_connectors import TransferTimeout
    from dlmix_kv_connectors.testing import raw_auth

    a = make_transport("tcp", name="nd", secret="s")
    s = raw_auth(a.host, a.port, "dripping", "s")
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stop = threading.Event()

    def drip():
        while not stop.is_set():
            try:
                if not s.recv(4096):
                    return
            except OSError:
                return
            time.sleep(0.05)

    out: dict = {"err": None, "done": False}

    def send():
        try:
            for _ in range(8):  # the first ones may fit the socket's send buffer
                a.notify("dripping", {"pad": "x" * (3 << 20)}, timeout_s=1.0)
            out["done"] = True
        except Exception as e:
            out["err"] = e

    reader = threading.Thread(target=drip, daemon=True)
    sender = threading.Thread(target=send, daemon=True)
    try:
        reader.start()
        sender.start()
        sender.join(20)
        assert not sender.is_alive(), "notify(timeout_s=1) still sending after 20 s"
        assert isinstance(out["err"], TransferTimeout) and not out["done"], out
    finally:
        stop.set()
        s.close()
        a.close()


def test_a_peer_that_stops_reading_a_read_response_is_cut_off_at_the_owner_timeout():
    """An authenticated peer asks for a large granted read and never reads its socket. The owner stops sending within
    about its ``timeout_s`` and drops that connection only: other peers are served meanwhile and after, no byte the
    owner writes into the region after that reaches the stalled peer (a hold is released ``io_timeout_s`` after its
    revoke and its blocks reused), and ``close()`` is prompt. Before, the serving thread blocked in ``sendmsg``
    forever and kept streaming the region's bytes whenever the peer read again, long after revoke and unregister."""
    from dlmix_kv_connectors.testing import raw_auth

    n = 64 << 20  # far beyond the loopback socket buffers of both ends
    a = make_transport("tcp", name="sa", secret="s", timeout_s=1.0)
    b = make_transport("tcp", name="sb", secret="s")
    src = np.zeros(n, dtype=np.uint8)
    a.register("kv", src)
    a.grant("evil", "big", [("kv", 0, n)], "r", None)
    a.grant("sb", "small", [("kv", 0, 4096)], "r", None)
    dst = np.ones(4096, dtype=np.uint8)
    b.register("kv", dst)
    s = raw_auth(a.host, a.port, "evil", "s")
    try:
        s.sendall(W.pack(W.REQ, W.Req(1, "r", "big", "tcp", [("kv", 0, n)])))
        b.connect(a.descriptor())
        assert b.read("sa", [Segment("kv", 0, "kv", 0, 4096)], "small").result(10) == 4096 and not dst.any()
        assert poll(lambda: "evil" not in a.peers(), timeout_s=8, interval_s=0.05), \
            "the owner still serves a read to a peer that stopped reading 8 s ago (timeout_s=1)"
        a.revoke("big")
        src[:] = 0xAB  # the blocks are reused for another request
        s.settimeout(5)
        got = 0
        try:
            while chunk := s.recv(1 << 20):
                assert 0xAB not in chunk, "bytes written after the cut-off reached the stalled peer"
                got += len(chunk)
        except (ConnectionResetError, socket.timeout):
            pass
        assert got < n
        dst[:] = 1
        assert b.read("sa", [Segment("kv", 0, "kv", 0, 4096)], "small").result(10) == 4096 and (dst == 0xAB).all()
        t0 = time.monotonic()
        a.close()
        assert time.monotonic() - t0 < 2.0
    finally:
        s.close()
        a.close()
        b.close()
    assert _wait_threads_gone("sa", "sb", timeout=5) == []



def test_a_peer_that_stalls_mid_write_payload_is_cut_off_at_the_owner_timeout():
    """An authenticated peer sends a granted write's request and half its payload, then stalls. The owner drops that
    connection about ``timeout_s`` later, so the rest of the payload, sent after the grant was revoked, never lands in
    the region. Before, the serving thread waited in ``recv`` forever and wrote the late bytes into the region."""
    from dlmix_kv_connectors.testing import half_written_write

    n = 1 << 20
    a = make_transport("tcp", name="wsa", secret="s", timeout_s=1.0)
    dst, s = half_written_write(a, n, "s")
    try:
        assert poll(lambda: "evil" not in a.peers(), timeout_s=8, interval_s=0.05), \
            "the owner still waits for the payload of a peer that stalled 8 s ago (timeout_s=1)"
        a.revoke("w")
        try:
            s.sendall(b"\x22" * (n // 2))
        except OSError:
            pass
        time.sleep(0.3)
        assert not (dst == 0x22).any(), "bytes sent after the cut-off landed in the region"
    finally:
        s.close()
        a.close()
    assert _wait_threads_gone("wsa", timeout=5) == []


def _hs_threads(name: str) -> int:
    import threading

    return sum(1 for t in threading.enumerate() if t.is_alive() and t.name == f"dlmix-kv-hs-{name}")


def test_one_host_cannot_take_every_handshake_slot():
    """Idle connections from one address hold at most ``max_handshakes_per_host`` handshake slots; the rest are
    answered ``busy`` and closed at once. Before, 8 idle connections from 127.0.0.2 took all 8 slots for
    ``handshake_timeout_s`` (60 s here) and a peer from 127.0.0.1 could not connect within 30 s. A peer whose own
    address is at its cap tries again and gets in once a slot of its address frees."""
    import threading

    a = make_transport("tcp", name="hph", secret="s", handshake_timeout_s=60, max_handshakes=8,
                       max_handshakes_per_host=2)
    b = make_transport("tcp", name="hpb", secret="s")
    c = make_transport("tcp", name="hpc", secret="s")
    idle = [socket.create_connection((a.host, a.port), timeout=5, source_address=("127.0.0.2", 0))
            for _ in range(8)]
    mine = []
    try:
        for k in idle[2:]:  # answered busy, not held
            k.settimeout(10)
            ftype, blen, _ = W.read_frame_header(k, memoryview(bytearray(W.HEADER_SIZE)), W.PREAUTH_MAX_BODY, 0)
            assert ftype == W.ERROR and W.read_body(k, ftype, blen).reason.startswith("busy:")
        assert a.stats["busy_refusals"] == 6
        assert poll(lambda: _hs_threads("hph") == 2, timeout_s=10, interval_s=0.02), _hs_threads("hph")
        b.connect(a.descriptor(), timeout_s=30)  # from 127.0.0.1: not behind 127.0.0.2's idle connections
        assert "hpb" in a.peers()
        # 127.0.0.1 at its cap: c is answered busy, tries again, and gets in when one of these ends
        mine = [socket.create_connection((a.host, a.port), timeout=5) for _ in range(2)]
        assert poll(lambda: a._hs_hosts.get("127.0.0.1") == 2, timeout_s=10, interval_s=0.02), a._hs_hosts
        t = threading.Thread(target=c.connect, args=(a.descriptor(),), kwargs={"timeout_s": 60})
        t.start()
        assert poll(lambda: a.stats["busy_refusals"] > 6, timeout_s=30, interval_s=0.01), a.stats
        assert "hpc" not in a.peers()
        mine.pop().close()
        t.join(60)
        assert "hpc" in a.peers()
    finally:
        for k in idle + mine:
            k.close()
        a.close()
        b.close()
        c.close()
    assert _wait_threads_gone("hph", "hpb", "hpc", timeout=5) == []


def test_close_ends_handshakes_that_never_complete():
    """Connections accepted but never authenticated (silent, half a header, a HELLO and no AUTH) do not keep threads
    after ``close()``: before, each handshake thread lived on for up to ``handshake_timeout_s`` (10 s) per step."""
    a = make_transport("tcp", name="hsa", secret="s")  # default handshake_timeout_s: 10 s
    hello = W.pack(W.HELLO, W.Hello(W.VERSION, "x", "00" * 32))
    socks = [socket.create_connection((a.host, a.port), timeout=5) for _ in range(3)]
    try:
        socks[1].sendall(hello[:7])
        socks[2].sendall(hello)
        assert poll(lambda: _hs_threads("hsa") == 3, timeout_s=5, interval_s=0.02), _hs_threads("hsa")
        t0 = time.monotonic()
        a.close()
        assert time.monotonic() - t0 < 2.0
        assert poll(lambda: _hs_threads("hsa") == 0, timeout_s=3, interval_s=0.02), \
            f"{_hs_threads('hsa')} handshake threads alive 3 s after close()"
    finally:
        for s in socks:
            s.close()
        a.close()


def test_a_slow_loris_handshake_is_cut_off():
    """A peer that drips its HELLO one byte at a time is dropped about ``handshake_timeout_s`` after the step began:
    before, each byte restarted the timeout, so a byte every 0.1 s held the connection and its thread for as long as
    the peer liked (a HELLO is ~120 B, a pre-auth body may be 64 KiB)."""
    import threading

    a = make_transport("tcp", name="hla", secret="s", handshake_timeout_s=0.5)
    hello = W.pack(W.HELLO, W.Hello(W.VERSION, "x", "00" * 32))
    stop = threading.Event()
    cut: list = []

    def drip():
        with socket.create_connection((a.host, a.port), timeout=5) as s:
            t0 = time.monotonic()
            try:
                for i in range(len(hello)):
                    if stop.wait(0.1):
                        return
                    s.sendall(hello[i:i + 1])
            except OSError:
                pass
            try:  # the endpoint answers ERROR and closes; wait for the close
                s.settimeout(5)
                while s.recv(4096):
                    pass
            except OSError:
                pass
            cut.append(time.monotonic() - t0)

    th = threading.Thread(target=drip, daemon=True)
    try:
        th.start()
        th.join(4)
        stop.set()
        assert cut and cut[0] < 3.0, "a peer dripping its HELLO byte by byte still held its handshake after 4 s " \
                                     "(handshake_timeout_s=0.5)"
    finally:
        stop.set()
        a.close()
        th.join(10)
    assert _wait_threads_gone("hla", timeout=5) == []


def test_handshakes_in_progress_are_capped():
    """At most ``max_handshakes`` accepted connections are in their handshake at once; the rest wait in the listen
    backlog, so idle connections cannot make the endpoint start a thread each (before: one thread per connection, 500
    idle connections = 500 threads for ``handshake_timeout_s``). A real peer queued behind them still gets in."""
    a = make_transport("tcp", name="hca", secret="s", handshake_timeout_s=0.5, max_handshakes=4)
    b = make_transport("tcp", name="hcb", secret="s")
    idle = [socket.create_connection((a.host, a.port), timeout=5) for _ in range(20)]
    try:
        seen = 0
        for _ in range(20):
            seen = max(seen, _hs_threads("hca"))
            time.sleep(0.02)
        assert seen <= 4, f"{seen} handshake threads for 20 idle connections (max_handshakes=4)"
        b.connect(a.descriptor(), timeout_s=15)  # admitted once the idle ones ahead of it timed out
        assert "hcb" in a.peers()
    finally:
        for s in idle:
            s.close()
        a.close()
        b.close()
    assert _wait_threads_gone("hca", "hcb", timeout=5) == []


def test_a_dialer_answered_busy_tries_until_its_connect_timeout():
    """A peer that stays busy: the dialer keeps trying for its whole connect timeout, then says so. Before, it gave up
    up to one back-off step (0.5 s) early, its last try never made, while its message said it waited the whole time."""
    from dlmix_kv_connectors import TransferTimeout

    a = make_transport("tcp", name="bdl", secret="s", handshake_timeout_s=60, max_handshakes=8,
                       max_handshakes_per_host=1)
    c = make_transport("tcp", name="bdc", secret="s")
    hold = socket.create_connection((a.host, a.port), timeout=5)  # 127.0.0.1's only handshake slot, idle
    try:
        assert poll(lambda: a._hs_hosts.get("127.0.0.1") == 1, timeout_s=10, interval_s=0.02), a._hs_hosts
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="stayed busy"):
            c.connect(a.descriptor(), timeout_s=2.0)
        assert time.monotonic() - t0 >= 1.95
    finally:
        hold.close()
        a.close()
        c.close()
    assert _wait_threads_gone("bdl", "bdc", timeout=5) == []


def test_a_refused_grant_grants_nothing():
    """A grant call that raises leaves no grant behind: a bad ``expires_s`` (a string, negative, NaN, infinite) used
    to be checked only after the grant was stored, with no expiry at all: a permanent grant from a failed call."""
    t = make_transport("tcp", name="g", secret="s")
    try:
        t.register("L0", bytearray(4096))
        for bad in ("x", -1, float("nan"), float("inf"), True):
            with pytest.raises(ValueError, match="expires_s"):
                t.grant("D", f"t{bad}", [("L0", 0, 16)], expires_s=bad)
        for ranges in ([("L0", 0)], ("L0", 0, 16), [("L0", 0, 16, 1)], "L0"):
            with pytest.raises(ValueError, match="range"):
                t.grant("D", "tr", ranges)
        assert t._grants == {}
        t.grant("D", "ok", [("L0", 0, 16)], expires_s=0)  # already lapsed: allowed (tests use it)
        assert list(t._grants) == ["ok"]
    finally:
        t.close()


def test_many_ranges_of_one_grant_merge_exactly():
    """Ranges of one grant call are merged in one sort (one at a time was quadratic: 20,000 ranges took 96 s): every
    other 16-byte run of a region, then the runs between, end as one granted interval."""
    t = make_transport("tcp", name="gm", secret="s")
    try:
        t.register("L0", bytearray(32 * 5000))
        t.grant("D", "t", [("L0", 32 * i, 16) for i in range(5000)])
        starts, ends = t._grants["t"].table["r"]["L0"]
        assert len(starts) == 5000 and starts[:2] == [0, 32] and ends[-1] == 32 * 4999 + 16
        t.grant("D", "t", [("L0", 32 * i + 16, 16) for i in range(5000)])
        assert t._grants["t"].table["r"]["L0"] == ([0], [32 * 5000])
    finally:
        t.close()


@pytest.mark.parametrize("kw, what", [({"max_payload": 0}, "max_payload"), ({"max_payload": -1}, "max_payload"),
                                      ({"chunk_bytes": 0}, "chunk_bytes"), ({"stripes": 0}, "stripes"),
                                      ({"max_segs": 0}, "max_segs"), ({"secret": 123}, "secret"),
                                      ({"secret": True}, "secret"), ({"name": 5}, "name"), ({"name": ""}, "name"),
                                      ({"timeout_s": float("nan")}, "timeout_s"), ({"timeout_s": 0}, "timeout_s")])
def test_endpoint_settings_out_of_range_are_refused(kw, what):
    """``max_payload=0`` made the first read cut its transfer into empty chunks forever (memory growing); a non-str
    secret was turned into zero bytes (``secret=123``: 123 zero bytes)."""
    with pytest.raises(ValueError, match=what):
        make_transport("tcp", **{"name": "x", "secret": "s", **kw})


def test_a_failed_connect_leaves_no_descriptor_behind():
    """Descriptors come from requests: one that cannot be reached is not kept (300 made-up names with 1 MiB of junk
    each grew a decode worker by 300 MB); a known peer's earlier descriptor stays."""
    t = make_transport("tcp", name="c", secret="s")
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there
    try:
        for i in range(3):
            with pytest.raises(Exception):
                t.connect({"kind": "tcp", "name": f"ghost{i}", "host": "127.0.0.1", "port": port,
                           "junk": "x" * 1000}, timeout_s=1)
        assert t._desc == {}
    finally:
        t.close()


def test_json_nested_too_deeply_is_a_protocol_error():
    """A 2 KB body of nested arrays made msgspec raise RecursionError, which the handshake logged as an internal
    error with a traceback; it is a malformed frame like any other."""
    body = b'{"msg":{"a":' + b"[" * 100000 + b"]" * 100000 + b"}}"
    with pytest.raises(ProtocolError, match="nested too deeply"):
        W.decode_body(W.NOTIFY, body)


@pytest.mark.parametrize("bad", [{"port": True}, {"port": -1}, {"port": 70000}, {"kind": ["tcp"]}])
def test_a_descriptor_with_a_bad_port_or_kind_is_a_value_error(bad):
    """As documented for a malformed descriptor: ValueError naming the field (a port of True, -1 or 70000 gave a
    PeerError from the dial, a list as kind a TypeError)."""
    t = make_transport("tcp", name="bd", secret="s")
    try:
        with pytest.raises(ValueError, match="port|kind"):
            t.connect({"kind": "tcp", "name": "x", "host": "127.0.0.1", "port": 9, **bad}, timeout_s=1)
    finally:
        t.close()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0, -1, "5", True])
def test_a_call_timeout_that_is_not_a_positive_finite_number_is_refused(bad):
    """``read(..., timeout_s=nan)`` set a deadline no clock reaches (a stalled peer then held the transfer forever);
    read, write and notify refuse such a timeout before anything is sent."""
    a = make_transport("tcp", name="ta", secret="s")
    b = make_transport("tcp", name="tb", secret="s")
    try:
        a.register("kv", bytearray(64))
        b.register("kv", bytearray(64))
        a.grant("tb", "t", [("kv", 0, 64)], "rw")
        b.connect(a.descriptor())
        for call in (lambda: b.read("ta", [Segment("kv", 0, "kv", 0, 16)], "t", timeout_s=bad),
                     lambda: b.write("ta", [Segment("kv", 0, "kv", 0, 16)], "t", timeout_s=bad),
                     lambda: b.notify("ta", {"x": 1}, timeout_s=bad)):
            with pytest.raises(ValueError, match="timeout_s"):
                call()
        assert b.read("ta", [Segment("kv", 0, "kv", 0, 16)], "t", timeout_s=5).result(10) == 16
    finally:
        a.close()
        b.close()


def test_a_pointer_region_of_booleans_is_refused():
    """``register("r", (True, 10))`` was taken as host address 1."""
    from dlmix_kv_connectors import UnsupportedMemoryError

    t = make_transport("tcp", name="pb", secret="s")
    try:
        for bad in ((True, 10), (4096, False)):
            with pytest.raises(UnsupportedMemoryError, match="booleans"):
                t.register("r", bad)
    finally:
        t.close()


def test_concurrent_first_connects_to_one_peer_set_up_one_link():
    """Four threads connect to a new peer at once (a decode's pull threads, each for its own request): the link is set
    up once, ``stripes`` connections, and every thread gets it. Before, each thread that found no live connection
    dialed its own stripes (8 connections instead of 2, never trimmed; an adapter re-added the peer under a transfer
    in flight). A connect waiting behind a silent peer's set-up gives up at its own timeout."""
    import threading

    from dlmix_kv_connectors import TransferTimeout

    a = make_transport("tcp", name="a4", secret="s", stripes=2)
    b = make_transport("tcp", name="b4", secret="s")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        def connect():
            assert a.connect(b.descriptor(), timeout_s=10) == "b4"

        errors = _at_once(4, connect)
        assert errors == [] and len([c for c in a._out["b4"] if c.alive]) == 2, (errors, a._out["b4"])
        desc = {"kind": "tcp", "name": "quiet", "host": "127.0.0.1", "port": silent.getsockname()[1]}
        first = threading.Thread(target=lambda: pytest.raises(Exception, a.connect, desc, timeout_s=3))
        first.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            a.connect(desc, timeout_s=1)  # queued behind the first set-up: bounded by its own timeout
        assert time.monotonic() - t0 < 2.5
        first.join(10)
        assert a._dialing == {}
    finally:
        a.close()
        b.close()
        silent.close()


def test_concurrent_failed_connects_to_one_peer_leave_no_descriptor_behind():
    """Two pull threads connect to the same unreachable made-up peer (a listener that never answers the handshake):
    the first gives up at its timeout while the second is still queued behind its set-up, then the second gives up
    too. No descriptor of that name stays. Before, the first found the second's descriptor in place and left it, and
    the second put back the first's as the 'earlier' one: the name was remembered for good, as a real peer's is."""
    import threading

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    a = make_transport("tcp", name="a5", secret="s")
    try:
        desc = {"kind": "tcp", "name": "ghost", "host": "127.0.0.1", "port": silent.getsockname()[1]}
        errors = []

        def go(timeout):
            try:
                a.connect(dict(desc), timeout_s=timeout)
            except Exception as e:  # noqa: BLE001 - checked below
                errors.append(e)

        first = threading.Thread(target=go, args=(1.0,))
        first.start()
        assert poll(lambda: a._dialing.get("ghost", [None, 0])[1] == 1, 10)  # the first is setting the link up
        second = threading.Thread(target=go, args=(2.5,))
        second.start()
        assert poll(lambda: a._dialing.get("ghost", [None, 0])[1] == 2, 10)  # the second waits behind it
        first.join(10)
        second.join(10)
        assert len(errors) == 2, errors
        # each names its own connect timeout (the second's said 1.5 s: the time it had left after waiting its turn)
        msgs = sorted(str(e) for e in errors)
        assert any("within 1.0 s" in m or "after 1.0 s" in m for m in msgs), msgs
        assert any("within 2.5 s" in m or "after 2.5 s" in m for m in msgs), msgs
        assert "ghost" not in a._desc and a._dialing == {}
        with pytest.raises(PeerError, match="not connected"):
            a.notify("ghost", {"x": 1})  # forgotten: not dialed again from the stale descriptor
    finally:
        a.close()
        silent.close()


def test_close_ends_a_connect_to_a_silent_peer_at_once():
    """A pull thread connecting to a prefill that accepts and never answers the handshake (connect timeout 60 s here)
    when its endpoint closes (the engine shuts down): the connect fails at once with 'transport closed', and a
    connect queued behind it too; no thread is left waiting out the timeout. Before, both ran to their timeout
    after close()."""
    import threading

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    a = make_transport("tcp", name="a6", secret="s")
    desc = {"kind": "tcp", "name": "quiet6", "host": "127.0.0.1", "port": silent.getsockname()[1]}
    errors = []

    def go():
        try:
            a.connect(dict(desc), timeout_s=8)
        except Exception as e:  # noqa: BLE001 - checked below
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        assert poll(lambda: a._dialing.get("quiet6", [None, 0])[1] == 2, 10)  # one dials, one waits behind it
        a.close()
        for t in threads:
            t.join(20)  # well before their 60 s connect timeout
        assert not any(t.is_alive() for t in threads), errors
        assert len(errors) == 2 and all(isinstance(e, PeerError) and "closed" in str(e) for e in errors), errors
    finally:
        a.close()
        silent.close()
        for t in threads:
            t.join(70)


def test_threads_that_find_a_link_down_set_it_up_again_once():
    """A peer's link went down (its connections dropped, e.g. by a timed-out transfer); four pull threads then notify
    it at once (their extends): the link is set up again once, ``stripes`` connections. Before, each thread that
    found no live connection dialed its own stripes (8 connections instead of 2, never trimmed), as concurrent first
    connects did before they went through one set-up per peer."""
    import threading

    a = make_transport("tcp", name="a7", secret="s", stripes=2)
    b = make_transport("tcp", name="b7", secret="s")
    try:
        a.connect(b.descriptor())
        for c in list(a._out["b7"]):
            a._drop_conn(c, "test: link lost")
        other = threading.Event()
        dial, first = a._dial, []

        def dial_and_wait_for_company(*args):  # the first dial waits (up to 1 s) for another thread to dial too
            if not first:
                first.append(1)
                other.wait(1.0)
            else:
                other.set()
            return dial(*args)

        a._dial = dial_and_wait_for_company
        errors = _at_once(4, lambda: a.notify("b7", {"x": 1}))
        assert errors == [] and len([c for c in a._out["b7"] if c.alive]) == 2, (errors, a._out["b7"])
    finally:
        a.close()
        b.close()


def test_a_connect_dials_its_own_descriptor_while_another_connect_to_that_name_brings_a_stale_one():
    """Two pull threads connect to one prefill name at once: one with the prefill's current descriptor, one with a
    stale descriptor from a request made before the prefill restarted on a new port. The connect with the current
    descriptor links up whatever the order; the name's descriptor afterwards is the one that worked. Before, each
    connect dialed whichever descriptor was written last, so the good one could dial the stale port and fail."""
    import threading

    a = make_transport("tcp", name="a8", secret="s")
    b = make_transport("tcp", name="b8", secret="s")
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    stale = dict(b.descriptor(), port=dead.getsockname()[1])
    dead.close()  # the prefill's old port: nothing listens there any more
    link_once, waited, second_in = a._link_once, [], threading.Event()

    def wait_for_the_other(peer, timeout, *rest):  # the first connect goes on once the second wrote its descriptor
        if not waited:
            waited.append(1)
            assert second_in.wait(10)
        else:
            second_in.set()
        return link_once(peer, timeout, *rest)

    a._link_once = wait_for_the_other
    errors = []

    def go(desc):
        try:
            a.connect(dict(desc), timeout_s=5)
        except Exception as e:  # noqa: BLE001 - checked below
            errors.append((desc["port"], e))

    try:
        good = threading.Thread(target=go, args=(b.descriptor(),))
        good.start()
        assert poll(lambda: a._connecting.get("b8") == 1, 10)
        old = threading.Thread(target=go, args=(stale,))
        old.start()
        good.join(20)
        old.join(20)
        assert all(port == stale["port"] for port, _ in errors), errors  # only the stale descriptor may fail
        assert [c for c in a._out["b8"] if c.alive] and a._desc["b8"]["port"] == b.port
        a.notify("b8", {"x": 1})
    finally:
        a.close()
        b.close()


def _at_once(n: int, fn) -> list:
    """Run ``fn`` on ``n`` threads released together (a barrier); the exceptions they raised (joined within 30 s
    each)."""
    import threading

    start, errors = threading.Barrier(n), []

    def go():
        start.wait()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_a_stale_descriptor_that_reuses_the_live_link_does_not_become_the_names_descriptor():
    """A request made before the prefill restarted on a new port brings a stale descriptor after the link to the new
    port is up: its connect reuses the live link (and succeeds), but it dialed nothing, so the name keeps the
    descriptor that worked. Before, the stale one was recorded as the last successful connect's, and when the link
    later went down it was set up again to the old port (PeerError/TransferTimeout)."""
    a = make_transport("tcp", name="a9", secret="s")
    b = make_transport("tcp", name="b9", secret="s")
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    stale = dict(b.descriptor(), port=dead.getsockname()[1])
    dead.close()
    try:
        assert a.connect(b.descriptor(), timeout_s=5) == "b9"
        assert a.connect(stale, timeout_s=5) == "b9"  # the live link serves it
        assert a._desc["b9"]["port"] == b.port and a._linked["b9"]["port"] == b.port
        for c in list(a._out["b9"]):
            a._drop_conn(c, "test: link lost")
        a.notify("b9", {"x": 1})  # the link is set up again, to the port that worked
        assert [c.alive for c in a._out["b9"]] and all(c.alive for c in a._out["b9"])
    finally:
        a.close()
        b.close()
