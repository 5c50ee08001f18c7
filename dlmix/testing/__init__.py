"""Test and benchmark helpers shipped with dlmix: free ports, an event loop in a thread, and the mock engine.

* :func:`free_port`, :func:`free_port_block`, :func:`port_free` (from :mod:`dlmix.engine_process`, the one home of
  port helpers);
* :class:`LoopThread`: an asyncio loop (uvloop when installed) in a daemon thread, for synchronous tests driving
  asyncio servers;
* :class:`RouterThread`: the dlmix router started in-process on its own :class:`LoopThread`;
* :func:`compare_greedy`: greedy token ids against a reference, near-ties (small top-2 gaps) counted, any other
  divergence fails; :func:`output_logprobs`: the output tokens and top-2 gaps of an OpenAI response;
* :func:`wait_http`: poll a URL until it answers 200; :func:`poll` / :func:`wait_until`: poll any condition with a
  (generous) deadline;
* :class:`JsonStandIn`: a stand-in HTTP server answering JSON from a function (an engine's routes, for tests of the
  code that calls them);
* :class:`~dlmix.testing.mock_engine.MockEngine`: the one mock OpenAI engine (vLLM's API, PD legs, KV events,
  Prometheus counters, fixed fast answers for router benchmarks);
* :mod:`dlmix.testing.cpu_gemm`: bf16/fp16 products in fp32 where the CPU has no native kernel for them (the
  LMDeploy and SGLang CPU aids).
"""
from __future__ import annotations

import asyncio
import threading
import time

from dlmix.engine_process import free_port, free_port_block, port_free

__all__ = ["free_port", "free_port_block", "port_free", "LoopThread", "RouterThread", "JsonStandIn", "wait_http", "poll",
           "wait_until", "MockEngine", "compare_greedy", "output_logprobs", "fill_tokens",
           "hold_and_pull", "side_by_side", "pd_router", "fleet_router", "stop_all", "read_http_request",
           "raw_server"]


class LoopThread:
    """An asyncio event loop (uvloop if available and ``use_uvloop``) running in a daemon thread.

    ``run(coro, timeout)`` runs a coroutine on it and returns its result (raises its exception, or TimeoutError after
    ``timeout`` seconds); ``call(fn, *a)`` runs a plain function on the loop thread; ``close()`` stops the loop.
    """

    def __init__(self, use_uvloop: bool = True):
        self.loop = None
        if use_uvloop:
            try:
                import uvloop

                self.loop = uvloop.new_event_loop()
            except ImportError:  # pragma: no cover
                pass
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        """Run ``coro`` on the loop; wait at most ``timeout`` seconds for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *a):
        """Run a plain function on the loop thread and return its result."""
        async def _c():
            return fn(*a)
        return self.run(_c())

    def close(self) -> None:
        """Stop the loop and join the thread (5 s at most)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


