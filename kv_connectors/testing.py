"""A transport peer in its own process, driven by JSON lines on stdin/stdout (used by the contract tests and the
benchmark to put the two ends of a link into two real processes).

Run: ``python -m dlmix_kv_connectors.testing KIND NAME SECRET [CFG_JSON]``. Each stdin line is one JSON command;
each answer is one JSON line on stdout (``{"ok": true, ...}`` or ``{"ok": false, "etype": ..., "err": ...}``).

Commands: ``region {name, size, seed}`` (allocate and fill with :func:`pattern`), ``desc``, ``connect {desc}``,
``grant {peer, tid, ranges, mode, expires_s}``, ``revoke {tid}``, ``sha {name, off, len}``, ``fill {name, off, len,
seed}``, ``read``/``write {peer, segs, tid, timeout_s}``, ``read_loop {peer, segs, tid}`` (reads in a background
thread until killed; answers after the first read), ``notify {peer, msg}``, ``notes {timeout}``, ``stats``,
``bench {peer, op, size, iters, tid}`` (returns seconds per op), ``exit``.
"""
from __future__ import annotations

import hashlib
import json
import sys
import threading
import time

import numpy as np


def pattern(size: int, seed: int) -> np.ndarray:
    """Deterministic bytes (uint8, shape ``[size]``) for region ``seed``; both processes compute the same array."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def sha(buf) -> str:
    """sha256 hex of a byte buffer."""
    return hashlib.sha256(memoryview(buf).cast("B")).hexdigest()


class PeerProcess:
    """Driver of a peer process (``python -m dlmix_kv_connectors.testing``) from tests and benchmarks.

    ``call(cmd, **kw)`` sends one command and returns the answer dict, raising ``TimeoutError`` if none arrives in
    ``timeout`` seconds. ``stop()``/``cont()``/``kill()`` send SIGSTOP/SIGCONT/SIGKILL (stalled and dead peers).
    """

    def __init__(self, kind: str, name: str, secret: str, cfg: dict | None = None, timeout: float = 180.0,
                 env: dict | None = None):
        import os
        import subprocess

        self.kind, self.name = kind, name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dlmix_kv_connectors.testing", kind, name, secret, json.dumps(cfg or {})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            env=dict(os.environ, **(env or {})))
        self.pid = self.proc.pid
        first = self._read(timeout)
        if not first.get("ok"):
            raise RuntimeError(f"peer failed to start: {first}")
        self.desc = first["desc"]

    def _read(self, timeout: float) -> dict:
        import select

        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            raise TimeoutError(f"peer {self.name} did not answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer {self.name} exited (rc={self.proc.poll()})")
        return json.loads(line)

    def call(self, cmd: str, timeout: float = 120.0, **kw) -> dict:
        self.proc.stdin.write(json.dumps(dict(kw, cmd=cmd)) + "\n")
        self.proc.stdin.flush()
        ans = self._read(timeout)
        if "desc" in ans:
            self.desc = ans["desc"]
        return ans

    def stop(self) -> None:
        import os
        import signal

        os.kill(self.pid, signal.SIGSTOP)
        # signal delivery is asynchronous: wait until every thread is really stopped
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                states = [open(f"/proc/{self.pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
                          for t in os.listdir(f"/proc/{self.pid}/task")]
            except (FileNotFoundError, ProcessLookupError):
                continue
            if all(st in ("T", "t") for st in states):
                return
            time.sleep(0.001)

    def cont(self) -> None:
        import os
        import signal

        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        import os
        import signal

        try:
            os.kill(self.pid, signal.SIGKILL)  # also ends a stopped process, without letting it run again
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=5)
                self.proc.wait(5)
            except Exception:
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass


def raw_auth(host: str, port: int, name: str, secret: str):
    """A raw socket to a TCP-family transport listener at ``host:port``, authenticated as ``name`` with ``secret``
    (the wire handshake of :mod:`dlmix_kv_connectors._wire` done by hand), for sending hostile frames. A listener
    that answers ``busy`` (its handshake slots for this host are taken, e.g. by a test's other raw sockets still
    being closed) is tried again for up to 10 s, as an endpoint's own dial does. Raises OSError when the listener
    hangs up, AssertionError when it refuses the secret or stays busy."""
    import os
    import socket

    from . import _wire as W

    hdr = memoryview(bytearray(16))
    deadline = time.monotonic() + 10
    nap = 0.01
    while True:
        s = socket.create_connection((host, port), timeout=5)
        nc = os.urandom(32)
        s.sendall(W.pack(W.HELLO, W.Hello(W.VERSION, name, nc.hex())))
        ftype, blen, _ = W.read_frame_header(s, hdr, 1 << 16, 0)
        ch = W.read_body(s, ftype, blen)
        if ftype != W.ERROR or not str(getattr(ch, "reason", "")).startswith("busy"):
            break
        s.close()
        if time.monotonic() > deadline:
            raise AssertionError(f"listener at {host}:{port} stayed busy for 10 s")
        time.sleep(nap)
        nap = min(0.5, nap * 2)
    ns = bytes.fromhex(ch.nonce)
    s.sendall(W.pack(W.AUTH, W.Auth(W.mac(secret.encode(), b"client", nc, ns, name, ch.name), {})))
    ftype, blen, _ = W.read_frame_header(s, hdr, 1 << 16, 0)
    assert ftype == W.AUTH_OK, f"authentication refused (frame type {ftype})"
    W.read_body(s, ftype, blen)
    return s


def half_written_write(owner, n: int, secret: str, peer: str = "evil", fill: int = 0x11):
    """A peer's granted write to ``owner`` (a TCP-family endpoint) stalled halfway: registers an ``n``-byte region
    ``kv`` of zeros on ``owner``, grants ``peer`` a write of it (transfer ``w``), then, over a :func:`raw_auth`
    socket, sends the write's request and its first ``n // 2`` payload bytes (all ``fill``). Returns ``(dst, sock)``
    once those bytes are in the region: ``dst`` the region's numpy array, ``sock`` the peer's socket (the caller
    sends the rest, or not, and closes it). Raises AssertionError when they do not land within 5 s."""
    from . import _wire as W

    dst = np.zeros(n, dtype=np.uint8)
    owner.register("kv", dst)
    owner.grant(peer, "w", [("kv", 0, n)], "w", None)
    s = raw_auth(owner.host, owner.port, peer, secret)
    s.sendall(W.pack(W.REQ, W.Req(1, "w", "w", "tcp", [("kv", 0, n)]), n) + bytes([fill]) * (n // 2))
    deadline = time.monotonic() + 5
    while (dst == fill).sum() != n // 2:
        if time.monotonic() > deadline:
            s.close()
            raise AssertionError("the first half of the write did not land")
        time.sleep(0.01)
    return dst, s


def fuzz_frame(rng) -> bytes:
    """One hostile wire frame from ``rng`` (a ``random.Random``): garbage, bad headers, oversized/truncated lengths,
    wrong-typed or out-of-range bodies, reads outside or beyond a grant (``tid`` ``"fz"`` on region ``"kv"``), hostile
    control messages. The one frame fuzzer of the transport contract tests and ``benchmarks/faults.py``."""
    import struct

    from . import _wire as W

    k = rng.randrange(10)
    if k == 0:
        return rng.randbytes(rng.randrange(1, 64))
    if k == 1:  # header claiming a huge body or payload
        return struct.pack("!2sBBIQ", b"DX", 1, rng.randrange(0, 12), rng.choice([1 << 31, 5 << 20, 17]),
                           rng.choice([0, 1 << 40, 300 << 20]))
    if k == 2:  # truncated body
        return struct.pack("!2sBBIQ", b"DX", 1, W.REQ, 500, 0) + b'{"id": 1, "op":'
    if k == 3:  # wrong version/magic
        return struct.pack("!2sBBIQ", rng.choice([b"DX", b"XX"]), rng.randrange(256), W.REQ, 2, 0) + b"{}"
    bodies = [
        {"id": 1, "op": "r", "tid": "fz", "dp": "tcp", "segs": [["kv", 0, 4096]]},  # valid, granted
        {"id": 2, "op": "r", "tid": "fz", "dp": "tcp", "segs": [["kv", -5, 10]]},
        {"id": 3, "op": "r", "tid": "fz", "dp": "tcp", "segs": [["kv", 0, 1 << 62]]},
        {"id": 4, "op": "w", "tid": "t", "dp": "tcp", "segs": [["kv", 0, 16]]},  # someone else's grant
        {"id": 5, "op": "x", "tid": "fz", "dp": "tcp", "segs": []},
        {"id": "a", "op": "r", "tid": 3, "dp": "tcp", "segs": "no"},
        {"id": 6, "op": "r", "tid": "fz", "dp": "cma", "segs": [["kv", 0, 8]], "iov": [[4096, 8]], "pid": 1},
        {"id": 7, "op": "r", "tid": "fz", "dp": "authz", "segs": [["kv", 0, 8]] * 70000},
        {"msg": {"type": "blocks_ready", "x": [1, 2]}},
        {"msg": "not a dict"},
        {"reason": 5},
        [1, 2, 3],
        "x" * rng.randrange(100),
    ]
    body = rng.choice(bodies)
    raw = W.ENC.encode(body)
    if rng.random() < 0.3:
        raw = bytearray(raw)
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        raw = bytes(raw)
    ftype = rng.choice([W.REQ, W.REQ, W.NOTIFY, W.RESP, W.HELLO, W.ERROR, W.AUTH_OK, 0, 99])
    plen = rng.choice([0, 0, 0, 16, 4096])
    return struct.pack("!2sBBIQ", b"DX", 1, ftype, len(raw), plen) + raw + rng.randbytes(min(plen, 64))


def main(argv: list[str]) -> int:
    import os

    # answers go to a private copy of stdout; anything libraries print goes to stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from dlmix_kv_connectors import make_transport

    kind, name, secret = argv[:3]
    cfg = json.loads(argv[3]) if len(argv) > 3 else {}
    t = make_transport(kind, name=name, secret=secret, **cfg)
    arrays: dict[str, np.ndarray] = {}

    def reply(**kw):
        out.write(json.dumps(kw) + "\n")
        out.flush()

    reply(ok=True, desc=t.descriptor())
    for line in sys.stdin:
        if not line.strip():
            continue
        c = json.loads(line)
        cmd = c.pop("cmd")
        try:
            if cmd == "region":
                a = pattern(c["size"], c["seed"])
                arrays[c["name"]] = a
                t.register(c["name"], a)
                reply(ok=True, desc=t.descriptor())
            elif cmd == "desc":
                reply(ok=True, desc=t.descriptor())
            elif cmd == "connect":
                reply(ok=True, peer=t.connect(c["desc"]))
            elif cmd == "grant":
                t.grant(c["peer"], c["tid"], [tuple(r) for r in c["ranges"]], c.get("mode", "r"),
                        c.get("expires_s", 300))
                reply(ok=True)
            elif cmd == "revoke":
                reply(ok=True, existed=t.revoke(c["tid"]))
            elif cmd == "sha":
                a = arrays[c["name"]]
                reply(ok=True, sha=sha(a[c["off"]:c["off"] + c["len"]]))
            elif cmd == "fill":
                arrays[c["name"]][c["off"]:c["off"] + c["len"]] = pattern(c["len"], c["seed"])
                reply(ok=True)
            elif cmd in ("read", "write"):
                fn = t.read if cmd == "read" else t.write
                h = fn(c["peer"], [tuple(s) for s in c["segs"]], c["tid"], c.get("timeout_s"))
                n = h.result()
                reply(ok=True, n=n)
            elif cmd == "read_loop":
                segs = [tuple(s) for s in c["segs"]]
                t.read(c["peer"], segs, c["tid"]).result()

                def loop():
                    while True:
                        try:
                            t.read(c["peer"], segs, c["tid"]).result()
                        except Exception:
                            time.sleep(0.01)

                threading.Thread(target=loop, daemon=True).start()
                reply(ok=True)
            elif cmd == "bench":
                fn = t.read if c["op"] == "r" else t.write
                segs = [tuple(s) for s in c["segs"]]
                times = []
                for _ in range(c["iters"]):
                    t0 = time.perf_counter()
                    fn(c["peer"], segs, c["tid"]).result()
                    times.append(time.perf_counter() - t0)
                reply(ok=True, times=times)
            elif cmd == "notify":
                t.notify(c["peer"], c["msg"])
                reply(ok=True)
            elif cmd == "notes":
                notes = []
                n = t.get_notification(c.get("timeout", 0))
                while n is not None:
                    notes.append({"peer": n.peer, "msg": n.msg})
                    n = t.get_notification(0)
                reply(ok=True, notes=notes)
            elif cmd == "stats":
                reply(ok=True, stats=dict(getattr(t, "stats", {})), peers=t.peers())
            elif cmd == "exit":
                reply(ok=True)
                break
            else:
                reply(ok=False, etype="ValueError", err=f"unknown command {cmd!r}")
        except Exception as e:  # report every failure to the driver
            reply(ok=False, etype=type(e).__name__, err=str(e))
    t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
