"""Regression tests of the built-in TCP transport core (``dlmix_kv_connectors._core``) against a peer that speaks the
wire protocol by hand: a failure is reported only once no byte of the transfer can land in local memory, the outbound
handshake is bounded by the connect timeout in all, and ``unregister()`` returns only once no request being served
touches the region."""
from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from dlmix.testing import poll
from dlmix_kv_connectors import GrantError, PeerError, Segment, TransferTimeout, make_transport
from dlmix_kv_connectors import _wire as W


def _serve_handshake(sock: socket.socket, name: str, secret: bytes) -> str:
    """The listening side of the wire handshake, by hand, on an accepted ``sock``; returns the client's name."""
    hdr = memoryview(bytearray(W.HEADER_SIZE))
    ftype, blen, _ = W.read_frame_header(sock, hdr, W.PREAUTH_MAX_BODY, 0)
    hello = W.read_body(sock, ftype, blen)
    nc, ns = bytes.fromhex(hello.nonce), os.urandom(32)
    sock.sendall(W.pack(W.CHALLENGE, W.Challenge(name, ns.hex(), W.mac(secret, b"server", nc, ns, name, hello.name))))
    ftype, blen, _ = W.read_frame_header(sock, hdr, W.PREAUTH_MAX_BODY, 0)
    W.read_body(sock, ftype, blen)
    sock.sendall(W.pack(W.AUTH_OK, W.AuthOk({})))
    return hello.name


def _read_req(sock: socket.socket) -> W.Req:
    hdr = memoryview(bytearray(W.HEADER_SIZE))
    ftype, blen, plen = W.read_frame_header(sock, hdr, 1 << 20, 0)
    assert ftype == W.REQ and plen == 0
    return W.read_body(sock, ftype, blen)


class _FakeOwner:
    """A listener that authenticates ``n`` connections as owner ``name`` and then leaves them to the test."""

    def __init__(self, name: str, secret: str, n: int):
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(8)
        self.name, self.secret, self.n = name, secret.encode(), n
        self.socks: list[socket.socket] = []
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self) -> None:
        self.lsock.settimeout(10)
        for _ in range(self.n):
            s, _ = self.lsock.accept()
            s.settimeout(10)
            _serve_handshake(s, self.name, self.secret)
            self.socks.append(s)

    def descriptor(self) -> dict:
        return {"kind": "tcp", "name": self.name, "host": "127.0.0.1", "port": self.lsock.getsockname()[1]}

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.lsock.close()
        self.th.join(5)