async def read_http_request(reader: asyncio.StreamReader) -> bytes:
    """Read one HTTP/1.1 request (head, then a ``content-length`` body) from ``reader``; returns the head bytes.
    Raises ``asyncio.IncompleteReadError`` when the peer closes. For hand-written broken or hostile backends."""
    head = await reader.readuntil(b"\r\n\r\n")
    n = next((int(ln.split(b":")[1]) for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length:")), 0)
    await reader.readexactly(n)
    return head


async def raw_server(conn) -> tuple:
    """An asyncio server running ``conn(reader, writer)`` on a free loopback port: ``(server, port)``."""
    srv = await asyncio.start_server(conn, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


class JsonStandIn:
    """A stand-in HTTP server on 127.0.0.1 (a free port, daemon threads) for tests of code that calls an engine's
    routes: ``route(method, path, body) -> (status, answer)`` answers every request, ``body`` being the decoded JSON of
    a POST (None for a GET or an empty body) and ``answer`` any JSON value; each request is recorded in ``calls`` as
    ``(path, body)``. ``url`` is its base URL; ``close()`` stops it."""

    def __init__(self, route):
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.calls: list = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _serve(self, method: str) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                stand_in.calls.append((self.path, body))
                status, answer = route(method, self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop serving and close the socket."""
        self.srv.shutdown()
        self.srv.server_close()


#: environment of engine servers sharing a few cores in tests: unpinned, one OpenMP thread each, passive waits (a
#: pinned engine spinning next to a KV transfer starved it)
SHARED_CORES_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def stop_all(servers) -> None:
    """Stop every server of ``servers`` (objects with a blocking ``stop()``: engine server children, routers) at the
    same time, one thread each, and return when all have stopped; the first exception any ``stop()`` raised is raised
    then. An engine's shutdown is mostly waiting (its processes exit, its ports close), so a fixture with several
    servers is torn down in about the time of the slowest one instead of their sum."""
    import concurrent.futures as cf

    servers = list(servers)
    if not servers:
        return
    with cf.ThreadPoolExecutor(max_workers=len(servers)) as ex:
        futures = [ex.submit(s.stop) for s in servers]
    for f in futures:
        f.result()


def pd_router(model_spec: str, prefill: dict, decode: dict, policy: str = "prefix") -> "RouterThread":
    """A :class:`RouterThread` on a free loopback port with one prefill and one decode instance registered through
    the admin API (``prefill``/``decode``: registration bodies without ``role``; ``model`` defaults to ``smollm2``,
    ``heartbeat_ttl_s`` to 0). The ``prefix`` policy always disaggregates. Raises AssertionError when a
    registration is refused (with the router's answer)."""
    return fleet_router(model_spec, [dict(prefill, role="prefill"), dict(decode, role="decode")], policy)


def fleet_router(model_spec: str, instances: list, policy: str = "prefix", **cfg) -> "RouterThread":
    """A :class:`RouterThread` on a free loopback port with ``instances`` (registration bodies with ``role``; ``model``
    defaults to ``smollm2``, ``heartbeat_ttl_s`` to 0) registered through the admin API in order; ``cfg``: more
    ``RouterConfig`` fields (e.g. ``allow_pinning=True``). Raises AssertionError when a registration is refused (with
    the router's answer)."""
    import httpx

    from dlmix.router.config import RouterConfig

    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy=policy, model_spec=model_spec, **cfg))
    try:
        with httpx.Client(base_url=rt.url, timeout=30, trust_env=False) as c:
            for body in instances:
                r = c.post("/admin/instances", json={"model": "smollm2", "heartbeat_ttl_s": 0, **body})
                assert r.status_code in (200, 201), r.text
    except BaseException:
        rt.close()
        raise
    return rt


class RouterThread:
    """A :class:`dlmix.router.server.Router` built from ``cfg`` (a ``RouterConfig``) and started on its own
    :class:`LoopThread`, for synchronous tests that also read the router's state. ``url`` is its base URL (the port
    the router bound, so ``port=0`` works); ``call(fn)`` runs ``fn()`` on the router's loop (its index and policy
    are not thread-safe); ``close()`` stops the router, then the loop. Raises what ``Router``/``start`` raise."""

    def __init__(self, cfg, start_timeout_s: float = 120.0):
        from dlmix.router.server import Router

        self.lt = LoopThread(use_uvloop=False)
        try:
            self.router = self.call(lambda: Router(cfg), start_timeout_s)
            self.lt.run(self.router.start(), start_timeout_s)
        except BaseException:
            self.lt.close()
            raise
        self.url = f"http://127.0.0.1:{self.router.cfg.port}"

    def call(self, fn, timeout_s: float = 120.0):
        """Run ``fn()`` on the router's loop thread and return its result (TimeoutError after ``timeout_s``)."""
        async def _c():
            return fn()
        return self.lt.run(_c(), timeout_s)

    def close(self) -> None:
        """Stop the router (30 s at most), then its loop."""
        try:
            self.lt.run(self.router.stop(), 30)
        finally:
            self.lt.close()


def fill_tokens(layout, caches, block_ids, n: int, seed: int = 0) -> dict:
    """Write random K/V for tokens ``0..n-1`` of every layer into ``caches`` (blocks ``block_ids``, token order)
    with :func:`dlmix.kv.ops.write_kv`; returns ``{(token, layer): (k, v)}`` (each ``[local heads, head_size]`` in
    the layout's dtype), the reference a test compares a transfer's destination with."""
    import torch

    from dlmix.kv.ops import torch_dtype, write_kv

    g = torch.Generator().manual_seed(seed)
    ref = {}
    for t in range(n):
        for layer in range(layout.model.num_layers):
            k = torch.randn(layout.num_local_heads, layout.model.head_size, generator=g).to(torch_dtype(layout))
            v = torch.randn(layout.num_local_heads, layout.model.head_size, generator=g).to(torch_dtype(layout))
            write_kv(layout, caches, block_ids, t, layer, k, v)
            ref[(t, layer)] = (k, v)
    return ref


def hold_and_pull(producer, consumer, src, dst, src_blocks, dst_blocks, n: int, start: int):
    """One request through two :class:`dlmix.pd.endpoint.KVEndpoint` s: the producer holds tokens ``0..n-1`` of
    request ``"req"`` in ``src_blocks`` (layout ``src``), the consumer claims the tokens beyond its own prefix of
    ``start`` tokens (asserted: ``[start, n)``) and pulls them into ``dst_blocks`` (layout ``dst``); returns the
    :class:`dlmix.pd.consumer.PullResult`."""
    from dlmix.pd.consumer import claim
    from dlmix.pd.contract import TransferParams, prompt_digest

    digest = prompt_digest(range(n))
    params = TransferParams.make(engine="reference", instance_id="p0", transports=[producer.descriptor()],
                                 request_id="req", block_ids=src_blocks, num_tokens=n, layout=src, digest=digest)
    producer.add_hold("req", src_blocks, n, digest)
    c = claim(params.to_dict(), dst, n + 1, start, prompt_token_ids=list(range(n + 1)))
    assert (c.start, c.end) == (start, n)
    return consumer.pull_params(c.params, c.start, c.end, dst_blocks, digest=digest)


def spread_lengths(n: int, lo: int = 10, hi: int = 1000, shuffle=None) -> list[int]:
    """``n`` prompt lengths in tokens from ``lo`` to ``hi``, both ends included, in geometric steps (each about the
    same ratio above the one before; 20 from 10 to 1,000: 10, 13, 16, 21, ..., 616, 785, 1000). Short, middle and
    long prompts each get a share of the set (every decade of lengths as many prompts), and the whole set costs
    about 230 prompt tokens a prompt to prefill, against 505 for lengths spread evenly: the PD end-to-end tests
    prefill every prompt twice (the pair, the single reference) on two CPU cores. Lengths stay strictly increasing
    (a step below one token becomes one). With ``shuffle`` (a ``random.Random``), ``lo`` and ``hi`` come first and the
    lengths between follow in the order ``shuffle.shuffle`` gives them. Raises ValueError unless ``n >= 2`` and
    ``0 < lo < hi``."""
    if n < 2 or not 0 < lo < hi:
        raise ValueError(f"spread_lengths needs n >= 2 and 0 < lo < hi, got n={n}, lo={lo}, hi={hi}")
    out: list[int] = []
    for i in range(n):
        x = max(round(lo * (hi / lo) ** (i / (n - 1))), out[-1] + 1 if out else lo)
        out.append(x)
    if out[-1] != hi:
        raise ValueError(f"{n} strictly increasing lengths do not fit between {lo} and {hi}")
    if shuffle is not None:
        middle = out[1:-1]
        shuffle.shuffle(middle)
        out = [lo, hi] + middle
    return out


def side_by_side(items, run, reference) -> list[tuple]:
    """``[(run(x), reference(x)) for x in items]``, with the references computed in order in one background thread
    while this thread runs ``run`` over the items: a PD pair under test and the single reference instance are other
    processes, so both cores work instead of one waiting for the other. Results keep the items' order; an exception
    from either side propagates (the references not yet started are cancelled)."""
    from concurrent.futures import ThreadPoolExecutor

    items = list(items)
    ex = ThreadPoolExecutor(1, thread_name_prefix="reference")
    try:
        refs = [ex.submit(reference, x) for x in items]
        got = [run(x) for x in items]
        return [(g, f.result()) for g, f in zip(got, refs)]
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def poll(cond, timeout_s: float = 120.0, interval_s: float = 0.05):
    """Call ``cond()`` every ``interval_s`` seconds until it returns a true value or ``timeout_s`` seconds passed;
    returns its last value (falsy on timeout). A deadline only bounds the wait: keep it generous, tests run on
    loaded CI machines."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval_s)


def wait_until(cond, timeout_s: float = 120.0, what: str = "condition", interval_s: float = 0.05):
    """:func:`poll`, raising AssertionError naming ``what`` when ``cond()`` is still false after ``timeout_s``."""
    v = poll(cond, timeout_s, interval_s)
    if not v:
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
    return v


def wait_http(url: str, timeout: float = 30.0, interval: float = 0.2) -> bool:
    """Poll ``GET url`` until it answers 200 (True) or ``timeout`` seconds pass (False)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    return False


def __getattr__(name):  # MockEngine imports the router's HTTP layer: load it only when asked for
    if name == "MockEngine":
        from dlmix.testing.mock_engine import MockEngine

        return MockEngine
    raise AttributeError(f"module 'dlmix.testing' has no attribute {name!r}")


def output_logprobs(choice: dict) -> tuple[list[str], list[float]]:
    """Output tokens (strings) and, per token, the gap between the top-1 and top-2 logprob (nats; inf when fewer than
    two are given) of one OpenAI response choice with logprobs, chat (``logprobs.content``) or completion
    (``logprobs.tokens`` / ``top_logprobs``) format. Empty lists when the choice has no logprobs."""
    lp = choice.get("logprobs") or {}
    toks: list[str] = []
    gaps: list[float] = []
    if "content" in lp:
        for c in lp["content"] or []:
            toks.append(c["token"])
            v = sorted((t["logprob"] for t in c.get("top_logprobs") or []), reverse=True)
            gaps.append(v[0] - v[1] if len(v) > 1 else float("inf"))
    else:
        toks = list(lp.get("tokens") or [])
        for top in lp.get("top_logprobs") or []:
            v = sorted((top or {}).values(), reverse=True)
            gaps.append(v[0] - v[1] if len(v) > 1 else float("inf"))
    return toks, gaps


def compare_greedy(case: str, got: dict, refs: dict, threshold: float, max_tokens: int) -> tuple[int, int]:
    """Compare greedy outputs with references, prompt by prompt. ``got``: ``{i: generated ids}``; ``refs``:
    ``{i: (ids, top-1/top-2 logprob gaps)}`` (e.g. from ``dlmix_vllm.testing.result_tokens``). Each has 1 to
    ``max_tokens`` ids (fewer when the model stopped at its end-of-text token, which a short chat prompt may reach
    within the budget): equal ids are identical. A first divergence (or the end of the shorter one, when one output is
    a prefix of the other) at a position whose reference gap is below ``threshold`` (nats) is a near-tie (printed
    and counted); any other divergence fails (AssertionError naming the prompt, position and gap). Returns
    (identical, near_ties)."""
    same = ties = 0
    for i, ids in got.items():
        ref, gaps = refs[i]
        assert 0 < len(ids) <= max_tokens and 0 < len(ref) <= max_tokens, (case, i, ids, ref)
        if ids == ref:
            same += 1
            continue
        n = min(len(ids), len(ref))
        k = next((j for j in range(n) if ids[j] != ref[j]), n)
        gap = gaps[k] if k < len(gaps) else float("inf")
        assert gap < threshold, f"{case}: prompt {i} differs at token {k} with top-2 gap {gap:.4f} >= {threshold}"
        ties += 1
        print(f"[{case}] prompt {i}: near-tie at token {k} (top-2 gap {gap:.4f})")
    print(f"[{case}] identical {same}/{len(got)}, near-ties {ties} (threshold {threshold} nats)")
    return same, ties
