"""Wire format of dlmix's control/data channel: a fixed binary header, a msgspec-JSON body, an optional raw payload.

Frame = header (16 bytes, ``struct "!2sBBIQ"``: magic ``b"DX"``, version, frame type, body length in bytes, payload
length in bytes) + body (JSON object, at most ``max_body`` bytes) + payload (raw bytes, at most ``max_payload``).
Nothing is ever unpickled. Bodies are decoded straight into typed msgspec Structs, so a wrong type or a missing field
is a :class:`ProtocolError`.

Authentication (both directions, secret never sent): client → HELLO{name, nonce_c}; server → CHALLENGE{name, nonce_s,
mac_s = HMAC-SHA256(secret, "dlmix-kv-server" | nonce_c | nonce_s | server | client)}; client checks mac_s, then →
AUTH{mac_c = HMAC(secret, "dlmix-kv-client" | nonce_c | nonce_s | client | server), info}; server checks mac_c →
AUTH_OK{info}. Both nonces are 32 random bytes, so a recorded exchange cannot be replayed.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

import msgspec

from .base import PeerError, ProtocolError

MAGIC = b"DX"
VERSION = 1
HEADER = struct.Struct("!2sBBIQ")
HEADER_SIZE = HEADER.size  # 16

# frame types
HELLO, CHALLENGE, AUTH, AUTH_OK, REQ, RESP, NOTIFY, ERROR = range(1, 9)
FRAME_NAMES = {HELLO: "HELLO", CHALLENGE: "CHALLENGE", AUTH: "AUTH", AUTH_OK: "AUTH_OK", REQ: "REQ", RESP: "RESP",
               NOTIFY: "NOTIFY", ERROR: "ERROR"}

PREAUTH_MAX_BODY = 64 * 1024
MAX_NAME = 256
IOV_BATCH = 512  # buffers per sendmsg/recvmsg_into call (below IOV_MAX = 1024)
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
RX_BUFFER = 256 * 1024  # bytes of a connection's receive buffer (FrameReader)
RX_DIRECT = 64 * 1024  # payloads from this size on are received straight into their destination


class Hello(msgspec.Struct):
    v: int
    name: str
    nonce: str


class Challenge(msgspec.Struct):
    name: str
    nonce: str
    mac: str


class Auth(msgspec.Struct):
    mac: str
    info: dict = {}


class AuthOk(msgspec.Struct):
    info: dict = {}


class Req(msgspec.Struct):
    """A one-sided op request. ``segs`` are the owner's ``(region, offset, length)``; ``dp`` the data path
    (``"tcp"``: payload in the frames, ``"cma"``: owner copies with process_vm_*, ``"authz"``: grant check only, the
    adapter library moves the bytes); ``iov`` the initiator's ``(address, length)`` per segment for ``"cma"``."""

    id: int
    op: str
    tid: str
    dp: str
    segs: list[tuple[str, int, int]]
    iov: list[tuple[int, int]] = []
    pid: int = 0


class Resp(msgspec.Struct):
    id: int
    ok: bool
    n: int = 0
    code: str = ""
    err: str = ""
    iov: list[tuple[int, int]] = []


class Notify(msgspec.Struct):
    msg: dict


class Error(msgspec.Struct):
    reason: str


DECODERS = {
    HELLO: msgspec.json.Decoder(Hello),
    CHALLENGE: msgspec.json.Decoder(Challenge),
    AUTH: msgspec.json.Decoder(Auth),
    AUTH_OK: msgspec.json.Decoder(AuthOk),
    REQ: msgspec.json.Decoder(Req),
    RESP: msgspec.json.Decoder(Resp),
    NOTIFY: msgspec.json.Decoder(Notify),
    ERROR: msgspec.json.Decoder(Error),
}
ENC = msgspec.json.Encoder()


