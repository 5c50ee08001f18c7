"""EngineProcess stops the whole process group, also after the group leader itself exited."""
from __future__ import annotations

import os
import sys
import time

import pytest

from dlmix.engine_process import EngineProcess, EngineStartError, VLLMServerSpec, free_port


class _FakeSpec(VLLMServerSpec):
    def __init__(self, code: str, **kw):
        super().__init__(model="unused", port=free_port(), **kw)
        self.code = code

    def argv(self):
        return [sys.executable, "-c", self.code]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie still answers kill(0)
        return f.read().split(")")[-1].split()[0] != "Z"


def test_stop_kills_grandchild_left_by_exited_leader(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))")
    proc = EngineProcess(_FakeSpec(code), name="fake", log_dir=tmp_path).start()
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pidfile.read_text())
    proc.proc.wait(30)  # the leader exits by itself
    assert _alive(grandchild)
    proc.stop(grace_s=1)
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_dead_engine_reports_log_tail(tmp_path):
    proc = EngineProcess(_FakeSpec("print('boom: bad flag'); raise SystemExit(3)"), name="fake", log_dir=tmp_path)
    with pytest.raises(EngineStartError, match="boom: bad flag"):
        with proc:
            pass


def test_port_in_use_is_refused(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        spec = _FakeSpec("pass")
        spec.port = s.getsockname()[1]
        with pytest.raises(EngineStartError, match="in use"):
            EngineProcess(spec, name="fake", log_dir=tmp_path).start()


def test_free_port_block_is_below_the_ephemeral_range_and_skips_taken_ports():
    import socket

    from dlmix.engine_process import _ephemeral_low, free_port_block, port_free

    low = _ephemeral_low()
    for _ in range(20):
        p = free_port_block(3)
        assert 10000 <= p and p + 3 <= low
        assert all(port_free("127.0.0.1", p + k) for k in range(3))
    # a bound port is not free; a block overlapping "taken" is never returned
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))
        assert not port_free("127.0.0.1", p)
    taken = set(range(10000, low - 2000))  # leave only the top 2000 ports below the range
    q = free_port_block(2, taken=taken)
    assert q >= low - 2000 and not {q, q + 1} & taken
