"""NIXL adapter: a transfer that fails or is cancelled while NIXL is still moving its bytes is reported only once no
byte can land any more.

NIXL cannot abort a transfer (releasing an active handle "cancels" it, yet the bytes still arrive), so the adapter
waits the transfer out (``NixlTransport._wait_out``, bounded by ``cancel_grace_s``). Without that, the PD consumer,
which reuses its staging region as soon as a read fails, would find another request's KV overwritten by a late read.
The owner is stalled (SIGSTOP) right as NIXL starts the read, and resumed a little later: over UCX-TCP (the owner's
progress is needed) its bytes arrive only then.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from dlmix_kv_connectors import Segment, TransferCancelled, TransferTimeout, make_transport
from dlmix_kv_connectors.base import _resolve
from dlmix_kv_connectors.testing import PeerProcess, pattern

SECRET = "nixl-secret"
MiB = 1 << 20
UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}

try:
    _resolve("nixl")
    _why = None
except ImportError as e:
    _why = f"nixl adapter: package not installed ({e})"
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")


@pytest.mark.parametrize("how,stall_s", [("timeout", 2.5), ("cancel", 8.0)])  # cancel: beyond the 5 s + 2 s waits
def test_a_failed_or_cancelled_read_lands_nothing_afterwards(monkeypatch, how, stall_s):
    for k, v in UCX_TCP.items():
        monkeypatch.setenv(k, v)
    size = 32 * MiB
    local = make_transport("nixl", name="local", secret=SECRET)
    p = PeerProcess("nixl", "remote", SECRET, None, env=UCX_TCP)
    resume = threading.Timer(stall_s, p.cont)
    started = threading.Event()
    try:
        p.call("region", name="kv", size=size, seed=3)
        dst = np.zeros(size, dtype=np.uint8)
        local.register("kv", dst)
        local.connect(p.desc)
        assert p.call("grant", peer="local", tid="t", ranges=[["kv", 0, size]], mode="r")["ok"]
        agent = local._agent
        start = agent.transfer

        def stall_then_start(h, *a, **kw):  # the owner stops after the grant, as NIXL's READ leaves
            p.stop()
            resume.start()
            try:
                return start(h, *a, **kw)
            finally:
                started.set()

        agent.transfer = stall_then_start
        h = local.read("remote", [Segment("kv", 0, "kv", 0, size)], "t", timeout_s=1.0 if how == "timeout" else 60)
        assert started.wait(60)
        if how == "cancel":
            assert h.cancel() is True  # returns once the read can write nothing more
            exc = TransferCancelled
        else:
            exc = TransferTimeout
        with pytest.raises(exc):
            h.result(60)
        agent.transfer = start
        at_failure = dst.copy()
        resume.join()
        # whatever arrived, arrived before the failure was reported: nothing changes afterwards
        for _ in range(20):
            assert local.read("remote", [Segment("kv", 0, "kv", 0, 4096)], "t").result(60) == 4096
        assert np.array_equal(dst[4096:], at_failure[4096:])
        assert bytes(dst[:4096]) == bytes(pattern(size, 3)[:4096])
    finally:
        resume.cancel()
        p.cont()
        p.close()
        local.close()


def test_progress_thread_waits_for_ucx_events_instead_of_spinning(monkeypatch):
    """NIXL's ``nixl_agent`` sets ``pthrDelay = 0``, so the UCX progress thread's ``poll()`` returns at once and the
    thread spins a whole core per idle agent. The adapter hands NIXL ``progress_delay_us`` (default 1000) instead:
    checked on the config NIXL's agent receives, and on the CPU an idle agent then uses (a spinning one used 4.99 s
    in 5 s here; the bound only fails if the thread spins)."""
    import time

    import dlmix_kv_connectors.nixl as nx

    g = nx._Agent.__init__.__globals__
    bind = g["nixlBind"]
    seen, real = [], bind.nixlAgent

    def capture(name, cfg):
        seen.append((cfg.useProgThread, cfg.pthrDelay))
        return real(name, cfg)

    monkeypatch.setattr(bind, "nixlAgent", capture)
    for delay in (None, 0, 250):
        kw = {} if delay is None else {"progress_delay_us": delay}
        make_transport("nixl", name=f"d{delay}", secret=SECRET, **kw).close()
    assert seen == [(True, 1000), (True, 0), (True, 250)]
    assert g["nixlBind"] is bind  # NIXL's module is left as it was
    for bad in (-1, 1.5, "1000", True, 10**8):
        with pytest.raises(ValueError, match="progress_delay_us"):
            make_transport("nixl", name="bad", secret=SECRET, progress_delay_us=bad)
    monkeypatch.undo()

    idle = make_transport("nixl", name="idle", secret=SECRET)
    try:
        time.sleep(0.5)  # past the agent's start-up
        c0 = time.process_time()
        time.sleep(2.0)
        used = time.process_time() - c0
    finally:
        idle.close()
    assert used < 0.5, f"an idle NIXL agent used {used:.2f} s of CPU in 2 s: its progress thread spins"