def pack(ftype: int, body, payload_len: int = 0) -> bytes:
    """Header + encoded body for frame type ``ftype`` (the payload, if any, is sent after it)."""
    b = ENC.encode(body)
    return HEADER.pack(MAGIC, VERSION, ftype, len(b), payload_len) + b


def mac(secret: bytes, role: bytes, nonce_c: bytes, nonce_s: bytes, a: str, b: str) -> str:
    """HMAC-SHA256 hex of the handshake transcript (see module docstring)."""
    msg = b"dlmix-kv-" + role + b"|" + nonce_c + b"|" + nonce_s + b"|" + a.encode() + b"|" + b.encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def new_nonce() -> bytes:
    return os.urandom(32)


# ---- socket helpers: zero-copy from / into memoryviews ----


def recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``: one ``recv_into(MSG_WAITALL)`` (the kernel returns only once all bytes are in, so
    one syscall and one GIL round trip per view instead of one per arriving TCP segment). With ``deadline``
    (``time.monotonic()`` seconds) the whole fill must end by then: each ``recv`` waits only for the time left, so a
    peer that drips a byte now and then cannot stretch the wait (the handshake's reads); the socket is left in
    timeout mode. Raises PeerError on EOF, TimeoutError past the deadline, OSError."""
    pos, n = 0, len(view)
    while pos < n:
        if deadline is None:
            got = sock.recv_into(view[pos:], n - pos, _WAITALL)
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out with {pos} of {n} B received")
            sock.settimeout(left)
            got = sock.recv_into(view[pos:], n - pos)
        if got == 0:
            raise PeerError("connection closed by peer")
        pos += got


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Scatter-receive exactly ``sum(len(v))`` bytes into ``views`` (``recvmsg_into(MSG_WAITALL)``, up to IOV_BATCH
    buffers at once)."""
    views = [v for v in views if len(v)]
    i = 0
    while i < len(views):
        if len(views) - i == 1:
            recv_exact_into(sock, views[i])
            return
        got = sock.recvmsg_into(views[i:i + IOV_BATCH], 0, _WAITALL)[0]
        if got == 0:
            raise PeerError("connection closed by peer")
        while got:
            v = views[i]
            if got >= len(v):
                got -= len(v)
                i += 1
            else:
                views[i] = v[got:]
                got = 0


def send_views(sock: socket.socket, views: list) -> None:
    """Gather-send all ``views`` (bytes/memoryviews) with ``sendmsg`` (no copy), handling partial sends."""
    if len(views) == 1:
        sock.sendall(views[0])
        return
    if len(views) <= IOV_BATCH:  # usually one sendmsg sends it all (a header and a few views)
        sent = sock.sendmsg(views)
        total = 0
        for v in views:
            total += len(v)
        if sent == total:
            return
        views = _skip(views, sent)
    views = [v if isinstance(v, memoryview) else memoryview(v) for v in views if len(v)]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i:i + IOV_BATCH])
        while sent:
            v = views[i]
            if sent >= len(v):
                sent -= len(v)
                i += 1
            else:
                views[i] = v[sent:]
                sent = 0


def send_views_until(sock: socket.socket, views: list, deadline: float) -> None:
    """:func:`send_views` bounded by ``deadline`` (``time.monotonic()`` seconds) as a whole: before each send call
    the socket's send timeout (``SO_SNDTIMEO``) is set to the time left. That timeout bounds one call only, and a
    peer reading a little at a time lets every call make some progress (one notification took 57 s against a 1 s
    timeout to a peer reading 8 KiB per 0.1 s). Raises BlockingIOError when the deadline passes, possibly mid-frame;
    the caller resets the socket's timeout."""
    views = [v if isinstance(v, memoryview) else memoryview(v) for v in views if len(v)]
    while views:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BlockingIOError("send deadline passed")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(left), max(1, int((left % 1) * 1e6))))
        views = _skip(views, sock.sendmsg(views[:IOV_BATCH]))


