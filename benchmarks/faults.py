"""The fault campaign: hostile clients, fuzzed requests and frames, the PD fault matrix on real vLLM CPU and LMDeploy.

Classes (each reports ``tried``, ``ok`` (greedy output equal to a single instance; ``near_ties`` counted apart),
``clear_error``, ``unclear``, ``wrong`` (must be 0), ``unchecked``, ``held_after`` (must be 0), ``crashes`` (must be
0) and ``worst_healthy_wait_s``: the longest one answer took for a healthy client running beside the faulty ones):

* mock engines behind ``dlmix router`` (:class:`dlmix.testing.faults.MockDeployment`): ``one_byte_chunks``,
  ``slowloris``, ``idle_connections`` (2,000), ``oversized`` (URL, header, header count, body), ``malformed_json``,
  ``fuzzed_requests`` (10,000);
  ``held_after`` = requests still running on the engines.
* the built-in TCP KV transport: ``fuzzed_frames`` (10,000 hostile frames from
  :func:`dlmix_kv_connectors.testing.fuzz_frame` at a peer process with a granted region); ``wrong`` = the region's
  bytes changed or a healthy read returned other bytes; ``clear_error`` = frames the endpoint counted as protocol
  errors or refused operations.
* a real vLLM CPU prefill/decode pair (SmolLM2-135M fp32, DLMixConnector, prefill pinned to core 0, decode to core 1,
  the decode's KV link through :class:`dlmix.testing.faults.LinkProxy`; the PD client is the two-step client of
  ``dlmix_vllm.testing``): ``pd_baseline``, ``kv_link_stall`` (shorter and longer than the decode's io timeout),
  ``kv_link_drop``, ``client_abort_prefill`` / ``client_abort_transfer`` / ``client_abort_decode`` (each followed by
  the same request, which must be right), ``decode_kv_exhausted`` (8 concurrent 1,000-token requests, 6 x 600 with
  ``--quick``, against a ~2,900-token KV cache on both sides), ``kill_prefill_mid_transfer``, ``kill_decode_mid_stream`` and
  ``restart_same_address`` (both engines restarted on their ports). ``held_after``: KV blocks in use on both
  instances once idle (vLLM's ``kv_cache_usage_perc`` times the cache's blocks); references are the decode instance
  serving the same prompt alone after a prefix-cache reset. The healthy PD client shares the KV link; it pauses while a
  fault is armed on the link's byte count (drop, kill, client abort mid-transfer), so the fault hits the class's own
  transfer; a stall hits everyone on the link, the healthy client included.
* a real LMDeploy 0.18 CPU prefill/decode pair behind the dlmix router (when ``scripts/setup_lmdeploy.sh`` built its
  venv; :class:`dlmix_lmdeploy.testing.RoutedPair`: bf16/block-16 prefill of 96 blocks, fp16/block-64 decode of 32,
  DLMix backend, both registered with the router by their own hook): ``lmd_baseline``, ``lmd_prefill_pool_exhausted``
  (6 prompts of ~2,100 tokens together for the prefill's 1,536), ``lmd_decode_kv_exhausted`` (6 x 450 for the decode's
  2,048), ``lmd_client_abort_prefill`` / ``lmd_client_abort_decode`` (each followed by the same request, which must be
  right), ``lmd_decode_leg_refused`` (a decode leg the decode answers 400), ``lmd_kill_prefill`` (SIGKILL with 6
  requests in flight) and ``lmd_restart_same_address`` (the prefill restarted on its port). References are the same
  request through the same deployment with nothing else running; ``held_after``: blocks in use beyond the idle
  allowance on both engines, from LMDeploy's own block manager as heartbeated.

    flock /tmp/dlmix-heavy.lock python benchmarks/faults.py [--quick] [--no-vllm] [--no-lmdeploy] [--only CLASS,...]

``--quick``: smaller hostile sizes and 1-2 requests per PD class (the 10,000 fuzzed requests and frames stay).
Prints progress to stderr and ONE JSON object on the last stdout line: ``{"classes": {name: tally}, "totals":
{...}, "seconds": s}``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dlmix.testing.faults import (  # noqa: E402
    LinkProxy,
    MockDeployment,
    idle_connections,
    Tally,
    fuzzed_requests,
    malformed_json,
    one_byte_chunks,
    oversized,
    slowloris,
)

MAX_TOKENS = 12
PD_CLASSES = {"pd_baseline", "kv_link_stall", "kv_link_drop", "client_abort_prefill", "client_abort_transfer",
              "client_abort_decode", "decode_kv_exhausted", "kill_prefill_mid_transfer", "kill_decode_mid_stream",
              "restart_same_address"}
LMD_CLASSES = {"lmd_baseline", "lmd_prefill_pool_exhausted", "lmd_decode_kv_exhausted", "lmd_client_abort_prefill",
               "lmd_client_abort_decode", "lmd_decode_leg_refused", "lmd_kill_prefill", "lmd_restart_same_address"}
NEAR_TIE = 0.5  # nats: a first divergence where the reference's top-1/top-2 gap is smaller counts as a near-tie


#: engine stops run when a signal ends the campaign early (the engines live in their own process groups)
_CLEANUP: list = []


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ mock engines
def mock_classes(quick: bool, only: set) -> dict:
    out = {}
    runs = [("one_byte_chunks", lambda d: one_byte_chunks(d, kib=64 if quick else 176)),
            ("slowloris", lambda d: slowloris(d, clients=50, seconds=15.0 if quick else 70.0)),
            ("idle_connections", lambda d: idle_connections(d, n=2000, seconds=10.0 if quick else 70.0)),
            ("oversized", lambda d: oversized(d, body_mb=65)),
            ("malformed_json", malformed_json),
            ("fuzzed_requests", lambda d: fuzzed_requests(d, n=10_000, seed=1))]
    with MockDeployment() as dep:
        _CLEANUP.append(dep.stop)
        for name, fn in runs:
            if only and name not in only:
                continue
            t0 = time.monotonic()
            out[name] = fn(dep).to_dict()
            log(f"[faults] {name}: {time.monotonic() - t0:.1f}s {json.dumps(out[name])[:400]}")
    return out


# ------------------------------------------------------------------------------------------------ transport frames
def frame_class(n: int = 10_000) -> dict:
    import numpy as np

    from dlmix_kv_connectors import Segment, make_transport
    from dlmix_kv_connectors.testing import PeerProcess, fuzz_frame, pattern, raw_auth, sha

    secret, size = "faults-secret", 1 << 20
    t = Tally()
    err = os.dup(2)  # the peer logs every hostile connection it closes: keep that out of the campaign's output
    with open(os.devnull, "wb") as dn:
        os.dup2(dn.fileno(), 2)
        try:
            p = PeerProcess("tcp", "remote", secret)
        finally:
            os.dup2(err, 2)
            os.close(err)
    local = make_transport("tcp", name="local", secret=secret)
    try:
        p.call("region", name="kv", size=size, seed=21)
        dst = np.zeros(size, dtype=np.uint8)
        local.register("kv", dst)
        local.connect(p.desc)
        p.call("grant", peer="local", tid="t", ranges=[["kv", 0, size]], mode="r")
        p.call("grant", peer="fuzzer", tid="fz", ranges=[["kv", 0, 4096]], mode="r")
        want = sha(pattern(size, 21))
        stop, worst, bad = threading.Event(), [0.0], [0]

        def healthy():
            while not stop.is_set():
                dst[:] = 0
                t0 = time.monotonic()
                try:
                    local.read("remote", [Segment("kv", 0, "kv", 0, size)], "t").result(60)
                    if sha(dst) != want:
                        bad[0] += 1
                except Exception:
                    bad[0] += 1
                worst[0] = max(worst[0], time.monotonic() - t0)
                stop.wait(0.02)

        th = threading.Thread(target=healthy, daemon=True)
        th.start()
        host, port = p.desc["host"], p.desc["port"]
        rng = random.Random(4321)
        sent = 0
        while sent < n // 2:  # unauthenticated garbage, one frame per connection
            try:
                with socket.create_connection((host, port), timeout=5) as s:
                    s.sendall(fuzz_frame(rng))
            except OSError:
                pass
            sent += 1
        while sent < n:  # authenticated, then hostile frames until the endpoint hangs up
            try:
                s = raw_auth(host, port, "fuzzer", secret)
            except (OSError, AssertionError):
                sent += 1
                continue
            try:
                for _ in range(min(8, n - sent)):
                    sent += 1
                    s.sendall(fuzz_frame(rng))
            except OSError:
                pass
            finally:
                s.close()
        stop.set()
        th.join(60)
        t.tried = sent
        alive = p.proc.poll() is None
        t.crashes = 0 if alive else 1
        if alive:
            st = p.call("stats")["stats"]
            t.clear_error = int(st.get("protocol_errors", 0)) + int(st.get("refused_ops", 0))
            if p.call("sha", name="kv", off=0, len=size)["sha"] != want:
                t.wrong += 1
                t.notes.append("the peer's region changed")
            t.notes.append(f"endpoint stats: protocol_errors {st.get('protocol_errors')}, refused_ops "
                           f"{st.get('refused_ops')}")
        t.wrong += bad[0]
        t.worst_healthy_wait_s = worst[0]
    finally:
        local.close()
        p.close()
    return t.to_dict()


# ------------------------------------------------------------------------------------------------ real vLLM PD
class PD:
    """A vLLM CPU prefill/decode pair with the decode's KV link through a :class:`LinkProxy`."""

    def __init__(self, workdir: str, model: str):
        from dlmix_vllm import testing as T

        self.T, self.dir, self.model = T, workdir, model
        self.proxy = LinkProxy()
        self.P = self.D = None
        self.gen = 0

    def launch(self, which: str, port=None):
        T = self.T
        self.gen += 1
        if which == "P":
            self.P = T.launch(f"P{self.gen}", self.model, self.dir_path, role="kv_producer", cpu="0", dtype="float32",
                              port=port, extra={"hold_timeout_s": 20, "io_timeout_s": 10})
            return self.P
        self.D = T.launch(f"D{self.gen}", self.model, self.dir_path, role="kv_consumer", cpu="1", dtype="float32",
                          port=port, extra={"io_timeout_s": 10, "connect_timeout_s": 3})
        return self.D

    @property
    def dir_path(self):
        from pathlib import Path

        return Path(self.dir)

    def start(self) -> "PD":
        _CLEANUP.append(lambda: [s.kill(signal.SIGKILL) for s in (self.P, self.D) if s is not None])
        self.launch("P")
        self.launch("D")
        self.T.wait_ready([self.P, self.D], timeout_s=600)
        return self

    def stop(self) -> None:
        for s in (self.P, self.D):
            if s is not None:
                s.stop()
        self.proxy.close()

    # --------------------------------------------------------------------------------------------- requests
    def reference(self, prompt) -> tuple:
        T = self.T
        T.reset_prefix_cache(self.D.url)
        r = T.single(self.D.url, "completion", prompt, MAX_TOKENS)
        T.reset_prefix_cache(self.D.url)
        return T.result_tokens(r)

    def prefill(self, prompt, timeout: float = 300.0) -> dict:
        import httpx

        path, body = self.T.request_body("completion", prompt, 1, ktp={"do_remote_decode": True})
        with httpx.Client(timeout=timeout) as c:
            r = c.post(self.P.url + path, json=body)
        r.raise_for_status()
        params = r.json()["kv_transfer_params"]
        tr = params["remote_transports"][0]
        self.proxy.upstream = (tr["host"], tr["port"])
        params["remote_transports"] = [dict(tr, port=self.proxy.port)] + params["remote_transports"][1:]
        return params

    def decode(self, prompt, params, stream: bool = False, timeout: float = 300.0) -> dict:
        import httpx

        path, body = self.T.request_body("completion", prompt, MAX_TOKENS, stream=stream, ktp=params)
        with httpx.Client(timeout=timeout) as c:
            return self.T._post(c, self.D.url + path, body)

    def two_step(self, prompt, stream: bool = False, timeout: float = 300.0) -> dict:
        return self.decode(prompt, self.prefill(prompt, timeout), stream, timeout)

    def held_blocks(self) -> int:
        """KV blocks in use on both instances (0 when idle and nothing is held)."""
        T, total = self.T, 0
        for s in (self.P, self.D):
            if s is None or not s.alive():
                continue
            usage = T.kv_usage(s.url)
            if usage > 0:
                nb = 0
                for line in __import__("httpx").get(s.url + "/metrics", timeout=10).text.splitlines():
                    if line.startswith("vllm:cache_config_info") and 'num_gpu_blocks="' in line:
                        nb = int(line.split('num_gpu_blocks="')[1].split('"')[0])
                total += max(1, round(usage * nb))
        return total

    def settle(self, timeout: float = 40.0) -> int:
        deadline = time.monotonic() + timeout
        held = self.held_blocks()
        while held and time.monotonic() < deadline:
            time.sleep(1.0)
            held = self.held_blocks()
        return held


