"""Common base of the library adapters (Mooncake, NIXL, DLSlime): dlmix's control channel + the library's data path.

Every adapter keeps dlmix's authenticated TCP link for the handshake, notifications and *authorization*: before the
library moves a chunk, the initiator sends the owner an ``authz`` request naming the owner's segments; the owner checks
the grant (same code as the TCP transport) and answers with the addresses of exactly those bytes, or refuses
(:class:`GrantError`). Only then does the initiator issue the library's one-sided op. The libraries themselves do not
check ranges (DLSlime's TCP server reads/writes any address a request names; Mooncake and NIXL check only that the
address lies in some registered buffer), so the grant check binds cooperating peers that share the secret: a process
that drives the library directly, without dlmix, can still reach every registered buffer. Run adapters on trusted
networks (or loopback / a private network namespace); use ``tcp``/``shm`` where peers are not trusted.

Subclasses implement the ``_lib_*`` hooks; the base does chunking (``lib_chunk_bytes`` bytes, ``segs_per_frame``
segments per authorization), cancellation (a chunk's library op is waited for before ``cancel()`` returns) and the
per-transfer deadline (passed to the library wait). A library op that cannot be aborted is waited for in the same
way when its transfer times out: the timeout is reported once the op has ended, so no byte lands after a transfer
failed or was cancelled (``_lib_transfer``'s contract: return only when no byte can land any more).
"""
from __future__ import annotations

import time
from typing import Any, Mapping

from . import _wire as W
from ._core import Endpoint, _Chunk, _Conn, _Xfer
from .base import PeerError, ProtocolError, Region, Segment, TransferTimeout, TransportError


