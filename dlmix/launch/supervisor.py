"""Supervision of a running deployment: a process that dies is reported and restarted with exponential back-off.

:func:`dlmix.launch.runner.start` hands every started process to a :class:`Supervisor` once the deployment is ready.
A background thread polls the processes every ``poll_s`` seconds (a state machine per process, nothing blocks on
one process):

* ``running`` -> the process exited: its whole process group is killed (children such as vLLM's EngineCore would
  otherwise keep the port and the accelerator memory), the exit is reported, and a restart is scheduled after
  :meth:`RestartPolicy.delay` seconds -- or, when ``max_restarts`` restarts in a row are used up, it is given up;
* ``backoff`` -> the delay passed: the same command line is started again on the same port, same log file (appended);
* ``starting`` -> ``GET /health`` answers (200; the router also 503 = listening, no instance yet): ``running``
  again. Exit or no answer within the process's ``ready_timeout_s``: counted as a failed restart.
* ``running`` engine that stays alive but says it cannot serve: its health path is asked every
  :attr:`Supervisor.health_every_s` seconds; when it has answered with a 5xx status for
  :attr:`Supervisor.unhealthy_after_s` seconds in a row (e.g. an LMDeploy ``api_server`` whose engine child process
  died answers 503 "engine process is not alive" for good), it is handled as an exit: its group is killed and a
  restart scheduled. Only an answer counts: no answer (a busy engine, a timeout) never triggers it, and a 200 in
  between starts the count again.

The other processes are untouched and keep serving. The router takes a dead engine out of rotation by itself (a
refused connection does it at once, health checks every ``health_interval_s`` otherwise; the request is retried on
another instance) and puts it back after its next successful health check; engines with the DLMix connector
re-register on their own (a heartbeat answered 404 makes them register again, so a restarted router relearns them).

The deployment fails as a whole (:meth:`Supervisor.fatal` is set; :meth:`RunningDeployment.wait` raises) only when
the router is given up or every engine is given up.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import httpx

from dlmix.launch.config import RestartPolicy

__all__ = ["Supervised", "Supervisor", "SupervisorEvent", "kill_group", "console_printer"]


@dataclass
class SupervisorEvent:
    """One thing the supervisor did or saw.

    Attributes:
        t: ``time.time()`` of the event (seconds since the epoch).
        name: process name.
        kind: ``exited``, ``restarting``, ``started``, ``healthy``, ``start_failed``, ``gave_up``.
        message: one human-readable line.
        restarts: restarts used so far in the current run of failures.
    """

    t: float
    name: str
    kind: str
    message: str
    restarts: int = 0


_EVENT_STYLE = {"exited": "red", "gave_up": "bold red", "start_failed": "red", "restarting": "yellow",
                "started": "yellow", "healthy": "green"}


def console_printer(console) -> Callable[[SupervisorEvent], None]:
    """An ``on_event`` callback printing each event as one time-stamped, coloured line on a rich ``console``."""
    from rich.markup import escape

    def show(ev: SupervisorEvent) -> None:
        style = _EVENT_STYLE.get(ev.kind, "white")
        console.print(f"[dim]{time.strftime('%H:%M:%S', time.localtime(ev.t))}[/] [{style}]supervisor[/] "
                      f"{escape(ev.message)}", highlight=False, soft_wrap=True)

    return show


@dataclass
class Supervised:
    """A process under supervision: its plan (command, URL, kind), its :class:`EngineProcess`, its policy and state.

    ``state`` is ``running``, ``backoff``, ``starting`` or ``failed``; ``restarts`` counts restarts in a row (reset
    after ``policy.reset_after_s`` of running); ``total_restarts`` never resets.
    """

    plan: object  # dlmix.launch.runner.ProcessPlan (name, kind, url, ready_timeout_s)
    process: object  # dlmix.engine_process.EngineProcess
    policy: RestartPolicy
    state: str = "running"
    restarts: int = 0
    total_restarts: int = 0
    since: float = field(default_factory=time.monotonic)
    due: float = 0.0
    last_exit: Optional[int] = None
    #: how it last ended (``"b exited with code -9"``), for the message that stops the deployment
    last_end: str = ""
    #: since when (``time.monotonic()``) a running engine has answered its health check with a 5xx status, in a row
    unhealthy_since: Optional[float] = None
    #: when (``time.monotonic()``) a running engine's health is asked next
    next_health: float = 0.0

    @property
    def name(self) -> str:
        return self.plan.name  # type: ignore[attr-defined]


def kill_group(pgid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL process group ``pgid`` until no live member is left (bounded by ``timeout_s``); by id only."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        if not group_members({pgid}) or time.monotonic() > deadline:
            return
        time.sleep(0.05)


class Supervisor:
    """Watches processes and restarts the ones that die (see the module docstring).

    Args:
        items: the processes (:class:`Supervised`).
        on_event: called with every :class:`SupervisorEvent` from the supervisor thread (e.g. print it).
        poll_s: seconds between polls.
        lock: held while a process is (re)started, so :meth:`stop` never races a spawn.
        health_every_s: seconds between health checks of a running engine.
        unhealthy_after_s: seconds of 5xx health answers in a row after which a running engine is restarted.
    """

    def __init__(self, items: List[Supervised], on_event: Optional[Callable[[SupervisorEvent], None]] = None,
                 poll_s: float = 0.5, lock: Optional[threading.Lock] = None, health_every_s: float = 5.0,
                 unhealthy_after_s: float = 60.0):
        self.health_every_s = health_every_s
        self.unhealthy_after_s = unhealthy_after_s
        self.items = items
        self.on_event = on_event
        self.poll_s = poll_s
        self.events: List[SupervisorEvent] = []
        self.fatal: Optional[str] = None
        self.lock = lock or threading.Lock()
        self._stop = threading.Event()
        self._fatal_evt = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="dlmix-launch-supervisor")
        self._client = httpx.Client(timeout=1.0)

    def start(self) -> "Supervisor":
        self._t.start()
        return self

    def stop(self) -> None:
        """Stop supervising (no further restarts); returns after the thread ended."""
        self._stop.set()
        if self._t.is_alive() and threading.current_thread() is not self._t:
            self._t.join(30)
        self._client.close()

    def wait_fatal(self, timeout: Optional[float] = None) -> Optional[str]:
        """Block until the deployment failed as a whole (returns the reason) or ``timeout`` s (returns None)."""
        self._fatal_evt.wait(timeout)
        return self.fatal

    # ------------------------------------------------------------------ internals
    def _emit(self, s: Supervised, kind: str, message: str) -> None:
        ev = SupervisorEvent(time.time(), s.name, kind, message, s.restarts)
        self.events.append(ev)
        if self.on_event is not None:
            with contextlib.suppress(Exception):
                self.on_event(ev)

    def _run(self) -> None:
        while not self._stop.is_set():
            for s in self.items:
                if self._stop.is_set():
                    break
                try:
                    self._step(s, time.monotonic())
                except Exception as e:  # noqa: BLE001 - supervision must survive anything a step raises
                    self._emit(s, "error", f"supervisor error on {s.name}: {type(e).__name__}: {e}")
            self._check_fatal()
            self._stop.wait(self.poll_s)

    def _check_fatal(self) -> None:
        if self.fatal is not None:
            return
        router = [s for s in self.items if s.plan.kind == "router"]  # type: ignore[attr-defined]
        engines = [s for s in self.items if s.plan.kind == "engine"]  # type: ignore[attr-defined]
        reason = None
        if any(s.state == "failed" for s in router):
            reason = "the router was given up"
        elif engines and all(s.state == "failed" for s in engines):
            reason = "every engine was given up"
        if reason:
            gone = [s for s in router + engines if s.state == "failed"]
            self.fatal = reason + ": " + "; ".join(
                f"{s.last_end or s.name} (log {s.process.log_path})" for s in gone)  # type: ignore[attr-defined]
            self._fatal_evt.set()

    def _is_last(self, s: Supervised) -> bool:
        """Giving ``s`` up stops the deployment: it is the router, or the last engine not given up."""
        if s.plan.kind == "router":  # type: ignore[attr-defined]
            return True
        return all(o.state == "failed" for o in self.items if o is not s and o.plan.kind == "engine")  # type: ignore

    def _health_code(self, s: Supervised) -> Optional[int]:
        """The HTTP status of ``s``'s health path, or None without an answer (refused, timed out)."""
        try:
            path = getattr(s.plan, "health_path", "/health")
            return self._client.get(s.plan.url + path).status_code  # type: ignore[attr-defined]
        except httpx.HTTPError:
            return None

    def _healthy(self, s: Supervised) -> bool:
        code = self._health_code(s)
        return code == 200 or (s.plan.kind == "router" and code == 503)  # type: ignore[attr-defined]

    def _watch_health(self, s: Supervised, now: float) -> None:
        """A running engine's periodic health check (module docstring): restart it after ``unhealthy_after_s`` of
        5xx answers in a row."""
        if now < s.next_health:
            return
        s.next_health = now + self.health_every_s
        code = self._health_code(s)
        if code is None:  # no answer: busy or slow, never a reason to restart a live process
            return
        if code < 500:
            s.unhealthy_since = None
            return
        if s.unhealthy_since is None:
            s.unhealthy_since = now
        elif now - s.unhealthy_since >= self.unhealthy_after_s:
            path = getattr(s.plan, "health_path", "/health")
            self._died(s, now, f"{s.name} is alive but answered {path} with {code} for "
                               f"{now - s.unhealthy_since:.0f} s", None)

    def _step(self, s: Supervised, now: float) -> None:
        p = s.process
        if s.state in ("running", "starting"):
            rc = p.proc.poll() if p.proc is not None else -1  # type: ignore[attr-defined]
            if rc is not None:
                self._died(s, now, f"{s.name} exited with code {rc}", rc)
            elif s.state == "starting":
                if self._healthy(s):
                    s.state, s.since = "running", now
                    self._emit(s, "healthy", f"{s.name} is healthy again after restart {s.restarts} "
                                             f"({p.url})")  # type: ignore[attr-defined]
                elif now - s.since > s.plan.ready_timeout_s:  # type: ignore[attr-defined]
                    self._died(s, now, f"{s.name} was not healthy {s.plan.ready_timeout_s:.0f} s after its "
                                       f"restart", None)  # type: ignore[attr-defined]
            else:
                if s.restarts and now - s.since >= s.policy.reset_after_s:
                    s.restarts = 0
                if s.plan.kind == "engine":  # type: ignore[attr-defined]
                    self._watch_health(s, now)
        elif s.state == "backoff" and now >= s.due:
            with self.lock:
                if self._stop.is_set():
                    return
                s.restarts += 1
                s.total_restarts += 1
                try:
                    p.start()  # type: ignore[attr-defined]
                except Exception as e:  # noqa: BLE001 - e.g. the port is still held
                    s.last_end = f"{s.name}: restart {s.restarts} failed: {e}"  # what ended it, if given up now
                    self._emit(s, "start_failed", s.last_end)
                    self._schedule(s, time.monotonic())
                    return
            s.state, s.since = "starting", time.monotonic()
            self._emit(s, "started", f"{s.name} restarted (restart {s.restarts} of {s.policy.max_restarts}, "
                                     f"pid {p.proc.pid})")  # type: ignore[attr-defined]

    def _died(self, s: Supervised, now: float, what: str, rc: Optional[int]) -> None:
        p = s.process
        s.last_exit = rc
        s.unhealthy_since = None
        if p.proc is not None:  # type: ignore[attr-defined]
            kill_group(p.proc.pid)  # type: ignore[attr-defined]  # leftovers of the group go too
            with contextlib.suppress(Exception):
                p.proc.wait(5)  # type: ignore[attr-defined]
        if s.state == "running" and now - s.since >= s.policy.reset_after_s:
            s.restarts = 0
        s.last_end = what
        tail = p.log_tail(5).strip().replace("\n", " | ")  # type: ignore[attr-defined]
        if len(tail) > 300:  # its last 300 characters, from a word boundary
            cut = tail[-300:]
            tail = "..." + cut[max(0, cut.find(" ")):]
        self._emit(s, "exited", f"{what}; log {p.log_path}: {tail}")  # type: ignore[attr-defined]
        self._schedule(s, now)

    def _schedule(self, s: Supervised, now: float) -> None:
        if s.restarts >= s.policy.max_restarts:
            then = ("the deployment stops" if self._is_last(s) else "the other processes keep running")
            s.state = "failed"
            self._emit(s, "gave_up", f"{s.name} given up after {s.restarts} restart(s) in a row "
                                     f"(max_restarts {s.policy.max_restarts}); {then}")
            return
        d = s.policy.delay(s.restarts)
        s.state, s.due = "backoff", now + d
        self._emit(s, "restarting", f"restarting {s.name} in {d:.1f} s (restart {s.restarts + 1} of "
                                    f"{s.policy.max_restarts})")


def group_members(pgids: set) -> set:
    """``{(pid, pgid)}`` of live (non-zombie) processes whose process group is in ``pgids`` (Linux ``/proc``;
    elsewhere an empty set)."""
    out = set()
    proc = Path("/proc")
    if not proc.is_dir():
        return out
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if f[0] != "Z" and int(f[2]) in pgids:
            out.add((int(d.name), int(f[2])))
    return out
