"""Checks of a deployment against the machine it is about to start on: what the file's own validation
(:class:`~dlmix.launch.config.Deployment`) cannot know, because the same file may describe another machine
(``--emit k8s`` writes it for a cluster). ``dlmix launch FILE --check`` and ``dlmix launch FILE`` run them; the
Kubernetes emitter does not.

Checked per instance: a model given as a filesystem path (not for ``engine: mock``, which loads none) (absolute, ``~``, ``./`` or ``../``) exists; the cores of
``cpus`` are cores this process may run on (``os.sched_getaffinity``, the set ``taskset`` and
``VLLM_CPU_OMP_THREADS_BIND`` must stay within); the ``python`` interpreter named for the instance exists. A hub id
(``org/name``) or a dlmix model name is not checked here (it is resolved when the instance starts); a bare name close
to a dlmix model name (``smolm2``), neither a folder here nor ``org/name``, is reported as a likely typo.
"""
from __future__ import annotations

import difflib
import os
import shutil
from pathlib import Path
from typing import List

from dlmix.launch.config import Deployment
from dlmix.net import is_loopback, parse_cpus

__all__ = ["local_problems", "available_cpus"]

_PATH_PREFIXES = ("/", "~", "./", "../")
_MODEL_FOLDER_FILES = ("config.json", "params.json")  # what vLLM looks for in a model folder (params.json: Mistral)


def available_cpus() -> List[int]:
    """Core ids this process may run on, sorted (Linux: ``os.sched_getaffinity(0)``; elsewhere ``0 .. cpu_count-1``)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _core_list(cores: List[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, i = [], 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)


def local_problems(dep: Deployment) -> List[str]:
    """What would make ``dep`` fail to start on this machine, one readable line per problem (empty: none found).

    Each line names the instance (``instances[i] (name)``), the field and the value; nothing is started and no model
    is built. Raises nothing for a valid :class:`Deployment`."""
    from dlmix import models

    problems: List[str] = []
    cores = available_cpus()
    for i, inst in enumerate(dep.instances):
        where = f"instances[{i}] ({dep.instance_name(i)})"
        ref = dep.model_of(i)
        if inst.engine != "mock" and ref and ref not in models.MODELS and ref.startswith(_PATH_PREFIXES) \
                and not Path(ref).expanduser().exists():
            problems.append(f"{where}: model {ref!r} does not exist on this machine (a local folder, a dlmix model "
                            f"name ({', '.join(sorted(models.MODELS))}) or a hub id 'org/name' is expected)")
        elif inst.engine != "mock" and ref and ref not in models.MODELS and Path(ref).expanduser().is_dir() \
                and not any((Path(ref).expanduser() / f).is_file() for f in _MODEL_FOLDER_FILES):
            # the engines take an existing folder as the model and refuse it only after start-up, in a traceback
            problems.append(f"{where}: model folder {ref!r} holds no config.json (nor a Mistral params.json): not a "
                            "Hugging Face model folder, which the engine refuses after start-up (the folder that "
                            "holds config.json is expected)")
        elif inst.engine != "mock" and ref and ref not in models.MODELS and "/" not in ref \
                and not Path(ref).expanduser().exists() \
                and (near := difflib.get_close_matches(ref, list(models.MODELS), n=1)):
            near = near[0]
            problems.append(f"{where}: model {ref!r} is neither a dlmix model name nor a folder here; did you mean "
                            f"{near!r}? (dlmix models: {', '.join(sorted(models.MODELS))}; a hub id is 'org/name')")
        if inst.cpus:
            missing = sorted(set(parse_cpus(inst.cpus)) - set(cores))
            if missing:
                problems.append(f"{where}: cpus {inst.cpus!r} names core(s) {_core_list(missing)} that this machine "
                                f"does not offer to this process (available: {_core_list(cores)})")
        if inst.python and not (Path(inst.python).expanduser().exists() or shutil.which(inst.python)):
            rel = Path(inst.python).expanduser()
            hint = (f" (a relative path is taken from the directory dlmix launch runs in, {Path.cwd()}: run it "
                    f"where {inst.python} exists, e.g. the repository root, or give an absolute path)"
                    if not rel.is_absolute() and "/" in inst.python else "")
            problems.append(f"{where}: python {inst.python!r} does not exist on this machine{hint}")
    r = dep.router
    rc = None
    if dep.router_enabled() and r is not None:
        from dlmix.errors import ConfigError
        from dlmix.router.config import RouterConfig

        try:  # the settings the router reads from the router.yaml launch writes (router.config's keys win)
            rc = RouterConfig.from_dict({"host": r.host, **r.config})
        except ConfigError:  # refused by Deployment's own checks already
            rc = None
    if rc is not None and not is_loopback(rc.host) and not rc.api_keys and not rc.allow_open:
        # the router refuses this at start-up (dlmix.router.server); --emit k8s sets allow_open itself
        problems.append(f"router: host {rc.host!r} is not loopback and router.config sets no api_keys: the router "
                        "refuses to serve it; set router.config.api_keys (clients send Authorization: Bearer KEY) "
                        "or router.config.allow_open: true, or bind 127.0.0.1")
    return problems
