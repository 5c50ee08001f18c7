"""``dlmix launch DEPLOYMENT.yaml``: command-line front end of :mod:`dlmix.launch` (registered in dlmix.cli)."""
from __future__ import annotations

import contextlib
import shlex
import signal
from pathlib import Path
from typing import Optional, Tuple

import typer

from dlmix.paths import folder_problem

__all__ = ["StopSignal", "launch_cmd", "stopping_on_signals"]


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignal(KeyboardInterrupt):
    """A stop signal (SIGINT, SIGTERM or SIGHUP) received inside :func:`stopping_on_signals`; ``signum`` its number.
    The exit code after the stop is ``128 + signum`` (the shell's convention: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def _raise_interrupt(signum, frame):  # SIGINT/SIGTERM/SIGHUP -> the same clean stop as Ctrl-C
    # one-shot: a second signal (a second Ctrl-C, SIGTERM right behind SIGINT) must not abort the stop half-way and
    # leave engines running; the stop is bounded anyway (--grace seconds, then SIGKILL)
    _hold_signals()
    raise StopSignal(signum)


def _hold_signals() -> None:
    for s in _STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


@contextlib.contextmanager
def stopping_on_signals():
    """While inside, SIGINT, SIGTERM and SIGHUP raise :class:`StopSignal` (a KeyboardInterrupt) once (then are ignored, so a stop under way
    is never cut short); the previous handlers are restored on exit. SIGINT too: a process started with SIGINT
    ignored (a background job of a non-interactive shell) gets no KeyboardInterrupt from Python, and its children
    would inherit the ignored SIGINT. Installs nothing outside the main thread (Python allows handlers only there)."""
    import threading

    main = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, _raise_interrupt) for s in _STOP_SIGNALS} if main else {}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stop(running, grace: float) -> None:
    """Stop the deployment with the stop signals held off (see :func:`_raise_interrupt`)."""
    if running is not None:
        _hold_signals()
        running.stop(grace)


def launch_cmd(
    deployment: Path = typer.Argument(..., help="deployment YAML (see examples/*.yaml)"),
    follow_logs: bool = typer.Option(False, "--follow-logs", "-f", help="stream every log, prefixed [name]"),
    log_dir: Optional[Path] = typer.Option(None, "--log-dir", help="log folder (default: a new temp folder)"),
    check: bool = typer.Option(False, "--check", help="validate the file and check this machine can start it "
                                                      "(model paths, cores, interpreters; not ports); start nothing"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the command lines without starting anything"),
    grace: float = typer.Option(10.0, "--grace", min=0, max=3600,
                                help="seconds between SIGINT and SIGKILL when stopping"),
    emit: Optional[Tuple[str, str]] = typer.Option(None, "--emit", metavar="FORMAT DIR",
                                                   help="write manifests instead of starting: 'k8s DIR' (Kubernetes)"),
) -> None:
    """Start engines and the router of a deployment file, wait until all are ready, print where to send
    requests, restart a process that dies (with back-off, see `restart:` in the file), and stop every process on
    Ctrl-C or when the router or every engine is given up."""
    import tempfile

    from rich.console import Console

    from dlmix.launch.config import ConfigError, Deployment
    from dlmix.launch.runner import LaunchError, plan, start

    console = Console(soft_wrap=True)  # a log path or command line must stay one line when output is not a terminal
    if sum(map(bool, (check, dry_run, emit))) > 1:
        console.print("[red]--check, --dry-run and --emit are alternatives: give one[/]", highlight=False)
        raise typer.Exit(2)
    for flag, folder in (("--log-dir", log_dir), ("--emit", emit[1] if emit else None)):
        problem = folder_problem(folder) if folder is not None else None
        if problem:  # before anything starts or is written
            console.print(f"[red]{flag} {folder}: {problem}[/]", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
    try:
        dep = Deployment.from_file(deployment)
    except ConfigError as e:
        console.print(f"[red]error in deployment file[/]\n{e}", highlight=False)
        raise typer.Exit(2)
    if check:
        from dlmix.launch.preflight import local_problems

        problems = local_problems(dep)
        if problems:
            console.print(f"[red]{deployment}: valid, but it cannot start on this machine[/]\n  "
                          + "\n  ".join(problems), highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        console.print(f"{deployment}: ok ({len(dep.instances)} instance(s), router: "
                      f"{'yes' if dep.router_enabled() else 'no'})", highlight=False, soft_wrap=True)
        return
    if emit:
        if emit[0] != "k8s":
            console.print(f"[red]unknown --emit format {emit[0]!r}[/]; supported: k8s", highlight=False)
            raise typer.Exit(2)
        from dlmix.launch.k8s import emit_k8s

        try:
            m = emit_k8s(dep, Path(emit[1]))
        except ConfigError as e:
            console.print(f"[red]cannot emit Kubernetes manifests[/]\n{e}", highlight=False)
            raise typer.Exit(2)
        for f in m.files:
            console.print(f"  {Path(emit[1]) / f}", highlight=False)
        for n in m.notes:
            console.print(f"[yellow]note:[/] {n}", highlight=False)
        console.print(f"wrote {len(m.files)} object(s); deploy with: kubectl apply -f {emit[1]}", highlight=False)
        return
    if dry_run:
        # without --log-dir the paths shown (router config, KV-event sockets) are in a temporary folder, removed after
        with (tempfile.TemporaryDirectory(prefix="dlmix-dry-run-") if log_dir is None
              else contextlib.nullcontext(str(log_dir))) as ldir:
            from dlmix.models import MODELS, prepared

            # a dlmix model name becomes the folder launch builds for it: shown when it is built already
            models, unbuilt = {}, set()
            for i in range(len(dep.instances)):
                name = dep.model_of(i) or ""
                folder = prepared(name) if name in MODELS else None
                if name in MODELS and folder is None:
                    unbuilt.add(name)
                models[i] = str(folder) if folder is not None else name
            for pl in plan(dep, "<generated-secret>", Path(ldir), models=models):
                env = " ".join(f"{k}={shlex.quote(v)}" for k, v in pl.env.items() if k not in
                               ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"))
                console.print(f"[bold]{pl.name}[/] ({pl.url}):\n  {env + ' ' if env else ''}"
                              f"{' '.join(shlex.quote(a) for a in pl.argv)}", highlight=False, soft_wrap=True)
        from dlmix.launch.preflight import local_problems

        for name in sorted(unbuilt):
            console.print(f"[yellow]note:[/] model {name!r} is not built yet: a launch builds it and passes its folder "
                          f"(`dlmix models prepare {name}` prints it)", highlight=False, soft_wrap=True)
        for p in local_problems(dep):
            console.print(f"[yellow]note:[/] {p}", highlight=False, soft_wrap=True)
        return
    with stopping_on_signals():  # Ctrl-C, SIGTERM and SIGHUP stop every process, once
        running = None
        try:
            running = start(dep, log_dir=log_dir, console=console, follow_logs=follow_logs, grace_s=grace)
            model = running.instances[0].served_model_name
            console.print(f"\n[bold green]ready[/]: send OpenAI requests to [bold]{running.url}[/]  "
                          f"(model {model!r})")
            if running.router_url:
                console.print(f"  router admin: {running.router_url}/admin/instances (Bearer key in "
                              f"{running.log_dir / 'router.yaml'}), metrics: {running.router_url}/metrics")
            for inst in running.instances:
                console.print(f"  {inst.name}: {inst.role} {inst.engine} {inst.url}  log {inst.log_path}")
            # a router with client keys answers 401 without one: the example request carries the header then
            keyed = bool(running.router_url and dep.router is not None and dep.router.config.get("api_keys"))
            auth = " -H 'Authorization: Bearer KEY'" if keyed else ""
            console.print(f"  try: curl -s {running.url}/v1/completions -H 'Content-Type: application/json'{auth} "
                          f"-d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'"
                          + ("  (KEY: one of router.config.api_keys)" if keyed else ""),
                          highlight=False, soft_wrap=True)
            console.print("Ctrl-C stops everything.")
            running.wait()
        except KeyboardInterrupt as e:
            console.print("\n[yellow]stopping every process...[/]")
            _stop(running, grace)
            console.print("stopped.")
            raise typer.Exit(128 + getattr(e, "signum", signal.SIGINT))
        except LaunchError as e:
            _stop(running, grace)
            tail = ("" if getattr(e, "nothing_started", False)
                    else "\nEvery process that was started has been stopped.")
            console.print(f"[red]launch failed:[/] {e}{tail}", highlight=False, soft_wrap=True)
            raise typer.Exit(1)
        except Exception as e:  # model preparation and other failures
            _stop(running, grace)
            console.print(f"[red]launch failed:[/] {type(e).__name__}: {e}", highlight=False)
            raise typer.Exit(1)

