"""Simulator timing vs a real vLLM CPU server on this machine (SmolLM2-135M), side by side in one run.

The simulator's CPU deployment (``smollm2_cpu``) uses the calibration stored in
``dlmix/data/sim_calib_smollm2_vllm_cpu.json``, measured once on one processor (its ``source`` names it). This
benchmark starts one vLLM CPU server (:func:`dlmix.sim.calibrate.start_server`), re-measures prefill TTFT and decode
inter-token latency at a few points with the calibration's own method, runs the simulator on the same points, and
prints predicted vs measured. A ratio near 1 says the stored calibration describes this machine; a different
processor (e.g. AVX2 without AVX-512 BF16) or a loaded machine gives other ratios -- recalibrate with
``python -m dlmix.sim.calibrate`` there. (Timing comparisons live here, not in the test suite: they depend on the
processor and the load.)

    flock /tmp/dlmix-heavy.lock python benchmarks/sim_calibration.py [--quick]

Prints a table, then one JSON line: per point ``predicted_s``, ``measured_s`` and ``predicted_over_measured``;
``max_rel_err`` (max |predicted/measured - 1|), ``within_35pct``, the 1-minute load average before and after, the
core count and whether the processor has AVX-512 BF16.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, Iterable, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOLERANCE = 0.35


def simulate_points(prefill_ns: Iterable[int], decode_pts: Iterable[Tuple[int, int]], tokens: int
                    ) -> Tuple[Dict[int, float], Dict[Tuple[int, int], float]]:
    """Simulator predictions on the calibrated CPU deployment (``smollm2_cpu``).

    Returns ``(ttft, itl)``: ``ttft[N]`` = time to first token (s) of one lone request of N prompt tokens;
    ``itl[(B, N)]`` = median inter-token latency (s) of B simultaneous requests of N prompt tokens generating
    ``tokens`` tokens each.
    """
    from dlmix.sim.simulator import Simulator
    from dlmix.sim.workload import SimRequest

    ttft = {}
    for n in prefill_ns:
        r = Simulator("smollm2_cpu", "smollm2", "round_robin").run([SimRequest(0, 0.0, n, 1, [1, 2, 3, 4])])
        ttft[n] = r.records[0].first_token
    itl = {}
    for b, n in decode_pts:
        reqs = [SimRequest(i, 0.0, n, tokens, [100 + 10 * i + k for k in range(4)]) for i in range(b)]
        r = Simulator("smollm2_cpu", "smollm2", "round_robin").run(reqs)
        itl[(b, n)] = r.summary["itl_ms"]["median"] / 1000.0
    return ttft, itl


def _cpu_flags() -> set:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 prefill and 2 decode points, 2 repeats")
    a = ap.parse_args(argv)
    from dlmix.sim import calibrate

    prefill_ns = (256, 1024) if a.quick else (128, 256, 512, 1024, 1536)
    decode_pts = ((1, 256), (4, 256)) if a.quick else ((1, 256), (4, 256), (8, 256), (4, 512))
    reps = 2 if a.quick else 3
    load0 = os.getloadavg()[0]
    with calibrate.start_server() as srv:
        pre = dict(calibrate.measure_prefill(srv.url, "smollm2", prefill_ns, reps=reps, seed=11))
        dec = {(b, s): t for b, s, t in calibrate.measure_decode(srv.url, "smollm2", decode_pts, seed=12)}
    load1 = os.getloadavg()[0]
    ttft, itl = simulate_points(prefill_ns, decode_pts, calibrate.DECODE_TOKENS)
    points = {}
    for n in prefill_ns:
        points[f"ttft_n{n}"] = (ttft[n], pre[n])
    for b, n in decode_pts:
        points[f"itl_b{b}_n{n}"] = (itl[(b, n)], dec[(b, b * (n + calibrate.DECODE_TOKENS // 2))])
    print(f"{'point':<16}{'predicted s':>14}{'measured s':>14}{'pred/meas':>11}")
    out: dict = {"points": {}}
    for k, (p, m) in points.items():
        print(f"{k:<16}{p:>14.4f}{m:>14.4f}{p / m:>11.2f}")
        out["points"][k] = {"predicted_s": round(p, 5), "measured_s": round(m, 5),
                            "predicted_over_measured": round(p / m, 3)}
    err = max(abs(p / m - 1) for p, m in points.values())
    flags = _cpu_flags()
    out.update(max_rel_err=round(err, 3), within_35pct=err <= TOLERANCE, load_avg_1m_before=round(load0, 2),
               load_avg_1m_after=round(load1, 2), cores=os.cpu_count(), avx512_bf16="avx512_bf16" in flags,
               amx="amx_bf16" in flags, quick=a.quick)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