def _verdict(got_ids: list, ref: tuple) -> str:
    ids, gaps = ref
    if got_ids == ids:
        return "ok"
    if len(got_ids) != len(ids):
        return "wrong"
    k = next(j for j in range(len(ids)) if got_ids[j] != ids[j])
    return "near_ties" if k < len(gaps) and gaps[k] < NEAR_TIE else "wrong"


def _prompt(rng: random.Random, n: int) -> list:
    return [rng.randrange(200, 40000) for _ in range(n)]


class _Healthy:
    """A healthy PD client beside the faults: short prompts (fresh each time), worst wait, wrong answers."""

    def __init__(self, pd: PD, refs: list, gap_s: float = 0.3):
        self.pd, self.refs, self.gap_s = pd, refs, gap_s
        self.worst, self.bad, self.n = 0.0, 0, 0
        self._stop = threading.Event()
        self._pause = threading.Event()
        self._busy = threading.Lock()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        i = 0
        while not self._stop.is_set():
            prompt, ref = self.refs[i % len(self.refs)]
            i += 1
            with self._busy:
                if self._pause.is_set():
                    pass
                else:
                    t0 = time.monotonic()
                    try:
                        r = self.pd.two_step(prompt, timeout=60.0)
                        if _verdict(self.pd.T.result_tokens(r)[0], ref) == "wrong":
                            self.bad += 1
                    except Exception:
                        pass  # a fault class may take an engine away on purpose; only wrong answers count
                    self.worst = max(self.worst, time.monotonic() - t0)
                    self.n += 1
            self._stop.wait(self.gap_s)

    class _Paused:
        def __init__(self, h):
            self.h = h

        def __enter__(self):
            self.h._pause.set()
            with self.h._busy:  # its request in flight ends first
                pass

        def __exit__(self, *exc):
            self.h._pause.clear()

    def paused(self):
        """While a fault is armed on the shared KV link, the healthy client waits, so the fault hits the class's own
        transfer (the link proxy counts every transfer's bytes)."""
        return self._Paused(self)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(400)


