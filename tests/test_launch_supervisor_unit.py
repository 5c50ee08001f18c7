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
