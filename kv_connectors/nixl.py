"""NIXL adapter (kind ``"nixl"``): NIXL's UCX backend moves the bytes, dlmix's link authorizes them.

Needs ``pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1`` (UCX is vendored; a plain ``pip install nixl`` drags in
CUDA torch and nvidia wheels). Each endpoint owns one ``nixl_agent`` named after the endpoint; the descriptor carries
its metadata blob (base64), which the peer loads with ``add_remote_agent``. Transfers are ``initialize_xfer`` READ or
WRITE descriptor lists (host ``DRAM``) with the owner's addresses handed out after the grant check (see
:mod:`._adapter`), polled with ``check_xfer_state`` until done or the transfer deadline.

``enable_prog_thread`` (default True): UCX needs progress on the *target* side for protocols it emulates in software
(TCP RMA, rendezvous), so an endpoint that others read from or write to keeps NIXL's progress thread. An endpoint
that only initiates (e.g. a decode worker pulling) can pass ``enable_prog_thread=False`` and progress happens in its
polling loop. ``progress_delay_us`` (default 1000): the progress thread waits in ``poll()`` on the UCX workers' event
descriptors and wakes when UCX signals work, or after this delay, rounded up to whole milliseconds (the UCX backend's
``nixlUcxSharedThread`` in NIXL's ``src/plugins/ucx/ucx_backend.cpp``). NIXL's Python ``nixl_agent`` always passes 0,
which makes that ``poll()`` return at once: the thread then spins, a whole core per idle agent (measured with NIXL
1.5.1 on a 2-core VM: 4.99 s of CPU in 5 s idle, against 0.15 s with 1000 us). 0 restores NIXL's own behaviour.
``UCX_TLS`` (environment, read when the agent starts) picks UCX's transports; ``tcp`` alone is the cross-host
setting, the default lets UCX use shared memory / CMA on one host. Without RDMA devices, ``UCX_MODULES=^ib`` is set (if unset): UCX's IB modules otherwise segfault
the process at exit.
"""
from __future__ import annotations

import base64
import logging
import os
import threading
import time
import types
import uuid
from typing import Any, Mapping

from ._adapter import AdapterEndpoint, coalesce_pairs
from .base import PeerError, Region, register_transport

log = logging.getLogger("dlmix.kv_connectors.nixl")

def _no_rdma_devices() -> bool:
    try:
        return not os.listdir("/sys/class/infiniband")
    except OSError:
        return True


# UCX's InfiniBand modules, loaded on a box with libibverbs but no RDMA device, crash the process at exit
# (SIGSEGV after interpreter teardown, measured with NIXL 1.5.1 here even for a bare agent); skip them there.
if _no_rdma_devices():
    os.environ.setdefault("UCX_MODULES", "^ib")

try:
    from nixl._api import nixl_agent as _Agent
    from nixl._api import nixl_agent_config as _Config
except (ImportError, OSError) as _e:
    raise ImportError(f"nixl adapter needs `pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1`: {_e}")


_AGENT_LOCK = threading.Lock()


def _new_agent(name: str, config: Any, delay_us: int) -> Any:
    """``nixl_agent(name, config)`` whose progress thread waits up to ``delay_us`` microseconds for UCX events
    (the agent config's ``pthrDelay``; see the module docstring). NIXL's ``nixl_agent.__init__`` builds its
    ``nixlAgentConfig`` itself and sets ``pthrDelay = 0``; for the call, the module it is defined in sees a
    ``nixlAgentConfig`` subclass that keeps at least ``delay_us``. Agents created in other modules meanwhile are not
    affected; a binding that cannot be subclassed falls back to NIXL's own setting, logged once."""
    if not delay_us:
        return _Agent(name, config)
    g = _Agent.__init__.__globals__
    bind = g.get("nixlBind")
    try:
        base = bind.nixlAgentConfig

        class _DelayedConfig(base):  # type: ignore[misc, valid-type]
            def __setattr__(self, key: str, value: Any) -> None:
                if key == "pthrDelay":
                    value = max(int(value), delay_us)
                super().__setattr__(key, value)

        proxy = types.SimpleNamespace(**{k: getattr(bind, k) for k in dir(bind) if not k.startswith("__")})
        proxy.nixlAgentConfig = _DelayedConfig
    except (AttributeError, TypeError) as e:
        log.warning("NIXL progress delay not applied (%s): its progress thread busy-polls", e)
        return _Agent(name, config)
    with _AGENT_LOCK:
        g["nixlBind"] = proxy
        try:
            return _Agent(name, config)
        finally:
            g["nixlBind"] = bind


