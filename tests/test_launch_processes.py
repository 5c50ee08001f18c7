"""dlmix launch with dlmix's mock engines (fast): readiness, router wiring, log following, and no orphans after a
normal stop, a failed start, a port in use, and SIGINT to the CLI."""
from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import httpx
import pytest

from dlmix.engine_process import free_port_block
from dlmix.launch import Deployment, PortInUseError, ProcessFailedError, launch
from dlmix.testing import wait_until


def _deployment(tmp_path: Path, *, router: bool = True, fail_b: bool = False, port_b: int | None = None,
                a_args: str = "") -> Path:
    # three distinct ports: two free_port() calls can return the same just-released port
    pa = free_port_block(1)
    pb = port_b or free_port_block(1, taken=(pa,))
    pr = free_port_block(1, taken=(pa, pb))
    b_args = '["--spawn-child", "--fail-after", "0.3"]' if fail_b else '["--ttft-ms", "1"]'
    text = "name: t\n"
    if router:
        text += f"router: {{port: {pr}, policy: round_robin, ready_timeout_s: 60}}\n"
    text += ("instances:\n"
             f"  - {{name: a, engine: mock, port: {pa}, extra_args: [\"--spawn-child\", \"--ttft-ms\", \"1\"{a_args}]}}\n"
             f"  - {{name: b, engine: mock, port: {pb}, extra_args: {b_args}}}\n")
    f = tmp_path / "dep.yaml"
    f.write_text(text)
    return f


