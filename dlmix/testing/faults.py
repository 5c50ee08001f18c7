"""The fault campaign's client side against a router: hostile clients, fuzzed requests, and how an answer is judged.

Used by ``benchmarks/faults.py`` (full campaign, one JSON line) and ``tests/test_faults.py`` (fast cases). Every
request goes over a raw socket (the hostile ones must control the bytes); an answer is judged as

* ``ok``: 200 and equal to the decode engine's own answer to the same request (the mock engine is deterministic and
  a PD answer through the router equals a direct one, see :mod:`dlmix.testing.mock_engine`);
* ``clear_error``: a 4xx/5xx whose body says what went wrong (a JSON ``error`` string or ``error.message``), or a
  408/413/414/431 (the status itself names the problem), or a connection the server closed on a client that never
  finished its request (slowloris: nginx's header timeout does the same);
* ``unclear``: anything else that is not an answer (a reset, no answer before the timeout, a 4xx/5xx without a
  reason, a 200 that is not a complete HTTP answer);
* ``wrong``: a 200 whose content differs from the engine's own answer (must never happen).

:class:`Tally` adds these up per class; :class:`HealthyClient` measures the worst wait of a well-behaved client
while hostile ones run; :class:`MockDeployment` runs ``dlmix router`` in front of a mock prefill and decode engine
as real processes, so a crash is a process that exited.
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from dlmix.engine_process import free_port
from dlmix.net import sse_lines

__all__ = ["Answer", "Tally", "exchange", "judge", "http_request", "fuzz_request", "malformed_bodies",
           "HealthyClient", "MockDeployment", "LinkProxy", "one_byte_chunks", "slowloris", "idle_connections",
           "oversized", "fuzzed_requests", "malformed_json"]

#: the well-formed request every class derives from (a small completion; the mock answers it deterministically)
BASE = {"model": "mock", "prompt": "The router sends this prompt to a prefill and then a decode instance.",
        "max_tokens": 8, "temperature": 0}


@dataclass
class Answer:
    """One exchange: ``status`` (None: no HTTP answer), ``headers`` (lower-case names), ``body`` (de-chunked bytes),
    ``error``: why there is no complete answer (``reset``, ``timeout``, ``closed``, a parse problem)."""

    status: Optional[int] = None
    headers: dict = field(default_factory=dict)
    body: bytes = b""
    error: Optional[str] = None


@dataclass
class Tally:
    """Per-class outcome counts (see module doc); ``unchecked``: 200 answers to hostile framings that have no engine
    reference (counted apart from ``ok``); ``held_after``: what the engines still hold afterwards (KV blocks
    on real engines, running requests on mock engines); ``crashes``: processes that exited; ``worst_healthy_wait_s``:
    the longest a healthy client waited for one answer while the class ran."""

    tried: int = 0
    ok: int = 0
    near_ties: int = 0
    clear_error: int = 0
    unclear: int = 0
    wrong: int = 0
    unchecked: int = 0
    held_after: int = 0
    crashes: int = 0
    worst_healthy_wait_s: Optional[float] = None
    notes: list = field(default_factory=list)

    def add(self, verdict: str) -> None:
        self.tried += 1
        setattr(self, verdict, getattr(self, verdict) + 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["worst_healthy_wait_s"] is not None:
            d["worst_healthy_wait_s"] = round(d["worst_healthy_wait_s"], 3)
        if not d["notes"]:
            d.pop("notes")
        return d


def http_request(method: str, path: str, body: bytes = b"", headers: Optional[list] = None,
                 host: str = "127.0.0.1") -> bytes:
    """Raw HTTP/1.1 request bytes (``Connection: close``, a ``Content-Length`` when ``body`` is given and no
    ``headers`` entry sets one)."""
    hs = [("Host", host), ("Connection", "close")]
    hs += list(headers or [])
    if body and not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in hs):
        hs.append(("Content-Length", str(len(body))))
    if body and not any(k.lower() == "content-type" for k, _ in hs):
        hs.append(("Content-Type", "application/json"))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hs) + "\r\n"
    return head.encode("latin-1", "replace") + body


def _parse(raw: bytes) -> Answer:
    i = raw.find(b"\r\n\r\n")
    if i < 0:
        return Answer(error="closed" if not raw else "incomplete head")
    lines = raw[:i].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    try:
        status = int(parts[1])
    except (IndexError, ValueError):
        return Answer(error=f"bad status line {lines[0][:60]!r}")
    hs = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(b":")
        hs[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    body = raw[i + 4:]
    if hs.get("transfer-encoding", "").lower() == "chunked":
        out, pos = bytearray(), 0
        while True:
            j = body.find(b"\r\n", pos)
            if j < 0:
                return Answer(status, hs, bytes(out), "truncated chunked body")
            try:
                n = int(body[pos:j].split(b";")[0], 16)
            except ValueError:
                return Answer(status, hs, bytes(out), "bad chunk size")
            if n == 0:
                break
            out += body[j + 2:j + 2 + n]
            if len(body) < j + 2 + n:
                return Answer(status, hs, bytes(out), "truncated chunk")
            pos = j + 4 + n
        body = bytes(out)
    elif "content-length" in hs:
        try:
            n = int(hs["content-length"])
        except ValueError:
            return Answer(status, hs, body, "bad content-length")
        if len(body) < n:
            return Answer(status, hs, body, "truncated body")
        body = body[:n]
    return Answer(status, hs, body)


def exchange(port: int, raw: bytes, timeout: float = 30.0, host: str = "127.0.0.1",
             chunk: Optional[int] = None) -> Answer:
    """Send ``raw`` on a fresh connection (in pieces of ``chunk`` bytes, each its own segment, when given) and read
    the answer until the server closes (requests carry ``Connection: close``) or ``timeout`` seconds pass."""
    try:
        s = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        return Answer(error=f"connect: {e}")
    try:
        s.settimeout(timeout)
        try:
            if chunk:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for i in range(0, len(raw), chunk):
                    s.sendall(raw[i:i + chunk])
            else:
                s.sendall(raw)
        except OSError:  # the server may answer (413) and close before the whole request was sent
            pass
        buf = bytearray()
        deadline = time.monotonic() + timeout
        while True:
            try:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                b = s.recv(1 << 16)
            except socket.timeout:
                a = _parse(bytes(buf))
                return Answer(a.status, a.headers, a.body, "timeout") if a.error or a.status is None else a
            except OSError as e:
                a = _parse(bytes(buf))
                return a if a.status is not None and a.error is None else Answer(a.status, a.headers, a.body,
                                                                               f"reset ({e.__class__.__name__})")
            if not b:
                return _parse(bytes(buf))
            buf += b
    finally:
        s.close()


def _events(body: bytes) -> Optional[list]:
    out = []
    for line in sse_lines(body.decode("utf-8", "replace")):
        if line.startswith("data: "):
            out.append(line[6:])
    return out


def _same(a: Answer, ref: Answer) -> bool:
    if a.headers.get("content-type", "").startswith("text/event-stream"):
        return _events(a.body) == _events(ref.body)
    try:
        return json.loads(a.body) == json.loads(ref.body)
    except ValueError:
        return a.body == ref.body


def _clear(a: Answer) -> bool:
    if a.status in (408, 413, 414, 431):
        return True
    try:
        d = json.loads(a.body)
    except ValueError:
        return False
    e = d.get("error") if isinstance(d, dict) else None
    if isinstance(e, dict):
        e = e.get("message")
    return isinstance(e, str) and bool(e.strip())


def judge(a: Answer, reference: Optional[Callable[[], Answer]] = None) -> str:
    """Verdict of one answer (``ok``/``clear_error``/``unclear``/``wrong``/``unchecked``, see module doc).
    ``reference()`` returns the decode engine's own answer to the same request; it is asked only for a 200. A 200
    with no reference, or whose reference is not a 200 (the router replaced a field the engine chokes on, e.g. a
    client's own ``kv_transfer_params``), is ``unchecked``."""
    if a.status is None or a.error is not None:
        return "unclear"
    if a.status == 200:
        if reference is None:
            return "unchecked"
        ref = reference()
        if ref.status != 200 or ref.error is not None:
            return "unchecked"
        return "ok" if _same(a, ref) else "wrong"
    if 400 <= a.status < 600 and _clear(a):
        return "clear_error"
    return "unclear"


# ------------------------------------------------------------------------------------------------ request fuzzing
_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/", "/v1/../admin",
          "/v1/completions?x=" + "%00" * 8, "/%ff%fe", "/v1/completions/extra", "*", "/v1/chat/completions#frag"]
