"""Start real LMDeploy servers (its proxy and ``api_server``) on a CPU machine for tests, benchmarks and development.
Nothing here imports LMDeploy: the servers run with the LMDeploy venv's python (``scripts/setup_lmdeploy.sh``), with
the CPU aid on (``DLMIX_LMDEPLOY_CPU=1``, :mod:`dlmix_lmdeploy.cpu`) and one OpenMP thread per server.
Servers are stopped by process id (their process group), with timeouts.
"""
from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from dlmix.engine_process import LMDEPLOY_ROLES, LMDeployServerSpec, ServerChild, free_port

__all__ = ["lmdeploy_python", "LMDeployServer", "start_proxy", "start_api_server", "start_all_ready", "post_json", "free_port",
           "reference", "reference_chat", "first_divergence", "near_tie", "RoutedPair"]


def lmdeploy_python() -> str | None:
    """The LMDeploy venv's python (``$DLMIX_LMDEPLOY_VENV``, else ``.venv-lmdeploy`` beside this checkout) when
    LMDeploy is installed there; None otherwise."""
    root = Path(__file__).resolve().parents[2]
    for c in (os.environ.get("DLMIX_LMDEPLOY_VENV"), str(root / ".venv-lmdeploy")):
        if c and (Path(c) / "bin" / "python").exists() and list(Path(c).glob("lib/python3*/site-packages/lmdeploy")):
            return str(Path(c) / "bin" / "python")
    return None


class LMDeployServer(ServerChild):
    """One running LMDeploy process (pid, URL, log file); an ``api_server`` is ready when ``GET /v1/models``
    answers 200 (the proxy: ``wait_ready(path="/nodes/status")``)."""

    READY_PATH = "/v1/models"
    NAME = "LMDeploy"


def _spawn(argv: list[str], env: dict[str, str], log_path: Path, url: str) -> LMDeployServer:
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    return LMDeployServer(proc, url, log_path)


def _python() -> str:
    py = lmdeploy_python()
    if py is None:
        raise RuntimeError("no LMDeploy venv: run scripts/setup_lmdeploy.sh (or set DLMIX_LMDEPLOY_VENV)")
    return py


def start_proxy(log_dir: Path, port: int | None = None, strategy: str = "DistServe") -> LMDeployServer:
    """``lmdeploy serve proxy`` on 127.0.0.1 (``--serving-strategy DistServe`` by default), with
    ``--disable-cache-status``: LMDeploy's proxy otherwise saves its node list to ``serve/proxy/proxy_config.json`` in
    its package and loads it at import, so nodes of earlier runs come back (a saved list is removed first)."""
    venv = Path(_python()).parents[1]
    for saved in venv.glob("lib/python3*/site-packages/lmdeploy/serve/proxy/proxy_config.json"):
        saved.unlink(missing_ok=True)
    port = port or free_port()
    spec = LMDeployServerSpec(model="", port=port)  # for its environment (CPU aid, offline hub)
    argv = [str(Path(_python()).parent / "lmdeploy"), "serve", "proxy", "--server-name", "127.0.0.1",
            "--server-port", str(port), "--serving-strategy", strategy, "--routing-strategy",
            "min_expected_latency", "--disable-cache-status"]
    return _spawn(argv, spec.child_env(), Path(log_dir) / f"proxy-{port}.log", f"http://127.0.0.1:{port}")


