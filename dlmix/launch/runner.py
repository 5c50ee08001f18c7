"""Start, watch and stop a whole local deployment (engines + router) described by a :class:`Deployment`.

Every child runs in its own process group (``start_new_session``) with its log in ``LOG_DIR/NAME.log``; stopping
sends SIGINT to every group at once, waits up to ``grace_s`` seconds, then SIGKILLs the groups, so engine
sub-processes (vLLM's EngineCore and workers) never outlive the launcher -- also when a group leader has already
exited and left children behind.

Once everything is ready, a :class:`~dlmix.launch.supervisor.Supervisor` watches the processes: one that dies is
reported and restarted with exponential back-off (``restart:`` in the deployment file), the others keep serving.

Python API (used by ``dlmix demo``)::

    from dlmix.launch import Deployment, launch
    dep = Deployment.from_file("examples/cpu-pd.yaml")
    with launch(dep) as running:           # returns when everything is ready; stops everything on exit
        print(running.url)                 # where clients send requests (router, else the first engine)
        for inst in running.instances:     # RunningInstance: name, role, url, served_model_name, log_path, pid
            ...

Errors (all subclasses of :class:`LaunchError`; every started process is stopped before they propagate):
:class:`PortInUseError` (a port of the file is taken; nothing is started), :class:`ProcessFailedError` (a process
exited or did not become ready in time; the message carries its log tail).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import httpx

from dlmix.engine_process import (EngineProcess, EngineStartError, LMDeployServerSpec, SGLangServerSpec,
                                  VLLMServerSpec, free_port_block, port_free as _port_free)
from dlmix.launch.config import DEVICE_VISIBILITY_ENV, Deployment, Instance, merged_settings, sglang_bootstrap_port
from dlmix.launch.supervisor import Supervised, Supervisor, SupervisorEvent, console_printer, group_members
from dlmix.net import url_host
from dlmix.pd.registration import registration_body

__all__ = ["LaunchError", "PortInUseError", "ProcessFailedError", "RunningInstance", "RunningDeployment", "launch",
           "start", "plan"]

CPU_DEFAULT_KV_BYTES = 128 * 1024 * 1024
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class LaunchError(RuntimeError):
    """The deployment could not be started; every process it had started is stopped."""


class PortInUseError(LaunchError):
    """A port named in the deployment file is already taken (nothing was started)."""

    nothing_started = True


class NotStartableHereError(LaunchError):
    """The deployment names what this machine lacks (a model folder, CPU cores, an interpreter; see
    :func:`dlmix.launch.preflight.local_problems`); nothing was started."""

    nothing_started = True


class ProcessFailedError(LaunchError):
    """A process exited, or did not become ready in time; the message carries the tail of its log."""


@dataclass
class _Spec:
    """Duck-typed spec for :class:`EngineProcess`: a command line, its environment and the port it serves."""

    cmd: List[str]
    host: str
    port: int
    env: Dict[str, str] = field(default_factory=dict)

    def argv(self) -> List[str]:
        return list(self.cmd)

    def child_env(self) -> Dict[str, str]:
        e = dict(os.environ)
        if "--kv-cache-memory-bytes" in self.cmd:
            e.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the flag (vllm/platforms/cpu.py reads it)
        e.setdefault("PYTHONUNBUFFERED", "1")
        e.update(self.env)
        return e

    @property
    def url(self) -> str:
        """``http://host:port`` as this machine reaches it (:func:`dlmix.net.url_host`)."""
        return f"http://{url_host(self.host)}:{self.port}"


@dataclass
class ProcessPlan:
    """What launch will start for one process: name, kind (``router``/``engine``), command line, environment
    additions, URL, and for engines the instance index and whether it self-registers with the router."""

    name: str
    kind: str
    argv: List[str]
    env: Dict[str, str]
    host: str
    port: int
    index: int = -1
    self_registers: bool = False
    ready_timeout_s: float = 600.0
    #: readiness path (SGLang: ``/ready``; its ``/health`` generates a token first)
    health_path: str = "/health"

    @property
    def url(self) -> str:
        """``http://host:port`` as this machine reaches it (:func:`dlmix.net.url_host`)."""
        return f"http://{url_host(self.host)}:{self.port}"


@dataclass
class RunningInstance:
    """A started engine instance.

    Attributes: name, role, engine, url (OpenAI API root), model (resolved path or id), served_model_name,
    log_path, process (:class:`EngineProcess`), config (:class:`Instance`).
    """

    name: str
    role: str
    engine: str
    url: str
    model: str
    served_model_name: str
    log_path: Path
    process: EngineProcess
    config: Instance

    @property
    def pid(self) -> Optional[int]:
        """Process id (= process group id) of the instance's top process."""
        return self.process.proc.pid if self.process.proc else None


