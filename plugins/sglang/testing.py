"""Start real SGLang servers on a CPU machine for tests, benchmarks and development (no SGLang import here: the
servers run with the SGLang venv's python, ``scripts/setup_sglang.sh``).

The flags that run SGLang 0.5.23 on a CPU-only host, and the PD flags, are built by
:class:`dlmix.engine_process.SGLangServerSpec` (its docstring says why each is there). A crashed SGLang server waits
for "CUDA coredumps" before it exits: stop servers by pid, with timeouts (:meth:`SGLangServer.stop`).
"""
from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlmix.engine_process import SGLANG_CPU_FLAGS, SGLANG_CPU_PD_FLAGS, ServerChild, SGLangServerSpec, free_port

__all__ = ["sglang_python", "SGLangServer", "start_server", "start_sglang_router", "free_port", "generate",
           "pd_generate", "held_by_instance", "wait_nothing_held", "post_json", "CPU_FLAGS", "PD_FLAGS"]

#: the CPU flags (one definition: :class:`dlmix.engine_process.SGLangServerSpec`)
CPU_FLAGS = SGLANG_CPU_FLAGS
PD_FLAGS = SGLANG_CPU_PD_FLAGS


def sglang_python() -> str | None:
    """The SGLang venv's python (``$DLMIX_SGLANG_VENV``, else ``.venv-sglang`` beside this checkout, where
    ``scripts/setup_sglang.sh`` builds it) when SGLang imports there; None otherwise."""
    root = Path(__file__).resolve().parents[2]
    cands = [os.environ.get("DLMIX_SGLANG_VENV"), str(root / ".venv-sglang")]
    for c in cands:
        if c and (Path(c) / "bin" / "python").exists() and list(Path(c).glob("lib/python3*/site-packages/sglang")):
            return str(Path(c) / "bin" / "python")
    return None


@dataclass
class SGLangServer(ServerChild):
    """One running ``sglang.launch_server`` (pid, URL, log file); ready when ``GET /health`` answers 200."""

    bootstrap_port: int | None = None
    args: list[str] = field(default_factory=list)
    #: ZMQ endpoint of its KV events (``--kv-events-config``), or None
    kv_events: str | None = None

    NAME = "SGLang"

    def wait_ready(self, timeout_s: float = 600.0, path: str | None = None, interval_s: float = 2.0) -> None:
        super().wait_ready(timeout_s, path, interval_s)


def require_venv() -> None:
    """Skip the calling test module, with the reason, when SGLang's venv is absent (call at module level)."""
    if sglang_python() is None:
        import pytest

        pytest.skip("no SGLang venv (run scripts/setup_sglang.sh, or set DLMIX_SGLANG_VENV)", allow_module_level=True)


def start_server(model: str, port: int, log_path: str | Path, *, mode: str | None = None,
                 backend: str = "dlmix", bootstrap_port: int | None = None, extra: list[str] | None = None,
                 env: dict[str, str] | None = None, dtype: str = "float32", page_size: int | None = None,
                 max_total_tokens: int = 8192, mem_fraction: float = 0.8,
                 python: str | None = None, kv_events: str | None = None, tp: int = 1) -> SGLangServer:
    """Start ``python -m sglang.launch_server`` for ``model`` on 127.0.0.1:``port`` (not waiting for it).

    ``mode``: None (a single server), ``prefill`` or ``decode`` (with ``--disaggregation-transfer-backend backend``;
    prefill listens for bootstrap on ``bootstrap_port``). ``env``: extra environment (e.g. ``DLMIX_SGLANG_CONFIG``).
    ``kv_events``: ``tcp://host:port`` to publish KV events on (``SGLangServer.kv_events``). ``tp``: attention TP
    size (``--tp-size``; on CPU its ranks are processes talking over gloo). The server runs with
    the CPU aids on (``DLMIX_SGLANG_CPU_AIDS=1``, :func:`dlmix_sglang._cpu_aids`; ``env`` may turn them off).
    Raises RuntimeError when no SGLang venv is found.
    """
    py = python or sglang_python()
    if py is None:
        raise RuntimeError("no SGLang venv: run scripts/setup_sglang.sh (or set DLMIX_SGLANG_VENV)")
    bp = (bootstrap_port or free_port()) if mode == "prefill" else None
    spec = SGLangServerSpec(model=str(model), port=port, python=py, dtype=dtype, page_size=page_size,
                            max_total_tokens=max_total_tokens, mem_fraction_static=mem_fraction,
                            disaggregation_mode=mode, transfer_backend=backend, bootstrap_port=bp,
                            kv_events=kv_events, tensor_parallel_size=tp, extra_args=list(extra or []),
                            env={"MC_FORCE_TCP": "1", "MOONCAKE_PROTOCOL": "tcp", "OMP_NUM_THREADS": "1",
                                 "DLMIX_SGLANG_CPU_AIDS": "1", **(env or {})})
    args = spec.argv()
    log_path = Path(log_path)
    fh = open(log_path, "wb")
    proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=spec.child_env(), start_new_session=True)
    fh.close()
    return SGLangServer(proc=proc, url=f"http://127.0.0.1:{port}", log_path=log_path, bootstrap_port=bp, args=args,
                        kv_events=kv_events)


