"""Admin API at fleet scale: registering, heartbeating and scraping 10,000 instances on one router.

The router runs in its own process (``python -m dlmix.cli router``, round_robin, health checks effectively off);
this process registers ``N`` instances through ``POST /admin/instances`` (4 keep-alive connections, 64 pipelined
requests in flight on each, prefill/decode alternating, one shared KV layout so the layout check runs), sends one heartbeat per instance, then
GETs ``/metrics``. The same steps at ``N/10`` give a per-instance cost ratio: ``register_per_instance_10k_vs_1k`` =
(cost per registration at N/10) / (cost per registration at N), about 1 when registration cost does not grow with
the fleet (it was quadratic before: 6,732 of 10,000 in 240 s).

    python benchmarks/router_admin.py [--quick] [--n 10000] [--baseline-src DIR [--baseline-n 2000]]

``--baseline-src DIR``: also register ``--baseline-n`` instances on the router of another source tree and on this
one, one after the other in the same run: ``register_2000_vs_baseline`` (baseline time / this time, higher is
better) and ``metrics_bytes_2000_vs_baseline``.

Prints one JSON object on the last line: ``register_10k_s``, ``heartbeat_10k_s``, ``metrics_10k_ms``,
``metrics_10k_bytes``, ``register_per_instance_10k_vs_1k``, and the same at N/10 (``register_1k_s``, ...).
``--quick``: N = 10,000 anyway (it takes seconds); the flag only skips the repeat of the N/10 round.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layout() -> dict:
    from dlmix.kv.layout import KVLayout, ModelIdentity

    return KVLayout(model=ModelIdentity(architecture="LlamaForCausalLM", num_layers=32, num_kv_heads=8,
                                        head_size=128), block_size=16, dtype="bfloat16",
                    arrangement="vllm_lbnhc").to_dict()


def _shim(src: str) -> str:
    """A PYTHONPATH folder whose ``dlmix`` is the one of source tree ``src`` (for the baseline router)."""
    import tempfile

    d = tempfile.mkdtemp(prefix="dlmix-base-")
    os.symlink(os.path.join(os.path.abspath(src), "dlmix"), os.path.join(d, "dlmix"))
    os.symlink(os.path.join(os.path.abspath(src), "kv_connectors"), os.path.join(d, "dlmix_kv_connectors"))
    return d


def _start_router(src: str = None):
    port = _free_port()
    cmd = [sys.executable, "-m", "dlmix.cli", "router", "--port", str(port), "--policy", "round_robin",
           "--health-interval-s", "3600", "--heartbeat-ttl-s", "3600", "--admin-key", "adm"]
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = _shim(src)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=src or ROOT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(base + "/metrics", timeout=1).status_code == 200:
                return p, base
        except httpx.HTTPError:
            time.sleep(0.1)
    p.kill()
    raise RuntimeError("router did not start: " + (p.stdout.read() if p.stdout else ""))


async def _pipelined(host: str, port: int, reqs: list, conc: int = 4, window: int = 64) -> list:
    """Send raw HTTP/1.1 requests over ``conc`` keep-alive connections, ``window`` pipelined at a time on each (a
    cheap client: the router, not the client, is what is measured). Returns the status codes in request order."""
    out = [0] * len(reqs)

    async def one(k: int):
        rd, wr = await asyncio.open_connection(host, port)
        mine = list(range(k, len(reqs), conc))
        for s in range(0, len(mine), window):
            part = mine[s:s + window]
            wr.write(b"".join(reqs[i] for i in part))
            await wr.drain()
            for i in part:
                head = await rd.readuntil(b"\r\n\r\n")
                out[i] = int(head[9:12])
                n = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        n = int(line[15:])
                await rd.readexactly(n)
        wr.close()

    await asyncio.gather(*(one(k) for k in range(conc)))
    return out


def _req(method: str, path: str, body) -> bytes:
    data = json.dumps(body).encode()
    return (f"{method} {path} HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer adm\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n").encode() + data


async def _round(base: str, n: int, offset: int) -> dict:
    host, port = base[7:].split(":")
    lay = _layout()
    regs = [_req("POST", "/admin/instances", {
        "url": f"http://10.{j // 65536 % 256}.{j // 256 % 256}.{j % 256}:8000", "id": f"i{j}",
        "role": ("prefill", "decode")[j % 2], "model": "m", "chip": "H100", "kv_layout": lay})
        for j in range(offset, offset + n)]
    hbs = [_req("POST", f"/admin/instances/i{j}/heartbeat", {"waiting": 1, "running": 2, "kv_usage": 0.5})
           for j in range(offset, offset + n)]
    t0 = time.perf_counter()
    st = await _pipelined(host, int(port), regs)
    t_reg = time.perf_counter() - t0
    if set(st) != {201}:
        raise RuntimeError(f"registrations answered {sorted(set(st))}")
    t0 = time.perf_counter()
    st = await _pipelined(host, int(port), hbs)
    t_hb = time.perf_counter() - t0
    if set(st) != {200}:
        raise RuntimeError(f"heartbeats answered {sorted(set(st))}")
    async with httpx.AsyncClient(base_url=base, headers={"authorization": "Bearer adm"}, timeout=60) as h:
        t0 = time.perf_counter()
        m = await h.get("/metrics")
        t_m = time.perf_counter() - t0
    assert m.status_code == 200
    return {"register_s": t_reg, "heartbeat_s": t_hb, "metrics_ms": t_m * 1e3, "metrics_bytes": len(m.content)}


def _measure(n: int, src: str = None) -> dict:
    p, base = _start_router(src)
    try:
        return asyncio.run(_round(base, n, 0))
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--baseline-src", help="another dlmix source tree (e.g. `git archive main | tar -x -C DIR`): "
                    "register --baseline-n instances on its router and on this one, side by side")
    ap.add_argument("--baseline-n", type=int, default=2000)
    a = ap.parse_args()
    n, small = a.n, max(a.n // 10, 1)
    rounds = 1 if a.quick else 2
    s = min((_measure(small) for _ in range(rounds)), key=lambda r: r["register_s"])
    big = _measure(n)
    out = {f"register_{n // 1000}k_s": round(big["register_s"], 3),
           f"heartbeat_{n // 1000}k_s": round(big["heartbeat_s"], 3),
           f"metrics_{n // 1000}k_ms": round(big["metrics_ms"], 2),
           f"metrics_{n // 1000}k_bytes": big["metrics_bytes"],
           f"register_{small // 1000}k_s": round(s["register_s"], 3),
           f"metrics_{small // 1000}k_bytes": s["metrics_bytes"],
           f"register_per_instance_{n // 1000}k_vs_{small // 1000}k": round((s["register_s"] / small)
                                                                          / (big["register_s"] / n), 3)}
    if a.baseline_src:
        bn = a.baseline_n
        base = _measure(bn, a.baseline_src)
        mine = _measure(bn)
        out[f"baseline_register_{bn}_s"] = round(base["register_s"], 3)
        out[f"register_{bn}_s"] = round(mine["register_s"], 3)
        out[f"register_{bn}_vs_baseline"] = round(base["register_s"] / mine["register_s"], 2)
        out[f"metrics_bytes_{bn}_vs_baseline"] = round(base["metrics_bytes"] / mine["metrics_bytes"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
