"""Calibration of the simulator's timing against vLLM CPU (SmolLM2-135M): what does not depend on the machine.

The stored fit (``dlmix/data/sim_calib_smollm2_vllm_cpu.json``) has the expected schema, reproduces its own measured
points within the stated error, the fit recovers exact synthetic coefficients, and the simulator consumes the file and
reproduces the fitted formulas end to end. Comparing the simulator with a live vLLM CPU server is a timing measurement
that depends on the processor (the calibration was measured with AVX-512 BF16) and on the load:
``benchmarks/sim_calibration.py --quick`` prints it.
"""
import importlib.util
import json
from importlib import resources
from pathlib import Path

import pytest

from dlmix.sim.calibrate import fit, fit_errors, predict_itl, predict_ttft
from dlmix.sim.timing import LinearTiming

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


def _benchmark():
    """benchmarks/sim_calibration.py as a module (its ``simulate_points`` is the one simulator-side helper)."""
    spec = importlib.util.spec_from_file_location(
        "dlmix_bench_sim_calibration", Path(__file__).resolve().parents[1] / "benchmarks" / "sim_calibration.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_schema():
    d = _profile()
    assert d["name"] == "smollm2_vllm_cpu" and d["source"] and d["measured_at"]
    assert set(d["coefficients"]) == {"c0", "c_tok", "c_quad", "c_seq", "c_ctx", "r0"}
    assert all(isinstance(v, float) and v >= 0 for v in d["coefficients"].values())
    assert d["engine"] == {"block_size": 32, "max_num_batched_tokens": 2048, "max_num_seqs": 64}
    assert len(d["prefill_points"]) >= 3 and len(d["decode_points"]) >= 3
    assert all(len(p) == 2 and p[0] > 0 and p[1] > 0 for p in d["prefill_points"])
    assert all(len(p) == 3 and p[0] >= 1 and p[1] >= p[0] and p[2] > 0 for p in d["decode_points"])
    assert {"max_rel_err", "mean_rel_err", "method"} <= set(d["fit"])


def test_simulator_consumes_the_profile():
    d = _profile()
    t = LinearTiming.load("smollm2_vllm_cpu")
    assert (t.c0, t.c_tok, t.c_quad, t.c_seq, t.c_ctx, t.r0) == tuple(
        d["coefficients"][k] for k in ("c0", "c_tok", "c_quad", "c_seq", "c_ctx", "r0"))
    assert t.name == d["name"] and t.source == d["source"]


def test_simulator_reproduces_calibrated_formulas():
    d = _profile()
    c = d["coefficients"]
    ttft, itl = _benchmark().simulate_points([256, 1024], [(4, 256)], 48)
    for n, t in ttft.items():
        assert t == pytest.approx(predict_ttft(c, n), rel=1e-9)
    # decode iteration of 4 sequences: context grows from 4*257 by 4 per iteration; the median is mid-way
    assert itl[(4, 256)] == pytest.approx(predict_itl(c, 4, 4 * (256 + 24)), rel=0.01)


def test_core_lists_and_cpu_flags(tmp_path):
    from dlmix.net import parse_cpus
    from dlmix.sim.calibrate import _flags_text, cpu_flags

    assert parse_cpus("0") == [0] and parse_cpus("0-1") == [0, 1] and parse_cpus("3, 0-1,1") == [0, 1, 3]
    for bad in ("", "a", "1-", "2-1", "0;1"):
        with pytest.raises(ValueError):
            parse_cpus(bad)
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    fl = cpu_flags(str(info))
    assert fl == {"model": "Some CPU", "avx512f": True, "avx512_bf16": True, "amx": True}
    assert _flags_text(fl) == "AVX-512 BF16, AMX"
    info.write_text("model name\t: Old CPU\nflags\t\t: fpu avx2\n")
    assert _flags_text(cpu_flags(str(info))) == "no AVX-512, no AMX"
    assert _flags_text(cpu_flags(str(tmp_path / "missing"))) == "CPU flags unknown"


@pytest.mark.parametrize("args", [["--out", "/no/such/folder/calib.json"], ["--reps", "0", "--out", "calib.json"]])
def test_calibrate_refuses_an_unwritable_out_or_no_reps_before_measuring(args, tmp_path, monkeypatch):
    """The default ``--out`` is relative to the repository root: from any other folder the profile was measured for
    minutes and then lost to a FileNotFoundError (new-user review). Refused at once now, without starting vLLM."""
    from dlmix.sim import calibrate

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: pytest.fail("measured despite bad arguments"))
    with pytest.raises(SystemExit) as ex:
        calibrate.main(args)
    assert ex.value.code == 2