class AdapterEndpoint(Endpoint):
    """Base class of library adapters. Extra keyword: ``lib_chunk_bytes`` (int, 64 MiB) bytes per authorization."""

    DP = "authz"
    PACKAGE = ""  # pip name, for messages
    #: seconds ``_lib_transfer`` may go on past a transfer's deadline before it returns (a library op it waits out)
    cancel_grace_s = 0.0

    def __init__(self, *, lib_chunk_bytes: int = 64 << 20, **kw: Any):
        self.lib_chunk_bytes = int(lib_chunk_bytes)
        self._lib_peers: dict[str, Any] = {}
        self._lib_seen: dict[str, dict] = {}
        super().__init__(**kw)
        self.COMPATIBLE_KINDS = frozenset({self.kind})
        try:
            self._lib_init()
        except BaseException:
            super().close()
            raise

    # ---- hooks for subclasses ----
    def _lib_init(self) -> None:
        raise NotImplementedError

    def _lib_descriptor(self) -> dict:
        raise NotImplementedError

    def _lib_register(self, reg: Region) -> None:
        raise NotImplementedError

    def _lib_unregister(self, reg: Region) -> None:
        pass

    def _lib_connect(self, peer: str, desc: Mapping) -> Any:
        """Connect the library to the peer; return per-peer state kept in ``self._lib_peers[peer]``."""
        raise NotImplementedError

    def _lib_transfer(self, op: str, peer: str, local: list[tuple[Region, int, int]], remote: list[tuple[str, int, int]],
                      remote_addrs: list[int], deadline: float) -> None:
        """Move the bytes of one authorized chunk, blocking until done or ``deadline`` (monotonic seconds).

        ``local[i] = (region, offset, length)``, ``remote[i] = (region_name, offset, length)`` and ``remote_addrs[i]``
        the owner's address of that segment. Raise TransportError (TransferTimeout past the deadline), but only once
        no byte of the op can land any more (at most ``cancel_grace_s`` past the deadline)."""
        raise NotImplementedError

    def _lib_close(self) -> None:
        pass

    # ---- Endpoint data-path hooks ----
    def _dp_descriptor(self) -> dict:
        return {"lib": self._lib_descriptor()}

    def _dp_register(self, reg: Region) -> None:
        self._lib_register(reg)

    def _dp_unregister(self, reg: Region) -> None:
        self._lib_unregister(reg)

    def _dp_link_up(self, peer: str, desc: Mapping, conns: list[_Conn]) -> None:
        if "lib" not in desc:
            raise ValueError(f"descriptor of {peer!r} lacks the {self.kind} library info")
        self._lib_peers[peer] = self._lib_connect(peer, desc)
        self._lib_seen[peer] = dict(desc["lib"])

    def connect(self, descriptor: Mapping[str, Any], timeout_s: float | None = None) -> str:
        """As :meth:`Transport.connect`; a repeated call with a changed descriptor (e.g. the peer registered more
        regions) also refreshes the library's view of the peer."""
        peer = super().connect(descriptor, timeout_s)
        lib = dict(descriptor.get("lib") or {})
        if peer not in self._lib_peers or self._lib_seen.get(peer) != lib:
            self._lib_peers[peer] = self._lib_connect(peer, descriptor)
        self._lib_seen[peer] = lib
        return peer

    def _submit(self, x: _Xfer, op: str, peer: str, conns: list[_Conn], segs: list[Segment]) -> None:
        groups = self._split(segs, self.lib_chunk_bytes, self.segs_per_frame)
        chunks = []
        regions = self._regions
        for g in groups:
            wire = [(s.remote_region, s.remote_offset + o, n) for s, o, n in g]
            ch = _Chunk(x, op, "authz", wire, [], sum(n for _, _, n in g))
            ch.extra = [(regions[s.local_region], s.local_offset + o, n) for s, o, n in g]
            chunks.append(ch)
        self._launch(x, conns, chunks)

    def _dp_serve(self, conn: _Conn, req: W.Req, checked: list, total: int) -> W.Resp:
        if req.dp != "authz":
            raise ProtocolError(f"unsupported data path {req.dp!r} for {self.kind}")
        return W.Resp(req.id, True, n=total, iov=[(reg.ptr + off, ln) for reg, off, ln in checked])

    def _dp_complete(self, conn: _Conn, ch: _Chunk, resp: W.Resp) -> None:
        if len(resp.iov) != len(ch.extra) or any(a[1] != b[2] for a, b in zip(resp.iov, ch.extra)):
            raise ProtocolError("authorization does not pair with the request's segments")
        if not ch.begin_receiving():
            return
        try:
            self._lib_transfer(ch.op, ch.xfer.peer, ch.extra, ch.segs, [a for a, _ in resp.iov], ch.xfer.deadline)
        except TransportError as e:
            ch.xfer.fail(e)
            return
        except Exception as e:  # library error
            ch.xfer.fail(PeerError(f"{self.kind} transfer with {ch.xfer.peer!r} failed: {e}"))
            return
        finally:
            ch.end_receiving()
        self._chunk_ok(ch, resp)

    def _cancel(self, h) -> None:
        """As the base, then wait for every chunk's library op to end (bounded by the transfer's deadline plus
        ``cancel_grace_s`` and 10 s): dropping dlmix's connection does not stop it."""
        x = h._xfer
        super()._cancel(h)
        if x is not None:
            for ch in x.chunks:
                ch.recv_done.wait(max(0.0, x.deadline - time.monotonic()) + self.cancel_grace_s + 10.0)

    def _dp_close(self) -> None:
        try:
            self._lib_close()
        except Exception:
            pass

    @staticmethod
    def _poll(check, deadline: float, what: str) -> None:
        """Call ``check()`` until it returns True (done), spinning briefly then sleeping 50 us between polls.
        ``check`` raises on failure. Raises TransferTimeout past ``deadline``."""
        spins = 0
        while not check():
            if time.monotonic() > deadline:
                raise TransferTimeout(f"{what} did not complete before the transfer deadline")
            spins += 1
            time.sleep(0 if spins < 200 else 50e-6)


def coalesce_pairs(local: list[int], remote: list[int], lengths: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Merge address pairs that continue each other on both sides (``local[i] + len[i] == local[i+1]`` and the same
    for remote). Returns new (local, remote, lengths) lists; order kept."""
    lo: list[int] = []
    ro: list[int] = []
    ln: list[int] = []
    for a, b, n in zip(local, remote, lengths):
        if ln and lo[-1] + ln[-1] == a and ro[-1] + ln[-1] == b:
            ln[-1] += n
        else:
            lo.append(a)
            ro.append(b)
            ln.append(n)
    return lo, ro, ln
