"""TTFT of aggregated vLLM vs PD with DLMixConnector vs PD with vLLM's NixlConnector (real vLLM CPU, SmolLM2),
plus bytes moved, transfer time and the decode-side staging peak.

One run, three phases on the same machine one after the other (servers of a phase are stopped before the next):
  aggregated: one plain server (bf16, block 128, core 1);
  dlmix:      P (kv_producer, core 0) + D (kv_consumer, core 1), DLMixConnector over the built-in TCP transport;
  nixl:       P + D with NixlConnector (kv_buffer_device cpu, UCX over loopback; needs ``pip install nixl``).
Every request uses a fresh random prompt (no prefix-cache hits). TTFT = time until the first streamed token
(PD: prefill request with max_tokens=1, then the decode stream's first token). The median over the repetitions is
reported per prompt length (128, 512, 1000 tokens). ``ttft_vs_nixl_<N>`` = NIXL TTFT / DLMix TTFT (higher is better
for DLMix); ``ttft_vs_agg_<N>`` = aggregated TTFT / DLMix TTFT.

Staging: ``peak_staging_mib_<N>`` is the largest staging round the decode side used for an N-token transfer with the
default 64 MiB bound, measured with two in-process transport endpoints over TCP holding SmolLM2-shaped vLLM-CPU caches
(bf16, block 128); the 1,000-token figure is also measured on the real servers (``dlmix_peak_staging_mib_1000_e2e``).

Usage: ``python benchmarks/pd_vllm.py [--quick]``; prints one JSON object on the last line.
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
from pathlib import Path

import httpx

from dlmix.net import iter_sse_lines
from dlmix_vllm import testing as T

LENGTHS = (128, 512, 1000)
_WORDS = T.PROSE_WORDS[:28]
#: the servers' model and KV cache dtype (the figures above are for bf16; the test launcher's default is fp32)
DTYPE = "bfloat16"


def _prompt(tok, rng: random.Random, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tok(" " + " ".join(rng.choice(_WORDS) for _ in range(200)), add_special_tokens=False).input_ids
    return ids[:n]


def _ttft_stream(client: httpx.Client, url: str, prompt: list[int], ktp: dict | None) -> tuple[float, dict | None]:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    if ktp is not None:
        body["kv_transfer_params"] = ktp
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in iter_sse_lines(r):
            if line.startswith("data: ") and line[6:] != "[DONE]" and first is None:
                ev = json.loads(line[6:])
                if any((c.get("text") or "") for c in ev.get("choices") or []):
                    first = time.perf_counter() - t0
    return (first if first is not None else time.perf_counter() - t0), None


def _prefill(client: httpx.Client, url: str, prompt: list[int]) -> tuple[float, dict]:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"prefill HTTP {r.status_code}: {r.text[:300]}")
    return time.perf_counter() - t0, r.json()["kv_transfer_params"]


def run_phase(name: str, model: str, wd: Path, tok, reps: int, rng: random.Random, transport: str = "tcp") -> dict:
    stats_dir = wd / f"stats-{name}"
    servers = []
    if name == "aggregated":
        servers = [T.launch("agg", model, wd, role=None, cpu="1", dtype=DTYPE)]
    elif name == "dlmix":
        servers = [T.launch("dlmix-P", model, wd, role="kv_producer", cpu="0", dtype=DTYPE,
                            extra={"transport": transport}),
                   T.launch("dlmix-D", model, wd, role="kv_consumer", cpu="1", dtype=DTYPE,
                            extra={"stats_dir": str(stats_dir), "transport": transport})]
    else:
        env_p = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(T.free_port()),
                 "UCX_NET_DEVICES": "lo", "UCX_TLS": "sm,self,tcp"}
        env_d = dict(env_p, VLLM_NIXL_SIDE_CHANNEL_PORT=str(T.free_port()))
        servers = [T.launch("nixl-P", model, wd, role="kv_producer", cpu="0", dtype=DTYPE, connector="NixlConnector",
                            env=env_p, extra={"kv_lease_duration": 300}),
                   T.launch("nixl-D", model, wd, role="kv_consumer", cpu="1", dtype=DTYPE, connector="NixlConnector",
                            env=env_d, extra={"kv_lease_duration": 300})]
    out: dict = {"ttft_s": {}, "errors": []}
    try:
        T.wait_ready(servers, timeout_s=400)
        with httpx.Client(timeout=300) as c:
            for warm in range(2):  # warm-up (NIXL handshake, allocator)
                p = _prompt(tok, rng, 64)
                if name == "aggregated":
                    _ttft_stream(c, servers[0].url, p, None)
                else:
                    _, ktp = _prefill(c, servers[0].url, p)
                    _ttft_stream(c, servers[1].url, p, ktp)
            for n in LENGTHS:
                vals = []
                for _ in range(reps):
                    p = _prompt(tok, rng, n)
                    if name == "aggregated":
                        t, _ = _ttft_stream(c, servers[0].url, p, None)
                    else:
                        tp, ktp = _prefill(c, servers[0].url, p)
                        td, _ = _ttft_stream(c, servers[1].url, p, ktp)
                        t = tp + td
                        out.setdefault("blocks", {}).setdefault(str(n), len(ktp.get("remote_block_ids") or [[]])
                                                                if name == "dlmix"
                                                                else len((ktp.get("remote_block_ids") or [[]])[0]))
                    vals.append(t)
                out["ttft_s"][str(n)] = statistics.median(vals)
        if name == "dlmix":
            recs = []
            for f in stats_dir.glob("*.jsonl"):
                recs += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            by_n: dict[str, list] = {}
            for r in recs:
                by_n.setdefault(str(r["end"] - r["start"]), []).append(r)
            out["transfers"] = {n: {"bytes": statistics.median(x["bytes_received"] for x in v),
                                    "transfer_s": statistics.median(x["transfer_s"] for x in v),
                                    "peak_staging_bytes": max(x["peak_staging_bytes"] for x in v)}
                                for n, v in by_n.items() if n in {str(k) for k in LENGTHS}}
        if name == "nixl":
            text = servers[1].log.read_text(errors="replace")
            out["nixl_metrics_lines"] = re.findall(r"KV Transfer metrics: (.*)", text)[-3:]
    except Exception as e:
        out["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        for s in servers:
            s.stop()
    return out


def staging_peaks(lengths=(1000, 8000)) -> dict:
    """Peak staging bytes (and transfer time) of N-token pulls between two in-process endpoints (SmolLM2 shape)."""
    import torch

    from dlmix.kv import KVLayout, ModelIdentity
    from dlmix.kv.ops import pack
    from dlmix_vllm.transfer import KVEndpoint

    ident = ModelIdentity("LlamaForCausalLM", 30, 3, 64, "gqa", weights_fingerprint="sha256:x")
    lay = KVLayout(model=ident, block_size=128, dtype="bf16", arrangement="vllm_cpu")
    nb = 8000 // 128 + 2
    src = [torch.randn(lay.layer_shape(nb)).to(torch.bfloat16) for _ in range(30)]
    dst = [torch.zeros(lay.layer_shape(nb), dtype=torch.bfloat16) for _ in range(30)]
    p = KVEndpoint("tcp", "bench-p", "bench", "127.0.0.1", 0, lay, src, 0)
    d = KVEndpoint("tcp", "bench-d", "bench", "127.0.0.1", 0, lay, dst, 64 << 20)
    out = {}
    try:
        for n in lengths:
            blocks = list(range((n + 127) // 128))
            p.add_hold(f"r{n}", blocks, n)
            res = d.pull(p.descriptor(), f"r{n}", blocks, 0, n, blocks)
            if res.error:
                raise RuntimeError(res.error)
            out[n] = {"peak_staging_mib": res.peak_staging_bytes / 2**20, "bytes": res.bytes_received,
                      "transfer_s": res.seconds, "rounds": res.rounds}
            out[n]["exact"] = bool(torch.equal(pack(lay, src, blocks, lay, 0, n), pack(lay, dst, blocks, lay, 0, n)))
    finally:
        p.close()
        d.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 repetitions per length instead of 5")
    ap.add_argument("--skip-nixl", action="store_true")
    ap.add_argument("--dlmix-transport", default="tcp", help="dlmix_kv_connectors kind for DLMixConnector (tcp, shm)")
    args = ap.parse_args()
    reps = 2 if args.quick else 5

    from transformers import AutoTokenizer

    from dlmix.models import prepare

    model = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    wd = Path(tempfile.mkdtemp(prefix="pd_vllm-"))
    res: dict = {"bench": "pd_vllm", "reps": reps, "lengths": list(LENGTHS), "dlmix_transport": args.dlmix_transport}
    phases = ["aggregated", "dlmix"] + ([] if args.skip_nixl else ["nixl"])
    per = {}
    for ph in phases:
        t0 = time.time()
        per[ph] = run_phase(ph, model, wd, tok, reps, rng, args.dlmix_transport)
        print(f"[pd_vllm] {ph}: {json.dumps(per[ph])} ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    for n in LENGTHS:
        k = str(n)
        dl = per["dlmix"]["ttft_s"].get(k)
        ag = per["aggregated"]["ttft_s"].get(k)
        nx = per.get("nixl", {}).get("ttft_s", {}).get(k)
        res[f"ttft_agg_s_{n}"] = ag
        res[f"ttft_dlmix_s_{n}"] = dl
        res[f"ttft_nixl_s_{n}"] = nx
        res[f"ttft_vs_agg_{n}"] = (ag / dl) if ag and dl else None
        res[f"ttft_vs_nixl_{n}"] = (nx / dl) if nx and dl else None
        tr = per["dlmix"].get("transfers", {}).get(k)
        if tr:
            res[f"dlmix_bytes_{n}"] = tr["bytes"]
            res[f"dlmix_transfer_s_{n}"] = tr["transfer_s"]
        nb = per.get("nixl", {}).get("blocks", {}).get(k)
        if nb:
            res[f"nixl_bytes_{n}"] = nb * 30 * 3 * 128 * 2 * 64 * 2
    e2e = per["dlmix"].get("transfers", {}).get("1000")
    if e2e:
        res["dlmix_peak_staging_mib_1000_e2e"] = e2e["peak_staging_bytes"] / 2**20
    for n, v in staging_peaks().items():
        res[f"peak_staging_mib_{n}"] = round(v["peak_staging_mib"], 3)
        res[f"staging_transfer_s_{n}"] = round(v["transfer_s"], 4)
        res[f"staging_exact_{n}"] = v["exact"]
    res["errors"] = {ph: per[ph]["errors"] for ph in phases if per[ph]["errors"]}
    res["nixl_metrics"] = per.get("nixl", {}).get("nixl_metrics_lines")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