def start_sglang_router(prefill: SGLangServer, decode: SGLangServer, port: int, log_path: str | Path,
                        python: str | None = None) -> SGLangServer:
    """Start SGLang's own PD router (``sglang_router.launch_router --pd-disaggregation``, PyPI ``sglang-router``)
    in front of one prefill and one decode server. Raises RuntimeError when no SGLang venv is found."""
    py = python or sglang_python()
    if py is None:
        raise RuntimeError("no SGLang venv: run scripts/setup_sglang.sh (or set DLMIX_SGLANG_VENV)")
    args = [py, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", prefill.url,
            str(prefill.bootstrap_port), "--decode", decode.url, "--host", "127.0.0.1", "--port", str(port)]
    log_path = Path(log_path)
    fh = open(log_path, "wb")
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=e, start_new_session=True)
    fh.close()
    return SGLangServer(proc=proc, url=f"http://127.0.0.1:{port}", log_path=log_path, args=args)


def post_json(url: str, body: dict[str, Any], timeout_s: float = 300.0) -> tuple[int, dict[str, Any] | str]:
    """POST JSON; returns ``(status, parsed JSON or text)`` (HTTP errors are returned, not raised)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(errors="replace"), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def generate(url: str, input_ids: list[int], max_new_tokens: int, *, bootstrap: tuple[str, int, int] | None = None,
             logprobs: bool = False, timeout_s: float = 300.0, ignore_eos: bool = False
             ) -> tuple[int, dict[str, Any] | str]:
    """SGLang ``POST /generate`` with token ids, greedy; ``bootstrap`` = (host, port, room) for a PD leg;
    ``ignore_eos``: generate ``max_new_tokens`` tokens whatever they are."""
    body: dict[str, Any] = {"input_ids": list(input_ids),
                            "sampling_params": {"temperature": 0, "max_new_tokens": int(max_new_tokens),
                                                **({"ignore_eos": True} if ignore_eos else {})}}
    if logprobs:
        body.update({"return_logprob": True, "top_logprobs_num": 2})
    if bootstrap is not None:
        body.update({"bootstrap_host": bootstrap[0], "bootstrap_port": bootstrap[1], "bootstrap_room": bootstrap[2]})
    return post_json(url + "/generate", body, timeout_s)


def pd_generate(prefill: SGLangServer, decode: SGLangServer, input_ids: list[int], max_new_tokens: int, *,
                room: int | None = None, ignore_eos: bool = False) -> tuple[tuple[int, Any], tuple[int, Any]]:
    """One request through a PD pair as SGLang's router sends it: the same :func:`generate` body with
    ``bootstrap_host/port/room`` to ``prefill`` and ``decode`` at once (``room``: a random 62-bit one by default).
    Returns ``((prefill status, body), (decode status, body))``."""
    import random
    import threading

    room = random.getrandbits(62) if room is None else room
    out: dict[str, Any] = {}

    def leg(name: str, url: str) -> None:
        out[name] = generate(url, input_ids, max_new_tokens, bootstrap=("127.0.0.1", prefill.bootstrap_port, room),
                             ignore_eos=ignore_eos)

    th = [threading.Thread(target=leg, args=(n, s.url)) for n, s in (("p", prefill), ("d", decode))]
    for t in th:
        t.start()
    for t in th:
        t.join()
    return out["p"], out["d"]


def held_by_instance(router_url: str) -> dict[str, tuple[float, int, int]]:
    """``{url: (kv_usage, running, waiting)}`` of the instances that heartbeat the dlmix router at ``router_url``
    (SGLang's own KV token usage and queues, :mod:`dlmix_sglang.router_hook`)."""
    import httpx

    return {i["url"]: (i["load"]["kv_usage"], i["load"]["running"], i["load"]["waiting"])
            for i in httpx.get(router_url + "/admin/instances", timeout=5).json()["instances"]}


def wait_nothing_held(router_url: str, urls: list[str], timeout_s: float = 120.0) -> None:
    """Wait until every instance in ``urls`` heartbeats no KV tokens held and no request queued; raises
    AssertionError (with what they heartbeat) after ``timeout_s`` seconds."""
    from dlmix.testing import wait_until

    wait_until(lambda: all(held_by_instance(router_url).get(u) == (0.0, 0, 0) for u in urls), timeout_s,
               f"no KV held and no request queued on {urls} (now {held_by_instance(router_url)})")
