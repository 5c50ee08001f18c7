"""TTFT of SGLang PD with the dlmix transfer backend vs SGLang's own Mooncake backend over TCP (real SGLang 0.5.23 CPU
servers, SmolLM2, fp32, page 64 on both sides so Mooncake accepts the pair), plus the KV bytes moved.

Two phases one after the other (a phase's servers are stopped before the next): ``dlmix`` and ``mooncake``
(``MC_FORCE_TCP=1``; needs ``mooncake-transfer-engine-non-cuda`` in the SGLang venv). Each request is a fresh random
token-id prompt sent to prefill and decode at once with the same bootstrap room (SGLang's PD protocol) and
``max_new_tokens=1``: TTFT = time until decode answers (prefill compute + KV transfer + first decode step). Medians
per prompt length (128, 512, 1000 tokens). ``ttft_vs_mooncake_<N>`` = Mooncake TTFT / dlmix TTFT (higher is better
for dlmix). ``kv_bytes_<N>``: bytes of one N-token request's KV (layers x K,V x KV heads x head size x 4 B), what
either backend moves.

Usage: ``python benchmarks/pd_sglang.py [--quick]`` (runs the servers with the SGLang venv's python); prints one JSON
object on the last line.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from dlmix_sglang import testing as T

LENGTHS = (128, 512, 1000)


def _pd_once(p: T.SGLangServer, d: T.SGLangServer, ids: list[int]) -> tuple[float, str | None]:
    room = random.getrandbits(62)
    out: dict = {}

    def leg(name, url):
        out[name] = T.generate(url, ids, 1, bootstrap=("127.0.0.1", p.bootstrap_port, room), timeout_s=300)

    t0 = time.perf_counter()
    tp = threading.Thread(target=leg, args=("p", p.url))
    tp.start()
    leg("d", d.url)
    dt = time.perf_counter() - t0
    tp.join()
    st, body = out["d"]
    return dt, None if st == 200 else f"{st}: {str(body)[:300]}"


def _phase(backend: str, model: str, work: Path, reps: int, rng: random.Random, vocab: int) -> dict:
    env = {"DLMIX_SGLANG_CPU_AIDS": "1"}  # Mooncake's sender on a CPU-only host (dlmix_sglang._cpu_aids)
    p = T.start_server(model, T.free_port(), work / f"{backend}-P.log", mode="prefill", backend=backend,
                       page_size=64, env=env)
    d = T.start_server(model, T.free_port(), work / f"{backend}-D.log", mode="decode", backend=backend, page_size=64,
                       env=env)
    res: dict = {"ttft_s": {}, "errors": []}
    try:
        p.wait_ready()
        d.wait_ready()
        _pd_once(p, d, [rng.randrange(100, vocab) for _ in range(32)])  # warm-up
        for n in LENGTHS:
            times = []
            for _ in range(reps):
                dt, err = _pd_once(p, d, [rng.randrange(100, vocab) for _ in range(n)])
                if err:
                    res["errors"].append(err)
                else:
                    times.append(dt)
            res["ttft_s"][str(n)] = statistics.median(times) if times else None
    except RuntimeError as e:
        res["errors"].append(str(e)[-1500:])
    finally:
        p.stop()
        d.stop()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 requests per length instead of 8")
    args = ap.parse_args()
    if T.sglang_python() is None:
        print(json.dumps({"skipped": "no SGLang venv (scripts/setup_sglang.sh)"}))
        return
    from dlmix.models import prepare

    model = str(prepare("smollm2"))
    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    per_token = cfg["num_hidden_layers"] * 2 * heads * head * 4
    reps = 3 if args.quick else 8
    work = Path(tempfile.mkdtemp(prefix="pd_sglang-"))
    per = {b: _phase(b, model, work, reps, random.Random(7), int(cfg["vocab_size"])) for b in ("dlmix", "mooncake")}
    res: dict = {"reps": reps, "page_size": 64, "dtype": "fp32"}
    for n in LENGTHS:
        k = str(n)
        dl, mc = per["dlmix"]["ttft_s"].get(k), per["mooncake"]["ttft_s"].get(k)
        res[f"ttft_dlmix_s_{n}"] = dl
        res[f"ttft_mooncake_s_{n}"] = mc
        res[f"ttft_vs_mooncake_{n}"] = (mc / dl) if mc and dl else None
        res[f"kv_bytes_{n}"] = n * per_token
    res["errors"] = {b: per[b]["errors"] for b in per if per[b]["errors"]}
    res["logs"] = str(work)
    sys.stdout.flush()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