def start_api_server(model: str, log_dir: Path, *, role: str = "Hybrid", dtype: str = "float16",
                     block_size: int = 16, num_blocks: int = 256, proxy_url: str | None = None,
                     migration_backend: str = "DLMix", port: int | None = None, session_len: int = 2048,
                     env: dict[str, str] | None = None, extra: list[str] | None = None) -> LMDeployServer:
    """``lmdeploy serve api_server MODEL --backend pytorch`` on 127.0.0.1 with a fixed block count
    (``--num-gpu-blocks``: otherwise it follows free memory), eager mode, the given role and migration backend."""
    port = port or free_port()
    spec = LMDeployServerSpec(model=str(model), port=port, python=_python(), dtype=dtype, block_size=block_size,
                              num_blocks=num_blocks, session_len=session_len, role=dlmix_role(role),
                              migration_backend=migration_backend, proxy_url=proxy_url, extra_args=list(extra or []),
                              env={"PYTHONUNBUFFERED": "1", **(env or {})}, hub_offline=False)
    return _spawn(spec.argv(), spec.child_env(), Path(log_dir) / f"{role.lower()}-{port}.log", spec.url)


def require_venv() -> None:
    """Skip the calling test module, with the reason, when LMDeploy's venv is absent (call at module level)."""
    if lmdeploy_python() is None:
        import pytest

        pytest.skip("no LMDeploy venv (run scripts/setup_lmdeploy.sh, or set DLMIX_LMDEPLOY_VENV)",
                    allow_module_level=True)


def start_ready(model: str, log_dir: Path, started: list | None = None, **kw: Any) -> LMDeployServer:
    """:func:`start_api_server` and wait until it is ready, retried once on the same port when the engine process
    died at start-up: LMDeploy 0.18's api_server shuts its multiprocessing manager down while the engine process may
    still be releasing the manager's condition (``zmq_engine.py`` ``_start_mp_proc``), a start-up race a loaded
    machine hits now and then (``EOFError``, "engine process is not alive"). Every server started is appended to
    ``started`` (so the caller stops it). Raises RuntimeError with the log tail otherwise."""
    kw["port"] = kw.get("port") or free_port()  # a retry keeps the port: a proxy may have registered the first try
    for attempt in (1, 2):
        s = start_api_server(model, log_dir, **kw)
        if started is not None:
            started.append(s)
        try:
            s.wait_ready()
            return s
        except RuntimeError:
            s.stop()
            if attempt == 2 or "not alive" not in s.log_tail(200):
                raise
    raise AssertionError("unreachable")


def start_all_ready(model: str, log_dir: Path, started: list, specs: list[dict[str, Any]]) -> list[LMDeployServer]:
    """One server per keyword set in ``specs`` (as :func:`start_api_server`; a ``model`` key serves another model
    folder than ``model``), all spawned at once (their start-ups overlap) and then waited for in order; a server that
    hit the start-up race :func:`start_ready` describes is started again alone on its port. Every server started is
    appended to ``started``. Returns them in ``specs`` order. Raises RuntimeError with the log tail of a server that
    did not come up."""
    ports: set[int] = set()
    spawned = []
    for kw in specs:
        kw = dict(kw)
        m = kw.pop("model", model)
        while not kw.get("port") or kw["port"] in ports:
            kw["port"] = free_port()
        ports.add(kw["port"])
        s = start_api_server(m, log_dir, **kw)
        started.append(s)
        spawned.append((s, m, kw))
    out = []
    for s, m, kw in spawned:
        try:
            s.wait_ready()
            out.append(s)
        except RuntimeError:
            s.stop()
            if "not alive" not in s.log_tail(200):
                raise
            out.append(start_ready(m, log_dir, started, **kw))
    return out


def router_request(url: str, model: str, kind: str, prompt: str, max_tokens: int,
                   headers: dict[str, str] | None = None) -> str:
    """One greedy request (``ignore_eos``) of ``kind`` (``completion`` / ``chat``, ``-stream`` appended for SSE) to
    ``url`` (e.g. the dlmix router), with ``headers`` added (e.g. the router's instance pins); the answer's text.
    Asserts HTTP 200."""
    chat = kind.startswith("chat")
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not kind.endswith("-stream"):
        status, out = post_json(url + path, body, headers=headers)
        assert status == 200, (kind, status, out)
        c = out["choices"][0]
        return c["message"]["content"] if chat else c["text"]
    body["stream"] = True
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    text = []
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            c = json.loads(line[5:])["choices"]
            if c:
                text.append((c[0].get("delta") or {}).get("content") or "" if chat else c[0].get("text") or "")
    return "".join(text)


