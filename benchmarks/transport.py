"""KV transport benchmark: GB/s and per-transfer latency of one-sided reads between two processes, side by side.

Measured in one run, interleaved round by round so load changes hit every contender alike:

* ``socket``: the loopback ceiling — a plain blocking TCP socket; the client sends an 8-byte request, the server
  ``sendall``s the bytes from a memoryview, the client ``recv_into``s the destination.
* ``memcpy``: ``numpy.copyto`` of the same sizes inside one process (the same-host ceiling).
* every dlmix transport (``tcp``, ``shm``) and every installed adapter (``dlslime``, ``nixl``, ``mooncake``): the
  owner is a peer process (``dlmix_kv_connectors.testing``) with a 64 MiB region and a read grant; this process pulls
  ``read(...).result()``. NIXL runs twice: ``nixl`` = UCX restricted to TCP on the loopback device (``UCX_TLS=tcp``,
  ``UCX_NET_DEVICES=lo``; the like-for-like rival of dlmix ``tcp``) and ``nixl_sm`` = UCX's defaults, which on one
  host move the bytes through shared memory / CMA (the rival of dlmix ``shm``). Both run as dlmix configures NIXL
  (its progress thread sleeps in ``poll()`` between UCX events, ``progress_delay_us`` 1000); ``nixl_spin`` is
  ``nixl`` with NIXL's own Python setting, a progress thread that never sleeps (``progress_delay_us`` 0).

Each round starts every transport's peer and endpoint afresh and closes them once its sizes are measured, so no
transport's idle threads load another's measurement (an idle ``nixl_spin`` agent's UCX progress thread spins a whole
core, and each NIXL contender has two agents: with them all alive, a 2-core machine measured everything else under
load).

Sizes 4 KiB, 256 KiB, 4 MiB, 64 MiB. For each contender and size: ``lat_us`` = median seconds per transfer;
``GBps`` = bytes / fastest transfer (on a shared, oversubscribed box noise only ever adds time, so the minimum is the
stable estimate of what the path can do; timeit's rule) and ``GBps_median`` = bytes / median. The ratios use
``GBps``; ``ratios_median`` repeats them from medians. Mooncake's listeners bind every interface, so when run as root the whole benchmark
re-executes itself inside a private network namespace (``unshare -n``, loopback up); otherwise Mooncake is skipped.

The 4 KiB latency depends on where the two processes run more than on either contender. On a VM, a loopback
round trip between processes on one CPU costs a context switch (22 us measured here), while one between two CPUs pays
the wake-up of the other, often halted, virtual CPU each way (125 us measured here); left to the scheduler, a contender
lands in either case by chance, and a waiter that polls for its reply (dlmix ``tcp``, ``spin_us``) keeps its CPU busy
and so pushes its peer to the other CPU. So the 4 KiB latency is also measured with placement fixed, every contender
alike: ``split`` = this process on CPU 0 and the peer process on CPU 1 (what two hosts are: each side wakes on its own
CPU) and ``same`` = both on CPU 0 (every microsecond of either side's work adds up, and a poll of the reply only
delays the peer); ``lat_us_split`` / ``lat_us_same`` in the results. On one CPU or without ``sched_setaffinity`` only
the unpinned figure is measured.

Prints a table, then ONE JSON line last with ratios ``WHAT_vs_BASELINE`` (GB/s ratios, higher is better):
tcp_vs_socket_4mib, tcp_vs_socket_64mib, tcp_vs_nixl_4mib, tcp_vs_nixl_64mib, tcp_vs_nixl_spin_4mib,
tcp_vs_nixl_spin_64mib, nixl_vs_nixl_spin_64mib (what the progress delay costs NIXL), tcp_vs_nixl_sm (64 MiB),
tcp_vs_mooncake (64 MiB), tcp_vs_dlslime (64 MiB), shm_vs_nixl_sm (64 MiB), shm_vs_memcpy (64 MiB), and
``tcp_latency_vs_socket_4kib`` = the plain socket's median 4 KiB latency / dlmix tcp's (higher is better), with the
two processes on two CPUs (``split``; unpinned where that cannot be set), and the same ratio
``tcp_latency_vs_socket_4kib_same_cpu`` and ``tcp_latency_vs_socket_4kib_unpinned`` for the other placements.

    python benchmarks/transport.py --quick
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import time

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 256 * KiB, 4 * MiB, 64 * MiB]
LABEL = {4 * KiB: "4KiB", 256 * KiB: "256KiB", 4 * MiB: "4MiB", 64 * MiB: "64MiB"}
SECRET = "bench-secret"


def _socket_server(port_q) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(np.random.default_rng(0).integers(0, 256, max(SIZES), dtype=np.uint8))
    req = bytearray(8)
    while True:
        got = 0
        while got < 8:
            n = conn.recv_into(memoryview(req)[got:])
            if n == 0:
                return
            got += n
        (size,) = struct.unpack("!Q", req)
        conn.sendall(buf[:size])


class SocketBaseline:
    name = "socket"

    def __init__(self):
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.proc = ctx.Process(target=_socket_server, args=(q,), daemon=True)
        self.proc.start()
        self.sock = socket.create_connection(("127.0.0.1", q.get(timeout=60)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.dst = memoryview(np.zeros(max(SIZES), dtype=np.uint8))

    def once(self, size: int) -> float:
        t = time.perf_counter()
        self.sock.sendall(struct.pack("!Q", size))
        v = self.dst[:size]
        got = 0
        while got < size:
            got += self.sock.recv_into(v[got:], size - got)
        return time.perf_counter() - t

    @property
    def peer_pid(self) -> int:
        return self.proc.pid

    def close(self):
        self.sock.close()
        self.proc.terminate()


class Memcpy:
    name = "memcpy"
    peer_pid = None

    def __init__(self):
        self.src = np.random.default_rng(1).integers(0, 256, max(SIZES), dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        np.copyto(self.dst, self.src)

    def once(self, size: int) -> float:
        t = time.perf_counter()
        np.copyto(self.dst[:size], self.src[:size])
        return time.perf_counter() - t

    def close(self):
        pass


#: NIXL contenders: ``nixl`` = UCX restricted to its TCP transport on the loopback device (``UCX_TLS=tcp``,
#: ``UCX_NET_DEVICES=lo``: the like-for-like rival of dlmix ``tcp``); ``nixl_sm`` = UCX's defaults, which on one
#: host pick shared memory / CMA (the rival of dlmix ``shm``, not of a socket transport); ``nixl_spin`` = ``nixl``
#: with a progress thread that never sleeps (NIXL's own Python default, ``progress_delay_us`` 0).
NIXL_ENV = {"nixl": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}, "nixl_sm": {},
            "nixl_spin": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}}
NIXL_CFG = {"nixl_spin": {"progress_delay_us": 0}}


class TransportBench:
    def __init__(self, name: str, cfg: dict | None = None):
        from dlmix_kv_connectors import Segment, make_transport
        from dlmix_kv_connectors.testing import PeerProcess

        kind = "nixl" if name in NIXL_ENV else name
        env = NIXL_ENV.get(name, {})
        cfg = {**NIXL_CFG.get(name, {}), **(cfg or {})}
        self.name = name
        self.Segment = Segment
        self.peer = PeerProcess(kind, "owner", SECRET, cfg, env=env)
        self.peer.call("region", name="kv", size=max(SIZES), seed=2)
        self.peer.call("grant", peer="bench", tid="b", ranges=[["kv", 0, max(SIZES)]], mode="rw", expires_s=None)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # UCX reads its environment when the agent starts
        try:
            self.t = make_transport(kind, name="bench", secret=SECRET, **(cfg or {}))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.dst = np.zeros(max(SIZES), dtype=np.uint8)
        self.t.register("kv", self.dst)
        self.t.connect(self.peer.desc)
        self.t.read("owner", [Segment("kv", 0, "kv", 0, max(SIZES))], "b").result(120)  # warm up + verify
        from dlmix_kv_connectors.testing import pattern

        if not np.array_equal(self.dst, pattern(max(SIZES), 2)):
            raise RuntimeError(f"{kind}: bytes differ after the warm-up read")
        self.extra = {"cma": self.t.check_cma("owner")} if kind == "shm" else {}

    @property
    def peer_pid(self) -> int:
        return self.peer.pid

    def once(self, size: int) -> float:
        t = time.perf_counter()
        self.t.read("owner", [self.Segment("kv", 0, "kv", 0, size)], "b").result(120)
        return time.perf_counter() - t

    def close(self):
        self.t.close()
        self.peer.close()


def _pin(pid: int, cpus: set[int]) -> None:
    """Set the CPU affinity of every thread of process ``pid`` (threads started later inherit their creator's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            pass


#: the fixed placements of the 4 KiB latency: (CPUs of this process, CPUs of the peer process)
PLACEMENTS = {"split": ({0}, {1}), "same": ({0}, {0})}


def placements_available() -> bool:
    """True when both fixed placements can be set: Linux ``sched_setaffinity``, CPUs 0 and 1 allowed to this process."""
    return hasattr(os, "sched_setaffinity") and {0, 1} <= os.sched_getaffinity(0) and os.path.isdir("/proc/self/task")


#: every contender name ``--kinds`` accepts (the transports, and NIXL's two variants)
CONTENDERS = ("tcp", "shm", "dlslime", "nixl", "nixl_spin", "nixl_sm", "mooncake")


def available_adapters() -> dict[str, str | None]:
    from dlmix_kv_connectors.base import _resolve

    out = {}
    for kind in ("dlslime", "nixl", "mooncake"):
        try:
            _resolve(kind)
            out[kind] = None
        except ImportError as e:
            out[kind] = f"not installed ({e})"
    if out["mooncake"] is None and os.environ.get("DLMIX_NETNS") != "1":
        out["mooncake"] = "skipped: its listeners bind every interface and no private netns (run as root)"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds/iterations (a few minutes here)")
    ap.add_argument("--kinds", default="", help="comma list to restrict contenders (default: all available)")
    ap.add_argument("--no-netns", action="store_true", help="do not re-execute inside a private network namespace")
    args = ap.parse_args()
    want = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in want if k not in CONTENDERS]
    if unknown:  # a typo would otherwise run no transport at all and print only nulls
        ap.error(f"--kinds: unknown contender(s) {', '.join(unknown)}; known: {', '.join(CONTENDERS)}")

    if (not args.no_netns and os.environ.get("DLMIX_NETNS") != "1" and hasattr(os, "geteuid") and os.geteuid() == 0
            and shutil.which("unshare") and shutil.which("ip")):
        cmd = "ip link set lo up && exec " + " ".join([sys.executable] + [f"'{a}'" for a in sys.argv])
        rc = subprocess.call(["unshare", "-n", "sh", "-c", cmd], env=dict(os.environ, DLMIX_NETNS="1"))
        if rc == 0:
            sys.exit(0)
        print(f"[transport] private netns run failed (rc={rc}); running here without mooncake", file=sys.stderr)
        os.environ["DLMIX_MOONCAKE_OFF"] = "1"

    rounds = 3 if args.quick else 6
    budget_s = 1.0 if args.quick else 2.0
    iters = {4 * KiB: 200, 256 * KiB: 100, 4 * MiB: 30, 64 * MiB: 8}
    skipped = {k: v for k, v in available_adapters().items() if v}
    if os.environ.get("DLMIX_MOONCAKE_OFF"):
        skipped["mooncake"] = "skipped: private netns unavailable"
    kinds = ["tcp", "shm"] + [k for k in ("dlslime", "nixl", "mooncake") if k not in skipped]
    if "nixl" in kinds:
        kinds += ["nixl_spin", "nixl_sm"]
    if want:
        for k in want:
            if k not in kinds:
                why = skipped.get(k.split("_")[0], "not available here")
                print(f"[transport] --kinds {k}: not run ({why})", file=sys.stderr)
        kinds = [k for k in kinds if k in want]
    baselines = [SocketBaseline(), Memcpy()]
    names = [c.name for c in baselines] + kinds
    samples: dict[str, dict[int, list[float]]] = {n: {s: [] for s in SIZES} for n in names}
    extra: dict[str, dict] = {}

    pinned = placements_available()
    free_cpus = os.sched_getaffinity(0) if pinned else set()
    placed: dict[str, dict[str, list[float]]] = {n: {p: [] for p in PLACEMENTS} for n in names}

    def timed(c, s: int, out: list) -> None:
        c.once(s)  # warm
        t_end = time.perf_counter() + budget_s
        for i in range(iters[s]):  # up to iters[s] transfers, at least 3, within the time budget
            out.append(c.once(s))
            if i >= 2 and time.perf_counter() > t_end:
                break

    def measure(c) -> None:
        for s in SIZES:
            timed(c, s, samples[c.name][s])
        if pinned and c.peer_pid is not None:
            try:
                for where, (mine, theirs) in PLACEMENTS.items():
                    _pin(os.getpid(), mine)
                    _pin(c.peer_pid, theirs)
                    timed(c, 4 * KiB, placed[c.name][where])
            finally:
                _pin(os.getpid(), free_cpus)
                _pin(c.peer_pid, free_cpus)

    # A transport's processes live only while it is measured: an idle nixl_spin agent's progress thread spins a whole
    # core (two agents per contender), which would load every other contender's measurement on a small machine.
    for r in range(rounds):
        for c in baselines:
            measure(c)
        for k in kinds:
            if k in skipped:
                continue
            try:
                c = TransportBench(k)
            except Exception as e:  # report and go on
                skipped[k] = f"failed to start: {type(e).__name__}: {e}"
                print(f"[transport] {k}: {skipped[k]}", file=sys.stderr)
                continue
            try:
                extra.setdefault(k, c.extra)
                measure(c)
            finally:
                c.close()
        print(f"[transport] round {r + 1}/{rounds} done", file=sys.stderr)
    for c in baselines:
        c.close()
    samples = {n: per for n, per in samples.items() if n not in skipped}

    res: dict[str, dict] = {}
    for name, per in samples.items():
        res[name] = {}
        for s, ts in per.items():
            med = statistics.median(ts)
            res[name][LABEL[s]] = {"GBps": round(s / min(ts) / 1e9, 3), "GBps_median": round(s / med / 1e9, 3),
                                   "lat_us": round(med * 1e6, 1), "n": len(ts)}
        for where, ts in placed.get(name, {}).items():
            if ts:
                res[name]["4KiB"][f"lat_us_{where}"] = round(statistics.median(ts) * 1e6, 1)

    hdr = f"{'contender':10s}" + "".join(f"{LABEL[s]:>22s}" for s in SIZES)
    print(hdr)
    print(f"{'':10s}" + "".join(f"{'GB/s   lat_us':>22s}" for _ in SIZES))
    for name, per in res.items():
        print(f"{name:10s}" + "".join(f"{per[LABEL[s]]['GBps']:>12.3f}{per[LABEL[s]]['lat_us']:>10.1f}" for s in SIZES))
    print("(GB/s from the fastest transfer, lat_us = median; see --help)")
    for k, why in skipped.items():
        print(f"{k:10s} {why}")

    def ratio(a: str, b: str, size: str, key: str = "GBps") -> float | None:
        if a in res and b in res:
            return round(res[a][size][key] / res[b][size][key], 3)
        return None

    pairs = {"tcp_vs_socket_4mib": ("tcp", "socket", "4MiB"), "tcp_vs_socket_64mib": ("tcp", "socket", "64MiB"),
             "tcp_vs_nixl_4mib": ("tcp", "nixl", "4MiB"), "tcp_vs_nixl_64mib": ("tcp", "nixl", "64MiB"),
             "tcp_vs_nixl_spin_4mib": ("tcp", "nixl_spin", "4MiB"),
             "tcp_vs_nixl_spin_64mib": ("tcp", "nixl_spin", "64MiB"),
             "nixl_vs_nixl_spin_64mib": ("nixl", "nixl_spin", "64MiB"),
             "tcp_vs_mooncake": ("tcp", "mooncake", "64MiB"), "tcp_vs_dlslime": ("tcp", "dlslime", "64MiB"),
             "shm_vs_nixl_sm": ("shm", "nixl_sm", "64MiB"), "tcp_vs_nixl_sm": ("tcp", "nixl_sm", "64MiB"),
             "shm_vs_memcpy": ("shm", "memcpy", "64MiB")}

    def lat_ratio(base: str, who: str, size: str, key: str = "lat_us") -> float | None:  # base / who (medians)
        if base in res and who in res and key in res[base][size] and key in res[who][size]:
            return round(res[base][size][key] / res[who][size][key], 3)
        return None

    if pinned:
        print("4 KiB latency (us, median) with placement fixed: split = this process on CPU 0, peer on CPU 1; "
              "same = both on CPU 0")
        for name, per in res.items():
            if "lat_us_split" in per["4KiB"]:
                print(f"{name:10s} split {per['4KiB']['lat_us_split']:>8.1f}   same {per['4KiB']['lat_us_same']:>8.1f}")

    out = {
        "bench": "transport",
        "quick": args.quick,
        **{k: ratio(*v) for k, v in pairs.items()},
        "tcp_latency_vs_socket_4kib": lat_ratio("socket", "tcp", "4KiB", "lat_us_split" if pinned else "lat_us"),
        "tcp_latency_vs_socket_4kib_same_cpu": lat_ratio("socket", "tcp", "4KiB", "lat_us_same") if pinned else None,
        "tcp_latency_vs_socket_4kib_unpinned": lat_ratio("socket", "tcp", "4KiB"),
        "ratios_median": {k: ratio(*v, key="GBps_median") for k, v in pairs.items()},
        "shm_cma": extra.get("shm", {}).get("cma"),
        "skipped": skipped,
        "results": res,
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