def _resolve_model(ref: Optional[str]) -> str:
    """dlmix model name -> prepared local folder; anything else unchanged (path or hub id)."""
    if not ref:
        return ""
    from dlmix import models

    if ref in models.MODELS:
        return str(models.prepare(ref))
    p = Path(ref).expanduser()
    return str(p) if p.exists() else ref


def _engine_env(dep: Deployment, inst: Instance) -> Dict[str, str]:
    """An engine's environment additions: its accelerator visibility variable, then the deployment's and its own
    ``env``."""
    env: Dict[str, str] = {}
    if inst.device != "cpu" and inst.devices:
        env[DEVICE_VISIBILITY_ENV[inst.device]] = inst.devices
    env.update(dep.env)
    env.update(inst.env)
    return env


def _vllm_spec(dep: Deployment, i: int, model: str, kv_transfer: Optional[dict], kv_events: Optional[str]
               ) -> VLLMServerSpec:
    """The :class:`VLLMServerSpec` of instance ``i``: its command line and environment additions."""
    inst = dep.instances[i]
    kv = inst.kv
    extra: List[str] = []
    if kv_transfer:
        extra += ["--kv-transfer-config", json.dumps(kv_transfer, separators=(",", ":"))]
    if dep.router_enabled():
        algo = str(dep.router.config.get("hash_algo", "sha256_cbor"))  # type: ignore[union-attr]
        if "--prefix-caching-hash-algo" not in inst.extra_args:
            extra += ["--prefix-caching-hash-algo", algo]
    if kv_events:
        extra += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                    "endpoint": kv_events})]
    cpu = inst.device == "cpu"
    env = _engine_env(dep, inst)
    if cpu:  # dlmix_vllm.cpu_aids: 16-bit prefill products in fp32 where the CPU has no native kernel, no spin waits
        env = {VLLMServerSpec.CPU_AIDS_ENV: "1", **env}
    return VLLMServerSpec(
        model=model, port=inst.port, host=inst.host, python=inst.python,
        served_model_name=dep.served_name_of(i), max_model_len=inst.max_model_len, seed=0,
        enforce_eager=inst.enforce_eager if inst.enforce_eager is not None else cpu,
        block_size=kv.block_size, dtype=kv.dtype, kv_cache_dtype=kv.cache_dtype,
        kv_cache_bytes=kv.cache_bytes or (CPU_DEFAULT_KV_BYTES if cpu else None),
        gpu_memory_utilization=kv.gpu_memory_utilization, tensor_parallel_size=inst.tensor_parallel_size,
        extra_args=extra + list(inst.extra_args),
        taskset_cpus=inst.cpus if not cpu else None, cpu_bind=inst.cpus if cpu and inst.cpus else None,
        hub_offline=bool(model) and Path(model).is_dir(),  # local folder: never reach for the hub
        env=env)


def _with_own_settings(launch: dict, env: Dict[str, str], var: str) -> Optional[dict]:
    """The backend settings launch writes into ``var`` (``launch``: its secret, bind host, router keys) with the keys
    of the instance's own ``var`` in ``env`` merged over them (:func:`dlmix.launch.config.merged_settings`). The
    instance's value is taken out of ``env``; when it is not a JSON object it is put back and None returned, so the
    engine's loader refuses it with the reason (the file check, :meth:`dlmix.launch.config.Deployment.from_yaml`,
    refuses it first)."""
    own = env.pop(var, None)
    merged = merged_settings(launch, own)
    if merged is None:
        env[var] = own
    return merged