@register_transport("nixl")
class NixlTransport(AdapterEndpoint):
    """dlmix control + NIXL (UCX backend). Host memory (DRAM) only in this build.

    Extra keywords: ``enable_prog_thread`` (bool, True) and ``progress_delay_us`` (int, 1000; both in the module
    docstring), ``backends`` (list, ``["UCX"]``),
    ``cancel_grace_s`` (float, 60): how long a failed or late transfer, which NIXL cannot abort, is waited for
    before it is given up (:meth:`_wait_out`). Until then its failure is not reported and ``cancel()`` does not
    return, so no byte lands after either.
    """

    PACKAGE = "nixl-cu12==1.5.1 nixl==1.5.1"

    def __init__(self, *, enable_prog_thread: bool = True, progress_delay_us: int = 1000,
                 backends: list[str] | None = None, cancel_grace_s: float = 60.0, **kw: Any):
        if type(progress_delay_us) is not int or not 0 <= progress_delay_us <= 10_000_000:
            raise ValueError(f"progress_delay_us must be an integer number of microseconds in 0..10000000, got "
                             f"{progress_delay_us!r}")
        self.enable_prog_thread = bool(enable_prog_thread)
        self.progress_delay_us = progress_delay_us
        self.cancel_grace_s = float(cancel_grace_s)
        self.backends = list(backends or ["UCX"])
        super().__init__(**kw)

    @classmethod
    def check_available(cls) -> str | None:
        return None

    def _lib_init(self) -> None:
        self._agent_name = f"{self.name}-{uuid.uuid4().hex[:8]}"
        self._agent = _new_agent(self._agent_name, _Config(enable_prog_thread=self.enable_prog_thread,
                                                           backends=self.backends), self.progress_delay_us)
        self._nixl_regs: dict[str, Any] = {}

    def _lib_descriptor(self) -> dict:
        return {"meta": base64.b64encode(self._agent.get_agent_metadata()).decode()}

    def _lib_register(self, reg: Region) -> None:
        self._nixl_regs[reg.name] = self._agent.register_memory([(reg.ptr, reg.length, 0, "")], "DRAM")

    def _lib_unregister(self, reg: Region) -> None:
        d = self._nixl_regs.pop(reg.name, None)
        if d is not None:
            self._agent.deregister_memory(d)

    def _lib_connect(self, peer: str, desc: Mapping) -> Any:
        meta = desc["lib"].get("meta")
        if not isinstance(meta, str):
            raise ValueError(f"descriptor of {peer!r} lacks the NIXL agent metadata")
        old = self._lib_peers.get(peer)
        if old is not None:
            try:
                self._agent.remove_remote_agent(old)
            except Exception:
                pass
        name = self._agent.add_remote_agent(base64.b64decode(meta))
        return name.decode() if isinstance(name, bytes) else name

    def _lib_transfer(self, op, peer, local, remote, remote_addrs, deadline) -> None:
        agent = self._agent
        lo, ro, ln = coalesce_pairs([reg.ptr + off for reg, off, _ in local], remote_addrs, [n for _, _, n in local])
        ld = agent.get_xfer_descs([(a, n, 0) for a, n in zip(lo, ln)], "DRAM")
        rd = agent.get_xfer_descs([(a, n, 0) for a, n in zip(ro, ln)], "DRAM")
        try:
            h = agent.initialize_xfer("READ" if op == "r" else "WRITE", ld, rd, self._lib_peers[peer])
        except Exception as e:
            raise PeerError(f"NIXL could not prepare the transfer with {peer!r}: {e}") from None
        started = False
        try:
            st = agent.transfer(h)
            started = st != "ERR"
            if not started:
                raise PeerError(f"NIXL transfer to {peer!r} failed to start")

            def done() -> bool:
                s = agent.check_xfer_state(h)
                if s == "ERR":
                    raise PeerError(f"NIXL transfer with {peer!r} failed")
                return s == "DONE"

            self._poll(done, deadline, "NIXL transfer")
        except BaseException:
            if started:
                self._wait_out(h, peer)
            raise
        finally:
            try:
                agent.release_xfer_handle(h)
            except Exception:
                pass

    def _wait_out(self, h: Any, peer: str) -> None:
        """Block until transfer ``h``, which failed or passed its deadline, can write no more bytes: until NIXL
        reports it no longer in progress, for at most ``cancel_grace_s`` seconds (then log an error). Never raises.

        NIXL cannot abort a transfer: releasing an active handle counts as cancelling it, but measured with NIXL
        1.5.1 over UCX-TCP, a READ whose owner was stalled past the deadline, its handle released, still wrote the
        whole destination once the owner ran again; removing the remote agent blocks while the transfer is active.
        The transfer's caller reuses its destination as soon as the transfer fails (e.g. the PD consumer's staging
        region), so the failure is reported only after this returns."""
        agent = self._agent
        end = time.monotonic() + self.cancel_grace_s
        while time.monotonic() < end:
            try:
                if agent.check_xfer_state(h) != "PROC":
                    return
            except Exception:
                return
            time.sleep(1e-3)
        log.error("a failed NIXL transfer with %r was still in progress %.0f s after it failed; it is given up, and "
                  "its destination may still be written", peer, self.cancel_grace_s)

    def _lib_close(self) -> None:
        agent = self._agent
        if agent is None:
            return
        for name in list(self._lib_peers.values()):
            try:
                agent.remove_remote_agent(name)
            except Exception:
                pass
        self._lib_peers.clear()
        for d in list(self._nixl_regs.values()):
            try:
                agent.deregister_memory(d)
            except Exception:
                pass
        self._nixl_regs.clear()
        # destroy the agent (and its UCX worker/progress thread) now: left to interpreter teardown it segfaults
        self._agent = None
        del agent
        import gc

        gc.collect()
