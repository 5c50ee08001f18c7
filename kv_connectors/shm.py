"""Same-host transport (kind ``"shm"``): bytes move by cross-memory attach, control stays on the authenticated TCP link.

When both endpoints run on one host (same boot id and PID namespace), each chunk of a transfer is one authorization
round trip on the authenticated TCP link plus one cross-memory copy: the initiator sends the owner's segments; the
owner checks the grant exactly as for TCP and answers with the addresses of exactly those granted bytes (nothing
else); the initiator then copies with ``process_vm_readv`` (read) or ``process_vm_writev`` (write) through ctypes
(Linux >= 3.2; up to 1024 segments per syscall). The initiator does the copy so that ``cancel()`` and timeouts keep
their guarantee (no bytes land in local memory after they return) even when the owner is stalled.

Trust: a process allowed to ptrace the owner can read its memory anyway; the grant check stops honest-but-wrong
peers (a stale block table, a wrong transfer id) exactly like TCP. Permission: the initiator must be allowed to ptrace
the owner (same uid and ``/proc/sys/kernel/yama/ptrace_scope`` 0 or 1 with a descendant, or root / CAP_SYS_PTRACE).
At connect time the initiator proves it by reading a 64-byte random probe the owner advertises; if that fails (other
host, other PID namespace, ptrace forbidden, seccomp) the link falls back to the TCP data path transparently.
``cma=False`` forces TCP.
"""
from __future__ import annotations

import ctypes
import os
from typing import Mapping

from . import _wire as W
from ._core import HOST_ID, Endpoint, _Chunk, _Conn, _Xfer
from .base import PeerError, ProtocolError, Segment, register_transport

IOV_MAX = 1024


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_fns = {}
for _n in ("process_vm_readv", "process_vm_writev"):
    _f = getattr(_libc, _n, None)
    if _f is not None:
        _f.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                       ctypes.c_ulong]
        _f.restype = ctypes.c_ssize_t
        _fns[_n] = _f


def cma_copy(pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]], to_remote: bool) -> int:
    """Copy between this process's ``local`` ``(addr, len)`` list and process ``pid``'s ``remote`` list.

    ``to_remote=True`` copies local → remote (``process_vm_writev``), else remote → local (``process_vm_readv``).
    Element *i* of both lists must have the same length. Returns bytes copied. Raises OSError (errno from the kernel:
    EPERM no ptrace permission, ESRCH no such process, EFAULT bad address) or ValueError on mismatched lists.
    """
    if len(local) != len(remote) or any(a[1] != b[1] for a, b in zip(local, remote)):
        raise ValueError("local and remote iovec lists must pair up with equal lengths")
    fn = _fns["process_vm_writev" if to_remote else "process_vm_readv"]
    loc = [list(p) for p in local if p[1]]
    rem = [list(p) for p in remote if p[1]]
    done = 0
    i = 0
    while i < len(loc):
        k = min(len(loc) - i, IOV_MAX)
        la = (_IOVec * k)(*[(a, n) for a, n in loc[i:i + k]])
        ra = (_IOVec * k)(*[(a, n) for a, n in rem[i:i + k]])
        want = sum(n for _, n in loc[i:i + k])
        got = fn(pid, la, k, ra, k, 0)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{fn.__name__}(pid {pid}): {os.strerror(e)}")
        if got == 0 and want:
            raise OSError(0, f"{fn.__name__}(pid {pid}) made no progress")
        done += got
        if got == want:
            i += k
            continue
        while got:  # partial: advance both lists in lockstep
            n = loc[i][1]
            if got >= n:
                got -= n
                i += 1
            else:
                loc[i] = [loc[i][0] + got, n - got]
                rem[i] = [rem[i][0] + got, n - got]
                got = 0
    return done


