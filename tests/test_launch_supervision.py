"""Supervision in ``dlmix launch`` with dlmix's mock engines (fast): a killed engine is reported and restarted with
back-off while the other keeps serving through the router, the router takes it out of rotation and back in, a
process given up leaves the rest running, and stopping leaves no process behind."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from dlmix.engine_process import free_port
from dlmix.launch import Deployment, ProcessFailedError, launch
from dlmix.launch.config import RestartPolicy
from dlmix.testing import wait_until


def _write(tmp_path: Path, *, router: bool, restart: str) -> Path:
    text = f"name: sup\nrestart: {restart}\n"
    if router:
        text += (f"router: {{port: {free_port()}, policy: round_robin, ready_timeout_s: 60,\n"
                 f"         config: {{health_interval_s: 0.2, health_failures: 1, breaker_cooldown_s: 0.5}}}}\n")
    text += ("instances:\n"
             f"  - {{name: a, engine: mock, port: {free_port()}, ready_timeout_s: 60,"
             f" extra_args: [\"--spawn-child\", \"--ttft-ms\", \"1\", \"--itl-ms\", \"0\"]}}\n"
             f"  - {{name: b, engine: mock, port: {free_port()}, ready_timeout_s: 60,"
             f" extra_args: [\"--ttft-ms\", \"1\", \"--itl-ms\", \"0\"]}}\n")
    f = tmp_path / "dep.yaml"
    f.write_text(text)
    return f


def _admin(running) -> dict:
    r = httpx.get(running.router_url + "/admin/instances", headers={"Authorization": f"Bearer {running.secret}"},
                  timeout=10)
    return {i["url"].rstrip("/"): i for i in r.json()["instances"]}


def _complete(url: str, k: int) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=30,
                      json={"model": "mock", "prompt": [1, 2, 3, k], "max_tokens": 2})


def _served(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("vllm:request_success_total"))


def test_killed_engine_restarts_while_the_other_serves(tmp_path, orphans):
    f = _write(tmp_path, router=True, restart="{max_restarts: 3, backoff_s: 3.0, backoff_max_s: 3.0}")
    events = []
    with launch(Deployment.from_file(f), log_dir=tmp_path / "logs", on_event=events.append) as running:
        a, b = running.instances
        old_pid = a.pid
        old_group = orphans.group_members({old_pid})
        assert len(old_group) == 2                                   # the engine and its grandchild
        orphans.track(pgids={old_pid}, pids=old_group)
        os.kill(old_pid, signal.SIGKILL)
        # while a is down (3 s back-off): the router shows it out of rotation and every request succeeds on b
        wait_until(lambda: not _admin(running)[a.url]["healthy"], 30, "the router to take a out of rotation")
        codes, k = [], 0
        while not any(e.kind == "started" for e in events):
            r = _complete(running.url, k)
            codes.append((r.status_code, r.json().get("usage", {}).get("completion_tokens")))
            k += 1
            time.sleep(0.02)
        assert codes and set(codes) == {(200, 2)}
        assert _admin(running)[b.url]["healthy"]
        # a is back: new pid, old group gone, healthy in the router, and it serves again through the router
        wait_until(lambda: any(e.kind == "healthy" and e.name == "a" for e in events), 60, "a to be healthy again")
        assert a.pid != old_pid and a.process.alive()
        assert not orphans.group_members({old_pid})
        wait_until(lambda: _admin(running)[a.url]["healthy"], 30, "the router to put a back into rotation")
        before = _served(a.url)
        for j in range(6):
            r = _complete(running.url, 1000 + j)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert _served(a.url) >= before + 2                          # round robin: a gets its share again
        kinds = [(e.name, e.kind) for e in events]
        assert kinds[:4] == [("a", "exited"), ("a", "restarting"), ("a", "started"), ("a", "healthy")], kinds
        assert "exited with code -9" in events[0].message and "in 3.0 s (restart 1 of 3)" in events[1].message
        assert [(e.name, e.kind) for e in running.events] == kinds
        assert running.supervisor.fatal is None
        members = orphans.group_members(running.pgids())
        assert len(members) >= 4                                     # router, a + grandchild, b
        orphans.track(pgids=running.pgids(), pids=members)
    orphans.assert_gone()                                            # clean stop: no orphans, old or new


def test_given_up_engine_leaves_the_rest_serving_until_none_is_left(tmp_path, orphans):
    f = _write(tmp_path, router=False, restart="{max_restarts: 0}")
    events = []
    with pytest.raises(ProcessFailedError) as ei:
        with launch(Deployment.from_file(f), log_dir=tmp_path / "logs", on_event=events.append) as running:
            a, b = running.instances
            orphans.track(pgids=running.pgids())
            os.kill(b.pid, signal.SIGKILL)
            wait_until(lambda: any(e.kind == "gave_up" for e in events), 30, "b to be given up")
            assert running.supervisor.fatal is None
            assert _complete(a.url, 1).status_code == 200              # a keeps serving
            os.kill(a.pid, signal.SIGKILL)
            running.wait(poll_s=0.05)
    assert [(e.name, e.kind) for e in events] == [("b", "exited"), ("b", "gave_up"), ("a", "exited"),
                                                  ("a", "gave_up")]
    # the first given up leaves a serving, the last stops the deployment; the failure names each once, with its log
    assert events[1].message.endswith("; the other processes keep running"), events[1].message
    assert events[3].message.endswith("; the deployment stops"), events[3].message
    logs = tmp_path / "logs"
    assert str(ei.value).endswith(f"every engine was given up: a exited with code -9 (log {logs / 'a.log'}); "
                                  f"b exited with code -9 (log {logs / 'b.log'})"), str(ei.value)
    orphans.assert_gone()


def test_restart_policy_backoff_and_overrides():
    p = RestartPolicy(backoff_s=0.5, backoff_max_s=3.0)
    assert [p.delay(k) for k in range(6)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert RestartPolicy().delay(10_000) == 60.0
    dep = Deployment.from_yaml(
        "restart: {max_restarts: 2}\nrouter: {port: 9000, restart: {max_restarts: 9}}\ninstances:\n"
        "  - {engine: mock, port: 9001, restart: {backoff_s: 0}}\n  - {engine: mock, port: 9002}\n")
    assert dep.restart_of(-1).max_restarts == 9
    assert dep.restart_of(0).backoff_s == 0 and dep.restart_of(0).max_restarts == 5   # own policy, own defaults
    assert dep.restart_of(1).max_restarts == 2
    with pytest.raises(Exception) as ei:
        Deployment.from_yaml("restart: {max_restart: 2}\ninstances:\n  - {engine: mock, port: 9001}\n", "x.yaml")
    assert "x.yaml:1:11: restart.max_restart: unknown key" in str(ei.value)


def test_cli_reports_the_restart_and_stops_cleanly(tmp_path, orphans, cli_launch):
    import re

    f = _write(tmp_path, router=True, restart="{max_restarts: 2, backoff_s: 0.5}")
    logs = tmp_path / "logs"
    cli = cli_launch(f, logs, columns=250)
    cli.wait_for(b"Ctrl-C stops everything", 90, "the deployment to be ready")
    pid_b = int(re.findall(r"mock engine pid (\d+)", (logs / "b.log").read_text())[0])
    os.kill(pid_b, signal.SIGKILL)
    cli.wait_for(b"b is healthy again after restart 1", 60, "the CLI to report b's restart")
    orphans.track(pgids=orphans.logged_pids(logs), logs=logs)
    text = cli.interrupt()
    assert cli.proc.returncode == 130, text
    assert "supervisor b exited with code -9" in text and "restarting b in 0.5 s (restart 1 of 2)" in text
    assert "stopped." in text
    orphans.assert_gone()