def dlmix_role(role: str) -> str:
    """dlmix role of an LMDeploy ``--role`` name (``Prefill`` -> ``prefill``, ``Hybrid`` -> ``both``)."""
    return {v: k for k, v in LMDEPLOY_ROLES.items()}[role]


def post_json(url: str, body: dict[str, Any], timeout: float = 300.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """POST JSON (with ``headers`` added); returns (status, decoded body); an HTTP error's body is decoded too (or
    ``{"raw": text}``)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                  **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read().decode(errors="replace")
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw}


def reference(url: str, prompt: str, tokenizer: Any, max_tokens: int) -> tuple[str, list[str], list[float]]:
    """A single instance's greedy completion of the raw ``prompt`` through LMDeploy's ``/generate`` (no chat
    template, as ``/v1/completions``): ``(text, its tokens as text, per-token top-1/top-2 logprob gap in nats)``.
    The instance needs ``--logprobs-mode raw_logprobs``."""
    status, out = post_json(url + "/generate", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                "ignore_eos": True, "return_logprob": True, "top_logprobs_num": 5})
    if status != 200 or len(out.get("output_ids") or []) != max_tokens:
        raise AssertionError(f"reference /generate answered {status}: {out}")
    special = set(tokenizer.all_special_ids)  # banned by ignore_eos, but raw logprobs still list them
    gaps = []
    for tok, top in zip(out["output_ids"], out["meta_info"]["output_top_logprobs"]):
        mine = next((lp for lp, t in top if t == tok), None)
        others = [lp for lp, t in top if t != tok and t not in special]
        gaps.append(mine - max(others) if mine is not None and others else float("inf"))
    return out["text"], [tokenizer.decode([t]) for t in out["output_ids"]], gaps


def reference_chat(url: str, model: str, content: str, tokenizer: Any, max_tokens: int
                   ) -> tuple[str, list[str], list[float]]:
    """A single instance's greedy chat completion of one user message: ``(text, its tokens as text, per-token gap
    between the chosen token's logprob and the best other candidate's, special tokens left out)``. Needs
    ``--logprobs-mode raw_logprobs``."""
    status, out = post_json(url + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 5})
    if status != 200:
        raise AssertionError(f"reference chat answered {status}: {out}")
    choice = out["choices"][0]
    special = set(tokenizer.all_special_tokens)  # banned by ignore_eos, but raw logprobs still list them
    texts, gaps = [], []
    for c in choice["logprobs"]["content"]:
        # a special token (e.g. <|im_start|>) is generated but skipped in the text (skip_special_tokens)
        texts.append("" if c["token"] in special else tokenizer.convert_tokens_to_string([c["token"]]))
        others = [t["logprob"] for t in c.get("top_logprobs") or []
                  if t["token"] != c["token"] and t["token"] not in special]
        gaps.append(c["logprob"] - max(others) if others else float("inf"))
    return choice["message"]["content"], texts, gaps


def first_divergence(text: str, ref_tokens: list[str]) -> int | None:
    """Index of the first reference token that ``text`` does not continue with; None when ``text`` is exactly the
    reference."""
    pos = 0
    for k, tok in enumerate(ref_tokens):
        if not text.startswith(tok, pos):
            return k
        pos += len(tok)
    return None if pos == len(text) else len(ref_tokens)


def near_tie(case: str, got: str, ref: tuple[str, list[str], list[float]], threshold: float) -> bool:
    """False when ``got`` equals the reference text; True when it first differs at a token whose reference gap is
    below ``threshold`` nats (printed); AssertionError naming the token and gap otherwise."""
    text, tokens, gaps = ref
    if got == text:
        return False
    k = first_divergence(got, tokens)
    if k is None:
        return False
    gap = gaps[k] if k < len(gaps) else float("inf")
    if not 0 <= gap < threshold:
        raise AssertionError(f"{case}: differs at token {k} (top-2 gap {gap:.4f}, near-tie below {threshold}): {got!r} vs "
                             f"{text!r}")
    print(f"[{case}] near-tie at token {k} (top-2 gap {gap:.4f})")
    return True


class RoutedPair:
    """A dlmix router (a :class:`dlmix.testing.RouterThread` in this process, ``cost`` policy) and an LMDeploy
    prefill and decode that register themselves with it and heartbeat their block usage every ``heartbeat_s``
    seconds (:mod:`dlmix_lmdeploy.router_hook`): the fault tests' and the fault campaign's deployment.

    Args:
        model: the model folder (also the served model name).
        log_dir: where the servers' logs go.
        engines: per name (``"P"``, ``"D"``) the :func:`start_api_server` keywords (role, dtype, block_size,
            num_blocks, ...). Default: a bf16/block-16 prefill of 96 blocks and an fp16/block-64 decode of 32.
        hold_timeout_s: the prefill's hold timeout (long by default, so that blocks freed within a test's wait were
            freed by the flow itself, not by this timeout).

    The block usage read is LMDeploy's own block manager's (used blocks over the pool, as heartbeated), which counts
    the blocks a prefill holds for a decode. Use as a context manager, or call :meth:`stop`.
    """

    #: blocks an idle engine may still report (LMDeploy keeps at most a block or two for itself)
    IDLE_BLOCKS = 2

    def __init__(self, model: str, log_dir: Path, engines: dict[str, dict] | None = None,
                 hold_timeout_s: float = 600.0, heartbeat_s: float = 0.5):
        self.model = str(model)
        self.log_dir = Path(log_dir)
        self.engines = engines or {"P": dict(role="Prefill", dtype="bfloat16", block_size=16, num_blocks=96),
                                   "D": dict(role="Decode", dtype="float16", block_size=64, num_blocks=32)}
        self.hold_timeout_s = hold_timeout_s
        self.heartbeat_s = heartbeat_s
        self.servers: dict[str, LMDeployServer] = {}
        self.started: list[LMDeployServer] = []
        self.router: Any = None

    @property
    def url(self) -> str:
        """The router's base URL."""
        return self.router.url

    def start(self) -> "RoutedPair":
        """Start the router and both engines; returns once the router has a heartbeat from each. Raises
        RuntimeError (with a log tail) when an engine does not start, AssertionError when one never registers."""
        from dlmix.router.config import RouterConfig
        from dlmix.testing import RouterThread

        self.router = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="cost", model_spec=self.model))
        try:
            for name in self.engines:
                self.launch(name)
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self, name: str, port: int | None = None) -> LMDeployServer:
        """Start engine ``name`` (again, e.g. on its old ``port`` after a kill) and wait until it heartbeats."""
        from dlmix.testing import poll

        port = port or free_port()
        url = f"http://127.0.0.1:{port}"
        before = self.router.call(lambda: self._backend(url))  # a killed instance's, replaced when this registers
        env = {"DLMIX_LMDEPLOY_CONFIG": json.dumps({"router_url": self.url, "public_url": url,
                                                    "model_name": self.model, "heartbeat_s": self.heartbeat_s,
                                                    "hold_timeout_s": self.hold_timeout_s})}
        s = self.servers[name] = start_ready(self.model, self.log_dir, self.started, port=port, env=env,
                                             **self.engines[name])

        def serving() -> bool:
            b = self._backend(url)
            return b is not None and b is not before and b.state.load is not None and b.state.healthy
        assert poll(lambda: self.router.call(serving), 60), f"{name} ({url}) never registered and heartbeated"
        return s

    def _backend(self, url: str) -> Any:
        """The router's backend registered for ``url`` (None when none); call on the router's loop."""
        return next((b for b in self.router.router.registry.backends.values() if b.state.url == url), None)

    def __getattr__(self, name: str) -> LMDeployServer:
        servers = self.__dict__.get("servers", {})
        if name in servers:
            return servers[name]
        raise AttributeError(name)

    def usage(self, name: str) -> float | None:
        """Engine ``name``'s used share of its block pool from its last heartbeat (None before the first)."""
        url = self.servers[name].url

        def get():
            for b in self.router.router.registry.backends.values():
                if b.state.url == url and b.state.load is not None:
                    return b.state.load.kv_usage
            return None
        return self.router.call(get)

    def blocks_used(self, name: str) -> int | None:
        """:meth:`usage` in blocks."""
        u = self.usage(name)
        return None if u is None else round(u * int(self.engines[name]["num_blocks"]))

    def settle(self, names: tuple[str, ...] = ("P", "D"), timeout_s: float = 90.0) -> dict[str, int | None]:
        """Wait (up to ``timeout_s``) until each engine reports at most :data:`IDLE_BLOCKS` blocks in use; returns
        the last figures in blocks (None for an engine that did not report)."""
        from dlmix.testing import poll

        last: dict[str, int | None] = {}

        def idle() -> bool:
            for n in names:
                last[n] = self.blocks_used(n)
            return all(last[n] is not None and last[n] <= self.IDLE_BLOCKS for n in names)

        poll(idle, timeout_s, interval_s=0.5)
        return dict(last)

    def held_after(self, names: tuple[str, ...] = ("P", "D"), timeout_s: float = 90.0) -> int:
        """Blocks still in use beyond the idle allowance after :meth:`settle` (an engine that does not report
        counts its whole pool)."""
        last = self.settle(names, timeout_s)
        return sum(int(self.engines[n]["num_blocks"]) if last[n] is None else max(0, last[n] - self.IDLE_BLOCKS)
                   for n in names)

    def stop(self) -> None:
        """Stop every engine started (by process group) and the router."""
        for s in reversed(self.started):
            s.stop()
        if self.router is not None:
            self.router.close()

    def __enter__(self) -> "RoutedPair":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def router_against_reference(router_url: str, ref_url: str, model: str, tokenizer: Any, words: list[str],
                             lengths: list[int], rng: Any, label: str, threshold: float, max_tokens: int,
                             headers: dict[str, str] | None = None) -> int:
    """Greedy requests through ``router_url`` (a PD pair whose decode is LMDeploy) against ``ref_url`` (an LMDeploy
    instance in the decode's configuration, ``--logprobs-mode raw_logprobs``): one prompt of random ``words`` per
    entry of ``lengths`` (tokens), kinds cycling completion, chat, streamed completion, streamed chat. Each answer
    must equal the reference's text or part from it at a near-tie (:func:`near_tie`, which asserts otherwise). The
    references run side by side with the router requests (:func:`dlmix.testing.side_by_side`); ``headers`` go with
    each router request (e.g. the router's instance pins).
    Returns the number of near-ties (printed with ``label``)."""
    from dlmix.testing import side_by_side

    kinds = ["completion", "chat", "completion-stream", "chat-stream"]
    items = []
    for i, n in enumerate(lengths):
        text = " ".join(rng.choice(words) for _ in range(n))
        items.append((n, kinds[i % 4], tokenizer.decode(tokenizer.encode(text)[:n])))

    def ref(item):
        _, kind, prompt = item
        if kind.startswith("chat"):
            return reference_chat(ref_url, model, prompt, tokenizer, max_tokens)
        return reference(ref_url, prompt, tokenizer, max_tokens)

    ties = 0
    for (n, kind, _), (got, r) in zip(items, side_by_side(
            items, lambda it: router_request(router_url, model, it[1], it[2], max_tokens, headers), ref)):
        ties += near_tie(f"{label}, {kind} {n} tokens", got, r, threshold)
    print(f"{label}: identical {len(lengths) - ties}/{len(lengths)}, near-ties {ties}")
    return ties
