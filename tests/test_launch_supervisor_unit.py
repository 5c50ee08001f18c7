"""The supervisor's bookkeeping on fake processes (no process started)."""
from __future__ import annotations

from types import SimpleNamespace

from dlmix.launch.config import RestartPolicy
from dlmix.launch.supervisor import Supervised, Supervisor


class _Dead:
    """A process that exited with code 1 and cannot be started again (its port is still held)."""

    log_path = "/tmp/x.log"
    url = "http://127.0.0.1:1"

    def __init__(self):
        self.proc = SimpleNamespace(poll=lambda: 1, pid=2 ** 22 + 7, wait=lambda t: 1)

    def start(self):
        raise OSError("port 8100 is still in use")

    def log_tail(self, n):
        return "boom"


def test_the_stop_message_names_the_failed_restart_that_ended_an_engine(monkeypatch):
    """The last engine given up because its restart could not start: the reason that stops the deployment names
    that failure. Before, it named the exit before the restart ("exited with code 1"), a message that sends the
    operator to the wrong log line."""
    import dlmix.launch.supervisor as sup

    monkeypatch.setattr(sup, "kill_group", lambda pgid, timeout_s=10.0: None)
    s = Supervised(plan=SimpleNamespace(name="b", kind="engine", url="http://127.0.0.1:1", ready_timeout_s=1),
                   process=_Dead(), policy=RestartPolicy(max_restarts=1, backoff_s=0.0, backoff_max_s=0.0))
    v = Supervisor([s])
    v._step(s, 0.0)                 # exited: back-off
    assert s.state == "backoff"
    v._step(s, s.due + 1)           # the restart fails to start: given up
    assert s.state == "failed"
    v._check_fatal()
    v.stop()
    assert "restart 1 failed: port 8100 is still in use" in v.fatal, v.fatal


class _AliveButUnhealthy:
    """A process that stays alive (an LMDeploy api_server whose engine child died) and can be started again."""

    log_path = "/tmp/x.log"
    url = "http://127.0.0.1:1"

    def __init__(self):
        self.proc = SimpleNamespace(poll=lambda: None, pid=2 ** 22 + 9, wait=lambda t: 0)
        self.starts = 0

    def start(self):
        self.starts += 1

    def log_tail(self, n):
        return "PyTorch ZMQ engine process is not alive."


def test_an_alive_engine_answering_5xx_for_unhealthy_after_s_is_restarted(monkeypatch):
    """An engine process that does not exit but answers its health check with 503 for good (LMDeploy's api_server
    after its engine child died) was never restarted: the supervisor watched exits only. Now 5xx answers for
    ``unhealthy_after_s`` in a row are handled as an exit (group killed, restart scheduled, then started). No answer
    at all (a busy engine) and a 200 in between start the count again; the router's 503 is not watched."""
    import dlmix.launch.supervisor as sup

    killed = []
    monkeypatch.setattr(sup, "kill_group", lambda pgid, timeout_s=10.0: killed.append(pgid))
    proc = _AliveButUnhealthy()
    s = Supervised(plan=SimpleNamespace(name="prefill", kind="engine", url="http://127.0.0.1:1", ready_timeout_s=60,
                                        health_path="/health"),
                   process=proc, policy=RestartPolicy(max_restarts=3, backoff_s=0.0, backoff_max_s=0.0))
    router = Supervised(plan=SimpleNamespace(name="router", kind="router", url="http://127.0.0.1:2",
                                             ready_timeout_s=60), process=_AliveButUnhealthy(),
                        policy=RestartPolicy(max_restarts=3, backoff_s=0.0, backoff_max_s=0.0))
    v = Supervisor([s, router], health_every_s=5.0, unhealthy_after_s=60.0)
    answers = iter([503, 503, None, 503, 200] + [503] * 20)
    asked = []

    def code(item):
        asked.append(item.name)
        return next(answers)

    monkeypatch.setattr(v, "_health_code", code)
    t = 0.0
    for _ in range(5):  # 503, 503, no answer, 503, 200: the count starts again at the 200
        v._step(s, t)
        t += 5.0
    assert s.state == "running" and s.unhealthy_since is None
    while s.state == "running" and t < 200:
        v._step(s, t)
        v._step(router, t)
        t += 5.0
    assert s.state == "backoff" and killed == [proc.proc.pid], (s.state, killed)
    assert 60.0 <= t - 25.0 - 5.0 <= 70.0  # 503 from t=25 on; handled at the first check >= 60 s later
    assert "router" not in asked  # the router's 503 (no instance yet) is not a failure
    exited = [e for e in v.events if e.kind == "exited"]
    assert "prefill is alive but answered /health with 503 for 60 s" in exited[-1].message
    v._step(s, s.due + 1)  # the restart starts it again
    assert s.state == "starting" and proc.starts == 1
    v.stop()