_METHODS = ["POST"] * 8 + ["GET", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH", "BREW", "P OST"]


def _mutate_value(rng: random.Random) -> Any:
    return rng.choice([None, True, False, 0, -1, 1, 7, 64, 2 ** 31, -2 ** 63, 2 ** 70, 1.5, float("nan"), "",
                       "x", "8", "\u0000", "\ud800", "é" * 20, [], [1, "a"], {}, {"a": [1]}, [[[[]]]],
                       "A" * 2000])


def _fuzz_body(rng: random.Random) -> bytes:
    k = rng.randrange(8)
    if k == 0:
        return rng.randbytes(rng.randrange(0, 200))
    d: dict = dict(BASE)
    if rng.random() < 0.4:
        d.pop("prompt")
        d["messages"] = [{"role": "user", "content": "Say something about routers."}]
    for _ in range(rng.randrange(1, 4)):
        key = rng.choice(["model", "prompt", "messages", "max_tokens", "stream", "n", "temperature", "seed",
                          "stop", "logprobs", "stream_options", "kv_transfer_params", "cache_salt", "extra",
                          "max_completion_tokens", "top_p", "user"])
        if rng.random() < 0.15:
            d.pop(key, None)
        elif key == "max_tokens" and rng.random() < 0.5:
            d[key] = rng.choice([1, 2, 16, 64])
        elif key == "stream" and rng.random() < 0.5:
            d[key] = rng.choice([True, False])
        elif key == "messages" and rng.random() < 0.5:
            d[key] = [{"role": rng.choice(["user", "system", "tool", 5, None]),
                       "content": rng.choice(["hi", None, 5, [{"type": "text", "text": 7}],
                                              [{"type": "text", "text": "hi"}], {"a": 1}])}]
        else:
            d[key] = _mutate_value(rng)
    for key in ("max_tokens", "max_completion_tokens"):  # no runaway generation (the mock has no length limit)
        v = d.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 64:
            d[key] = rng.choice(["big", -3, 0, 1.5, str(v)])
    if isinstance(d.get("n"), int) and not isinstance(d.get("n"), bool) and d["n"] > 4:
        d["n"] = -1
    raw = json.dumps(d, allow_nan=True, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    if k == 1 and raw:  # truncated
        raw = raw[:rng.randrange(len(raw))]
    elif k == 2 and raw:  # flipped bytes
        b = bytearray(raw)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        raw = bytes(b)
    return raw


def fuzz_request(rng: random.Random) -> tuple[bytes, Optional[tuple[str, str, bytes]]]:
    """One fuzzed request: ``(raw bytes, (method, path, body))``; the triple is None when the framing itself is
    hostile (then no engine reference applies). Bodies never ask for more than 64 tokens (``max_tokens`` and
    ``max_completion_tokens``) or 4 choices."""
    method = rng.choice(_METHODS)
    path = rng.choice(_PATHS[:2]) if rng.random() < 0.8 else rng.choice(_PATHS)
    body = _fuzz_body(rng) if method not in ("GET", "HEAD") or rng.random() < 0.2 else b""
    k = rng.randrange(12)
    if k == 0:  # a content-length that is a lie (shorter) or not a number
        raw = http_request(method, path, body, [("Content-Length", rng.choice(["-1", "abc", "1e3", "0x10",
                                                                             str(max(0, len(body) - 3))]))])
        return raw, None
    if k == 1:  # chunked framing, sometimes broken
        chunks = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
        if rng.random() < 0.5:
            chunks = chunks.replace(b"\r\n", b"\n", 1)
        return http_request(method, path, chunks, [("Transfer-Encoding", "chunked")]), None
    if k == 2:  # hostile header lines
        hs = [rng.choice([("X-" + "a" * 300, "b"), ("Content-Type", "text/plain"), ("Authorization", "Bearer \x00"),
                          ("Content-Length", str(len(body))), ("X-Bad\x01Name", "v"), ("Host", "")])]
        return http_request(method, path, body, hs), None
    if k == 3:  # not HTTP at all
        return rng.randbytes(rng.randrange(1, 300)) + b"\r\n\r\n", None
    return http_request(method, path, body), (method, path, body)


def malformed_bodies() -> list[tuple[str, bytes]]:
    """Named malformed JSON bodies for ``/v1/completions`` (each must get a 400 naming the problem)."""
    deep = b"[" * 100_000 + b"]" * 100_000
    return [
        ("truncated", b'{"model": "mock", "prompt": "hi", "max_'),
        ("not_an_object", b'[1, 2, 3]'),
        ("a_string", b'"hello"'),
        ("empty", b""),
        ("nan", b'{"model": "mock", "prompt": "hi", "max_tokens": NaN}'),
        ("invalid_utf8", b'{"model": "mock", "prompt": "\xff\xfe"}'),
        ("deep_nesting", b'{"model": "mock", "prompt": ' + deep + b"}"),
        ("non_string_text_part", json.dumps({"model": "mock", "messages": [
            {"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode()),
        ("prompt_wrong_type", b'{"model": "mock", "prompt": {"a": 1}, "max_tokens": 4}'),
        ("max_tokens_string", b'{"model": "mock", "prompt": "hi", "max_tokens": "many"}'),
        ("trailing_garbage", b'{"model": "mock", "prompt": "hi"} trailing'),
        ("unknown_model", b'{"model": "no-such-model", "prompt": "hi", "max_tokens": 4}'),
    ]


# ------------------------------------------------------------------------------------------------ healthy client
class HealthyClient:
    """A well-behaved client in a thread: one small completion after another through the router (fresh connection
    each, like a new user), recording the longest wait and whether every answer was right. ``start()``, then
    ``stop() -> (worst_wait_s, answers, wrong_or_failed)``."""

    def __init__(self, port: int, reference: Answer, timeout: float = 120.0):
        self.port, self.ref, self.timeout = port, reference, timeout
        self.worst = 0.0
        self.n = 0
        self.bad = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        raw = http_request("POST", "/v1/completions", json.dumps(BASE).encode())
        while not self._stop.is_set():
            t0 = time.monotonic()
            a = exchange(self.port, raw, self.timeout)
            self.worst = max(self.worst, time.monotonic() - t0)
            self.n += 1
            if a.status != 200 or a.error or not _same(a, self.ref):
                self.bad += 1
            self._stop.wait(0.05)

    def start(self) -> "HealthyClient":
        self._t.start()
        return self

    def stop(self) -> tuple[float, int, int]:
        self._stop.set()
        self._t.join(self.timeout + 5)
        return self.worst, self.n, self.bad


# ------------------------------------------------------------------------------------------------ the deployment
class MockDeployment:
    """``dlmix router`` (a process) in front of a mock prefill and a mock decode engine (one process), the router's
    cost policy told to disaggregate every request (``local_max_uncached: 0``). ``port``: the router's;
    ``engine_ports``: (prefill, decode). ``crashes()``: processes that exited since start (each restarted)."""

    def __init__(self, workdir: Optional[str] = None, router_cfg: Optional[dict] = None):
        self.dir = workdir or tempfile.mkdtemp(prefix="dlmix-faults-")
        self.port = free_port()
        self.engine_ports = (free_port(), free_port())
        while len({self.port, *self.engine_ports}) < 3:
            self.engine_ports = (free_port(), free_port())
        self.router_cfg = router_cfg or {}
        self.engines: Optional[subprocess.Popen] = None
        self.router: Optional[subprocess.Popen] = None
        self._crashes = 0

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        with open(os.path.join(self.dir, log), "ab") as f:
            return subprocess.Popen([sys.executable] + args, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def _start_engines(self) -> None:
        p, d = self.engine_ports
        self.engines = self._spawn(["-m", "dlmix.testing.mock_engine", "--ports", f"{p},{d}", "--ttft-ms", "0",
                                    "--itl-ms", "0"], "engines.log")
        for port in self.engine_ports:
            self._wait(port, "/health")

    def _start_router(self) -> None:
        import yaml

        p, d = self.engine_ports
        cfg = {"host": "127.0.0.1", "port": self.port, "policy": "cost",
               "policy_params": {"local_max_uncached": 0}, "health_interval_s": 0.5,
               "instances": [{"id": "P", "url": f"http://127.0.0.1:{p}", "role": "prefill", "model": "mock",
                              "chip": "cpu-x86"},
                             {"id": "D", "url": f"http://127.0.0.1:{d}", "role": "decode", "model": "mock",
                              "chip": "cpu-x86"}]}
        cfg.update(self.router_cfg)
        path = os.path.join(self.dir, "router.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        self.router = self._spawn(["-m", "dlmix.cli", "router", "--config", path], "router.log")
        self._wait(self.port, "/health")

    def _wait(self, port: int, path: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            a = exchange(port, http_request("GET", path), 2.0)
            if a.status == 200:
                return
            time.sleep(0.2)
        raise RuntimeError(f"nothing answers 200 on port {port}{path} after {timeout}s (logs in {self.dir})")

    def start(self) -> "MockDeployment":
        self._start_engines()
        self._start_router()
        return self

    def crashes(self) -> int:
        """Processes that exited since the last call (restarted, so the next class finds a deployment)."""
        n = 0
        if self.engines is not None and self.engines.poll() is not None:
            n += 1
            self._start_engines()
        if self.router is not None and self.router.poll() is not None:
            n += 1
            self._start_router()
        self._crashes += n
        return n

    def running_on_engines(self) -> int:
        """Requests the engines still run (``vllm:num_requests_running``): what a fault left behind."""
        total = 0
        for port in self.engine_ports:
            a = exchange(port, http_request("GET", "/metrics"), 5.0)
            for line in a.body.decode("utf-8", "replace").splitlines():
                if line.startswith("vllm:num_requests_running"):
                    total += int(float(line.rsplit(" ", 1)[1]))
        return total

    def reference(self, method: str, path: str, body: bytes) -> Answer:
        """The decode engine's own answer to the same request."""
        return exchange(self.engine_ports[1], http_request(method, path, body), 30.0)

    def stop(self) -> None:
        import signal

        for p in (self.router, self.engines):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(5)

    def __enter__(self) -> "MockDeployment":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------------ the classes
def _run_class(dep: MockDeployment, work: Callable[[Tally], None]) -> Tally:
    t = Tally()
    ref = dep.reference("POST", "/v1/completions", json.dumps(BASE).encode())
    hc = HealthyClient(dep.port, ref).start()
    try:
        work(t)
    finally:
        worst, n, bad = hc.stop()
    t.worst_healthy_wait_s = worst
    if bad:
        t.notes.append(f"healthy client: {bad} of {n} answers failed or differed")
    time.sleep(0.3)
    t.crashes = dep.crashes()
    t.held_after = dep.running_on_engines()
    return t


def one_byte_chunks(dep: MockDeployment, kib: int = 64) -> Tally:
    """One valid completion whose ``kib`` KiB body arrives one byte per TCP segment."""
    body = json.dumps(dict(BASE, prompt=("chunked body " * (kib * 80))[:kib * 1024])).encode()

    def work(t: Tally) -> None:
        a = exchange(dep.port, http_request("POST", "/v1/completions", body), 300.0, chunk=1)
        t.add(judge(a, lambda: dep.reference("POST", "/v1/completions", body)))
    return _run_class(dep, work)


def slowloris(dep: MockDeployment, clients: int = 50, seconds: float = 15.0) -> Tally:
    """``clients`` connections that send a request head one header byte per second for ``seconds``: each the
    server closed (or answered 408) counts as ``clear_error``, each still open at the end as ``unclear``."""

    def work(t: Tally) -> None:
        socks = []
        for _ in range(clients):
            try:
                s = socket.create_connection(("127.0.0.1", dep.port), timeout=5)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                socks.append(s)
            except OSError:
                t.add("clear_error")
        closed: dict = {}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and len(closed) < len(socks):
            for i, s in enumerate(socks):
                if i in closed:
                    continue
                try:
                    s.sendall(b"X")
                    s.setblocking(False)
                    try:
                        b = s.recv(4096)
                        closed[i] = b if b else b"closed"
                    except BlockingIOError:
                        pass
                    finally:
                        s.setblocking(True)
                except OSError:
                    closed[i] = b"reset"
            time.sleep(1.0)
        for i, s in enumerate(socks):
            t.add("clear_error" if i in closed else "unclear")
            s.close()
        if len(closed) < len(socks):
            t.notes.append(f"{len(socks) - len(closed)} slow connections still open after {seconds:.0f}s")
    return _run_class(dep, work)


def idle_connections(dep: MockDeployment, n: int = 2000, seconds: float = 10.0) -> Tally:
    """``n`` connections opened and left idle for ``seconds`` (no request at all) while the healthy client runs: each
    the server refused or closed counts as ``clear_error`` (a connection cap or idle timeout at work), each still
    open at the end as ``unclear``."""

    def work(t: Tally) -> None:
        socks, refused = [], 0
        for _ in range(n):
            try:
                socks.append(socket.create_connection(("127.0.0.1", dep.port), timeout=5))
            except OSError:
                refused += 1
        time.sleep(seconds)
        closed = 0
        for s in socks:
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
            s.close()
        t.tried = n
        t.clear_error = refused + closed
        t.unclear = n - refused - closed
        if t.unclear:
            t.notes.append(f"{t.unclear} idle connections still open after {seconds:.0f}s")
    return _run_class(dep, work)


def oversized(dep: MockDeployment, body_mb: int = 65) -> Tally:
    """A 1 MiB URL, a 1 MiB header, 100,000 headers, a ``body_mb`` MiB body: each should get 414/431/431/413."""
    cases = [
        ("url", http_request("GET", "/v1/models?x=" + "a" * (1 << 20))),
        ("header", http_request("GET", "/v1/models", headers=[("X-Big", "b" * (1 << 20))])),
        ("header_count", http_request("GET", "/v1/models", headers=[(f"X-{i}", "v") for i in range(100_000)])),
        ("body", http_request("POST", "/v1/completions", b"{" + b" " * (body_mb << 20) + b"}")),
    ]

    def work(t: Tally) -> None:
        for name, raw in cases:
            a = exchange(dep.port, raw, 60.0)
            v = judge(a)
            if v == "unchecked":  # a 200 to an oversized request: the limit is missing
                v = "unclear"
            t.add(v)
            t.notes.append(f"{name}: {a.status if a.status is not None else a.error}")
    return _run_class(dep, work)


def malformed_json(dep: MockDeployment) -> Tally:
    """:func:`malformed_bodies` to ``/v1/completions``: each should get a 400/404 naming the problem."""

    def work(t: Tally) -> None:
        for name, body in malformed_bodies():
            raw = http_request("POST", "/v1/chat/completions" if "text_part" in name else "/v1/completions", body)
            a = exchange(dep.port, raw, 30.0)
            v = judge(a, lambda: dep.reference("POST", raw.split(b" ", 2)[1].decode(), body))
            t.add(v)
            if v != "clear_error":
                t.notes.append(f"{name}: {a.status if a.status is not None else a.error}")
    return _run_class(dep, work)


def fuzzed_requests(dep: MockDeployment, n: int = 10_000, seed: int = 0, workers: int = 8,
                    timeout: float = 10.0) -> Tally:
    """``n`` requests from :func:`fuzz_request` (``workers`` at a time); a 200 to a generation request is compared
    with the decode engine's own answer to the same request (other paths are the router's own: ``unchecked``); no
    answer within ``timeout`` seconds is ``unclear``."""
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(seed)
    reqs = [fuzz_request(rng) for _ in range(n)]
    lock = threading.Lock()
    unclear_examples: list = []

    def one(item, t: Tally) -> None:
        raw, triple = item
        a = exchange(dep.port, raw, timeout)
        gen = triple is not None and triple[0] == "POST" and triple[1] in _PATHS[:2]
        v = judge(a, (lambda: dep.reference(*triple)) if gen else None)  # the router answers the rest itself
        with lock:
            t.add(v)
            if v in ("unclear", "wrong") and len(unclear_examples) < 5:
                unclear_examples.append(f"{v}: {raw[:80]!r} -> {a.status} {a.error} {a.body[:80]!r}")

    def work(t: Tally) -> None:
        with ThreadPoolExecutor(workers) as ex:
            list(ex.map(lambda it: one(it, t), reqs))
        t.notes.extend(unclear_examples)
    return _run_class(dep, work)


# ------------------------------------------------------------------------------------------------ a faulty KV link
class LinkProxy:
    """A TCP forwarder for a KV link (consumer -> proxy -> producer's transport listener) that can stall or drop it.

    ``upstream``: ``(host, port)`` to forward new connections to (set it before the consumer dials). ``arm(at_bytes,
    action)``: once ``at_bytes`` producer->consumer bytes have passed since arming, run ``action()`` once (from the
    forwarding thread; e.g. :meth:`drop`, a stall, killing the producer). ``stall(seconds)``: hold every byte in both
    directions for ``seconds``. ``drop()``: close every forwarded connection (the next dial gets a fresh one).
    ``down_bytes``: producer->consumer bytes forwarded in total.
    """

    def __init__(self, host: str = "127.0.0.1"):
        self.ls = socket.socket()
        self.ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ls.bind((host, 0))
        self.ls.listen(64)
        self.host, self.port = host, self.ls.getsockname()[1]
        self.upstream: Optional[tuple[str, int]] = None
        self.down_bytes = 0
        self._stall_until = 0.0
        self._armed: Optional[tuple[int, Callable[[], None]]] = None
        self._lock = threading.Lock()
        self._conns: list = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, at_bytes: int, action: Callable[[], None]) -> None:
        with self._lock:
            self._armed = (self.down_bytes + int(at_bytes), action)

    def stall(self, seconds: float) -> None:
        self._stall_until = time.monotonic() + seconds

    def drop(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            for fn in (lambda: s.shutdown(socket.SHUT_RDWR), s.close):
                try:
                    fn()
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self.drop()
        try:
            self.ls.shutdown(socket.SHUT_RDWR)  # wakes the accept thread; closing alone does not (Linux)
        except OSError:
            pass
        self.ls.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(self.upstream, timeout=5) if self.upstream else None
            except OSError:
                u = None
            if u is None:
                c.close()
                continue
            u.settimeout(None)
            with self._lock:
                self._conns += [c, u]
            threading.Thread(target=self._pump, args=(c, u, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, True), daemon=True).start()

    def _pump(self, src, dst, down: bool) -> None:
        try:
            while True:
                b = src.recv(1 << 16)
                if not b:
                    break
                while time.monotonic() < self._stall_until and not self._closed:
                    time.sleep(0.01)
                fire = None
                if down:
                    with self._lock:
                        self.down_bytes += len(b)
                        if self._armed is not None and self.down_bytes >= self._armed[0]:
                            fire, self._armed = self._armed[1], None
                dst.sendall(b)
                if fire is not None:
                    fire()
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
