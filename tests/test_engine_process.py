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


def test_free_port_is_below_the_ephemeral_range_and_not_handed_out_twice():
    """``free_port`` never returns a port the kernel may give a port-0 bind meanwhile (an engine's own listeners), and
    not one it returned lately (its server may not have bound it yet)."""
    from dlmix.engine_process import _ephemeral_low

    low = _ephemeral_low()
    ports = [free_port() for _ in range(500)]
    assert all(10000 <= p < low for p in ports)
    assert len(set(ports)) == 500


def test_pd_test_spec_builds_the_same_command_line_as_the_connector_test_launcher(tmp_path, monkeypatch):
    """One vLLM command-line builder: ``pd_test_spec`` gives the flags and environment that the connector tests'
    launcher (dlmix_vllm.testing.launch) passes, flag for flag."""
    import subprocess

    import dlmix_vllm.testing as vt
    from dlmix.engine_process import pd_test_spec

    seen = {}

    class FakePopen:
        def __init__(self, args, env=None, **kw):
            seen["args"], seen["env"] = list(args), dict(env)
            self.pid = 0

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    vt.launch("p", "/models/m", tmp_path, role="kv_producer", cpu="1", port=4321, extra={"transport": "tcp"},
              extra_args=["--x", "1"])

    def pairs(argv):
        i = argv.index("-m") + 2  # after "-m vllm.entrypoints.openai.api_server"
        out, rest = set(), argv[i:]
        while rest:
            if len(rest) > 1 and not rest[1].startswith("--"):
                out.add((rest[0], rest[1]))
                rest = rest[2:]
            else:
                out.add((rest[0], None))
                rest = rest[1:]
        return out

    spec = pd_test_spec("/models/m", role="kv_producer", cpu="1", port=4321,
                        extra={"transport": "tcp"}, extra_args=["--x", "1"])
    assert pairs(spec.argv()) == pairs(seen["args"])
    env = spec.child_env()
    for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CACHE_ROOT", "VLLM_SERVER_DEV_MODE", "HF_HUB_OFFLINE",
              "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "PYTHONUNBUFFERED"):
        assert env[k] == seen["env"][k], k
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_server_child_stop_signals_the_leader_alone_then_kills_what_it_left(tmp_path):
    """ServerChild.stop: SIGTERM reaches the server process only (it shuts its own engine processes down; an engine
    process that got the signal itself could die before reading its server's close request, which hung LMDeploy's
    API server), then the group is killed: a child the leader left behind is gone and never saw SIGTERM."""
    import subprocess

    from dlmix.engine_process import ServerChild

    child_log, pidfile = tmp_path / "child.log", tmp_path / "child.pid"
    child = ("import signal, time; "
             f"signal.signal(signal.SIGTERM, lambda *a: open({str(child_log)!r}, 'a').write('SIGTERM\\n')); "
             "time.sleep(300)")
    leader = ("import signal, subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
              f"open({str(pidfile)!r}, 'w').write(str(p.pid)); "
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(300)")
    s = ServerChild(subprocess.Popen([sys.executable, "-c", leader], start_new_session=True), "http://127.0.0.1:9",
                    tmp_path / "none.log")
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    time.sleep(0.5)  # the child's handler is installed
    s.stop(timeout_s=10)
    assert s.proc.returncode == 0  # the leader exited on its own SIGTERM
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    assert not child_log.exists()  # SIGKILLed with the group, never sent SIGTERM


def test_sglang_cpu_tp_ranks_get_one_group_of_cores_each():
    """SGLang's CPU path allows one TP rank per NUMA node unless ``SGLANG_CPU_OMP_THREADS_BIND`` names each rank's
    cores: :class:`SGLangServerSpec` sets it for TP > 1 on CPU (cores cut into consecutive groups), not otherwise."""
    from dlmix.engine_process import SGLangServerSpec, cpu_bind_groups

    assert cpu_bind_groups(2, "0-3") == "0-1|2-3"
    assert cpu_bind_groups(2, "0-2,4,5,7") == "0-2|4-5,7"
    assert cpu_bind_groups(3, "0,1") == "0|1|0"  # fewer cores than ranks: shared
    assert cpu_bind_groups(1, "5") == "5"
    with pytest.raises(ValueError):
        cpu_bind_groups(0)
    spec = SGLangServerSpec(model="/m", port=1, tensor_parallel_size=2, taskset_cpus="0-3")
    assert spec.env_additions()["SGLANG_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    assert "--tp-size" in spec.argv() and spec.argv()[spec.argv().index("--tp-size") + 1] == "2"
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in SGLangServerSpec(model="/m", port=1).env_additions()
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in SGLangServerSpec(model="/m", port=1, tensor_parallel_size=2,
                                                                  device="cuda").env_additions()


def test_the_log_tail_names_the_first_exception_further_up(tmp_path):
    """An LMDeploy engine that dies in its engine process ends its log with the api server's own traceback about the
    dead child (``RPCServerDeadError``): the cause, further up, comes first with its line number (before: the last
    lines only, a new user saw no reason)."""
    from dlmix.engine_process import log_tail

    log = tmp_path / "x.log"
    lines = ["starting", "Traceback (most recent call last):", '  File "a.py", line 1, in <module>',
             "dlmix_lmdeploy.config.DLMixLMDeployConfigError: invalid DLMIX_LMDEPLOY_CONFIG: pull_threads: >= 1",
             *[f"noise {i}" for i in range(50)], "(EngineCore pid=7) ValueError: later one",
             "lmdeploy.serve.exceptions.RPCServerDeadError: engine process is not alive"]
    log.write_text("\n".join(lines) + "\n")
    got = log_tail(log, 5).splitlines()
    assert got[0] == ("first exception in the log (line 4): dlmix_lmdeploy.config.DLMixLMDeployConfigError: invalid "
                      "DLMIX_LMDEPLOY_CONFIG: pull_threads: >= 1")
    assert got[1:] == ["...", *lines[-5:]]
    # the first exception within the tail itself, or none at all: the tail alone
    assert log_tail(log, 60).splitlines() == lines[-60:]
    log.write_text("a\nb\nc\n")
    assert log_tail(log, 2) == "b\nc" and log_tail(tmp_path / "missing.log") == ""
    log.write_text("(EngineCore pid=12) torch.OutOfMemoryError: no\n" + "x\n" * 9)
    assert log_tail(log, 3).startswith("first exception in the log (line 1): (EngineCore pid=12) torch.OutOfMemory")