def test_launch_router_and_engines_then_stop_leaves_no_process(tmp_path, orphans):
    dep = Deployment.from_file(_deployment(tmp_path))
    lines = []
    logs = tmp_path / "logs"
    with launch(dep, log_dir=logs, follow_logs=True, log_writer=lambda n, l: lines.append((n, l))) as running:
        assert running.router_url == dep.router.url and running.url == dep.router.url
        assert [i.name for i in running.instances] == ["a", "b"]
        admin = httpx.get(running.router_url + "/admin/instances",
                          headers={"Authorization": f"Bearer {running.secret}"}, timeout=30).json()
        assert sorted(i["url"] for i in admin["instances"]) == sorted(i.url for i in running.instances)
        for k in range(4):
            r = httpx.post(running.url + "/v1/completions", timeout=30,
                           json={"model": "mock", "prompt": [1, 2, 3, k], "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
        orphans.track(pgids=running.pgids(), logs=logs)
        members = orphans.group_members(running.pgids())
        assert len(running.pgids()) == 3
        assert len(members) >= 4                    # router, 2 engines, engine a's grandchild
        assert orphans.logged_pids(logs) <= members
        orphans.track(pids=members)
        wait_until(lambda: any(n == "a" and "mock engine listening" in l for n, l in list(lines)), 60,
                   "the log follower to pass on engine a's log")
    orphans.assert_gone()
    names = {n for n, _ in lines}
    assert {"a", "b", "router"} <= names
    assert any(n == "a" and "mock engine listening" in l for n, l in lines)


def test_engine_that_fails_to_start_stops_everything(tmp_path, orphans):
    dep = Deployment.from_file(_deployment(tmp_path, fail_b=True))
    logs = tmp_path / "logs"
    with pytest.raises(ProcessFailedError) as ei:
        with launch(dep, log_dir=logs):
            pytest.fail("launch must not succeed")
    msg = str(ei.value)
    assert "engine 'b'" in msg and "exited with code 1 during start-up" in msg
    assert "ERROR: mock engine failed to start" in msg             # the log tail
    assert len(orphans.logged_pids(logs)) == 4                     # 2 engines + 2 grandchildren
    orphans.track(logs=logs).assert_gone()


def test_port_in_use_is_named_and_nothing_starts(tmp_path, orphans):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        dep = Deployment.from_file(_deployment(tmp_path, port_b=taken))
        logs = tmp_path / "logs"
        with pytest.raises(PortInUseError) as ei:
            with launch(dep, log_dir=logs):
                pytest.fail("launch must not succeed")
    msg = str(ei.value)
    assert f"port {taken} on 127.0.0.1 (instances[1].port in {tmp_path / 'dep.yaml'}) is already in use" in msg
    assert "Nothing was started" in msg
    assert not list(logs.glob("*.log")) and not orphans.cmdline_pids(str(logs))


def _ready_cli(tmp_path, orphans, cli_launch, a_args: str = ""):
    """``dlmix launch`` of the two-mock deployment as a CLI child, waited until ready, with its router, engines and
    the engines' grandchildren tracked by ``orphans``."""
    f = _deployment(tmp_path, a_args=a_args)
    logs = tmp_path / "logs"
    cli = cli_launch(f, logs, columns=200)
    cli.wait_for(b"Ctrl-C stops everything", 180, "the deployment to be ready")
    children = orphans.logged_pids(logs) | orphans.cmdline_pids(str(logs))
    assert len(children) >= 5                                      # router, 2 engines, 1 grandchild, ...
    orphans.track(pids=children, logs=logs)
    return cli


def test_cli_sigint_stops_every_child(tmp_path, orphans, cli_launch):
    cli = _ready_cli(tmp_path, orphans, cli_launch)
    text = cli.interrupt()
    assert cli.proc.returncode == 130, text
    assert "stopping every process" in text and "stopped." in text
    orphans.assert_gone()


def test_cli_sigterm_stops_every_child_and_exits_143(tmp_path, orphans, cli_launch):
    """SIGTERM (``kill``, Kubernetes, systemd) stops the deployment as Ctrl-C does; the exit code says which signal
    it was (128 + 15), as a shell reports it; before, every stop signal exited 130 (Ctrl-C's)."""
    cli = _ready_cli(tmp_path, orphans, cli_launch)
    text = cli.interrupt(sig=signal.SIGTERM)
    assert cli.proc.returncode == 143, text
    assert "stopping every process" in text and "stopped." in text
    orphans.assert_gone()


def test_cli_killed_with_sigkill_leaves_no_engine_serving(tmp_path, orphans, cli_launch):
    """``kill -9`` of ``dlmix launch`` (or the OOM killer) runs none of its stop code: its router and engines, each in
    its own session, get SIGTERM from the kernel when it dies (``PR_SET_PDEATHSIG``) and stop with their children."""
    import shutil

    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv (util-linux): children are not tied to the launcher's life")
    cli = _ready_cli(tmp_path, orphans, cli_launch)
    os.kill(cli.proc.pid, signal.SIGKILL)
    cli.proc.wait(30)
    orphans.assert_gone()


def test_cli_second_sigint_while_stopping_still_stops_every_child(tmp_path, orphans, cli_launch):
    """A second Ctrl-C while the CLI stops (engine a takes 3 s to stop) must not abort the stop half-way: before
    the fix it raised inside the stop and the CLI exited with the router and engines still running."""
    cli = _ready_cli(tmp_path, orphans, cli_launch, a_args=', \"--stop-delay-s\", \"3\"')
    text = cli.interrupt(again_after=b"stopping every process")
    assert cli.proc.returncode == 130, text
    assert "stopped." in text
    orphans.assert_gone()


def test_engine_dying_after_ready_is_reported_and_everything_stops_when_unsupervised(tmp_path, orphans):
    logs = tmp_path / "logs"
    with pytest.raises(ProcessFailedError) as ei:
        with launch(_deployment(tmp_path, router=False), log_dir=logs, supervise=False) as running:  # a path works
            assert running.router_url is None and running.url == running.instances[0].url
            orphans.track(pgids=running.pgids(), logs=logs)
            os.kill(running.instances[1].pid, signal.SIGKILL)
            running.wait(poll_s=0.05)
    assert "b exited with code -9" in str(ei.value)
    orphans.assert_gone()


def test_an_instance_whose_python_cannot_run_fails_the_launch_with_its_reason(tmp_path, orphans):
    """An instance ``python`` that exists but is not executable passes the machine check; starting it fails with
    ProcessFailedError naming the instance and the OS error, and what had started (router, engine a) is stopped.
    Before, any start failure was reported as a port in use ("Nothing was started") although processes had run."""
    bad = tmp_path / "python-not-executable"
    bad.write_text("#!/bin/sh\n")
    f = _deployment(tmp_path)
    text = f.read_text()
    i = text.index("{name: b, engine: mock, ")  # instance b only
    f.write_text(text[:i] + text[i:].replace("engine: mock, ", f"engine: mock, python: {bad}, ", 1))
    logs = tmp_path / "logs"
    with pytest.raises(ProcessFailedError) as ei:
        with launch(Deployment.from_file(f), log_dir=logs):
            pytest.fail("launch must not succeed")
    assert "'b' could not be started" in str(ei.value) and "Permission denied" in str(ei.value)
    orphans.track(logs=logs).assert_gone()


def _marked(mark: str) -> set[int]:
    """Live, non-zombie processes whose environment holds ``DLMIX_TEST_MARK=mark``."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"DLMIX_TEST_MARK={mark}".encode() in env and state != "Z":
            out.add(int(d.name))
    return out


def test_dlmix_demo_stopped_with_sigterm_leaves_no_process(tmp_path, orphans):
    """``dlmix demo --deployment FILE`` stopped with SIGTERM (``kill``, a CI timeout) stops its deployment as Ctrl-C
    does: no router, engine or grandchild is left. Before, the default SIGTERM ended the interpreter and left them
    all running (they run in their own sessions)."""
    import subprocess
    import sys

    mark = f"demo-{os.getpid()}"
    f = _deployment(tmp_path)
    f.write_text(f.read_text().replace('extra_args: ["--ttft-ms", "1"]', 'extra_args: ["--startup-s", "60"]'))
    env = {**os.environ, "DLMIX_TEST_MARK": mark}
    cli = subprocess.Popen([sys.executable, "-m", "dlmix.cli", "demo", "--deployment", str(f)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        wait_until(lambda: len(_marked(mark) - {cli.pid}) >= 4, 120, "router, two engines and a grandchild")
        orphans.track(pids=_marked(mark) - {cli.pid})
        cli.send_signal(signal.SIGTERM)
        cli.wait(120)
        wait_until(lambda: not _marked(mark), 30, "every process of the deployment to end")
        orphans.assert_gone()
    finally:
        if cli.poll() is None:
            cli.kill()
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_an_instance_bound_to_ipv6_loopback_starts(tmp_path, orphans):
    """``host: '::1'``: the start-time port check uses an IPv6 socket (an IPv4 one can never bind ``::1``, so every
    IPv6 instance failed with "port ... is in use" for a free port)."""
    p = free_port_block(1)
    f = tmp_path / "dep.yaml"
    f.write_text(f"name: v6\ninstances:\n  - {{name: a, engine: mock, host: '::1', port: {p}, ready_timeout_s: 60}}\n")
    logs = tmp_path / "logs"
    with launch(Deployment.from_file(f), log_dir=logs) as running:
        assert f"[::1]:{p}" in running.processes[0].url
        assert httpx.get(f"http://[::1]:{p}/health", timeout=30).status_code == 200
    orphans.track(logs=logs).assert_gone()


def test_cli_example_request_carries_the_key_a_keyed_router_needs(tmp_path, orphans, cli_launch):
    """With router.config.api_keys the router answers 401 to a request without a key: the example curl launch prints
    sends the Authorization header (a placeholder, named), and that request with a real key succeeds; without keys
    the example stays as it was."""
    import re
    import shlex
    import subprocess

    f = _deployment(tmp_path)
    f.write_text(f.read_text().replace("policy: round_robin,", "policy: round_robin, config: {api_keys: [k1]},"))
    logs = tmp_path / "logs"
    cli = cli_launch(f, logs, columns=400)
    cli.wait_for(b"Ctrl-C stops everything", 180, "the deployment to be ready")
    orphans.track(pids=orphans.logged_pids(logs) | orphans.cmdline_pids(str(logs)), logs=logs)
    (line,) = [ln for ln in cli.out.decode().splitlines() if "try: curl" in ln]
    assert "-H 'Authorization: Bearer KEY'" in line and "(KEY: one of router.config.api_keys)" in line, line
    cmd = re.sub(r"\s+\(KEY: .*\)$", "", line.split("try: ", 1)[1]).replace("Bearer KEY", "Bearer k1")
    r = subprocess.run(shlex.split(cmd) + ["-o", "/dev/null", "-w", "%{http_code}"], capture_output=True, text=True,
                       timeout=60)
    assert r.stdout == "200", (cmd, r.stdout, r.stderr)
    text = cli.interrupt()
    assert cli.proc.returncode == 130, text
    orphans.assert_gone()