def pd_classes(quick: bool, only: set, out: dict) -> dict:
    from dlmix.models import prepare

    model = str(prepare("smollm2"))
    wd = tempfile.mkdtemp(prefix="dlmix-faults-pd-")
    rng = random.Random(7)
    pd = PD(wd, model).start()
    per = 1 if quick else 3
    try:
        healthy = [(p, pd.reference(p)) for p in (_prompt(rng, 40), _prompt(rng, 60))]

        state: dict = {}

        def run(name, body):
            if only and name not in only:
                return
            t = Tally()
            t0 = time.monotonic()
            with _Healthy(pd, healthy, 1.0 if quick else 0.3) as h:
                state["healthy"] = h
                try:
                    body(t)
                except Exception as e:  # the class itself failed: say so, keep going
                    t.notes.append(f"class aborted: {type(e).__name__}: {e}"[:300])
            t.worst_healthy_wait_s = h.worst
            if h.bad:
                t.wrong += h.bad
                t.notes.append(f"healthy client: {h.bad} wrong answers of {h.n}")
            for s, which in ((pd.P, "P"), (pd.D, "D")):
                if not s.alive() and name not in ("kill_prefill_mid_transfer", "kill_decode_mid_stream"):
                    t.crashes += 1
                    t.notes.append(f"{which} exited: {s.tail(5)[-300:]}")
            t.held_after = pd.settle()
            out[name] = t.to_dict()
            log(f"[faults] {name}: {time.monotonic() - t0:.1f}s {json.dumps(out[name])[:400]}")

        def judged(t, prompt, ref, fn):
            try:
                r = fn()
                t.add(_verdict(pd.T.result_tokens(r)[0], ref))
            except Exception as e:
                t.add("clear_error" if "HTTP" in str(e) else "unclear")
                t.notes.append(f"{type(e).__name__}: {str(e)[:150]}")

        long_n = 800 if quick else 1500  # tokens of a prompt whose transfer a fault interrupts (~37/69 MB fp32)

        def fresh(n_tokens=600 if quick else 1000):
            p = _prompt(rng, n_tokens)
            return p, pd.reference(p)

        def baseline(t):
            for _ in range(per + 1):
                p, ref = fresh()
                judged(t, p, ref, lambda: pd.two_step(p))
        run("pd_baseline", baseline)

        def stall(t):  # the whole link stalls as the decode starts: the healthy client's transfers wait too
            for secs in (3.0, 14.0):  # shorter, then longer than the decode's io_timeout_s (10)
                p, ref = fresh(long_n)

                def go(p=p, secs=secs):
                    params = pd.prefill(p)
                    pd.proxy.stall(secs)
                    return pd.decode(p, params)
                judged(t, p, ref, go)
        run("kv_link_stall", stall)

        def drop(t):
            for _ in range(per):
                p, ref = fresh(long_n)
                with state["healthy"].paused():
                    pd.proxy.arm(256 << 10, pd.proxy.drop)
                    judged(t, p, ref, lambda: pd.two_step(p))
        run("kv_link_drop", drop)

        def abort_prefill(t):
            import httpx

            for _ in range(per):
                p, ref = fresh(long_n)
                path, body = pd.T.request_body("completion", p, 1, ktp={"do_remote_decode": True})
                try:
                    httpx.post(pd.P.url + path, json=body, timeout=0.3)
                except httpx.TimeoutException:
                    pass  # the client gave up mid-prefill
                time.sleep(1.0)
                judged(t, p, ref, lambda: pd.two_step(p))
        run("client_abort_prefill", abort_prefill)

        def abort_transfer(t):
            for _ in range(per):
                p, ref = fresh(long_n)
                params = pd.prefill(p)
                path, body = pd.T.request_body("completion", p, MAX_TOKENS, ktp=params)
                raw = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Content-Length: %d\r\n\r\n").encode()
                data = json.dumps(body).encode()
                with state["healthy"].paused():
                    s = socket.create_connection(("127.0.0.1", pd.D.port), timeout=60)
                    done = threading.Event()
                    pd.proxy.arm(256 << 10, lambda: (s.close(), done.set()))  # the client leaves mid-transfer
                    s.sendall(raw % len(data) + data)
                    done.wait(60)
                    time.sleep(1.0)
                judged(t, p, ref, lambda: pd.two_step(p))
        run("client_abort_transfer", abort_transfer)

        def abort_decode(t):
            import httpx

            for _ in range(per):
                p, ref = fresh(600)
                params = pd.prefill(p)
                path, body = pd.T.request_body("completion", p, MAX_TOKENS, stream=True, ktp=params)
                with httpx.Client(timeout=120) as c, c.stream("POST", pd.D.url + path, json=body) as r:
                    for i, _ in enumerate(r.iter_lines()):
                        if i >= 2:
                            break  # the client leaves mid-stream
                time.sleep(1.0)
                judged(t, p, ref, lambda: pd.two_step(p))
        run("client_abort_decode", abort_decode)

        def exhaust(t):
            from concurrent.futures import ThreadPoolExecutor

            # 6 x 600 (quick) or 8 x 1000 tokens at once: more than either instance's ~2,900-token KV cache
            items = [fresh(600) for _ in range(6)] if quick else [fresh(1000) for _ in range(8)]
            with ThreadPoolExecutor(len(items)) as ex:
                futs = [ex.submit(pd.two_step, p) for p, _ in items]
                for f, (p, ref) in zip(futs, items):
                    judged(t, p, ref, f.result)
        run("decode_kv_exhausted", exhaust)

        def kill_prefill(t):
            p, ref = fresh(long_n)
            port = pd.P.port
            with state["healthy"].paused():
                pd.proxy.arm(256 << 10, lambda: pd.P.kill(signal.SIGKILL))
                judged(t, p, ref, lambda: pd.two_step(p))
            t.notes.append(f"prefill alive after the kill: {pd.P.alive()}")
            pd.T.wait_ready([pd.launch("P", port=port)], timeout_s=600)
        run("kill_prefill_mid_transfer", kill_prefill)

        def kill_decode(t):
            import httpx

            p, ref = fresh(600)
            params = pd.prefill(p)
            path, body = pd.T.request_body("completion", p, MAX_TOKENS, stream=True, ktp=params)
            port = pd.D.port
            ended = "no answer"
            try:
                with httpx.Client(timeout=120) as c, c.stream("POST", pd.D.url + path, json=body) as r:
                    lines = []
                    for i, line in enumerate(r.iter_lines()):
                        lines.append(line)
                        if i == 2:
                            pd.D.kill(signal.SIGKILL)
                    ended = "[DONE]" if any("[DONE]" in x for x in lines) else "cut without [DONE]"
            except httpx.HTTPError as e:
                ended = f"{type(e).__name__}"
            t.add("ok" if ended == "[DONE]" else "unclear")
            t.notes.append(f"killed decode: the client's stream {ended} (a direct client has nobody to tell it)")
            pd.T.wait_ready([pd.launch("D", port=port)], timeout_s=600)
        run("kill_decode_mid_stream", kill_decode)

        def restart(t):  # both engines were restarted on their ports by the two classes before
            for _ in range(per + 1):
                p, ref = fresh()
                judged(t, p, ref, lambda: pd.two_step(p))
        run("restart_same_address", restart)
    finally:
        pd.stop()
    return out