def _sglang_spec(dep: Deployment, i: int, model: str, secret: str, kv_events: Optional[str], taken: set
                 ) -> SGLangServerSpec:
    """The :class:`SGLangServerSpec` of instance ``i``: prefill/decode roles use the ``dlmix`` transfer backend
    (authenticated with the launch's secret, which is also the launched router's admin key, ``router_admin_key``,
    plus the keys of the instance's own ``DLMIX_SGLANG_CONFIG`` in ``env``, e.g. ``pull_threads``; a prefill gets a
    free bootstrap port unless ``extra_args`` name one), KV pool ``--max-total-tokens 8192
    --mem-fraction-static 0.8`` on CPU unless ``extra_args`` set them (the pool is the 8,192 tokens; SGLang refuses to
    start when the free memory dropped by more than the fraction while it loaded its weights, which servers starting
    beside it can cause under a low fraction)."""
    inst = dep.instances[i]
    kv = inst.kv
    cpu = inst.device == "cpu"
    mode = inst.role if inst.role in ("prefill", "decode") else None
    args = list(inst.extra_args)
    bp = None
    if mode == "prefill":
        bp = sglang_bootstrap_port(args)  # checked with the file (a ConfigError names a bad one)
        if bp is not None:
            k = args.index("--disaggregation-bootstrap-port")
            del args[k:k + 2]
        else:
            bp = _free_block(1, taken)
    env = _engine_env(dep, inst)
    backend = None
    if mode:
        # the launch's secret, bind host and router admin key, then the instance's own DLMIX_SGLANG_CONFIG
        backend = _with_own_settings({"shared_secret": secret, "host": inst.host,
                                      **({"router_admin_key": secret} if dep.router_enabled() else {})},
                                     env, "DLMIX_SGLANG_CONFIG")
    return SGLangServerSpec(
        model=model, port=inst.port, host=inst.host, python=inst.python, served_model_name=dep.served_name_of(i),
        dtype=kv.dtype, page_size=kv.block_size, kv_cache_dtype=kv.cache_dtype,
        tensor_parallel_size=inst.tensor_parallel_size, context_length=inst.max_model_len,
        max_total_tokens=8192 if cpu and "--max-total-tokens" not in args else None,
        mem_fraction_static=(kv.gpu_memory_utilization if kv.gpu_memory_utilization is not None
                             else 0.8 if cpu and "--mem-fraction-static" not in args else None),
        device=inst.device, disaggregation_mode=mode, bootstrap_port=bp,
        # the launched router's admin key too: its POST /dlmix/handoff (rooms of another engine's prefill for a
        # decode) needs it, and a prefill's own hand-off route then answers only the router
        backend_config=backend,
        kv_events=kv_events, taskset_cpus=inst.cpus, extra_args=args, env=env,
        hub_offline=bool(model) and Path(model).is_dir())


def _lmdeploy_spec(dep: Deployment, i: int, model: str, secret: str, router_url: Optional[str] = None,
                   kv_events: Optional[str] = None) -> LMDeployServerSpec:
    """The :class:`LMDeployServerSpec` of instance ``i``: prefill/decode roles use the ``DLMix`` migration backend
    (authenticated with the launch's secret, plus the keys of the instance's own ``DLMIX_LMDEPLOY_CONFIG`` in
    ``env``, e.g. ``transport``); on CPU a pool of 256 blocks (``--num-gpu-blocks``) unless
    ``extra_args`` set one. With ``router_url`` the engine registers itself with the launched router through its
    admin API (``router_url``, ``router_admin_key`` = the launch's secret, ``public_url``, ``instance_id`` = the
    instance's name, ``model_name``, ``chip_profile``) and heartbeats its own load
    (:mod:`dlmix_lmdeploy.router_hook`), any role; ``kv_events``: the ``kv_events_endpoint`` it publishes its prefix
    cache on (with ``--enable-prefix-caching``). Not LMDeploy's
    ``--proxy-url``: the launched router has an admin key, which LMDeploy's own registration cannot send."""
    inst = dep.instances[i]
    kv = inst.kv
    cpu = inst.device == "cpu"
    args = list(inst.extra_args)
    env = _engine_env(dep, inst)
    backend = None
    routed = {}
    if router_url:
        routed = {"router_url": router_url, "router_admin_key": secret, "public_url": inst.url,
                  "instance_id": dep.instance_name(i), "model_name": dep.served_name_of(i), "chip_profile": inst.chip}
        if kv_events:
            routed["kv_events_endpoint"] = kv_events
    if inst.role != "both" or routed:
        # the launch's secret and bind host (PD roles), the router keys, then the instance's own DLMIX_LMDEPLOY_CONFIG
        backend = {"shared_secret": secret, "host": inst.host} if inst.role != "both" else {}
        backend.update(routed)
        backend = _with_own_settings(backend, env, "DLMIX_LMDEPLOY_CONFIG")
    return LMDeployServerSpec(
        model=model, port=inst.port, host=inst.host, python=inst.python, served_model_name=dep.served_name_of(i),
        dtype=kv.dtype, block_size=kv.block_size,
        num_blocks=256 if cpu and "--num-gpu-blocks" not in args else None, session_len=inst.max_model_len,
        tensor_parallel_size=inst.tensor_parallel_size, role=inst.role,
        backend_config=backend, device=inst.device, taskset_cpus=inst.cpus, extra_args=args, env=env,
        hub_offline=bool(model) and Path(model).is_dir())