def _skip(views: list, n: int) -> list:
    """``views`` without their first ``n`` bytes (memoryviews, no copy)."""
    out = []
    for v in views:
        ln = len(v)
        if n >= ln:
            n -= ln
            continue
        out.append(memoryview(v)[n:] if n else v)
        n = 0
    return out


_DRAIN = bytearray(1 << 20)


def drain(sock: socket.socket, n: int) -> None:
    """Read and discard ``n`` bytes (payload of a refused or cancelled op)."""
    mv = memoryview(_DRAIN)
    while n > 0:
        got = sock.recv_into(mv, min(n, len(mv)))
        if got == 0:
            raise PeerError("connection closed by peer")
        n -= got


def read_frame_header(sock: socket.socket, hdr: memoryview, max_body: int, max_payload: int,
                      deadline: float | None = None) -> tuple[int, int, int]:
    """Read and validate one header; returns ``(ftype, body_len, payload_len)``. ``deadline``
    (``time.monotonic()`` seconds): see :func:`recv_exact_into`. Raises ProtocolError / PeerError / TimeoutError."""
    recv_exact_into(sock, hdr, deadline)
    return check_header(HEADER.unpack(hdr), max_body, max_payload)


def check_header(fields: tuple, max_body: int, max_payload: int) -> tuple[int, int, int]:
    """Validate unpacked header ``fields`` (magic, version, type, body length, payload length); returns
    ``(ftype, body_len, payload_len)``. Raises ProtocolError naming what is wrong."""
    magic, ver, ftype, blen, plen = fields
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if ver != VERSION:
        raise ProtocolError(f"unsupported protocol version {ver}")
    if ftype not in DECODERS:
        raise ProtocolError(f"unknown frame type {ftype}")
    if blen > max_body:
        raise ProtocolError(f"{FRAME_NAMES[ftype]} body of {blen} B exceeds the {max_body} B limit")
    if plen > max_payload:
        raise ProtocolError(f"{FRAME_NAMES[ftype]} payload of {plen} B exceeds the {max_payload} B limit")
    return ftype, blen, plen


def decode_body(ftype: int, raw) -> object:
    """Decode body bytes ``raw`` as frame type ``ftype``'s Struct. Raises ProtocolError on bad JSON/schema, JSON
    nested too deeply to decode included (a small body of a thousand nested arrays makes msgspec raise
    RecursionError)."""
    try:
        return DECODERS[ftype].decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"malformed {FRAME_NAMES[ftype]} body: {e}") from None
    except RecursionError:
        raise ProtocolError(f"malformed {FRAME_NAMES[ftype]} body: JSON nested too deeply") from None


def read_body(sock: socket.socket, ftype: int, blen: int, deadline: float | None = None):
    """Read ``blen`` body bytes and decode them as frame type ``ftype``. ``deadline`` (``time.monotonic()`` seconds):
    see :func:`recv_exact_into`. Raises ProtocolError on bad JSON/schema, PeerError on EOF, TimeoutError."""
    buf = bytearray(blen)
    recv_exact_into(sock, memoryview(buf), deadline)
    return decode_body(ftype, buf)