@register_transport("shm")
class ShmTransport(Endpoint):
    """Same-host transport: the owner checks the grant over TCP, the initiator copies by cross-memory attach.

    Extra keywords: ``cma`` (bool, True): use cross-memory attach when possible; ``cma_chunk_bytes`` (int, 32 MiB):
    bytes per authorization request (the chunks of one transfer are spread over the stripes, each copied by that
    connection's reader thread, so ``stripes`` copies run in parallel).
    """

    def __init__(self, *, cma: bool = True, cma_chunk_bytes: int = 32 << 20, **kw):
        super().__init__(**kw)
        self.cma_enabled = bool(cma) and len(_fns) == 2
        self.cma_chunk_bytes = int(cma_chunk_bytes)
        self._probe = ctypes.create_string_buffer(os.urandom(64), 64)

    def _server_info(self, conn: _Conn, info: dict) -> dict:
        out = super()._server_info(conn, info)
        if self.cma_enabled:
            out["probe"] = [ctypes.addressof(self._probe), 64, bytes(self._probe.raw).hex()]
        return out

    def _dp_link_up(self, peer: str, desc: Mapping, conns: list[_Conn]) -> None:
        for c in conns:
            c.info["cma"] = self._probe_peer(c.info)

    def _probe_peer(self, info: dict) -> bool:
        """Can we read the owner's memory? (same host id, ptrace permitted): read its 64-byte random probe."""
        probe = info.get("probe")
        if not (self.cma_enabled and info.get("host_id") == HOST_ID and isinstance(probe, list) and len(probe) == 3):
            return False
        try:
            addr, n, hexs = int(probe[0]), int(probe[1]), str(probe[2])
            buf = ctypes.create_string_buffer(n)
            cma_copy(int(info["pid"]), [(ctypes.addressof(buf), n)], [(addr, n)], to_remote=False)
            return buf.raw.hex() == hexs
        except (OSError, ValueError, TypeError, KeyError):
            return False

    def check_cma(self, peer: str) -> bool:
        """True when the link to ``peer`` moves bytes by cross-memory attach (else TCP)."""
        cs = [c for c in self._out.get(peer, []) if c.alive]
        return bool(cs) and all(c.info.get("cma") for c in cs)

    def _submit(self, x: _Xfer, op: str, peer: str, conns: list[_Conn], segs: list[Segment]) -> None:
        if not all(c.info.get("cma") for c in conns):
            return super()._submit(x, op, peer, conns, segs)
        groups = self._split(segs, self.cma_chunk_bytes, IOV_MAX * 4)
        regions = self._regions
        chunks = []
        for g in groups:
            wire = [(s.remote_region, s.remote_offset + o, n) for s, o, n in g]
            ch = _Chunk(x, op, "cma", wire, [], sum(n for _, _, n in g))
            ch.extra = [(regions[s.local_region].ptr + s.local_offset + o, n) for s, o, n in g]
            chunks.append(ch)
        self._launch(x, conns, chunks)

    def _dp_serve(self, conn: _Conn, req: W.Req, checked: list, total: int) -> W.Resp:
        if req.dp != "cma":
            return super()._dp_serve(conn, req, checked, total)
        # grant checked: hand the initiator the addresses of exactly the granted bytes it asked for
        return W.Resp(req.id, True, n=total, iov=[(reg.ptr + off, ln) for reg, off, ln in checked])

    def _dp_complete(self, conn: _Conn, ch: _Chunk, resp: W.Resp) -> None:
        if ch.dp != "cma":
            return super()._dp_complete(conn, ch, resp)
        local = ch.extra
        if len(resp.iov) != len(local) or any(a[1] != b[1] for a, b in zip(resp.iov, local)):
            raise ProtocolError("cma authorization does not pair with the request's segments")
        if not ch.begin_receiving():
            return
        try:
            cma_copy(int(conn.info["pid"]), local, [tuple(v) for v in resp.iov], to_remote=(ch.op == "w"))
        except (OSError, ValueError) as e:
            ch.xfer.fail(PeerError(f"cross-memory copy with {conn.peer!r} failed: {e}"))
            return
        finally:
            ch.end_receiving()
        self._chunk_ok(ch, resp)
