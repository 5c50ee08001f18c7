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
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from typing import Dict, List, Sequence, Tuple

import numpy as np

PREFILL_NS = (32, 128, 256, 512, 768, 1024, 1536, 1920)
DECODE_BS = ((1, 64), (2, 64), (4, 64), (8, 64), (1, 1024), (4, 512), (8, 256))
DECODE_TOKENS = 48
SERVER_ARGS = ["--max-num-batched-tokens", "2048", "--no-enable-prefix-caching", "--max-num-seqs", "64"]
BLOCK_SIZE = 32


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
        for line in r.iter_lines():
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


def start_server(block_size: int = BLOCK_SIZE):
    """Start one SmolLM2 vLLM CPU server (context manager :class:`dlmix.engine_process.EngineProcess`)."""
    from dlmix import models
    from dlmix.engine_process import EngineProcess, VLLMServerSpec, free_port

    spec = VLLMServerSpec(model=str(models.prepare("smollm2")), port=free_port(), block_size=block_size,
                          max_model_len=2048, served_model_name="smollm2", kv_cache_bytes=256 * 1024 * 1024,
                          extra_args=list(SERVER_ARGS))
    return EngineProcess(spec, name="calib")


def main(argv=None) -> int:
    """Measure, fit, write the calibration JSON (see module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="dlmix/data/sim_calib_smollm2_vllm_cpu.json")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    load = os.getloadavg()[0]
    with start_server() as srv:
        pre = measure_prefill(srv.url, "smollm2", PREFILL_NS, a.reps)
        dec = measure_decode(srv.url, "smollm2", DECODE_BS)
    c = fit(pre, dec)
    doc = {"name": "smollm2_vllm_cpu",
           "source": "measured with dlmix.sim.calibrate: vllm-cpu 0.32.0, SmolLM2-135M-Instruct bf16, 2-core x86 "
                     "(AVX-512 BF16, no AMX), --enforce-eager, prefix caching off, "
                     + " ".join(SERVER_ARGS) + f", block size {BLOCK_SIZE}; one server; 1-min load average {load:.1f} "
                     "at the start",
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "engine": {"block_size": BLOCK_SIZE, "max_num_batched_tokens": 2048, "max_num_seqs": 64},
           "coefficients": c, "prefill_points": pre, "decode_points": dec,
           "fit": dict(fit_errors(c, pre, dec), method="relative-error least squares, non-negative slopes")}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
