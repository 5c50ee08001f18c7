"""Router throughput and added latency, side by side on the same mock backends.

Compares the dlmix router (round_robin and cost policies) with sglang-router and vllm-router (Rust; installed in a
SEPARATE venv, default /tmp/rvenv: ``python3.11 -m venv /tmp/rvenv && /tmp/rvenv/bin/pip install
sglang-router==0.3.2 vllm-router==0.1.17``; skipped with a note when absent) and with no router.

Setup: 4 fast mock backends (``python -m dlmix.testing.mock_engine --canned``: one uvloop process, fixed responses:
1 JSON body or 8 SSE chunks) and the load
generators share core 1; the router under test is pinned to core 0 (taskset). Load: ``wrk`` (closed loop, 64
connections non-streaming / 32 streaming, 1 KB prompts) for req/s; an open-loop Python client at 500 req/s for the
added p50/p99 latency (router minus direct, same client). Prefix index memory is measured with tracemalloc.

    python benchmarks/router.py [--quick] [--baseline-src DIR]

``--baseline-src DIR``: also run the router of another dlmix source tree (e.g. the previous commit, ``mkdir DIR &&
git archive main | tar -x -C DIR``) as ``base_round_robin``/``base_cost`` in the same rounds, and report
``rps_vs_baseline_*``, ``cpu_rps_vs_baseline_*`` and ``streams_vs_baseline_*`` (this tree over the baseline, from
the medians over rounds) and ``paired_vs_baseline_*``: the ratio of each round (this tree and the baseline measured
one after the other, so a drift of a shared machine cancels; every other round runs the contenders in reverse order,
so none always follows the same one) and their median. ``--rounds N`` sets the number of
interleaved rounds (default 3, 1 with ``--quick``); on a noisy 2-core machine one measurement varies by +-30 %, so
compare with 7 or more.

Router replicas (:mod:`dlmix.router.shared`, when ``etcd`` is installed): one dlmix router on etcd (the mocks registered
through it) measured in the same rounds as the memory-only one (``rps_etcd_vs_memory_round_robin``), and, right after
it in each round, three replicas on etcd sharing core 0, loaded by three wrk processes at once (the 64 connections
split evenly: a connection-level round-robin front, as a Kubernetes Service balances); ``rps_3_replicas_vs_1`` is the
per-round ratio's median.

Prints one JSON object on the last line: ``rps`` per router/policy, ``rps_vs_rust_sglang_rr``,
``rps_vs_rust_vllm_rr``, ``rps_vs_rust_sglang_cache_aware``, ``p99_added_ms_at_500rps``, ``index_mib_per_million_blocks``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable
PROMPT = ("The quick brown fox jumps over the lazy dog while the router decides where to send it. " * 12)[:1000]


def body(stream: bool) -> bytes:
    return json.dumps({"model": "mock", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                       "stream": stream}).encode()


# ---------------------------------------------------------------------------------------------- helpers
sys.path.insert(0, ROOT)
from dlmix.testing import free_port  # noqa: E402


def wait_http(port: int, path: str = "/health", timeout: float = 30.0, post: bool = False) -> bool:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if post:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=body(False),
                               headers={"content-type": "application/json"}, timeout=2)
            else:
                r = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2)
            if r.status_code == 200:
                return True
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.3)
    return False


def start(cmd, cpu: str, log: str, env=None) -> subprocess.Popen:
    """Start ``cmd`` pinned to ``cpu``, output to the ``log`` file (a pipe nobody reads would block it)."""
    with open(log, "wb") as f:
        return subprocess.Popen(["taskset", "-c", cpu] + cmd, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def wrk(port: int, stream: bool, conns: int, secs: int, pid: int = 0):
    """Closed-loop load with wrk (one thread, pinned to core 1). Returns (req/s, router CPU µs per request or
    None): the CPU figure (from /proc) does not depend on how much of its core the router got on a shared machine."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\nwrk.body = %s\n'
                % json.dumps(body(stream).decode()))
        lua = f.name
    c0 = cpu_seconds(pid) if pid else 0.0
    out = subprocess.run(["taskset", "-c", "1", "wrk", "-t1", f"-c{conns}", f"-d{secs}s", "-s", lua,
                          f"http://127.0.0.1:{port}/v1/completions"], capture_output=True, text=True).stdout
    c1 = cpu_seconds(pid) if pid else 0.0
    os.unlink(lua)
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    n = re.search(r"(\d+) requests in", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if bad:
        print(f"  warning: {bad.group(1)} non-2xx responses on port {port}", file=sys.stderr)
    rps = float(m.group(1)) if m else 0.0
    us = (c1 - c0) / int(n.group(1)) * 1e6 if (pid and n and int(n.group(1))) else None
    return rps, us


def wrk_many(ports, stream: bool, conns: int, secs: int) -> float:
    """One wrk per port at once (the connections split evenly: a connection-level round-robin front, as a Kubernetes
    Service's kube-proxy balances), all pinned to core 1. Returns the summed req/s."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\nwrk.body = %s\n'
                % json.dumps(body(stream).decode()))
        lua = f.name
    per = [conns // len(ports) + (1 if i < conns % len(ports) else 0) for i in range(len(ports))]
    ps = [subprocess.Popen(["taskset", "-c", "1", "wrk", "-t1", f"-c{c}", f"-d{secs}s", "-s", lua,
                            f"http://127.0.0.1:{port}/v1/completions"], stdout=subprocess.PIPE, text=True)
          for port, c in zip(ports, per)]
    total = 0.0
    for p in ps:
        out = p.communicate()[0]
        m = re.search(r"Requests/sec:\s+([\d.]+)", out)
        bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
        if bad:
            print(f"  warning: {bad.group(1)} non-2xx responses", file=sys.stderr)
        total += float(m.group(1)) if m else 0.0
    os.unlink(lua)
    return total


def start_etcd(logdir: str):
    """An etcd member on free loopback ports (pinned to core 1), or (None, reason)."""
    exe = shutil.which("etcd")
    if not exe:
        return None, "etcd not installed (scripts/setup.sh installs etcd-server): replica figures skipped"
    cport, pport = free_port(), free_port()
    url = f"http://127.0.0.1:{cport}"
    p = start([exe, "--name", "b", "--data-dir", os.path.join(logdir, "etcd"), "--listen-client-urls", url,
               "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{pport}",
               "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
               "--initial-cluster", f"b=http://127.0.0.1:{pport}"], "1", os.path.join(logdir, "etcd.log"))
    if not wait_http(cport, "/health", timeout=60):
        stop(p)
        return None, "etcd did not start: replica figures skipped"
    return (p, url), None


def register_all(port: int, urls, n_replicas_ports=()) -> bool:
    """Register the mock backends through the router replica on ``port`` (they go to etcd) and wait until every
    replica in ``n_replicas_ports`` lists them all."""
    import httpx

    for u in urls:
        r = httpx.post(f"http://127.0.0.1:{port}/admin/instances", json={"url": u, "model": "mock", "chip": "H100",
                                                                         "heartbeat_ttl_s": 0}, timeout=10)
        if r.status_code != 201:
            print(f"  registration through :{port} failed: {r.status_code} {r.text[:200]}", file=sys.stderr)
            return False
    deadline = time.time() + 30
    for q in (port, *n_replicas_ports):
        while len(httpx.get(f"http://127.0.0.1:{q}/admin/instances", timeout=10).json()["instances"]) < len(urls):
            if time.time() > deadline:
                return False
            time.sleep(0.05)
    return True


PACED = r'''
import asyncio, sys, time, json, socket
import httptools, uvloop
port, rate, secs, conns = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
body = sys.stdin.buffer.read()
req = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
class C(asyncio.Protocol):
    def connection_made(self, t):
        self.t = t; t.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    def data_received(self, d):
        self.p.feed_data(d)
    def on_message_complete(self):
        self.f.set_result(None)
    def go(self):
        self.p = httptools.HttpResponseParser(self); self.f = asyncio.get_event_loop().create_future()
        self.t.write(req); return self.f
async def main():
    loop = asyncio.get_event_loop()
    pool = []
    for _ in range(conns):
        _, c = await loop.create_connection(C, "127.0.0.1", port); pool.append(c)
    free = asyncio.Queue()
    for c in pool: free.put_nowait(c)
    lat = []
    n = int(rate * secs)
    t0 = time.perf_counter() + 0.2
    async def one(i, ts):
        c = await free.get()
        await c.go()
        lat.append(time.perf_counter() - ts)
        free.put_nowait(c)
    tasks = []
    for i in range(n):
        ts = t0 + i / rate
        d = ts - time.perf_counter()
        if d > 0: await asyncio.sleep(d)
        tasks.append(asyncio.ensure_future(one(i, ts)))
    await asyncio.gather(*tasks)
    lat.sort()
    print(json.dumps({"p50": lat[len(lat)//2]*1e3, "p99": lat[int(len(lat)*0.99)]*1e3, "n": len(lat)}))
uvloop.install(); asyncio.run(main())
'''


def paced(port: int, rate: float, secs: float) -> dict:
    out = subprocess.run(["taskset", "-c", "1", PY, "-c", PACED, str(port), str(rate), str(secs), "32"],
                         input=body(False), capture_output=True, timeout=secs * 4 + 30)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def shared_prefix_spread(port: int, mock_ports, n: int = 200, conc: int = 16) -> dict:
    """Send ``n`` requests sharing one 4 KB prefix (unique suffixes) with ``conc`` in flight; return the share of
    the busiest backend and the per-backend counts."""
    import httpx

    def stats():
        return {p: httpx.get(f"http://127.0.0.1:{p}/mock/stats", timeout=5).json()["requests"] for p in mock_ports}

    before = stats()
    prefix = ("You are a helpful assistant for the dlmix project. Answer briefly and precisely. " * 50)[:4096]

    async def run():
        sem = asyncio.Semaphore(conc)
        async with httpx.AsyncClient(timeout=30) as h:
            async def one(i):
                async with sem:
                    r = await h.post(f"http://127.0.0.1:{port}/v1/completions",
                                     json={"model": "mock", "prompt": prefix + f" Question {i}?", "max_tokens": 8})
                    return r.status_code
            return await asyncio.gather(*(one(i) for i in range(n)))

    codes = asyncio.run(run())
    after = stats()
    counts = sorted((after[k] - before[k] for k in after), reverse=True)
    return {"max_share": round(counts[0] / max(sum(counts), 1), 3), "counts": counts,
            "ok": sum(1 for c in codes if c == 200)}


def tokenize_costs() -> dict:
    """µs to tokenize a 1 KB chat prompt with the SmolLM2 fast tokenizer (cached build) and to hash its blocks
    (sha256_cbor, block 16), plus the approximate char-chunk path; None where the model is unavailable."""
    import timeit

    sys.path.insert(0, ROOT)
    from dlmix.routing.hashing import BlockHasher, char_chunk_keys
    from dlmix.router.tokenize import PromptExtractor

    out = {"char_chunks_us_1kb": round(timeit.timeit(lambda: char_chunk_keys(PROMPT, 16), number=2000) / 2 * 1e3, 1)}
    try:
        from dlmix.models import prepare

        path = str(prepare("smollm2"))
    except Exception as ex:  # noqa: BLE001
        out["tokenizer_note"] = f"smollm2 unavailable: {ex}"
        return out
    ex = PromptExtractor(path)
    body = {"messages": [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Question 0?"}]}
    ex.extract(True, body)
    n = 200
    k = [0]

    def cold():  # nothing cached
        ex._cache.clear()
        if ex._split is not None:
            ex._seg.clear()
        return ex.extract(True, body)

    def warm():  # shared 1 KB system prompt cached, a new question each time
        k[0] += 1
        return ex.extract(True, {"messages": [body["messages"][0], {"role": "user", "content": f"Question {k[0]}?"}]})
    out["hf_chat_tokenize_us_1kb_cold"] = round(timeit.timeit(cold, number=n) / n * 1e6, 1)
    out["hf_chat_tokenize_us_1kb_shared_system"] = round(timeit.timeit(warm, number=n) / n * 1e6, 1)
    out["hf_split_encoding_active"] = ex._split is not None
    ids = cold()[0]
    h = BlockHasher("sha256_cbor", memo_size=0)
    h.memo_size = 1  # no memo hits: the first-time cost
    out["sha256_cbor_hash_us_1kb_cold"] = round(timeit.timeit(lambda: h.block_keys(ids, 16), number=n) / n * 1e6, 1)
    h2 = BlockHasher("sha256_cbor")
    out["sha256_cbor_hash_us_1kb_memo"] = round(timeit.timeit(lambda: h2.block_keys(ids, 16), number=n) / n * 1e6,
                                                1)
    out["tokens_1kb"] = len(ids)
    return out


def index_mib_per_million(n: int = 1_000_000) -> float:
    import tracemalloc

    sys.path.insert(0, ROOT)
    from dlmix.routing.prefix_index import PrefixIndex

    rng = random.Random(0)
    tracemalloc.start()
    ix = PrefixIndex()
    for s in range(8):  # 8 instances, 1M distinct blocks in all, ~25 % held by two instances
        keys = [rng.getrandbits(64) for _ in range(n // 8)]
        ix.store(s, keys)
        ix.store((s + 1) % 8, keys[: n // 32])
    cur, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(ix) == n
    return cur / 2**20 * (1_000_000 / n)


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rvenv", default="/tmp/rvenv")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick: 1)")
    ap.add_argument("--baseline-src", default=None,
                    help="a dlmix source tree (e.g. `git archive main`) whose router runs side by side as base_*")
    a = ap.parse_args()
    secs = 4 if a.quick else 10
    paced_secs = 5 if a.quick else 12
    runs = a.rounds or (1 if a.quick else 3)
    notes = []
    if not shutil.which("wrk"):
        sys.exit("wrk not found: apt-get install -y wrk")
    ports = [free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    mocks = subprocess.Popen(["taskset", "-c", "1", PY, "-m", "dlmix.testing.mock_engine", "--canned",
                              "--ports", ",".join(map(str, ports))], stdout=subprocess.PIPE, start_new_session=True,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    for _ in ports:
        mocks.stdout.readline()
    mocks.stdout.readline()
    res: dict = {"rps": {}, "streams_per_s": {}, "added_ms_at_500rps": {}, "cpu_us_per_req": {},
                 "cpu_us_per_stream": {}, "shared_prefix_4kb": {}}
    procs = []
    try:
        routers = {}
        dl = [os.path.join(os.path.dirname(PY), "dlmix"), "router"]
        inst = sum((["--instance", f"url={u},model=mock,chip=H100"] for u in urls), [])
        envs = {}
        for pol in ("round_robin", "cost"):
            routers[f"dlmix_{pol}"] = dl + ["--policy", pol, "--model-spec", "llama-3.1-8b"] + inst
            envs[f"dlmix_{pol}"] = dict(os.environ,
                                        PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
            if a.baseline_src:
                routers[f"base_{pol}"] = routers[f"dlmix_{pol}"]
                envs[f"base_{pol}"] = dict(os.environ, PYTHONPATH=os.path.abspath(a.baseline_src))
        rb = os.path.join(a.rvenv, "bin")
        if os.path.exists(os.path.join(rb, "python")):
            has_sg = subprocess.run([os.path.join(rb, "python"), "-c", "import sglang_router"],
                                    capture_output=True).returncode == 0
            if has_sg:
                for pol in ("round_robin", "cache_aware"):
                    routers[f"sglang_{pol}"] = [os.path.join(rb, "python"), "-m", "sglang_router.launch_router",
                                                "--worker-urls", *urls, "--policy", pol, "--host", "127.0.0.1",
                                                "--log-level", "warn", "--prometheus-port", str(free_port())]
            else:
                notes.append("sglang-router not importable in rvenv: skipped")
            vr = os.path.join(rb, "vllm-router")
            if os.path.exists(vr):
                routers["vllm_round_robin"] = [vr, "--worker-urls", *urls, "--policy", "round_robin",
                                               "--host", "127.0.0.1", "--log-level", "warning",
                                               "--prometheus-port", str(free_port())]
            else:
                notes.append("vllm-router binary not in rvenv: skipped")
        else:
            notes.append(f"no venv at {a.rvenv}: Rust routers skipped")

        targets = {"no_router": (ports[0], 0)}
        logdir = tempfile.mkdtemp(prefix="dlmix-router-bench-")
        for name, cmd in routers.items():
            port = free_port()
            p = start(cmd + ["--port", str(port)], "0", log=os.path.join(logdir, name + ".log"),
                      env=envs.get(name))
            procs.append(p)
            if not wait_http(port, post=True, timeout=60):
                with open(os.path.join(logdir, name + ".log"), errors="replace") as f:
                    err = f.read()[-300:]
                notes.append(f"{name} did not come up: {err}")
                stop(p)
                continue
            targets[name] = (port, p.pid)
        # router replicas (dlmix.router.shared): one replica on etcd (its figures next to the memory-only router)
        # and three replicas sharing core 0 behind a connection-level round-robin front
        replica_ports = []
        et, why = start_etcd(logdir)
        if et is None:
            notes.append(why)
        else:
            procs.append(et[0])
            envr = envs.get("dlmix_round_robin")
            rr = dl + ["--policy", "round_robin", "--model-spec", "llama-3.1-8b", "--etcd", et[1]]
            port = free_port()
            p = start(rr + ["--etcd-prefix", "/bench/one", "--port", str(port)], "0",
                      log=os.path.join(logdir, "etcd_one.log"), env=envr)
            procs.append(p)
            if wait_http(port, "/admin/instances", timeout=60) and register_all(port, urls):
                # measured right after the memory-only round_robin router, so both follow the same contender
                order = list(targets)
                order.insert(order.index("dlmix_round_robin") + 1 if "dlmix_round_robin" in order else len(order),
                             "dlmix_round_robin_etcd")
                targets["dlmix_round_robin_etcd"] = (port, p.pid)
                targets = {k: targets[k] for k in order}
            else:
                notes.append("router on etcd did not come up")
            for k in range(3):
                port = free_port()
                p = start(rr + ["--etcd-prefix", "/bench/three", "--port", str(port)], "0",
                          log=os.path.join(logdir, f"etcd_three_{k}.log"), env=envr)
                procs.append(p)
                if wait_http(port, "/admin/instances", timeout=60):
                    replica_ports.append(port)
            if len(replica_ports) != 3 or not register_all(replica_ports[0], urls, replica_ports[1:]):
                notes.append("three router replicas did not come up")
                replica_ports = []
        rps_l = {n: [] for n in targets}
        cpu_l = {n: [] for n in targets}
        rep3_l: list = []
        rep1_l: list = []
        st_l = {n: [] for n in targets}
        stcpu_l = {n: [] for n in targets}
        for name, (port, pid) in targets.items():
            wrk(port, False, 64, 2)  # warm-up (connection pools, JIT-free but caches)
        for rnd in range(runs):  # interleaved rounds: slow drifts of a shared machine hit every router alike
            # every other round in reverse order, so no contender always runs right after the same other one
            for name, (port, pid) in (list(targets.items())[::-1] if rnd % 2 else list(targets.items())):
                r, c = wrk(port, False, 64, secs, pid)
                rps_l[name].append(r)
                if c:
                    cpu_l[name].append(c)
                if name == "dlmix_round_robin_etcd" and replica_ports:  # 3 replicas right after 1, same round
                    rep1_l.append(r)
                    rep3_l.append(wrk_many(replica_ports, False, 64, secs))
                r, c = wrk(port, True, 32, secs, pid)
                st_l[name].append(r)
                if c:
                    stcpu_l[name].append(c)
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        for name in targets:
            res["rps"][name] = round(med(rps_l[name]))
            res["streams_per_s"][name] = round(med(st_l[name]))
            if cpu_l[name]:
                res["cpu_us_per_req"][name] = round(med(cpu_l[name]), 1)
                res["cpu_us_per_stream"][name] = round(med(stcpu_l[name]), 1)
            print(f"{name}: {res['rps'][name]} req/s, {res['streams_per_s'][name]} streams/s, "
                  f"{res['cpu_us_per_req'].get(name)} CPU us/req", file=sys.stderr)
        base = paced(targets["no_router"][0], 500, paced_secs)
        res["direct_ms_at_500rps"] = {"p50": round(base["p50"], 3), "p99": round(base["p99"], 3)}
        for name, (port, pid) in targets.items():
            if name == "no_router":
                continue
            q = paced(port, 500, paced_secs)
            res["added_ms_at_500rps"][name] = {"p50": round(q["p50"] - base["p50"], 3),
                                               "p99": round(q["p99"] - base["p99"], 3)}
            print(f"{name}: added p50 {q['p50'] - base['p50']:.3f} ms p99 {q['p99'] - base['p99']:.3f} ms",
                  file=sys.stderr)
        for name, (port, pid) in targets.items():
            if name != "no_router":
                res["shared_prefix_4kb"][name] = shared_prefix_spread(port, ports)
                print(f"{name}: shared prefix spread {res['shared_prefix_4kb'][name]}", file=sys.stderr)
    finally:
        for p in procs:
            stop(p)
        stop(mocks)

    rps = res["rps"]
    cpu = res["cpu_us_per_req"]
    rep_ratio = [round(x / y, 3) for x, y in zip(rep3_l, rep1_l) if y]
    if rep3_l:
        rps["dlmix_3_replicas_round_robin"] = round(statistics.median(rep3_l))

    def ratio(x, y):
        return round(rps[x] / rps[y], 3) if x in rps and y in rps and rps[y] else None

    def paired(rps_l, cpu_l, x, y):  # per-round ratios of x over y (measured back to back), and their medians
        if not (rps_l.get(x) and rps_l.get(y)):
            return None
        rr = [round(a / b, 3) for a, b in zip(rps_l[x], rps_l[y]) if b]
        cr = [round(b / a, 3) for a, b in zip(cpu_l.get(x, []), cpu_l.get(y, [])) if a]
        return {"rps_per_round": rr, "cpu_rps_per_round": cr,
                "rps_median": round(statistics.median(rr), 3) if rr else None,
                "cpu_rps_median": round(statistics.median(cr), 3) if cr else None}

    def cpu_ratio(x, y):  # requests per CPU-second, x over y
        return round(cpu[y] / cpu[x], 3) if x in cpu and y in cpu and cpu[x] else None

    out = {
        "rps": rps, "streams_per_s": res["streams_per_s"], "added_ms_at_500rps": res["added_ms_at_500rps"],
        "cpu_us_per_req": cpu, "cpu_us_per_stream": res["cpu_us_per_stream"],
        "cpu_rps_vs_rust_sglang_rr": cpu_ratio("dlmix_round_robin", "sglang_round_robin"),
        "cpu_rps_vs_rust_vllm_rr": cpu_ratio("dlmix_round_robin", "vllm_round_robin"),
        "cpu_rps_vs_rust_sglang_cache_aware": cpu_ratio("dlmix_cost", "sglang_cache_aware"),
        "direct_ms_at_500rps": res.get("direct_ms_at_500rps"),
        "rps_vs_rust_sglang_rr": ratio("dlmix_round_robin", "sglang_round_robin"),
        "rps_vs_rust_vllm_rr": ratio("dlmix_round_robin", "vllm_round_robin"),
        "rps_vs_rust_sglang_cache_aware": ratio("dlmix_cost", "sglang_cache_aware"),
        "streams_vs_rust_sglang_rr": (round(res["streams_per_s"]["dlmix_round_robin"] /
                                            res["streams_per_s"]["sglang_round_robin"], 3)
                                      if "sglang_round_robin" in res["streams_per_s"] else None),
        "p99_added_ms_at_500rps": res["added_ms_at_500rps"].get("dlmix_cost", {}).get("p99"),
        "p99_added_ms_at_500rps_round_robin": res["added_ms_at_500rps"].get("dlmix_round_robin", {}).get("p99"),
        "shared_prefix_4kb_over_4": res["shared_prefix_4kb"],
        # router replicas on etcd: 3 replicas (sharing core 0, behind a connection-level round-robin front) over 1,
        # per round and median; and one replica on etcd over the memory-only router (the hot path reads no etcd)
        "rps_3_replicas_vs_1": round(statistics.median(rep_ratio), 3) if rep_ratio else None,
        "rps_3_replicas_vs_1_per_round": rep_ratio,
        "rps_etcd_vs_memory_round_robin": ratio("dlmix_round_robin_etcd", "dlmix_round_robin"),
        "cpu_rps_etcd_vs_memory_round_robin": cpu_ratio("dlmix_round_robin_etcd", "dlmix_round_robin"),
        "paired_etcd_vs_memory_round_robin": paired(rps_l, cpu_l, "dlmix_round_robin_etcd", "dlmix_round_robin"),
        **({f"{k}_vs_baseline_{pol}": v for pol in ("round_robin", "cost") for k, v in (
            ("rps", ratio(f"dlmix_{pol}", f"base_{pol}")),
            ("cpu_rps", cpu_ratio(f"dlmix_{pol}", f"base_{pol}")),
            ("streams", round(res["streams_per_s"][f"dlmix_{pol}"] / res["streams_per_s"][f"base_{pol}"], 3)
             if res["streams_per_s"].get(f"base_{pol}") and f"dlmix_{pol}" in res["streams_per_s"] else None))}
           if a.baseline_src else {}),
        **({f"paired_vs_baseline_{pol}": paired(rps_l, cpu_l, f"dlmix_{pol}", f"base_{pol}")
            for pol in ("round_robin", "cost")} if a.baseline_src else {}),
        **tokenize_costs(),
        "index_mib_per_million_blocks": round(index_mib_per_million(), 1),
        "notes": notes + ["router pinned to core 0, mocks + load generators on core 1; on a shared machine "
                          "req/s depends on other load, CPU us/req (from /proc) does not",
                          "the 3 router replicas share core 0 (the single router's CPU budget): on this machine "
                          "the ratio measures what replication costs, not what more cores would add"],
        "quick": a.quick, "duration_s": secs, "runs": runs,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