@pytest.mark.parametrize("how", ["refused", "dropped"])
def test_a_failed_chunk_is_reported_only_once_no_other_chunk_can_land(how):
    """A read cut into two chunks, one per stripe: the owner refuses one chunk (or its connection drops) while the
    other chunk's payload is half received. The failure must not be reported (and ``cancel()`` must not return) while
    that payload can still land: the PD consumer reuses its staging region right after a failed read. Before, the
    handle failed at once, ``cancel()`` returned False without waiting, and the rest of the payload landed later."""
    n = 2 << 20  # two chunks of 1 MiB (min_stripe_bytes) over the two stripes
    owner = _FakeOwner("fo", "s", 2)
    a = make_transport("tcp", name="fa", secret="s", stripes=2, timeout_s=10)
    dst = np.zeros(n, dtype=np.uint8)
    a.register("dst", dst)
    try:
        a.connect(owner.descriptor(), timeout_s=10)
        owner.th.join(5)
        h = a.read("fo", [Segment("dst", 0, "kv", 0, n)], "t")
        reqs = [(s, _read_req(s)) for s in owner.socks]
        (s0, r0), (s1, r1) = sorted(reqs, key=lambda sr: sr[1].segs[0][1])
        half = r1.segs[0][2] // 2
        # chunk 1 (dst[n/2:]): the response header and half its payload, then a stall
        s1.sendall(W.pack(W.RESP, W.Resp(r1.id, True, n=r1.segs[0][2]), r1.segs[0][2]) + b"\x11" * half)
        assert poll(lambda: (dst == 0x11).sum() == half, timeout_s=5, interval_s=0.01)
        # chunk 0 fails
        if how == "refused":
            s0.sendall(W.pack(W.RESP, W.Resp(r0.id, False, code="grant", err="not granted")))
        else:
            s0.shutdown(socket.SHUT_RDWR)
        done_at = None
        if h.wait(0.5):  # the failure is reported: from now on no byte may land in dst
            done_at = dst.copy()
            assert h.cancel() is False
            dst[:] = 0x33  # the staging region is reused at once
        s1.sendall(b"\x22" * half)  # the rest of chunk 1's payload arrives late
        assert h.wait(10), "the transfer never ended"
        err = h.exception()
        assert isinstance(err, GrantError if how == "refused" else PeerError), repr(err)
        if done_at is not None:
            assert not poll(lambda: (dst == 0x22).any(), timeout_s=1, interval_s=0.01), \
                "bytes of the transfer landed in local memory after its failure was reported"
        else:  # the failure waited for chunk 1's payload to land
            assert (dst[n // 2 + half:] == 0x22).all()
    finally:
        a.close()
        owner.close()


def test_the_outbound_handshake_is_bounded_in_all_by_the_connect_timeout():
    """A listener that answers the HELLO one byte every 0.3 s holds ``connect(timeout_s=1)`` for about 1 s, not for
    as long as it keeps dripping: before, each byte received restarted the socket timeout (a CHALLENGE is ~220 B,
    so about a minute)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    stop = threading.Event()

    def drip():
        lsock.settimeout(5)
        s, _ = lsock.accept()
        with s:
            s.settimeout(5)
            hdr = memoryview(bytearray(W.HEADER_SIZE))
            ftype, blen, _ = W.read_frame_header(s, hdr, W.PREAUTH_MAX_BODY, 0)
            hello = W.read_body(s, ftype, blen)
            frame = W.pack(W.CHALLENGE, W.Challenge("drip", "00" * 32, W.mac(b"s", b"server", bytes.fromhex(
                hello.nonce), bytes(32), "drip", hello.name)))
            for i in range(len(frame)):
                if stop.wait(0.3):
                    return
                try:
                    s.sendall(frame[i:i + 1])
                except OSError:
                    return

    th = threading.Thread(target=drip, daemon=True)
    th.start()
    a = make_transport("tcp", name="da", secret="s", stripes=1)
    out: list = []

    def dial():
        try:
            a.connect({"kind": "tcp", "name": "drip", "host": "127.0.0.1", "port": lsock.getsockname()[1]},
                      timeout_s=1.0)
            out.append("connected")
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out.append(e)

    dialer = threading.Thread(target=dial, daemon=True)
    try:
        dialer.start()
        dialer.join(5)
        assert out, "connect(timeout_s=1) still in its handshake after 5 s with a peer dripping one byte per 0.3 s"
        assert isinstance(out[0], TransferTimeout), repr(out[0])
    finally:
        stop.set()
        th.join(5)
        lsock.close()
        a.close()
        dialer.join(5)


def test_unregister_returns_only_once_no_request_served_from_the_region_can_touch_it():
    """A peer's granted write is being served (half its payload received) when the owner unregisters the region and
    reuses its memory. Bytes of that write must not land after ``unregister()`` returned: it waits for the request
    (here: until its payload is in) or cuts its connection off. Before, it returned at once and the rest of the
    payload was written into the reused memory."""
    from dlmix_kv_connectors.testing import half_written_write

    n = 1 << 20
    a = make_transport("tcp", name="ua", secret="s", timeout_s=10)
    dst, s = half_written_write(a, n, "s")
    returned = threading.Event()

    def unregister():
        a.unregister("kv")
        dst[:] = 0x33  # the memory is reused at once
        returned.set()

    th = threading.Thread(target=unregister, daemon=True)
    try:
        th.start()
        returned.wait(0.5)
        s.sendall(b"\x22" * (n // 2))
        assert returned.wait(15), "unregister() did not return"
        assert not poll(lambda: (dst == 0x22).any(), timeout_s=1, interval_s=0.01), \
            "bytes of a request served from the region landed after unregister() returned"
    finally:
        s.close()
        a.close()
        th.join(5)