def _router_argv(config_path: Path) -> List[str]:
    """``python -m dlmix.cli router --config FILE``: the router runs as the CLI sub-command in a child process (the
    launcher never imports the CLI, which imports the launcher)."""
    return [sys.executable, "-m", "dlmix.cli", "router", "--config", str(config_path)]


def _free_block(n: int, taken: set) -> int:
    p = free_port_block(n, "127.0.0.1", taken)
    taken.update(range(p, p + n))
    return p


def plan(dep: Deployment, secret: str, log_dir: Path, models: Optional[Dict[int, str]] = None) -> List[ProcessPlan]:
    """The processes a launch starts (router first, then the engines), with their command lines.

    ``models`` maps instance index -> resolved model (default: :func:`_resolve_model` of each reference, which
    builds dlmix models). Writes the router config to ``log_dir/router.yaml`` (mode 0600: it holds the secret).
    Pure otherwise: starts nothing.
    """
    import yaml

    plans: List[ProcessPlan] = []
    taken: set = {i.port for i in dep.instances}
    if dep.router_enabled():
        taken.add(dep.router.port)  # type: ignore[union-attr]
    models = models if models is not None else {i: _resolve_model(dep.model_of(i)) for i in range(len(dep.instances))}
    static: List[dict] = []
    router_url = dep.router.url if dep.router_enabled() else None  # type: ignore[union-attr]
    for i, inst in enumerate(dep.instances):
        name = dep.instance_name(i)
        conn = dep.connector_of(i)
        kv_transfer = None
        self_reg = False
        if conn is not None:
            role = conn.kv_role or {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[inst.role]
            kv_transfer = {"kv_connector": conn.name, "kv_role": role, "engine_id": name}
            if conn.module_path:
                kv_transfer["kv_connector_module_path"] = conn.module_path
            extra = dict(conn.extra_config)
            if conn.name == "DLMixConnector":
                base = {"shared_secret": secret, "chip_profile": inst.chip, "public_url": inst.url,
                        "model_name": dep.served_name_of(i), "host": inst.host}
                if "port" not in extra:
                    base["port"] = _free_block(inst.tensor_parallel_size, taken)
                if router_url:
                    base.update(router_url=router_url, router_admin_key=secret)
                    self_reg = True
                extra = {**base, **extra}
            if extra:
                kv_transfer["kv_connector_extra_config"] = extra
        # KV events over a local IPC socket: vLLM 0.32's ZMQ publisher binds only wildcard, ipc:// and inproc://
        # endpoints and *connects* to a concrete tcp://host:port, where the router's subscriber connects too.
        ev = (f"ipc://{Path(log_dir).resolve()}/{name}-kv-events.ipc"
              if dep.router_enabled() and dep.router.kv_events and inst.engine == "vllm"  # type: ignore[union-attr]
              else None)
        bootstrap = None
        if inst.engine == "sglang":
            # SGLang binds a concrete tcp://host:port when told to ("bind": true)
            if dep.router_enabled() and dep.router.kv_events:  # type: ignore[union-attr]
                ev = f"tcp://{inst.host}:{_free_block(1, taken)}"
            sspec = _sglang_spec(dep, i, models[i], secret, ev, taken)
            bootstrap = sspec.bootstrap_port
            argv, env = sspec.argv(), sspec.env_additions()
            plans.append(ProcessPlan(name=name, kind="engine", argv=argv, env=env, host=inst.host,
                                     port=inst.port, index=i, ready_timeout_s=inst.ready_timeout_s,
                                     health_path="/ready"))
            if router_url:
                static.append(registration_body(
                    url=inst.url, instance_id=name, role=inst.role, engine="sglang", model=dep.served_name_of(i),
                    chip=inst.chip, heartbeat_ttl_s=0, block_size=inst.kv.block_size or 16, kv_events=ev,
                    bootstrap_port=bootstrap))
            continue
        if inst.engine == "lmdeploy":
            # KV events need LMDeploy's prefix cache; the engine binds a concrete tcp://host:port for them
            if router_url and dep.router.kv_events and "--enable-prefix-caching" in inst.extra_args:  # type: ignore
                ev = f"tcp://{inst.host}:{_free_block(1, taken)}"
            lspec = _lmdeploy_spec(dep, i, models[i], secret, router_url, ev)
            plans.append(ProcessPlan(name=name, kind="engine", argv=lspec.argv(), env=lspec.env_additions(),
                                     host=inst.host, port=inst.port, index=i, ready_timeout_s=inst.ready_timeout_s,
                                     health_path="/health", self_registers=bool(router_url)))
            continue
        vspec = _vllm_spec(dep, i, models[i], kv_transfer, ev)
        env = vspec.env_additions()  # mock engines get the same environment
        if inst.engine == "vllm":
            argv = vspec.argv()
        else:  # mock test engine
            argv = [inst.python or sys.executable, "-m", "dlmix.testing.mock_engine", "--host", inst.host,
                    "--port", str(inst.port), "--model", dep.served_name_of(i),
                    "--block-size", str(inst.kv.block_size or 16)] + list(inst.extra_args)
        plans.append(ProcessPlan(name=name, kind="engine", argv=argv, env=env, host=inst.host,
                                 port=inst.port, index=i, self_registers=self_reg,
                                 ready_timeout_s=inst.ready_timeout_s))
        if router_url and not self_reg:
            static.append(registration_body(
                url=inst.url, instance_id=name, role=inst.role, engine="vllm", model=dep.served_name_of(i),
                chip=inst.chip, heartbeat_ttl_s=0,
                block_size=inst.kv.block_size or (128 if inst.device == "cpu" else 16), kv_events=ev or None))
    if dep.router_enabled():
        r = dep.router
        cfg: dict = {"host": r.host, "port": r.port, "policy": r.policy,  # type: ignore[union-attr]
                     "policy_params": dict(r.policy_params), "admin_key": secret,  # type: ignore[union-attr]
                     "instances": static}
        spec = r.model_spec  # type: ignore[union-attr]
        if spec is None:
            first = models.get(0, "")
            if first and (Path(first) / "config.json").exists():
                spec = first
        if spec is not None:
            cfg["model_spec"] = spec
        if r.tokenizer:  # type: ignore[union-attr]
            cfg["tokenizer"] = models.get(0) if r.tokenizer == "model" else r.tokenizer  # type: ignore[union-attr]
        if r.chips:  # type: ignore[union-attr]
            cfg["chips"] = [str(Path(c).expanduser().resolve()) for c in r.chips]  # type: ignore[union-attr]
        cfg.update(r.config)  # type: ignore[union-attr]
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / "router.yaml"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        plans.insert(0, ProcessPlan(name="router", kind="router", argv=_router_argv(path), env=dict(dep.env),
                                    host=r.host, port=r.port,  # type: ignore[union-attr]
                                    ready_timeout_s=r.ready_timeout_s))  # type: ignore[union-attr]
    return plans


class RunningDeployment:
    """A started deployment: its processes, URLs and log folder. Stop with :meth:`stop` (idempotent).

    Attributes:
        deployment: the :class:`Deployment`.
        url: where clients send requests (router, else the first instance).
        router_url: router root or None.
        instances: list of :class:`RunningInstance` in file order.
        log_dir: folder of the per-process logs.
        secret: the shared secret of this launch (router admin key, connector HMAC key).
    """

    def __init__(self, deployment: Deployment, log_dir: Path, secret: str):
        self.deployment = deployment
        self.log_dir = log_dir
        self.secret = secret
        self.router_url: Optional[str] = deployment.router.url if deployment.router_enabled() else None  # type: ignore
        self.url = deployment.entry_url()
        self.instances: List[RunningInstance] = []
        self.router: Optional[EngineProcess] = None
        self.processes: List[EngineProcess] = []
        self._stopped = False
        self._follower: Optional["LogFollower"] = None
        self.supervisor: Optional[Supervisor] = None
        self._lock = threading.Lock()

    @property
    def events(self) -> List[SupervisorEvent]:
        """What the supervisor saw and did (exits, restarts, give-ups), oldest first; empty without one."""
        return list(self.supervisor.events) if self.supervisor else []

    def pgids(self) -> List[int]:
        """Process group ids of every started process (equal to their pids)."""
        return [p.proc.pid for p in self.processes if p.proc is not None]

    def failed(self) -> Optional[EngineProcess]:
        """The first process that has exited, or None while all run."""
        for p in self.processes:
            if p.proc is not None and p.proc.poll() is not None:
                return p
        return None

    def wait(self, poll_s: float = 0.5) -> None:
        """Block until the deployment fails (raises :class:`ProcessFailedError`) or KeyboardInterrupt.

        Supervised (the default): fails when the router or every engine was given up after its restarts.
        Unsupervised (``start(..., supervise=False)``): fails as soon as any process exits.
        """
        if self.supervisor is not None:
            while True:
                reason = self.supervisor.wait_fatal(poll_s)
                if reason is not None:
                    raise ProcessFailedError(f"deployment failed: {reason}")
        while True:
            p = self.failed()
            if p is not None:
                raise ProcessFailedError(f"{p.name} exited with code {p.proc.returncode}; last log lines "
                                         f"({p.log_path}):\n{p.log_tail(30)}")
            time.sleep(poll_s)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every process: SIGINT to all groups, up to ``grace_s`` seconds, then SIGKILL to all groups."""
        if self._stopped:
            return
        self._stopped = True
        if self.supervisor is not None:
            self.supervisor.stop()  # no restart after this point
        with self._lock:
            stop_groups(self.processes, grace_s)
        if self._follower:
            self._follower.stop()


def stop_groups(procs: List[EngineProcess], grace_s: float = 10.0) -> None:
    """SIGINT every process group, wait up to ``grace_s`` s for the leaders, SIGKILL every group, reap."""
    started = [p for p in procs if p.proc is not None]
    for p in started:
        if p.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.proc.pid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for p in started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(max(0.0, deadline - time.monotonic()))
    for p in started:  # the group may outlive its leader: kill it by id in any case
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.proc.pid, signal.SIGKILL)
    for p in started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(5)
    # SIGKILL is asynchronous: wait (bounded) until no live member of any group is left
    pgids = {p.proc.pid for p in started}
    deadline = time.monotonic() + 10.0
    while pgids and time.monotonic() < deadline:
        left = group_members(pgids)
        if not left:
            break
        for pg in {pg for _, pg in left}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pg, signal.SIGKILL)
        time.sleep(0.05)


class LogFollower:
    """Streams every process log to ``write`` as ``[name] line`` from a background thread."""

    def __init__(self, procs: List[EngineProcess], write: Callable[[str, str], None], poll_s: float = 0.2):
        self.procs, self.write, self.poll_s = procs, write, poll_s
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="dlmix-log-follower")

    def start(self) -> "LogFollower":
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join(2)

    def _run(self) -> None:
        pos: Dict[str, int] = {}
        buf: Dict[str, str] = {}
        while True:
            last = self._stop.is_set()
            for p in list(self.procs):
                try:
                    with open(p.log_path, "rb") as f:
                        f.seek(pos.get(p.name, 0))
                        data = f.read()
                        pos[p.name] = f.tell()
                except OSError:
                    continue
                if not data:
                    continue
                text = buf.get(p.name, "") + data.decode(errors="replace")
                lines = text.split("\n")
                buf[p.name] = lines.pop()
                for ln in lines:
                    self.write(p.name, ln.rstrip("\r"))
            if last:
                return
            self._stop.wait(self.poll_s)


class _Progress:
    """Rich live table of process states (or nothing when ``console`` is None)."""

    def __init__(self, console, names: List[str]):
        self.console = console
        self.state = {n: "waiting" for n in names}
        self.t0 = time.monotonic()
        self.live = None
        if console is not None:
            from rich.live import Live

            self.live = Live(self._table(), console=console, refresh_per_second=4, transient=False)

    def _table(self):
        from rich.table import Table

        t = Table(title=f"dlmix launch ({time.monotonic() - self.t0:.0f} s)")
        t.add_column("process")
        t.add_column("state")
        for n, s in self.state.items():
            style = "green" if s.startswith("ready") or s.startswith("registered") else (
                "red" if s.startswith("FAILED") else "yellow")
            t.add_row(n, f"[{style}]{s}[/]")
        return t

    def set(self, name: str, s: str) -> None:
        self.state[name] = s
        if self.live is not None:
            self.live.update(self._table())

    def __enter__(self):
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.update(self._table())
            self.live.__exit__(*exc)
            if not self.console.is_terminal:
                self.console.print()


def start(dep: Deployment | str | os.PathLike, *, log_dir: Optional[str | os.PathLike] = None, console=None,
          follow_logs: bool = False, log_writer: Optional[Callable[[str, str], None]] = None, grace_s: float = 10.0,
          poll_s: float = 0.5, supervise: bool = True,
          on_event: Optional[Callable[[SupervisorEvent], None]] = None) -> RunningDeployment:
    """Start ``dep`` and wait until every process is ready (and registered with the router).

    Args:
        dep: the deployment, or the path of a deployment file.
        log_dir: folder for logs and the generated router config (default: a new temp folder).
        console: ``rich.console.Console`` for the progress display (None = no display).
        follow_logs: stream every log, prefixed ``[name]``, to ``log_writer`` (default: print to ``console``).
        grace_s: seconds between SIGINT and SIGKILL when stopping.
        poll_s: seconds between readiness polls (and supervisor polls).
        supervise: restart processes that die after start-up, per the file's ``restart`` policies
            (:mod:`dlmix.launch.supervisor`); False: :meth:`RunningDeployment.wait` fails at the first exit.
        on_event: called with each :class:`~dlmix.launch.supervisor.SupervisorEvent` (from the supervisor thread);
            default: printed on ``console`` when one is given.

    Returns:
        :class:`RunningDeployment` (call :meth:`RunningDeployment.stop` when done; :func:`launch` does).

    Raises:
        NotStartableHereError: a model path, a core of ``cpus`` or an instance's ``python`` is missing on this
            machine (checked before anything starts).
        PortInUseError: a configured port is taken (checked before anything starts).
        ProcessFailedError: a process exited or was not ready in time (everything started is stopped first).
        dlmix.models.ModelError: a dlmix model could not be built.
    """
    if isinstance(dep, (str, os.PathLike)):
        dep = Deployment.from_file(dep)
    from dlmix.launch.preflight import local_problems

    problems = local_problems(dep)
    if problems:
        raise NotStartableHereError(f"{dep.source or 'the deployment'} cannot start on this machine:\n  "
                                    + "\n  ".join(problems) + "\nNothing was started.")
    ldir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"dlmix-launch-{dep.name}-"))
    ldir.mkdir(parents=True, exist_ok=True)
    secret = dep.secret if dep.secret and dep.secret != "auto" else secrets.token_hex(32)
    origin = dep.source or "the deployment"
    # 1. ports: fail before starting anything
    checks = [(f"instances[{i}].port", inst.host, inst.port) for i, inst in enumerate(dep.instances)]
    if dep.router_enabled():
        checks.insert(0, ("router.port", dep.router.host, dep.router.port))  # type: ignore[union-attr]
    for fieldname, host, port in checks:
        if not _port_free(host, port):
            raise PortInUseError(f"port {port} on {host} ({fieldname} in {origin}) is already in use; stop the "
                                 f"process that holds it or choose another port. Nothing was started.")
    plans = plan(dep, secret, ldir)
    running = RunningDeployment(dep, ldir, secret)
    if follow_logs:
        write = log_writer or _console_writer(console)
        running._follower = LogFollower(running.processes, write).start()
    names = [p.name for p in plans]
    try:
        with _Progress(console, names) as prog:
            client = httpx.Client(timeout=2.0)
            try:
                router_plan = plans[0] if plans and plans[0].kind == "router" else None
                if router_plan:
                    rp = _spawn(router_plan, ldir, running)
                    running.router = rp
                    prog.set("router", "starting")
                    _wait_health([(router_plan, rp)], client, prog, poll_s)
                engines = [(pl, _spawn(pl, ldir, running)) for pl in plans if pl.kind == "engine"]
                for pl, proc in engines:
                    inst = dep.instances[pl.index]
                    running.instances.append(RunningInstance(
                        name=pl.name, role=inst.role, engine=inst.engine, url=inst.url,
                        model=pl.argv[pl.argv.index("--model") + 1] if "--model" in pl.argv else "",
                        served_model_name=dep.served_name_of(pl.index), log_path=proc.log_path, process=proc,
                        config=inst))
                    prog.set(pl.name, "starting")
                _wait_health(engines, client, prog, poll_s, running)
                if router_plan:
                    _wait_registered(running, engines, client, prog, poll_s, router_plan.ready_timeout_s)
            finally:
                client.close()
        if supervise:
            # the very process each plan started (by plan, not by name: one process per item)
            started = ([(router_plan, running.router)] if router_plan else []) + list(engines)
            items = [Supervised(plan=pl, process=proc, policy=dep.restart_of(pl.index)) for pl, proc in started]
            if on_event is None and console is not None:
                on_event = console_printer(console)
            running.supervisor = Supervisor(items, on_event=on_event, poll_s=min(poll_s, 0.5),
                                            lock=running._lock).start()
    except BaseException:
        running.stop(grace_s)
        raise
    return running


def _console_writer(console) -> Callable[[str, str], None]:
    colors = ["cyan", "magenta", "green", "yellow", "blue", "red"]
    assigned: Dict[str, str] = {}

    def write(name: str, line: str) -> None:
        c = assigned.setdefault(name, colors[len(assigned) % len(colors)])
        if console is not None:
            from rich.markup import escape

            console.print(f"[{c}]\\[{escape(name)}][/] {escape(line)}", highlight=False, soft_wrap=True)
        else:
            print(f"[{name}] {line}", flush=True)

    return write


def _spawn(pl: ProcessPlan, ldir: Path, running: RunningDeployment) -> EngineProcess:
    spec = _Spec(cmd=pl.argv, host=pl.host, port=pl.port, env=pl.env)
    proc = EngineProcess(spec, name=pl.name, log_dir=ldir)  # type: ignore[arg-type]
    running.processes.append(proc)
    try:
        proc.start()
    except EngineStartError as e:  # port taken in the meantime
        raise PortInUseError(f"{pl.name}: {e}; every process started before it has been stopped") from None
    except OSError as e:  # the command cannot be executed (e.g. `python` is not an executable file)
        raise ProcessFailedError(f"{pl.kind} {pl.name!r} could not be started: {e}") from None
    return proc


def _wait_health(items, client: httpx.Client, prog: _Progress, poll_s: float,
                 running: Optional[RunningDeployment] = None) -> None:
    t0 = time.monotonic()
    pending = {pl.name: (pl, p) for pl, p in items}
    while pending:
        for name, (pl, p) in list(pending.items()):
            if not p.alive():
                prog.set(name, f"FAILED (exit {p.proc.returncode})")
                raise ProcessFailedError(
                    f"{pl.kind} {name!r} ({pl.url}) exited with code {p.proc.returncode} during start-up. "
                    f"Last log lines ({p.log_path}):\n{p.log_tail(30)}")
            try:
                code = client.get(pl.url + pl.health_path).status_code
                # the router answers 503 until an instance is healthy: listening is enough here, registration
                # is waited for separately
                ok = code == 200 or (pl.kind == "router" and code == 503)
            except httpx.HTTPError:
                ok = False
            if ok:
                prog.set(name, f"ready ({time.monotonic() - t0:.1f} s) {pl.url}")
                del pending[name]
            elif time.monotonic() - t0 > pl.ready_timeout_s:
                prog.set(name, "FAILED (timeout)")
                raise ProcessFailedError(
                    f"{pl.kind} {name!r} ({pl.url}) was not healthy after {pl.ready_timeout_s:.0f} s. "
                    f"Last log lines ({p.log_path}):\n{p.log_tail(30)}")
            else:
                prog.set(name, f"starting ({time.monotonic() - t0:.0f} s)")
        if pending:
            if running is not None and running.router is not None and not running.router.alive():
                raise ProcessFailedError(f"router exited with code {running.router.proc.returncode}. Last log "
                                         f"lines ({running.router.log_path}):\n{running.router.log_tail(30)}")
            time.sleep(poll_s)


def _wait_registered(running: RunningDeployment, engines, client: httpx.Client, prog: _Progress, poll_s: float,
                     timeout_s: float) -> None:
    """Wait until the router lists every instance (self-registered or static) as healthy."""
    want = {pl.url: pl.name for pl, _ in engines}
    headers = {"Authorization": f"Bearer {running.secret}"}
    t0 = time.monotonic()
    last = ""
    while True:
        for pl, p in [(None, running.router)] + list(engines):
            if p is not None and not p.alive():
                name = pl.name if pl else "router"
                raise ProcessFailedError(f"{name!r} exited with code {p.proc.returncode} while waiting for router "
                                         f"registration. Last log lines ({p.log_path}):\n{p.log_tail(30)}")
        try:
            r = client.get(running.router_url + "/admin/instances", headers=headers)
            if r.status_code == 200:
                have = {i["url"].rstrip("/"): i for i in r.json().get("instances", [])}
                missing = []
                for url, name in want.items():
                    i = have.get(url)
                    if i is not None and i.get("healthy", True):
                        prog.set(name, f"registered ({i.get('role')}, {i.get('chip')}) {url}")
                    else:
                        missing.append(name)
                if not missing:
                    return
                last = "not yet registered: " + ", ".join(missing)
            else:
                last = f"GET /admin/instances -> HTTP {r.status_code}: {r.text[:200]}"
        except (httpx.HTTPError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() - t0 > timeout_s:
            raise ProcessFailedError(f"instances did not register with the router within {timeout_s:.0f} s ({last})."
                                     f" Router log ({running.router.log_path}):\n{running.router.log_tail(20)}")
        time.sleep(poll_s)


@contextlib.contextmanager
def launch(dep: Deployment | str | os.PathLike, **kw) -> Iterator[RunningDeployment]:
    """Context manager around :func:`start`: yields the ready :class:`RunningDeployment`, stops it on exit
    (normal exit, exception or KeyboardInterrupt). Keyword arguments as for :func:`start`."""
    running = start(dep, **kw)
    try:
        yield running
    finally:
        running.stop(kw.get("grace_s", 10.0))