_WORDS = ("river mountain quiet engine market yellow window garden silver theory station winter bridge signal harvest "
          "lantern ocean pocket rhythm castle meadow copper thunder village orbit canvas planet ribbon").split()


def _words(rng: random.Random, n: int) -> str:
    """``n`` words repeating a random cycle of 4 to 7 words: the continuation is the cycle, with a wide margin
    between the model's first and second choice. Prompts of independent random words leave SmolLM2's next-token
    distribution flat, and there LMDeploy's bf16 CPU kernels alone change greedy answers with the batch they run
    in (measured here: a single bf16 instance, no PD, answered 3 of 6 such prompts differently when they ran
    together than one at a time), which would hide what a fault does."""
    cycle = rng.sample(_WORDS, rng.randint(4, 7))
    return f"Story {rng.randrange(10_000)}: " + " ".join(cycle[k % len(cycle)] for k in range(n))


def lmdeploy_classes(quick: bool, only: set, out: dict) -> dict:
    """The PD fault matrix on a real LMDeploy pair behind the dlmix router (:class:`dlmix_lmdeploy.testing.RoutedPair`:
    bf16/block-16 prefill of 96 blocks, fp16/block-64 decode of 32 blocks, DLMix backend, hold timeout 600 s).
    References are the same request through the same deployment with nothing else running: a fault must not change
    an answer. ``held_after``: blocks in use beyond the idle allowance on both engines once settled."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from dlmix.models import prepare
    from dlmix_lmdeploy import testing as LT

    model = str(prepare("smollm2"))
    rng = random.Random(11)
    per = 1 if quick else 3
    pair = LT.RoutedPair(model, tempfile.mkdtemp(prefix="dlmix-faults-lmdeploy-"))
    _CLEANUP.append(pair.stop)
    pair.start()

    def body(prompt: str, stream: bool = False, **kw) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": stream, **kw}

    def ask(prompt: str, timeout: float = 300.0) -> tuple[int, dict]:
        return LT.post_json(pair.url + "/v1/completions", body(prompt), timeout=timeout)

    def reference(prompt: str) -> str:
        st, o = ask(prompt)
        if st != 200:
            raise RuntimeError(f"reference request failed: {st} {str(o)[:200]}")
        return o["choices"][0]["text"]

    def judge(t, got: tuple[int, dict], ref: str) -> None:
        st, o = got
        if st == 200:
            text = o["choices"][0]["text"]
            t.add("ok" if text == ref else "wrong")
            if text != ref:
                t.notes.append(f"wrong: {text!r} for {ref!r}")
        elif st >= 400 and (o.get("error") or o.get("message") or o.get("detail")):
            t.add("clear_error")
            t.notes.append(f"{st}: {str(o)[:150]}")
        else:
            t.add("unclear")
            t.notes.append(f"{st}: {str(o)[:150]}")

    def fresh(n_words: int) -> tuple[str, str]:
        p = _words(rng, n_words)
        return p, reference(p)

    try:
        healthy = [fresh(40) for _ in range(3)]

        def run(name, fn, killed=False):
            if only and name not in only:
                return
            t = Tally()
            t0 = time.monotonic()
            stop = threading.Event()
            h = {"worst": 0.0, "bad": 0, "n": 0}

            def healthy_client():
                i = 0
                while not stop.is_set():
                    p, ref = healthy[i % len(healthy)]
                    i += 1
                    t1 = time.monotonic()
                    try:
                        st, o = ask(p, timeout=120)
                        if st == 200 and o["choices"][0]["text"] != ref:
                            h["bad"] += 1
                    except Exception:
                        pass  # a fault class may take an engine away on purpose; only wrong answers count
                    h["worst"] = max(h["worst"], time.monotonic() - t1)
                    h["n"] += 1
                    stop.wait(1.0 if quick else 0.3)

            th = threading.Thread(target=healthy_client, daemon=True)
            th.start()
            try:
                fn(t)
            except Exception as e:  # the class itself failed: say so, keep going
                t.notes.append(f"class aborted: {type(e).__name__}: {e}"[:300])
            stop.set()
            th.join(300)
            t.worst_healthy_wait_s = h["worst"]
            if h["bad"]:
                t.wrong += h["bad"]
                t.notes.append(f"healthy client: {h['bad']} wrong answers of {h['n']}")
            for which in ("P", "D"):
                if not killed and getattr(pair, which).proc.poll() is not None:
                    t.crashes += 1
                    t.notes.append(f"{which} exited: {getattr(pair, which).log_tail(5)[-300:]}")
            t.held_after = pair.held_after()
            out[name] = t.to_dict()
            log(f"[faults] {name}: {time.monotonic() - t0:.1f}s {json.dumps(out[name])[:400]}")

        def baseline(t):
            for _ in range(per + 1):
                p, ref = fresh(300)
                judge(t, ask(p), ref)
        run("lmd_baseline", baseline)

        def at_once(t, items):
            with ThreadPoolExecutor(len(items)) as ex:
                for got, (p, ref) in zip(ex.map(lambda it: ask(it[0]), items), items):
                    judge(t, got, ref)

        def prefill_pool(t):  # ~2,100 prompt tokens at once for the prefill's 1,536
            items = [fresh(250 + 40 * i) for i in range(6)]
            for _ in range(per):
                at_once(t, items)
        run("lmd_prefill_pool_exhausted", prefill_pool)

        def decode_pool(t):  # ~2,700 tokens at once for the decode's 2,048 (and the prefill's 1,536)
            at_once(t, [fresh(450) for _ in range(6)])
        run("lmd_decode_kv_exhausted", decode_pool)

        def abort_prefill(t):
            for _ in range(per):
                p, ref = fresh(700)
                try:
                    httpx.post(pair.url + "/v1/completions", json=body(p), timeout=0.3)
                except httpx.TimeoutException:
                    pass  # the client gave up during the prefill leg
                time.sleep(1.0)
                judge(t, ask(p), ref)
        run("lmd_client_abort_prefill", abort_prefill)

        def abort_decode(t):
            for _ in range(per):
                p, ref = fresh(300)
                with httpx.Client(timeout=120) as c, \
                        c.stream("POST", pair.url + "/v1/completions", json={**body(p, True), "max_tokens": 400}) as r:
                    for i, _ in enumerate(r.iter_lines()):
                        if i >= 2:
                            break  # the client leaves mid-stream
                time.sleep(1.0)
                judge(t, ask(p), ref)
        run("lmd_client_abort_decode", abort_decode)

        def refused(t):  # logprobs without --logprobs-mode: the decode leg answers 400; the prefill's hold is freed
            for _ in range(per):
                p, _ = fresh(300)
                st, o = LT.post_json(pair.url + "/v1/completions", body(p, logprobs=2))
                t.add("clear_error" if st == 400 and "logprobs" in json.dumps(o) else "unclear")
        run("lmd_decode_leg_refused", refused)

        def kill_prefill(t):
            items = [fresh(250 + 40 * i) for i in range(6)]
            port = int(pair.P.url.rsplit(":", 1)[1])
            with ThreadPoolExecutor(len(items)) as ex:
                futs = [ex.submit(ask, p) for p, _ in items]
                time.sleep(1.5)
                os.killpg(pair.P.proc.pid, signal.SIGKILL)
                for f, (p, ref) in zip(futs, items):
                    judge(t, f.result(), ref)
            pair.launch("P", port=port)
        run("lmd_kill_prefill", kill_prefill, killed=True)

        def restart(t):  # the prefill was restarted on its port by the class before
            for _ in range(per + 1):
                p, ref = fresh(300)
                judge(t, ask(p), ref)
        run("lmd_restart_same_address", restart)
    finally:
        pair.stop()
    return out


def _emit(classes: dict, t0: float, interrupted: bool = False) -> None:
    totals = {k: sum(c.get(k, 0) for c in classes.values()) for k in
              ("tried", "ok", "near_ties", "clear_error", "unclear", "wrong", "unchecked", "held_after", "crashes")}
    waits = [c["worst_healthy_wait_s"] for c in classes.values() if c.get("worst_healthy_wait_s") is not None]
    totals["worst_healthy_wait_s"] = max(waits) if waits else None
    out = {"classes": classes, "totals": totals, "seconds": round(time.monotonic() - t0, 1)}
    if interrupted:
        out["interrupted"] = True  # stopped (SIGTERM/SIGINT) before every class ran: these are the ones that did
    print(json.dumps(out), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-vllm", action="store_true", help="skip the real vLLM CPU PD classes")
    ap.add_argument("--no-lmdeploy", action="store_true", help="skip the real LMDeploy PD classes")
    ap.add_argument("--only", default="", help="comma-separated class names")
    a = ap.parse_args()
    only = {x for x in a.only.split(",") if x}
    t0 = time.monotonic()
    classes: dict = {}

    def stop(signum, frame):  # e.g. ``timeout``: still say what ran, and leave no engine behind
        _emit(classes, t0, interrupted=True)
        for fn in _CLEANUP:
            try:
                fn()
            except Exception:
                pass
        os._exit(1)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    classes.update(mock_classes(a.quick, only))
    if not only or "fuzzed_frames" in only:
        classes["fuzzed_frames"] = frame_class()
        log(f"[faults] fuzzed_frames: {json.dumps(classes['fuzzed_frames'])[:400]}")
    if not a.no_vllm and (not only or only & PD_CLASSES):
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            log(f"[faults] vLLM not installed ({e}): PD classes skipped")
        else:
            pd_classes(a.quick, only, classes)
    if not a.no_lmdeploy and (not only or only & LMD_CLASSES):
        from dlmix_lmdeploy.testing import lmdeploy_python

        if lmdeploy_python() is None:
            log("[faults] no LMDeploy venv (scripts/setup_lmdeploy.sh): LMDeploy PD classes skipped")
        else:
            lmdeploy_classes(a.quick, only, classes)
    _emit(classes, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
