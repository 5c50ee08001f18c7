"""TTFT of LMDeploy aggregated vs LMDeploy PD with the DLMix migration backend behind the dlmix router (real LMDeploy
0.18 CPU servers with the CPU aid, SmolLM2), plus the KV bytes moved and the transfer time.

Three deployments, all running at once, each request's prompt sent to every one of them in turn (the order rotated
from one prompt to the next), so load changes and prompt content hit all three alike:

* ``aggregated``: one Hybrid server, bf16, block 64; requests go to it directly;
* ``pd_same``: prefill bf16/block 64 -> decode bf16/block 64 behind the dlmix router (LMDeploy's DistServe flow);
* ``pd_mixed``: prefill bf16/block 16 -> decode fp16/block 64 behind the dlmix router (converted on the way);
* with ``--quant-policy 8`` or ``4``, a fourth, ``pd_quant``: prefill bf16/block 16 -> decode fp16/block 64 with that
  KV quantization (the KV travels as fp32 and is quantized on arrival).

Every prefill computes in bf16 (on a CPU without native fp16 arithmetic an fp16 prefill is several times slower,
which would swamp what PD adds); in DistServe the first token is the prefill's, so the decode's dtype does not enter
the TTFT.

Each request is a fresh prompt of about N tokens (words of random text) sent to ``/v1/completions`` with
``stream=true``, ``max_tokens=2``; TTFT = time until the first streamed text. The decode logs each migration (tokens,
bytes, seconds; ``DLMIX_LMDEPLOY_LOG=INFO``), from which the transfer time of each request is read. Medians per
prompt length N in 128, 512, 1000. Figures: ``ttft_ms_<phase>_<N>``, ``kv_bytes_<N>``, ``transfer_ms_<phase>_<N>`` and
``pd_ttft_overhead_ms_<N>`` = the median over prompts of (PD TTFT (same shapes) - aggregated TTFT of the same prompt -
that request's transfer time), with ``_spread`` (min, max), and ``pd_mixed_ttft_overhead_ms_<N>`` (mixed shapes,
conversion included in the transfer time), measured in the same run
(the cost of the prefill leg's HTTP round trip, the router hop and the decode's migration scheduling; target: at most
10 ms); ``ttft_agg_vs_pd_<phase>_<N>`` = aggregated TTFT / PD TTFT (higher is better for PD). With ``pd_quant``:
``kv_bytes_quant_<N>``, ``pd_quant_ttft_overhead_ms_<N>`` and ``transfer_quant_vs_mixed_<N>`` = the mixed pair's
transfer time / the quantized pair's (both include conversion; higher is better for the quantized pair).

Usage: ``python benchmarks/pd_lmdeploy.py [--quick] [--quant-policy 8|4]`` (LMDeploy runs with the venv of ``scripts/setup_lmdeploy.sh``);
prints one JSON object on the last line.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from dlmix_lmdeploy import testing as T

LENGTHS = (128, 512, 1000)
PHASES = ("aggregated", "pd_same", "pd_mixed")
_MIGRATED = re.compile(r"DLMix: session \S+ migrated (\d+) tokens, (\d+) B in ([0-9.]+) s")
_WORDS = ("river mountain quiet engine market yellow window garden silver theory station winter bridge signal "
          "harvest lantern ocean pocket rhythm castle meadow copper thunder village orbit canvas planet ribbon").split()


def _prompt(tokenizer, n: int, rng: random.Random) -> str:
    ids = tokenizer.encode(" ".join(rng.choice(_WORDS) for _ in range(n)), add_special_tokens=False)[:n]
    return tokenizer.decode(ids)


def _ttft(url: str, model: str, prompt: str) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                c = json.loads(line[5:]).get("choices") or []
                if c and c[0].get("text"):
                    dt = time.perf_counter() - t0
                    for _ in r:  # drain
                        pass
                    return dt
    raise RuntimeError(f"no text streamed from {url}")


def _deploy(name: str, model: str, work: Path, started: list, routers: list, quant: int = 0
            ) -> tuple[str, object]:
    """Start deployment ``name``; returns ``(url to send requests to, decode server or None)``."""
    from dlmix.router.config import RouterConfig
    from dlmix.testing import RouterThread

    if name == "aggregated":
        s = T.start_ready(model, work, started, role="Hybrid", dtype="bfloat16", block_size=64, num_blocks=64)
        return s.url, None
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="cost", model_spec=model))
    routers.append(rt)
    env = {"DLMIX_LMDEPLOY_LOG": "INFO"}
    same = name == "pd_same"
    q = ["--quant-policy", str(quant)] if name == "pd_quant" else []
    servers = [T.start_ready(model, work, started, proxy_url=rt.url, env=env, **kw) for kw in (
        dict(role="Prefill", dtype="bfloat16", block_size=64 if same else 16, num_blocks=64 if same else 256),
        dict(role="Decode", dtype="bfloat16" if same else "float16", block_size=64, num_blocks=64, extra=q))]
    deadline = time.monotonic() + 60
    while len(rt.call(lambda: list(rt.router.registry.backends))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    return rt.url, servers[1]


def _migrations(decode) -> list:
    return _MIGRATED.findall(decode.log_path.read_text(errors="replace"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 requests per length (default 7)")
    ap.add_argument("--quant-policy", type=int, choices=(0, 4, 8), default=0,
                    help="also run pd_quant: a decode with this LMDeploy KV quantization")
    args = ap.parse_args()
    phases = PHASES + (("pd_quant",) if args.quant_policy else ())
    if T.lmdeploy_python() is None:
        sys.exit("no LMDeploy venv: run scripts/setup_lmdeploy.sh")
    from transformers import AutoTokenizer

    from dlmix.models import prepare

    model = str(prepare("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    reps = 3 if args.quick else 7
    rng = random.Random(0)
    ttft: dict = {name: {n: [] for n in LENGTHS} for name in phases}
    moved: dict = {name: {n: [] for n in LENGTHS} for name in phases[1:]}
    started, routers = [], []
    with tempfile.TemporaryDirectory(prefix="pd_lmdeploy_") as work:
        try:
            deps = {name: _deploy(name, model, Path(work), started, routers, args.quant_policy) for name in phases}
            for url, _ in deps.values():
                _ttft(url, model, _prompt(tokenizer, 32, rng))  # warm-up (and the pair handshake)
            for n in LENGTHS:
                for rep in range(reps):
                    prompt = _prompt(tokenizer, n, rng)
                    k = rep % len(phases)
                    order = phases[k:] + phases[:k]  # each deployment first as often as the others
                    for name in order:
                        url, decode = deps[name]
                        seen = len(_migrations(decode)) if decode else 0
                        ttft[name][n].append(_ttft(url, model, prompt))
                        if decode:
                            deadline = time.monotonic() + 10
                            while len(_migrations(decode)) == seen and time.monotonic() < deadline:
                                time.sleep(0.05)
                            got = _migrations(decode)[seen:]
                            if len(got) != 1:
                                raise RuntimeError(f"{name}: {len(got)} migrations logged for one request")
                            moved[name][n].append((float(got[0][2]), int(got[0][1])))
                print(f"{n} tokens:", {k: [round(x * 1e3) for x in ttft[k][n]] for k in phases}, flush=True)
        finally:
            for s in reversed(started):
                s.stop()
            for rt in routers:
                rt.close()
    med = statistics.median
    fig: dict = {"reps": reps, "quant_policy": args.quant_policy}
    for n in LENGTHS:
        for name in phases:
            fig[f"ttft_ms_{name}_{n}"] = round(med(ttft[name][n]) * 1e3, 1)
            if name != "aggregated":
                fig[f"transfer_ms_{name}_{n}"] = round(med(t for t, _ in moved[name][n]) * 1e3, 2)
        fig[f"kv_bytes_{n}"] = med(b for _, b in moved["pd_same"][n])
        pairs = [("pd_same", "pd_ttft_overhead_ms"), ("pd_mixed", "pd_mixed_ttft_overhead_ms")]
        if args.quant_policy:
            pairs.append(("pd_quant", "pd_quant_ttft_overhead_ms"))
            fig[f"kv_bytes_quant_{n}"] = med(b for _, b in moved["pd_quant"][n])
            fig[f"transfer_quant_vs_mixed_{n}"] = round(med(t for t, _ in moved["pd_mixed"][n])
                                                        / med(t for t, _ in moved["pd_quant"][n]), 3)
        for name, key in pairs:
            paired = [pd - agg - t for pd, agg, (t, _) in zip(ttft[name][n], ttft["aggregated"][n], moved[name][n])]
            fig[f"{key}_{n}"] = round(med(paired) * 1e3, 1)
            fig[f"{key}_{n}_spread"] = [round(min(paired) * 1e3, 1), round(max(paired) * 1e3, 1)]
            fig[f"ttft_agg_vs_{name}_{n}"] = round(med(ttft["aggregated"][n]) / med(ttft[name][n]), 3)
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
