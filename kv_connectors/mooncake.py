"""Mooncake Transfer Engine adapter (kind ``"mooncake"``): Mooncake's TCP transport moves the bytes, dlmix's link
authorizes them.

Needs ``apt-get install libibverbs1`` and ``pip install mooncake-transfer-engine-non-cuda==0.3.13.post1`` (extra
``dlmix[mooncake]``; the CUDA wheel does not import without libcuda, and both own the ``mooncake`` package). The engine
is initialised with metadata server ``P2PHANDSHAKE`` (no etcd) and protocol ``tcp``; a peer addresses it by session id
``host:rpc_port`` from the descriptor. Transfers use ``batch_transfer_async_read/write`` with the owner's addresses that
the owner handed out after checking the grant (see :mod:`._adapter`), polled until done or the transfer deadline.

**Listeners**: Mooncake 0.3.13 binds its RPC and data listeners to every interface, whatever ``host`` or
``MC_TCP_BIND_ADDRESS`` say. Use it only on trusted networks, or inside a private network namespace (the tests run it
under ``unshare -n``). Its server checks that an address lies inside *some* registered buffer, not inside a grant.
``MC_TCP_ENABLE_CONNECTION_POOL=1`` is set (if unset) for steadier throughput.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Mapping

from ._adapter import AdapterEndpoint, coalesce_pairs
from .base import PeerError, Region, TransportError, register_transport

os.environ.setdefault("MC_TCP_ENABLE_CONNECTION_POOL", "1")
os.environ.setdefault("GLOG_minloglevel", "2")
try:
    from mooncake.engine import TransferEngine as _TE
except (ImportError, OSError) as _e:
    raise ImportError("mooncake adapter needs `apt-get install libibverbs1` and "
                      f"`pip install mooncake-transfer-engine-non-cuda==0.3.13.post1`: {_e}")

log = logging.getLogger("dlmix_kv_connectors")
_warned = threading.Event()


@register_transport("mooncake")
class MooncakeTransport(AdapterEndpoint):
    """dlmix control + Mooncake Transfer Engine (TCP protocol, P2P handshake). Host memory only.

    Extra keyword: ``mc_protocol`` (str, ``"tcp"``): Mooncake transport protocol (``"rdma"`` needs NICs).
    """

    PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"

    def __init__(self, *, mc_protocol: str = "tcp", **kw: Any):
        self.mc_protocol = mc_protocol
        super().__init__(**kw)

    @classmethod
    def check_available(cls) -> str | None:
        return None

    def _lib_init(self) -> None:
        if not _warned.is_set():
            _warned.set()
            log.warning("mooncake transfer engine binds its listeners to every interface; use trusted networks or a "
                        "private network namespace")
        self._te = _TE()
        rc = self._te.initialize(self.host, "P2PHANDSHAKE", self.mc_protocol, "")
        if rc != 0:
            raise TransportError(f"mooncake TransferEngine.initialize failed (rc={rc})")
        self._session = f"{self.host}:{self._te.get_rpc_port()}"

    def _lib_descriptor(self) -> dict:
        return {"session": self._session}

    def _lib_register(self, reg: Region) -> None:
        rc = self._te.register_memory(reg.ptr, reg.length)
        if rc != 0:
            raise TransportError(f"mooncake register_memory({reg.name!r}) failed (rc={rc})")

    def _lib_unregister(self, reg: Region) -> None:
        self._te.unregister_memory(reg.ptr)

    def _lib_connect(self, peer: str, desc: Mapping) -> Any:
        session = desc["lib"].get("session")
        if not isinstance(session, str):
            raise ValueError(f"descriptor of {peer!r} lacks the mooncake session id")
        return session

    def _lib_transfer(self, op, peer, local, remote, remote_addrs, deadline) -> None:
        session = self._lib_peers[peer]
        lo, ro, ln = coalesce_pairs([reg.ptr + off for reg, off, _ in local], remote_addrs, [n for _, _, n in local])
        fn = self._te.batch_transfer_async_read if op == "r" else self._te.batch_transfer_async_write
        bid = fn(session, lo, ro, ln)
        if bid == 0 or bid < 0:
            raise PeerError(f"mooncake could not submit the batch to {peer!r} (rc={bid})")
        te = self._te

        def done() -> bool:
            st = te.get_batch_transfer_status([bid])
            if st < 0:
                raise PeerError(f"mooncake transfer with {peer!r} failed (status {st})")
            return st == 0

        self._poll(done, deadline, "mooncake batch")