class FrameReader:
    """Buffered frame reader of one connection: a header, its body and a small payload usually arrive with ONE
    ``recv_into`` into a per-connection buffer (``RX_BUFFER`` bytes), instead of one syscall per header, body and
    payload. Payloads of at least ``RX_DIRECT`` bytes still land straight in their destination views (only the bytes
    already buffered are copied), so large transfers stay zero-copy in user space.

    Every read of a connection after its handshake must go through its reader (it may hold bytes of the next frame).
    Errors: :class:`ProtocolError` (bad header/body), :class:`PeerError` (EOF).
    """

    __slots__ = ("sock", "buf", "mv", "start", "end")

    def __init__(self, sock: socket.socket, size: int = RX_BUFFER):
        self.sock = sock
        self.buf = bytearray(size)
        self.mv = memoryview(self.buf)
        self.start = 0
        self.end = 0

    def _fill(self, need: int) -> None:
        """Make at least ``need`` (<= buffer size) bytes available at ``start``."""
        if self.end - self.start >= need:
            return
        if self.start:
            n = self.end - self.start
            if n:
                self.mv[:n] = self.mv[self.start:self.end]
            self.start, self.end = 0, n
        recv_into = self.sock.recv_into
        mv, size = self.mv, len(self.mv)
        while self.end < need:
            got = recv_into(mv[self.end:], size - self.end)
            if got == 0:
                raise PeerError("connection closed by peer")
            self.end += got

    def ready(self) -> bool:
        """True when a frame has started: bytes are buffered, or a non-blocking ``recv`` got some. Raises PeerError
        on EOF."""
        if self.start < self.end:
            return True
        self.start = self.end = 0
        try:
            got = self.sock.recv_into(self.mv, len(self.mv), _DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        if got == 0:
            raise PeerError("connection closed by peer")
        self.end = got
        return True

    def header(self, max_body: int, max_payload: int) -> tuple[int, int, int]:
        """Read and validate one header; returns ``(ftype, body_len, payload_len)``."""
        self._fill(HEADER_SIZE)
        fields = HEADER.unpack_from(self.buf, self.start)
        self.start += HEADER_SIZE
        return check_header(fields, max_body, max_payload)

    def frame(self, max_body: int, max_payload: int) -> tuple[int, object, int]:
        """Read one frame's header and body: ``(ftype, decoded body, payload_len)``; the payload is left to the caller
        (``into``/``skip``). The usual small frame costs one ``recv`` (none when already buffered) and one call.
        Raises ProtocolError (bad header, a body over ``max_body`` or malformed, a payload over ``max_payload``) /
        PeerError (EOF)."""
        if self.end - self.start < HEADER_SIZE:
            self._fill(HEADER_SIZE)  # one recv usually brings the whole frame, its payload included
        start = self.start
        magic, ver, ftype, blen, plen = HEADER.unpack_from(self.buf, start)
        if magic == MAGIC and ver == VERSION and blen <= max_body and plen <= max_payload \
                and start + HEADER_SIZE + blen <= self.end and ftype in DECODERS:
            start += HEADER_SIZE
            self.start = start + blen
            return ftype, decode_body(ftype, self.mv[start:start + blen]), plen
        ftype, blen, plen = self.header(max_body, max_payload)
        return ftype, self.body(ftype, blen), plen

    def body(self, ftype: int, blen: int):
        """Read ``blen`` body bytes and decode them as frame type ``ftype``."""
        if blen <= len(self.buf):
            self._fill(blen)
            raw = self.mv[self.start:self.start + blen]
            self.start += blen
        else:
            raw = memoryview(bytearray(blen))
            self.into([raw])
        return decode_body(ftype, raw)

    def into(self, views: list[memoryview]) -> None:
        """Fill ``views`` (in order) with the next ``sum(len(v))`` bytes: buffered bytes are copied, a small rest is
        buffered then copied, a large rest is received straight into the views."""
        if len(views) == 1:  # the common small read: its bytes usually came with the header, one copy
            v = views[0]
            n = len(v)
            if n <= self.end - self.start:
                v[:] = self.mv[self.start:self.start + n]
                self.start += n
                return
        views = [v for v in views if len(v)]
        total = sum(len(v) for v in views)
        if total < RX_DIRECT and total <= len(self.buf):
            self._fill(total)
        i = 0
        while i < len(views) and self.start < self.end:
            v = views[i]
            n = min(len(v), self.end - self.start)
            v[:n] = self.mv[self.start:self.start + n]
            self.start += n
            if n < len(v):
                views[i] = v[n:]
            else:
                i += 1
        if i < len(views):
            recv_views(self.sock, views[i:])

    def skip(self, n: int) -> None:
        """Read and discard ``n`` bytes (payload of a refused or cancelled op)."""
        k = min(n, self.end - self.start)
        self.start += k
        if n > k:
            drain(self.sock, n - k)
